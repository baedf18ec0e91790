// The collectives of EpBackend: validate, stage, build the op, enqueue.
#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <numeric>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include "cuda_collectives.h"
#include "ep_work.h"
#include "moelink/backend/ep_backend.h"
#include "moelink/collective/algorithms.h"
#include "moelink/collective/worker.h"

namespace moelink::backend {

using c10d::OpType;
using collective::DType;
namespace algo = collective;

namespace {

c10::intrusive_ptr<EpWork> makeWork(int rank, OpType type, const char* title,
                                    std::vector<at::Tensor> outputs) {
  return c10::make_intrusive<EpWork>(rank, type, title, std::move(outputs));
}

// Flat contiguous buffer of the given tensors' values, in order.
at::Tensor concat(EpWork& w, const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> flat;
  flat.reserve(ts.size());
  for (const auto& t : ts) flat.push_back(t.reshape({-1}));
  at::Tensor buf = ts.empty() ? at::empty({0}) : at::cat(flat);
  w.keep(buf);
  return buf;
}

// Copies consecutive slices of `flat` into `outs` on success.
void scatterBack(EpWork& w, const at::Tensor& flat, const std::vector<at::Tensor>& outs) {
  w.keep(flat);
  w.onSuccess([flat, outs]() mutable {
    int64_t off = 0;
    for (auto& o : outs) {
      o.copy_(flat.narrow(0, off, o.numel()).view(o.sizes()));
      off += o.numel();
    }
  });
}

char* ptr(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

}  // namespace

c10::intrusive_ptr<c10d::Work> EpBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                    const c10d::BroadcastOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  checkSingle(tensors, "broadcast");
  checkRoot(opts.rootRank, size_, "broadcast");
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "moelink broadcast: rootTensor must be 0");
  if (DevicePlacement("broadcast").add(tensors).cuda()) return cuda().broadcast(tensors[0], static_cast<int>(opts.rootRank), callOf(opts));
  auto w = makeWork(rank_, OpType::BROADCAST, "ep:broadcast", tensors);
  at::Tensor buf = inplaceBuffer(*w, tensors[0]);
  return enqueue(w, [=](const algo::AlgoContext& c) {
    auto spec = algo::broadcastOp(c, ptr(buf), nbytes(buf), static_cast<int>(opts.rootRank));
    spec.dtype = toDType(buf.scalar_type());
    return spec;
  }, timeoutOf(opts.timeout));
}

c10::intrusive_ptr<c10d::Work> EpBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                    const c10d::AllreduceOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) return allreduceSparse(tensors, opts);
  checkSingle(tensors, "allreduce");
  auto op = toReduceOp(opts.reduceOp, tensors[0].scalar_type(), "allreduce");
  const bool on_cuda = DevicePlacement("allreduce").add(tensors).cuda();
  preMultiplyInPlace(opts.reduceOp, tensors[0]);  // PREMUL_SUM: the tensor is the output too
  if (on_cuda) return cuda().allreduce(tensors, op, callOf(opts));
  auto w = makeWork(rank_, OpType::ALLREDUCE, "ep:all_reduce", tensors);
  at::Tensor buf = inplaceBuffer(*w, tensors[0]);
  return enqueue(w, [=](const algo::AlgoContext& c) {
    auto spec = algo::allreduceOp(c, ptr(buf), buf.numel(), toDType(buf.scalar_type()), op);
    return spec;
  }, timeoutOf(opts.timeout));
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
  const bool on_cuda = DevicePlacement("allreduce_coalesced").add(tensors).cuda();
  for (auto& t : tensors) preMultiplyInPlace(opts.reduceOp, t);
  if (on_cuda) return cuda().allreduce(tensors, op, callOf(opts));
  auto w = makeWork(rank_, OpType::ALLREDUCE_COALESCED, "ep:all_reduce_coalesced", tensors);
  at::Tensor flat = concat(*w, tensors);
  scatterBack(*w, flat, tensors);
  return enqueue(w, [=](const algo::AlgoContext& c) {
    auto spec = algo::allreduceOp(c, ptr(flat), flat.numel(), toDType(flat.scalar_type()), op);
    return spec;
  }, timeoutOf(opts.timeout));
}

c10::intrusive_ptr<c10d::Work> EpBackend::reduce(std::vector<at::Tensor>& tensors,
                                                 const c10d::ReduceOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  checkSingle(tensors, "reduce");
  checkRoot(opts.rootRank, size_, "reduce");
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "moelink reduce: rootTensor must be 0");
  auto op = toReduceOp(opts.reduceOp, tensors[0].scalar_type(), "reduce");
  const bool on_cuda = DevicePlacement("reduce").add(tensors).cuda();
  // PREMUL_SUM: the root's tensor receives the result; the others' stay as they were.
  std::vector<at::Tensor> in = tensors;
  if (rank_ == opts.rootRank)
    preMultiplyInPlace(opts.reduceOp, in[0]);
  else
    in[0] = preMultiplied(opts.reduceOp, tensors[0]);
  if (on_cuda) return cuda().reduce(in[0], op, static_cast<int>(opts.rootRank), callOf(opts));
  auto w = makeWork(rank_, OpType::REDUCE, "ep:reduce", in);
  at::Tensor buf = inplaceBuffer(*w, in[0]);
  return enqueue(w, [=](const algo::AlgoContext& c) {
    auto spec = algo::reduceOp(c, ptr(buf), ptr(buf), buf.numel(), toDType(buf.scalar_type()),
                             op, static_cast<int>(opts.rootRank));
    return spec;
  }, timeoutOf(opts.timeout));
}

c10::intrusive_ptr<c10d::Work> EpBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::AllgatherOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  checkSingle(inputs, "allgather");
  TORCH_CHECK_VALUE(outputs.size() == 1, "moelink allgather: expects one output list per process");
  checkList(outputs[0], inputs[0], size_, "allgather", "the output list");
  if (DevicePlacement("allgather").add(outputs).add(inputs).cuda()) return cuda().allgather(outputs[0], inputs[0], callOf(opts));
  auto w = makeWork(rank_, OpType::ALLGATHER, "ep:all_gather", outputs[0]);
  at::Tensor in = inputBuffer(*w, inputs[0]);
  at::Tensor flat = at::empty({in.numel() * size_}, in.options());
  scatterBack(*w, flat, outputs[0]);
  return enqueue(w, [=](const algo::AlgoContext& c) {
    auto spec = algo::allgatherOp(c, ptr(in), ptr(flat), nbytes(in));
    spec.dtype = toDType(in.scalar_type());
    return spec;
  }, timeoutOf(opts.timeout));
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
  if (DevicePlacement("all_gather_into_tensor").add(output).add(input).cuda()) return cuda().allgather(output, input, callOf(opts));
  auto w = makeWork(rank_, OpType::_ALLGATHER_BASE, "ep:_all_gather_base", {output});
  at::Tensor in = inputBuffer(*w, input);
  at::Tensor out = outputBuffer(*w, output);
  return enqueue(w, [=](const algo::AlgoContext& c) {
    auto spec = algo::allgatherOp(c, ptr(in), ptr(out), nbytes(in));
    spec.dtype = toDType(in.scalar_type());
    return spec;
  }, timeoutOf(opts.timeout));
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
  if (DevicePlacement("allgather_into_tensor_coalesced").add(outputs).add(inputs).cuda()) return cuda().allgatherCoalesced(outputs, inputs, callOf(opts));
  auto w = makeWork(rank_, OpType::COALESCED, "ep:allgather_into_tensor_coalesced", outputs);
  at::Tensor in = concat(*w, inputs);
  at::Tensor flat = at::empty({in.numel() * size_}, in.options());
  w->keep(flat);
  // flat is [rank][input 0 | input 1 | ...]; output i gathers every rank's input i.
  w->onSuccess([flat, outputs, inputs, size = size_]() mutable {
    int64_t per_rank = flat.numel() / size, off = 0;
    for (size_t i = 0; i < outputs.size(); ++i) {
      int64_t n = inputs[i].numel();
      at::Tensor src = flat.view({size, per_rank}).narrow(1, off, n);
      outputs[i].copy_(src.reshape(outputs[i].sizes()));
      off += n;
    }
  });
  return enqueue(w, [=](const algo::AlgoContext& c) {
    auto spec = algo::allgatherOp(c, ptr(in), ptr(flat), nbytes(in));
    spec.dtype = toDType(in.scalar_type());
    return spec;
  }, timeoutOf(opts.timeout));
}

c10::intrusive_ptr<c10d::Work> EpBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllgatherOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const char* name = "all_gather_coalesced";
  TORCH_CHECK_VALUE(!inputs.empty(), "moelink ", name, ": no input tensors");
  TORCH_CHECK_VALUE(static_cast<int>(outputs.size()) == size_, "moelink ", name,
                    ": needs one output list per rank (", size_, "), got ", outputs.size());
  std::vector<at::Tensor> all_out;
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
      all_out.push_back(outputs[r][j]);
    }
  }
  // outputs[r][j] <- flat[r][input j]: one all-gather of the concatenated inputs.
  auto place = [outputs, inputs, size = size_](const at::Tensor& flat) mutable {
    const int64_t per_rank = flat.numel() / size;
    for (int r = 0; r < size; ++r) {
      int64_t off = 0;
      for (size_t j = 0; j < inputs.size(); ++j) {
        const int64_t n = inputs[j].numel();
        outputs[r][j].copy_(flat.narrow(0, r * per_rank + off, n).view(outputs[r][j].sizes()));
        off += n;
      }
    }
  };
  if (DevicePlacement(name).add(outputs).add(inputs).cuda()) {
    int64_t total = 0;
    for (const auto& t : inputs) total += t.numel();
    std::vector<at::Tensor> flat_in{at::cat([&] {
      std::vector<at::Tensor> v;
      for (const auto& t : inputs) v.push_back(t.reshape({-1}));
      return v;
    }())};
    at::Tensor flat = at::empty({total * size_}, inputs[0].options());
    auto work = cuda().allgather(flat, flat_in[0], callOf(opts));
    work->wait();  // the current stream waits for the op; the copies below follow it
    place(flat);
    return work;
  }
  auto w = makeWork(rank_, OpType::ALLGATHER_COALESCED, "ep:all_gather_coalesced", all_out);
  at::Tensor in = concat(*w, inputs);
  at::Tensor flat = at::empty({in.numel() * size_}, in.options());
  w->keep(flat);
  w->onSuccess([flat, place]() mutable { place(flat); });
  return enqueue(w, [=](const algo::AlgoContext& c) {
    auto spec = algo::allgatherOp(c, ptr(in), ptr(flat), nbytes(in));
    spec.dtype = toDType(in.scalar_type());
    return spec;
  }, timeoutOf(opts.timeout));
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
  if (DevicePlacement("gather").add(outputs).add(inputs).cuda()) return cuda().gather(outs, inputs[0], root, callOf(opts));
  auto w = makeWork(rank_, OpType::GATHER, "ep:gather", outs);
  at::Tensor in = inputBuffer(*w, inputs[0]);
  at::Tensor flat;
  if (rank_ == root) {
    flat = at::empty({in.numel() * size_}, in.options());
    scatterBack(*w, flat, outs);
  }
  return enqueue(w, [=](const algo::AlgoContext& c) {
    auto spec = algo::gatherOp(c, ptr(in), flat.defined() ? ptr(flat) : nullptr, nbytes(in), root);
    spec.dtype = toDType(in.scalar_type());
    return spec;
  }, timeoutOf(opts.timeout));
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
  if (DevicePlacement("scatter").add(outputs).add(inputs).cuda())
    return cuda().scatter(outputs[0], rank_ == root ? inputs[0] : std::vector<at::Tensor>{}, root,
                          callOf(opts));
  auto w = makeWork(rank_, OpType::SCATTER, "ep:scatter", outputs);
  at::Tensor in;
  if (rank_ == root) in = concat(*w, inputs[0]);
  at::Tensor out = outputBuffer(*w, outputs[0]);
  return enqueue(w, [=](const algo::AlgoContext& c) {
    auto spec = algo::scatterOp(c, in.defined() ? ptr(in) : nullptr, ptr(out), nbytes(out), root);
    spec.dtype = toDType(out.scalar_type());
    return spec;
  }, timeoutOf(opts.timeout));
}

c10::intrusive_ptr<c10d::Work> EpBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                         std::vector<std::vector<at::Tensor>>& inputs,
                                                         const c10d::ReduceScatterOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  checkSingle(outputs, "reduce_scatter");
  TORCH_CHECK_VALUE(inputs.size() == 1, "moelink reduce_scatter: expects one input list per process");
  checkList(inputs[0], outputs[0], size_, "reduce_scatter", "the input list");
  auto op = toReduceOp(opts.reduceOp, outputs[0].scalar_type(), "reduce_scatter");
  const bool on_cuda = DevicePlacement("reduce_scatter").add(outputs).add(inputs).cuda();
  std::vector<at::Tensor> ins;
  for (const auto& t : inputs[0]) ins.push_back(preMultiplied(opts.reduceOp, t));  // PREMUL_SUM
  if (on_cuda) return cuda().reduceScatter(outputs[0], ins, op, callOf(opts));
  auto w = makeWork(rank_, OpType::REDUCE_SCATTER, "ep:reduce_scatter", outputs);
  at::Tensor in = concat(*w, ins);
  at::Tensor out = outputBuffer(*w, outputs[0]);
  return enqueue(w, [=](const algo::AlgoContext& c) {
    auto spec = algo::reduceScatterOp(c, ptr(in), ptr(out), out.numel(),
                                    toDType(out.scalar_type()), op);
    return spec;
  }, timeoutOf(opts.timeout));
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
  const bool on_cuda = DevicePlacement("reduce_scatter_tensor").add(output).add(input).cuda();
  at::Tensor scaled = preMultiplied(opts.reduceOp, input);  // PREMUL_SUM
  if (on_cuda) return cuda().reduceScatter(output, scaled, op, callOf(opts));
  auto w = makeWork(rank_, OpType::_REDUCE_SCATTER_BASE, "ep:_reduce_scatter_base", {output});
  at::Tensor in = inputBuffer(*w, scaled);
  at::Tensor out = outputBuffer(*w, output);
  return enqueue(w, [=](const algo::AlgoContext& c) {
    auto spec = algo::reduceScatterOp(c, ptr(in), ptr(out), out.numel(),
                                    toDType(out.scalar_type()), op);
    return spec;
  }, timeoutOf(opts.timeout));
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
  const bool on_cuda = DevicePlacement("reduce_scatter_tensor_coalesced").add(outputs).add(inputs).cuda();
  std::vector<at::Tensor> scaled;
  for (const auto& t : inputs) scaled.push_back(preMultiplied(opts.reduceOp, t));  // PREMUL_SUM
  if (on_cuda) return cuda().reduceScatterCoalesced(outputs, scaled, op, callOf(opts));
  auto w = makeWork(rank_, OpType::COALESCED, "ep:reduce_scatter_tensor_coalesced", outputs);
  // Block layout [rank][output 0 | output 1 | ...] built from each input's rank slices.
  std::vector<at::Tensor> pieces;
  for (int r = 0; r < size_; ++r)
    for (size_t i = 0; i < inputs.size(); ++i) {
      int64_t n = outputs[i].numel();
      pieces.push_back(scaled[i].reshape({-1}).narrow(0, r * n, n));
    }
  at::Tensor in = at::cat(pieces);
  w->keep(in);
  int64_t total = in.numel() / size_;
  at::Tensor out = at::empty({total}, in.options());
  scatterBack(*w, out, outputs);
  return enqueue(w, [=](const algo::AlgoContext& c) {
    auto spec = algo::reduceScatterOp(c, ptr(in), ptr(out), total, toDType(in.scalar_type()), op);
    return spec;
  }, timeoutOf(opts.timeout));
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
  if (DevicePlacement("all_to_all_single").add(output).add(src).cuda())
    return cuda().alltoall(output, src, l, callOf(opts));
  auto w = makeWork(rank_, OpType::ALLTOALL_BASE, "ep:all_to_all", {output});
  at::Tensor in = inputBuffer(*w, src);
  at::Tensor out = outputBuffer(*w, output);
  return enqueue(w, [=](const algo::AlgoContext& c) {
    auto spec = algo::alltoallOp(c, ptr(in), l.send_off, l.send_bytes, ptr(out), l.recv_off,
                               l.recv_bytes);
    spec.dtype = toDType(in.scalar_type());
    return spec;
  }, timeoutOf(opts.timeout));
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
  if (DevicePlacement("all_to_all").add(outputs).add(inputs).cuda())
    return cuda().alltoall(outputs, inputs, l, callOf(opts));
  auto w = makeWork(rank_, OpType::ALLTOALL, "ep:all_to_all", outputs);
  at::Tensor in = concat(*w, inputs);
  const uint64_t ro = l.recv_off.back() + l.recv_bytes.back();
  at::Tensor flat = at::empty({static_cast<int64_t>(ro / inputs[0].element_size())}, inputs[0].options());
  scatterBack(*w, flat, outputs);
  return enqueue(w, [=](const algo::AlgoContext& c) {
    auto spec = algo::alltoallOp(c, ptr(in), l.send_off, l.send_bytes, ptr(flat), l.recv_off,
                               l.recv_bytes);
    spec.dtype = toDType(in.scalar_type());
    return spec;
  }, timeoutOf(opts.timeout));
}

void EpBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  // A tag of its own, far from what applications use.
  constexpr int kTag = -0x6d6c6d62;
  // An explicit zero is a zero budget here, as in gloo (timeoutOf reads it as "unset").
  const std::chrono::milliseconds limit =
      opts.timeout == c10d::kUnsetTimeout ? timeout_ : std::max(opts.timeout, std::chrono::milliseconds(0));
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
  auto w = makeWork(rank_, OpType::BARRIER, "ep:barrier", {});
  return enqueue(w, [](const algo::AlgoContext& c) { return algo::barrierOp(c); }, timeoutOf(opts.timeout));
}

c10::intrusive_ptr<c10d::Work> EpBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  checkSingle(tensors, "send");
  TORCH_CHECK_VALUE(dst >= 0 && dst < size_ && dst != rank_, "moelink send: invalid destination rank ", dst,
                    " (group of ", size_, ", this rank ", rank_, ")");
  if (DevicePlacement("send").add(tensors).cuda()) return cuda().send(tensors[0], dst, tag, CudaCall{timeout_});
  auto w = makeWork(rank_, OpType::SEND, "ep:send", tensors);
  at::Tensor in = inputBuffer(*w, tensors[0]);
  worker().send(dst, ptr(in), nbytes(in), tag, [w](const std::string& err) { w->complete(err); }, timeout_);
  return w;
}

c10::intrusive_ptr<c10d::Work> EpBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  checkSingle(tensors, "recv");
  TORCH_CHECK_VALUE(src >= 0 && src < size_ && src != rank_, "moelink recv: invalid source rank ", src,
                    " (group of ", size_, ", this rank ", rank_, ")");
  if (DevicePlacement("recv").add(tensors).cuda()) return cuda().recv(tensors[0], src, tag, CudaCall{timeout_});
  auto w = makeWork(rank_, OpType::RECV, "ep:recv", tensors);
  at::Tensor out = outputBuffer(*w, tensors[0]);
  worker().recv(src, ptr(out), nbytes(out), tag,
                [w](const std::string& err, int from) { w->complete(err, from); }, timeout_);
  return w;
}

c10::intrusive_ptr<c10d::Work> EpBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  checkSingle(tensors, "recv");
  if (DevicePlacement("recv").add(tensors).cuda()) return cuda().recv(tensors[0], -1, tag, CudaCall{timeout_});
  auto w = makeWork(rank_, OpType::RECVANYSOURCE, "ep:recvAnySource", tensors);
  at::Tensor out = outputBuffer(*w, tensors[0]);
  worker().recv(-1, ptr(out), nbytes(out), tag,
                [w](const std::string& err, int from) { w->complete(err, from); }, timeout_);
  return w;
}

}  // namespace moelink::backend
