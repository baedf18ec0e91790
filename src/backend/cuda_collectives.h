// The CUDA side of EpBackend: the same c10d collectives on CUDA tensors, stream-ordered like
// NCCL's. EpBackend validates the device placement of every call and hands calls on CUDA
// tensors here; CPU tensors never reach this unit.
//
// Two executors, chosen once per group (the first CUDA op; every rank agrees):
// - in-host ("nvlink"): every rank on this host and every peer's staging area mapped through
//   CUDA IPC: each collective is one or two exchange kernels (collective/exchange.h) on the
//   group's communication stream; no CPU thread is on the critical path;
// - host-staged ("host"): ranks on several hosts (or MOELINK_RANKS_PER_HOST virtual hosts):
//   the stream copies the inputs into pinned host memory and raises a host-mapped word
//   (cuStreamWriteValue32); the collective worker runs the CPU op on those copies once it
//   sees the word, then raises another that the stream waits for (cuStreamWaitValue32)
//   before copying the results back. No SM waits, and the caller's thread never blocks.
// Point-to-point ops take the host-staged route in both cases (it matches tags and sources
// and lets sends and receives progress independently, as batch_isend_irecv needs).
//
// Streams: an op waits for the work queued so far on the caller's current stream, runs on
// the group's communication stream, and records an event there; Work::wait() makes the
// current stream wait for it (no host block), Work::getFuture() completes once the GPU has
// finished the op (a completion thread watches the events), and a failure reported by the
// GPU (a header mismatch, a timeout) is raised by wait() or the future once known.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace moelink::backend {

class EpBackend;

class CudaCollectives {
 public:
  virtual ~CudaCollectives() = default;
  // "nvlink" or "host" once the first CUDA op has chosen, else "".
  virtual std::string path() const = 0;

  using Work = c10::intrusive_ptr<c10d::Work>;
  using Tensors = std::vector<at::Tensor>;
  using TensorLists = std::vector<std::vector<at::Tensor>>;
  virtual Work broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) = 0;
  virtual Work allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) = 0;
  virtual Work allreduce_coalesced(Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) = 0;
  virtual Work reduce(Tensors& tensors, const c10d::ReduceOptions& opts) = 0;
  virtual Work allgather(TensorLists& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) = 0;
  virtual Work _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) = 0;
  virtual Work allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                               const c10d::AllgatherOptions& opts) = 0;
  virtual Work gather(TensorLists& outputs, Tensors& inputs, const c10d::GatherOptions& opts) = 0;
  virtual Work scatter(Tensors& outputs, TensorLists& inputs, const c10d::ScatterOptions& opts) = 0;
  virtual Work reduce_scatter(Tensors& outputs, TensorLists& inputs, const c10d::ReduceScatterOptions& opts) = 0;
  virtual Work _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                    const c10d::ReduceScatterOptions& opts) = 0;
  virtual Work reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                               const c10d::ReduceScatterOptions& opts) = 0;
  virtual Work alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& out_splits,
                             std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& opts) = 0;
  virtual Work alltoall(Tensors& outputs, Tensors& inputs, const c10d::AllToAllOptions& opts) = 0;
  virtual Work send(Tensors& tensors, int dst, int tag) = 0;
  virtual Work recv(Tensors& tensors, int src, int tag) = 0;
  virtual Work recvAnysource(Tensors& tensors, int tag) = 0;
};

// The CUDA unit of `backend`; raises where moelink was built without CUDA.
std::unique_ptr<CudaCollectives> makeCudaCollectives(EpBackend& backend);

}  // namespace moelink::backend
