// Low-latency combine: expert outputs go straight back into their token's rank, one
// region per (token, top-k slot); the token's rank waits for the experts' flags and
// writes the weighted sum.
//
// One launch, one block of 32 warps per SM. Send phase: each half-block (16 warps) takes
// (local expert, destination rank) pairs: the pair's rows are split into chunks over the
// warps, then one thread raises the expert's flag at the destination. Receive phase: a
// block per token waits for the flags of its experts, then every thread reduces one
// 16-byte column over the top-k rows. The last block to finish clears the flags.
#include <cuda_bf16.h>

#include "moelink/ep/kernels.h"
#include "launch.h"
#include "sync.cuh"

namespace moelink::ep::kernels {

namespace {

constexpr int kWarps = 32;
constexpr int kThreads = kWarps * 32;
constexpr int kGroups = 2;  // send-phase groups per block
constexpr int kGroupWarps = kWarps / kGroups;
constexpr int kVecsPerLane = 8;  // a send chunk: 32 lanes x 8 x 16 B

__global__ void __launch_bounds__(kThreads, 1) combineKernel(CombineArgs a) {
  const EpLayout& L = a.c.layout;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int vecs = L.hidden / 8;  // 16-byte vectors per bf16 row
  extern __shared__ int s_active[];  // [num_ranks]: the mask as this launch starts
  if (tid == 0) tracePoint(a.c, 0);

  if (a.c.phases & kSendPhase) {
    // A snapshot, so that every thread of a group takes the same branch below (the mask
    // may change while the kernel runs, when a receiver times out).
    for (int r = tid; r < L.num_ranks; r += kThreads) s_active[r] = a.c.active[r];
    __syncthreads();
    const int group = warp / kGroupWarps, gwarp = warp % kGroupWarps, gtid = tid % (kGroupWarps * 32);
    const int parts = (vecs + 32 * kVecsPerLane - 1) / (32 * kVecsPerLane);
    const uint64_t rows_per_expert = static_cast<uint64_t>(L.num_ranks) * L.max_tokens;
    for (int pair = blockIdx.x * kGroups + group; pair < L.num_local_experts * L.num_ranks;
         pair += gridDim.x * kGroups) {
      const int le = pair / L.num_ranks, dst = pair % L.num_ranks;
      if (!s_active[dst]) continue;  // uniform over the group
      const PeerRoute& route = a.c.routes[dst];
      const int64_t lr = a.layout_range[pair];
      const int begin = static_cast<int>(lr >> 32), n = static_cast<int>(lr & 0xffffffff);
      for (int item = gwarp; item < n * parts; item += kGroupWarps) {
        const int i = item / parts, p = item % parts;
        const uint64_t row = le * rows_per_expert + begin + i;
        const int t = __ldg(a.src_info + row), k = __ldg(a.src_slot + row);
        const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(a.x) + row * 2ull * L.hidden);
        int4* d = reinterpret_cast<int4*>(route.combine_send + (static_cast<uint64_t>(t) * kMaxTopk + k) * L.combine_msg_bytes);
        const int base = p * 32 * kVecsPerLane + lane;
        int4 v[kVecsPerLane];
#pragma unroll
        for (int u = 0; u < kVecsPerLane; ++u)
          if (base + u * 32 < vecs) v[u] = ldNc(src + base + u * 32);
#pragma unroll
        for (int u = 0; u < kVecsPerLane; ++u)
          if (base + u * 32 < vecs) stNa(d + base + u * 32, v[u]);
      }
      // NOTES: the barrier orders the group's stores before the flag's system-scope release
      // (cumulative): a reader that sees the flag sees the rows. Proxy posts follow the
      // same barrier, and the flag's post comes after the rows' posts in the ring.
      namedBarrier(1 + group, kGroupWarps * 32);
      const int e = a.c.rank * L.num_local_experts + le;
      if (route.proxy) {
        for (int i = gtid; i < n; i += kGroupWarps * 32) {
          const uint64_t row = le * rows_per_expert + begin + i;
          const uint64_t off = (static_cast<uint64_t>(a.src_info[row]) * kMaxTopk + a.src_slot[row]) * L.combine_msg_bytes;
          proxyPost(a.c.ring, kProxyData, dst, route.combine_send + off - a.c.ring.outbox, route.combine_remote + off,
                    L.combine_msg_bytes);
        }
        namedBarrier(1 + group, kGroupWarps * 32);
        if (gtid == 0) proxyPost(a.c.ring, kProxySignal, dst, 1, route.flag_remote + e * kSignalBytes, kSignalBytes);
      } else if (gtid == 0) {
        stReleaseSys(reinterpret_cast<int*>(route.flag_send + e * kSignalBytes), 1);
      }
    }
    if (tid == 0) tracePoint(a.c, 1);
  }

  if (!(a.c.phases & kRecvPhase)) return;
  __shared__ int s_valid[kMaxTopk];
  __shared__ float s_weight[kMaxTopk];
  __shared__ const char* s_rows[kMaxTopk];
  __shared__ int s_proxy;  // some row comes from a proxy source (host memory)
  for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
    if (tid == 0) s_proxy = 0;
    __syncthreads();
    if (tid < a.num_topk) {
      const int64_t e = a.topk_idx[static_cast<size_t>(t) * a.num_topk + tid];
      int ok = 0;
      if (e >= 0 && e < L.num_experts) {
        const int r = static_cast<int>(e) / L.num_local_experts;
        const PeerRoute& route = a.c.routes[r];
        if (a.c.active[r]) {
          ok = waitNonZero(reinterpret_cast<const int*>(route.flag_recv + e * kSignalBytes), a.c.timeout_ns) != 0;
          if (!ok) atomicExch(a.c.active + r, 0);  // timed out: masked
        }
        s_rows[tid] = route.combine_recv + (static_cast<uint64_t>(t) * kMaxTopk + tid) * L.combine_msg_bytes;
        if (ok && route.proxy) s_proxy = 1;
      }
      s_valid[tid] = ok;
      s_weight[tid] = ok ? a.topk_weights[static_cast<size_t>(t) * a.num_topk + tid] : 0.0f;
    }
    __syncthreads();
    if (tid == 0 && t == blockIdx.x) tracePoint(a.c, 2);
    for (int h = tid; h < vecs; h += kThreads) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      // Eight rows' loads in flight at a time (all of a top-8), within the register budget.
      for (int k0 = 0; k0 < a.num_topk; k0 += 8) {
        int4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u)
          if (k0 + u < a.num_topk && s_valid[k0 + u])
            v[u] = s_proxy ? ldRecvSys(reinterpret_cast<const int4*>(s_rows[k0 + u]) + h)
                           : ldRecv(reinterpret_cast<const int4*>(s_rows[k0 + u]) + h);
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          if (k0 + u < a.num_topk && s_valid[k0 + u]) {
            const float w = s_weight[k0 + u];
            const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float2 f = __bfloat1622float2(b[j]);
              acc[2 * j] += w * f.x;
              acc[2 * j + 1] += w * f.y;
            }
          }
        }
      }
      int4 o;
      __nv_bfloat162* ob = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int j = 0; j < 4; ++j) ob[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
      reinterpret_cast<int4*>(static_cast<char*>(a.out) + static_cast<uint64_t>(t) * 2 * L.hidden)[h] = o;
    }
    __syncthreads();
  }
  // The last block to finish clears the flags for the round after next.
  // NOTES: every expert raises its flag here, also those no token of this rank used, and a
  // flag that arrived after the clear would survive into a later round (which would then
  // read before its data came). So the last block first waits for every active expert's
  // flag of this round; only then is no write of this round still on its way. Blocks
  // still reading flags are done by then (each counts itself finished after its tokens).
  if (tid == 0) tracePoint(a.c, 3);
  int* finished = a.scratch + 3 * L.num_experts;
  __shared__ bool s_last;
  if (tid == 0) {
    __threadfence();
    s_last = atomicAdd(finished, 1) == static_cast<int>(gridDim.x) - 1;
  }
  __syncthreads();
  if (!s_last) return;
  for (int e = tid; e < L.num_experts; e += kThreads) {
    const int r = e / L.num_local_experts;
    const int* flag = reinterpret_cast<const int*>(a.c.routes[r].flag_recv + e * kSignalBytes);
    if (a.c.active[r] && !waitNonZero(flag, a.c.timeout_ns)) atomicExch(a.c.active + r, 0);
  }
  __syncthreads();
  for (int e = tid; e < L.num_experts; e += kThreads)
    resetSignal(reinterpret_cast<int*>(a.c.routes[e / L.num_local_experts].flag_recv + e * kSignalBytes));
  if (tid == 0) {
    *finished = 0;
    tracePoint(a.c, 4);
  }
}

}  // namespace

void combine(const CombineArgs& a, cudaStream_t stream) {
  const size_t smem = a.c.layout.num_ranks * sizeof(int);
  static std::atomic<size_t> smem_seen[64];
  ensureSmem(reinterpret_cast<const void*>(combineKernel), smem, smem_seen, "cudaFuncSetAttribute(combine)");
  combineKernel<<<a.c.num_sms, kThreads, smem, stream>>>(a);
  check(cudaGetLastError(), "combine launch");
}

}  // namespace moelink::ep::kernels
