// The Lamport kernel: a small in-host exchange (exchangeLamport) whose data carries its own
// validity, so that one NVLink crossing is the whole cost of the op.
//
// Every 8 bytes of a pair travel as one 16-byte line {low word, flag, high word, flag}, stored
// with one 16-byte instruction into the receiver's Lamport area (parity seq & 1, slot of the
// sender); the flag is the op's number. A receiver polls each line until both flags carry
// this op's number (a line is written at once, and each 8-byte half of it is seen whole), so
// no flag follows the data and nothing is acknowledged. The op's header travels the same way,
// as the first kLamportHeaderLines lines of every pair, and every block checks every
// peer's header before it consumes anything: a disagreement fails the op on every rank with
// the staged kernel's words (exchange.cu).
//
// Reuse: op seq writes the parity that op seq - 2 used. When this rank's op seq - 1 succeeded
// (linesEarly), it saw every peer's header or lines of seq - 1, which a peer writes only after
// its own op seq - 2 has ended: nothing of seq - 2 is still being read, and the lines go out at
// once. After a failed op, the blocks first wait for every peer's header of seq in the header
// slots (awaitPeersStarted; the extra block writes this rank's at the start of every launch).
//
// The staged protocol on the other end: a rank also writes its header into the peer's header
// slot (the extra block, off the data's path), and while it waits for a peer's lines it
// watches that peer's header slot too, so that when the ranks disagree about the op and one
// of them runs the staged kernel, both fail with the mismatch instead of waiting for their
// deadline. Ops that agree take the same protocol on every rank, but for copies whose pairs
// differ in length from rank to rank (an all-to-all, a broadcast's scatter half): there a rank
// on the staged kernel moves its short pairs as lines (exchangeLamportPairs), so the two meet.
#include "exchange_common.cuh"

namespace moelink::cuda {

namespace {

// Kernels are built for groups of up to N = 4 and N = 8 ranks: a thread keeps two lines of every
// peer in registers, so the larger groups run half as many threads per block.
template <int N> constexpr int threadsFor() { return lamportThreads(N); }

// ---- the reduction of one line's 8 bytes over the n sources, in rank order ----

template <typename T>
struct LineReduce {
  template <int N>
  __device__ static uint64_t run(const uint64_t* w, int n, ReduceOp op, int avg_n) {
    using A = typename AccOf<T>::type;
    constexpr int V = 8 / sizeof(T);
    A acc[V];
    const T* e0 = reinterpret_cast<const T*>(&w[0]);
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = toAcc<T>(e0[k]);
#pragma unroll
    for (int q = 1; q < N; ++q) {
      if (q >= n) break;
      const T* e = reinterpret_cast<const T*>(&w[q]);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = apply<A>(acc[k], toAcc<T>(e[k]), op);
    }
    uint64_t r;
    T* o = reinterpret_cast<T*>(&r);
#pragma unroll
    for (int k = 0; k < V; ++k) o[k] = finishAcc<T>(acc[k], op, avg_n);
    return r;
  }
};

// Bool: bytes 0/1; SUM/MAX/BOR = or, PRODUCT/MIN/BAND = and, BXOR = xor.
template <>
struct LineReduce<Bool> {
  template <int N>
  __device__ static uint64_t run(const uint64_t* w, int n, ReduceOp op, int) {
    uint64_t r = 0;
    for (int k = 0; k < 8; ++k) {
      bool acc = ((w[0] >> (8 * k)) & 0xff) != 0;
      for (int q = 1; q < n; ++q) {
        const bool v = ((w[q] >> (8 * k)) & 0xff) != 0;
        if (op == ReduceOp::kBxor) acc = acc != v;
        else if (op == ReduceOp::kProduct || op == ReduceOp::kMin || op == ReduceOp::kBand) acc = acc && v;
        else acc = acc || v;
      }
      r |= static_cast<uint64_t>(acc) << (8 * k);
    }
    return r;
  }
};

// complex64, one per line: SUM/AVG add, PRODUCT multiplies.
struct LineReduceComplex64 {
  template <int N>
  __device__ static uint64_t run(const uint64_t* w, int n, ReduceOp op, int avg_n) {
    const float* v = reinterpret_cast<const float*>(&w[0]);
    float re = v[0], im = v[1];
    for (int q = 1; q < n; ++q) {
      const float* x = reinterpret_cast<const float*>(&w[q]);
      if (op == ReduceOp::kProduct) {
        const float r2 = re * x[0] - im * x[1];
        im = re * x[1] + im * x[0];
        re = r2;
      } else {
        re += x[0];
        im += x[1];
      }
    }
    if (op == ReduceOp::kAvg) {
      re /= static_cast<float>(avg_n);
      im /= static_cast<float>(avg_n);
    }
    uint64_t r;
    float* o = reinterpret_cast<float*>(&r);
    o[0] = re;
    o[1] = im;
    return r;
  }
};

struct LineCopy {
  template <int N>
  __device__ static uint64_t run(const uint64_t* w, int, ReduceOp, int) { return w[0]; }
};

// ---- a thread's two lines: i and i + blockDim.x, so that a warp's loads and stores are contiguous ----
//
// A thread's memory operations are issued together and their results used after: the source
// words of every pair, then every line's store; every peer's two lines, then the checks. Two
// lines cost one load latency and one wait, not one per line and peer.

// Bits j of the lines (i, i + blockDim.x) that a pair of `bytes` has.
__device__ __forceinline__ uint32_t pairLines(uint64_t bytes, uint64_t i) {
  return (8 * i < bytes ? 1u : 0u) | (8 * (i + blockDim.x) < bytes ? 2u : 0u);
}

// The words of lines i and i + blockDim.x of a pair of `bytes` at p (0 for a line it lacks).
__device__ __forceinline__ void loadLines(const char* p, uint64_t bytes, uint64_t i, uint64_t* w) {
  const uint64_t i1 = i + blockDim.x;
  w[0] = 8 * i < bytes ? load8(p + 8 * i, lineLen(bytes, i)) : 0;
  w[1] = 8 * i1 < bytes ? load8(p + 8 * i1, lineLen(bytes, i1)) : 0;
}
__device__ __forceinline__ void storeLines(char* p, uint64_t bytes, uint64_t i, const uint64_t* w) {
  const uint64_t i1 = i + blockDim.x;
  if (8 * i < bytes) store8(p + 8 * i, w[0], lineLen(bytes, i));
  if (8 * i1 < bytes) store8(p + 8 * i1, w[1], lineLen(bytes, i1));
}

// Lines i and i + blockDim.x from the peers, bit 2q + j of `want` for line j from peer q, into v[q][j]:
// every wanted line is loaded at once, and the loads repeated for those that do not yet carry
// this op's flag. False when the launch failed, its deadline passed or it was aborted.
template <int N>
__device__ bool awaitLines(const Ctx& c, uint32_t flag, int parity, uint64_t i, uint32_t want, uint64_t (&v)[N][2]) {
  const ExchangeLaunch& a = *c.a;
  uint32_t spins = 0;
  while (want) {
    Line l[N][2];
#pragma unroll
    for (int q = 0; q < N; ++q)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if ((want >> (2 * q + j)) & 1)
          l[q][j] = loadLine(lamportArea(a.staging[a.rank], a.layout, a.size, parity, q) +
                             (kLamportHeaderLines + i + j * blockDim.x) * kLamportLineBytes);
#pragma unroll
    for (int q = 0; q < N; ++q)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (((want >> (2 * q + j)) & 1) && l[q][j].carries(flag)) {
          v[q][j] = l[q][j].value();
          want &= ~(1u << (2 * q + j));
        }
    if (want && (++spins & 1023) == 0 && !keepWaiting(c, (__ffs(want) - 1) / 2)) return false;
  }
  return true;
}

// Pushes this thread's lines of every pair (and, in block 0, the header lines).
template <int N>
__device__ void pushLines(const Ctx& c, uint32_t flag, int parity) {
  const ExchangeLaunch& a = *c.a;
  const int me = a.rank, n = a.size;
  pushHeaderLines(c, flag, parity);
  const uint64_t stride = 2ull * a.launched * blockDim.x;
  for (uint64_t i = 2ull * blockIdx.x * blockDim.x + threadIdx.x;; i += stride) {
    // Slot k: the peer k ranks after this one.
    uint64_t w[N][2];
    uint32_t lines = 0;
#pragma unroll
    for (int k = 1; k < N; ++k) {
      const int p = (me + k) % n;
      const uint32_t has = k < n ? pairLines(a.send_bytes[p], i) : 0;
      if (has) {
        loadLines(a.in + a.send_off[p], a.send_bytes[p], i, w[k]);
        lines |= has << (2 * k);
      }
    }
    if (!lines) return;
#pragma unroll
    for (int k = 1; k < N; ++k) {
      const int p = (me + k) % n;
      if (!((lines >> (2 * k)) & 3)) continue;
      char* area = lamportArea(a.staging[p], a.layout, n, parity, me) + (kLamportHeaderLines + i) * kLamportLineBytes;
      if ((lines >> (2 * k)) & 1) putLine(area, w[k][0], flag);
      if ((lines >> (2 * k)) & 2) putLine(area + blockDim.x * kLamportLineBytes, w[k][1], flag);
    }
  }
}

// Every peer's header lines, checked by every block before it consumes. False when the launch
// failed (a disagreement is recorded here).
__device__ bool checkHeaders(const Ctx& c, uint32_t flag, int parity) {
  const ExchangeLaunch& a = *c.a;
  const int me = a.rank, n = a.size;
  __shared__ ExchangeHeader theirs[kExchangeMaxRanks];
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  if (threadIdx.x < n * kLamportHeaderLines) {
    const int q = threadIdx.x / kLamportHeaderLines, w = threadIdx.x % kLamportHeaderLines;
    if (q != me) {
      uint64_t v = 0;
      const char* line = lamportArea(a.staging[me], a.layout, n, parity, q) + w * kLamportLineBytes;
      if (awaitLine(c, line, flag, q, &v, /*watch_slot=*/w == 0))
        reinterpret_cast<uint64_t*>(&theirs[q])[w] = v;
      else
        bad = 1;
    }
  }
  __syncthreads();
  if (!bad && threadIdx.x < n && static_cast<int>(threadIdx.x) != me) {
    const int q = threadIdx.x;
    if (!sameHeader(a.header[q], theirs[q])) {
      fail(c, ExchangeStatus::kMismatch, q, &theirs[q]);
      bad = 1;
    }
  }
  __syncthreads();
  // Another block's failure needs no check here: every block checks every peer's header, and
  // a peer that has gone is this block's own deadline too.
  return !bad;
}

// Copies or reduces this thread's lines into place.
template <typename Reduce, int N>
__device__ void consumeLines(const Ctx& c, uint32_t flag, int parity) {
  const ExchangeLaunch& a = *c.a;
  const int me = a.rank, n = a.size;
  const uint64_t stride = 2ull * a.launched * blockDim.x;
  const uint64_t first = 2ull * blockIdx.x * blockDim.x + threadIdx.x;
  uint64_t v[N][2];
  if (a.mode != static_cast<uint8_t>(ExchangeMode::kReduce)) {
    const char* own = a.in + a.send_off[me];
    char* into = a.out + a.recv_off[me];
    for (uint64_t i = first;; i += stride) {
      uint32_t want = 0;
#pragma unroll
      for (int q = 0; q < N; ++q)
        if (q < n && q != me) want |= pairLines(a.recv_bytes[q], i) << (2 * q);
      const bool mine = own != into && pairLines(a.send_bytes[me], i);
      if (!want && !mine) return;
      if (mine) {
        uint64_t w[2];
        loadLines(own, a.send_bytes[me], i, w);
        storeLines(into, a.send_bytes[me], i, w);
      }
      if (!awaitLines<N>(c, flag, parity, i, want, v)) return;
#pragma unroll
      for (int q = 0; q < N; ++q)
        if ((want >> (2 * q)) & 3) storeLines(a.out + a.recv_off[q], a.recv_bytes[q], i, v[q]);
    }
  }
  const uint64_t bytes = a.reduce_bytes;
  for (uint64_t i = first; 8 * i < bytes; i += stride) {
    const uint32_t lines = pairLines(bytes, i);
    uint32_t want = 0;
#pragma unroll
    for (int q = 0; q < N; ++q)
      if (q < n && q != me) want |= lines << (2 * q);
#pragma unroll
    for (int q = 0; q < N; ++q)
      if (q == me) loadLines(a.in + a.send_off[me], bytes, i, v[q]);
    if (!awaitLines<N>(c, flag, parity, i, want, v)) return;
    uint64_t r[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      uint64_t w[N];
#pragma unroll
      for (int q = 0; q < N; ++q) w[q] = v[q][j];
      r[j] = Reduce::template run<N>(w, n, static_cast<ReduceOp>(a.redop), n);
    }
    storeLines(a.out, bytes, i, r);
  }
}

// Blocks [0, launched) move the data; the last block writes this rank's header into each peer's
// header slot (a release store per peer: its round trip stays off the data blocks).
template <typename Reduce, int N>
__global__ void __launch_bounds__(threadsFor<N>()) lamportKernel(const __grid_constant__ ExchangeLaunch a) {
  // Launched as a programmatic dependent (launchFor): wait for the kernel before this one on the
  // stream to end and its writes to be seen, then let the next launch of this kernel get its
  // blocks onto the GPU while this one runs (it waits here in turn).
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int me = a.rank, n = a.size;
  Counter* counter = reinterpret_cast<Counter*>(a.staging[me] + a.layout.counter);
  Ctx c{&a, *reinterpret_cast<volatile unsigned long long*>(&counter->seq) + 1, counter, 0};
  __shared__ uint64_t start;
  if (threadIdx.x == 0) start = device::globalTimerNs();
  __syncthreads();
  c.start_ns = start;
  // Op numbers start at 1, and a line of another op of this parity carries another number.
  const uint32_t flag = static_cast<uint32_t>(c.seq);
  const int parity = static_cast<int>(c.seq & 1);
  if (static_cast<int>(blockIdx.x) == a.launched) {
    if (threadIdx.x < n && static_cast<int>(threadIdx.x) != me) {
      const int p = threadIdx.x;
      ExchangeHeader* h = headerSlot(a.staging[p], a.layout, c.seq, me);
      const uint64_t* src = reinterpret_cast<const uint64_t*>(&a.header[p]);
      uint64_t* dst = reinterpret_cast<uint64_t*>(h);
      for (int i = 0; i < 7; ++i) dst[i] = src[i];
      device::stReleaseSys64(&h->seq, c.seq);
    }
  } else if (linesEarly(c) || awaitPeersStarted(c)) {
    pushLines<N>(c, flag, parity);
    if (checkHeaders(c, flag, parity)) consumeLines<Reduce, N>(c, flag, parity);
  }
  // No staged half was read in this op: the next staged op of one round may push early.
  // (Only the last block to end may number the next op: a block that has yet to start reads
  // this op's number from the counter.)
  finishLaunch(c, /*single=*/true);
}

// Launches with programmatic stream serialization (unless MOELINK_CUDA_PDL=0): the GPU may start
// this launch while the kernel before it ends, its blocks waiting at griddepcontrol.wait (captured
// into a graph as a programmatic edge); a plain launch where the attribute is refused. In a plain
// launch griddepcontrol.wait returns at once, the stream having ordered it already.
template <typename Reduce, int N>
cudaError_t launchAs(const ExchangeLaunch& l, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(l.launched + 1);
  cfg.blockDim = dim3(threadsFor<N>());
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = l.dependent_launch ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, lamportKernel<Reduce, N>, l);
  if (e != cudaErrorNotSupported && e != cudaErrorInvalidValue) return e;
  (void)cudaGetLastError();
  lamportKernel<Reduce, N><<<cfg.gridDim, cfg.blockDim, 0, stream>>>(l);
  return cudaGetLastError();
}

template <typename Reduce>
cudaError_t launchFor(const ExchangeLaunch& l, cudaStream_t stream) {
  return l.size <= 4 ? launchAs<Reduce, 4>(l, stream) : launchAs<Reduce, kExchangeMaxRanks>(l, stream);
}

}  // namespace

cudaError_t launchLamport(const ExchangeLaunch& l, cudaStream_t stream) {
  if (l.mode != static_cast<uint8_t>(ExchangeMode::kReduce)) return launchFor<LineCopy>(l, stream);
  switch (static_cast<DType>(l.dtype)) {
    case DType::kFloat32: return launchFor<LineReduce<float>>(l, stream);
    case DType::kFloat64: return launchFor<LineReduce<double>>(l, stream);
    case DType::kFloat16: return launchFor<LineReduce<__half>>(l, stream);
    case DType::kBFloat16: return launchFor<LineReduce<__nv_bfloat16>>(l, stream);
    case DType::kInt8: return launchFor<LineReduce<int8_t>>(l, stream);
    case DType::kInt16: return launchFor<LineReduce<int16_t>>(l, stream);
    case DType::kInt32: return launchFor<LineReduce<int32_t>>(l, stream);
    case DType::kInt64: return launchFor<LineReduce<long long>>(l, stream);
    case DType::kUInt8: return launchFor<LineReduce<uint8_t>>(l, stream);
    case DType::kBool: return launchFor<LineReduce<Bool>>(l, stream);
    case DType::kComplex64: return launchFor<LineReduceComplex64>(l, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace moelink::cuda
