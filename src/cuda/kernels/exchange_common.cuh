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
  unsigned int done;       // blocks of the current launch that have finished
  unsigned int failed;     // seq of a failed launch (blocks stop waiting)
  // seq of the latest launch that succeeded with every pair in one round (0: none): the
  // next launch may push before it has seen its peers' headers (exchangeKernel).
  unsigned long long single_ok;
};

struct Ctx {
  const ExchangeLaunch* a;
  uint64_t seq;
  Counter* counter;
  uint64_t start_ns;
};

// Records a failure once per launch (the first block to fail writes the status).
__device__ void fail(const Ctx& c, uint32_t code, int peer, const ExchangeHeader* theirs) {
  const ExchangeLaunch& a = *c.a;
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
  if (*reinterpret_cast<volatile unsigned*>(&c.counter->failed) >= static_cast<unsigned>(c.seq)) return false;
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
  if (threadIdx.x == 0)
    failed = *reinterpret_cast<volatile unsigned*>(&c.counter->failed) >= static_cast<unsigned>(c.seq);
  __syncthreads();
  const bool f = failed;
  __syncthreads();
  return f;
}

// Ends a block of the launch; the last block to finish numbers the next op (a launch of one
// block needs no count: the kernel's end publishes its writes to the next launch), and
// records whether this op succeeded with every pair in one round (exchangePushesEarly).
__device__ void finishLaunch(const Ctx& c, bool single) {
  __syncthreads();
  if (threadIdx.x == 0) {
    Counter* counter = c.counter;
    bool last = gridDim.x == 1;
    if (!last) {
      __threadfence();
      last = atomicAdd(&counter->done, 1u) == gridDim.x - 1;
      if (last) counter->done = 0;
    }
    if (last) {
      const bool ok = *reinterpret_cast<volatile unsigned*>(&counter->failed) < static_cast<unsigned>(c.seq);
      counter->single_ok = ok && single ? c.seq : 0;
      counter->seq = c.seq;
      if (gridDim.x > 1) __threadfence();
    }
  }
}

}  // namespace
}  // namespace moelink::cuda
