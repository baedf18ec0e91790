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

namespace moelink::cuda {

// What the worker found when the piece's rows had all arrived (written into host-mapped
// memory before it lets the stream go on): the rows are those of the ranks active then.
struct RowsPlan {
  uint64_t ticket = 0;  // the piece's; a plan with another ticket is stale and the launch does nothing
  uint64_t off = 0;     // this rank's range within `mine` and `out` (bytes)
  uint64_t len = 0;
  uint64_t stride = 0;  // between the rows
  int32_t rows = 0;     // how many (one per active rank, in rank order)
  int32_t me = 0;       // this rank's index among them (its row is `mine`, not in `rows`)
};

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
