// What the in-host collective kernels share (exchange.cu, the staged protocol; lamport.cu,
// the Lamport protocol): the staging area's op counter, failure and deadline handling, the
// header slots and their check, and the reductions in an accumulator type.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "moelink/common/device_sync.cuh"
#include "moelink/cuda/exchange_kernel.h"

namespace moelink::cuda {
namespace {

struct Counter {
  unsigned long long seq;  // ops completed on this staging area
  // Blocks of the current launch that have finished, and kDoneFailed once the launch has failed:
  // the last block learns both from its one atomic add (finishLaunch).
  unsigned int done;
  unsigned int failed;     // seq of a failed launch (blocks stop waiting)
  // seq of the latest launch that succeeded with every pair in one round (0: none): the
  // next launch may push before it has seen its peers' headers (exchangeKernel).
  unsigned long long single_ok;
  // seq of the latest launch that succeeded (0: none): this rank saw every peer's header or
  // lines of it, so every peer had ended the op before it, and the next op may write the
  // Lamport parity that op used before it has seen its peers' headers (lamport.cu).
  unsigned long long any_ok;
};

constexpr unsigned kDoneFailed = 1u << 31;

// Marks the launch failed in the done word before this thread goes on (a fence: the block's
// count, added after its last barrier, comes after the mark in the word's order).
__device__ __forceinline__ void markFailed(Counter* counter) {
  atomicOr(&counter->done, kDoneFailed);
  __threadfence();
}

struct Ctx {
  const ExchangeLaunch* a;
  uint64_t seq;
  Counter* counter;
  uint64_t start_ns;
};

// Records a failure once per launch (the first block to fail writes the status).
__device__ void fail(const Ctx& c, uint32_t code, int peer, const ExchangeHeader* theirs) {
  const ExchangeLaunch& a = *c.a;
  markFailed(c.counter);
  if (atomicMax(&c.counter->failed, static_cast<unsigned>(c.seq)) < static_cast<unsigned>(c.seq) && a.status) {
    ExchangeStatus* s = a.status;
    s->peer = peer;
    s->seq = c.seq;
    s->mine = a.header[peer];
    s->mine.seq = c.seq;
    if (theirs) s->theirs = *theirs;
    __threadfence_system();
    *reinterpret_cast<volatile uint32_t*>(&s->code) = code;
    __threadfence_system();
  }
}

// The slow path of every wait (every 1024th spin): false when the launch has failed, its
// deadline has passed or the host has aborted it (the last two recorded).
__device__ bool keepWaiting(const Ctx& c, int peer) {
  if (*reinterpret_cast<volatile unsigned*>(&c.counter->failed) >= static_cast<unsigned>(c.seq)) {
    markFailed(c.counter);  // another block's failure, or the host's abortWaits
    return false;
  }
  if (c.a->timeout_ns && device::globalTimerNs() - c.start_ns > c.a->timeout_ns) {
    fail(c, ExchangeStatus::kTimeout, peer, nullptr);
    return false;
  }
  if (c.a->abort && *reinterpret_cast<const volatile uint32_t*>(c.a->abort)) {
    fail(c, ExchangeStatus::kAborted, peer, nullptr);
    return false;
  }
  return true;
}

// Spins until *p >= want. False when the launch failed or the deadline passed (recorded).
__device__ bool waitAtLeast(const Ctx& c, const uint64_t* p, uint64_t want, int peer) {
  uint32_t spins = 0;
  while (device::ldAcquireSys64(p) < want)
    if ((++spins & 1023) == 0 && !keepWaiting(c, peer)) return false;
  return true;
}

__device__ __forceinline__ ExchangeHeader* headerSlot(char* staging, const ExchangeLayout& l, uint64_t seq, int src) {
  return reinterpret_cast<ExchangeHeader*>(staging + l.header) + (seq & 1) * kExchangeMaxRanks + src;
}
__device__ bool sameHeader(const ExchangeHeader& m, const ExchangeHeader& t) {
  return m.kind == t.kind && m.dtype == t.dtype && m.redop == t.redop && m.mode == t.mode && m.root == t.root &&
         (m.op_bytes == 0 || t.op_bytes == 0 || m.op_bytes == t.op_bytes) && t.send_bytes == m.recv_bytes &&
         t.recv_bytes == m.send_bytes && m.round_bytes == t.round_bytes && m.blocks == t.blocks &&
         m.split == t.split && m.lamport_bytes == t.lamport_bytes;
}

// ---- reductions, in an accumulator type, rank order ----

template <typename T> struct AccOf { using type = T; };
template <> struct AccOf<__half> { using type = float; };
template <> struct AccOf<__nv_bfloat16> { using type = float; };

template <typename T> __device__ __forceinline__ typename AccOf<T>::type toAcc(T v) { return v; }
template <> __device__ __forceinline__ float toAcc(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float toAcc(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T fromAcc(typename AccOf<T>::type v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half fromAcc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 fromAcc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename A> __device__ __forceinline__ bool isNan(A v) {
  if constexpr (std::is_floating_point_v<A>) return v != v;
  return false;
}

template <typename A> __device__ __forceinline__ A apply(A x, A y, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return static_cast<A>(x + y);
    case ReduceOp::kProduct: return static_cast<A>(x * y);
    case ReduceOp::kMin:
      if (isNan(x) || isNan(y)) return isNan(x) ? x : y;
      return y < x ? y : x;
    case ReduceOp::kMax:
      if (isNan(x) || isNan(y)) return isNan(x) ? x : y;
      return y > x ? y : x;
    default: break;
  }
  if constexpr (std::is_integral_v<A>) {
    switch (op) {
      case ReduceOp::kBand: return static_cast<A>(x & y);
      case ReduceOp::kBor: return static_cast<A>(x | y);
      case ReduceOp::kBxor: return static_cast<A>(x ^ y);
      default: break;
    }
  }
  return x;
}

// Bool: stored as bytes 0/1; SUM/MAX/BOR = or, PRODUCT/MIN/BAND = and, BXOR = xor.
struct Bool {};
template <> struct AccOf<Bool> { using type = bool; };

template <typename T>
__device__ __forceinline__ T finishAcc(typename AccOf<T>::type acc, ReduceOp op, int avg_n) {
  using A = typename AccOf<T>::type;
  if (op == ReduceOp::kAvg) acc = static_cast<A>(acc / static_cast<A>(avg_n));
  return fromAcc<T>(acc);
}

// Whether this launch has failed, decided once for the whole block (a barrier).
__device__ bool blockFailed(const Ctx& c) {
  __shared__ int failed;
  __syncthreads();
  if (threadIdx.x == 0) {
    failed = *reinterpret_cast<volatile unsigned*>(&c.counter->failed) >= static_cast<unsigned>(c.seq);
    if (failed) markFailed(c.counter);
  }
  __syncthreads();
  const bool f = failed;
  __syncthreads();
  return f;
}

// ---- Lamport lines (lamport.cu; the small pairs of a staged exchange, exchange.cu) ----

__device__ __forceinline__ char* lamportArea(char* staging, const ExchangeLayout& l, int n, int parity, int src) {
  return staging + l.lamport + (static_cast<uint64_t>(parity) * n + src) * kLamportSourceBytes;
}

__device__ __forceinline__ void putLine(char* line, uint64_t v, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(line), "r"(static_cast<uint32_t>(v)),
               "r"(flag), "r"(static_cast<uint32_t>(v >> 32)), "r"(flag)
               : "memory");
}

// A line as loaded: its 8 bytes and the flag in each half.
struct Line {
  uint32_t lo, f0, hi, f1;
  __device__ bool carries(uint32_t flag) const { return f0 == flag && f1 == flag; }
  __device__ uint64_t value() const { return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32); }
};

// One load of a line (the check is the caller's, so that several loads can be in flight).
__device__ __forceinline__ Line loadLine(const char* line) {
  Line l;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(l.lo), "=r"(l.f0), "=r"(l.hi), "=r"(l.f1)
               : "l"(line)
               : "memory");
  return l;
}

// True, with the line's 8 bytes in *v, when the line carries `flag` in both halves.
__device__ __forceinline__ bool takeLine(const char* line, uint32_t flag, uint64_t* v) {
  const Line l = loadLine(line);
  *v = l.value();
  return l.carries(flag);
}

// The peer's header in this rank's header slot for op c.seq, when the peer has written it and it
// disagrees with this rank's (a peer on the staged kernel, or a Lamport peer whose lines have
// not all come): recorded as a failure. True when the launch should stop waiting.
__device__ bool slotDisagrees(const Ctx& c, int q) {
  const ExchangeLaunch& a = *c.a;
  ExchangeHeader* h = headerSlot(a.staging[a.rank], a.layout, c.seq, q);
  const uint64_t seq = device::ldAcquireSys64(&h->seq);
  if (seq < c.seq) return false;
  ExchangeHeader theirs = *h;
  if (seq > c.seq) {
    fail(c, ExchangeStatus::kAhead, q, &theirs);
    return true;
  }
  if (sameHeader(a.header[q], theirs)) return false;
  fail(c, ExchangeStatus::kMismatch, q, &theirs);
  return true;
}

// Spins until `line` carries this op's flag. False when the launch failed, its deadline passed
// or it was aborted; `watch_slot`: also when peer q's header slot disagrees.
__device__ bool awaitLine(const Ctx& c, const char* line, uint32_t flag, int q, uint64_t* v, bool watch_slot) {
  uint32_t spins = 0;
  while (!takeLine(line, flag, v)) {
    if ((++spins & 1023) == 0) {
      if (!keepWaiting(c, q)) return false;
      if (watch_slot && slotDisagrees(c, q)) return false;
    }
  }
  return true;
}

// Bytes of line i of a pair of `bytes` (1..8; the line carries 8 bytes of the pair from 8 * i).
__device__ __forceinline__ uint64_t lineLen(uint64_t bytes, uint64_t i) { return bytes - 8 * i < 8 ? bytes - 8 * i : 8; }

// `len` (1..8) bytes at p, little-endian in a word.
__device__ __forceinline__ uint64_t load8(const char* p, uint64_t len) {
  if (len == 8 && (reinterpret_cast<uintptr_t>(p) & 7) == 0) return *reinterpret_cast<const uint64_t*>(p);
  uint64_t v = 0;
  for (uint64_t i = 0; i < len; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}
__device__ __forceinline__ void store8(char* p, uint64_t v, uint64_t len) {
  if (len == 8 && (reinterpret_cast<uintptr_t>(p) & 7) == 0) {
    *reinterpret_cast<uint64_t*>(p) = v;
    return;
  }
  for (uint64_t i = 0; i < len; ++i) p[i] = static_cast<char>(v >> (8 * i));
}

// Whether op c.seq may write Lamport lines before it has seen its peers' headers: this rank's
// previous op succeeded (Counter::any_ok), so every peer has ended the op before that, the last
// one that wrote the parity this op writes.
__device__ __forceinline__ bool linesEarly(uint64_t seq, uint64_t any_ok) { return seq >= 1 && any_ok == seq - 1; }
__device__ bool linesEarly(const Ctx& c) {
  return linesEarly(c.seq, *reinterpret_cast<volatile unsigned long long*>(&c.counter->any_ok));
}

// Otherwise (after a failed op) a block waits until every peer has written its header of this
// op into this rank's header slot, which it does only once its previous op has ended; a header
// that disagrees fails the op here. False when the launch failed.
__device__ bool awaitPeersStarted(const Ctx& c) {
  const ExchangeLaunch& a = *c.a;
  if (threadIdx.x < a.size && static_cast<int>(threadIdx.x) != a.rank) {
    const int q = threadIdx.x;
    const ExchangeHeader* h = headerSlot(a.staging[a.rank], a.layout, c.seq, q);
    if (waitAtLeast(c, &h->seq, c.seq, q)) {
      ExchangeHeader theirs = *h;
      if (theirs.seq > c.seq)
        fail(c, ExchangeStatus::kAhead, q, &theirs);
      else if (!sameHeader(a.header[q], theirs))
        fail(c, ExchangeStatus::kMismatch, q, &theirs);
    }
  }
  return !blockFailed(c);
}

// Every pair's header lines (block 0's threads [0, n * kLamportHeaderLines)).
__device__ void pushHeaderLines(const Ctx& c, uint32_t flag, int parity) {
  const ExchangeLaunch& a = *c.a;
  const int me = a.rank, n = a.size;
  if (blockIdx.x != 0 || threadIdx.x >= n * kLamportHeaderLines) return;
  const int p = threadIdx.x / kLamportHeaderLines, w = threadIdx.x % kLamportHeaderLines;
  if (p == me) return;
  ExchangeHeader h = a.header[p];
  h.seq = c.seq;
  putLine(lamportArea(a.staging[p], a.layout, n, parity, me) + w * kLamportLineBytes,
          reinterpret_cast<const uint64_t*>(&h)[w], flag);
}

// Ends a block of the launch; the last block to finish numbers the next op and records whether
// this op succeeded, and with every pair in one round (exchangePushesEarly). One atomic add per
// block tells the last one both (Counter::done; a block that failed marked the word before its
// last barrier). No fence follows the counter's words: the kernel's end publishes them to the
// next launch on the stream, the only reader.
__device__ void finishLaunch(const Ctx& c, bool single) {
  __syncthreads();
  if (threadIdx.x == 0) {
    Counter* counter = c.counter;
    const unsigned before = atomicAdd(&counter->done, 1u);
    if ((before & ~kDoneFailed) == gridDim.x - 1) {
      const bool ok = !(before & kDoneFailed);
      counter->done = 0;
      counter->single_ok = ok && single ? c.seq : 0;
      counter->any_ok = ok ? c.seq : 0;
      counter->seq = c.seq;
    }
  }
}

}  // namespace
}  // namespace moelink::cuda
