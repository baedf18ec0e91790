// The Lamport kernel: a small in-host exchange (exchangeLamport) whose data carries its own
// validity, so that one NVLink crossing is the whole cost of the op.
//
// Every 8 bytes of a pair travel as one 16-byte line {low word, flag, high word, flag}, stored
// with one 16-byte instruction into the receiver's Lamport area (parity seq & 1, slot of the
// sender); the flag is the op's number. A receiver polls each line until both flags carry
// this op's number (a line is written at once, and each 8-byte half of it is seen whole), so
// no flag follows the data and nothing is acknowledged. The op's header travels the same way,
// as the first kLamportHeaderLines lines of every pair. Every block loads the peers' header
// lines in the same wait as its first data lines and checks them once its lines are in
// (checkHeaders), so the check costs no round trip of its own: a disagreement fails the op on
// every rank with the staged kernel's words (exchange.cu), and a block that waits for lines a
// peer does not send looks at that peer's header lines and slot on the slow path of its wait
// (peerDisagrees). A block may have written lines of an op its peers disagree about into the
// output before the check fails the op; a failed op's output is undefined.
//
// The two-shot all_reduce (ExchangeMode::kReduceGather, Gather) runs the reduce-scatter half's
// pairs as above, then each thread sends the lines it reduced of this rank's block to every peer
// as lines of the same op, kLamportGatherLine lines into its slot there, and places the peers'
// reduced lines of the same index into the output (gatherLines): two crossings, one launch.
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
// peer in registers, so the larger groups run at most half as many threads per block. A launch
// runs lamportThreadsFor(x, t) threads per block (ExchangeLaunch::threads), at most this bound.
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

// One word of a peer's header lines, which threads [0, n * kLamportHeaderLines) load beside
// their first lines: the header is checked after the data (checkHeaders), so that waiting for it
// costs no round trip of its own.
struct HeaderWord {
  bool pending = false;  // this thread has a word, not yet come
  bool taken = false;    // and it has come, into v
  uint64_t v = 0;
};

// The line of this thread's header word: peer threadIdx.x / kLamportHeaderLines, word
// threadIdx.x % kLamportHeaderLines.
__device__ __forceinline__ const char* headerLine(const ExchangeLaunch& a, int parity) {
  return lamportArea(a.staging[a.rank], a.layout, a.size, parity, threadIdx.x / kLamportHeaderLines) +
         (threadIdx.x % kLamportHeaderLines) * kLamportLineBytes;
}

__device__ HeaderWord headerWord(const ExchangeLaunch& a) {
  HeaderWord h;
  h.pending = threadIdx.x < a.size * kLamportHeaderLines && threadIdx.x / kLamportHeaderLines != a.rank;
  return h;
}

// Peer q's header, when its lines of this op have all come and it disagrees with this rank's,
// or when its header slot disagrees (a peer on the staged kernel): recorded as a failure. The
// slow path of a wait for q's lines, whose number is this rank's idea of the op: a peer that
// disagrees may never send them.
__device__ bool peerDisagrees(const Ctx& c, int q, uint32_t flag, int parity) {
  const ExchangeLaunch& a = *c.a;
  if (slotDisagrees(c, q)) return true;
  ExchangeHeader theirs;
  const char* area = lamportArea(a.staging[a.rank], a.layout, a.size, parity, q);
  for (uint64_t w = 0; w < kLamportHeaderLines; ++w)
    if (!takeLine(area + w * kLamportLineBytes, flag, &reinterpret_cast<uint64_t*>(&theirs)[w])) return false;
  if (sameHeader(a.header[q], theirs)) return false;
  fail(c, ExchangeStatus::kMismatch, q, &theirs);
  return true;
}

// Lines i and i + blockDim.x from the peers, bit 2q + j of `want` for line j from peer q, into
// v[q][j], and the header word h while pending: every wanted line is loaded at once, and the
// loads repeated for those that do not yet carry this op's flag. False when the launch failed,
// its deadline passed or it was aborted, or a peer disagrees about the op.
template <int N>
__device__ bool awaitLines(const Ctx& c, uint32_t flag, int parity, uint64_t i, uint32_t want, uint64_t (&v)[N][2],
                           HeaderWord& h) {
  const ExchangeLaunch& a = *c.a;
  // Line i from peer 0; peer q's is kLamportSourceBytes further per q.
  const char* line0 = lamportArea(a.staging[a.rank], a.layout, a.size, parity, 0) +
                      (kLamportHeaderLines + i) * kLamportLineBytes;
  const uint64_t second = blockDim.x * kLamportLineBytes;
  uint32_t spins = 0;
  while (want || h.pending) {
    Line l[N][2], hl;
#pragma unroll
    for (int q = 0; q < N; ++q)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if ((want >> (2 * q + j)) & 1) l[q][j] = loadLine(line0 + q * kLamportSourceBytes + j * second);
    if (h.pending) hl = loadLine(headerLine(a, parity));
#pragma unroll
    for (int q = 0; q < N; ++q)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (((want >> (2 * q + j)) & 1) && l[q][j].carries(flag)) {
          v[q][j] = l[q][j].value();
          want &= ~(1u << (2 * q + j));
        }
    if (h.pending && hl.carries(flag)) {
      h.v = hl.value();
      h.pending = false;
      h.taken = true;
    }
    if ((want || h.pending) && (++spins & 1023) == 0) {
      const int q = want ? (__ffs(want) - 1) / 2 : static_cast<int>(threadIdx.x / kLamportHeaderLines);
      if (!keepWaiting(c, q) || peerDisagrees(c, q, flag, parity)) return false;
    }
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
  // Peers by rank (a constant index into the launch's arrays, no indexed load of them).
  for (uint64_t i = 2ull * blockIdx.x * blockDim.x + threadIdx.x;; i += stride) {
    uint64_t w[N][2];
    uint32_t lines = 0;
#pragma unroll
    for (int p = 0; p < N; ++p) {
      const uint32_t has = p < n && p != me ? pairLines(a.send_bytes[p], i) : 0;
      if (has) {
        loadLines(a.in + a.send_off[p], a.send_bytes[p], i, w[p]);
        lines |= has << (2 * p);
      }
    }
    if (!lines) return;
#pragma unroll
    for (int p = 0; p < N; ++p) {
      if (!((lines >> (2 * p)) & 3)) continue;
      char* area = lamportArea(a.staging[p], a.layout, n, parity, me) + (kLamportHeaderLines + i) * kLamportLineBytes;
      if ((lines >> (2 * p)) & 1) putLine(area, w[p][0], flag);
      if ((lines >> (2 * p)) & 2) putLine(area + blockDim.x * kLamportLineBytes, w[p][1], flag);
    }
  }
}

// Every peer's header, checked by every block once its lines have come (a block that consumed
// lines of an op its peer disagrees about fails it here, with the staged kernel's words). The
// header threads' words meet in shared memory; `ok`: this thread's wait ended well.
__device__ void checkHeaders(const Ctx& c, const HeaderWord& h, bool ok) {
  const ExchangeLaunch& a = *c.a;
  const int me = a.rank, n = a.size;
  __shared__ ExchangeHeader theirs[kExchangeMaxRanks];
  __shared__ int got[kExchangeMaxRanks * kLamportHeaderLines];
  if (h.pending || h.taken) {
    reinterpret_cast<uint64_t*>(&theirs[threadIdx.x / kLamportHeaderLines])[threadIdx.x % kLamportHeaderLines] = h.v;
    got[threadIdx.x] = ok && h.taken;
  }
  __syncthreads();
  if (threadIdx.x < n && static_cast<int>(threadIdx.x) != me) {
    const int q = threadIdx.x;
    bool all = true;
    for (uint64_t w = 0; w < kLamportHeaderLines; ++w) all = all && got[q * kLamportHeaderLines + w];
    if (all && !sameHeader(a.header[q], theirs[q])) fail(c, ExchangeStatus::kMismatch, q, &theirs[q]);
  }
}

// The two-shot all_reduce's gather half (kReduceGather) at lines i and i + blockDim.x: this
// rank's reduced lines r (bits `lines` of its block) to every peer, kLamportGatherLine lines into
// its slot, then every peer's reduced lines into place (out + send_off[q]). A line of this rank
// goes to peer p only after this thread has p's scatter line of this op at the same place: p had
// started this op, so it had ended op seq - 2, the last to read those lines. False when the wait
// failed.
template <int N>
__device__ bool gatherLines(const Ctx& c, uint32_t flag, int parity, uint64_t i, uint32_t lines,
                            const uint64_t (&r)[2], uint64_t (&v)[N][2], HeaderWord& h) {
  const ExchangeLaunch& a = *c.a;
  const int me = a.rank, n = a.size;
  const uint64_t at = (kLamportHeaderLines + kLamportGatherLine + i) * kLamportLineBytes;
#pragma unroll
  for (int p = 0; p < N; ++p) {
    if (p >= n || p == me || !lines) continue;
    char* area = lamportArea(a.staging[p], a.layout, n, parity, me) + at;
    if (lines & 1) putLine(area, r[0], flag);
    if (lines & 2) putLine(area + blockDim.x * kLamportLineBytes, r[1], flag);
  }
  uint32_t want = 0;
#pragma unroll
  for (int q = 0; q < N; ++q)
    if (q < n && q != me) want |= pairLines(a.send_bytes[q], i) << (2 * q);
  if (!awaitLines<N>(c, flag, parity, kLamportGatherLine + i, want, v, h)) return false;
#pragma unroll
  for (int q = 0; q < N; ++q)
    if ((want >> (2 * q)) & 3) storeLines(a.out + a.send_off[q], a.send_bytes[q], i, v[q]);
  return true;
}

// Copies or reduces this thread's lines into place, with the header word h beside the first
// wait (and, in the two-shot all_reduce, Gather, sends the reduced lines on and takes the
// peers'). False when a wait failed.
template <typename Reduce, int N, bool Gather>
__device__ bool consumeLines(const Ctx& c, uint32_t flag, int parity, HeaderWord& h) {
  const ExchangeLaunch& a = *c.a;
  const int me = a.rank, n = a.size;
  const uint64_t stride = 2ull * a.launched * blockDim.x;
  const uint64_t first = 2ull * blockIdx.x * blockDim.x + threadIdx.x;
  uint64_t v[N][2];
  if (a.mode == static_cast<uint8_t>(ExchangeMode::kCopy)) {
    const char* own = a.in + a.send_off[me];
    char* into = a.out + a.recv_off[me];
    for (uint64_t i = first;; i += stride) {
      uint32_t want = 0;
#pragma unroll
      for (int q = 0; q < N; ++q)
        if (q < n && q != me) want |= pairLines(a.recv_bytes[q], i) << (2 * q);
      const bool mine = own != into && pairLines(a.send_bytes[me], i);
      if (!want && !mine) return true;
      if (mine) {
        uint64_t w[2];
        loadLines(own, a.send_bytes[me], i, w);
        storeLines(into, a.send_bytes[me], i, w);
      }
      if (!awaitLines<N>(c, flag, parity, i, want, v, h)) return false;
#pragma unroll
      for (int q = 0; q < N; ++q)
        if ((want >> (2 * q)) & 3) storeLines(a.out + a.recv_off[q], a.recv_bytes[q], i, v[q]);
    }
  }
  // This rank's block; in the two-shot all_reduce the lines run on over the peers' blocks (the
  // first is the longest), whose reduced lines this thread takes after its own.
  const uint64_t bytes = a.reduce_bytes;
  char* const into = Gather ? a.out + a.send_off[me] : a.out;
  const uint64_t span = Gather && a.send_bytes[0] > bytes ? a.send_bytes[0] : bytes;
  for (uint64_t i = first; 8 * i < span; i += stride) {
    const uint32_t lines = pairLines(bytes, i);
    uint64_t r[2] = {0, 0};
    if (lines) {
      uint32_t want = 0;
#pragma unroll
      for (int q = 0; q < N; ++q)
        if (q < n && q != me) want |= lines << (2 * q);
#pragma unroll
      for (int q = 0; q < N; ++q)
        if (q == me) loadLines(a.in + a.send_off[me], bytes, i, v[q]);
      if (!awaitLines<N>(c, flag, parity, i, want, v, h)) return false;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint64_t w[N];
#pragma unroll
        for (int q = 0; q < N; ++q) w[q] = v[q][j];
        r[j] = Reduce::template run<N>(w, n, static_cast<ReduceOp>(a.redop), n);
      }
      storeLines(into, bytes, i, r);
    }
    if constexpr (Gather)
      if (!gatherLines<N>(c, flag, parity, i, lines, r, v, h)) return false;
  }
  return true;
}

// Blocks [0, launched) move the data; the last block writes this rank's header into each peer's
// header slot (a release store per peer: its round trip stays off the data blocks). The op's
// number (the counter) and whether the op before it succeeded are loaded together at the start.
template <typename Reduce, int N, bool Gather>
__global__ void __launch_bounds__(threadsFor<N>()) lamportKernel(const __grid_constant__ ExchangeLaunch a) {
  // Launched as a programmatic dependent (launchFor): wait for the kernel before this one on the
  // stream to end and its writes to be seen, then let the next launch of this kernel get its
  // blocks onto the GPU while this one runs (it waits here in turn).
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int me = a.rank, n = a.size;
  Counter* counter = reinterpret_cast<Counter*>(a.staging[me] + a.layout.counter);
  // The op's number and whether the last op succeeded, loaded together (each thread its own;
  // its deadline counts from its own start).
  const unsigned long long last = *reinterpret_cast<volatile unsigned long long*>(&counter->seq);
  const unsigned long long any_ok = *reinterpret_cast<volatile unsigned long long*>(&counter->any_ok);
  Ctx c{&a, last + 1, counter, device::globalTimerNs()};
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
  } else if (linesEarly(c.seq, any_ok) || awaitPeersStarted(c)) {
    pushLines<N>(c, flag, parity);
    HeaderWord h = headerWord(a);
    bool ok = consumeLines<Reduce, N, Gather>(c, flag, parity, h);
    if (ok && h.pending) {  // a thread without lines of its own
      uint64_t none[N][2];
      ok = awaitLines<N>(c, flag, parity, 0, 0, none, h);
    }
    checkHeaders(c, h, ok);
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
template <typename Reduce, int N, bool Gather>
cudaError_t launchAs(const ExchangeLaunch& l, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(l.launched + 1);
  cfg.blockDim = dim3(l.threads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = l.dependent_launch ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, lamportKernel<Reduce, N, Gather>, l);
  if (e != cudaErrorNotSupported && e != cudaErrorInvalidValue) return e;
  (void)cudaGetLastError();
  lamportKernel<Reduce, N, Gather><<<cfg.gridDim, cfg.blockDim, 0, stream>>>(l);
  return cudaGetLastError();
}

// The kernels of a copy (LineCopy) or a reduction; a reduction's also as the two-shot all_reduce.
template <typename Reduce>
cudaError_t launchFor(const ExchangeLaunch& l, cudaStream_t stream) {
  if constexpr (!std::is_same_v<Reduce, LineCopy>)
    if (l.mode == static_cast<uint8_t>(ExchangeMode::kReduceGather))
      return l.size <= 4 ? launchAs<Reduce, 4, true>(l, stream) : launchAs<Reduce, kExchangeMaxRanks, true>(l, stream);
  return l.size <= 4 ? launchAs<Reduce, 4, false>(l, stream) : launchAs<Reduce, kExchangeMaxRanks, false>(l, stream);
}

}  // namespace

cudaError_t launchLamport(const ExchangeLaunch& l, cudaStream_t stream) {
  if (l.mode == static_cast<uint8_t>(ExchangeMode::kCopy)) return launchFor<LineCopy>(l, stream);
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
