// The collectives of EpBackend: each call is validated here, on the caller's thread, then
// handed to the unit of its tensors' device (collectives.h) with the checked arguments.
#include <algorithm>
#include <condition_variable>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include "moelink/backend/collectives.h"
#include "moelink/backend/ep_backend.h"
#include "moelink/backend/work.h"
#include "moelink/collective/algorithms.h"
#include "moelink/collective/worker.h"

namespace moelink::backend {

template <typename CallOptions>
Call EpBackend::callOf(const CallOptions& opts) const {
  return {timeoutOf(opts.timeout), opts.asyncOp};
}

c10::intrusive_ptr<c10d::Work> EpBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                    const c10d::BroadcastOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  checkSingle(tensors, "broadcast");
  checkRoot(opts.rootRank, size_, "broadcast");
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "moelink broadcast: rootTensor must be 0");
  return on(DevicePlacement("broadcast").add(tensors)).broadcast(tensors[0], static_cast<int>(opts.rootRank),
                                                                 callOf(opts));
}

c10::intrusive_ptr<c10d::Work> EpBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                    const c10d::AllreduceOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) return allreduceSparse(tensors, opts);
  checkSingle(tensors, "allreduce");
  auto op = toReduceOp(opts.reduceOp, tensors[0].scalar_type(), "allreduce");
  Collectives& unit = on(DevicePlacement("allreduce").add(tensors));
  preMultiplyInPlace(opts.reduceOp, tensors[0]);  // PREMUL_SUM: the tensor is the output too
  return unit.allreduce(tensors, op, callOf(opts));
}

c10::intrusive_ptr<c10d::Work> EpBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  TORCH_CHECK_VALUE(!tensors.empty(), "moelink allreduce_coalesced: no tensors");
  for (const auto& t : tensors) {
    checkTensor(t, "allreduce_coalesced");
    checkSameDtype(t, tensors[0], "allreduce_coalesced");
  }
  auto op = toReduceOp(opts.reduceOp, tensors[0].scalar_type(), "allreduce_coalesced");
  Collectives& unit = on(DevicePlacement("allreduce_coalesced").add(tensors));
  for (auto& t : tensors) preMultiplyInPlace(opts.reduceOp, t);
  return unit.allreduce(tensors, op, callOf(opts));
}

c10::intrusive_ptr<c10d::Work> EpBackend::reduce(std::vector<at::Tensor>& tensors,
                                                 const c10d::ReduceOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  checkSingle(tensors, "reduce");
  checkRoot(opts.rootRank, size_, "reduce");
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "moelink reduce: rootTensor must be 0");
  auto op = toReduceOp(opts.reduceOp, tensors[0].scalar_type(), "reduce");
  Collectives& unit = on(DevicePlacement("reduce").add(tensors));
  // PREMUL_SUM: the root's tensor receives the result; the others' stay as they were.
  at::Tensor in = tensors[0];
  if (rank_ == opts.rootRank)
    preMultiplyInPlace(opts.reduceOp, in);
  else
    in = preMultiplied(opts.reduceOp, tensors[0]);
  return unit.reduce(in, op, static_cast<int>(opts.rootRank), callOf(opts));
}

c10::intrusive_ptr<c10d::Work> EpBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::AllgatherOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  checkSingle(inputs, "allgather");
  TORCH_CHECK_VALUE(outputs.size() == 1, "moelink allgather: expects one output list per process");
  checkList(outputs[0], inputs[0], size_, "allgather", "the output list");
  return on(DevicePlacement("allgather").add(outputs).add(inputs)).allgather(outputs[0], inputs[0], callOf(opts));
}

c10::intrusive_ptr<c10d::Work> EpBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                          const c10d::AllgatherOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  checkTensor(output, "all_gather_into_tensor");
  checkTensor(input, "all_gather_into_tensor");
  checkSameDtype(output, input, "all_gather_into_tensor");
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size_, "moelink all_gather_into_tensor: output has ",
                    output.numel(), " elements, expected ", input.numel() * size_, " (input ",
                    input.numel(), " x group size ", size_, ")");
  return on(DevicePlacement("all_gather_into_tensor").add(output).add(input)).allgather(output, input, callOf(opts));
}

c10::intrusive_ptr<c10d::Work> EpBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const char* name = "allgather_into_tensor_coalesced";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size() && !inputs.empty(), "moelink ", name,
                    ": needs as many outputs as inputs (", outputs.size(), " vs ", inputs.size(), ")");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], name);
    checkTensor(outputs[i], name);
    checkSameDtype(inputs[i], inputs[0], name);
    checkSameDtype(outputs[i], inputs[0], name);
    TORCH_CHECK_VALUE(outputs[i].numel() == inputs[i].numel() * size_, "moelink ", name, ": output ", i,
                      " has ", outputs[i].numel(), " elements, expected ", inputs[i].numel() * size_);
  }
  return on(DevicePlacement(name).add(outputs).add(inputs)).allgatherCoalesced(outputs, inputs, callOf(opts));
}

c10::intrusive_ptr<c10d::Work> EpBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllgatherOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const char* name = "all_gather_coalesced";
  TORCH_CHECK_VALUE(!inputs.empty(), "moelink ", name, ": no input tensors");
  TORCH_CHECK_VALUE(static_cast<int>(outputs.size()) == size_, "moelink ", name,
                    ": needs one output list per rank (", size_, "), got ", outputs.size());
  for (const auto& t : inputs) {
    checkTensor(t, name);
    checkSameDtype(t, inputs[0], name);
  }
  for (int r = 0; r < size_; ++r) {
    TORCH_CHECK_VALUE(outputs[r].size() == inputs.size(), "moelink ", name, ": output list ", r, " has ",
                      outputs[r].size(), " tensors, expected one per input (", inputs.size(), ")");
    for (size_t j = 0; j < inputs.size(); ++j) {
      checkTensor(outputs[r][j], name);
      checkSameDtype(outputs[r][j], inputs[0], name);
      TORCH_CHECK_VALUE(outputs[r][j].numel() == inputs[j].numel(), "moelink ", name, ": output ", r, "/", j,
                        " has ", outputs[r][j].numel(), " elements, input ", j, " has ", inputs[j].numel());
    }
  }
  return on(DevicePlacement(name).add(outputs).add(inputs)).allgatherLists(outputs, inputs, callOf(opts));
}

c10::intrusive_ptr<c10d::Work> EpBackend::gather_into_tensor(at::Tensor& output, at::Tensor& input,
                                                             const c10d::GatherOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const char* name = "gather_into_tensor";
  checkTensor(input, name);
  checkRoot(opts.rootRank, size_, name);
  std::vector<std::vector<at::Tensor>> outputs;
  if (rank_ == opts.rootRank) {
    checkTensor(output, name);
    checkSameDtype(output, input, name);
    TORCH_CHECK_VALUE(output.numel() == input.numel() * size_, "moelink ", name, ": output has ", output.numel(),
                      " elements, expected ", input.numel() * size_, " (input ", input.numel(), " x group size ",
                      size_, ")");
    TORCH_CHECK_VALUE(output.is_contiguous(), "moelink ", name, ": the root's output must be contiguous");
    outputs.push_back(output.view({size_, -1}).unbind(0));
  }
  std::vector<at::Tensor> inputs{input};
  return gather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> EpBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                 std::vector<at::Tensor>& inputs,
                                                 const c10d::GatherOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  checkSingle(inputs, "gather");
  checkRoot(opts.rootRank, size_, "gather");
  int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1, "moelink gather: the root needs one output list");
    checkList(outputs[0], inputs[0], size_, "gather", "the root's output list");
    outs = outputs[0];
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                      "moelink gather: only the root (rank ", root, ") takes an output list");
  }
  return on(DevicePlacement("gather").add(outputs).add(inputs)).gather(outs, inputs[0], root, callOf(opts));
}

c10::intrusive_ptr<c10d::Work> EpBackend::scatter(std::vector<at::Tensor>& outputs,
                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                  const c10d::ScatterOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  checkSingle(outputs, "scatter");
  checkRoot(opts.rootRank, size_, "scatter");
  int root = static_cast<int>(opts.rootRank);
  if (rank_ == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1, "moelink scatter: the root needs one input list");
    checkList(inputs[0], outputs[0], size_, "scatter", "the root's input list");
  } else {
    TORCH_CHECK_VALUE(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                      "moelink scatter: only the root (rank ", root, ") takes an input list");
  }
  return on(DevicePlacement("scatter").add(outputs).add(inputs))
      .scatter(outputs[0], rank_ == root ? inputs[0] : std::vector<at::Tensor>{}, root, callOf(opts));
}

c10::intrusive_ptr<c10d::Work> EpBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                         std::vector<std::vector<at::Tensor>>& inputs,
                                                         const c10d::ReduceScatterOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  checkSingle(outputs, "reduce_scatter");
  TORCH_CHECK_VALUE(inputs.size() == 1, "moelink reduce_scatter: expects one input list per process");
  checkList(inputs[0], outputs[0], size_, "reduce_scatter", "the input list");
  auto op = toReduceOp(opts.reduceOp, outputs[0].scalar_type(), "reduce_scatter");
  Collectives& unit = on(DevicePlacement("reduce_scatter").add(outputs).add(inputs));
  std::vector<at::Tensor> ins;
  for (const auto& t : inputs[0]) ins.push_back(preMultiplied(opts.reduceOp, t));  // PREMUL_SUM
  return unit.reduceScatter(outputs[0], ins, op, callOf(opts));
}

c10::intrusive_ptr<c10d::Work> EpBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                               const c10d::ReduceScatterOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const char* name = "reduce_scatter_tensor";
  checkTensor(output, name);
  checkTensor(input, name);
  checkSameDtype(output, input, name);
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size_, "moelink ", name, ": input has ", input.numel(),
                    " elements, expected ", output.numel() * size_, " (output ", output.numel(),
                    " x group size ", size_, ")");
  auto op = toReduceOp(opts.reduceOp, output.scalar_type(), name);
  Collectives& unit = on(DevicePlacement(name).add(output).add(input));
  at::Tensor scaled = preMultiplied(opts.reduceOp, input);  // PREMUL_SUM
  return unit.reduceScatter(output, scaled, op, callOf(opts));
}

c10::intrusive_ptr<c10d::Work> EpBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const char* name = "reduce_scatter_tensor_coalesced";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size() && !inputs.empty(), "moelink ", name,
                    ": needs as many outputs as inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], name);
    checkTensor(outputs[i], name);
    checkSameDtype(inputs[i], inputs[0], name);
    checkSameDtype(outputs[i], inputs[0], name);
    TORCH_CHECK_VALUE(inputs[i].numel() == outputs[i].numel() * size_, "moelink ", name, ": input ", i,
                      " has ", inputs[i].numel(), " elements, expected ", outputs[i].numel() * size_);
  }
  auto op = toReduceOp(opts.reduceOp, inputs[0].scalar_type(), name);
  Collectives& unit = on(DevicePlacement(name).add(outputs).add(inputs));
  std::vector<at::Tensor> scaled;
  for (const auto& t : inputs) scaled.push_back(preMultiplied(opts.reduceOp, t));  // PREMUL_SUM
  return unit.reduceScatterCoalesced(outputs, scaled, op, callOf(opts));
}

c10::intrusive_ptr<c10d::Work> EpBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                        std::vector<int64_t>& out_splits,
                                                        std::vector<int64_t>& in_splits,
                                                        const c10d::AllToAllOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const char* name = "all_to_all_single";
  checkTensor(output, name);
  checkTensor(input, name);
  checkSameDtype(output, input, name);
  PairLayout l = alltoallLayout(input, output, in_splits, out_splits, size_, rank_);
  // In place (input and output share memory): data received would overwrite data not yet sent,
  // so the op sends from a copy.
  at::Tensor src = at::get_overlap_status(output, input) == at::MemOverlapStatus::No ? input : input.clone();
  return on(DevicePlacement(name).add(output).add(src)).alltoall(output, src, l, callOf(opts));
}

c10::intrusive_ptr<c10d::Work> EpBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                   std::vector<at::Tensor>& inputs,
                                                   const c10d::AllToAllOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const char* name = "all_to_all";
  TORCH_CHECK_VALUE(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
                    "moelink ", name, ": needs one input and one output tensor per rank (", size_, ")");
  for (int r = 0; r < size_; ++r) {
    checkTensor(inputs[r], name);
    checkTensor(outputs[r], name);
    checkSameDtype(inputs[r], inputs[0], name);
    checkSameDtype(outputs[r], inputs[0], name);
  }
  TORCH_CHECK_VALUE(inputs[rank_].numel() == outputs[rank_].numel(), "moelink ", name,
                    ": this rank's own input and output differ in size");
  PairLayout l = alltoallLayout(inputs, outputs);
  return on(DevicePlacement(name).add(outputs).add(inputs)).alltoall(outputs, inputs, l, callOf(opts));
}

void EpBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  // A tag of its own, far from what applications use.
  constexpr int kTag = -0x6d6c6d62;
  // An explicit zero is a zero budget here, as in gloo (timeoutOf reads it as "unset").
  const std::chrono::milliseconds limit =
      opts.timeout == c10d::kUnsetTimeout ? timeout() : std::max(opts.timeout, std::chrono::milliseconds(0));
  // The wording is gloo's, which PyTorch's tests and users' handlers match on.
  const std::string prefix = "moelink monitored_barrier: ";
  if (size_ > 1 && limit.count() == 0) {
    TORCH_CHECK(rank_ != 0, prefix, "Rank 0 timed out in monitoredBarrier after 0 ms");
    TORCH_CHECK(false, prefix, "Rank ", rank_, " successfully reached monitoredBarrier, but received errors while "
                "waiting for send/recv from rank 0: its timeout is 0 ms");
  }
  struct Outcome {
    std::mutex mu;
    std::condition_variable cv;
    int pending = 0;
    std::vector<std::string> errors;
  };
  auto outcome = std::make_shared<Outcome>();
  auto track = [outcome](size_t slot) {
    return [outcome, slot](const std::string& err, int = -1) {
      std::lock_guard<std::mutex> g(outcome->mu);
      outcome->errors[slot] = err;
      if (--outcome->pending == 0) outcome->cv.notify_all();
    };
  };
  auto waitAll = [outcome] {
    std::unique_lock<std::mutex> lk(outcome->mu);
    outcome->cv.wait(lk, [&] { return outcome->pending == 0; });
  };
  std::vector<uint8_t> bytes(size_, 0);  // rank 0: one check-in byte per rank; others: rank 0's answer
  if (rank_ != 0) {
    outcome->errors.assign(2, "");
    outcome->pending = 2;
    uint8_t hello = 1;
    worker().send(0, &hello, 1, kTag, track(0), limit);
    // Rank 0 answers once it has heard from everyone or waited `limit` for them.
    worker().recv(0, &bytes[0], 1, kTag, track(1), 2 * limit);
    waitAll();
    TORCH_CHECK(outcome->errors[1].empty() && bytes[0] == 1, prefix, "Rank ", rank_,
                " successfully reached monitoredBarrier, but received errors while waiting for send/recv from "
                "rank 0: ", bytes[0] == 2 ? "rank 0 reports that other ranks failed to pass the barrier"
                                          : "no answer from rank 0 within " + std::to_string(2 * limit.count()) + " ms");
    return;
  }
  outcome->errors.assign(size_, "");
  outcome->pending = size_ - 1;
  for (int r = 1; r < size_; ++r) worker().recv(r, &bytes[r], 1, kTag, track(r), limit);
  waitAll();
  std::vector<int> missing;
  for (int r = 1; r < size_; ++r)
    if (!outcome->errors[r].empty()) missing.push_back(r);
  // Answer the ranks that arrived (1: passed, 2: others failed), so that they do not wait out
  // the timeout; sends to missing ranks would only wait for them.
  std::vector<uint8_t> answer(size_, missing.empty() ? 1 : 2);
  outcome->errors.assign(size_, "");
  outcome->pending = size_ - 1 - static_cast<int>(missing.size());
  for (int r = 1; r < size_; ++r)
    if (std::find(missing.begin(), missing.end(), r) == missing.end())
      worker().send(r, &answer[r], 1, kTag, track(r), limit);
  if (outcome->pending > 0) waitAll();
  if (missing.empty()) return;
  std::string who;
  const size_t shown = wait_all_ranks ? missing.size() : 1;
  for (size_t i = 0; i < shown; ++i) who += (i ? ", " : "") + std::to_string(missing[i]);
  TORCH_CHECK(false, prefix, "Rank", shown > 1 ? "s " : " ", who, " failed to pass monitoredBarrier in ", limit.count(),
              " ms");
}

c10::intrusive_ptr<c10d::Work> EpBackend::barrier(const c10d::BarrierOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  auto w = c10::make_intrusive<EpWork>(rank_, c10d::OpType::BARRIER, "ep:barrier", std::vector<at::Tensor>{});
  w->setGroupSize(size_);
  return submitToWorker(worker(), w, [](const collective::AlgoContext& c) { return collective::barrierOp(c); },
                        timeoutOf(opts.timeout));
}

c10::intrusive_ptr<c10d::Work> EpBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  checkSingle(tensors, "send");
  TORCH_CHECK_VALUE(dst >= 0 && dst < size_ && dst != rank_, "moelink send: invalid destination rank ", dst,
                    " (group of ", size_, ", this rank ", rank_, ")");
  return on(DevicePlacement("send").add(tensors)).send(tensors[0], dst, tag, Call{timeout()});
}

c10::intrusive_ptr<c10d::Work> EpBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  checkSingle(tensors, "recv");
  TORCH_CHECK_VALUE(src >= 0 && src < size_ && src != rank_, "moelink recv: invalid source rank ", src,
                    " (group of ", size_, ", this rank ", rank_, ")");
  return on(DevicePlacement("recv").add(tensors)).recv(tensors[0], src, tag, Call{timeout()});
}

c10::intrusive_ptr<c10d::Work> EpBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  checkSingle(tensors, "recv");
  return on(DevicePlacement("recv").add(tensors)).recv(tensors[0], -1, tag, Call{timeout()});
}

}  // namespace moelink::backend
