// Launchers of the EP kernels (src/ep/kernels/*.cu). They take raw device pointers, sizes
// and a stream: no torch types. `peers[r]` is rank r's buffer as this rank addresses it
// (its own buffer for r == rank, a CUDA IPC mapping for an NVLink peer); `half` selects
// the round's half (0 or 1). See layout.h for the buffer layout.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "moelink/ep/layout.h"

namespace moelink::ep::kernels {

// Scratch integers a buffer keeps for its kernels (zeroed once at allocation).
inline int scratchInts(const EpLayout& l) { return 3 * l.num_experts + 4; }

struct Common {
  EpLayout layout;
  int rank = 0;
  int half = 0;
  char* const* peers = nullptr;  // device array [num_ranks]
  int num_sms = 0;
  // int32 [num_ranks] on the GPU: 1 = active. A receiver that waits on a source longer
  // than timeout_ns (> 0) clears the source's entry and treats it as having sent nothing;
  // inactive ranks are neither sent to nor waited for.
  int* active = nullptr;
  int64_t timeout_ns = 0;  // <= 0: wait without limit
};

struct DispatchArgs {
  Common c;
  const void* x = nullptr;          // bf16 [num_tokens, hidden]
  const int64_t* topk_idx = nullptr;  // [num_tokens, num_topk], -1 = none
  int num_tokens = 0;
  int num_topk = 0;
  bool use_fp8 = false;
  bool round_scale = false;  // FP8 scales rounded up to a power of two
  int* scratch = nullptr;    // kScratchInts int32, zero between rounds (the kernels restore it)
  // outputs (dispatchRecv)
  void* recv_x = nullptr;        // bf16 or e4m3 [local, ranks*max_tokens, hidden]
  float* recv_scales = nullptr;  // [local, ranks*max_tokens, hidden/128] when FP8
  int* recv_src_info = nullptr;  // [local, ranks*max_tokens]: source token
  int* recv_src_slot = nullptr;  // [local, ranks*max_tokens]: source top-k slot
  int* recv_count = nullptr;     // [local], zeroed before dispatchRecv
  int64_t* layout_range = nullptr;  // [local, ranks]: (begin << 32) | count
};

// Sends every (token, top-k) to its expert's rank, then each expert's token count.
void dispatchSend(const DispatchArgs& a, cudaStream_t stream);
// Waits for every source's count and packs the received tokens per local expert.
void dispatchRecv(const DispatchArgs& a, cudaStream_t stream);

struct CombineArgs {
  Common c;
  const void* x = nullptr;  // bf16 expert outputs [local, ranks*max_tokens, hidden]
  const int* src_info = nullptr;
  const int* src_slot = nullptr;
  const int64_t* layout_range = nullptr;
  int* scratch = nullptr;  // as in DispatchArgs
  // receive side
  const int64_t* topk_idx = nullptr;
  const float* topk_weights = nullptr;
  int num_tokens = 0;
  int num_topk = 0;
  void* out = nullptr;  // bf16 [num_tokens, hidden]
};

// Sends every expert output back to its token's rank, then each expert's flag.
void combineSend(const CombineArgs& a, cudaStream_t stream);
// Waits for the flags of each token's experts and writes the weighted sums.
void combineRecv(const CombineArgs& a, cudaStream_t stream);

}  // namespace moelink::ep::kernels
