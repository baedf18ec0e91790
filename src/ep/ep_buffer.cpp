#include "moelink/ep/ep_buffer.h"

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdlib>
#include <thread>
#include <cstring>

#include "moelink/ep/kernels.h"
#include "moelink/transfer/transfer_engine.h"

namespace moelink::ep {

namespace {

void cudaCheck(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "moelink EP buffer: ", what, " failed: ", cudaGetErrorString(e));
}

std::vector<uint8_t> bytesOf(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

struct EpBuffer::Launch {
  kernels::Common c;
};

int64_t EpBuffer::sizeHint(int64_t num_ranks, int64_t max_tokens, int64_t hidden, int64_t num_experts) {
  return static_cast<int64_t>(EpLayout::make(static_cast<int>(num_ranks), static_cast<int>(num_experts),
                                             static_cast<int>(max_tokens), static_cast<int>(hidden))
                                  .totalBytes());
}

EpBuffer::EpBuffer(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, const std::string& key,
                   int64_t max_tokens, int64_t hidden, int64_t num_experts)
    : rank_(rank), size_(size) {
  try {
    layout_ = EpLayout::make(size, static_cast<int>(num_experts), static_cast<int>(max_tokens),
                             static_cast<int>(hidden));
  } catch (const std::exception& e) {
    TORCH_CHECK_VALUE(false, "moelink Buffer: ", e.what());
  }
  // MOELINK_EP_TIMEOUT_US: how long a receiver waits for a source before masking it out
  // when the call passes timeout_us=-1 (default 30 s; 0 waits without limit).
  const char* env = std::getenv("MOELINK_EP_TIMEOUT_US");
  default_timeout_us_ = env && *env ? std::atoll(env) : 30000000;
  cudaCheck(cudaGetDevice(&device_), "cudaGetDevice");
  cudaCheck(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_), "SM count");
  cudaCheck(cudaMalloc(&buffer_, layout_.totalBytes()), "cudaMalloc(buffer)");
  cudaCheck(cudaMemset(buffer_, 0, layout_.totalBytes()), "cudaMemset(buffer)");
  int scratch = kernels::scratchInts(layout_);
  cudaCheck(cudaMalloc(&scratch_, scratch * sizeof(int)), "cudaMalloc(scratch)");
  cudaCheck(cudaMemset(scratch_, 0, scratch * sizeof(int)), "cudaMemset(scratch)");

  // Exchange CUDA IPC handles and host ids through the group's store.
  cudaIpcMemHandle_t handle;
  cudaCheck(cudaIpcGetMemHandle(&handle, buffer_), "cudaIpcGetMemHandle");
  std::string mine(reinterpret_cast<const char*>(&handle), sizeof handle);
  std::string host = transfer::localHostId();
  store->set(key + "/ipc/" + std::to_string(rank), bytesOf(mine));
  store->set(key + "/host/" + std::to_string(rank), bytesOf(host));
  peers_.assign(size, nullptr);
  transports_.assign(size, "");
  for (int r = 0; r < size; ++r) {
    if (r == rank) {
      peers_[r] = buffer_;
      transports_[r] = "local";
      continue;
    }
    auto h = store->get(key + "/host/" + std::to_string(r));
    std::string peer_host(h.begin(), h.end());
    TORCH_CHECK(peer_host == host, "moelink Buffer: rank ", r, " is on another host (", peer_host,
                "); the cross-host paths (IBGDA, CPU proxy) are not part of this build, only NVLink within a host");
    auto b = store->get(key + "/ipc/" + std::to_string(r));
    TORCH_CHECK(b.size() == sizeof(cudaIpcMemHandle_t), "moelink Buffer: bad IPC handle from rank ", r);
    cudaIpcMemHandle_t ph;
    std::memcpy(&ph, b.data(), sizeof ph);
    void* p = nullptr;
    cudaCheck(cudaIpcOpenMemHandle(&p, ph, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
    peers_[r] = static_cast<char*>(p);
    transports_[r] = "nvlink";
  }
  cudaCheck(cudaMalloc(&peers_dev_, size * sizeof(char*)), "cudaMalloc(peers)");
  cudaCheck(cudaMemcpy(peers_dev_, peers_.data(), size * sizeof(char*), cudaMemcpyHostToDevice), "peers copy");
  active_ = at::ones({size}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device_));
  cudaCheck(cudaDeviceSynchronize(), "buffer setup");
  // Every rank has mapped every peer before anyone writes (the store doubles as barrier).
  store->add(key + "/mapped", 1);
  auto deadline = std::chrono::steady_clock::now() + store->getTimeout();
  while (store->add(key + "/mapped", 0) < size) {
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline,
                "moelink Buffer: timed out waiting for every rank to create its buffer (a collective call)");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

EpBuffer::~EpBuffer() {
  cudaDeviceSynchronize();
  for (int r = 0; r < size_; ++r)
    if (r != rank_ && peers_[r]) cudaIpcCloseMemHandle(peers_[r]);
  cudaFree(peers_dev_);
  cudaFree(scratch_);
  cudaFree(buffer_);
}

std::string EpBuffer::transportOf(int rank) const {
  TORCH_CHECK_VALUE(rank >= 0 && rank < size_, "moelink Buffer: rank ", rank, " outside the group of ", size_);
  return transports_[rank];
}

EpBuffer::Launch EpBuffer::common(int half, int64_t timeout_us, const std::optional<at::Tensor>& active) const {
  Launch l;
  l.c.layout = layout_;
  l.c.rank = rank_;
  l.c.half = half;
  l.c.peers = peers_dev_;
  l.c.num_sms = num_sms_;
  at::Tensor mask = active_;
  if (active.has_value()) {
    mask = *active;
    TORCH_CHECK_VALUE(mask.is_cuda() && mask.scalar_type() == at::kInt && mask.numel() == size_ && mask.is_contiguous(),
                      "moelink: active_ranks must be a contiguous int32 CUDA tensor of ", size_, " entries");
  }
  l.c.active = mask.data_ptr<int>();
  int64_t us = timeout_us < 0 ? default_timeout_us_ : timeout_us;
  l.c.timeout_ns = us * 1000;
  return l;
}

DispatchOutputs EpBuffer::dispatch(const at::Tensor& x, const at::Tensor& topk_idx, bool use_fp8, bool round_scale,
                                   int64_t timeout_us, const std::optional<at::Tensor>& active, bool launch_recv) {
  const EpLayout& L = layout_;
  TORCH_CHECK_VALUE(x.is_cuda() && x.device().index() == device_, "moelink dispatch: x must be on cuda:", device_);
  TORCH_CHECK_TYPE(x.scalar_type() == at::kBFloat16, "moelink dispatch: x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == L.hidden && x.is_contiguous(),
                    "moelink dispatch: x must be a contiguous [tokens, ", L.hidden, "] tensor, got ", x.sizes());
  TORCH_CHECK_VALUE(x.size(0) <= L.max_tokens, "moelink dispatch: ", x.size(0),
                    " tokens exceed num_max_dispatch_tokens_per_rank=", L.max_tokens);
  TORCH_CHECK_TYPE(topk_idx.scalar_type() == at::kLong, "moelink dispatch: topk_idx must be int64");
  TORCH_CHECK_VALUE(topk_idx.is_cuda() && topk_idx.device() == x.device() && topk_idx.dim() == 2 &&
                        topk_idx.size(0) == x.size(0) && topk_idx.is_contiguous(),
                    "moelink dispatch: topk_idx must be a contiguous [", x.size(0), ", topk] tensor on ", x.device());
  TORCH_CHECK_VALUE(topk_idx.size(1) >= 1 && topk_idx.size(1) <= kMaxTopk, "moelink dispatch: top-k must be 1..",
                    kMaxTopk, ", got ", topk_idx.size(1));
  c10::cuda::CUDAGuard guard(device_);
  auto opts = x.options();
  const int64_t rows = static_cast<int64_t>(L.num_ranks) * L.max_tokens;
  DispatchOutputs out;
  out.half = round_++ & 1;
  out.recv_x = at::empty({L.num_local_experts, rows, L.hidden}, opts.dtype(use_fp8 ? at::kFloat8_e4m3fn : at::kBFloat16));
  if (use_fp8) out.recv_scales = at::empty({L.num_local_experts, rows, L.hidden / kHiddenAlign}, opts.dtype(at::kFloat));
  out.recv_count = at::zeros({L.num_local_experts}, opts.dtype(at::kInt));
  out.src_info = at::empty({L.num_local_experts, rows}, opts.dtype(at::kInt));
  out.src_slot = at::empty({L.num_local_experts, rows}, opts.dtype(at::kInt));
  out.layout_range = at::empty({L.num_local_experts, L.num_ranks}, opts.dtype(at::kLong));
  kernels::DispatchArgs a;
  a.c = common(static_cast<int>(out.half), timeout_us, active).c;
  a.x = x.data_ptr();
  a.topk_idx = topk_idx.data_ptr<int64_t>();
  a.num_tokens = static_cast<int>(x.size(0));
  a.num_topk = static_cast<int>(topk_idx.size(1));
  a.use_fp8 = use_fp8;
  a.round_scale = round_scale;
  a.scratch = scratch_;
  auto stream = c10::cuda::getCurrentCUDAStream(device_).stream();
  kernels::dispatchSend(a, stream);
  if (launch_recv) dispatchRecv(out, use_fp8, timeout_us, active);
  return out;
}

void EpBuffer::dispatchRecv(DispatchOutputs& out, bool use_fp8, int64_t timeout_us,
                            const std::optional<at::Tensor>& active) {
  c10::cuda::CUDAGuard guard(device_);
  kernels::DispatchArgs a;
  a.c = common(static_cast<int>(out.half), timeout_us, active).c;
  a.use_fp8 = use_fp8;
  a.recv_x = out.recv_x.data_ptr();
  a.recv_scales = use_fp8 ? out.recv_scales.data_ptr<float>() : nullptr;
  a.recv_src_info = out.src_info.data_ptr<int>();
  a.recv_src_slot = out.src_slot.data_ptr<int>();
  a.recv_count = out.recv_count.data_ptr<int>();
  a.layout_range = out.layout_range.data_ptr<int64_t>();
  kernels::dispatchRecv(a, c10::cuda::getCurrentCUDAStream(device_).stream());
}

at::Tensor EpBuffer::combine(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                             const DispatchOutputs& h, const std::optional<at::Tensor>& out, int64_t timeout_us,
                             const std::optional<at::Tensor>& active, bool launch_recv) {
  const EpLayout& L = layout_;
  const int64_t rows = static_cast<int64_t>(L.num_ranks) * L.max_tokens;
  TORCH_CHECK_TYPE(x.scalar_type() == at::kBFloat16, "moelink combine: x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.is_cuda() && x.device().index() == device_ && x.is_contiguous() && x.dim() == 3 &&
                        x.size(0) == L.num_local_experts && x.size(1) == rows && x.size(2) == L.hidden,
                    "moelink combine: x must be a contiguous [", L.num_local_experts, ", ", rows, ", ", L.hidden,
                    "] tensor on cuda:", device_, ", got ", x.sizes());
  TORCH_CHECK_VALUE(topk_idx.dim() == 2 && topk_idx.scalar_type() == at::kLong && topk_idx.is_contiguous() &&
                        topk_idx.size(0) <= L.max_tokens && topk_idx.size(1) >= 1 && topk_idx.size(1) <= kMaxTopk,
                    "moelink combine: topk_idx must be a contiguous int64 [tokens <= ", L.max_tokens, ", 1..",
                    kMaxTopk, "] tensor");
  TORCH_CHECK_VALUE(topk_weights.sizes() == topk_idx.sizes() && topk_weights.scalar_type() == at::kFloat &&
                        topk_weights.is_contiguous() && topk_weights.is_cuda(),
                    "moelink combine: topk_weights must be a contiguous float32 CUDA tensor shaped like topk_idx");
  c10::cuda::CUDAGuard guard(device_);
  // Everything is checked before the send: once it runs, the peers expect this rank's receive.
  at::Tensor result = out.has_value() ? *out : at::empty({topk_idx.size(0), L.hidden}, x.options());
  TORCH_CHECK_VALUE(result.sizes() == at::IntArrayRef({topk_idx.size(0), L.hidden}) &&
                        result.scalar_type() == at::kBFloat16 && result.is_contiguous() && result.is_cuda(),
                    "moelink combine: out must be a contiguous bfloat16 [", topk_idx.size(0), ", ", L.hidden, "] CUDA tensor");
  kernels::CombineArgs a;
  a.c = common(static_cast<int>(h.half), timeout_us, active).c;
  a.x = x.data_ptr();
  a.src_info = h.src_info.data_ptr<int>();
  a.src_slot = h.src_slot.data_ptr<int>();
  a.layout_range = h.layout_range.data_ptr<int64_t>();
  a.scratch = scratch_;
  kernels::combineSend(a, c10::cuda::getCurrentCUDAStream(device_).stream());
  if (launch_recv) combineRecv(topk_idx, topk_weights, h, result, timeout_us, active);
  return result;
}

void EpBuffer::combineRecv(const at::Tensor& topk_idx, const at::Tensor& topk_weights, const DispatchOutputs& h,
                           at::Tensor& out, int64_t timeout_us, const std::optional<at::Tensor>& active) {
  c10::cuda::CUDAGuard guard(device_);
  kernels::CombineArgs a;
  a.c = common(static_cast<int>(h.half), timeout_us, active).c;
  a.scratch = scratch_;
  a.topk_idx = topk_idx.data_ptr<int64_t>();
  a.topk_weights = topk_weights.data_ptr<float>();
  a.num_tokens = static_cast<int>(topk_idx.size(0));
  a.num_topk = static_cast<int>(topk_idx.size(1));
  a.out = out.data_ptr();
  kernels::combineRecv(a, c10::cuda::getCurrentCUDAStream(device_).stream());
}

}  // namespace moelink::ep
