// EpBackend: the c10d backend "ep".
//
// Every collective follows the same steps (as ProcessGroupGloo does): validate on the
// caller's thread (raising a Python exception for bad input), stage non-contiguous
// tensors into contiguous buffers, build the op for the collective worker, and return an
// EpWork that owns every tensor involved. The worker completes the work on its thread:
// it copies staged outputs back, then marks the Future (value: the output tensors) or
// stores the exception, which wait() rethrows.
//
// One backend = one group: its own TransferEngine (over the group's prefixed c10d store)
// and its own CollectiveWorker thread. shutdown() (also run by destroy_process_group and
// the destructor) stops both and releases sockets and shared memory.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace moelink::transfer {
class TransferEngine;
class MetadataStore;
}  // namespace moelink::transfer
namespace moelink::collective {
class CollectiveWorker;
struct OpSpec;
struct AlgoContext;
}  // namespace moelink::collective

namespace moelink::backend {

class Collectives;
class DevicePlacement;
struct Call;
struct GroupContext;

// Membership options (moelink.EpOptions): on a peer's failure, complete the op in flight
// over the survivors ("continue") or fail it everywhere ("raise"); `extension`: this
// process takes a failed rank's place and is readmitted by the group (recover_ranks).
struct EpBackendOptions {
  bool raise_on_peer_failure = false;
  bool extension = false;
  int initial_size = 0;  // ranks [0, initial_size) create the group, the rest join later (0: all)
};

class EpBackend : public c10d::Backend {
 public:
  using Options = EpBackendOptions;
  EpBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
            std::chrono::milliseconds timeout, Options options = {});
  ~EpBackend() override;

  const std::string getBackendName() const override { return "ep"; }
  // Collectives issued on this group by this rank (every rank issues the same ones): c10d's
  // sequence number, which TORCH_DISTRIBUTED_DEBUG=DETAIL checks across ranks before each op.
  uint64_t getSequenceNumberForGroup() override { return seq_collective_.load(std::memory_order_relaxed); }
  void setSequenceNumberForGroup() override {}  // numbers start at 0 on every rank

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  // Sparse COO tensors (SUM only, as gloo): what c10d calls for CUDA sparse tensors; CPU sparse
  // tensors reach allreduce() above, which hands them here too.
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override {
    return allreduceSparse(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  // outputs[r][j]: rank r's inputs[j].
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  // The root's output holds every rank's input in rank order. Declared without `override`:
  // torch >= 2.14 has this virtual (dist.gather_into_tensor), older releases do not.
  c10::intrusive_ptr<c10d::Work> gather_into_tensor(at::Tensor& output, at::Tensor& input,
                                                    const c10d::GatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // As gloo's: every rank checks in with rank 0, which waits for each up to the timeout and
  // raises naming the ranks that did not arrive (the first, or all with wait_all_ranks);
  // the others raise too, once rank 0 has told them (or its answer timed out). Blocking.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override;

  void shutdown() override;
  // Shuts down every backend of this process that is not destroyed yet, and unlinks every
  // shared-memory name of the process: run at interpreter exit (integration's atexit hook), so
  // that no worker thread is left to complete an op, and so touch Python, once the interpreter
  // is being torn down, and nothing of the process stays in /dev/shm.
  static void shutdownAll();

#if MOELINK_C10D_SHRINK
  // torch.distributed.shrink_group (ep_backend_shrink.cpp): the ranks that stay build a new
  // backend over themselves, renumbered in order, through this group's store (which must
  // still answer, as for new_group). Either shrink flag: ops still in flight here are failed
  // by the destruction of this group that shrink_group does next; they do not hold it up.
  bool supportsShrinking() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranks_to_exclude, int shrink_flags,
                                           const c10::intrusive_ptr<c10d::Backend::Options>& opts_override) override;
#endif
#if MOELINK_C10D_SET_TIMEOUT
  // torch.distributed.set_timeout: the default timeout of the ops issued after it, as gloo's and
  // NCCL's groups take it (ops already issued keep theirs; an op's own timeout still wins). It
  // must be positive.
  void setTimeout(std::chrono::milliseconds timeout) override;
#endif

  // The "ip:port" this rank's tcp transport listens on.
  std::string tcpAddress() const;
  // How this rank reaches `peer` for collectives ("shm", "tcp", "local").
  std::string transportOf(int peer) const;
  // Whether `peer` reads this rank's large collective payloads straight from this process's
  // memory (one copy; same host, where the kernel allows cross-memory reads).
  bool readsDirectly(int peer) const;
  std::vector<int64_t> activeRanks() const;
  // Per rank: 1 = active (the group's mask), as int32.
  std::vector<int32_t> activeMask() const;
  // Keeps `mirror` (a CPU int32 tensor of at least size() entries) equal to the group's mask
  // (entries past size() zero), written now and by the worker at every membership change.
  void mirrorMask(const at::Tensor& mirror);
  // Per rank in `ranks`: active, or a replacement process waits to be readmitted and is alive.
  std::vector<int32_t> peerState(const std::vector<int64_t>& ranks);
  // Ranks active or with a process waiting to be readmitted, as this rank sees them.
  int64_t numSyncedRanks();
  // Readmits `ranks` (collective over the active ranks; blocks until done).
  void recoverRanks(const std::vector<int64_t>& ranks);
  uint64_t epoch() const;
  // The ranks that left while `work` ran; nullopt for a work of another backend.
  static std::optional<std::vector<int64_t>> lostRanksOf(const c10::intrusive_ptr<c10d::Work>& work);
  // The default timeout of ops issued from now on (the group's, or set_timeout's since).
  std::chrono::milliseconds timeout() const { return timeout_.load(std::memory_order_relaxed); }
  // The group's store (the EP buffer exchanges its CUDA IPC handles through it).
  c10::intrusive_ptr<c10d::Store> store() const { return c10d_store_; }
  // The host id of `peer` (ranks with equal ids share a host; transfer::localHostId()).
  std::string hostIdOf(int peer) const;
  // How CUDA tensors travel in this group: "nvlink" (in-host kernels), "host" (staged
  // through host memory and the collective worker), or "" before the first CUDA op.
  std::string cudaPath() const;
  // The group's collective worker (the CUDA unit's host-staged route submits to it).
  collective::CollectiveWorker& worker() const;

 private:
  // The unit of a call's device (collectives.h), made at the group's first op on that device
  // (the CPU one with the group).
  Collectives& on(const DevicePlacement& placement);
  GroupContext groupContext() const;
  std::chrono::milliseconds timeoutOf(std::chrono::milliseconds requested) const;
  // ep_backend_sparse.cpp
  c10::intrusive_ptr<c10d::Work> allreduceSparse(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts);
  // What a unit needs of a call's c10d options (its timeout, whether it is asynchronous).
  template <typename CallOptions>
  Call callOf(const CallOptions& opts) const;

  std::atomic<std::chrono::milliseconds> timeout_;
  std::atomic<uint64_t> seq_collective_{0};
  std::atomic<uint64_t> shrinks_{0};  // groups shrunk from this one (names their stores)
  Options options_;
  c10::intrusive_ptr<c10d::Store> c10d_store_;
  std::shared_ptr<transfer::MetadataStore> store_;
  std::unique_ptr<transfer::TransferEngine> engine_;
  std::unique_ptr<collective::CollectiveWorker> worker_;
  std::mutex shutdown_mu_;  // shutdown() may come from c10d, the destructor and shutdownAll at once
  mutable std::mutex units_mu_;
  std::map<c10::DeviceType, std::unique_ptr<Collectives>> units_;
};

}  // namespace moelink::backend
