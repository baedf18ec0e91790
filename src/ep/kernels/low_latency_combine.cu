// Low-latency combine: each rank weights and sums the expert outputs it holds for a token
// and sends the token's rank one bf16 row (not one per top-k entry); the token's rank adds
// up the rows of the ranks its dispatch reached.
//
// One launch, one block of 32 warps per SM. Send phase:
//  1. Routes: block r sends rank r (itself included) this rank's route entries, per
//     (token, top-k) the expert, the slot its dispatch claimed there and the weight, then
//     raises its route flag there.
//  2. Every block waits for the route flags of the active sources (the last block to have
//     read them resets them for the round after next).
//  3. Groups: a team of 8 warps per (source, token) that has entries here: it looks the
//     entries' rows up in the dispatch's layout, sums weight * row in fp32 over them, writes
//     the bf16 sum into the token's rank at the slot of the token's first entry here
//     (combine_x[token][k]), and raises that slot's flag (release after a team barrier).
// Receive phase: a block per token waits for the flags of its first entry at each rank its
// dispatch reached (and resets them), then every thread adds up one 16-byte column.
//
// (Measured, EP4 on 4x H200, 128 tokens: a bulk L2 prefetch of every row this rank holds,
// issued by each block while the routes travel, delayed the routes' arrival from 5.8 to 19 us
// and made the combine 2.3x slower.)
//
// The payload crossing the links is one row per (token, destination rank): with top-8 of
// 256 experts on 4 ranks about 3.6 rows per token instead of 8. The partial sums are
// rounded to bf16 once before the token's rank adds them (in fp32).
#include <cuda_bf16.h>

#include <climits>

#include "moelink/ep/low_latency_kernels.h"
#include "launch.h"
#include "sync.cuh"

namespace moelink::ep::kernels {

namespace {

constexpr int kWarps = 32;
constexpr int kThreads = kWarps * 32;
constexpr int kTeams = 4;                        // send-phase teams per block
constexpr int kTeamThreads = kThreads / kTeams;  // 8 warps
constexpr int kRowsInFlight = 2;                 // rows loaded together per column
constexpr int kColsPerThread = 2;                // columns (16 B) a thread works on together
constexpr int kRouteFlagBase = kMaxTopk + 1;     // route flag = tokens * base + top-k (never 0)
constexpr int kRelayTimedOut = INT_MIN;          // relayed for a proxy source's route flag that never came

// A barrier of one team's 256 threads (named barriers 1..kTeams; 0 is __syncthreads).
__device__ __forceinline__ void teamSync(int team) {
  asm volatile("bar.sync %0, %1;" ::"r"(team + 1), "r"(kTeamThreads) : "memory");
}

// Route entry i of this rank: the expert, the slot its dispatch claimed there and the weight;
// expert -1 where the dispatch sent nothing (masked rank, a repeated expert's overflow).
__device__ __forceinline__ int4 routeEntry(const CombineArgs& a, int i) {
  const int t = i / a.num_topk, k = i % a.num_topk;
  const int slot = a.c.sent[static_cast<uint64_t>(t) * kMaxTopk + k];
  const int e = static_cast<int>(__ldg(a.topk_idx + i));
  const float w = __ldg(a.topk_weights + i);
  return make_int4(slot >= 0 ? e : -1, slot, __float_as_int(w), 0);
}

// This rank's route entries to rank r, then the route flag; by the whole block. `first`:
// the thread's entry threadIdx.x, loaded beforehand.
template <bool kIbgda>
__device__ void sendRoutes(const CombineArgs& a, int r, int4 first) {
  const PeerRoute& route = a.c.routes[r];
  const int n = a.num_tokens * a.num_topk;
  int4* dst = reinterpret_cast<int4*>(route.route_send);
  if (static_cast<int>(threadIdx.x) < n) stNa(dst + threadIdx.x, first);
  for (int i = threadIdx.x + kThreads; i < n; i += kThreads) stNa(dst + i, routeEntry(a, i));
  // NOTES: the barrier orders every thread's entries before thread 0's system-scope release
  // of the flag (or its proxy/queue-pair posts, data before signal).
  __syncthreads();
  if (threadIdx.x != 0) return;
  const int flag = a.num_tokens * kRouteFlagBase + a.num_topk;
  const uint64_t bytes = static_cast<uint64_t>(n) * kRouteEntryBytes;
  if (route.proxy) {
    if (n > 0) proxyPost(a.c.ring, kProxyData, r, route.route_send - a.c.ring.outbox, route.route_remote, bytes);
    proxyPost(a.c.ring, kProxySignal, r, static_cast<uint32_t>(flag), route.route_flag_remote, kSignalBytes);
  } else if (kIbgda && route.qp != nullptr) {
    if (n > 0) ibgdaPostData(route, route.route_send, route.route_remote, bytes);
    ibgdaPostSignal(route, route.route_flag_remote, flag);
  } else {
    stReleaseSys(reinterpret_cast<int*>(route.route_flag_send), flag);
  }
}

template <bool kIbgda>  // some peer is reached through IBGDA
__global__ void __launch_bounds__(kThreads, 1) combineKernel(CombineArgs a) {
  const EpLayout& L = a.c.layout;
  const int tid = threadIdx.x, warp = tid / 32;
  const int vecs = L.hidden / 8;  // 16-byte vectors per bf16 row
  // Dynamic shared memory: the layout_range copy [local expert][source] (8-byte aligned,
  // first), the active mask as this launch starts [ranks], the route flags seen [ranks].
  extern __shared__ __align__(16) char smem[];
  int64_t* s_range = reinterpret_cast<int64_t*>(smem);
  int* s_active = reinterpret_cast<int*>(s_range + L.num_experts);
  int* s_hdr = s_active + L.num_ranks;
  if (tid == 0) tracePoint(a.c, 0);

  if (a.c.phases & kSendPhase) {
    // Blocks that send routes load their first entries alongside the mask.
    const int4 first = static_cast<int>(blockIdx.x) < L.num_ranks && tid < a.num_tokens * a.num_topk
                           ? routeEntry(a, tid)
                           : make_int4(-1, -1, 0, 0);
    // A snapshot, so that the branches below are uniform (the mask may change while the
    // kernel runs, when a receiver times out).
    for (int r = tid; r < L.num_ranks; r += kThreads) s_active[r] = a.c.active[r];
    __syncthreads();
    for (int r = blockIdx.x; r < L.num_ranks; r += gridDim.x)
      if (s_active[r]) sendRoutes<kIbgda>(a, r, first);
    // Read while the routes are on their way (ordered before use by the barrier below).
    for (int i = tid; i < L.num_experts; i += kThreads) s_range[i] = __ldg(a.layout_range + i);

    // A proxy source's route flag is in host memory: one block (the source's watcher) polls it
    // and relays its value through this GPU's memory, which the other blocks poll. (With every
    // block polling the host's flags, each of this GPU's posts to the proxy took ~120 us:
    // 4x H200, EP4 over 2 virtual hosts.)
    for (int s = tid; s < L.num_ranks; s += kThreads) {
      int v = 0;
      if (s_active[s]) {
        const int* flag = reinterpret_cast<const int*>(a.c.routes[s].route_flag_recv);
        if (!a.c.routes[s].proxy) {
          v = waitNonZero(flag, a.c.timeout_ns);
        } else if (s % static_cast<int>(gridDim.x) == static_cast<int>(blockIdx.x)) {
          v = waitNonZero(flag, a.c.timeout_ns);
          stReleaseGpu(a.relay + s, v != 0 ? v : kRelayTimedOut);
        } else {
          const int r = waitNonZero<true>(a.relay + s, a.c.timeout_ns);
          v = r == kRelayTimedOut ? 0 : r;
        }
        // A peer wrote this flag: its token count sizes the reads of the peer's route
        // entries and the rows sent back; past this buffer's max_tokens (or negative) they would
        // run past their regions, so such a source is masked as one that timed out.
        if (v < 0 || v / kRouteFlagBase > L.max_tokens) v = 0;
        if (v == 0) atomicExch(a.c.active + s, 0);  // timed out (or a bad flag): masked
      }
      s_hdr[s] = v;
    }
    __syncthreads();
    if (tid == 0) {
      tracePoint(a.c, 4);
      // The last block to get here resets the flags: every block has read them by then.
      int* seen = a.blocks_seen;
      if (atomicAdd(seen, 1) == static_cast<int>(gridDim.x) - 1) {
        for (int s = 0; s < L.num_ranks; ++s) {
          resetSignal(reinterpret_cast<int*>(a.c.routes[s].route_flag_recv));
          a.relay[s] = 0;
        }
        *seen = 0;
      }
    }

    __shared__ int64_t s_row[kTeams][kMaxTopk];  // -1: entry not here, -2: here but not received
    __shared__ float s_weight[kTeams][kMaxTopk];
    const int team = warp / (kWarps / kTeams), ttid = tid % kTeamThreads;
    int max_tokens = 0;
    for (int s = 0; s < L.num_ranks; ++s) max_tokens = max(max_tokens, s_hdr[s] / kRouteFlagBase);
    const int items = max_tokens * L.num_ranks;
    const int64_t rows_per_expert = static_cast<int64_t>(L.num_ranks) * L.max_tokens;
    const int first_expert = a.c.rank * L.num_local_experts;
    const int4* x = static_cast<const int4*>(a.x);
    // Item (source, token), sources interleaved so that the teams at work at any moment
    // write to every rank; consecutive items on different SMs.
    for (int item = blockIdx.x + team * gridDim.x; item < items; item += kTeams * gridDim.x) {
      const int s = item % L.num_ranks, t = item / L.num_ranks;
      const int hdr = s_hdr[s];
      if (hdr == 0 || t >= hdr / kRouteFlagBase) continue;  // uniform over the team
      const int topk = hdr % kRouteFlagBase;
      const PeerRoute& route = a.c.routes[s];
      if (ttid < topk) {
        const int4* ent = reinterpret_cast<const int4*>(route.route_recv) + static_cast<uint64_t>(t) * topk + ttid;
        const int4 v = route.proxy ? ldRecvSys(ent) : ldRecv(ent);
        int64_t row = -1;
        if (v.x >= first_expert && v.x < first_expert + L.num_local_experts) {
          const int le = v.x - first_expert;
          const int64_t lr = s_range[le * L.num_ranks + s];  // (begin << 32) | n
          const int begin = static_cast<int>(lr >> 32), n = static_cast<int>(lr & 0xffffffff);
          row = v.y >= 0 && v.y < n ? le * rows_per_expert + begin + v.y : -2;
        }
        s_row[team][ttid] = row;
        s_weight[team][ttid] = __int_as_float(v.z);
      }
      teamSync(team);
      // The token's first entry here names the slot its sum goes back in. A group missing a
      // row (its count timed out in the dispatch) sends nothing: the token's rank times out
      // on it rather than taking a partial sum.
      int lead = -1;
      bool whole = true;
      for (int k = 0; k < topk; ++k) {
        const int64_t row = s_row[team][k];
        whole = whole && row != -2;
        if (lead < 0 && row >= 0) lead = k;
      }
      const bool send = lead >= 0 && whole;
      const uint64_t entry = static_cast<uint64_t>(t) * kMaxTopk + lead;
      if (send) {
        int4* dst = reinterpret_cast<int4*>(route.combine_send + entry * L.combine_msg_bytes);
        for (int h0 = ttid; h0 < vecs; h0 += kColsPerThread * kTeamThreads) {
          float acc[kColsPerThread][8];
#pragma unroll
          for (int c = 0; c < kColsPerThread; ++c)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[c][j] = 0.0f;
          for (int k0 = lead; k0 < topk; k0 += kRowsInFlight) {
            int4 v[kColsPerThread][kRowsInFlight];
#pragma unroll
            for (int u = 0; u < kRowsInFlight; ++u) {
              const int64_t row = k0 + u < topk ? s_row[team][k0 + u] : -1;
#pragma unroll
              for (int c = 0; c < kColsPerThread; ++c) {
                const int h = h0 + c * kTeamThreads;
                if (row >= 0 && h < vecs) v[c][u] = ldNc(x + row * vecs + h);
              }
            }
#pragma unroll
            for (int u = 0; u < kRowsInFlight; ++u) {
              if (k0 + u >= topk || s_row[team][k0 + u] < 0) continue;
              const float w = s_weight[team][k0 + u];
#pragma unroll
              for (int c = 0; c < kColsPerThread; ++c) {
                const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v[c][u]);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                  const float2 f = __bfloat1622float2(b[j]);
                  acc[c][2 * j] += w * f.x;
                  acc[c][2 * j + 1] += w * f.y;
                }
              }
            }
          }
#pragma unroll
          for (int c = 0; c < kColsPerThread; ++c) {
            const int h = h0 + c * kTeamThreads;
            if (h >= vecs) continue;
            int4 o;
            __nv_bfloat162* ob = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
            for (int j = 0; j < 4; ++j) ob[j] = __floats2bfloat162_rn(acc[c][2 * j], acc[c][2 * j + 1]);
            stNa(dst + h, o);
          }
        }
      }
      // NOTES: the team barrier orders every thread's stores of the row before thread 0's
      // system-scope release of the flag (cumulative): a reader that sees the flag sees the
      // row. For a proxy peer the row's post precedes the flag's in the ring, and the proxy
      // delivers in ring order. The barrier also guards s_row for the team's next item.
      teamSync(team);
      if (ttid == 0 && send) {
        const uint64_t off = entry * L.combine_msg_bytes;
        if (route.proxy) {
          proxyPost(a.c.ring, kProxyData, s, route.combine_send + off - a.c.ring.outbox, route.combine_remote + off,
                    L.combine_msg_bytes);
          proxyPost(a.c.ring, kProxySignal, s, 1, route.flag_remote + entry * kSignalBytes, kSignalBytes);
        } else if (kIbgda && route.qp != nullptr) {
          ibgdaPostData(route, route.combine_send + off, route.combine_remote + off, L.combine_msg_bytes);
          ibgdaPostSignal(route, route.flag_remote + entry * kSignalBytes, 1);
        } else {
          stReleaseSys(reinterpret_cast<int*>(route.flag_send + entry * kSignalBytes), 1);
        }
      }
    }
    if (tid == 0) tracePoint(a.c, 1);
  }

  if (!(a.c.phases & kRecvPhase)) return;
  // With proxy peers, the receive phase (whose waits poll host memory for the proxy sources'
  // flags) starts once every block has posted its rows: polling host memory holds the posts.
  if ((a.c.phases & kSendPhase) && a.c.ring.entries != nullptr) {
    __syncthreads();
    if (tid == 0) {
      int* done = a.gate;
      int* past = a.gate + 1;
      atomicAdd(done, 1);
      while (ldAcquireGpu(done) < static_cast<int>(gridDim.x)) {
      }
      if (atomicAdd(past, 1) == static_cast<int>(gridDim.x) - 1) {  // the last one through resets
        *done = 0;
        *past = 0;
      }
    }
    __syncthreads();
  }
  __shared__ int s_dest[kMaxTopk];  // the entry's rank, -1 where the dispatch sent nothing
  __shared__ int s_valid[kMaxTopk];
  __shared__ const char* s_rows[kMaxTopk];
  __shared__ int s_proxy;  // some row comes from a proxy source (host memory)
  for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
    if (tid == 0) s_proxy = 0;
    if (tid < a.num_topk) {
      const uint64_t entry = static_cast<uint64_t>(t) * kMaxTopk + tid;
      const int64_t e = a.topk_idx[static_cast<size_t>(t) * a.num_topk + tid];
      s_dest[tid] = a.c.sent[entry] >= 0 && e >= 0 && e < L.num_experts ? static_cast<int>(e) / L.num_local_experts
                                                                         : -1;
    }
    __syncthreads();
    if (tid < a.num_topk) {
      const uint64_t entry = static_cast<uint64_t>(t) * kMaxTopk + tid;
      int ok = 0;
      // One row per rank the dispatch reached, in the slot of the token's first entry there.
      if (leadsRow(s_dest, tid)) {
        const int r = s_dest[tid];
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
    }
    __syncthreads();
    if (tid == 0 && t == blockIdx.x) tracePoint(a.c, 2);
    for (int h = tid; h < vecs; h += kThreads) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      // Eight rows' loads in flight at a time, within the register budget.
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
            const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float2 f = __bfloat1622float2(b[j]);
              acc[2 * j] += f.x;
              acc[2 * j + 1] += f.y;
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

void preloadCombine() {
  cudaFuncAttributes attr;
  check(cudaFuncGetAttributes(&attr, combineKernel<true>), "loading the combine kernel");
  check(cudaFuncGetAttributes(&attr, combineKernel<false>), "loading the combine kernel");
}

void combine(const CombineArgs& a, cudaStream_t stream) {
  const EpLayout& L = a.c.layout;
  const size_t smem = static_cast<size_t>(L.num_experts) * sizeof(int64_t) + 2ull * L.num_ranks * sizeof(int);
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
