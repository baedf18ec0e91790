// EpWork and the tensor checks/staging shared by the backend's translation units.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "moelink/collective/dtype.h"

namespace moelink::backend {

// A submitted op: owns its tensors until the worker completes it.
class EpWork : public c10d::Work {
 public:
  EpWork(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs);

  // Keeps `t` alive until completion (inputs and staging buffers).
  void keep(const at::Tensor& t) { keep_.push_back(t); }
  // On success, runs `f` on the worker thread before completion (copy results back).
  void onSuccess(std::function<void()> f) { finishers_.push_back(std::move(f)); }
  // On success, copies the contiguous staging buffer `src` into the caller's `dst`.
  void copyBack(const at::Tensor& dst, const at::Tensor& src);
  // Completes: "" is success, else the error. Called once, on the worker thread.
  void complete(std::string error, int source_rank = -1);

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  int sourceRank() const override { return source_.load(); }

 private:
  std::vector<at::Tensor> outputs_, keep_;
  std::vector<std::function<void()>> finishers_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<int> source_{-1};
};

// Checks that `t` is a dense CPU tensor; raises a ValueError/TypeError naming `op`.
void checkTensor(const at::Tensor& t, const char* op);
void checkSingle(const std::vector<at::Tensor>& ts, const char* op);
void checkSameDtype(const at::Tensor& a, const at::Tensor& b, const char* op);
void checkRoot(int64_t root, int size, const char* op);
// The dtype as the collective layer knows it; dtypes it cannot reduce become kBytes
// (moved, never reduced).
collective::DType toDType(at::ScalarType t);
// Maps and validates a reduction for `t`, raising for unsupported combinations.
collective::ReduceOp toReduceOp(const c10d::ReduceOp& op, at::ScalarType t, const char* opname);

// A contiguous buffer holding `t`'s values; written back into `t` on success when `t`
// itself is not contiguous (for ops that update `t` in place).
at::Tensor inplaceBuffer(EpWork& w, const at::Tensor& t);
// A contiguous buffer for an output; written back into `t` on success when needed.
at::Tensor outputBuffer(EpWork& w, const at::Tensor& t);
// A contiguous copy (or `t` itself) kept alive by the work.
at::Tensor inputBuffer(EpWork& w, const at::Tensor& t);
uint64_t nbytes(const at::Tensor& t);

}  // namespace moelink::backend
