// Low-latency combine: expert outputs go straight back into their token's rank, one
// region per (token, top-k slot); the token's rank waits for the experts' flags and
// writes the weighted sum.
#include <cuda_bf16.h>

#include "moelink/common/error.h"
#include "moelink/ep/kernels.h"
#include "sync.cuh"

namespace moelink::ep::kernels {

namespace {

constexpr int kWarps = 8;

__global__ void __launch_bounds__(kWarps * 32) combineSendKernel(CombineArgs a) {
  const EpLayout& L = a.c.layout;
  const int pair = blockIdx.x;  // (local expert, rank the tokens came from)
  const int le = pair / L.num_ranks, dst = pair % L.num_ranks;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if (!a.c.active[dst]) return;
  const int64_t lr = a.layout_range[pair];
  const int begin = static_cast<int>(lr >> 32), n = static_cast<int>(lr & 0xffffffff);
  const uint64_t rows_per_expert = static_cast<uint64_t>(L.num_ranks) * L.max_tokens;
  char* remote = a.c.peers[dst] + a.c.half * L.half_bytes;
  for (int i = warp; i < n; i += kWarps) {
    const uint64_t row = le * rows_per_expert + begin + i;
    const int t = a.src_info[row], k = a.src_slot[row];
    const int4* s = reinterpret_cast<const int4*>(static_cast<const char*>(a.x) + row * 2ull * L.hidden);
    int4* d = reinterpret_cast<int4*>(remote + L.off_combine_x +
                                      (static_cast<uint64_t>(t) * kMaxTopk + k) * L.combine_msg_bytes);
    for (int j = lane; j < L.hidden / 8; j += 32) d[j] = s[j];
  }
  // NOTES: the barrier orders every thread's stores before thread 0's release, which is
  // cumulative at system scope: a reader that sees the flag sees all of the block's data.
  __syncthreads();
  if (tid == 0) {
    __threadfence_system();
    stReleaseSys(reinterpret_cast<int*>(remote + L.off_combine_flag) + a.c.rank * L.num_local_experts + le, 1);
  }
}

__global__ void __launch_bounds__(kWarps * 32) combineRecvKernel(CombineArgs a) {
  const EpLayout& L = a.c.layout;
  char* half = a.c.peers[a.c.rank] + a.c.half * L.half_bytes;
  int* flags = reinterpret_cast<int*>(half + L.off_combine_flag);
  int* finished = a.scratch + 3 * L.num_experts;
  const int tid = threadIdx.x;
  __shared__ int s_valid[kMaxTopk];
  for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
    if (tid < a.num_topk) {
      int64_t e = a.topk_idx[static_cast<size_t>(t) * a.num_topk + tid];
      int ok = 0;
      if (e >= 0 && e < L.num_experts) {
        int r = static_cast<int>(e) / L.num_local_experts;
        if (a.c.active[r]) {
          ok = waitNonZero(flags + e, a.c.timeout_ns) != 0;
          if (!ok) atomicExch(a.c.active + r, 0);  // timed out: masked
        }
      }
      s_valid[tid] = ok;
    }
    __syncthreads();
    const char* base = half + L.off_combine_x + static_cast<uint64_t>(t) * kMaxTopk * L.combine_msg_bytes;
    for (int h = tid; h < L.hidden / 8; h += blockDim.x) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int k = 0; k < a.num_topk; ++k) {
        if (!s_valid[k]) continue;
        const float w = a.topk_weights[static_cast<size_t>(t) * a.num_topk + k];
        int4 v = reinterpret_cast<const int4*>(base + k * L.combine_msg_bytes)[h];
        const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v);
        for (int j = 0; j < 4; ++j) {
          float2 f = __bfloat1622float2(b[j]);
          acc[2 * j] += w * f.x;
          acc[2 * j + 1] += w * f.y;
        }
      }
      int4 o;
      __nv_bfloat162* ob = reinterpret_cast<__nv_bfloat162*>(&o);
      for (int j = 0; j < 4; ++j) ob[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
      reinterpret_cast<int4*>(static_cast<char*>(a.out) + static_cast<uint64_t>(t) * 2 * L.hidden)[h] = o;
    }
    __syncthreads();
  }
  // The last block to finish clears the flags for the round after next.
  // NOTES: every expert raises its flag here, also those no token of this rank used, and a
  // flag that arrived after the clear would survive into a later round (which would then
  // read before its data came). So the last block first waits for every active expert's
  // flag of this round; only then is no write of this round still on its way.
  __shared__ bool s_last;
  if (tid == 0) {
    __threadfence();
    s_last = atomicAdd(finished, 1) == static_cast<int>(gridDim.x) - 1;
  }
  __syncthreads();
  if (!s_last) return;
  for (int e = tid; e < L.num_experts; e += blockDim.x) {
    int r = e / L.num_local_experts;
    if (a.c.active[r] && !waitNonZero(flags + e, a.c.timeout_ns)) atomicExch(a.c.active + r, 0);
  }
  __syncthreads();
  for (int e = tid; e < L.num_experts; e += blockDim.x) flags[e] = 0;
  if (tid == 0) *finished = 0;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) MOELINK_THROW(what, " failed: ", cudaGetErrorString(e));
}

}  // namespace

void combineSend(const CombineArgs& a, cudaStream_t stream) {
  combineSendKernel<<<a.c.layout.num_local_experts * a.c.layout.num_ranks, kWarps * 32, 0, stream>>>(a);
  check(cudaGetLastError(), "combine send launch");
}

void combineRecv(const CombineArgs& a, cudaStream_t stream) {
  int blocks = a.num_tokens < 1 ? 1 : (a.num_tokens < a.c.num_sms ? a.num_tokens : a.c.num_sms);
  combineRecvKernel<<<blocks, kWarps * 32, 0, stream>>>(a);
  check(cudaGetLastError(), "combine recv launch");
}

}  // namespace moelink::ep::kernels
