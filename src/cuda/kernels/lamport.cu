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

constexpr int kLamportThreads = 512;

// ---- the reduction of one line's 8 bytes over the n sources, in rank order ----

template <typename T>
struct LineReduce {
  __device__ static uint64_t run(const uint64_t* w, int n, ReduceOp op, int avg_n) {
    using A = typename AccOf<T>::type;
    constexpr int V = 8 / sizeof(T);
    A acc[V];
    const T* e0 = reinterpret_cast<const T*>(&w[0]);
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = toAcc<T>(e0[k]);
    for (int q = 1; q < n; ++q) {
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
  __device__ static uint64_t run(const uint64_t* w, int, ReduceOp, int) { return w[0]; }
};

// Pushes this thread's lines of every pair (and, in block 0, the header lines).
__device__ void pushLines(const Ctx& c, uint32_t flag, int parity) {
  const ExchangeLaunch& a = *c.a;
  const int me = a.rank, n = a.size;
  pushHeaderLines(c, flag, parity);
  const uint64_t stride = static_cast<uint64_t>(a.launched) * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int k = 1; k < n; ++k) {
    const int p = (me + k) % n;
    pushPairLines(c, p, a.in + a.send_off[p], a.send_bytes[p], flag, parity, first, stride);
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
  return !bad && !blockFailed(c);
}

// Copies or reduces this thread's lines into place.
template <typename Reduce>
__device__ void consumeLines(const Ctx& c, uint32_t flag, int parity) {
  const ExchangeLaunch& a = *c.a;
  const int me = a.rank, n = a.size;
  const uint64_t stride = static_cast<uint64_t>(a.launched) * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  auto line = [&](int q, uint64_t i) {
    return lamportArea(a.staging[me], a.layout, n, parity, q) + (kLamportHeaderLines + i) * kLamportLineBytes;
  };
  if (a.mode != static_cast<uint8_t>(ExchangeMode::kReduce)) {
    const char* own = a.in + a.send_off[me];
    char* into = a.out + a.recv_off[me];
    if (own != into)
      for (uint64_t i = first; i * 8 < a.send_bytes[me]; i += stride) {
        const uint64_t len = a.send_bytes[me] - i * 8 < 8 ? a.send_bytes[me] - i * 8 : 8;
        store8(into + i * 8, load8(own + i * 8, len), len);
      }
    for (int k = 1; k < n; ++k) {
      const int q = (me + n - k) % n;
      if (!takePairLines(c, q, a.out + a.recv_off[q], a.recv_bytes[q], flag, parity, first, stride)) return;
    }
    return;
  }
  const uint64_t bytes = a.reduce_bytes;
  for (uint64_t i = first; i * 8 < bytes; i += stride) {
    const uint64_t len = bytes - i * 8 < 8 ? bytes - i * 8 : 8;
    uint64_t w[kExchangeMaxRanks];
    w[me] = load8(a.in + a.send_off[me] + i * 8, len);
    for (int q = 0; q < n; ++q)
      if (q != me && !awaitLine(c, line(q, i), flag, q, &w[q], false)) return;
    store8(a.out + i * 8, Reduce::run(w, n, static_cast<ReduceOp>(a.redop), n), len);
  }
}

// Blocks [0, launched) move the data; the last block writes this rank's header into each peer's
// header slot (a release store per peer: its round trip stays off the data blocks).
template <typename Reduce>
__global__ void __launch_bounds__(kLamportThreads) lamportKernel(const __grid_constant__ ExchangeLaunch a) {
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
    pushLines(c, flag, parity);
    if (checkHeaders(c, flag, parity)) consumeLines<Reduce>(c, flag, parity);
  }
  // No staged half was read in this op: the next staged op of one round may push early.
  finishLaunch(c, /*single=*/true);
}

}  // namespace

cudaError_t launchLamport(const ExchangeLaunch& l, cudaStream_t stream) {
  const int grid = l.launched + 1;
  if (l.mode != static_cast<uint8_t>(ExchangeMode::kReduce)) {
    lamportKernel<LineCopy><<<grid, kLamportThreads, 0, stream>>>(l);
    return cudaGetLastError();
  }
  switch (static_cast<DType>(l.dtype)) {
    case DType::kFloat32: lamportKernel<LineReduce<float>><<<grid, kLamportThreads, 0, stream>>>(l); break;
    case DType::kFloat64: lamportKernel<LineReduce<double>><<<grid, kLamportThreads, 0, stream>>>(l); break;
    case DType::kFloat16: lamportKernel<LineReduce<__half>><<<grid, kLamportThreads, 0, stream>>>(l); break;
    case DType::kBFloat16: lamportKernel<LineReduce<__nv_bfloat16>><<<grid, kLamportThreads, 0, stream>>>(l); break;
    case DType::kInt8: lamportKernel<LineReduce<int8_t>><<<grid, kLamportThreads, 0, stream>>>(l); break;
    case DType::kInt16: lamportKernel<LineReduce<int16_t>><<<grid, kLamportThreads, 0, stream>>>(l); break;
    case DType::kInt32: lamportKernel<LineReduce<int32_t>><<<grid, kLamportThreads, 0, stream>>>(l); break;
    case DType::kInt64: lamportKernel<LineReduce<long long>><<<grid, kLamportThreads, 0, stream>>>(l); break;
    case DType::kUInt8: lamportKernel<LineReduce<uint8_t>><<<grid, kLamportThreads, 0, stream>>>(l); break;
    case DType::kBool: lamportKernel<LineReduce<Bool>><<<grid, kLamportThreads, 0, stream>>>(l); break;
    case DType::kComplex64: lamportKernel<LineReduceComplex64><<<grid, kLamportThreads, 0, stream>>>(l); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace moelink::cuda
