// EpWork and the tensor checks/staging shared by the backend's translation units.
#pragma once

#include <atomic>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "moelink/collective/dtype.h"

namespace moelink::backend {

// The ranks that left the group while an op ran (moelink.failed_ranks); every Work of the
// backend has them.
class LostRanks {
 public:
  virtual ~LostRanks() = default;
  void setLost(const std::vector<int>& ranks) { lost_.assign(ranks.begin(), ranks.end()); }
  std::vector<int64_t> lostRanks() const { return lost_; }

 private:
  std::vector<int64_t> lost_;
};

// What every Work of the backend has (EpWork on the worker, CudaWork on the GPU): its outputs,
// the future of them, and what Work::getFutureResult() returns (as NCCL's works do): a future,
// made at the first call, of the op's c10d::WorkResult. settle() completes all of them once.
class BackendWork : public c10d::Work, public LostRanks {
 public:
  BackendWork(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs);

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override;
  std::vector<at::Tensor> result() override { return outputs_; }

 protected:
  // The op completed: "" is success, else the error (a DistBackendError for the Work and its
  // future; TIMEOUT or COMM_ERROR for the result future).
  void settle(const std::string& error);

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::mutex result_mu_;
  bool settled_ = false;
  uint8_t result_ = 0;
  c10::intrusive_ptr<c10::ivalue::Future> result_future_;
};

// A submitted op: owns its tensors until the worker completes it.
class EpWork : public BackendWork {
 public:
  using BackendWork::BackendWork;

  // Keeps `t` alive until completion (inputs and staging buffers).
  void keep(const at::Tensor& t) { keep_.push_back(t); }
  // On success, runs `f` on the worker thread before completion (copy results back).
  void onSuccess(std::function<void()> f) { finishers_.push_back(std::move(f)); }
  // On success, copies the contiguous staging buffer `src` into the caller's `dst`.
  void copyBack(const at::Tensor& dst, const at::Tensor& src);
  // Completes: "" is success, else the error. Called once, on the worker thread.
  void complete(std::string error, int source_rank = -1);

  int sourceRank() const override { return source_.load(); }

 private:
  std::vector<at::Tensor> keep_;
  std::vector<std::function<void()>> finishers_;
  std::atomic<int> source_{-1};
};

// The exception a failed op completes its Work and Future with ("moelink " + what).
std::exception_ptr distBackendError(const std::string& what);

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
  bool cuda() const { return cuda_ > 0; }
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

// A contiguous buffer holding `t`'s values; written back into `t` on success when `t`
// itself is not contiguous (for ops that update `t` in place).
at::Tensor inplaceBuffer(EpWork& w, const at::Tensor& t);
// A contiguous buffer for an output; written back into `t` on success when needed.
at::Tensor outputBuffer(EpWork& w, const at::Tensor& t);
// A contiguous copy (or `t` itself) kept alive by the work.
at::Tensor inputBuffer(EpWork& w, const at::Tensor& t);
uint64_t nbytes(const at::Tensor& t);

}  // namespace moelink::backend
