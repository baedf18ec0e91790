// The host route's reduction of received rows (moelink/cuda/rows_reduce.h), with the
// accumulator types and operators of the in-host kernels (exchange_common.cuh).
#include "exchange_common.cuh"
#include "moelink/cuda/rows_reduce.h"

namespace moelink::cuda {

namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // vectors per thread in flight per source (the rows are read over PCIe)

// The launch's view of its plan, checked against the bounds; valid == false: do nothing.
struct View {
  bool valid;
  char* out;
  const char* rows;
  const char* mine;
  uint64_t stride, bytes;
  int n, me;
};

__device__ View readPlan(const RowsReduce& r) {
  View v{};
  const volatile RowsPlan* p = r.plan;
  const uint64_t ticket = p->ticket, off = p->off, len = p->len, stride = p->stride;
  const int n = p->rows, me = p->me;
  v.valid = ticket == r.ticket && n >= 1 && n <= r.max_rows && me >= 0 && me < n && off <= r.max_len &&
            len <= r.max_len - off &&
            (n == 1 || (stride <= r.rows_bytes && static_cast<uint64_t>(n - 1) * stride + len <= r.rows_bytes));
  v.out = r.out + off;
  v.rows = r.rows;
  v.mine = r.mine + off;
  v.stride = stride;
  v.bytes = len;
  v.n = n;
  v.me = me;
  return v;
}

// Read once per block (the plan is in host memory) into shared memory.
__device__ View viewOf(const RowsReduce& r) {
  __shared__ View shared;
  if (threadIdx.x == 0) shared = readPlan(r);
  __syncthreads();
  return shared;
}
__device__ __forceinline__ const char* source(const View& v, int q) {
  return q == v.me ? v.mine : v.rows + static_cast<uint64_t>(q) * v.stride;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rowsReduceKernel(RowsReduce a) {
  const View r = viewOf(a);
  if (!r.valid) return;
  using A = typename AccOf<T>::type;
  constexpr int V = 16 / sizeof(T);
  const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  uintptr_t align = reinterpret_cast<uintptr_t>(r.out) | reinterpret_cast<uintptr_t>(r.rows) |
                    reinterpret_cast<uintptr_t>(r.mine) | r.stride | r.bytes;
  uint64_t first = 0;  // elements done by the vector path
  if ((align & 15) == 0) {
    const uint64_t vectors = r.bytes / 16;
    for (uint64_t base = tid; base < vectors; base += stride * kUnroll) {
      A acc[kUnroll][V];
      for (int q = 0; q < r.n; ++q) {
        const int4* s = reinterpret_cast<const int4*>(source(r, q));
        int4 w[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (base + u * stride < vectors) w[u] = s[base + u * stride];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const T* e = reinterpret_cast<const T*>(&w[u]);
#pragma unroll
          for (int k = 0; k < V; ++k) acc[u][k] = q == 0 ? toAcc<T>(e[k]) : apply<A>(acc[u][k], toAcc<T>(e[k]), a.op);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * stride >= vectors) continue;
        int4 o;
        T* e = reinterpret_cast<T*>(&o);
#pragma unroll
        for (int k = 0; k < V; ++k) e[k] = finishAcc<T>(acc[u][k], a.op, r.n);
        reinterpret_cast<int4*>(r.out)[base + u * stride] = o;
      }
    }
    first = vectors * V;
  }
  const uint64_t count = r.bytes / sizeof(T);
  for (uint64_t i = first + tid; i < count; i += stride) {
    A acc = toAcc<T>(reinterpret_cast<const T*>(source(r, 0))[i]);
    for (int q = 1; q < r.n; ++q) acc = apply<A>(acc, toAcc<T>(reinterpret_cast<const T*>(source(r, q))[i]), a.op);
    reinterpret_cast<T*>(r.out)[i] = finishAcc<T>(acc, a.op, r.n);
  }
}

// Bool: bytes 0/1; SUM/MAX/BOR = or, PRODUCT/MIN/BAND = and, BXOR = xor (as the in-host kernels).
__global__ void __launch_bounds__(kThreads) rowsReduceBool(RowsReduce a) {
  const View r = viewOf(a);
  if (!r.valid) return;
  const ReduceOp op = a.op;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < r.bytes; i += stride) {
    bool acc = source(r, 0)[i] != 0;
    for (int q = 1; q < r.n; ++q) {
      const bool v = source(r, q)[i] != 0;
      if (op == ReduceOp::kBxor) acc = acc != v;
      else if (op == ReduceOp::kProduct || op == ReduceOp::kMin || op == ReduceOp::kBand) acc = acc && v;
      else acc = acc || v;
    }
    r.out[i] = acc;
  }
}

// Complex: SUM/AVG add, PRODUCT multiplies (the others are refused before launch).
template <typename R>
__global__ void __launch_bounds__(kThreads) rowsReduceComplex(RowsReduce a) {
  const View r = viewOf(a);
  if (!r.valid) return;
  const ReduceOp op = a.op;
  const uint64_t count = r.bytes / (2 * sizeof(R));
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const R* v = reinterpret_cast<const R*>(source(r, 0)) + 2 * i;
    R re = v[0], im = v[1];
    for (int q = 1; q < r.n; ++q) {
      const R* w = reinterpret_cast<const R*>(source(r, q)) + 2 * i;
      if (op == ReduceOp::kProduct) {
        const R re2 = re * w[0] - im * w[1];
        im = re * w[1] + im * w[0];
        re = re2;
      } else {
        re += w[0];
        im += w[1];
      }
    }
    if (op == ReduceOp::kAvg) {
      re /= static_cast<R>(r.n);
      im /= static_cast<R>(r.n);
    }
    R* o = reinterpret_cast<R*>(r.out) + 2 * i;
    o[0] = re;
    o[1] = im;
  }
}

}  // namespace

cudaError_t launchRowsReduce(const RowsReduce& r, cudaStream_t stream) {
  if (r.max_len == 0) return cudaSuccess;
  if (r.plan == nullptr || r.max_rows < 1 || !collective::reduceUnsupportedReason(r.dtype, r.op).empty())
    return cudaErrorInvalidValue;
  // Enough blocks to keep many PCIe reads in flight, no more than the largest plan needs.
  const uint64_t per_block = static_cast<uint64_t>(kThreads) * 16 * kUnroll;
  const int grid = static_cast<int>(std::min<uint64_t>(264, (r.max_len + per_block - 1) / per_block));
  switch (r.dtype) {
    case DType::kFloat32: rowsReduceKernel<float><<<grid, kThreads, 0, stream>>>(r); break;
    case DType::kFloat64: rowsReduceKernel<double><<<grid, kThreads, 0, stream>>>(r); break;
    case DType::kFloat16: rowsReduceKernel<__half><<<grid, kThreads, 0, stream>>>(r); break;
    case DType::kBFloat16: rowsReduceKernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(r); break;
    case DType::kInt8: rowsReduceKernel<int8_t><<<grid, kThreads, 0, stream>>>(r); break;
    case DType::kInt16: rowsReduceKernel<int16_t><<<grid, kThreads, 0, stream>>>(r); break;
    case DType::kInt32: rowsReduceKernel<int32_t><<<grid, kThreads, 0, stream>>>(r); break;
    case DType::kInt64: rowsReduceKernel<long long><<<grid, kThreads, 0, stream>>>(r); break;
    case DType::kUInt8: rowsReduceKernel<uint8_t><<<grid, kThreads, 0, stream>>>(r); break;
    case DType::kBool: rowsReduceBool<<<grid, kThreads, 0, stream>>>(r); break;
    case DType::kComplex64: rowsReduceComplex<float><<<grid, kThreads, 0, stream>>>(r); break;
    case DType::kComplex128: rowsReduceComplex<double><<<grid, kThreads, 0, stream>>>(r); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace moelink::cuda
