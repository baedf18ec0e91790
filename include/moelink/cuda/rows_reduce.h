// The host route's reduction on the GPU (src/cuda/kernels/rows_reduce.cu): no torch types.
//
// A rank's piece of a reduce-scatter arrives in pinned host memory as one row per peer; the
// GPU reduces those rows (read over PCIe through their device mapping) with this rank's own
// row (device memory) in rank order, so that every rank's result is the same bit for bit, and
// writes the result to `out` (device or host-mapped memory).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "moelink/collective/dtype.h"
#include "moelink/cuda/host_pieces.h"  // RowsPlan

namespace moelink::cuda {

struct RowsReduce {
  char* out = nullptr;         // result at out + plan.off
  const char* rows = nullptr;  // row i (i != plan.me) at rows + i * plan.stride: device view of host memory
  const char* mine = nullptr;  // this rank's row at mine + plan.off
  const RowsPlan* plan = nullptr;  // device view of host memory
  uint64_t ticket = 0;
  // Bounds a plan must keep (else the launch does nothing): off + len <= max_len, the rows
  // within rows_bytes, at most max_rows of them.
  uint64_t max_len = 0, rows_bytes = 0;
  int max_rows = 0;
  collective::DType dtype = collective::DType::kFloat32;
  collective::ReduceOp op = collective::ReduceOp::kSum;
};

// Launches the reduction on `stream` (AVG divides by the number of rows). cudaErrorInvalidValue for a pair of
// dtype and op the collectives refuse (see collective::reduceUnsupportedReason).
cudaError_t launchRowsReduce(const RowsReduce& r, cudaStream_t stream);

}  // namespace moelink::cuda
