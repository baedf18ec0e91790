// NormalBuffer: the torch-facing side of the normal-mode NVLink kernels (normal_kernels.h).
// Owns one NVL buffer per rank, mapped by every peer through CUDA IPC; collective: every rank
// of the group constructs it with the same arguments, and every call is made by every rank in
// the same order (a call's first kernel is a barrier across the ranks). Validation of the
// users' arguments is the Python layer's (moelink/normal.py); this class checks what the
// kernels depend on (devices, dtypes, shapes, sizes) before any launch.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "moelink/ep/normal_kernels.h"

namespace moelink::ep {

// What the kernels need of a call's shape: channels, ring slots per (source, channel) and
// tokens per send chunk.
struct NormalShape {
  int64_t channels = 12, ring_tokens = 256, send_chunk = 6;
};

struct NormalDispatchResult {
  at::Tensor recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx;
  at::Tensor rank_prefix, channel_prefix, recv_channel_prefix, send_head;
  std::vector<int64_t> num_recv_per_expert;  // received (token, local expert) pairs
  int64_t num_recv = 0;
};

class NormalBuffer {
 public:
  NormalBuffer(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, const std::string& key,
               int64_t bytes, int64_t num_experts);
  ~NormalBuffer();
  NormalBuffer(const NormalBuffer&) = delete;
  NormalBuffer& operator=(const NormalBuffer&) = delete;

  // Bytes a call of this shape needs (the buffer must have at least as many).
  static int64_t bytesNeeded(int64_t num_ranks, int64_t num_local_experts, const NormalShape& shape, int64_t x_bytes,
                             int64_t num_scales, int64_t num_topk);

  // get_dispatch_layout on the GPU: (num_tokens_per_rank, num_tokens_per_expert,
  // is_token_in_rank) of an int64 [tokens, topk] CUDA routing. Needs no buffer.
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> layout(const at::Tensor& topk_idx, int64_t num_experts,
                                                               int64_t num_ranks);

  // A dispatch that computes the layout (notify, then the host waits for the counts; with
  // num_worst_tokens > 0 nothing waits on the host: outputs of that many rows, num_recv set to
  // it, num_recv_per_expert empty, capturable in a CUDA graph).
  NormalDispatchResult dispatch(const at::Tensor& x, const std::optional<at::Tensor>& scales,
                                const std::optional<at::Tensor>& topk_idx, const std::optional<at::Tensor>& topk_weights,
                                const at::Tensor& is_token_in_rank, const at::Tensor& num_tokens_per_expert,
                                const NormalShape& shape, int64_t num_worst_tokens, int64_t timeout_us);
  // A dispatch that repeats a cached layout (no host wait). Returns (recv_x, recv_scales).
  // num_recv < 0: the handle of a num_worst_tokens dispatch (the count is on the device).
  std::tuple<at::Tensor, std::optional<at::Tensor>> cachedDispatch(
      const at::Tensor& x, const std::optional<at::Tensor>& scales, const at::Tensor& is_token_in_rank,
      const at::Tensor& rank_prefix, const at::Tensor& channel_prefix, const at::Tensor& recv_channel_prefix,
      int64_t num_recv, int64_t num_out_rows, const NormalShape& shape, int64_t timeout_us);
  // Returns (combined_x, combined_topk_weights).
  std::tuple<at::Tensor, std::optional<at::Tensor>> combine(
      const at::Tensor& x, const std::optional<at::Tensor>& topk_weights, const std::optional<at::Tensor>& bias0,
      const std::optional<at::Tensor>& bias1, const at::Tensor& rank_prefix, const at::Tensor& recv_channel_prefix,
      const at::Tensor& send_head, int64_t num_recv, const NormalShape& shape, int64_t timeout_us);

  int64_t bytes() const { return static_cast<int64_t>(bytes_); }

 private:
  normal::RingLayout layoutFor(const NormalShape& shape, int64_t x_bytes, int64_t num_scales, int64_t num_topk) const;
  void checkHealthy();  // raises (once) what a kernel reported, and refuses a broken buffer
  // dispatch()'s steps: its inputs' checks; the host's wait for the notify's counts.
  void checkDispatchInputs(const at::Tensor& x, const std::optional<at::Tensor>& scales,
                           const std::optional<at::Tensor>& topk_idx, const std::optional<at::Tensor>& topk_weights,
                           const at::Tensor& is_token_in_rank, const at::Tensor& num_tokens_per_expert) const;
  void waitForLayout(int ticket, int64_t timeout_us);
  // A bounded dispatch's overflow the notify kernel reported (rows that arrived), read and
  // cleared at the start of a call; raiseOverflow raises it after the call's launches, so that
  // every rank takes part in the call either way and a call never raises its own overflow.
  int takeOverflow();
  void raiseOverflow(int rows);
  int64_t timeoutNs(int64_t timeout_us) const;
  void release() noexcept;  // unmaps the peers, frees the buffer and the report
  // Starts a cached dispatch or a combine: the barrier kernel (the notify kernel is a
  // dispatch's own).
  void barrier(const normal::RingLayout& L, int64_t timeout_us, cudaStream_t stream);

  int rank_, size_, device_;
  int64_t num_experts_;
  char* buffer_ = nullptr;
  uint64_t bytes_ = 0;
  normal::Peers peers_;
  normal::HostReport* report_ = nullptr;  // host-mapped
  normal::HostReport* report_dev_ = nullptr;
  int ticket_ = 0;  // notify launches, so the host waits for its own report
  bool broken_ = false;
  bool use_tma_ = true;  // combine's sender moves rows with bulk copies (MOELINK_EP_TMA)
  int64_t default_timeout_us_ = 30000000;
};

}  // namespace moelink::ep
