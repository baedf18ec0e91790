// The CUDA unit of EpBackend (see cuda_collectives.h): per op, validate, then run it on the
// group's communication stream, in-host as exchange kernels or host-staged through the
// collective worker.
#include "cuda_collectives.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdlib>
#include <optional>

#include <glog/logging.h>

#include "cuda_runtime.h"
#include "ep_work.h"
#include "moelink/backend/ep_backend.h"
#include "moelink/collective/exchange_kernel.h"
#include "moelink/common/error.h"

namespace moelink::backend {

namespace {

using c10d::OpType;
using collective::Exchange;
using Work = CudaCollectives::Work;
using Tensors = CudaCollectives::Tensors;
using TensorLists = CudaCollectives::TensorLists;

constexpr size_t kSlots = 1024;  // ops in flight per group (status and ticket rings)

uint64_t nbytesOf(const at::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }
char* ptr(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

at::Tensor pinnedLike(const at::Tensor& t) {
  return at::empty(t.sizes(), at::TensorOptions().dtype(t.dtype()).pinned_memory(true));
}
Tensors pinnedLike(const Tensors& ts) {
  Tensors out;
  for (const auto& t : ts) out.push_back(pinnedLike(t));
  return out;
}

// Flat, contiguous concatenation of `ts` (made on the current stream).
at::Tensor flatten(const Tensors& ts) {
  std::vector<at::Tensor> flat;
  for (const auto& t : ts) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

// Copies consecutive slices of `flat` into `outs` (on the current stream).
void unflatten(const at::Tensor& flat, Tensors& outs) {
  int64_t off = 0;
  for (auto& o : outs) {
    o.copy_(flat.narrow(0, off, o.numel()).view(o.sizes()));
    off += o.numel();
  }
}

class CudaCollectivesImpl final : public CudaCollectives {
 public:
  explicit CudaCollectivesImpl(EpBackend& b) : b_(b), rank_(b.getRank()), size_(b.getSize()) {}
  ~CudaCollectivesImpl() override;

  std::string path() const override {
    std::lock_guard<std::mutex> g(mu_);
    return device_ < 0 ? "" : staging_ ? "nvlink" : "host";
  }

  Work broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) override;
  Work allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) override;
  Work allreduce_coalesced(Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  Work reduce(Tensors& tensors, const c10d::ReduceOptions& opts) override;
  Work allgather(TensorLists& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) override;
  Work _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override;
  Work allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) override;
  Work gather(TensorLists& outputs, Tensors& inputs, const c10d::GatherOptions& opts) override;
  Work scatter(Tensors& outputs, TensorLists& inputs, const c10d::ScatterOptions& opts) override;
  Work reduce_scatter(Tensors& outputs, TensorLists& inputs, const c10d::ReduceScatterOptions& opts) override;
  Work _reduce_scatter_base(at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  Work reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                       const c10d::ReduceScatterOptions& opts) override;
  Work alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& out_splits,
                     std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& opts) override;
  Work alltoall(Tensors& outputs, Tensors& inputs, const c10d::AllToAllOptions& opts) override;
  Work send(Tensors& tensors, int dst, int tag) override;
  Work recv(Tensors& tensors, int src, int tag) override;
  Work recvAnysource(Tensors& tensors, int tag) override;

 private:
  // An op being put on a stream: begin() orders it after the caller's current stream and
  // makes `stream` current; finish() records its end and hands the work on.
  struct Op {
    c10::intrusive_ptr<CudaWork> work;
    cudaStream_t stream = nullptr;
    bool captured = false;
    size_t slot = 0;
    std::optional<c10::cuda::CUDAStream> cuda_stream;  // current while the op is put on it
  };
  Op begin(OpType type, const char* title, Tensors outputs, int device, bool recv_stream = false);
  Work finish(Op& op, const Tensors& used);
  // Runs `body` as op `op`; on an exception the op is retired before it propagates.
  template <typename Body>
  Work run(Op op, const Tensors& used, Body&& body);
  // Binds the unit to `device` (the first op; collective) and checks later ops' device.
  void bind(int device, const char* opname);
  bool inHost() const { return staging_ != nullptr; }
  void exchange(Op& op, const Exchange& x, const void* in, void* out);
  // The host-staged route: `submit` runs the CPU op on pinned copies; `to_host` pairs
  // (GPU source, pinned copy) are copied before it, `from_host` pairs (GPU destination,
  // pinned source) after it.
  using Pairs = std::vector<std::pair<at::Tensor, at::Tensor>>;
  Work staged(OpType type, const char* title, const char* opname, Tensors outputs, int device, const Pairs& to_host,
              const Pairs& from_host, const std::function<c10::intrusive_ptr<c10d::Work>()>& submit,
              bool recv_stream = false);
  static Pairs pairs(const Tensors& a, const Tensors& b) {
    Pairs p;
    for (size_t i = 0; i < a.size(); ++i) p.emplace_back(a[i], b[i]);
    return p;
  }
  void allreduceFlat(Op& op, const at::Tensor& buf, collective::ReduceOp rop);

  EpBackend& b_;
  const int rank_, size_;
  mutable std::mutex mu_;
  int device_ = -1;
  collective::ExchangeTuning tuning_;
  std::optional<c10::cuda::CUDAStream> comm_, recv_;
  std::unique_ptr<ExchangeStaging> staging_;
  std::unique_ptr<MappedArray<collective::ExchangeStatus>> status_;  // kSlots + a sink for captured ops
  std::unique_ptr<MappedArray<uint32_t>> ready_, done_;
  std::unique_ptr<Completer> completer_;
  uint32_t ticket_ = 0;
};

CudaCollectivesImpl::~CudaCollectivesImpl() {
  if (device_ < 0) return;
  c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device_));
  // Kernels still waiting on peers give up, so that the streams drain.
  if (staging_) staging_->abortWaits(recv_->stream());
  completer_.reset();  // completes what was handed in
  cudaStreamSynchronize(comm_->stream());
  cudaStreamSynchronize(recv_->stream());
  staging_.reset();
}

void CudaCollectivesImpl::bind(int device, const char* opname) {
  std::lock_guard<std::mutex> g(mu_);
  if (device_ >= 0) {
    TORCH_CHECK_VALUE(device == device_, "moelink ", opname, ": this rank's CUDA collectives run on cuda:", device_,
                      " (its first CUDA op used it); got a tensor on cuda:", device);
    return;
  }
  const int current = c10::cuda::current_device();
  TORCH_CHECK_VALUE(device == current, "moelink ", opname, ": got a tensor on cuda:", device, ", but this rank's "
                    "current CUDA device is cuda:", current, "; call torch.cuda.set_device() with the rank's device "
                    "before its first CUDA collective");
  c10::cuda::CUDAGuard dg(static_cast<c10::DeviceIndex>(device));
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream(), &cs);
  TORCH_CHECK_VALUE(cs == cudaStreamCaptureStatusNone, "moelink ", opname, ": the first CUDA op of a group sets up "
                    "its GPU buffers and cannot be captured; run one CUDA collective on this group before capturing");
  try {
    tuning_ = collective::ExchangeTuning::fromEnv();
  } catch (const moelink::Error& e) {
    TORCH_CHECK_VALUE(false, "moelink: ", e.what());
  }
  comm_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, static_cast<c10::DeviceIndex>(device));
  recv_ = c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device));
  status_ = std::make_unique<MappedArray<collective::ExchangeStatus>>(kSlots + 1);
  ready_ = std::make_unique<MappedArray<uint32_t>>(kSlots);
  done_ = std::make_unique<MappedArray<uint32_t>>(kSlots);
  // In-host when every rank is on this host (MOELINK_RANKS_PER_HOST=n declares virtual hosts
  // of n ranks, as for the EP buffer) and every rank maps every peer's staging area.
  // MOELINK_RANKS_PER_HOST: group ranks [0, n), [n, 2n), ... into virtual hosts, so that the
  // host-staged route runs on one machine.
  const char* rph_env = std::getenv("MOELINK_RANKS_PER_HOST");
  const int rph = rph_env && *rph_env ? std::atoi(rph_env) : 0;
  TORCH_CHECK_VALUE(rph >= 0, "moelink: MOELINK_RANKS_PER_HOST must be a positive integer, got ", rph_env);
  bool one_host = size_ <= collective::kExchangeMaxRanks && (rph == 0 || rph >= size_);
  for (int q = 0; q < size_ && one_host; ++q) one_host = b_.hostIdOf(q) == b_.hostIdOf(rank_);
  if (one_host && size_ > 1) {
    std::string why;
    staging_ = ExchangeStaging::open(b_.store(), rank_, size_, device, tuning_, &why);
    if (!staging_) LOG(WARNING) << "moelink: CUDA collectives go through host memory: " << why;
  }
  completer_ = std::make_unique<Completer>(device, kSlots);
  device_ = device;
  VLOG(1) << "moelink: rank " << rank_ << " CUDA collectives on cuda:" << device << " via "
          << (staging_ ? "nvlink" : "host");
}

CudaCollectivesImpl::Op CudaCollectivesImpl::begin(OpType type, const char* title, Tensors outputs, int device,
                                                   bool recv_stream) {
  Op op;
  const auto dev = static_cast<c10::DeviceIndex>(device);
  c10::cuda::CUDAStream user = c10::cuda::getCurrentCUDAStream(dev);
  c10::cuda::CUDAStream s = recv_stream ? *recv_ : *comm_;
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  cudaCheck(cudaStreamIsCapturing(user.stream(), &cs), "cudaStreamIsCapturing");
  op.captured = cs != cudaStreamCaptureStatusNone;
  op.stream = s.stream();
  cudaEvent_t start;
  cudaCheck(cudaEventCreateWithFlags(&start, cudaEventDisableTiming), "cudaEventCreate");
  cudaCheck(cudaEventRecord(start, user.stream()), "cudaEventRecord");
  cudaCheck(cudaStreamWaitEvent(op.stream, start, 0), "cudaStreamWaitEvent");
  cudaEventDestroy(start);
  op.work = c10::make_intrusive<CudaWork>(rank_, type, title, std::move(outputs), device);
  op.work->timeout_ms = static_cast<uint64_t>(b_.timeout().count());
  op.slot = op.captured ? kSlots : completer_->reserve();
  op.cuda_stream = s;
  return op;
}

Work CudaCollectivesImpl::finish(Op& op, const Tensors& used) {
  cudaCheck(cudaEventRecord(op.work->endEvent(), op.stream), "cudaEventRecord");
  for (const auto& t : used)
    if (t.defined() && t.is_cuda() && t.storage().data_ptr().get())
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *op.cuda_stream);
  if (op.captured)
    op.work->completeCaptured();
  else
    completer_->add(op.work);
  return op.work;
}

template <typename Body>
Work CudaCollectivesImpl::run(Op op, const Tensors& used, Body&& body) {
  c10::cuda::CUDAStreamGuard guard(*op.cuda_stream);
  try {
    body(op);
  } catch (...) {
    // Retire the reserved slot (the work completes when what was queued has run).
    op.work->status = nullptr;
    op.work->inner.reset();
    finish(op, used);
    throw;
  }
  return finish(op, used);
}

void CudaCollectivesImpl::exchange(Op& op, const Exchange& x, const void* in, void* out) {
  collective::ExchangeLaunch l;
  collective::describeLaunch(x, rank_, tuning_, l);
  l.in = static_cast<const char*>(in);
  l.out = static_cast<char*>(out);
  for (int q = 0; q < size_; ++q) l.staging[q] = staging_->area(q);
  l.layout = staging_->layout();
  l.timeout_ns = static_cast<uint64_t>(b_.timeout().count()) * 1000000ull;
  l.status = status_->dev(op.slot);
  op.work->status = op.captured ? nullptr : status_->host(op.slot);
  cudaCheck(collective::launchExchange(l, op.stream), "launching the exchange kernel");
}

Work CudaCollectivesImpl::staged(OpType type, const char* title, const char* opname, Tensors outputs, int device,
                                 const Pairs& to_host, const Pairs& from_host,
                                 const std::function<c10::intrusive_ptr<c10d::Work>()>& submit, bool recv_stream) {
  Tensors used;
  for (const auto& p : to_host) used.push_back(p.first);
  for (const auto& p : from_host) used.push_back(p.first);
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  cudaCheck(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream(), &cs),
            "cudaStreamIsCapturing");
  TORCH_CHECK_VALUE(cs == cudaStreamCaptureStatusNone, "moelink ", opname,
                    ": in this group the op runs through host memory (",
                    inHost() ? "point-to-point ops always do" : "its ranks are on several hosts",
                    ") and cannot be captured in a CUDA graph");
  return run(begin(type, title, std::move(outputs), device, recv_stream), used, [&](Op& o) {
    const uint32_t ticket = ++ticket_ ? ticket_ : ++ticket_;  // never 0 (the words start at 0)
    for (const auto& [gpu, host] : to_host) {
      host.copy_(gpu, /*non_blocking=*/true);
      o.work->keep(host);
    }
    StreamMemOps::write(o.stream, ready_->dev(o.slot), ticket);
    c10::intrusive_ptr<c10d::Work> inner;
    {
      uint32_t* word = ready_->host(o.slot);
      ReadyGateScope gate([word, ticket] { return *reinterpret_cast<volatile uint32_t*>(word) == ticket; });
      inner = submit();
    }
    auto ep = c10::dynamic_intrusive_pointer_cast<EpWork>(inner);
    TORCH_INTERNAL_ASSERT(ep, "host-staged op without an EpWork");
    uint32_t* done = done_->host(o.slot);
    ep->getFuture()->addCallback(
        [done, ticket](c10::ivalue::Future&) { *reinterpret_cast<volatile uint32_t*>(done) = ticket; });
    StreamMemOps::wait(o.stream, done_->dev(o.slot), ticket);
    for (const auto& [gpu, host] : from_host) {
      gpu.copy_(host, /*non_blocking=*/true);
      o.work->keep(host);
    }
    o.work->inner = ep;
  });
}

void CudaCollectivesImpl::allreduceFlat(Op& op, const at::Tensor& buf, collective::ReduceOp rop) {
  const auto t = toDType(buf.scalar_type());
  const uint64_t count = static_cast<uint64_t>(buf.numel());
  if (tuning_.oneShot(size_, nbytesOf(buf))) {
    exchange(op, collective::exchangeAllreduceOneShot(size_, rank_, count, t, rop), ptr(buf), ptr(buf));
    return;
  }
  auto blocks = collective::allreduceBlocks(size_, count, t);
  const uint64_t es = collective::elementSize(t);
  exchange(op, collective::exchangeAllreduceScatter(size_, rank_, count, t, rop), ptr(buf),
           ptr(buf) + blocks[rank_].first * es);
  exchange(op, collective::exchangeAllreduceGather(size_, rank_, count, t), ptr(buf), ptr(buf));
}

// ---- the collectives ----

Work CudaCollectivesImpl::broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) {
  checkSingle(tensors, "broadcast");
  checkRoot(opts.rootRank, size_, "broadcast");
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "moelink broadcast: rootTensor must be 0");
  const int dev = tensors[0].get_device();
  bind(dev, "broadcast");
  if (!inHost()) {
    Tensors pin = pinnedLike(tensors);
    auto o = opts;
    return staged(OpType::BROADCAST, "ep:broadcast", "broadcast", tensors, dev, pairs(tensors, pin),
                  pairs(tensors, pin), [&] { return b_.broadcast(pin, o); });
  }
  return run(begin(OpType::BROADCAST, "ep:broadcast", tensors, dev), tensors, [&](Op& op) {
    at::Tensor buf = tensors[0].contiguous();
    exchange(op, collective::exchangeBroadcast(size_, rank_, nbytesOf(buf), static_cast<int>(opts.rootRank)), ptr(buf),
             ptr(buf));
    if (!buf.is_same(tensors[0])) tensors[0].copy_(buf);
  });
}

Work CudaCollectivesImpl::allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) {
  checkSingle(tensors, "allreduce");
  auto rop = toReduceOp(opts.reduceOp, tensors[0].scalar_type(), "allreduce");
  const int dev = tensors[0].get_device();
  bind(dev, "allreduce");
  if (!inHost()) {
    Tensors pin = pinnedLike(tensors);
    auto o = opts;
    return staged(OpType::ALLREDUCE, "ep:all_reduce", "allreduce", tensors, dev, pairs(tensors, pin),
                  pairs(tensors, pin), [&] { return b_.allreduce(pin, o); });
  }
  return run(begin(OpType::ALLREDUCE, "ep:all_reduce", tensors, dev), tensors, [&](Op& op) {
    at::Tensor buf = tensors[0].contiguous();
    allreduceFlat(op, buf, rop);
    if (!buf.is_same(tensors[0])) tensors[0].copy_(buf);
  });
}

Work CudaCollectivesImpl::allreduce_coalesced(Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK_VALUE(!tensors.empty(), "moelink allreduce_coalesced: no tensors");
  for (const auto& t : tensors) {
    checkTensor(t, "allreduce_coalesced");
    checkSameDtype(t, tensors[0], "allreduce_coalesced");
  }
  auto rop = toReduceOp(opts.reduceOp, tensors[0].scalar_type(), "allreduce_coalesced");
  const int dev = tensors[0].get_device();
  bind(dev, "allreduce_coalesced");
  if (!inHost()) {
    Tensors pin = pinnedLike(tensors);
    auto o = opts;
    return staged(OpType::ALLREDUCE_COALESCED, "ep:all_reduce_coalesced", "allreduce_coalesced", tensors, dev,
                  pairs(tensors, pin), pairs(tensors, pin), [&] { return b_.allreduce_coalesced(pin, o); });
  }
  return run(begin(OpType::ALLREDUCE_COALESCED, "ep:all_reduce_coalesced", tensors, dev), tensors, [&](Op& op) {
    at::Tensor flat = flatten(tensors);
    allreduceFlat(op, flat, rop);
    unflatten(flat, tensors);
  });
}

Work CudaCollectivesImpl::reduce(Tensors& tensors, const c10d::ReduceOptions& opts) {
  checkSingle(tensors, "reduce");
  checkRoot(opts.rootRank, size_, "reduce");
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "moelink reduce: rootTensor must be 0");
  auto rop = toReduceOp(opts.reduceOp, tensors[0].scalar_type(), "reduce");
  const int dev = tensors[0].get_device();
  bind(dev, "reduce");
  if (!inHost()) {
    Tensors pin = pinnedLike(tensors);
    auto o = opts;
    return staged(OpType::REDUCE, "ep:reduce", "reduce", tensors, dev, pairs(tensors, pin), pairs(tensors, pin),
                  [&] { return b_.reduce(pin, o); });
  }
  return run(begin(OpType::REDUCE, "ep:reduce", tensors, dev), tensors, [&](Op& op) {
    at::Tensor buf = tensors[0].contiguous();
    exchange(op,
             collective::exchangeReduce(size_, rank_, buf.numel(), toDType(buf.scalar_type()), rop,
                                        static_cast<int>(opts.rootRank)),
             ptr(buf), ptr(buf));
    if (!buf.is_same(tensors[0])) tensors[0].copy_(buf);
  });
}

Work CudaCollectivesImpl::allgather(TensorLists& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) {
  checkSingle(inputs, "allgather");
  TORCH_CHECK_VALUE(outputs.size() == 1, "moelink allgather: expects one output list per process");
  checkList(outputs[0], inputs[0], size_, "allgather", "the output list");
  const int dev = inputs[0].get_device();
  bind(dev, "allgather");
  if (!inHost()) {
    Tensors pin_in = pinnedLike(inputs), pin_out = pinnedLike(outputs[0]);
    TensorLists po{pin_out};
    auto o = opts;
    return staged(OpType::ALLGATHER, "ep:all_gather", "allgather", outputs[0], dev, pairs(inputs, pin_in),
                  pairs(outputs[0], pin_out), [&] { return b_.allgather(po, pin_in, o); });
  }
  Tensors used = inputs;
  used.insert(used.end(), outputs[0].begin(), outputs[0].end());
  return run(begin(OpType::ALLGATHER, "ep:all_gather", outputs[0], dev), used, [&](Op& op) {
    at::Tensor in = inputs[0].contiguous();
    at::Tensor flat = at::empty({in.numel() * size_}, in.options());
    exchange(op, collective::exchangeAllgather(size_, rank_, nbytesOf(in)), ptr(in), ptr(flat));
    unflatten(flat, outputs[0]);
  });
}

Work CudaCollectivesImpl::_allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  const char* name = "all_gather_into_tensor";
  checkTensor(output, name);
  checkTensor(input, name);
  checkSameDtype(output, input, name);
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size_, "moelink ", name, ": output has ", output.numel(),
                    " elements, expected ", input.numel() * size_, " (input ", input.numel(), " x group size ",
                    size_, ")");
  const int dev = input.get_device();
  bind(dev, name);
  if (!inHost()) {
    at::Tensor pi = pinnedLike(input), po = pinnedLike(output);
    auto o = opts;
    return staged(OpType::_ALLGATHER_BASE, "ep:_all_gather_base", name, {output}, dev, {{input, pi}}, {{output, po}},
                  [&] { return b_._allgather_base(po, pi, o); });
  }
  return run(begin(OpType::_ALLGATHER_BASE, "ep:_all_gather_base", {output}, dev), {input, output}, [&](Op& op) {
    at::Tensor in = input.contiguous();
    at::Tensor out = output.is_contiguous() ? output : at::empty_like(output, at::MemoryFormat::Contiguous);
    exchange(op, collective::exchangeAllgather(size_, rank_, nbytesOf(in)), ptr(in), ptr(out));
    if (!out.is_same(output)) output.copy_(out);
  });
}

Work CudaCollectivesImpl::allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  const char* name = "allgather_into_tensor_coalesced";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size() && !inputs.empty(), "moelink ", name,
                    ": needs as many outputs as inputs (", outputs.size(), " vs ", inputs.size(), ")");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], name);
    checkTensor(outputs[i], name);
    checkSameDtype(inputs[i], inputs[0], name);
    checkSameDtype(outputs[i], inputs[0], name);
    TORCH_CHECK_VALUE(outputs[i].numel() == inputs[i].numel() * size_, "moelink ", name, ": output ", i, " has ",
                      outputs[i].numel(), " elements, expected ", inputs[i].numel() * size_);
  }
  const int dev = inputs[0].get_device();
  bind(dev, name);
  if (!inHost()) {
    Tensors pi = pinnedLike(inputs), po = pinnedLike(outputs);
    auto o = opts;
    return staged(OpType::COALESCED, "ep:allgather_into_tensor_coalesced", name, outputs, dev, pairs(inputs, pi),
                  pairs(outputs, po), [&] { return b_.allgather_into_tensor_coalesced(po, pi, o); });
  }
  Tensors used = inputs;
  used.insert(used.end(), outputs.begin(), outputs.end());
  return run(begin(OpType::COALESCED, "ep:allgather_into_tensor_coalesced", outputs, dev), used, [&](Op& op) {
    at::Tensor in = flatten(inputs);
    at::Tensor flat = at::empty({in.numel() * size_}, in.options());
    exchange(op, collective::exchangeAllgather(size_, rank_, nbytesOf(in)), ptr(in), ptr(flat));
    // flat is [rank][input 0 | input 1 | ...]; output i gathers every rank's input i.
    int64_t per_rank = in.numel(), off = 0;
    for (size_t i = 0; i < outputs.size(); ++i) {
      int64_t n = inputs[i].numel();
      outputs[i].copy_(flat.view({size_, per_rank}).narrow(1, off, n).reshape(outputs[i].sizes()));
      off += n;
    }
  });
}

Work CudaCollectivesImpl::gather(TensorLists& outputs, Tensors& inputs, const c10d::GatherOptions& opts) {
  checkSingle(inputs, "gather");
  checkRoot(opts.rootRank, size_, "gather");
  const int root = static_cast<int>(opts.rootRank);
  Tensors outs;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1, "moelink gather: the root needs one output list");
    checkList(outputs[0], inputs[0], size_, "gather", "the root's output list");
    outs = outputs[0];
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                      "moelink gather: only the root (rank ", root, ") takes an output list");
  }
  const int dev = inputs[0].get_device();
  bind(dev, "gather");
  if (!inHost()) {
    Tensors pi = pinnedLike(inputs), po = pinnedLike(outs);
    TensorLists pol;
    if (rank_ == root) pol.push_back(po);
    auto o = opts;
    return staged(OpType::GATHER, "ep:gather", "gather", outs, dev, pairs(inputs, pi), pairs(outs, po),
                  [&] { return b_.gather(pol, pi, o); });
  }
  Tensors used = inputs;
  used.insert(used.end(), outs.begin(), outs.end());
  return run(begin(OpType::GATHER, "ep:gather", outs, dev), used, [&](Op& op) {
    at::Tensor in = inputs[0].contiguous();
    at::Tensor flat = rank_ == root ? at::empty({in.numel() * size_}, in.options()) : at::Tensor();
    exchange(op, collective::exchangeGather(size_, rank_, nbytesOf(in), root), ptr(in),
             flat.defined() ? ptr(flat) : nullptr);
    if (rank_ == root) unflatten(flat, outs);
  });
}

Work CudaCollectivesImpl::scatter(Tensors& outputs, TensorLists& inputs, const c10d::ScatterOptions& opts) {
  checkSingle(outputs, "scatter");
  checkRoot(opts.rootRank, size_, "scatter");
  const int root = static_cast<int>(opts.rootRank);
  Tensors ins;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1, "moelink scatter: the root needs one input list");
    checkList(inputs[0], outputs[0], size_, "scatter", "the root's input list");
    ins = inputs[0];
  } else {
    TORCH_CHECK_VALUE(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                      "moelink scatter: only the root (rank ", root, ") takes an input list");
  }
  const int dev = outputs[0].get_device();
  bind(dev, "scatter");
  if (!inHost()) {
    Tensors pi = pinnedLike(ins), po = pinnedLike(outputs);
    TensorLists pil;
    if (rank_ == root) pil.push_back(pi);
    auto o = opts;
    return staged(OpType::SCATTER, "ep:scatter", "scatter", outputs, dev, pairs(ins, pi), pairs(outputs, po),
                  [&] { return b_.scatter(po, pil, o); });
  }
  Tensors used = outputs;
  used.insert(used.end(), ins.begin(), ins.end());
  return run(begin(OpType::SCATTER, "ep:scatter", outputs, dev), used, [&](Op& op) {
    at::Tensor in = rank_ == root ? flatten(ins) : at::Tensor();
    at::Tensor out = outputs[0].is_contiguous() ? outputs[0] : at::empty_like(outputs[0], at::MemoryFormat::Contiguous);
    exchange(op, collective::exchangeScatter(size_, rank_, nbytesOf(out), root), in.defined() ? ptr(in) : nullptr,
             ptr(out));
    if (!out.is_same(outputs[0])) outputs[0].copy_(out);
  });
}

Work CudaCollectivesImpl::reduce_scatter(Tensors& outputs, TensorLists& inputs,
                                         const c10d::ReduceScatterOptions& opts) {
  checkSingle(outputs, "reduce_scatter");
  TORCH_CHECK_VALUE(inputs.size() == 1, "moelink reduce_scatter: expects one input list per process");
  checkList(inputs[0], outputs[0], size_, "reduce_scatter", "the input list");
  auto rop = toReduceOp(opts.reduceOp, outputs[0].scalar_type(), "reduce_scatter");
  const int dev = outputs[0].get_device();
  bind(dev, "reduce_scatter");
  if (!inHost()) {
    Tensors pi = pinnedLike(inputs[0]), po = pinnedLike(outputs);
    TensorLists pil{pi};
    auto o = opts;
    return staged(OpType::REDUCE_SCATTER, "ep:reduce_scatter", "reduce_scatter", outputs, dev, pairs(inputs[0], pi),
                  pairs(outputs, po), [&] { return b_.reduce_scatter(po, pil, o); });
  }
  Tensors used = outputs;
  used.insert(used.end(), inputs[0].begin(), inputs[0].end());
  return run(begin(OpType::REDUCE_SCATTER, "ep:reduce_scatter", outputs, dev), used, [&](Op& op) {
    at::Tensor in = flatten(inputs[0]);
    at::Tensor out = outputs[0].is_contiguous() ? outputs[0] : at::empty_like(outputs[0], at::MemoryFormat::Contiguous);
    exchange(op, collective::exchangeReduceScatter(size_, rank_, out.numel(), toDType(out.scalar_type()), rop),
             ptr(in), ptr(out));
    if (!out.is_same(outputs[0])) outputs[0].copy_(out);
  });
}

Work CudaCollectivesImpl::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                               const c10d::ReduceScatterOptions& opts) {
  const char* name = "reduce_scatter_tensor";
  checkTensor(output, name);
  checkTensor(input, name);
  checkSameDtype(output, input, name);
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size_, "moelink ", name, ": input has ", input.numel(),
                    " elements, expected ", output.numel() * size_, " (output ", output.numel(), " x group size ",
                    size_, ")");
  auto rop = toReduceOp(opts.reduceOp, output.scalar_type(), name);
  const int dev = input.get_device();
  bind(dev, name);
  if (!inHost()) {
    at::Tensor pi = pinnedLike(input), po = pinnedLike(output);
    auto o = opts;
    return staged(OpType::_REDUCE_SCATTER_BASE, "ep:_reduce_scatter_base", name, {output}, dev, {{input, pi}},
                  {{output, po}}, [&] { return b_._reduce_scatter_base(po, pi, o); });
  }
  return run(begin(OpType::_REDUCE_SCATTER_BASE, "ep:_reduce_scatter_base", {output}, dev), {input, output},
             [&](Op& op) {
               at::Tensor in = input.contiguous();
               at::Tensor out = output.is_contiguous() ? output : at::empty_like(output, at::MemoryFormat::Contiguous);
               exchange(op,
                        collective::exchangeReduceScatter(size_, rank_, out.numel(), toDType(out.scalar_type()), rop),
                        ptr(in), ptr(out));
               if (!out.is_same(output)) output.copy_(out);
             });
}

Work CudaCollectivesImpl::reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                          const c10d::ReduceScatterOptions& opts) {
  const char* name = "reduce_scatter_tensor_coalesced";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size() && !inputs.empty(), "moelink ", name,
                    ": needs as many outputs as inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], name);
    checkTensor(outputs[i], name);
    checkSameDtype(inputs[i], inputs[0], name);
    checkSameDtype(outputs[i], inputs[0], name);
    TORCH_CHECK_VALUE(inputs[i].numel() == outputs[i].numel() * size_, "moelink ", name, ": input ", i, " has ",
                      inputs[i].numel(), " elements, expected ", outputs[i].numel() * size_);
  }
  auto rop = toReduceOp(opts.reduceOp, inputs[0].scalar_type(), name);
  const int dev = inputs[0].get_device();
  bind(dev, name);
  if (!inHost()) {
    Tensors pi = pinnedLike(inputs), po = pinnedLike(outputs);
    auto o = opts;
    return staged(OpType::COALESCED, "ep:reduce_scatter_tensor_coalesced", name, outputs, dev, pairs(inputs, pi),
                  pairs(outputs, po), [&] { return b_.reduce_scatter_tensor_coalesced(po, pi, o); });
  }
  Tensors used = inputs;
  used.insert(used.end(), outputs.begin(), outputs.end());
  return run(begin(OpType::COALESCED, "ep:reduce_scatter_tensor_coalesced", outputs, dev), used, [&](Op& op) {
    // Block layout [rank][output 0 | output 1 | ...] built from each input's rank slices.
    std::vector<at::Tensor> pieces;
    for (int r = 0; r < size_; ++r)
      for (size_t i = 0; i < inputs.size(); ++i) {
        int64_t n = outputs[i].numel();
        pieces.push_back(inputs[i].reshape({-1}).narrow(0, r * n, n));
      }
    at::Tensor in = at::cat(pieces);
    at::Tensor out = at::empty({in.numel() / size_}, in.options());
    exchange(op, collective::exchangeReduceScatter(size_, rank_, out.numel(), toDType(out.scalar_type()), rop),
             ptr(in), ptr(out));
    unflatten(out, outputs);
  });
}

Work CudaCollectivesImpl::alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& out_splits,
                                        std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all_single";
  checkTensor(output, name);
  checkTensor(input, name);
  checkSameDtype(output, input, name);
  std::vector<uint64_t> soff, sb, roff, rb;
  alltoallLayout(input, output, in_splits, out_splits, size_, rank_, soff, sb, roff, rb);
  const int dev = input.get_device();
  bind(dev, name);
  if (!inHost()) {
    at::Tensor pi = pinnedLike(input), po = pinnedLike(output);
    auto o = opts;
    auto os = out_splits, is = in_splits;
    return staged(OpType::ALLTOALL_BASE, "ep:all_to_all", name, {output}, dev, {{input, pi}}, {{output, po}},
                  [&] { return b_.alltoall_base(po, pi, os, is, o); });
  }
  return run(begin(OpType::ALLTOALL_BASE, "ep:all_to_all", {output}, dev), {input, output}, [&](Op& op) {
    at::Tensor in = input.contiguous();
    at::Tensor out = output.is_contiguous() ? output : at::empty_like(output, at::MemoryFormat::Contiguous);
    exchange(op, collective::exchangeAlltoall(size_, rank_, soff, sb, roff, rb), ptr(in), ptr(out));
    if (!out.is_same(output)) output.copy_(out);
  });
}

Work CudaCollectivesImpl::alltoall(Tensors& outputs, Tensors& inputs, const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all";
  TORCH_CHECK_VALUE(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
                    "moelink ", name, ": needs one input and one output tensor per rank (", size_, ")");
  for (int r = 0; r < size_; ++r) {
    checkTensor(inputs[r], name);
    checkTensor(outputs[r], name);
    checkSameDtype(inputs[r], inputs[0], name);
    checkSameDtype(outputs[r], inputs[0], name);
  }
  TORCH_CHECK_VALUE(inputs[rank_].numel() == outputs[rank_].numel(), "moelink ", name,
                    ": this rank's own input and output differ in size");
  const int dev = inputs[0].get_device();
  bind(dev, name);
  if (!inHost()) {
    Tensors pi = pinnedLike(inputs), po = pinnedLike(outputs);
    auto o = opts;
    return staged(OpType::ALLTOALL, "ep:all_to_all", name, outputs, dev, pairs(inputs, pi), pairs(outputs, po),
                  [&] { return b_.alltoall(po, pi, o); });
  }
  std::vector<uint64_t> soff(size_), sb(size_), roff(size_), rb(size_);
  uint64_t so = 0, ro = 0;
  for (int r = 0; r < size_; ++r) {
    sb[r] = nbytesOf(inputs[r]);
    rb[r] = nbytesOf(outputs[r]);
    soff[r] = so;
    roff[r] = ro;
    so += sb[r];
    ro += rb[r];
  }
  Tensors used = inputs;
  used.insert(used.end(), outputs.begin(), outputs.end());
  return run(begin(OpType::ALLTOALL, "ep:all_to_all", outputs, dev), used, [&](Op& op) {
    at::Tensor in = flatten(inputs);
    at::Tensor flat = at::empty({static_cast<int64_t>(ro / inputs[0].element_size())}, inputs[0].options());
    exchange(op, collective::exchangeAlltoall(size_, rank_, soff, sb, roff, rb), ptr(in), ptr(flat));
    unflatten(flat, outputs);
  });
}

// ---- point to point: host-staged in every group ----

Work CudaCollectivesImpl::send(Tensors& tensors, int dst, int tag) {
  checkSingle(tensors, "send");
  const int dev = tensors[0].get_device();
  bind(dev, "send");
  Tensors pin = pinnedLike(tensors);
  return staged(OpType::SEND, "ep:send", "send", tensors, dev, pairs(tensors, pin), {},
                [&] { return b_.send(pin, dst, tag); });
}

Work CudaCollectivesImpl::recv(Tensors& tensors, int src, int tag) {
  checkSingle(tensors, "recv");
  const int dev = tensors[0].get_device();
  bind(dev, "recv");
  Tensors pin = pinnedLike(tensors);
  return staged(OpType::RECV, "ep:recv", "recv", tensors, dev, {}, pairs(tensors, pin),
                [&] { return b_.recv(pin, src, tag); }, /*recv_stream=*/true);
}

Work CudaCollectivesImpl::recvAnysource(Tensors& tensors, int tag) {
  checkSingle(tensors, "recv");
  const int dev = tensors[0].get_device();
  bind(dev, "recv");
  Tensors pin = pinnedLike(tensors);
  return staged(OpType::RECVANYSOURCE, "ep:recvAnySource", "recv", tensors, dev, {}, pairs(tensors, pin),
                [&] { return b_.recvAnysource(pin, tag); }, /*recv_stream=*/true);
}

}  // namespace

std::unique_ptr<CudaCollectives> makeCudaCollectives(EpBackend& backend) {
  return std::make_unique<CudaCollectivesImpl>(backend);
}

}  // namespace moelink::backend
