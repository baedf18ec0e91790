// Low-latency dispatch: every (token, top-k) goes straight into its expert's rank's
// receive slots; per-expert counts follow the tokens; the receiver packs per expert.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "moelink/common/error.h"
#include "moelink/ep/kernels.h"
#include "sync.cuh"

namespace moelink::ep::kernels {

namespace {

constexpr int kSendWarps = 32;  // one block of 1024 threads per SM
constexpr int kRecvWarps = 8;
constexpr float kFp8Max = 448.0f;

__device__ __forceinline__ bool validExpert(int64_t e, const EpLayout& L, const int* active) {
  return e >= 0 && e < L.num_experts && active[e / L.num_local_experts] != 0;
}

// Writes token t's message (header + bf16 or e4m3 + scales) into shared memory.
__device__ void stageToken(const DispatchArgs& a, int t, char* smem) {
  const EpLayout& L = a.c.layout;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if (tid == 0) *reinterpret_cast<int4*>(smem) = make_int4(t, 0, 0, 0);
  const auto* row = static_cast<const __nv_bfloat16*>(a.x) + static_cast<size_t>(t) * L.hidden;
  char* payload = smem + kMsgHeaderBytes;
  if (!a.use_fp8) {
    const int4* src = reinterpret_cast<const int4*>(row);
    int4* dst = reinterpret_cast<int4*>(payload);
    for (int i = tid; i < L.hidden / 8; i += blockDim.x) dst[i] = src[i];
    return;
  }
  // One warp per 128-element group, 4 elements per lane.
  float* scales = reinterpret_cast<float*>(payload + L.hidden);
  for (int g = warp; g < L.hidden / kHiddenAlign; g += kSendWarps) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(row + g * kHiddenAlign + lane * 4);
    float2 v0 = __bfloat1622float2(p[0]), v1 = __bfloat1622float2(p[1]);
    float amax = warpMax(fmaxf(fmaxf(fabsf(v0.x), fabsf(v0.y)), fmaxf(fabsf(v1.x), fabsf(v1.y))));
    float scale = fmaxf(amax, 1e-4f) / kFp8Max;
    if (a.round_scale) {  // up to a power of two, exactly (log2f is approximate)
      uint32_t bits = __float_as_uint(scale);
      if (bits & 0x7fffffu) bits = (bits & 0xff800000u) + 0x800000u;
      scale = __uint_as_float(bits);
    }
    float inv = 1.0f / scale;
    __nv_fp8x4_e4m3 q(make_float4(v0.x * inv, v0.y * inv, v1.x * inv, v1.y * inv));
    *reinterpret_cast<__nv_fp8x4_e4m3*>(payload + g * kHiddenAlign + lane * 4) = q;
    if (lane == 0) scales[g] = scale;
  }
}

__global__ void __launch_bounds__(kSendWarps * 32, 1) dispatchSendKernel(DispatchArgs a) {
  extern __shared__ __align__(16) char smem[];
  __shared__ int partial[kSendWarps];
  const EpLayout& L = a.c.layout;
  int* expected = a.scratch;
  int* slot_counter = a.scratch + L.num_experts;
  int* sent_counter = a.scratch + 2 * L.num_experts;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int entries = a.num_tokens * a.num_topk;

  // 1. How many tokens go to each of the experts this block signals for.
  for (int e = blockIdx.x; e < L.num_experts; e += gridDim.x) {
    int n = 0;
    for (int i = tid; i < entries; i += blockDim.x) n += a.topk_idx[i] == e;
    n = warpSum(n);
    if (lane == 0) partial[warp] = n;
    __syncthreads();
    if (tid == 0) {
      int s = 0;
      for (int w = 0; w < kSendWarps; ++w) s += partial[w];
      expected[e] = s;
    }
    __syncthreads();
  }

  // 2. Tokens: stage once, then one warp per top-k entry writes it to the expert's slot.
  const uint64_t payload = a.use_fp8 ? static_cast<uint64_t>(L.hidden) + L.hidden / kHiddenAlign * 4 : 2ull * L.hidden;
  const int send_vecs = static_cast<int>((kMsgHeaderBytes + payload + 15) / 16);
  for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
    stageToken(a, t, smem);
    __syncthreads();
    if (warp < a.num_topk) {
      int64_t e = a.topk_idx[static_cast<size_t>(t) * a.num_topk + warp];
      if (validExpert(e, L, a.c.active)) {
        int slot = 0;
        if (lane == 0) slot = atomicAdd(slot_counter + e, 1);
        slot = __shfl_sync(0xffffffffu, slot, 0);
        int r = static_cast<int>(e) / L.num_local_experts, le = static_cast<int>(e) % L.num_local_experts;
        if (slot < L.max_tokens) {  // a token listing one expert twice could overflow
          char* dst = a.c.peers[r] + a.c.half * L.half_bytes + L.off_dispatch_x +
                      ((static_cast<uint64_t>(le) * L.num_ranks + a.c.rank) * L.max_tokens + slot) * L.dispatch_msg_bytes;
          const int4* src = reinterpret_cast<const int4*>(smem);
          for (int i = lane; i < send_vecs; i += 32) {
            int4 v = src[i];
            if (i == 0) v.y = warp;  // the top-k slot, for combine
            reinterpret_cast<int4*>(dst)[i] = v;
          }
        }
        // NOTES: __syncwarp orders the lanes' stores before lane 0's fence, which is cumulative:
        // once the count writer sees this increment, the whole message is visible system-wide.
        __syncwarp();
        if (lane == 0) {
          __threadfence_system();
          atomicAdd(sent_counter + e, 1);
        }
      }
    }
    __syncthreads();
  }

  // 3. Once all of an expert's tokens are out, its count (-n-1) goes to the expert's rank.
  if (tid == 0) {
    for (int e = blockIdx.x; e < L.num_experts; e += gridDim.x) {
      int r = e / L.num_local_experts, le = e % L.num_local_experts;
      int n = expected[e];
      if (a.c.active[r]) {
        while (ldAcquireGpu(sent_counter + e) < n) {
        }
        __threadfence_system();
        int* count = reinterpret_cast<int*>(a.c.peers[r] + a.c.half * L.half_bytes + L.off_dispatch_count) +
                     le * L.num_ranks + a.c.rank;
        stReleaseSys(count, -min(n, L.max_tokens) - 1);
      }
      expected[e] = 0;
      slot_counter[e] = 0;
      sent_counter[e] = 0;
    }
  }
}

__global__ void __launch_bounds__(kRecvWarps * 32) dispatchRecvKernel(DispatchArgs a) {
  __shared__ int s_n, s_begin;
  const EpLayout& L = a.c.layout;
  const int pair = blockIdx.x;  // (local expert, source rank)
  const int le = pair / L.num_ranks, src = pair % L.num_ranks;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  char* half = a.c.peers[a.c.rank] + a.c.half * L.half_bytes;
  if (tid == 0) {
    int* count = reinterpret_cast<int*>(half + L.off_dispatch_count) + pair;
    int v = a.c.active[src] ? waitNonZero(count, a.c.timeout_ns) : 0;
    if (v == 0 && a.c.active[src]) atomicExch(a.c.active + src, 0);  // timed out: masked
    int n = v ? -v - 1 : 0;
    *count = 0;  // ready for the round after next
    s_n = n;
    s_begin = atomicAdd(a.recv_count + le, n);
    a.layout_range[pair] = (static_cast<int64_t>(s_begin) << 32) | static_cast<uint32_t>(n);
  }
  __syncthreads();
  const int n = s_n, begin = s_begin;
  const uint64_t rows_per_expert = static_cast<uint64_t>(L.num_ranks) * L.max_tokens;
  for (int i = warp; i < n; i += kRecvWarps) {
    const char* msg = half + L.off_dispatch_x + (static_cast<uint64_t>(pair) * L.max_tokens + i) * L.dispatch_msg_bytes;
    const uint64_t row = le * rows_per_expert + begin + i;
    if (lane == 0) {
      int4 h = *reinterpret_cast<const int4*>(msg);
      a.recv_src_info[row] = h.x;
      a.recv_src_slot[row] = h.y;
    }
    const char* payload = msg + kMsgHeaderBytes;
    if (!a.use_fp8) {
      const int4* s = reinterpret_cast<const int4*>(payload);
      int4* d = reinterpret_cast<int4*>(static_cast<char*>(a.recv_x) + row * 2ull * L.hidden);
      for (int j = lane; j < L.hidden / 8; j += 32) d[j] = s[j];
    } else {
      const int4* s = reinterpret_cast<const int4*>(payload);
      int4* d = reinterpret_cast<int4*>(static_cast<char*>(a.recv_x) + row * static_cast<uint64_t>(L.hidden));
      for (int j = lane; j < L.hidden / 16; j += 32) d[j] = s[j];
      const float* ss = reinterpret_cast<const float*>(payload + L.hidden);
      float* ds = a.recv_scales + row * (L.hidden / kHiddenAlign);
      for (int j = lane; j < L.hidden / kHiddenAlign; j += 32) ds[j] = ss[j];
    }
  }
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) MOELINK_THROW(what, " failed: ", cudaGetErrorString(e));
}

}  // namespace

void dispatchSend(const DispatchArgs& a, cudaStream_t stream) {
  const int smem = static_cast<int>(a.c.layout.dispatch_msg_bytes);
  if (smem > 48 * 1024)
    check(cudaFuncSetAttribute(dispatchSendKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
          "cudaFuncSetAttribute(dispatch)");
  dispatchSendKernel<<<a.c.num_sms, kSendWarps * 32, smem, stream>>>(a);
  check(cudaGetLastError(), "dispatch send launch");
}

void dispatchRecv(const DispatchArgs& a, cudaStream_t stream) {
  dispatchRecvKernel<<<a.c.layout.num_local_experts * a.c.layout.num_ranks, kRecvWarps * 32, 0, stream>>>(a);
  check(cudaGetLastError(), "dispatch recv launch");
}

}  // namespace moelink::ep::kernels
