// Low-latency dispatch: every token goes straight into the receive rows of each rank that
// holds one of its experts (once per rank), with a slot entry per (token, top-k) naming
// the row; per-expert counts follow; the receiver packs per expert.
//
// One launch, one block of 32 warps per SM. Send phase: the block first counts the tokens
// of the experts it accounts for. Then it takes its tokens in turn: claim a slot per
// top-k entry and write its entry, stage the token's payload (bf16, or e4m3 + scales) in
// shared memory, then write it once to every destination rank: as one bulk copy (TMA)
// per NVLink destination, issued by the thread of the rank's first top-k entry (use_tma),
// or with the row split into chunks over the warps (proxy destinations, or use_tma off).
// Each (token, top-k) then adds 1 to its expert's finish counter; whichever addition
// completes an expert's counter sends its count. Receive phase: a block per local expert
// waits for every source's count and lays the expert out; it and up to three more blocks
// (where the grid has them) copy the rows the slots name into the packed outputs.
// (Measured, EP4 on 4x H200, 128 tokens: bulk L2 prefetches of each block's token rows during
// the count staged the first token 0.8 us earlier but left the call's time as it was, 28.1-28.8
// against 28.5 us: the sends and the counts' crossing set it, not the loads.)
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <atomic>

#include "moelink/ep/low_latency_kernels.h"
#include "launch.h"
#include "sync.cuh"

namespace moelink::ep::kernels {

namespace {

constexpr int kWarps = 32;
constexpr int kThreads = kWarps * 32;
constexpr int kSendVecsPerLane = 4;       // a send chunk: 32 lanes x 4 x 16 B
constexpr int kFinishTag = 1 << 30;  // above any expert's count (tokens * top-k < 2^30)
constexpr float kFp8Max = 448.0f;
constexpr int kMaxSplit = 4;  // receive blocks per local expert
constexpr int kRecvVecsPerLane = 4;  // a receive chunk: 32 lanes x 4 x 16 B

__device__ __forceinline__ float halfWarpMax(float v) {
  for (int o = 8; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Token t's payload into shared memory, by all warps.
template <bool kFp8>
__device__ void stageToken(const DispatchArgs& a, int t, char* payload) {
  const EpLayout& L = a.c.layout;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int4* row = reinterpret_cast<const int4*>(static_cast<const __nv_bfloat16*>(a.x) + static_cast<size_t>(t) * L.hidden);
  if constexpr (!kFp8) {
    int4* dst = reinterpret_cast<int4*>(payload);
    for (int i = tid; i < L.hidden / 8; i += kThreads) dst[i] = ldNc(row + i);
  } else {
    // Half a warp per 128-element group (8 elements per lane); every lane takes part in
    // the shuffles, also where the group count is odd.
    const int groups = L.hidden / kHiddenAlign;
    float* scales = reinterpret_cast<float*>(payload + L.hidden);
    for (int g0 = warp * 2; g0 < groups; g0 += kWarps * 2) {
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
// kIbgda: some peer is reached through IBGDA (the launch without it has no IBGDA code).
template <bool kIbgda>
__device__ void signalCount(const DispatchArgs& a, int e) {
  const EpLayout& L = a.c.layout;
  int* slot_counter = a.scratch;
  int* finish = a.scratch + L.num_experts;
  int* expected = a.scratch + 2 * L.num_experts;
  const int n = expected[e];
  const int r = e / L.num_local_experts, le = e % L.num_local_experts;
  if (a.c.active[r]) {
    const PeerRoute& route = a.c.routes[r];
    const int sent = min(n, L.max_tokens), v = -sent - 1;
    if (route.proxy) {
      // The slot entries first (the ring keeps the order), then the count.
      const uint64_t off = static_cast<uint64_t>(le) * L.max_tokens * 4;
      if (sent > 0)
        proxyPost(a.c.ring, kProxyData, r, route.index_send + off - a.c.ring.outbox, route.index_remote + off,
                  static_cast<uint64_t>(sent) * 4);
      proxyPost(a.c.ring, kProxySignal, r, static_cast<uint32_t>(v), route.count_remote + le * kSignalBytes,
                kSignalBytes);
    } else if (kIbgda && route.qp != nullptr) {
      // The same over the peer's queue pair: the entries' WRITE, then the count fenced behind it.
      const uint64_t off = static_cast<uint64_t>(le) * L.max_tokens * 4;
      if (sent > 0) ibgdaPostData(route, route.index_send + off, route.index_remote + off, static_cast<uint64_t>(sent) * 4);
      ibgdaPostSignal(route, route.count_remote + le * kSignalBytes, v);
    } else {
      stReleaseSys(reinterpret_cast<int*>(route.count_send + le * kSignalBytes), v);
    }
  }
  finish[e] = 0;
  slot_counter[e] = 0;
  expected[e] = 0;
}

// Counts the tokens of the experts this block accounts for (e = blockIdx.x + j * grid) and
// adds them to the experts' finish counters; all threads, before any send. Each (token,
// top-k) entry adds 1 once it is out (or skipped), the count adds tag - n: whichever
// addition completes the tag sends the count, so the count leaves as soon as the expert's
// last row is out, without anyone polling. (Measured: counting in one warp alongside the
// sends took until after the sends, its loads queued behind the block's NVLink traffic,
// and the counts left late.)
template <bool kIbgda>
__device__ void countExperts(const DispatchArgs& a, int* s_counts, int nj) {
  const EpLayout& L = a.c.layout;
  const int tid = threadIdx.x;
  int* finish = a.scratch + L.num_experts;
  int* expected = a.scratch + 2 * L.num_experts;
  for (int j = tid; j < nj; j += kThreads) s_counts[j] = 0;
  __syncthreads();
  const int entries = a.num_tokens * a.num_topk;
  constexpr int kUnroll = 4;  // loads in flight per thread
  for (int i0 = 0; i0 < entries; i0 += kThreads * kUnroll) {
    int64_t e[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u * kThreads + tid;
      e[u] = i < entries ? __ldg(a.topk_idx + i) : -1;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (e[u] >= 0 && e[u] < L.num_experts && (e[u] - blockIdx.x) % gridDim.x == 0)
        atomicAdd(s_counts + (e[u] - blockIdx.x) / gridDim.x, 1);
  }
  __syncthreads();
  // By the last warp: warp 0 goes on to claim the first token's slots meanwhile.
  if (tid / 32 != kWarps - 1) return;
  for (int j = tid % 32; j < nj; j += 32) {
    const int e = blockIdx.x + j * gridDim.x;
    const int n = s_counts[j];
    expected[e] = n;  // published by the release below
    if (atomicAddAcqRelGpu(finish + e, kFinishTag - n) + kFinishTag - n == kFinishTag) signalCount<kIbgda>(a, e);
  }
}

// The receive layout of local expert le from the sources' row counts s_n: begin offsets
// into s_begin [ranks + 1], layout_range and recv_count. By one thread.
__device__ void layoutExpert(const DispatchArgs& a, int le, const int* s_n, int* s_begin) {
  const EpLayout& L = a.c.layout;
  int begin = 0;
  for (int s = 0; s < L.num_ranks; ++s) {
    s_begin[s] = begin;
    a.layout_range[le * L.num_ranks + s] = (static_cast<int64_t>(begin) << 32) | static_cast<uint32_t>(s_n[s]);
    begin += s_n[s];
  }
  s_begin[L.num_ranks] = begin;
  a.recv_count[le] = begin;
}

// Copies local expert le's rows into the packed outputs: of the expert's (row, part) items,
// items first, first + step, ..., one per warp at a time. The first part of a row carries its
// scales (loaded along with the data) and source info.
template <bool kFp8>
__device__ void packRows(const DispatchArgs& a, int le, const int* s_begin, int first, int step) {
  const EpLayout& L = a.c.layout;
  const int lane = threadIdx.x % 32;
  const uint64_t msg_bytes = L.dispatch_msg_bytes;
  const uint64_t rows_per_expert = static_cast<uint64_t>(L.num_ranks) * L.max_tokens;
  const int data_vecs = kFp8 ? L.hidden / 16 : L.hidden / 8;
  const int groups = L.hidden / kHiddenAlign;
  // Scale pairs loaded with the data, one per lane; float2 stores need an even group count
  // (the rows of recv_scales are groups * 4 bytes apart), else the scales go one by one.
  const int pairs = groups % 2 == 0 ? min(groups / 2, 32) : 0;
  const int parts = (data_vecs + 32 * kRecvVecsPerLane - 1) / (32 * kRecvVecsPerLane);
  const int total = s_begin[L.num_ranks];
  for (int item = first; item < total * parts; item += step) {
    const int j = item / parts, p = item % parts;
    int s = 0;
    while (s_begin[s + 1] <= j) ++s;
    const int i = j - s_begin[s];
    const PeerRoute& route = a.c.routes[s];
    const int entry = ldRelaxedSys(reinterpret_cast<const int*>(route.index_recv) + le * L.max_tokens + i);
    const int t = entry / kMaxTopk;
    const char* msg = route.dispatch_recv + t * msg_bytes;
    const uint64_t row = le * rows_per_expert + j;
    const int4* src = reinterpret_cast<const int4*>(msg);
    int4* data = reinterpret_cast<int4*>(static_cast<char*>(a.recv_x) + row * (kFp8 ? 1ull : 2ull) * L.hidden);
    const int base = p * 32 * kRecvVecsPerLane + lane;
    const float* ss = reinterpret_cast<const float*>(msg + L.hidden);
    float2 sc = make_float2(0.0f, 0.0f);
    if (kFp8 && p == 0 && lane < pairs) {
      if (route.proxy) {
        sc.x = *static_cast<const volatile float*>(ss + 2 * lane);
        sc.y = *static_cast<const volatile float*>(ss + 2 * lane + 1);
      } else {
        sc = *reinterpret_cast<const float2*>(ss + 2 * lane);
      }
    }
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
        a.recv_src_info[row] = t;
        a.recv_src_slot[row] = entry % kMaxTopk;
      }
      if (kFp8) {
        float* ds = a.recv_scales + row * groups;
        if (lane < pairs) reinterpret_cast<float2*>(ds)[lane] = sc;
        for (int g = 2 * pairs + lane; g < groups; g += 32)
          ds[g] = route.proxy ? *static_cast<const volatile float*>(ss + g) : ss[g];
      }
    }
  }
}

template <bool kFp8, bool kIbgda>
__global__ void __launch_bounds__(kThreads, 1) dispatchKernel(DispatchArgs a) {
  extern __shared__ __align__(16) char smem[];
  __shared__ int s_expert[kMaxTopk], s_dest[kMaxTopk];
  const EpLayout& L = a.c.layout;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const uint64_t msg_bytes = L.dispatch_msg_bytes;
  const int payload = kFp8 ? L.hidden + L.hidden / kHiddenAlign * 4 : 2 * L.hidden;
  const int msg_vecs = (payload + 15) / 16;
  int* ints = reinterpret_cast<int*>(smem + msg_bytes);   // after the staged row
  if (tid == 0) tracePoint(a.c, 0);

  if (a.c.phases & kSendPhase) {
    // The first token's routing, loaded alongside the counting's loads.
    const int64_t e_first = tid < a.num_topk && static_cast<int>(blockIdx.x) < a.num_tokens
                                ? __ldg(a.topk_idx + static_cast<size_t>(blockIdx.x) * a.num_topk + tid)
                                : -1;
    countExperts<kIbgda>(a, ints, (L.num_experts - blockIdx.x + gridDim.x - 1) / gridDim.x);
    if (tid == 0) tracePoint(a.c, 3);
    {
      int* slot_counter = a.scratch;
      int* finish = a.scratch + L.num_experts;
      const int chunks = (msg_vecs + 32 * kSendVecsPerLane - 1) / (32 * kSendVecsPerLane);
      for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
        if (tid < a.num_topk) {
          // Claim the entry's slot at its expert and write the slot entry; the row follows.
          const int64_t e = t == static_cast<int>(blockIdx.x) ? e_first
                                                               : __ldg(a.topk_idx + static_cast<size_t>(t) * a.num_topk + tid);
          const bool valid = e >= 0 && e < L.num_experts;
          const int r = valid ? static_cast<int>(e) / L.num_local_experts : -1;
          int slot = -1;
          if (valid && a.c.active[r]) slot = atomicAdd(slot_counter + e, 1);
          const bool sent = slot >= 0 && slot < L.max_tokens;  // a repeated expert may overflow
          if (sent) {
            const int le = static_cast<int>(e) % L.num_local_experts;
            reinterpret_cast<int*>(a.c.routes[r].index_send)[static_cast<uint64_t>(le) * L.max_tokens + slot] =
                t * kMaxTopk + tid;
          }
          a.c.sent[static_cast<uint64_t>(t) * kMaxTopk + tid] = sent ? slot : -1;
          s_expert[tid] = valid ? static_cast<int>(e) : -1;
          s_dest[tid] = sent ? r : -1;
        }
        stageToken<kFp8>(a, t, smem);
        if (a.use_tma) fenceProxyAsyncShared();
        __syncthreads();
        if (tid == 0 && t == blockIdx.x) tracePoint(a.c, 1);
        const int4* src = reinterpret_cast<const int4*>(smem);
        if (a.use_tma && tid < a.num_topk && leadsRow(s_dest, tid) && !a.c.routes[s_dest[tid]].proxy) {
          // One bulk copy per NVLink (or local) destination; proxy destinations (host
          // memory) go through the warps below.
          bulkStoreAndWait(a.c.routes[s_dest[tid]].dispatch_send + t * msg_bytes, smem, msg_vecs * 16);
        }
        for (int item = warp; item < a.num_topk * chunks; item += kWarps) {
          const int k = item / chunks, c = item % chunks;
          if (!leadsRow(s_dest, k)) continue;
          const PeerRoute& route = a.c.routes[s_dest[k]];
          if (a.use_tma && !route.proxy) continue;
          int4* dst = reinterpret_cast<int4*>(route.dispatch_send + t * msg_bytes);
          const int base = c * 32 * kSendVecsPerLane + lane;
          int4 v[kSendVecsPerLane];
#pragma unroll
          for (int u = 0; u < kSendVecsPerLane; ++u)
            if (base + u * 32 < msg_vecs) v[u] = src[base + u * 32];
#pragma unroll
          for (int u = 0; u < kSendVecsPerLane; ++u)
            if (base + u * 32 < msg_vecs) stNa(dst + base + u * 32, v[u]);
        }
        // NOTES: the barrier orders every warp's stores (rows and slot entries) before the
        // finish counters' releases and the proxy posts. The additions to a counter form
        // one release sequence, so the thread that completes it has acquired every row and
        // entry of the expert, and its count store releases them at system scope: a
        // receiver that sees the count sees them. The barrier also guards the staging
        // buffer. A row shared by several entries is posted to the proxy or the queue pair
        // (by the lead entry) before any of those entries adds to its counter (the warp
        // barrier), so the row's ticket (WQE index) precedes every count that covers it.
        __syncthreads();
        if (warp == 0) {
          const bool mine = tid < a.num_topk;
          const int e = mine ? s_expert[tid] : -1;
          if (mine && leadsRow(s_dest, tid) && a.c.routes[s_dest[tid]].proxy) {
            const PeerRoute& route = a.c.routes[s_dest[tid]];
            proxyPost(a.c.ring, kProxyData, s_dest[tid], route.dispatch_send + t * msg_bytes - a.c.ring.outbox,
                      route.dispatch_remote + t * msg_bytes, static_cast<uint64_t>(msg_vecs) * 16);
          } else if (kIbgda && mine && leadsRow(s_dest, tid) && a.c.routes[s_dest[tid]].qp != nullptr) {
            const PeerRoute& route = a.c.routes[s_dest[tid]];
            ibgdaPostData(route, route.dispatch_send + t * msg_bytes, route.dispatch_remote + t * msg_bytes,
                          static_cast<uint64_t>(msg_vecs) * 16);
          }
          __syncwarp();
          if (e >= 0 && atomicAddAcqRelGpu(finish + e, 1) + 1 == kFinishTag) signalCount<kIbgda>(a, e);
        }
      }
      if (tid == 0) tracePoint(a.c, 2);
    }
  }

  if (!(a.c.phases & kRecvPhase)) return;
  // Receive phase: `split` blocks per local expert (as many as the grid has, up to kMaxSplit).
  // The first waits for every source's count, lays the sources' rows out one after the other
  // and hands the layout to the others through layout_range and a ready flag; then each
  // copies every split-th item of the rows the slots name. Only the first reads the counts,
  // so a source timing out cannot give two blocks different layouts. (Measured slower:
  // packing each source as its count lands, with a block per (expert, source) and rows
  // claimed by atomicAdd, which overlaps the packing with sends still in flight; loading the
  // slot entries into shared memory first; blocks that each read the counts and reconcile
  // their views afterwards: docs/PERF.md.)
  __syncthreads();
  int* s_n = ints;                    // [num_ranks]
  int* s_begin = ints + L.num_ranks;  // [num_ranks + 1]
  const int split = max(1, min(static_cast<int>(gridDim.x) / L.num_local_experts, kMaxSplit));
  for (int u = blockIdx.x; u < L.num_local_experts * split; u += gridDim.x) {
    const int le = u % L.num_local_experts, part = u / L.num_local_experts;
    if (part == 0) {
      for (int s = tid; s < L.num_ranks; s += kThreads) {
        int* count = reinterpret_cast<int*>(a.c.routes[s].count_recv + le * kSignalBytes);
        int v = 0;
        if (a.c.active[s]) {
          v = waitNonZero(count, a.c.timeout_ns);
          if (v == 0) atomicExch(a.c.active + s, 0);  // timed out: masked
        }
        resetSignal(count);  // ready for the round after next
        int n = v ? -v - 1 : 0;
        // NOTES: a peer wrote this count: one outside [0, max_tokens] would lay this expert's
        // rows out past its region, so such a source is masked as one that timed out.
        if (n < 0 || n > L.max_tokens) {
          atomicExch(a.c.active + s, 0);
          n = 0;
        }
        s_n[s] = n;
      }
      __syncthreads();
      if (tid == 0) {
        if (u == static_cast<int>(blockIdx.x)) tracePoint(a.c, 4);
        layoutExpert(a, le, s_n, s_begin);
        // Releases this thread's layout_range and recv_count stores to the other blocks; the
        // last of them to read it leaves the flag 0 again.
        if (split > 1) stReleaseGpu(a.ready + le, split - 1);
      }
    } else if (tid == 0) {
      while (ldAcquireGpu(a.ready + le) == 0) {
      }
      for (int s = 0; s < L.num_ranks; ++s) s_begin[s] = static_cast<int>(a.layout_range[le * L.num_ranks + s] >> 32);
      s_begin[L.num_ranks] = a.recv_count[le];
      atomicSub(a.ready + le, 1);
      tracePoint(a.c, 4);
    }
    __syncthreads();
    packRows<kFp8>(a, le, s_begin, split * (threadIdx.x / 32) + part, split * kWarps);
    __syncthreads();  // s_n and s_begin are reused by the next expert
  }
  if (tid == 0) tracePoint(a.c, 5);
}

template <bool kFp8, bool kIbgda>
void launch(const DispatchArgs& a, cudaStream_t stream) {
  const EpLayout& L = a.c.layout;
  const int grid = a.c.num_sms;
  const int per_block = (L.num_experts + grid - 1) / grid;  // experts warp 31 counts
  const int ints = per_block > 2 * L.num_ranks + 1 ? per_block : 2 * L.num_ranks + 1;
  const size_t smem = L.dispatch_msg_bytes + static_cast<size_t>(ints) * sizeof(int);
  static std::atomic<size_t> smem_seen[64];
  ensureSmem(reinterpret_cast<const void*>(dispatchKernel<kFp8, kIbgda>), smem, smem_seen, "cudaFuncSetAttribute(dispatch)");
  dispatchKernel<kFp8, kIbgda><<<grid, kThreads, smem, stream>>>(a);
  check(cudaGetLastError(), "dispatch launch");
}

}  // namespace

void preloadDispatch() {
  cudaFuncAttributes attr;
  check(cudaFuncGetAttributes(&attr, dispatchKernel<true, true>), "loading the dispatch kernel");
  check(cudaFuncGetAttributes(&attr, dispatchKernel<true, false>), "loading the dispatch kernel");
  check(cudaFuncGetAttributes(&attr, dispatchKernel<false, true>), "loading the dispatch kernel");
  check(cudaFuncGetAttributes(&attr, dispatchKernel<false, false>), "loading the dispatch kernel");
}

void dispatch(const DispatchArgs& a, cudaStream_t stream) {
  if (a.use_fp8)
    a.c.ibgda ? launch<true, true>(a, stream) : launch<true, false>(a, stream);
  else
    a.c.ibgda ? launch<false, true>(a, stream) : launch<false, false>(a, stream);
}

}  // namespace moelink::ep::kernels
