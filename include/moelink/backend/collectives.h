// Collectives: the unit that runs c10d calls on one device's tensors.
//
// EpBackend validates every call on the caller's thread (sizes, dtypes, roots, reduce ops,
// split sizes; PREMUL_SUM factors applied) and hands the checked arguments to the unit of the
// device the call's tensors are on. The CPU unit is the backend's own (cpu_collectives.cpp);
// units of other devices register a factory per device type, as c10d's backends register
// their work per device (the CUDA unit from its folder, src/cuda/, whose static registration
// links in with it): the backend never names them, and a build without CUDA simply has no unit
// for it. A group makes its unit of a device once, at its first op on that device.
//
// A unit's Work owns what it needs until the op has finished; errors the unit finds in its
// arguments (a tensor on another GPU than the group's) raise on the caller's thread.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "moelink/backend/tensor_checks.h"
#include "moelink/collective/dtype.h"

namespace moelink::collective {
class CollectiveWorker;
}

namespace moelink::backend {

// How the caller issued an op: its timeout, and whether it is asynchronous (c10d's
// Options::asyncOp; false: the caller waits for the work at once).
struct Call {
  std::chrono::milliseconds timeout;
  bool async = true;
};

// What a unit needs of its group; EpBackend fills it and outlives its units.
struct GroupContext {
  int rank = 0;
  int size = 1;
  c10::intrusive_ptr<c10d::Store> store;           // the group's store
  collective::CollectiveWorker* worker = nullptr;  // the group's worker (shut down before the units)
  std::function<std::string(int)> host_of;         // a rank's host id (equal ids: one host)
};

class Collectives {
 public:
  using Work = c10::intrusive_ptr<c10d::Work>;
  using Tensors = std::vector<at::Tensor>;
  using ReduceOp = collective::ReduceOp;

  virtual ~Collectives() = default;
  // How the unit moves its data ("nvlink" or "host" for CUDA once chosen; "" otherwise).
  virtual std::string path() const { return ""; }

  virtual Work broadcast(at::Tensor& t, int root, const Call& call) = 0;
  // One tensor, or several reduced as one (allreduce_coalesced).
  virtual Work allreduce(Tensors& ts, ReduceOp op, const Call& call) = 0;
  virtual Work reduce(at::Tensor& t, ReduceOp op, int root, const Call& call) = 0;
  // Into one tensor (all_gather_into_tensor) or a list (all_gather).
  virtual Work allgather(at::Tensor& output, at::Tensor& input, const Call& call) = 0;
  virtual Work allgather(Tensors& outputs, at::Tensor& input, const Call& call) = 0;
  // outputs[i] gathers every rank's inputs[i] (allgather_into_tensor_coalesced).
  virtual Work allgatherCoalesced(Tensors& outputs, Tensors& inputs, const Call& call) = 0;
  // outputs[r][j]: rank r's inputs[j] (all_gather_coalesced).
  virtual Work allgatherLists(std::vector<Tensors>& outputs, Tensors& inputs, const Call& call) = 0;
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

// The CPU unit: each op stages its tensors into contiguous host buffers and runs on the
// group's collective worker.
std::unique_ptr<Collectives> makeCpuCollectives(const GroupContext& group);

using CollectivesFactory = std::function<std::unique_ptr<Collectives>(const GroupContext&)>;
// Registers the unit of a device type (from a static initializer); returns true.
bool registerCollectives(c10::DeviceType type, CollectivesFactory make);
// The unit of `type` for `group`; raises a ValueError when this build has none for it.
std::unique_ptr<Collectives> makeCollectives(c10::DeviceType type, const GroupContext& group);

}  // namespace moelink::backend
