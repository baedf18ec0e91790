// The exchange kernel: one in-host collective step over the staging areas every rank maps.
//
// Per launch: (1) block 0 writes this rank's header into every peer's header slot for this
// op's parity and every block checks the headers it received (so no block needs another's
// verdict); (2) rounds: in round r, block b pushes its piece of the round's bytes for each
// peer into that peer's staging half r&1 (slot of this rank) and raises the peer's flag
// (source = this rank, block b) to the round's tag; it then waits for the flags of the
// peers that send to it, consumes its piece (copy into place, or reduce in rank order with
// this rank's own range) and acknowledges in the producer's memory. Before reusing a half
// (round r >= 2) a producer waits for the acknowledgements of round r-2 from the consumer
// blocks that read where its piece goes (in full rounds: its namesake alone). A block meets
// only its namesake blocks on other ranks, so blocks run their rounds independently and
// NVLink pushes of one block overlap the local consumption of another; with separate roles
// (exchangeSplits) the pushing and consuming blocks of one rank wait for each other only
// where the op writes input it also pushes (ExchangeLaunch::guard_input). In a forwarded
// broadcast (ExchangeMode::kForward) the root only pushes, and every other rank's consuming
// block places its piece from the root and passes it on to the others in the same stores.
//
// A two-shot all_reduce (ExchangeMode::kReduceGatherStaged) runs its all-gather half on the
// consuming blocks: the block that reduces piece b of this rank's block stores the result into
// place and, in the same loop, into the second part of every peer's slot (the first holds the
// reduce-scatter piece; rounds of exchangeRoundBytes), raises the peers' gather flags, then
// copies the peers' reduced pieces b into place as they arrive and acknowledges them (gather
// flags and acknowledgements beside the others, so that the two halves' rounds run apart). The
// pushing blocks meanwhile push the next round's reduce-scatter pieces.
//
// Across launches: a peer writes the next op's header only once its previous launch has
// ended, which needed everything this rank sent it; so the header check also guarantees
// that nothing of the previous op is still being read, and two header parities keep a fast
// peer's next header from overwriting one a slow block has yet to read. The halves go by op
// and round (exchangeHalf), which lets a one-round op push before it has seen the peers'
// headers when this rank's previous op succeeded in one round (exchangePushesEarly,
// Counter::single_ok). Its headers are still checked before anything that arrived is
// consumed, so a disagreement fails the op as before (what a peer pushed stays in the
// staging area, within the size every rank agreed on at set-up).
#include "exchange_common.cuh"

namespace moelink::cuda {

namespace {

// A short pair as Lamport lines: lines [first, ..., step first + k * stride) of the pair to p,
// `bytes` from `src`. Lines go by index, as in the Lamport kernel, so a peer on either kernel
// reads them.
__device__ void pushPairLines(const Ctx& c, int p, const char* src, uint64_t bytes, uint32_t flag, int parity,
                              uint64_t first, uint64_t stride) {
  const ExchangeLaunch& a = *c.a;
  char* area = lamportArea(a.staging[p], a.layout, a.size, parity, a.rank) + kLamportHeaderLines * kLamportLineBytes;
  for (uint64_t i = first; i * 8 < bytes; i += stride)
    putLine(area + i * kLamportLineBytes, load8(src + i * 8, lineLen(bytes, i)), flag);
}

// The same lines of the pair from q, `bytes` into `dst` as they arrive. False when the launch
// failed (recorded).
__device__ bool takePairLines(const Ctx& c, int q, char* dst, uint64_t bytes, uint32_t flag, int parity,
                              uint64_t first, uint64_t stride) {
  const ExchangeLaunch& a = *c.a;
  const char* area =
      lamportArea(a.staging[a.rank], a.layout, a.size, parity, q) + kLamportHeaderLines * kLamportLineBytes;
  for (uint64_t i = first; i * 8 < bytes; i += stride) {
    uint64_t v;
    if (!awaitLine(c, area + i * kLamportLineBytes, flag, q, &v, false)) return false;
    store8(dst + i * 8, v, lineLen(bytes, i));
  }
  return true;
}

__device__ __forceinline__ uint64_t tagOf(uint64_t seq, uint64_t round) { return (seq << 24) | (round + 1); }

// Block b's word for `rank` in one of the layout's [2 halves][kExchangeMaxRanks][kExchangeMaxBlocks]
// arrays (`array`: its offset, ExchangeLayout::flags, acks, gather_flags or gather_acks).
__device__ __forceinline__ uint64_t* slotOf(char* staging, uint64_t array, int half, int rank, int b) {
  return reinterpret_cast<uint64_t*>(staging + array) + (half * kExchangeMaxRanks + rank) * kExchangeMaxBlocks + b;
}
__device__ __forceinline__ uint64_t* flagSlot(char* staging, const ExchangeLayout& l, int half, int src, int b) {
  return slotOf(staging, l.flags, half, src, b);
}
__device__ __forceinline__ uint64_t* ackSlot(char* staging, const ExchangeLayout& l, int half, int consumer, int b) {
  return slotOf(staging, l.acks, half, consumer, b);
}
__device__ __forceinline__ char* dataSlot(char* staging, const ExchangeLayout& l, int n, int half, int src) {
  return staging + l.data + (static_cast<uint64_t>(half) * n + src) * l.round_bytes;
}
// kReduceGatherStaged: where a source's reduced piece goes, behind its reduce-scatter piece.
__device__ __forceinline__ char* gatherSlot(const ExchangeLaunch& a, char* staging, int half, int src) {
  return dataSlot(staging, a.layout, a.size, half, src) + a.round;
}

// Block-wide copy of `len` bytes from `src` to every dsts[k] (k < ndst: a place, and the peers'
// slots a piece goes on to); 16-byte vectors when everything is aligned.
__device__ void copyBytes(char* const* dsts, int ndst, const char* src, uint64_t len) {
  uintptr_t align = reinterpret_cast<uintptr_t>(src) | len;
  for (int k = 0; k < ndst; ++k) align |= reinterpret_cast<uintptr_t>(dsts[k]);
  if ((align & 15) == 0) {
    const int4* s = reinterpret_cast<const int4*>(src);
    const uint64_t n = len / 16;
    uint64_t i = threadIdx.x;
    for (; i + 3 * blockDim.x < n; i += 4 * blockDim.x) {
      int4 v0 = s[i], v1 = s[i + blockDim.x], v2 = s[i + 2 * blockDim.x], v3 = s[i + 3 * blockDim.x];
#pragma unroll
      for (int k = 0; k < kExchangeMaxRanks; ++k) {
        if (k >= ndst) break;
        int4* d = reinterpret_cast<int4*>(dsts[k]);
        d[i] = v0;
        d[i + blockDim.x] = v1;
        d[i + 2 * blockDim.x] = v2;
        d[i + 3 * blockDim.x] = v3;
      }
    }
    for (; i < n; i += blockDim.x) {
      const int4 v = s[i];
      for (int k = 0; k < ndst; ++k) reinterpret_cast<int4*>(dsts[k])[i] = v;
    }
  } else {
    for (uint64_t i = threadIdx.x; i < len; i += blockDim.x) {
      const char v = src[i];
      for (int k = 0; k < ndst; ++k) dsts[k][i] = v;
    }
  }
}
__device__ __forceinline__ void copyBytes(char* dst, const char* src, uint64_t len) { copyBytes(&dst, 1, src, len); }

// Before a block writes [lo, hi) of round r >= 2 into peer p's slot of this half: the consuming
// blocks of p that read round r-2 there (their acknowledgements in `acks` of this rank's area:
// ExchangeLayout::acks or gather_acks) have finished. Round r-2 was a full round, cut as `round`
// (in full rounds the namesake alone). Threads [0, blocks) wait; a failure is recorded, and the
// caller's blockFailed() learns of it.
__device__ void awaitAcks(const Ctx& c, uint64_t acks, int half, int p, int r, uint64_t round, uint64_t lo,
                          uint64_t hi) {
  const ExchangeLaunch& a = *c.a;
  if (r < 2 || threadIdx.x >= static_cast<unsigned>(a.blocks)) return;
  uint64_t plo, phi;
  exchangePiece(round, threadIdx.x, a.blocks, &plo, &phi);
  if (plo < phi && plo < hi && lo < phi &&
      !waitAtLeast(c, slotOf(a.staging[a.rank], acks, half, p, threadIdx.x), tagOf(c.seq, r - 2), p))
    atomicMax(&c.counter->failed, static_cast<unsigned>(c.seq));
}

// Every outs[k] (k < nouts: the place, and the peers' slots it goes to as well) = op over the n
// sources, in source order. When every pointer and the length are 16-byte aligned, each thread
// loads a 16-byte vector of every source before reducing it (the loads are in flight together);
// the rest goes element by element.
template <typename T>
__device__ void reduceRange(char* const* outs, int nouts, const char* const* src, int n, uint64_t bytes, ReduceOp op,
                            int avg_n) {
  using A = typename AccOf<T>::type;
  constexpr int V = 16 / sizeof(T);
  uintptr_t align = bytes;
  for (int k = 0; k < nouts; ++k) align |= reinterpret_cast<uintptr_t>(outs[k]);
  for (int q = 0; q < n; ++q) align |= reinterpret_cast<uintptr_t>(src[q]);
  uint64_t first = 0;  // elements done by the vector path
  if ((align & 15) == 0) {
    const uint64_t vectors = bytes / 16;
    for (uint64_t i = threadIdx.x; i < vectors; i += blockDim.x) {
      int4 w[kExchangeMaxRanks];
#pragma unroll
      for (int q = 0; q < kExchangeMaxRanks; ++q)
        if (q < n) w[q] = reinterpret_cast<const int4*>(src[q])[i];
      A acc[V];
      const T* e0 = reinterpret_cast<const T*>(&w[0]);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = toAcc<T>(e0[k]);
#pragma unroll
      for (int q = 1; q < kExchangeMaxRanks; ++q) {
        if (q >= n) break;
        const T* e = reinterpret_cast<const T*>(&w[q]);
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] = apply<A>(acc[k], toAcc<T>(e[k]), op);
      }
      int4 r;
      T* o = reinterpret_cast<T*>(&r);
#pragma unroll
      for (int k = 0; k < V; ++k) o[k] = finishAcc<T>(acc[k], op, avg_n);
#pragma unroll
      for (int k = 0; k < kExchangeMaxRanks; ++k)
        if (k < nouts) reinterpret_cast<int4*>(outs[k])[i] = r;
    }
    first = vectors * V;
  }
  const uint64_t count = bytes / sizeof(T);
  const T* const* s = reinterpret_cast<const T* const*>(src);
  for (uint64_t i = first + threadIdx.x; i < count; i += blockDim.x) {
    A acc = toAcc<T>(s[0][i]);
    for (int q = 1; q < n; ++q) acc = apply<A>(acc, toAcc<T>(s[q][i]), op);
    const T v = finishAcc<T>(acc, op, avg_n);
    for (int k = 0; k < nouts; ++k) reinterpret_cast<T*>(outs[k])[i] = v;
  }
}

template <>
__device__ void reduceRange<Bool>(char* const* outs, int nouts, const char* const* src, int n, uint64_t bytes,
                                  ReduceOp op, int) {
  for (uint64_t i = threadIdx.x; i < bytes; i += blockDim.x) {
    bool acc = src[0][i] != 0;
    for (int q = 1; q < n; ++q) {
      bool v = src[q][i] != 0;
      if (op == ReduceOp::kBxor) acc = acc != v;
      else if (op == ReduceOp::kProduct || op == ReduceOp::kMin || op == ReduceOp::kBand) acc = acc && v;
      else acc = acc || v;
    }
    for (int k = 0; k < nouts; ++k) outs[k][i] = acc;
  }
}

// Complex: SUM/AVG add, PRODUCT multiplies (MIN/MAX/bitwise are refused before launch).
template <typename R>
__device__ void reduceComplex(char* const* outs, int nouts, const char* const* src, int n, uint64_t bytes, ReduceOp op,
                              int avg_n) {
  const uint64_t count = bytes / (2 * sizeof(R));
  for (uint64_t i = threadIdx.x; i < count; i += blockDim.x) {
    const R* v = reinterpret_cast<const R*>(src[0]) + 2 * i;
    R re = v[0], im = v[1];
    for (int q = 1; q < n; ++q) {
      const R* w = reinterpret_cast<const R*>(src[q]) + 2 * i;
      if (op == ReduceOp::kProduct) {
        R r2 = re * w[0] - im * w[1];
        im = re * w[1] + im * w[0];
        re = r2;
      } else {
        re += w[0];
        im += w[1];
      }
    }
    if (op == ReduceOp::kAvg) {
      re /= static_cast<R>(avg_n);
      im /= static_cast<R>(avg_n);
    }
    for (int k = 0; k < nouts; ++k) {
      R* o = reinterpret_cast<R*>(outs[k]) + 2 * i;
      o[0] = re;
      o[1] = im;
    }
  }
}

// The reduction a kernel instance is compiled for (one instance per dtype, and one that only
// copies), so that each instance carries a single reduction loop.
template <typename T>
struct ReduceAs {
  __device__ static void run(char* const* outs, int nouts, const char* const* src, int n, uint64_t bytes, ReduceOp op,
                             int avg_n) {
    reduceRange<T>(outs, nouts, src, n, bytes, op, avg_n);
  }
};
template <typename R>
struct ReduceComplex {
  __device__ static void run(char* const* outs, int nouts, const char* const* src, int n, uint64_t bytes, ReduceOp op,
                             int avg_n) {
    reduceComplex<R>(outs, nouts, src, n, bytes, op, avg_n);
  }
};
struct CopyOnly {
  __device__ static void run(char* const*, int, const char* const*, int, uint64_t, ReduceOp, int) {}
};

// Whether a pair of `bytes` travels as Lamport lines (exchangeLamportPairs).
__device__ __forceinline__ bool linePair(const ExchangeLaunch& a, uint64_t bytes) {
  return bytes != 0 && bytes <= a.lamport_pairs;
}

__device__ int roundsOf(const ExchangeLaunch& a, int q) {
  uint64_t bytes = a.send_bytes[q] > a.recv_bytes[q] ? a.send_bytes[q] : a.recv_bytes[q];
  return static_cast<int>((bytes + a.round - 1) / a.round);
}

// Whether every pair of this rank with a peer moves at most one round.
__device__ bool pairsInOneRound(const ExchangeLaunch& a) {
  for (int q = 0; q < a.size; ++q)
    if (q != a.rank && roundsOf(a, q) > 1) return false;
  return true;
}

// Block b pushes its piece of round r to each peer and raises the peer's flag. False when the
// launch failed.
__device__ bool pushRound(const Ctx& c, int r, int b) {
  const ExchangeLaunch& a = *c.a;
  const int me = a.rank, n = a.size, G = a.blocks;
  const ExchangeLayout& L = a.layout;
  const uint64_t R = a.round;
  const int half = exchangeHalf(c.seq, r);
  const uint64_t tag = tagOf(c.seq, r);
  // kForward: a rank but the root passes its pieces on from its consuming blocks (takeCopies).
  const bool forward = a.mode == static_cast<uint8_t>(ExchangeMode::kForward);
  if (forward && me != a.forward_from) return true;
  // The peers' flags go up together, after one barrier behind all of the block's pieces (each
  // release then waits for those writes at once, not for one peer's after another's), but the
  // root of a forwarded broadcast raises each as soon as its piece is written: a rank passes its
  // piece on once it has it. (4x H200, 4 ranks, graph replay: all_gather, reduce_scatter and
  // all_to_all at 4 MiB 9-17 % faster together, broadcast 1 MiB 17 %; a forwarded broadcast of
  // 16-32 MiB 3-8 % slower, measured when every rank passed pieces on from pushing blocks;
  // docs/PERF.md.)
  unsigned pushed = 0;  // bit p: a staged piece of this round went to p, its flag not yet raised
  // Each block visits the peers in its own rotation (block b starts b % (n-1) peers after this
  // rank): at any moment the blocks of a rank write to every peer at once, and the ranks' blocks
  // of the same index to different peers, so every NVLink port carries traffic throughout instead
  // of all blocks queueing on one peer after another. (4x H200, 4 ranks, against every block
  // starting at this rank + 1: all_reduce, all_gather and all_to_all +8-27 % bus bandwidth at
  // 128 MiB, every op +1-4 % at 1 GiB; docs/PERF.md.)
  for (int k = 1; k < n; ++k) {
    const int p = (me + 1 + (b + k - 1) % (n - 1)) % n;
    if (linePair(a, a.send_bytes[p])) {  // all of it in round 0, as Lamport lines
      if (r == 0)
        pushPairLines(c, p, a.in + a.send_off[p], a.send_bytes[p], static_cast<uint32_t>(c.seq),
                      static_cast<int>(c.seq & 1), static_cast<uint64_t>(b) * blockDim.x + threadIdx.x,
                      static_cast<uint64_t>(a.launched) * blockDim.x);
      continue;
    }
    uint64_t len = exchangeRoundLen(a.send_bytes[p], r, R), lo, hi;
    exchangePiece(len, b, G, &lo, &hi);
    if (lo >= hi) continue;
    if (r >= 2) {
      awaitAcks(c, L.acks, half, p, r, R, lo, hi);
      if (blockFailed(c)) return false;
    }
    copyBytes(dataSlot(a.staging[p], L, n, half, me) + lo, a.in + a.send_off[p] + r * R + lo, hi - lo);
    // The barrier orders every thread's writes before the releases, which are cumulative: the
    // peer that acquires the flag sees the whole piece.
    if (!forward) {
      pushed |= 1u << p;
      continue;
    }
    __syncthreads();
    if (threadIdx.x == 0) device::stReleaseSys64(flagSlot(a.staging[p], L, half, me, b), tag);
  }
  if (pushed) {  // the same on every thread
    __syncthreads();
    if (threadIdx.x < n && (pushed >> threadIdx.x & 1))
      device::stReleaseSys64(flagSlot(a.staging[threadIdx.x], L, half, me, b), tag);
  }
  return true;
}

// The source among `pending` (bits by rank) whose piece b of this round has arrived first (its
// flag in `flags`: ExchangeLayout::flags or gather_flags), the same for every thread of the block
// (a barrier); -1 when the launch failed or its deadline passed while waiting (recorded).
__device__ int nextArrival(const Ctx& c, uint64_t flags, int half, int b, uint64_t tag, unsigned pending) {
  const ExchangeLaunch& a = *c.a;
  __shared__ int next;
  __syncthreads();
  if (threadIdx.x == 0) {
    char* mine = a.staging[a.rank];
    int got = -1;
    for (uint32_t spins = 0; got < 0;) {
      for (int k = 1; k < a.size && got < 0; ++k) {
        const int q = (a.rank + a.size - k) % a.size;
        if ((pending >> q & 1) && device::ldAcquireSys64(slotOf(mine, flags, half, q, b)) >= tag) got = q;
      }
      if (got < 0 && (++spins & 1023) == 0) {
        int waited = 0;  // the first source still pending, for the message
        while (!(pending >> waited & 1)) ++waited;
        if (!keepWaiting(c, waited)) break;
      }
    }
    next = got;
  }
  __syncthreads();
  return next;
}

// Consuming block b's piece of round r of a reduction: once every peer's piece has come, this
// rank's block reduced in rank order into place (kReduce: at `out`; kReduceGatherStaged: at
// out + send_off[me], and in the same stores into every peer's gather slot, whose flag then goes
// up). False when the launch failed.
template <typename Reduce>
__device__ bool reducePiece(const Ctx& c, int r, int b) {
  const ExchangeLaunch& a = *c.a;
  const int me = a.rank, n = a.size, G = a.blocks;
  const ExchangeLayout& L = a.layout;
  const uint64_t R = a.round;
  char* mine = a.staging[me];
  const int half = exchangeHalf(c.seq, r);
  const uint64_t tag = tagOf(c.seq, r);
  const bool gather = a.mode == static_cast<uint8_t>(ExchangeMode::kReduceGatherStaged);
  uint64_t len = exchangeRoundLen(a.reduce_bytes, r, R), lo, hi;
  exchangePiece(len, b, G, &lo, &hi);
  if (lo >= hi) return true;
  __shared__ const char* srcs[kExchangeMaxRanks];
  __shared__ char* outs[kExchangeMaxRanks];  // [0] the place, then the peers' gather slots
  if (threadIdx.x < n && threadIdx.x != me) {
    const int q = threadIdx.x;
    if (!waitAtLeast(c, flagSlot(mine, L, half, q, b), tag, q))
      atomicMax(&c.counter->failed, static_cast<unsigned>(c.seq));
    srcs[q] = dataSlot(mine, L, n, half, q) + lo;
    if (gather) outs[q < me ? q + 1 : q] = gatherSlot(a, a.staging[q], half, me) + lo;
  }
  if (gather)  // each peer's consuming blocks have copied round r-2 out of where this piece goes
    for (int p = 0; p < n; ++p)
      if (p != me) awaitAcks(c, L.gather_acks, half, p, r, R, lo, hi);
  if (threadIdx.x == 0) {
    srcs[me] = a.in + a.send_off[me] + r * R + lo;
    outs[0] = a.out + (gather ? a.send_off[me] : 0) + r * R + lo;
  }
  if (blockFailed(c)) return false;
  Reduce::run(outs, gather ? n : 1, srcs, n, hi - lo, static_cast<ReduceOp>(a.redop), n);
  __syncthreads();
  if (threadIdx.x < n && threadIdx.x != me) {
    device::stReleaseSys64(ackSlot(a.staging[threadIdx.x], L, half, me, b), tag);
    if (gather) device::stReleaseSys64(slotOf(a.staging[threadIdx.x], L.gather_flags, half, me, b), tag);
  }
  return true;
}

// kReduceGatherStaged: consuming block b copies piece b of round r of each peer's reduced block
// into place, in the order the pieces arrive, and acknowledges each in the peer's memory. False
// when the launch failed.
__device__ bool takeGathered(const Ctx& c, int r, int b) {
  const ExchangeLaunch& a = *c.a;
  const int me = a.rank, n = a.size, G = a.blocks;
  const ExchangeLayout& L = a.layout;
  const uint64_t R = a.round;
  char* mine = a.staging[me];
  const int half = exchangeHalf(c.seq, r);
  const uint64_t tag = tagOf(c.seq, r);
  unsigned pending = 0;  // bit q: a piece of q's block in this round
  for (int q = 0; q < n; ++q) {
    uint64_t lo, hi;
    exchangePiece(exchangeRoundLen(a.send_bytes[q], r, R), b, G, &lo, &hi);
    if (q != me && lo < hi) pending |= 1u << q;
  }
  while (pending) {
    const int q = nextArrival(c, L.gather_flags, half, b, tag, pending);
    if (q < 0) atomicMax(&c.counter->failed, static_cast<unsigned>(c.seq));
    if (blockFailed(c)) return false;
    uint64_t lo, hi;
    exchangePiece(exchangeRoundLen(a.send_bytes[q], r, R), b, G, &lo, &hi);
    copyBytes(a.out + a.send_off[q] + r * R + lo, gatherSlot(a, mine, half, q) + lo, hi - lo);
    __syncthreads();
    if (threadIdx.x == 0) device::stReleaseSys64(slotOf(a.staging[q], L.gather_acks, half, me, b), tag);
    pending &= ~(1u << q);
  }
  return true;
}

// Consuming block b's pieces of round r of a copy: this rank's own block straight into place,
// then what the peers sent: Lamport lines (round 0), then the staged pieces in the order they
// arrive, each acknowledged in its sender's memory. In a forwarded broadcast (kForward) the piece
// from the root goes on to the other ranks in the same stores that place it (into their slots of
// this rank, after their acknowledgements of round r-2 there), and their flags go up together.
// False when the launch failed.
__device__ bool takeCopies(const Ctx& c, int r, int b) {
  const ExchangeLaunch& a = *c.a;
  const int me = a.rank, n = a.size, G = a.blocks;
  const ExchangeLayout& L = a.layout;
  const uint64_t R = a.round;
  char* mine = a.staging[me];
  const int half = exchangeHalf(c.seq, r);
  const uint64_t tag = tagOf(c.seq, r);
  uint64_t len = exchangeRoundLen(a.send_bytes[me], r, R), lo, hi;
  exchangePiece(len, b, G, &lo, &hi);
  const char* s = a.in + a.send_off[me] + r * R;
  char* d = a.out + a.recv_off[me] + r * R;
  if (lo < hi && s != d) copyBytes(d + lo, s + lo, hi - lo);
  unsigned pending = 0;  // bit q: a staged piece from q in this round
  for (int k = 1; k < n; ++k) {
    const int q = (me + n - k) % n;
    if (linePair(a, a.recv_bytes[q])) {
      if (r != 0) continue;
      if (!takePairLines(c, q, a.out + a.recv_off[q], a.recv_bytes[q], static_cast<uint32_t>(c.seq),
                         static_cast<int>(c.seq & 1), static_cast<uint64_t>(b) * blockDim.x + threadIdx.x,
                         static_cast<uint64_t>(a.launched) * blockDim.x))
        atomicMax(&c.counter->failed, static_cast<unsigned>(c.seq));
      if (blockFailed(c)) return false;
      continue;
    }
    uint64_t ql = exchangeRoundLen(a.recv_bytes[q], r, R), qlo, qhi;
    exchangePiece(ql, b, G, &qlo, &qhi);
    if (qlo < qhi) pending |= 1u << q;
  }
  __shared__ char* dsts[kExchangeMaxRanks];  // [0] the place, then the slots a piece goes on to
  while (pending) {
    const int q = nextArrival(c, L.flags, half, b, tag, pending);
    if (q < 0) atomicMax(&c.counter->failed, static_cast<unsigned>(c.seq));
    if (blockFailed(c)) return false;
    uint64_t ql = exchangeRoundLen(a.recv_bytes[q], r, R), qlo, qhi;
    exchangePiece(ql, b, G, &qlo, &qhi);
    // The ranks this piece goes on to: every pair this rank sends is the root's pair again, cut
    // alike (kForward).
    unsigned on = 0;
    int ndst = 1;
    if (q == a.forward_from)
      for (int p = 0; p < n; ++p)
        if (p != me && a.send_bytes[p]) {
          awaitAcks(c, L.acks, half, p, r, R, qlo, qhi);
          on |= 1u << p;
          if (threadIdx.x == 0) dsts[ndst] = dataSlot(a.staging[p], L, n, half, me) + qlo;
          ++ndst;
        }
    if (threadIdx.x == 0) dsts[0] = a.out + a.recv_off[q] + r * R + qlo;
    if (blockFailed(c)) return false;
    copyBytes(dsts, ndst, dataSlot(mine, L, n, half, q) + qlo, qhi - qlo);
    __syncthreads();
    if (threadIdx.x == 0) device::stReleaseSys64(ackSlot(a.staging[q], L, half, me, b), tag);
    if (threadIdx.x < n && (on >> threadIdx.x & 1))
      device::stReleaseSys64(flagSlot(a.staging[threadIdx.x], L, half, me, b), tag);
    pending &= ~(1u << q);
  }
  return true;
}

// The rounds of block b (round 0's pushes already done when `pushed_first`). False when the
// launch failed.
template <typename Reduce>
__device__ bool runRounds(const Ctx& c, bool pushed_first) {
  const ExchangeLaunch& a = *c.a;
  // Block b of the G that cut each round (Gl of them launched per role, every piece of this
  // rank's pairs among them): one block does both the pushing and the consuming, or
  // (roles == 2) block b pushes and block Gl + b consumes.
  const int me = a.rank, n = a.size, Gl = a.launched, b = blockIdx.x % Gl;
  const bool push = a.roles == 1 || static_cast<int>(blockIdx.x) < Gl;
  const ExchangeLayout& L = a.layout;
  const uint64_t R = a.round;
  char* mine = a.staging[me];
  const bool copy = a.mode == static_cast<uint8_t>(ExchangeMode::kCopy) ||
                    a.mode == static_cast<uint8_t>(ExchangeMode::kForward);
  const bool gather = a.mode == static_cast<uint8_t>(ExchangeMode::kReduceGatherStaged);
  int rounds = 0;
  for (int q = 0; q < n; ++q) rounds = max(rounds, roundsOf(a, q));
  if (copy && a.send_bytes[me] && a.in + a.send_off[me] != a.out + a.recv_off[me])
    rounds = max(rounds, static_cast<int>((a.send_bytes[me] + R - 1) / R));
  if (!copy) rounds = max(rounds, static_cast<int>((a.reduce_bytes + R - 1) / R));

  for (int r = 0; r < rounds; ++r) {
    const int half = exchangeHalf(c.seq, r);
    const uint64_t tag = tagOf(c.seq, r);
    if (push && !(r == 0 && pushed_first) && !pushRound(c, r, b)) return false;
    if (a.roles == 2) {
      // Pushing and consuming blocks part here. Where this rank's output meets the input its
      // pushing blocks read (ExchangeLaunch::guard_input), a pushing block says when it has
      // read round r, and consuming blocks wait until every pushing block has.
      if (push && !a.guard_input) continue;
      if (push) {
        __syncthreads();
        if (threadIdx.x == 0) {
          __threadfence();
          device::stReleaseSys64(flagSlot(mine, L, half, me, b), tag);  // no peer writes this slot
        }
        continue;
      }
      if (a.guard_input && threadIdx.x < Gl && !waitAtLeast(c, flagSlot(mine, L, half, me, threadIdx.x), tag, me))
        atomicMax(&c.counter->failed, static_cast<unsigned>(c.seq));
      if (blockFailed(c)) return false;
    }
    if (copy ? !takeCopies(c, r, b) : !reducePiece<Reduce>(c, r, b) || (gather && !takeGathered(c, r, b)))
      return false;
  }
  return true;
}

template <typename Reduce>
__global__ void __launch_bounds__(512) exchangeKernel(const __grid_constant__ ExchangeLaunch a) {
  const int me = a.rank, n = a.size;
  char* mine = a.staging[me];
  Counter* counter = reinterpret_cast<Counter*>(mine + a.layout.counter);
  Ctx c{&a, *reinterpret_cast<volatile unsigned long long*>(&counter->seq) + 1, counter, 0};
  __shared__ uint64_t start;
  __shared__ int bad, early;
  const bool single = pairsInOneRound(a);
  if (threadIdx.x == 0) {
    start = device::globalTimerNs();
    bad = 0;
    // Push before the headers have come (see the top of this file).
    early = exchangePushesEarly(c.seq, *reinterpret_cast<volatile unsigned long long*>(&counter->single_ok), single,
                                a.roles);
  }
  __syncthreads();
  c.start_ns = start;

  // (1) Headers: block 0 sends, every block checks.
  if (blockIdx.x == 0 && threadIdx.x < n && threadIdx.x != me) {
    const int p = threadIdx.x;
    ExchangeHeader* h = headerSlot(a.staging[p], a.layout, c.seq, me);
    const uint64_t* src = reinterpret_cast<const uint64_t*>(&a.header[p]);
    uint64_t* dst = reinterpret_cast<uint64_t*>(h);
    for (int i = 0; i < 7; ++i) dst[i] = src[i];
    device::stReleaseSys64(&h->seq, c.seq);  // the header's words before its seq (release)
  }
  // A peer that runs the Lamport kernel for this op (exchangeLamportPairs) checks this rank's
  // header from lines: sent now when the Lamport kernel's rule allows it (linesEarly), else once
  // the peers' headers have come (below). A pushing block sends its short pairs' lines in round
  // 0, which comes after the headers unless this rank pushes early, which implies linesEarly.
  const bool lines_now = a.header_lines && linesEarly(c);
  if (lines_now) pushHeaderLines(c, static_cast<uint32_t>(c.seq), static_cast<int>(c.seq & 1));
  if (early && !pushRound(c, 0, blockIdx.x)) bad = 1;  // (roles == 1: block b is piece b)
  if (threadIdx.x < n && threadIdx.x != me) {
    const int q = threadIdx.x;
    ExchangeHeader* h = headerSlot(mine, a.layout, c.seq, q);
    if (!waitAtLeast(c, &h->seq, c.seq, q)) {
      bad = 1;
    } else {
      ExchangeHeader theirs = *h;
      if (theirs.seq > c.seq) {
        fail(c, ExchangeStatus::kAhead, q, &theirs);
        bad = 1;
      } else if (!sameHeader(a.header[q], theirs)) {
        fail(c, ExchangeStatus::kMismatch, q, &theirs);
        bad = 1;
      }
    }
  }
  __syncthreads();
  if (!bad && a.header_lines && !lines_now)
    pushHeaderLines(c, static_cast<uint32_t>(c.seq), static_cast<int>(c.seq & 1));

  // (2) Rounds.
  if (!bad) runRounds<Reduce>(c, early);

  finishLaunch(c, single);
}

}  // namespace

void describeLaunch(const Exchange& x, int rank, const ExchangeTuning& t, ExchangeLaunch& l) {
  const int n = static_cast<int>(x.send_bytes.size());
  l.rank = rank;
  l.size = n;
  l.blocks = t.blocks;
  l.roles = exchangeSplits(x, t) ? 2 : 1;
  l.round = exchangeRoundBytes(x, t);
  l.launched = exchangeBlocksWithWork(x, t);
  l.lamport = exchangeLamport(x, t);
  l.dependent_launch = t.dependent_launch;
  l.guard_input = true;  // unknown until the pointers are (exchangeOutputMeetsInput)
  if (l.lamport) {
    l.roles = 1;
    l.launched = lamportBlocks(x, t);
    l.threads = lamportThreadsFor(x, t);
  } else {
    l.lamport_pairs = exchangeLamportPairs(x, t);
    // Every copy: a peer's pairs may all be short where this rank's are not.
    l.header_lines = (x.mode == ExchangeMode::kCopy || x.mode == ExchangeMode::kForward) && t.lamport_bytes != 0;
  }
  l.forward_from = x.forward_from;
  l.mode = static_cast<uint8_t>(x.mode);
  l.dtype = static_cast<uint8_t>(x.dtype);
  l.redop = static_cast<uint8_t>(x.redop);
  l.reduce_bytes = x.reduce_bytes;
  for (int q = 0; q < n; ++q) {
    l.send_off[q] = x.send_off[q];
    l.send_bytes[q] = x.send_bytes[q];
    l.recv_off[q] = x.recv_off[q];
    l.recv_bytes[q] = x.recv_bytes[q];
    if (q != rank) l.header[q] = exchangeHeader(x, q, t);
  }
}

cudaError_t launchExchange(const ExchangeLaunch& l, cudaStream_t stream) {
  if (l.lamport) return launchLamport(l, stream);
  const int grid = l.launched * l.roles;
  if (l.mode == static_cast<uint8_t>(ExchangeMode::kCopy) || l.mode == static_cast<uint8_t>(ExchangeMode::kForward)) {
    exchangeKernel<CopyOnly><<<grid, 512, 0, stream>>>(l);
    return cudaGetLastError();
  }
  switch (static_cast<DType>(l.dtype)) {
    case DType::kFloat32: exchangeKernel<ReduceAs<float>><<<grid, 512, 0, stream>>>(l); break;
    case DType::kFloat64: exchangeKernel<ReduceAs<double>><<<grid, 512, 0, stream>>>(l); break;
    case DType::kFloat16: exchangeKernel<ReduceAs<__half>><<<grid, 512, 0, stream>>>(l); break;
    case DType::kBFloat16: exchangeKernel<ReduceAs<__nv_bfloat16>><<<grid, 512, 0, stream>>>(l); break;
    case DType::kInt8: exchangeKernel<ReduceAs<int8_t>><<<grid, 512, 0, stream>>>(l); break;
    case DType::kInt16: exchangeKernel<ReduceAs<int16_t>><<<grid, 512, 0, stream>>>(l); break;
    case DType::kInt32: exchangeKernel<ReduceAs<int32_t>><<<grid, 512, 0, stream>>>(l); break;
    case DType::kInt64: exchangeKernel<ReduceAs<long long>><<<grid, 512, 0, stream>>>(l); break;
    case DType::kUInt8: exchangeKernel<ReduceAs<uint8_t>><<<grid, 512, 0, stream>>>(l); break;
    case DType::kBool: exchangeKernel<ReduceAs<Bool>><<<grid, 512, 0, stream>>>(l); break;
    case DType::kComplex64: exchangeKernel<ReduceComplex<float>><<<grid, 512, 0, stream>>>(l); break;
    case DType::kComplex128: exchangeKernel<ReduceComplex<double>><<<grid, 512, 0, stream>>>(l); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace moelink::cuda
