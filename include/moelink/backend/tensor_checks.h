// The checks every call of backend "ep" passes on the caller's thread before any unit sees it
// (each raises a Python ValueError or TypeError naming the op), and the conversions from
// torch's types to the collective layer's.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "moelink/collective/dtype.h"

namespace moelink::backend {

// Checks that `t` is a defined, dense tensor; raises a ValueError naming `op`. (Which device
// it is on is DevicePlacement's business.)
void checkTensor(const at::Tensor& t, const char* op);

// Where an op's tensors live: every one on the CPU, or every one on CUDA (then on one
// device). Raises a ValueError for a mix, for other devices, and for CUDA tensors on two
// devices, naming `op`.
class DevicePlacement {
 public:
  explicit DevicePlacement(const char* op) : op_(op) {}
  DevicePlacement& add(const at::Tensor& t);
  DevicePlacement& add(const std::vector<at::Tensor>& ts);
  DevicePlacement& add(const std::vector<std::vector<at::Tensor>>& lists);
  // The device type of the call (CPU for a call without tensors).
  c10::DeviceType deviceType() const { return cuda_ > 0 ? c10::DeviceType::CUDA : c10::DeviceType::CPU; }
  int device() const { return device_; }

 private:
  const char* op_;
  int cpu_ = 0, cuda_ = 0, device_ = -1;
};

void checkSingle(const std::vector<at::Tensor>& ts, const char* op);
void checkSameDtype(const at::Tensor& a, const at::Tensor& b, const char* op);
void checkRoot(int64_t root, int size, const char* op);
// Checks a per-rank list (one tensor per rank, each of `like`'s dtype and element count).
void checkList(const std::vector<at::Tensor>& list, const at::Tensor& like, int size, const char* op,
               const char* what);
// Bytes an all-to-all sends to / receives from each rank, at these offsets.
struct PairLayout {
  std::vector<uint64_t> send_off, send_bytes, recv_off, recv_bytes;
};
// all_to_all_single: validates the split sizes (empty = even) into a layout.
PairLayout alltoallLayout(const at::Tensor& input, const at::Tensor& output, const std::vector<int64_t>& in_splits,
                          const std::vector<int64_t>& out_splits, int size, int rank);
// all_to_all (lists): one tensor per rank each way.
PairLayout alltoallLayout(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs);
// The dtype as the collective layer knows it; dtypes it cannot reduce become kBytes
// (moved, never reduced).
collective::DType toDType(at::ScalarType t);
// Maps and validates a reduction for `t`, raising for unsupported combinations.
collective::ReduceOp toReduceOp(const c10d::ReduceOp& op, at::ScalarType t, const char* opname);
// PREMUL_SUM (torch.distributed._make_nccl_premul_sum(factor)) runs as SUM over inputs
// multiplied by the factor first (toReduceOp gives kSum): `x` times the factor, as a new
// tensor (x itself for other ops), or in place where `x` is also the output.
at::Tensor preMultiplied(const c10d::ReduceOp& op, const at::Tensor& x);
void preMultiplyInPlace(const c10d::ReduceOp& op, at::Tensor& x);

uint64_t nbytes(const at::Tensor& t);
// reduce_scatter_tensor_coalesced's input as one flat reduce-scatter takes it: rank blocks
// [rank][output 0 | output 1 | ...], block r of each holding inputs[i]'s slice r.
at::Tensor blocksByRank(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs, int size);
// all_gather_coalesced's outputs from one flat all-gather of the concatenated inputs:
// outputs[r][j] <- gathered's block r, at input j's place in it.
void copyGatheredLists(const at::Tensor& gathered, std::vector<std::vector<at::Tensor>>& outputs,
                       const std::vector<at::Tensor>& inputs, int size);

}  // namespace moelink::backend
