// Normal-mode kernels for ranks on one host: see moelink/ep/normal_kernels.h.
#include <cuda_bf16.h>

#include <atomic>
#include <climits>

#include "launch.h"
#include "moelink/ep/normal_kernels.h"
#include "sync.cuh"

namespace moelink::ep::normal {

using kernels::bulkLoad;
using kernels::bulkStoreGroup;
using kernels::bulkWaitAll;
using kernels::bulkWaitRead;
using kernels::ldAcquireSys;
using kernels::ldNc;
using kernels::mbarArrive;
using kernels::mbarInit;
using kernels::mbarInitDone;
using kernels::mbarWait;
using kernels::stReleaseSys;

namespace {

uint64_t align(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

constexpr int kCounterStride = 16;  // bytes per tail or head word

__device__ __forceinline__ void namedBarrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Raises the int at p to v (if below it), after every earlier access of this thread (and what
// it acquired) -- a peer that reads the new value may overwrite what those accesses read.
__device__ __forceinline__ void redMaxReleaseSys(int* p, int v) {
  asm volatile("red.release.sys.global.max.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The position of the q-th (from 0) set bit of m; m has more than q.
__device__ __forceinline__ int nthSet(uint32_t m, int q) {
  for (; q > 0; --q) m &= m - 1;
  return __ffs(m) - 1;
}

__device__ __forceinline__ int ldVolatile(const int* p) {
  int v;
  asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Tokens [begin, end) of channel c.
__device__ __forceinline__ void channelRange(int num_tokens, int num_channels, int c, int& begin, int& end) {
  const int per = (num_tokens + num_channels - 1) / num_channels;
  begin = min(c * per, num_tokens);
  end = min(begin + per, num_tokens);
}

__device__ __forceinline__ int* counter(char* base, const RingLayout& L, int src, int c, int which) {
  return reinterpret_cast<int*>(base + L.off_counters + (static_cast<uint64_t>(src * L.num_channels + c) * 2 + which) *
                                                            kCounterStride);
}

__device__ __forceinline__ char* ring(char* base, const RingLayout& L, int src, int c) {
  return base + L.off_rings + static_cast<uint64_t>(src * L.num_channels + c) * L.ring_bytes;
}

// Records the first failure for the host (a peer that did not answer within the timeout).
__device__ void reportError(HostReport* r, int code, int peer) {
  if (atomicCAS(const_cast<int*>(&r->error), 0, code) == 0) {
    r->error_rank = peer;
    __threadfence_system();
  }
}

// Spins until the int at p reaches at least `want` (wrap-safe); false on timeout.
__device__ bool waitAtLeast(const int* p, int want, int64_t timeout_ns, int* seen = nullptr) {
  const uint64_t start = timeout_ns > 0 ? kernels::globalTimerNs() : 0;
  int v;
  while (static_cast<int>((v = ldAcquireSys(p)) - want) < 0) {
    if (timeout_ns > 0 && static_cast<int64_t>(kernels::globalTimerNs() - start) > timeout_ns) return false;
  }
  if (seen) *seen = v;
  return true;
}

// This call's barrier sequence number: one more than the last one this rank used (kept in its
// own buffer, so replays of a captured graph advance it too). Every thread gets it.
__device__ int nextSeq(const RingLayout& L, char* me) {
  __shared__ int s_seq;
  if (threadIdx.x == 0) {
    int* word = reinterpret_cast<int*>(me + L.off_seq);
    s_seq = *reinterpret_cast<volatile int*>(word) + 1;
    *reinterpret_cast<volatile int*>(word) = s_seq;
  }
  __syncthreads();
  return s_seq;
}

// Clears this rank's ring counters, then tells every peer it reached `seq` and waits for all
// of them: after it, every rank has finished its previous call's kernels and cleared its rings.
__device__ void barrier(const RingLayout& L, const Peers& peers, int rank, int seq, HostReport* report,
                        int64_t timeout_ns) {
  char* me = peers.base[rank];
  const int words = L.num_ranks * L.num_channels * 2;
  for (int i = threadIdx.x; i < words; i += blockDim.x)
    *reinterpret_cast<int*>(me + L.off_counters + static_cast<uint64_t>(i) * kCounterStride) = 0;
  __syncthreads();
  if (threadIdx.x < L.num_ranks) {
    __threadfence_system();
    stReleaseSys(reinterpret_cast<int*>(peers.base[threadIdx.x] + L.off_barrier) + rank, seq);
  }
  if (threadIdx.x < L.num_ranks) {
    const int* mine = reinterpret_cast<const int*>(me + L.off_barrier) + threadIdx.x;
    if (!waitAtLeast(mine, seq, timeout_ns)) reportError(report, 1, threadIdx.x);
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads, 1) notifyKernel(NotifyArgs a) {
  const RingLayout& L = a.L;
  const int R = L.num_ranks, C = L.num_channels, nle = a.num_local_experts;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int seq = nextSeq(L, a.peers.base[a.rank]);
  __shared__ int s_count[kMaxRanks * kMaxChannels];
  // This rank's tokens per (destination, channel).
  for (int p = warp; p < R * C; p += kWarps) {
    const int r = p / C, c = p % C;
    int begin, end;
    channelRange(a.num_tokens, C, c, begin, end);
    int n = 0;
    for (int t = begin + lane; t < end; t += 32) n += a.is_token_in_rank[static_cast<int64_t>(t) * R + r] ? 1 : 0;
    for (int o = 16; o; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
    if (lane == 0) s_count[p] = n;
  }
  __syncthreads();
  if (threadIdx.x < R) {
    int acc = 0;
    for (int c = 0; c < C; ++c) a.channel_prefix[threadIdx.x * C + c] = acc += s_count[threadIdx.x * C + c];
  }
  // Leave them, and this rank's pairs per expert of each peer, in the peer's notify area: the
  // half of this call's parity, so that a peer still reading the previous call's counts (it
  // may, once it has passed that call's barrier) never sees these.
  const uint64_t half = static_cast<uint64_t>(seq & 1) * R * L.notify_ints * sizeof(int);
  for (int i = threadIdx.x; i < R * L.notify_ints; i += blockDim.x) {
    const int r = i / L.notify_ints, j = i % L.notify_ints;
    int v = j < C ? s_count[r * C + j] : a.num_tokens_per_expert[r * nle + (j - C)];
    reinterpret_cast<int*>(a.peers.base[r] + L.off_notify + half)[a.rank * L.notify_ints + j] = v;
  }
  barrier(L, a.peers, a.rank, seq, a.report, a.timeout_ns);
  const int* area = reinterpret_cast<const int*>(a.peers.base[a.rank] + L.off_notify + half);
  if (threadIdx.x == 0) {
    int rows = 0;
    for (int s = 0; s < R; ++s) {
      int acc = 0;
      for (int c = 0; c < C; ++c) {
        a.recv_channel_prefix[s * (C + 1) + c] = acc;
        // NOTES: a peer wrote this count: a negative one, or one that would take the row
        // numbering past 2^30, is refused (error 6, raised on the host) and counts as nothing,
        // so that no row is placed outside the outputs sized from these counts.
        int v = ldVolatile(area + s * L.notify_ints + c);
        if (v < 0 || static_cast<int64_t>(rows) + acc + v > (1 << 30)) {
          reportError(a.report, 6, s);
          v = 0;
        }
        acc += v;
      }
      a.recv_channel_prefix[s * (C + 1) + C] = acc;
      a.rank_prefix[s] = rows += acc;
    }
    a.report->num_recv = rows;
    if (a.max_rows > 0 && rows > a.max_rows) a.report->overflow = rows;
  }
  for (int e = threadIdx.x; e < nle; e += blockDim.x) {
    int n = 0;
    for (int s = 0; s < R; ++s) n += ldVolatile(area + s * L.notify_ints + C + e);
    a.report->per_expert[e] = n;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    a.report->ticket = a.ticket;
  }
}

__global__ void __launch_bounds__(256) layoutKernel(LayoutArgs a) {
  __shared__ int s_expert[kLayoutMaxExperts];
  __shared__ int s_rank[kLayoutMaxRanks];
  for (int i = threadIdx.x; i < a.num_experts; i += blockDim.x) s_expert[i] = 0;
  for (int i = threadIdx.x; i < a.num_ranks; i += blockDim.x) s_rank[i] = 0;
  __syncthreads();
  const int per_rank = a.num_experts / a.num_ranks;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < a.num_tokens) {
    uint64_t ranks = 0;
    for (int k = 0; k < a.num_topk; ++k) {
      const int64_t e = a.topk_idx[static_cast<int64_t>(t) * a.num_topk + k];
      if (e < 0 || e >= a.num_experts) continue;
      atomicAdd(&s_expert[e], 1);
      ranks |= 1ull << (e / per_rank);
    }
    for (int r = 0; r < a.num_ranks; ++r) {
      const bool in = (ranks >> r) & 1;
      a.is_token_in_rank[static_cast<int64_t>(t) * a.num_ranks + r] = in;
      if (in) atomicAdd(&s_rank[r], 1);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < a.num_experts; i += blockDim.x)
    if (s_expert[i]) atomicAdd(&a.num_tokens_per_expert[i], s_expert[i]);
  for (int i = threadIdx.x; i < a.num_ranks; i += blockDim.x)
    if (s_rank[i]) atomicAdd(&a.num_tokens_per_rank[i], s_rank[i]);
}

__global__ void prepareKernel(PrepareArgs a) {
  barrier(a.L, a.peers, a.rank, nextSeq(a.L, a.peers.base[a.rank]), a.report, a.timeout_ns);
}

__global__ void padKernel(PadArgs a) {
  const int first = a.rank_prefix[a.num_ranks - 1];
  const int64_t x16 = a.x_bytes / 16;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t begin = first < a.max_rows ? first : a.max_rows;
  const int64_t rows = a.max_rows - begin;
  int4* x = reinterpret_cast<int4*>(static_cast<char*>(a.recv_x) + begin * a.x_bytes);
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < rows * x16; i += stride) x[i] = make_int4(0, 0, 0, 0);
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < rows; i += stride) {
    const int64_t row = begin + i;
    a.recv_src_idx[row] = -1;
    for (int s = 0; s < a.num_scales; ++s) a.recv_scales[row * a.num_scales + s] = 0.f;
    for (int k = 0; k < a.num_topk; ++k) {
      a.recv_topk_idx[row * a.num_topk + k] = -1;
      a.recv_topk_weights[row * a.num_topk + k] = 0.f;
    }
  }
}

// A ring slot a peer filled (read after acquiring its tail): coherent, no L1 fill, and no
// compiler barrier, so that a batch of them is in flight at once (volatile asm keeps them
// after the barrier or acquire that precedes them).
__device__ __forceinline__ int4 ldRing(const int4* p) {
  int4 v;
  asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

constexpr int kBatch = 8;  // int4 loads per lane in flight in a copy

// Copies `bytes` (a multiple of 16) with the warp's lanes, kBatch loads per lane before their
// stores. kFromInput: the source is a read-only input (else a ring slot).
template <bool kFromInput>
__device__ __forceinline__ void warpCopy(void* dst, const void* src, int bytes) {
  const int4* s = static_cast<const int4*>(src);
  int4* d = static_cast<int4*>(dst);
  const int n = bytes / 16;
  const int lane = threadIdx.x % 32;
  for (int base = lane; base < n; base += 32 * kBatch) {
    int4 v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (base + u * 32 < n) v[u] = kFromInput ? ldNc(s + base + u * 32) : ldRing(s + base + u * 32);
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (base + u * 32 < n) d[base + u * 32] = v[u];
  }
}

__global__ void __launch_bounds__(kThreads, 1) dispatchKernel(DispatchArgs a) {
  const RingLayout& L = a.L;
  const int R = L.num_ranks, C = L.num_channels, K = L.num_topk, S = L.num_scales;
  const int c = blockIdx.x / 2;
  const bool sender = blockIdx.x % 2 == 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int W = kWarps / R;
  const int g = warp / W, wg = warp % W;
  if (g >= R) return;
  const bool leader = wg == 0 && lane == 0;
  __shared__ int s_value[kMaxRanks];
  __shared__ int s_abort[kMaxRanks];
  if (leader) s_abort[g] = 0;
  namedBarrier(g + 1, W * 32);
  if (sender) {
    const int r = g;
    int begin, end;
    channelRange(a.num_tokens, C, c, begin, end);
    const int total = a.channel_prefix[r * C + c] - (c ? a.channel_prefix[r * C + c - 1] : 0);
    char* dst = ring(a.peers.base[r], L, a.rank, c);
    int* tail = counter(a.peers.base[r], L, a.rank, c, 0);
    const int* head = counter(a.peers.base[r], L, a.rank, c, 1);
    // The channel's tokens 32 at a time: one flag per lane, a ballot tells every warp of the
    // group which go to r (in order: the j-th goes to slot j % ring). Warp j % W copies the
    // j-th; a chunk's tail is published once the group has copied it.
    int j = 0, chunk_end = 0;
    for (int w0 = begin; w0 < end; w0 += 32) {
      const int tt = w0 + lane;
      const bool in = tt < end && a.is_token_in_rank[static_cast<int64_t>(tt) * R + r];
      uint32_t m = __ballot_sync(0xffffffffu, in);
      // A token r does not get: -(its place in r's stream) - 1, the rows before it (combine's
      // receiver hands back r's slots below the lowest place its warps may still read).
      if (wg == 0 && tt < end && !in)
        a.send_head[static_cast<int64_t>(tt) * R + r] = -(j + __popc(m & ((1u << lane) - 1))) - 1;
      while (m) {
        if (j == chunk_end) {  // a new chunk: wait until the ring has room for it
          chunk_end = min(j + a.send_chunk, total);
          if (leader && !waitAtLeast(head, chunk_end - L.ring_tokens, a.timeout_ns)) {
            reportError(a.report, 2, r);
            s_abort[g] = 1;
          }
          namedBarrier(g + 1, W * 32);
          if (s_abort[g]) return;
        }
        for (; m && j < chunk_end; ++j) {
          const int t = w0 + __ffs(m) - 1;
          m &= m - 1;
          if (j % W != wg) continue;
          const int slot = j % L.ring_tokens;
          warpCopy<true>(dst + static_cast<uint64_t>(slot) * L.x_bytes,
                         static_cast<const char*>(a.x) + static_cast<int64_t>(t) * L.x_bytes, L.x_bytes);
          for (int i = lane; i < S; i += 32)
            reinterpret_cast<float*>(dst + L.r_scales)[slot * S + i] = a.scales[static_cast<int64_t>(t) * S + i];
          for (int k = lane; k < K; k += 32) {
            const int64_t e = a.topk_idx[static_cast<int64_t>(t) * K + k];
            const int64_t first = static_cast<int64_t>(r) * a.num_local_experts;
            const int local = e >= first && e < first + a.num_local_experts ? static_cast<int>(e - first) : -1;
            reinterpret_cast<int*>(dst + L.r_idx)[slot * K + k] = local;
            reinterpret_cast<float*>(dst + L.r_w)[slot * K + k] =
                local >= 0 ? a.topk_weights[static_cast<int64_t>(t) * K + k] : 0.f;
          }
          if (lane == 0) {
            reinterpret_cast<int*>(dst + L.r_src)[slot] = t;
            a.send_head[static_cast<int64_t>(t) * R + r] = j;
          }
        }
        if (j == chunk_end) {  // the chunk is copied: publish it
          namedBarrier(g + 1, W * 32);
          if (leader) {
            __threadfence_system();
            stReleaseSys(tail, chunk_end);
          }
        }
      }
    }
    return;
  }
  // Receiver of source s's stream in channel c.
  const int s = g;
  const int total = a.recv_channel_prefix[s * (C + 1) + c + 1] - a.recv_channel_prefix[s * (C + 1) + c];
  const int64_t row0 = (s ? a.rank_prefix[s - 1] : 0) + a.recv_channel_prefix[s * (C + 1) + c];
  char* src = ring(a.peers.base[a.rank], L, s, c);
  const int* tail = counter(a.peers.base[a.rank], L, s, c, 0);
  int* head = counter(a.peers.base[a.rank], L, s, c, 1);
  int consumed = 0;
  while (consumed < total) {
    if (leader) {
      const uint64_t start = a.timeout_ns > 0 ? kernels::globalTimerNs() : 0;
      int v;
      while ((v = ldAcquireSys(tail)) <= consumed) {
        if (a.timeout_ns > 0 && static_cast<int64_t>(kernels::globalTimerNs() - start) > a.timeout_ns) {
          reportError(a.report, 3, s);
          s_abort[g] = 1;
          break;
        }
      }
      s_value[g] = v;
    }
    namedBarrier(g + 1, W * 32);
    if (s_abort[g]) return;
    const int avail = *static_cast<volatile int*>(&s_value[g]);
    for (int k = consumed + wg; k < avail; k += W) {
      const int slot = k % L.ring_tokens;
      const int64_t row = row0 + k;
      if (a.max_rows > 0 && row >= a.max_rows) continue;  // past the outputs: dropped (reported by notify)
      warpCopy<false>(static_cast<char*>(a.recv_x) + row * L.x_bytes, src + static_cast<uint64_t>(slot) * L.x_bytes,
                      L.x_bytes);
      for (int i = lane; i < S; i += 32)
        a.recv_scales[row * S + i] = reinterpret_cast<const volatile float*>(src + L.r_scales)[slot * S + i];
      for (int k2 = lane; k2 < K; k2 += 32) {
        a.recv_topk_idx[row * K + k2] = reinterpret_cast<const volatile int*>(src + L.r_idx)[slot * K + k2];
        a.recv_topk_weights[row * K + k2] = reinterpret_cast<const volatile float*>(src + L.r_w)[slot * K + k2];
      }
      if (lane == 0) a.recv_src_idx[row] = reinterpret_cast<const volatile int*>(src + L.r_src)[slot];
    }
    namedBarrier(g + 1, W * 32);
    if (leader) stReleaseSys(head, avail);
    consumed = avail;
  }
}

constexpr int kBulkAhead = 3;  // loads in flight ahead of the stores
static_assert(kBulkAhead < kBulkStages, "a stage's store must be issued before its next load");

// Combine's sender with bulk copies: a.bulk_warps warps per destination s stream the rows
// received from rank s in channel c back into s's ring for (this rank, c), taking the stream's
// chunks in turn (warp j of s: chunks j, j + bulk_warps, ...), so that while one waits for its
// chunk's stores to complete the others' loads and stores keep the link busy. Lane 0 of a warp
// cuts a chunk's rows into pieces of a.piece_bytes and runs them through the warp's kBulkStages
// stages of shared memory (load k + kBulkAhead in flight while piece k is stored); the lanes
// write the top-k weights. A chunk's tail is published once its stores have completed and the
// chunk before it is published (s_pub: chunks of each stream published so far).
__device__ void combineSendBulk(const CombineArgs& a, int c, int warp, int lane) {
  extern __shared__ __align__(128) char s_stage[];
  __shared__ uint64_t s_bar[kWarps][kBulkStages];
  __shared__ int s_pub[kMaxRanks];
  __shared__ int s_fail[kMaxRanks];
  if (threadIdx.x < kMaxRanks) {
    s_pub[threadIdx.x] = 0;
    s_fail[threadIdx.x] = 0;
  }
  __syncthreads();
  const RingLayout& L = a.L;
  const int R = L.num_ranks, C = L.num_channels, K = L.num_topk, P = a.bulk_warps;
  const int s = warp / P, j = warp % P;
  if (s >= R) return;
  const uint32_t piece = static_cast<uint32_t>(a.piece_bytes);
  char* stages = s_stage + static_cast<uint64_t>(warp) * kBulkStages * piece;
  uint64_t* bars = s_bar[warp];
  if (lane == 0) {
    for (int i = 0; i < kBulkStages; ++i) mbarInit(&bars[i]);
    mbarInitDone();
  }
  __syncwarp();
  const int per_row = (L.x_bytes + static_cast<int>(piece) - 1) / static_cast<int>(piece);
  const int total = a.recv_channel_prefix[s * (C + 1) + c + 1] - a.recv_channel_prefix[s * (C + 1) + c];
  const int64_t row0 = (s ? a.rank_prefix[s - 1] : 0) + a.recv_channel_prefix[s * (C + 1) + c];
  char* dst = ring(a.peers.base[s], L, a.rank, c);
  int* tail = counter(a.peers.base[s], L, a.rank, c, 0);
  const int* head = counter(a.peers.base[s], L, a.rank, c, 1);
  const char* x = static_cast<const char*>(a.x);
  volatile int* pub = &s_pub[s];
  volatile int* fail = &s_fail[s];
  uint32_t n0 = 0;    // pieces through the stages so far (lane 0)
  int seen_head = 0;  // the latest head lane 0 read (the peer frees slots, it never takes them back)
  for (int chunk = j; chunk * a.send_chunk < total; chunk += P) {
    const int chunk_begin = chunk * a.send_chunk, chunk_end = min(chunk_begin + a.send_chunk, total);
    int ok = 1;
    if (lane == 0 && seen_head < chunk_end - L.ring_tokens) {
      if (!waitAtLeast(head, chunk_end - L.ring_tokens, a.timeout_ns, &seen_head)) {
        reportError(a.report, 4, s);
        *fail = 1;
        ok = 0;
      }
    }
    if (!__shfl_sync(0xffffffffu, ok, 0)) return;  // nothing in flight: the last chunk's stores completed
    if (lane == 0) {
      const int Q = (chunk_end - chunk_begin) * per_row;
      for (int q = 0; q < Q + kBulkAhead; ++q) {
        if (q < Q) {  // load piece q into its stage, once the stage's previous store has read it
          const uint32_t n = n0 + q;
          uint64_t* bar = &bars[n % kBulkStages];
          if (n >= kBulkStages) bulkWaitRead<kBulkStages - kBulkAhead - 1>();
          const int64_t row = row0 + chunk_begin + q / per_row;
          const uint32_t off = (q % per_row) * piece;
          if (a.max_rows > 0 && row >= a.max_rows)
            mbarArrive(bar);  // a row the bounded dispatch dropped: zeros, written below
          else
            bulkLoad(stages + (n % kBulkStages) * piece, x + row * L.x_bytes + off,
                     min(piece, static_cast<uint32_t>(L.x_bytes) - off), bar);
        }
        const int m = q - kBulkAhead;
        if (m >= 0) {  // store piece m once it has landed
          const uint32_t n = n0 + m;
          mbarWait(&bars[n % kBulkStages], (n / kBulkStages) & 1);
          const int k = chunk_begin + m / per_row;
          const uint32_t off = (m % per_row) * piece;
          const bool dropped = a.max_rows > 0 && row0 + k >= a.max_rows;
          bulkStoreGroup(dst + static_cast<uint64_t>(k % L.ring_tokens) * L.x_bytes + off,
                         stages + (n % kBulkStages) * piece,
                         dropped ? 0u : min(piece, static_cast<uint32_t>(L.x_bytes) - off));
        }
      }
      n0 += Q;
    }
    for (int k = chunk_begin; k < chunk_end; ++k) {
      const int slot = k % L.ring_tokens;
      float* w = reinterpret_cast<float*>(dst + L.r_w) + slot * K;
      if (a.max_rows > 0 && row0 + k >= a.max_rows) {
        int4* to = reinterpret_cast<int4*>(dst + static_cast<uint64_t>(slot) * L.x_bytes);
        for (int i = lane; i < L.x_bytes / 16; i += 32) to[i] = make_int4(0, 0, 0, 0);
        for (int k2 = lane; k2 < K; k2 += 32) w[k2] = 0.f;
      } else if (a.topk_weights != nullptr) {
        for (int k2 = lane; k2 < K; k2 += 32) w[k2] = a.topk_weights[(row0 + k) * K + k2];
      }
    }
    __syncwarp();
    if (lane == 0) {
      bulkWaitAll();
      // In stream order: after the chunk before this one (another warp's, unless P == 1). That
      // warp either publishes it or, having timed out, flags the stream failed.
      while (*pub != chunk && !*fail) {
      }
      if (*pub == chunk) {
        __threadfence_system();  // also orders the other warp's rows (seen through *pub) first
        stReleaseSys(tail, chunk_end);
        __threadfence_block();
        *pub = chunk + 1;
      } else {
        ok = 0;
      }
    }
    if (!__shfl_sync(0xffffffffu, ok, 0)) return;
  }
}

__global__ void __launch_bounds__(kThreads, 1) combineKernel(CombineArgs a) {
  const RingLayout& L = a.L;
  const int R = L.num_ranks, C = L.num_channels, K = L.num_topk;
  const int c = blockIdx.x / 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (blockIdx.x % 2 == 0 && a.piece_bytes > 0) {
    combineSendBulk(a, c, warp, lane);
    return;
  }
  if (blockIdx.x % 2 == 0) {
    // Sender with warp copies: the rows received from rank s in channel c go back into s's
    // ring for (this rank, c), W warps per destination.
    const int W = kWarps / R;
    const int g = warp / W, wg = warp % W;
    if (g >= R) return;
    const bool leader = wg == 0 && lane == 0;
    __shared__ int s_abort[kMaxRanks];
    if (leader) s_abort[g] = 0;
    namedBarrier(g + 1, W * 32);
    const int s = g;
    const int total = a.recv_channel_prefix[s * (C + 1) + c + 1] - a.recv_channel_prefix[s * (C + 1) + c];
    const int64_t row0 = (s ? a.rank_prefix[s - 1] : 0) + a.recv_channel_prefix[s * (C + 1) + c];
    char* dst = ring(a.peers.base[s], L, a.rank, c);
    int* tail = counter(a.peers.base[s], L, a.rank, c, 0);
    const int* head = counter(a.peers.base[s], L, a.rank, c, 1);
    for (int chunk_begin = 0; chunk_begin < total; chunk_begin += a.send_chunk) {
      const int chunk_end = min(chunk_begin + a.send_chunk, total);
      if (leader && !waitAtLeast(head, chunk_end - L.ring_tokens, a.timeout_ns)) {
        reportError(a.report, 4, s);
        s_abort[g] = 1;
      }
      namedBarrier(g + 1, W * 32);
      if (s_abort[g]) return;
      for (int k = chunk_begin + wg; k < chunk_end; k += W) {
        const int slot = k % L.ring_tokens;
        char* to = dst + static_cast<uint64_t>(slot) * L.x_bytes;
        if (a.max_rows > 0 && row0 + k >= a.max_rows) {  // a row the bounded dispatch dropped
          for (int i = lane; i < L.x_bytes / 16; i += 32) reinterpret_cast<int4*>(to)[i] = make_int4(0, 0, 0, 0);
          for (int k2 = lane; k2 < K; k2 += 32) reinterpret_cast<float*>(dst + L.r_w)[slot * K + k2] = 0.f;
          continue;
        }
        warpCopy<true>(to, static_cast<const char*>(a.x) + (row0 + k) * L.x_bytes, L.x_bytes);
        if (a.topk_weights != nullptr)
          for (int k2 = lane; k2 < K; k2 += 32)
            reinterpret_cast<float*>(dst + L.r_w)[slot * K + k2] = a.topk_weights[(row0 + k) * K + k2];
      }
      namedBarrier(g + 1, W * 32);
      if (leader) {
        __threadfence_system();
        stReleaseSys(tail, chunk_end);
      }
    }
    return;
  }
  // Receiver: warp w sums tokens begin + w, begin + w + kWarps, ... (one row from every rank
  // the dispatch sent the token to, then the biases), each warp at its own pace. A source's
  // slots are handed back (its head) up to the lowest one a warp may still read: every warp
  // keeps in s_pos the place of its current token in each source's stream (dispatch left it
  // in send_head, as -place - 1 for a source the token did not go to), and after each token
  // the lowest place of every source goes to that source's head. Tails a lane has acquired
  // are kept in s_tail, so that most tokens start without a read of the counters.
  __shared__ int s_pos[kWarps][kMaxRanks];
  __shared__ int s_tail[kMaxRanks];
  __shared__ int s_dead[kMaxRanks];
  for (int i = threadIdx.x; i < kWarps * kMaxRanks; i += blockDim.x) s_pos[i / kMaxRanks][i % kMaxRanks] = 0;
  if (threadIdx.x < kMaxRanks) {
    s_tail[threadIdx.x] = 0;
    s_dead[threadIdx.x] = 0;
  }
  __syncthreads();
  int begin, end;
  channelRange(a.num_tokens, C, c, begin, end);
  const int hidden8 = L.x_bytes / 16;  // 8 bf16 per int4
  char* const rings = a.peers.base[a.rank];
  for (int t = begin + warp;; t += kWarps) {
    // Lane r (< R): the token's slot in rank r's stream (-1: not sent there) and its place.
    int h = -1, place = INT_MAX;
    if (lane < R && t < end) {
      h = a.send_head[static_cast<int64_t>(t) * R + lane];
      place = h >= 0 ? h : -h - 1;
    }
    // This warp's earlier tokens are summed (their loads returned before __syncwarp): publish
    // the place, then hand back every source's slots below the lowest place of any warp.
    __syncwarp();
    if (lane < R) {
      __threadfence_block();
      *reinterpret_cast<volatile int*>(&s_pos[warp][lane]) = place;
      __threadfence_block();
      int low = INT_MAX;
      for (int w = 0; w < kWarps; ++w) low = min(low, *reinterpret_cast<volatile int*>(&s_pos[w][lane]));
      __threadfence_block();
      if (low != INT_MAX) redMaxReleaseSys(counter(rings, L, lane, c, 1), low);
    }
    if (t >= end) break;
    // Wait (lanes in parallel) for the rows to arrive.
    if (h >= 0) {
      if (*reinterpret_cast<volatile int*>(&s_dead[lane])) {
        h = -1;
      } else if (*reinterpret_cast<volatile int*>(&s_tail[lane]) <= h) {
        const int* tail = counter(rings, L, lane, c, 0);
        const uint64_t start = a.timeout_ns > 0 ? kernels::globalTimerNs() : 0;
        int v;
        while ((v = ldAcquireSys(tail)) <= h) {
          if (a.timeout_ns > 0 && static_cast<int64_t>(kernels::globalTimerNs() - start) > a.timeout_ns) break;
        }
        if (v <= h) {
          reportError(a.report, 5, lane);
          s_dead[lane] = 1;
          h = -1;
        } else {
          __threadfence_block();
          atomicMax(&s_tail[lane], v);
        }
      } else {
        __threadfence_block();  // pairs with the fence before the atomicMax that raised s_tail
      }
    }
    // Lane q (< n) holds the q-th row to sum: the ranks' rows in rank order, then the biases.
    const uint32_t from = __ballot_sync(0xffffffffu, h >= 0);
    const int nr = __popc(from);
    const int src = lane < nr ? nthSet(from, lane) : 0;
    const int hs = __shfl_sync(0xffffffffu, h, src);
    const int4* mine = nullptr;
    if (lane < nr) {
      mine = reinterpret_cast<const int4*>(ring(rings, L, src, c) +
                                           static_cast<uint64_t>(hs % L.ring_tokens) * L.x_bytes);
    } else {
      const void* bias = lane == nr ? (a.bias0 ? a.bias0 : a.bias1) : lane == nr + 1 && a.bias0 ? a.bias1 : nullptr;
      if (bias) mine = reinterpret_cast<const int4*>(static_cast<const char*>(bias) + static_cast<int64_t>(t) * L.x_bytes);
    }
    const int n = nr + (a.bias0 ? 1 : 0) + (a.bias1 ? 1 : 0);
    // kSumBatch int4 (8 bf16 each) per lane of kGroup rows at a time: their loads are in flight
    // together before they are summed. Every lane takes every step (the shuffles need the whole
    // warp), a lane past the row's end with its loads and stores switched off.
    constexpr int kSumBatch = 2, kGroup = 4;
    for (int step = 0; step < hidden8; step += 32 * kSumBatch) {
      const int base = step + lane;
      float acc[kSumBatch][8];
#pragma unroll
      for (int u = 0; u < kSumBatch; ++u)
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[u][q] = 0.f;
      for (int g0 = 0; g0 < n; g0 += kGroup) {
        int4 v[kGroup][kSumBatch];
#pragma unroll
        for (int q = 0; q < kGroup; ++q) {
          const int4* row = reinterpret_cast<const int4*>(
              __shfl_sync(0xffffffffu, reinterpret_cast<uint64_t>(mine), min(g0 + q, 31)));
#pragma unroll
          for (int u = 0; u < kSumBatch; ++u)
            v[q][u] = g0 + q < n && base + u * 32 < hidden8 ? ldRing(row + base + u * 32) : make_int4(0, 0, 0, 0);
        }
#pragma unroll
        for (int q = 0; q < kGroup; ++q)
#pragma unroll
          for (int u = 0; u < kSumBatch; ++u) {
            const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v[q][u]);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float2 f = __bfloat1622float2(p[e]);
              acc[u][2 * e] += f.x;
              acc[u][2 * e + 1] += f.y;
            }
          }
      }
#pragma unroll
      for (int u = 0; u < kSumBatch; ++u) {
        if (base + u * 32 >= hidden8) continue;
        int4 o;
        __nv_bfloat162* po = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
        for (int e = 0; e < 4; ++e) po[e] = __floats2bfloat162_rn(acc[u][2 * e], acc[u][2 * e + 1]);
        reinterpret_cast<int4*>(static_cast<char*>(a.out) + static_cast<int64_t>(t) * L.x_bytes)[base + u * 32] = o;
      }
    }
    if (a.out_weights != nullptr)
      for (int k0 = 0; k0 < K; k0 += 32) {
        const int k = k0 + lane;
        float w = 0.f;
        for (int q = 0; q < nr; ++q) {
          const int r = nthSet(from, q);
          const int hr = __shfl_sync(0xffffffffu, h, r);
          if (k < K) w += reinterpret_cast<const volatile float*>(ring(rings, L, r, c) + L.r_w)[(hr % L.ring_tokens) * K + k];
        }
        if (k < K) a.out_weights[static_cast<int64_t>(t) * K + k] = w;
      }
  }
}

}  // namespace

RingLayout RingLayout::make(int num_ranks, int num_channels, int ring_tokens, int x_bytes, int num_scales, int num_topk,
                            int num_local_experts) {
  RingLayout L;
  L.num_ranks = num_ranks;
  L.num_channels = num_channels;
  L.ring_tokens = ring_tokens;
  L.x_bytes = x_bytes;
  L.num_scales = num_scales;
  L.num_topk = num_topk;
  L.off_barrier = 0;
  L.off_seq = align(num_ranks * sizeof(int), 16);
  L.off_notify = align(L.off_seq + sizeof(int), 128);
  L.notify_ints = num_channels + num_local_experts;
  L.off_counters = align(L.off_notify + 2ull * num_ranks * L.notify_ints * sizeof(int), 128);  // two halves
  L.off_rings = align(L.off_counters + static_cast<uint64_t>(num_ranks) * num_channels * 2 * kCounterStride, 128);
  const uint64_t rt = ring_tokens;
  L.r_src = align(rt * x_bytes, 16);
  L.r_idx = align(L.r_src + rt * sizeof(int), 16);
  L.r_w = align(L.r_idx + rt * num_topk * sizeof(int), 16);
  L.r_scales = align(L.r_w + rt * num_topk * sizeof(float), 16);
  L.ring_bytes = align(L.r_scales + rt * num_scales * sizeof(float), 128);
  L.total = L.off_rings + static_cast<uint64_t>(num_ranks) * num_channels * L.ring_bytes;
  return L;
}

void notify(const NotifyArgs& a, cudaStream_t stream) {
  notifyKernel<<<1, kThreads, 0, stream>>>(a);
  kernels::check(cudaGetLastError(), "normal-mode notify launch");
}

void layout(const LayoutArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return;
  layoutKernel<<<(a.num_tokens + 255) / 256, 256, 0, stream>>>(a);
  kernels::check(cudaGetLastError(), "normal-mode layout launch");
}

void prepare(const PrepareArgs& a, cudaStream_t stream) {
  prepareKernel<<<1, 128, 0, stream>>>(a);
  kernels::check(cudaGetLastError(), "normal-mode prepare launch");
}

void pad(const PadArgs& a, cudaStream_t stream) {
  if (a.max_rows <= 0) return;
  padKernel<<<32, 256, 0, stream>>>(a);
  kernels::check(cudaGetLastError(), "normal-mode pad launch");
}

void dispatch(const DispatchArgs& a, cudaStream_t stream) {
  dispatchKernel<<<2 * a.L.num_channels, kThreads, 0, stream>>>(a);
  kernels::check(cudaGetLastError(), "normal-mode dispatch launch");
}

int bulkPieceBytes(int warps, int x_bytes) {
  const int stage = kBulkSmemBytes / (warps * kBulkStages);  // the most one stage may take
  const int per_row = (x_bytes + stage - 1) / stage;
  return static_cast<int>(align(static_cast<uint64_t>((x_bytes + per_row - 1) / per_row), 16));
}

void combine(const CombineArgs& a, cudaStream_t stream) {
  const int smem = a.piece_bytes > 0 ? a.L.num_ranks * a.bulk_warps * kBulkStages * a.piece_bytes : 0;
  if (smem > 0) {
    // Above 48 KiB a kernel's dynamic shared memory needs the opt-in, once per device.
    static std::atomic<int> opted[64];
    int device = 0;
    kernels::check(cudaGetDevice(&device), "cudaGetDevice");
    if (device < 64 && opted[device].load() < smem) {
      kernels::check(cudaFuncSetAttribute(combineKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                     "normal-mode combine: shared memory opt-in");
      opted[device].store(smem);
    }
  }
  combineKernel<<<2 * a.L.num_channels, kThreads, smem, stream>>>(a);
  kernels::check(cudaGetLastError(), "normal-mode combine launch");
}

}  // namespace moelink::ep::normal
