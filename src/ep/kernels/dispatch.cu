// Low-latency dispatch: every (token, top-k) goes straight into its expert's rank's
// receive slots; per-expert counts follow the tokens; the receiver packs per expert.
//
// One launch, one block of 32 warps per SM. Send phase: warps 0..30 take the block's
// tokens in turn: claim a slot per top-k entry, stage the token's message (header +
// bf16, or e4m3 + scales) in shared memory, then write it to every destination: as one
// bulk copy (TMA) per NVLink destination, issued by the entry's thread (use_tma), or with
// the message split into chunks over the warps (proxy destinations, or use_tma off).
// Each (token, top-k) then adds 1 to its expert's finish counter. Warp 31 meanwhile
// counts the tokens of the experts this block accounts for; whichever addition
// completes an expert's counter sends its count. Receive phase: a block per local expert
// waits for every source's count and copies the received messages into the packed
// outputs.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <atomic>

#include "moelink/ep/kernels.h"
#include "launch.h"
#include "sync.cuh"

namespace moelink::ep::kernels {

namespace {

constexpr int kWarps = 32;
constexpr int kThreads = kWarps * 32;
constexpr int kSenderWarps = kWarps - 1;  // the last warp counts and signals
constexpr int kSendVecsPerLane = 4;       // a send chunk: 32 lanes x 4 x 16 B
constexpr int kRecvVecsPerLane = 8;       // a receive chunk: 32 lanes x 8 x 16 B
constexpr int kFinishTag = 1 << 24;
constexpr float kFp8Max = 448.0f;

__device__ __forceinline__ float halfWarpMax(float v) {
  for (int o = 8; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Token t's message (header + payload) into shared memory, by the sender warps.
template <bool kFp8>
__device__ void stageToken(const DispatchArgs& a, int t, char* smem) {
  const EpLayout& L = a.c.layout;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if (tid == 0) *reinterpret_cast<int4*>(smem) = make_int4(t, 0, 0, 0);
  const int4* row = reinterpret_cast<const int4*>(static_cast<const __nv_bfloat16*>(a.x) + static_cast<size_t>(t) * L.hidden);
  char* payload = smem + kMsgHeaderBytes;
  if constexpr (!kFp8) {
    int4* dst = reinterpret_cast<int4*>(payload);
    for (int i = tid; i < L.hidden / 8; i += kSenderWarps * 32) dst[i] = ldNc(row + i);
  } else {
    // Half a warp per 128-element group (8 elements per lane); every lane takes part in
    // the shuffles, also where the group count is odd.
    const int groups = L.hidden / kHiddenAlign;
    float* scales = reinterpret_cast<float*>(payload + L.hidden);
    for (int g0 = warp * 2; g0 < groups; g0 += kSenderWarps * 2) {
      const int g = g0 + lane / 16, sub = lane % 16;
      const bool valid = g < groups;
      int4 raw = valid ? ldNc(row + g * 16 + sub) : make_int4(0, 0, 0, 0);
      const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&raw);
      float f[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float2 v = __bfloat1622float2(b[j]);
        f[2 * j] = v.x;
        f[2 * j + 1] = v.y;
      }
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(f[j]));
      amax = halfWarpMax(amax);
      float scale = fmaxf(amax, 1e-4f) / kFp8Max;
      if (a.round_scale) {  // up to a power of two, exactly (log2f is approximate)
        uint32_t bits = __float_as_uint(scale);
        if (bits & 0x7fffffu) bits = (bits & 0xff800000u) + 0x800000u;
        scale = __uint_as_float(bits);
      }
      const float inv = 1.0f / scale;
      if (valid) {
        __nv_fp8x4_e4m3 q0(make_float4(f[0] * inv, f[1] * inv, f[2] * inv, f[3] * inv));
        __nv_fp8x4_e4m3 q1(make_float4(f[4] * inv, f[5] * inv, f[6] * inv, f[7] * inv));
        uint2 q;
        q.x = *reinterpret_cast<uint32_t*>(&q0);
        q.y = *reinterpret_cast<uint32_t*>(&q1);
        *reinterpret_cast<uint2*>(payload + g * kHiddenAlign + sub * 8) = q;
        if (sub == 0) scales[g] = scale;
      }
    }
  }
}

// Expert e is complete (its finish counter reached the tag, seen through an acquiring
// RMW): sends its count to the expert's rank and resets e's counters for the next round.
__device__ void signalCount(const DispatchArgs& a, int e) {
  const EpLayout& L = a.c.layout;
  int* slot_counter = a.scratch;
  int* finish = a.scratch + L.num_experts;
  int* expected = a.scratch + 2 * L.num_experts;
  const int n = expected[e];
  const int r = e / L.num_local_experts, le = e % L.num_local_experts;
  if (a.c.active[r]) {
    const PeerRoute& route = a.c.routes[r];
    const int v = -min(n, L.max_tokens) - 1;
    if (route.proxy)
      proxyPost(a.c.ring, kProxySignal, r, static_cast<uint32_t>(v), route.count_remote + le * kSignalBytes,
                kSignalBytes);
    else
      stReleaseSys(reinterpret_cast<int*>(route.count_send + le * kSignalBytes), v);
  }
  finish[e] = 0;
  slot_counter[e] = 0;
  expected[e] = 0;
}

// Warp 31: counts the tokens of the experts this block accounts for and adds them to the
// experts' finish counters. Each (token, top-k) entry adds 1 once it is out (or skipped),
// the count adds tag - n: whichever addition completes the tag sends the count, so the
// count leaves as soon as the expert's last message is out, without anyone polling.
__device__ void countExperts(const DispatchArgs& a, int* s_counts, int nj) {
  const EpLayout& L = a.c.layout;
  const int lane = threadIdx.x % 32;
  int* finish = a.scratch + L.num_experts;
  int* expected = a.scratch + 2 * L.num_experts;
  for (int j = lane; j < nj; j += 32) s_counts[j] = 0;
  __syncwarp();
  const int entries = a.num_tokens * a.num_topk;
  constexpr int kUnroll = 8;  // loads in flight per lane
  for (int i0 = 0; i0 < entries; i0 += 32 * kUnroll) {
    int64_t e[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u * 32 + lane;
      e[u] = i < entries ? __ldg(a.topk_idx + i) : -1;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (e[u] >= 0 && e[u] < L.num_experts && (e[u] - blockIdx.x) % gridDim.x == 0)
        atomicAdd(s_counts + (e[u] - blockIdx.x) / gridDim.x, 1);
  }
  __syncwarp();
  for (int j = lane; j < nj; j += 32) {
    const int e = blockIdx.x + j * gridDim.x;
    const int n = s_counts[j];
    expected[e] = n;  // published by the release below
    if (atomicAddAcqRelGpu(finish + e, kFinishTag - n) + kFinishTag - n == kFinishTag) signalCount(a, e);
  }
}

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) dispatchKernel(DispatchArgs a) {
  extern __shared__ __align__(16) char smem[];
  __shared__ int s_expert[kMaxTopk], s_slot[kMaxTopk];
  const EpLayout& L = a.c.layout;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const uint64_t msg_bytes = L.dispatch_msg_bytes;
  const int payload = kFp8 ? L.hidden + L.hidden / kHiddenAlign * 4 : 2 * L.hidden;
  const int msg_vecs = (kMsgHeaderBytes + payload + 15) / 16;
  int* ints = reinterpret_cast<int*>(smem + msg_bytes);   // after the staged message
  if (tid == 0) tracePoint(a.c, 0);

  if (a.c.phases & kSendPhase) {
    if (warp == kSenderWarps) {
      countExperts(a, ints, (L.num_experts - blockIdx.x + gridDim.x - 1) / gridDim.x);
      if (lane == 0) tracePoint(a.c, 3);
    } else {
      int* slot_counter = a.scratch;
      int* finish = a.scratch + L.num_experts;
      const int chunks = (msg_vecs + 32 * kSendVecsPerLane - 1) / (32 * kSendVecsPerLane);
      for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
        if (tid < a.num_topk) {
          const int64_t e = __ldg(a.topk_idx + static_cast<size_t>(t) * a.num_topk + tid);
          int slot = -1;
          if (e >= 0 && e < L.num_experts && a.c.active[e / L.num_local_experts]) slot = atomicAdd(slot_counter + e, 1);
          s_expert[tid] = e >= 0 && e < L.num_experts ? static_cast<int>(e) : -1;
          s_slot[tid] = slot;  // -1: not sent; >= max_tokens: a repeated expert overflowed
        }
        stageToken<kFp8>(a, t, smem);
        if (a.use_tma) fenceProxyAsyncShared();
        namedBarrier(1, kSenderWarps * 32);
        if (tid == 0 && t == blockIdx.x) tracePoint(a.c, 1);
        const int4* src = reinterpret_cast<const int4*>(smem);
        if (a.use_tma && tid < a.num_topk) {
          // One bulk copy per destination, issued by the entry's thread; proxy peers'
          // messages (host memory) go through the warps below.
          const int e = s_expert[tid], slot = s_slot[tid];
          if (slot >= 0 && slot < L.max_tokens && !a.c.routes[e / L.num_local_experts].proxy) {
            const int le = e % L.num_local_experts;
            char* dst = a.c.routes[e / L.num_local_experts].dispatch_send +
                        (static_cast<uint64_t>(le) * L.max_tokens + slot) * msg_bytes;
            int4 h = src[0];
            h.y = tid;
            stNa(reinterpret_cast<int4*>(dst), h);
            bulkStoreAndWait(dst + kMsgHeaderBytes, smem + kMsgHeaderBytes, (msg_vecs - 1) * 16);
          }
        }
        for (int item = warp; item < a.num_topk * chunks; item += kSenderWarps) {
          const int k = item / chunks, c = item % chunks;
          const int e = s_expert[k], slot = s_slot[k];
          if (slot < 0 || slot >= L.max_tokens) continue;
          const int r = e / L.num_local_experts, le = e % L.num_local_experts;
          if (a.use_tma && !a.c.routes[r].proxy) continue;
          int4* dst = reinterpret_cast<int4*>(a.c.routes[r].dispatch_send +
                                              (static_cast<uint64_t>(le) * L.max_tokens + slot) * msg_bytes);
          const int base = c * 32 * kSendVecsPerLane + lane;
          int4 v[kSendVecsPerLane];
#pragma unroll
          for (int u = 0; u < kSendVecsPerLane; ++u)
            if (base + u * 32 < msg_vecs) v[u] = src[base + u * 32];
          if (base == 0) v[0].y = k;  // the header's top-k slot, for combine
#pragma unroll
          for (int u = 0; u < kSendVecsPerLane; ++u)
            if (base + u * 32 < msg_vecs) stNa(dst + base + u * 32, v[u]);
        }
        // NOTES: the barrier orders every warp's stores before the finish counter's
        // release (and the proxy post's). The additions to a counter form one release
        // sequence, so the thread that completes it has acquired every message of the
        // expert, and its count store releases them at system scope: a receiver that sees
        // the count sees the messages. The barrier also guards the staging buffer.
        namedBarrier(1, kSenderWarps * 32);
        if (tid < a.num_topk) {
          const int e = s_expert[tid], slot = s_slot[tid];
          if (e >= 0) {
            const int r = e / L.num_local_experts, le = e % L.num_local_experts;
            const PeerRoute& route = a.c.routes[r];
            if (route.proxy && slot >= 0 && slot < L.max_tokens) {
              const uint64_t off = (static_cast<uint64_t>(le) * L.max_tokens + slot) * msg_bytes;
              proxyPost(a.c.ring, kProxyData, r, route.dispatch_send + off - a.c.ring.outbox,
                        route.dispatch_remote + off, static_cast<uint64_t>(msg_vecs) * 16);
            }
            if (atomicAddAcqRelGpu(finish + e, 1) + 1 == kFinishTag) signalCount(a, e);
          }
        }
      }
      if (tid == 0) tracePoint(a.c, 2);
    }
  }

  if (!(a.c.phases & kRecvPhase)) return;
  __syncthreads();
  int* s_n = ints;                   // [num_ranks]
  int* s_begin = ints + L.num_ranks;  // [num_ranks + 1]
  const uint64_t rows_per_expert = static_cast<uint64_t>(L.num_ranks) * L.max_tokens;
  const int data_vecs = kFp8 ? L.hidden / 16 : L.hidden / 8;
  const int groups = L.hidden / kHiddenAlign;
  const int parts = (data_vecs + 32 * kRecvVecsPerLane - 1) / (32 * kRecvVecsPerLane);
  for (int le = blockIdx.x; le < L.num_local_experts; le += gridDim.x) {
    for (int s = tid; s < L.num_ranks; s += kThreads) {
      int* count = reinterpret_cast<int*>(a.c.routes[s].count_recv + le * kSignalBytes);
      int v = 0;
      if (a.c.active[s]) {
        v = waitNonZero(count, a.c.timeout_ns);
        if (v == 0) atomicExch(a.c.active + s, 0);  // timed out: masked
      }
      resetSignal(count);  // ready for the round after next
      s_n[s] = v ? -v - 1 : 0;
    }
    __syncthreads();
    if (tid == 0 && le == blockIdx.x) tracePoint(a.c, 4);
    if (tid == 0) {
      int begin = 0;
      for (int s = 0; s < L.num_ranks; ++s) {
        s_begin[s] = begin;
        a.layout_range[le * L.num_ranks + s] = (static_cast<int64_t>(begin) << 32) | static_cast<uint32_t>(s_n[s]);
        begin += s_n[s];
      }
      s_begin[L.num_ranks] = begin;
      a.recv_count[le] = begin;
    }
    __syncthreads();
    const int total = s_begin[L.num_ranks];
    for (int item = warp; item < total * parts; item += kWarps) {
      const int j = item / parts, p = item % parts;
      int s = 0;
      while (s_begin[s + 1] <= j) ++s;
      const int i = j - s_begin[s];
      const PeerRoute& route = a.c.routes[s];
      const char* msg = route.dispatch_recv + (static_cast<uint64_t>(le) * L.max_tokens + i) * msg_bytes;
      const uint64_t row = le * rows_per_expert + j;
      const int4* src = reinterpret_cast<const int4*>(msg + kMsgHeaderBytes);
      int4* data = reinterpret_cast<int4*>(static_cast<char*>(a.recv_x) + row * (kFp8 ? 1ull : 2ull) * L.hidden);
      const int base = p * 32 * kRecvVecsPerLane + lane;
      int4 v[kRecvVecsPerLane];
      if (!route.proxy) {
#pragma unroll
        for (int u = 0; u < kRecvVecsPerLane; ++u)
          if (base + u * 32 < data_vecs) v[u] = ldRecv(src + base + u * 32);
      } else {
#pragma unroll
        for (int u = 0; u < kRecvVecsPerLane; ++u)
          if (base + u * 32 < data_vecs) v[u] = ldRecvSys(src + base + u * 32);
      }
#pragma unroll
      for (int u = 0; u < kRecvVecsPerLane; ++u)
        if (base + u * 32 < data_vecs) data[base + u * 32] = v[u];
      if (p == 0) {
        if (lane == 0) {
          const int4 h = route.proxy ? ldRecvSys(reinterpret_cast<const int4*>(msg))
                                     : ldRecv(reinterpret_cast<const int4*>(msg));
          a.recv_src_info[row] = h.x;
          a.recv_src_slot[row] = h.y;
        }
        if (kFp8) {
          const float* ss = reinterpret_cast<const float*>(msg + kMsgHeaderBytes + L.hidden);
          float* ds = a.recv_scales + row * groups;
          for (int g = lane; g < groups; g += 32) ds[g] = route.proxy ? *static_cast<const volatile float*>(ss + g) : ss[g];
        }
      }
    }
    __syncthreads();  // s_n and s_begin are reused by the next expert
  }
  if (tid == 0) tracePoint(a.c, 5);
}

template <bool kFp8>
void launch(const DispatchArgs& a, cudaStream_t stream) {
  const EpLayout& L = a.c.layout;
  const int grid = a.c.num_sms;
  const int per_block = (L.num_experts + grid - 1) / grid;
  const int ints = per_block > 2 * L.num_ranks + 1 ? per_block : 2 * L.num_ranks + 1;
  const size_t smem = L.dispatch_msg_bytes + static_cast<size_t>(ints) * sizeof(int);
  static std::atomic<size_t> smem_seen[64];
  ensureSmem(reinterpret_cast<const void*>(dispatchKernel<kFp8>), smem, smem_seen, "cudaFuncSetAttribute(dispatch)");
  dispatchKernel<kFp8><<<grid, kThreads, smem, stream>>>(a);
  check(cudaGetLastError(), "dispatch launch");
}

}  // namespace

void dispatch(const DispatchArgs& a, cudaStream_t stream) {
  if (a.use_fp8)
    launch<true>(a, stream);
  else
    launch<false>(a, stream);
}

}  // namespace moelink::ep::kernels
