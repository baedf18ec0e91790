// all_reduce of sparse COO tensors (SUM), as gloo serves it: DDP's gradients of
// nn.Embedding(sparse=True) and dist.all_reduce on a sparse tensor. Two collectives on the
// worker: every rank's shape and non-zero count (the caller waits for it), then every rank's
// indices and values, padded to the largest count, gathered in one all-gather; the sum is the
// coalesced union, written into the caller's tensor. CUDA sparse tensors go through host memory
// and the call returns once the result is back on the caller's current stream.
#include <ATen/ATen.h>

#include "moelink/backend/tensor_checks.h"
#include "moelink/backend/work.h"
#include "moelink/backend/ep_backend.h"
#include "moelink/collective/algorithms.h"

namespace moelink::backend {

namespace {

// What every rank tells the others: [nnz, sparse_dim, dense_dim, dtype, sizes...].
at::Tensor describe(const at::Tensor& c) {
  std::vector<int64_t> m{c._nnz(), c.sparse_dim(), c.dense_dim(), static_cast<int64_t>(c.scalar_type())};
  for (int64_t s : c.sizes()) m.push_back(s);
  return at::tensor(m, at::kLong);
}

int64_t roundUp8(int64_t n) { return (n + 7) / 8 * 8; }

std::string listOf(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.numel(); ++i) s += (i ? ", " : "") + std::to_string(t[i].item<int64_t>());
  return s + "]";
}

}  // namespace

c10::intrusive_ptr<c10d::Work> EpBackend::allreduceSparse(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "moelink allreduce: expects exactly one tensor, got ", tensors.size());
  at::Tensor target = tensors[0];
  TORCH_CHECK_VALUE(target.layout() == at::kSparse,
                    "moelink allreduce: of the sparse layouts only COO is supported, got ", target.layout());
  TORCH_CHECK_VALUE(opts.reduceOp == c10d::ReduceOp::SUM,
                    "moelink allreduce: sparse tensors can only be summed (ReduceOp.SUM), as with gloo");
  TORCH_CHECK_VALUE(target.device().is_cpu() || target.device().is_cuda(), "moelink allreduce: sparse tensor on ",
                    target.device(), "; only CPU and CUDA are supported");
  const bool on_cuda = target.is_cuda();
  const auto timeout = timeoutOf(opts.timeout);
  const auto data = [](const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); };

  at::Tensor mine = target.detach().to(at::kCPU).coalesce();
  const int64_t nnz = mine._nnz(), sparse_dim = mine.sparse_dim();

  // 1. Shapes and counts. Ranks whose tensors differ in dimension count fail here with the
  //    usual "rank r sent n bytes" mismatch; other disagreements are named below.
  at::Tensor meta = describe(mine);
  at::Tensor metas = at::empty({meta.numel() * size_}, at::kLong);
  auto mw = c10::make_intrusive<EpWork>(rank_, c10d::OpType::ALLREDUCE, "ep:all_reduce(sparse, sizes)",
                                        std::vector<at::Tensor>{});
  mw->setGroupSize(size_);
  mw->keep(meta);
  mw->keep(metas);
  submitToWorker(worker(), mw, [=](const collective::AlgoContext& c) {
    return collective::allgatherOp(c, data(meta), data(metas), nbytes(meta));
  }, timeout)->wait();
  const int64_t width = meta.numel();
  std::vector<int64_t> counts(size_);
  int64_t most = 0;
  for (int r = 0; r < size_; ++r) {
    at::Tensor theirs = metas.narrow(0, r * width, width);
    TORCH_CHECK_VALUE(at::equal(theirs.narrow(0, 1, width - 1), meta.narrow(0, 1, width - 1)),
                      "moelink allreduce: rank ", r, "'s sparse tensor differs from this rank's in size, dtype or "
                      "number of sparse/dense dimensions (", listOf(theirs), " against ", listOf(meta),
                      "; [nnz, sparse_dim, dense_dim, dtype, sizes...])");
    counts[r] = theirs[0].item<int64_t>();
    most = std::max(most, counts[r]);
  }

  // 2. Every rank's indices [sparse_dim, most] (int64) then values [most, dense...], zero-padded,
  //    in one block of `block` bytes (a multiple of 8, so each rank's indices stay aligned).
  std::vector<int64_t> value_shape{most};
  for (int64_t d = sparse_dim; d < mine.dim(); ++d) value_shape.push_back(mine.size(d));
  at::Tensor idx = at::zeros({sparse_dim, most}, at::kLong);
  at::Tensor val = at::zeros(value_shape, mine.values().options());
  idx.narrow(1, 0, nnz).copy_(mine.indices());
  val.narrow(0, 0, nnz).copy_(mine.values());
  const int64_t idx_bytes = sparse_dim * most * 8, val_bytes = val.numel() * val.element_size();
  const int64_t block = roundUp8(idx_bytes + val_bytes);
  at::Tensor send = at::zeros({block}, at::kByte);
  send.narrow(0, 0, idx_bytes).copy_(idx.view({-1}).view(at::kByte));
  send.narrow(0, idx_bytes, val_bytes).copy_(val.view({-1}).view(at::kByte));
  at::Tensor recv = at::empty({block * size_}, at::kByte);

  auto w = c10::make_intrusive<EpWork>(rank_, c10d::OpType::ALLREDUCE, "ep:all_reduce(sparse)",
                                       std::vector<at::Tensor>{target});
  w->setGroupSize(size_);
  w->keep(send);
  w->keep(recv);
  const std::vector<int64_t> sizes = mine.sizes().vec();
  const int size = size_;
  auto sum = std::make_shared<at::Tensor>();
  w->onSuccess([=] {
    std::vector<at::Tensor> all_idx, all_val;
    for (int r = 0; r < size; ++r) {
      at::Tensor b = recv.narrow(0, r * block, block);
      all_idx.push_back(b.narrow(0, 0, idx_bytes).view(at::kLong).view({sparse_dim, most}).narrow(1, 0, counts[r]));
      all_val.push_back(
          b.narrow(0, idx_bytes, val_bytes).view(val.scalar_type()).view(value_shape).narrow(0, 0, counts[r]));
    }
    *sum = at::sparse_coo_tensor(at::cat(all_idx, 1), at::cat(all_val, 0), sizes).coalesce();
    if (!on_cuda) target.copy_(*sum);
  });
  auto work = submitToWorker(worker(), w, [=](const collective::AlgoContext& c) {
    return collective::allgatherOp(c, data(send), data(recv), nbytes(send));
  }, timeout);
  if (!on_cuda) return work;
  work->wait();  // the sum is on the host; bring it to the caller's device, on its current stream
  target.copy_(sum->to(target.device()));
  return work;
}

}  // namespace moelink::backend
