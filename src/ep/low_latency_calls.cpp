// The low-latency buffer's calls (low_latency_buffer.h): dispatch and combine, each with its
// receive half (the hooks), and the per-peer paths and trace they report. Set-up and membership
// are low_latency_buffer.cpp's.
#include "moelink/ep/low_latency_buffer.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>

#include "cuda_check.h"
#include "tensor_checks.h"
#include "moelink/common/error.h"
#include "moelink/ep/proxy.h"

namespace moelink::ep {

namespace {

// Dispatch's receive phase: where the packed outputs go.
void setDispatchOutputs(kernels::DispatchArgs& a, const DispatchOutputs& out, bool use_fp8) {
  a.recv_x = out.recv_x.data_ptr();
  a.recv_scales = use_fp8 ? out.recv_scales.data_ptr<float>() : nullptr;
  a.recv_src_info = out.src_info.data_ptr<int>();
  a.recv_src_slot = out.src_slot.data_ptr<int>();
  a.recv_count = out.recv_count.data_ptr<int>();
  a.layout_range = out.layout_range.data_ptr<int64_t>();
}

// Combine's receive phase: the tokens' routing and weights, and the output.
void setCombineReceive(kernels::CombineArgs& a, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                       const at::Tensor& out) {
  a.topk_idx = topk_idx.data_ptr<int64_t>();
  a.topk_weights = topk_weights.data_ptr<float>();
  a.num_tokens = static_cast<int>(topk_idx.size(0));
  a.num_topk = static_cast<int>(topk_idx.size(1));
  a.out = out.data_ptr();
}

}  // namespace

std::string LowLatencyBuffer::transportOf(int rank) const {
  TORCH_CHECK_VALUE(rank >= 0 && rank < size_, "moelink Buffer: rank ", rank, " outside the group of ", size_);
  return transports_[rank];
}

void LowLatencyBuffer::setTrace(const std::optional<at::Tensor>& trace) {
  if (!trace.has_value()) {
    trace_ = at::Tensor();
    return;
  }
  TORCH_CHECK_VALUE(trace->is_cuda() && trace->device().index() == device_ && trace->scalar_type() == at::kLong &&
                        trace->is_contiguous() && trace->numel() == static_cast<int64_t>(num_sms_) * kernels::kTracePoints,
                    "moelink: the trace tensor must be a contiguous int64 tensor of ", num_sms_ * kernels::kTracePoints,
                    " entries on cuda:", device_);
  trace_ = *trace;
}

std::string LowLatencyBuffer::proxyTransportOf(int rank) const {
  TORCH_CHECK_VALUE(rank >= 0 && rank < size_, "moelink Buffer: rank ", rank, " outside the group of ", size_);
  return transports_[rank] == "proxy" ? proxy_->transportTo(rank) : std::string();
}

kernels::Common LowLatencyBuffer::common(int half, int64_t timeout_us, const std::optional<at::Tensor>& active,
                                 int phases) const {
  kernels::Common c;
  c.layout = layout_;
  c.rank = rank_;
  c.half = half;
  c.routes = routes_dev_ + half * size_;
  c.sent = reinterpret_cast<int*>(buffer_ + half * layout_.half_bytes + layout_.off_dispatch_sent);
  if (proxy_) c.ring = proxy_->ring();
  c.ibgda = !ibgda_peers_.empty();
  c.num_sms = num_sms_;
  c.phases = phases;
  c.trace = trace_.defined() ? reinterpret_cast<uint64_t*>(trace_.data_ptr<int64_t>()) : nullptr;
  at::Tensor mask = active_;
  if (active.has_value()) {
    mask = *active;
    TORCH_CHECK_VALUE(mask.is_cuda() && mask.device().index() == device_ && mask.scalar_type() == at::kInt &&
                          mask.numel() == size_ && mask.is_contiguous(),
                      "moelink: active_ranks must be a contiguous int32 tensor of ", size_, " entries on cuda:", device_);
  }
  c.active = mask.data_ptr<int>();
  int64_t us = timeout_us < 0 ? default_timeout_us_ : timeout_us;
  c.timeout_ns = us * 1000;
  return c;
}

DispatchOutputs LowLatencyBuffer::dispatch(const at::Tensor& x, const at::Tensor& topk_idx, bool use_fp8, bool round_scale,
                                   int64_t timeout_us, const std::optional<at::Tensor>& active, bool launch_recv) {
  const EpLayout& L = layout_;
  TORCH_CHECK_VALUE(x.is_cuda() && x.device().index() == device_, "moelink dispatch: x must be on cuda:", device_);
  TORCH_CHECK_TYPE(x.scalar_type() == at::kBFloat16, "moelink dispatch: x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == L.hidden && x.is_contiguous(),
                    "moelink dispatch: x must be a contiguous [tokens, ", L.hidden, "] tensor, got ", x.sizes());
  TORCH_CHECK_VALUE(x.size(0) <= L.max_tokens, "moelink dispatch: ", x.size(0),
                    " tokens exceed num_max_dispatch_tokens_per_rank=", L.max_tokens);
  checkAligned(x, "moelink dispatch: x");
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
  out.num_tokens = x.size(0);
  out.num_topk = topk_idx.size(1);
  out.recv_x = at::empty({L.num_local_experts, rows, L.hidden}, opts.dtype(use_fp8 ? at::kFloat8_e4m3fn : at::kBFloat16));
  if (use_fp8) out.recv_scales = at::empty({L.num_local_experts, rows, L.hidden / kHiddenAlign}, opts.dtype(at::kFloat));
  out.recv_count = at::empty({L.num_local_experts}, opts.dtype(at::kInt));
  out.src_info = at::empty({L.num_local_experts, rows}, opts.dtype(at::kInt));
  out.src_slot = at::empty({L.num_local_experts, rows}, opts.dtype(at::kInt));
  out.layout_range = at::empty({L.num_local_experts, L.num_ranks}, opts.dtype(at::kLong));
  kernels::DispatchArgs a;
  a.c = common(static_cast<int>(out.half), timeout_us, active,
               kernels::kSendPhase | (launch_recv ? kernels::kRecvPhase : 0));
  a.x = x.data_ptr();
  a.topk_idx = topk_idx.data_ptr<int64_t>();
  a.num_tokens = static_cast<int>(x.size(0));
  a.num_topk = static_cast<int>(topk_idx.size(1));
  a.use_fp8 = use_fp8;
  a.round_scale = round_scale;
  a.use_tma = use_tma_;
  a.scratch = scratch_;
  a.ready = scratch_ + kernels::dispatchReadyOffset(layout_);
  setDispatchOutputs(a, out, use_fp8);
  kernels::dispatch(a, c10::cuda::getCurrentCUDAStream(device_).stream());
  return out;
}

void LowLatencyBuffer::dispatchRecv(DispatchOutputs& out, bool use_fp8, int64_t timeout_us,
                            const std::optional<at::Tensor>& active) {
  c10::cuda::CUDAGuard guard(device_);
  kernels::DispatchArgs a;
  a.c = common(static_cast<int>(out.half), timeout_us, active, kernels::kRecvPhase);
  a.use_fp8 = use_fp8;
  a.scratch = scratch_;
  a.ready = scratch_ + kernels::dispatchReadyOffset(layout_);
  setDispatchOutputs(a, out, use_fp8);
  kernels::dispatch(a, c10::cuda::getCurrentCUDAStream(device_).stream());
}

at::Tensor LowLatencyBuffer::combine(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                             const DispatchOutputs& h, const std::optional<at::Tensor>& out, int64_t timeout_us,
                             const std::optional<at::Tensor>& active, bool launch_recv) {
  const EpLayout& L = layout_;
  const int64_t rows = static_cast<int64_t>(L.num_ranks) * L.max_tokens;
  TORCH_CHECK_TYPE(x.scalar_type() == at::kBFloat16, "moelink combine: x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.is_cuda() && x.device().index() == device_ && x.is_contiguous() && x.dim() == 3 &&
                        x.size(0) == L.num_local_experts && x.size(1) == rows && x.size(2) == L.hidden,
                    "moelink combine: x must be a contiguous [", L.num_local_experts, ", ", rows, ", ", L.hidden,
                    "] tensor on cuda:", device_, ", got ", x.sizes());
  checkAligned(x, "moelink combine: x");
  TORCH_CHECK_VALUE(topk_idx.dim() == 2 && topk_idx.scalar_type() == at::kLong && topk_idx.is_contiguous() &&
                        topk_idx.is_cuda() && topk_idx.device().index() == device_ &&
                        topk_idx.size(0) <= L.max_tokens && topk_idx.size(1) >= 1 && topk_idx.size(1) <= kMaxTopk,
                    "moelink combine: topk_idx must be a contiguous int64 [tokens <= ", L.max_tokens, ", 1..",
                    kMaxTopk, "] tensor on cuda:", device_);
  TORCH_CHECK_VALUE(topk_weights.sizes() == topk_idx.sizes() && topk_weights.scalar_type() == at::kFloat &&
                        topk_weights.is_contiguous() && topk_weights.is_cuda() &&
                        topk_weights.device().index() == device_,
                    "moelink combine: topk_weights must be a contiguous float32 tensor on cuda:", device_,
                    " shaped like topk_idx");
  TORCH_CHECK_VALUE(topk_idx.size(0) == h.num_tokens && topk_idx.size(1) == h.num_topk,
                    "moelink combine: topk_idx must be the dispatch's [", h.num_tokens, ", ", h.num_topk,
                    "] routing (the handle's), got ", topk_idx.sizes());
  c10::cuda::CUDAGuard guard(device_);
  // Everything is checked before the launch: once it runs, the peers expect this rank's receive.
  at::Tensor result = out.has_value() ? *out : at::empty({topk_idx.size(0), L.hidden}, x.options());
  TORCH_CHECK_VALUE(result.sizes() == at::IntArrayRef({topk_idx.size(0), L.hidden}) &&
                        result.scalar_type() == at::kBFloat16 && result.is_contiguous() && result.is_cuda() &&
                        result.device().index() == device_,
                    "moelink combine: out must be a contiguous bfloat16 [", topk_idx.size(0), ", ", L.hidden,
                    "] tensor on cuda:", device_);
  checkAligned(result, "moelink combine: out");
  kernels::CombineArgs a;
  a.c = common(static_cast<int>(h.half), timeout_us, active,
               kernels::kSendPhase | (launch_recv ? kernels::kRecvPhase : 0));
  a.x = x.data_ptr();
  a.blocks_seen = scratch_ + kernels::combineScratchOffset(L);
  a.gate = scratch_ + kernels::combineGateOffset(L);
  a.relay = scratch_ + kernels::combineRelayOffset(L);
  a.layout_range = h.layout_range.data_ptr<int64_t>();
  setCombineReceive(a, topk_idx, topk_weights, result);
  kernels::combine(a, c10::cuda::getCurrentCUDAStream(device_).stream());
  return result;
}

void LowLatencyBuffer::combineRecv(const at::Tensor& topk_idx, const at::Tensor& topk_weights, const DispatchOutputs& h,
                           at::Tensor& out, int64_t timeout_us, const std::optional<at::Tensor>& active) {
  c10::cuda::CUDAGuard guard(device_);
  kernels::CombineArgs a;
  a.c = common(static_cast<int>(h.half), timeout_us, active, kernels::kRecvPhase);
  setCombineReceive(a, topk_idx, topk_weights, out);
  kernels::combine(a, c10::cuda::getCurrentCUDAStream(device_).stream());
}

}  // namespace moelink::ep
