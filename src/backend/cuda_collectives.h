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
// Both routes share the GPU-side preparation (flattening lists, contiguous copies); the
// host-staged route then hands the worker one flat op over pinned copies, so the CPU never
// reads a copy before the GPU has written it. Point-to-point ops take the host-staged route
// in both cases (it matches tags and sources and lets sends and receives progress
// independently, as batch_isend_irecv needs).
//
// Streams, as NCCL's backend in PyTorch does them: an asynchronous op (`async_op=True`, and
// every point-to-point op) waits for the work queued so far on the caller's current stream,
// runs on the group's communication stream and records an event there; Work::wait() makes the
// current stream wait for it (no host block). A synchronous op (`async_op=False`, which the
// caller follows with wait() at once) runs on the caller's current stream itself, which spares
// the two cross-stream hand-offs. Whatever their streams, a group's ops run on the GPU in the
// order they were issued: an op on another stream than the group's previous op waits for that
// op's end event. Work::getFuture() completes once the GPU has finished the op (a completion
// thread watches the events), and a failure reported by the GPU (a header mismatch, a timeout)
// is raised by wait() or the future once known.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "ep_work.h"
#include "moelink/backend/ep_backend.h"

namespace moelink::backend {


// Called by EpBackend after it has validated a call (shapes, roots, reduce op, split sizes)
// and found its tensors on CUDA: the arguments are the validated ones.
class CudaCollectives {
 public:
  virtual ~CudaCollectives() = default;
  // "nvlink" or "host" once the first CUDA op has chosen, else "".
  virtual std::string path() const = 0;

  using Work = c10::intrusive_ptr<c10d::Work>;
  using Tensors = std::vector<at::Tensor>;
  using Timeout = std::chrono::milliseconds;
  using ReduceOp = collective::ReduceOp;
  using Call = CudaCall;
  virtual Work broadcast(at::Tensor& t, int root, const Call& call) = 0;
  // One tensor, or several reduced as one (allreduce_coalesced).
  virtual Work allreduce(Tensors& ts, ReduceOp op, const Call& call) = 0;
  virtual Work reduce(at::Tensor& t, ReduceOp op, int root, const Call& call) = 0;
  // Into one tensor (all_gather_into_tensor) or a list (all_gather).
  virtual Work allgather(at::Tensor& output, at::Tensor& input, const Call& call) = 0;
  virtual Work allgather(Tensors& outputs, at::Tensor& input, const Call& call) = 0;
  virtual Work allgatherCoalesced(Tensors& outputs, Tensors& inputs, const Call& call) = 0;
  // outputs: the root's list (empty elsewhere).
  virtual Work gather(Tensors& outputs, at::Tensor& input, int root, const Call& call) = 0;
  // inputs: the root's list (empty elsewhere).
  virtual Work scatter(at::Tensor& output, const Tensors& inputs, int root, const Call& call) = 0;
  virtual Work reduceScatter(at::Tensor& output, at::Tensor& input, ReduceOp op, const Call& call) = 0;
  virtual Work reduceScatter(at::Tensor& output, Tensors& inputs, ReduceOp op, const Call& call) = 0;
  virtual Work reduceScatterCoalesced(Tensors& outputs, Tensors& inputs, ReduceOp op, const Call& call) = 0;
  virtual Work alltoall(at::Tensor& output, at::Tensor& input, const PairLayout& layout, const Call& call) = 0;
  virtual Work alltoall(Tensors& outputs, Tensors& inputs, const PairLayout& layout, const Call& call) = 0;
  virtual Work send(at::Tensor& t, int dst, int tag, const Call& call) = 0;
  // src < 0: any source.
  virtual Work recv(at::Tensor& t, int src, int tag, const Call& call) = 0;
};

// The CUDA unit of `backend`; raises where moelink was built without CUDA.
std::unique_ptr<CudaCollectives> makeCudaCollectives(EpBackend& backend);

}  // namespace moelink::backend
