// Low-latency combine: expert outputs go straight back into their token's rank, one
// region and one flag per (token, top-k slot); the token's rank waits for the flags of its
// token's rows and writes the weighted sum.
//
// One launch, one block of 32 warps per SM. Send phase: a warp per received row (the
// rows of every local expert spread over all SMs' warps): it copies the row to the
// token's rank, then raises the row's flag there. Receive phase: a block per token waits
// for the flags of the rows its dispatch sent (and resets them for the round after next),
// then every thread reduces one 16-byte column over the top-k rows.
#include <cuda_bf16.h>

#include "moelink/ep/kernels.h"
#include "launch.h"
#include "sync.cuh"

namespace moelink::ep::kernels {

namespace {

constexpr int kWarps = 32;
constexpr int kThreads = kWarps * 32;
constexpr int kVecsPerLane = 8;  // a send batch: 32 lanes x 8 x 16 B

template <bool kIbgda>  // some peer is reached through IBGDA
__global__ void __launch_bounds__(kThreads, 1) combineKernel(CombineArgs a) {
  const EpLayout& L = a.c.layout;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int vecs = L.hidden / 8;  // 16-byte vectors per bf16 row
  extern __shared__ int s_active[];  // [num_ranks]: the mask as this launch starts
  if (tid == 0) tracePoint(a.c, 0);

  if (a.c.phases & kSendPhase) {
    // A snapshot, so that every lane of a warp takes the same branch below (the mask may
    // change while the kernel runs, when a receiver times out).
    for (int r = tid; r < L.num_ranks; r += kThreads) s_active[r] = a.c.active[r];
    __syncthreads();
    // Item (w, pair): rows w, w + per_pair, ... of one (local expert, source) pair.
    // Consecutive items go to the same warp of consecutive blocks, so that every SM sends a
    // share of the rows.
    const int warps_total = gridDim.x * kWarps;
    const int pairs = L.num_local_experts * L.num_ranks;
    const int per_pair = max(1, warps_total / pairs);
    const uint64_t rows_per_expert = static_cast<uint64_t>(L.num_ranks) * L.max_tokens;
    for (int item = warp * gridDim.x + blockIdx.x; item < per_pair * pairs; item += warps_total) {
      const int pair = item % pairs, w = item / pairs;
      const int le = pair / L.num_ranks, s = pair % L.num_ranks;
      if (!s_active[s]) continue;  // uniform over the warp
      const int64_t lr = __ldg(a.layout_range + pair);  // (begin << 32) | n
      const int begin = static_cast<int>(lr >> 32), n = static_cast<int>(lr & 0xffffffff);
      for (int i = w; i < n; i += per_pair) {
        const PeerRoute& route = a.c.routes[s];
        const uint64_t row = le * rows_per_expert + begin + i;
        const uint64_t entry = static_cast<uint64_t>(__ldg(a.src_info + row)) * kMaxTopk + __ldg(a.src_slot + row);
        const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(a.x) + row * 2ull * L.hidden);
        int4* d = reinterpret_cast<int4*>(route.combine_send + entry * L.combine_msg_bytes);
        for (int base = lane; base < vecs; base += 32 * kVecsPerLane) {
          int4 v[kVecsPerLane];
#pragma unroll
          for (int u = 0; u < kVecsPerLane; ++u)
            if (base + u * 32 < vecs) v[u] = ldNc(src + base + u * 32);
#pragma unroll
          for (int u = 0; u < kVecsPerLane; ++u)
            if (base + u * 32 < vecs) stNa(d + base + u * 32, v[u]);
        }
        // NOTES: the warp barrier orders every lane's stores before lane 0's system-scope
        // release of the flag (cumulative): a reader that sees the flag sees the row. For a
        // proxy peer the row's post precedes the flag's in the ring, and the proxy delivers
        // in ring order.
        __syncwarp();
        if (lane == 0) {
          if (route.proxy) {
            const uint64_t off = entry * L.combine_msg_bytes;
            proxyPost(a.c.ring, kProxyData, s, route.combine_send + off - a.c.ring.outbox, route.combine_remote + off,
                      L.combine_msg_bytes);
            proxyPost(a.c.ring, kProxySignal, s, 1, route.flag_remote + entry * kSignalBytes, kSignalBytes);
          } else if (kIbgda && route.qp != nullptr) {
            const uint64_t off = entry * L.combine_msg_bytes;
            ibgdaPostData(route, route.combine_send + off, route.combine_remote + off, L.combine_msg_bytes);
            ibgdaPostSignal(route, route.flag_remote + entry * kSignalBytes, 1);
          } else {
            stReleaseSys(reinterpret_cast<int*>(route.flag_send + entry * kSignalBytes), 1);
          }
        }
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
      const uint64_t entry = static_cast<uint64_t>(t) * kMaxTopk + tid;
      int ok = 0;
      // Only the rows this rank's dispatch sent come back (not those of inactive ranks, or
      // of a repeated expert's overflow).
      if (e >= 0 && e < L.num_experts && a.c.sent[entry]) {
        const int r = static_cast<int>(e) / L.num_local_experts;
        const PeerRoute& route = a.c.routes[r];
        if (a.c.active[r]) {
          int* flag = reinterpret_cast<int*>(route.flag_recv + entry * kSignalBytes);
          ok = waitNonZero(flag, a.c.timeout_ns) != 0;
          if (ok)
            resetSignal(flag);  // ready for the round after next
          else
            atomicExch(a.c.active + r, 0);  // timed out: masked
        }
        s_rows[tid] = route.combine_recv + entry * L.combine_msg_bytes;
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
  if (tid == 0) tracePoint(a.c, 3);
}

}  // namespace

void combine(const CombineArgs& a, cudaStream_t stream) {
  const size_t smem = a.c.layout.num_ranks * sizeof(int);
  static std::atomic<size_t> smem_seen[64];
  if (a.c.ibgda) {
    static std::atomic<size_t> smem_seen_ibgda[64];
    ensureSmem(reinterpret_cast<const void*>(combineKernel<true>), smem, smem_seen_ibgda, "cudaFuncSetAttribute(combine)");
    combineKernel<true><<<a.c.num_sms, kThreads, smem, stream>>>(a);
  } else {
    ensureSmem(reinterpret_cast<const void*>(combineKernel<false>), smem, smem_seen, "cudaFuncSetAttribute(combine)");
    combineKernel<false><<<a.c.num_sms, kThreads, smem, stream>>>(a);
  }
  check(cudaGetLastError(), "combine launch");
}

}  // namespace moelink::ep::kernels
