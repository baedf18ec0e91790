// The Works of backend "ep": what every op's Work has (its outputs and their future, the
// result future, the ranks lost while it ran), and the Work of an op on the collective worker,
// which owns its tensors until the worker completes it. The CUDA unit's Work (cuda/) derives
// from BackendWork too.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "moelink/collective/dtype.h"

namespace moelink::collective {
class CollectiveWorker;
struct OpSpec;
struct AlgoContext;
}  // namespace moelink::collective

namespace moelink::backend {

// The ranks that left the group while an op ran (moelink.failed_ranks); every Work of the
// backend has them.
class LostRanks {
 public:
  virtual ~LostRanks() = default;
  void setLost(const std::vector<int>& ranks) { lost_.assign(ranks.begin(), ranks.end()); }
  std::vector<int64_t> lostRanks() const { return lost_; }
  // The size of the group the op ran in (the extent of a per-rank failure hint).
  void setGroupSize(int size) { group_size_ = size; }
  int groupSize() const { return group_size_; }

 private:
  std::vector<int64_t> lost_;
  int group_size_ = 0;
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

// Hands the op that `build` makes to `worker`; `work` completes with its outcome (and the ranks
// the op lost). Returns `work`.
c10::intrusive_ptr<EpWork> submitToWorker(collective::CollectiveWorker& worker, c10::intrusive_ptr<EpWork> work,
                                          std::function<collective::OpSpec(const collective::AlgoContext&)> build,
                                          std::chrono::milliseconds timeout);

// The exception a failed op completes its Work and Future with ("moelink " + what).
std::exception_ptr distBackendError(const std::string& what);

}  // namespace moelink::backend
