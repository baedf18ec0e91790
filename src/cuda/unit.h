// The CUDA unit's class (collectives.h), shared by its two files: collectives.cpp (binding the
// group's device and staging areas, how an op runs: streams, the exchange kernel, the
// host-staged route) and ops.cpp (each collective and point-to-point op in those terms).
#pragma once

#include "moelink/backend/collectives.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdlib>
#include <optional>

#include <glog/logging.h>

#include "moelink/collective/algorithms.h"
#include "moelink/collective/worker.h"
#include "moelink/common/error.h"
#include "moelink/common/settings.h"
#include "moelink/cuda/exchange_kernel.h"
#include "moelink/cuda/two_level.h"
#include "moelink/transfer/records.h"
#include "host_pipeline.h"
#include "staging.h"
#include "work.h"

namespace moelink::cuda {

using backend::Call;
using backend::Collectives;
using backend::GroupContext;
using backend::blocksByRank;
using backend::copyGatheredLists;
using backend::nbytes;
using backend::PairLayout;
using backend::toDType;
using c10d::OpType;
using Work = Collectives::Work;
using Tensors = Collectives::Tensors;
using Timeout = std::chrono::milliseconds;
namespace algo = collective;

constexpr size_t kSlots = 1024;  // ops in flight per group (status and ticket rings)

inline char* ptr(const at::Tensor& t) { return t.defined() ? static_cast<char*>(t.data_ptr()) : nullptr; }

// Whether the bytes of `a` and `b` overlap (an op called in place).
inline bool overlapping(const at::Tensor& a, const at::Tensor& b) {
  const char *a0 = ptr(a), *b0 = ptr(b);
  return a0 && b0 && a0 < b0 + nbytes(b) && b0 < a0 + nbytes(a);
}

inline at::Tensor pinnedLike(const at::Tensor& t) {
  return at::empty(t.sizes(), at::TensorOptions().dtype(t.dtype()).pinned_memory(true));
}

// `t` itself when contiguous, else a contiguous buffer for an output (copy back with settle()).
inline at::Tensor contiguousOut(const at::Tensor& t) {
  return t.is_contiguous() ? t : at::empty_like(t, at::MemoryFormat::Contiguous);
}

// Copies `buf` into `t` when they differ (an output that was not contiguous).
inline void settle(at::Tensor& t, const at::Tensor& buf) {
  if (!buf.is_same(t)) t.copy_(buf);
}

// Flat, contiguous concatenation of `ts`.
inline at::Tensor flatten(const Tensors& ts) {
  std::vector<at::Tensor> flat;
  for (const auto& t : ts) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

// Copies consecutive slices of `flat` into `outs`.
inline void unflatten(const at::Tensor& flat, Tensors& outs) {
  int64_t off = 0;
  for (auto& o : outs) {
    o.copy_(flat.narrow(0, off, o.numel()).view(o.sizes()));
    off += o.numel();
  }
}

inline Tensors joined(const Tensors& a, const Tensors& b) {
  Tensors all = a;
  all.insert(all.end(), b.begin(), b.end());
  return all;
}

class CudaCollectives final : public Collectives {
 public:
  explicit CudaCollectives(const GroupContext& g) : g_(g), rank_(g.rank), size_(g.size) {}
  ~CudaCollectives() override;

  std::string path() const override {
    std::lock_guard<std::mutex> g(mu_);
    return device_ < 0 ? "" : inHost() ? "nvlink" : twoLevel() ? "host+nvlink" : "host";
  }

  Work broadcast(at::Tensor& t, int root, const Call& call) override;
  Work allreduce(Tensors& ts, ReduceOp op, const Call& call) override;
  Work reduce(at::Tensor& t, ReduceOp op, int root, const Call& call) override;
  Work allgather(at::Tensor& output, at::Tensor& input, const Call& call) override;
  Work allgather(Tensors& outputs, at::Tensor& input, const Call& call) override;
  Work allgatherCoalesced(Tensors& outputs, Tensors& inputs, const Call& call) override;
  Work allgatherLists(std::vector<Tensors>& outputs, Tensors& inputs, const Call& call) override;
  Work gather(Tensors& outputs, at::Tensor& input, int root, const Call& call) override;
  Work scatter(at::Tensor& output, const Tensors& inputs, int root, const Call& call) override;
  Work reduceScatter(at::Tensor& output, at::Tensor& input, ReduceOp op, const Call& call) override;
  Work reduceScatter(at::Tensor& output, Tensors& inputs, ReduceOp op, const Call& call) override;
  Work reduceScatterCoalesced(Tensors& outputs, Tensors& inputs, ReduceOp op, const Call& call) override;
  Work alltoall(at::Tensor& output, at::Tensor& input, const PairLayout& layout, const Call& call) override;
  Work alltoall(Tensors& outputs, Tensors& inputs, const PairLayout& layout, const Call& call) override;
  Work send(at::Tensor& t, int dst, int tag, const Call& call) override;
  Work recv(at::Tensor& t, int src, int tag, const Call& call) override;

 private:
  // An op on its stream (current while the op's body runs).
  struct Op {
    c10::intrusive_ptr<CudaWork> work;
    std::optional<c10::cuda::CUDAStream> stream;
    bool captured = false;
    size_t slot = 0;
    Timeout timeout{0};
  };
  struct Kind {
    const char* name;  // for messages
    OpType type;
    const char* title;  // the Work's profiling title
    bool pipe = false;  // between hosts, it may run in pieces (HostPipeline), and so be captured
  };
  enum class Route { kGroup, kHost, kHostRecv };  // the group's route; host-staged (p2p)
  // Binds the unit (first op), puts a new op on its stream, runs `body` there, records the
  // op's end and hands its work to the completer. `used`: the caller's CUDA tensors. The
  // stream: the caller's current one for a synchronous group op, else the communication
  // stream (the receive stream for kHostRecv), ordered after the caller's current stream.
  template <typename Body>
  Work run(const Kind& k, Tensors outputs, const Tensors& used, Route route, const Call& call, Body&& body);
  void bind(int device, const char* opname);
  // In-host kernels: while the group's membership is the one the staging areas were set up
  // for (the areas of a rank that left, or of its replacement, are not consistent any more).
  bool inHost() const { return staging_ != nullptr && !changed_.load(std::memory_order_acquire); }
  // After a membership change, the group's next op on every rank sets up new staging areas
  // over the active ranks (restage), so the survivors, and later the group with its
  // readmitted ranks, run on the in-host kernels again. Returns the op's number (`seq`, or
  // the agreed one for a rank that has none yet).
  uint64_t restage(const char* opname, bool capturing, uint64_t seq);
  // One flat collective over contiguous CUDA buffers (`in` or `out` undefined where this rank
  // has none), by the group's route: the exchange `x`, or the worker op `host(ctx, in, out)`
  // built over pinned copies.
  using HostSpec = std::function<collective::OpSpec(const algo::AlgoContext&, char* in, char* out)>;
  // The op in pieces through the host pipeline (when pipes() says so), else nullptr. With
  // `any_size` in pieces at every size: an all-to-all, whose ranks' buffers differ in size, so
  // that a size threshold could send them different ways.
  using Piped = std::function<void(HostPipeline&, const HostPipeline::Call&)>;
  void flat(Op& op, const Exchange& x, const at::Tensor& in, const at::Tensor& out, const HostSpec& host,
            const Piped& piped = nullptr, bool any_size = false);
  void exchange(Op& op, const Exchange& x, const void* in, void* out);
  // A set of staging areas and the ranks that map each other's: the group's (in-host), or this
  // host's ranks in a group that spans hosts (TwoLevel).
  struct InHostSet {
    ExchangeStaging* staging;
    const std::vector<int>& members;  // ascending
    int me;                           // this rank's position among them
    const ExchangeTuning& tuning;     // of a group of members.size()
  };
  // `x` (built over the set's members) on the exchange kernel.
  void launch(Op& op, const Exchange& x, const InHostSet& set, const void* in, void* out);
  // The two-level route of a group that spans hosts with the same number (2 to
  // kExchangeMaxRanks) of its ranks on each: all_reduce as a reduce-scatter among this host's
  // ranks on the in-host kernels, an all_reduce of this rank's block among the ranks at the
  // same position on every host (its rail) through the host pipeline, and an all-gather among
  // this host's ranks on the in-host kernels; reduce_scatter as a reduce-scatter among this
  // host's ranks (each gets its rail's blocks) and one among the rail; all_gather as an
  // all-gather among the rail through the pipeline, then among this host's ranks on the in-host
  // kernels. The wire carries each byte once per host instead of once per rank. Decided at
  // the group's first collective op in each membership epoch (every rank issues it, and every
  // rank in an epoch sees the same active ranks): set up when every rank is active and agrees
  // (MOELINK_HOST_TWO_LEVEL, not capturing, areas mapped), over areas of that epoch; while some
  // rank is out the group runs flat (every rank on the wire), and once readmission makes it
  // whole again, in two levels again.
  struct TwoLevel {
    std::unique_ptr<ExchangeStaging> staging;
    TwoLevelRanks ranks;    // this host's ranks, this rank's position among them, its rail
    ExchangeTuning tuning;  // of a group of ranks.local.size() ranks
    // Row p * hosts + j of a two-level op's blocks ordered by (position on the host, position
    // on the rail) is the group's block rails[p][j] (int64, on the GPU): where all_gather puts
    // them, whence reduce_scatter takes them.
    at::Tensor gather_rows;
  };
  void setUpTwoLevel(bool capturing);
  // Every all_reduce, reduce_scatter, all_gather and broadcast takes it while it is set up and the
  // membership has not changed, whatever its size (small ones too, and empty blocks): ranks
  // that disagree about an op then still launch the same in-host kernels, whose header check
  // fails them at once.
  bool twoLevel() const { return two_level_ != nullptr && !changed_.load(std::memory_order_acquire); }
  void allreduceTwoLevel(Op& op, const at::Tensor& buf, ReduceOp rop);
  // `out`: contiguous, one block of in's bytes per rank.
  void allgatherTwoLevel(Op& op, const at::Tensor& in, const at::Tensor& out);
  // `in`: contiguous, one block of out's elements per rank.
  void reduceScatterTwoLevel(Op& op, const at::Tensor& in, const at::Tensor& out, ReduceOp rop);
  // `buf`: contiguous; `root`: a rank of the group.
  void broadcastTwoLevel(Op& op, const at::Tensor& buf, int root);
  // What a two-level op's cross-host step asks before each piece (RailStep::check): that the
  // membership has not changed and, `after_in_host`, that the in-host step before it succeeded
  // (its status word, cleared on the op's stream here, before that step's launch).
  std::function<std::string()> railCheck(Op& op, const char* what, bool after_in_host);
  // reduce_scatter / all_gather of `in` into `out` (both contiguous) on the group's route.
  void reduceScatterAny(Op& op, const at::Tensor& in, const at::Tensor& out, ReduceOp rop);
  void allgatherAny(Op& op, const at::Tensor& in, const at::Tensor& out);
  void hostFlat(Op& op, const at::Tensor& in, const at::Tensor& out, const HostSpec& host);
  static Piped gatherPieces(const at::Tensor& in, const at::Tensor& out);
  static Piped scatterPieces(const at::Tensor& in, const at::Tensor& out, ReduceOp rop);
  static Piped alltoallPieces(const at::Tensor& in, const at::Tensor& out, const PairLayout& l);
  // Whether a host-route op of `bytes` (its largest buffer) runs in pieces: from the
  // pipeline's threshold, and always when captured. Sets the pipeline up if needed.
  bool pipes(const Op& op, uint64_t bytes);
  // The pipeline's view of the op; an eager op's Work gets its outcome from it.
  HostPipeline::Call pipeCall(Op& op);
  // Tickets number host ops; the stream raises an op's ticket in its slot of ready_ when its
  // data is in host memory (raiseReady), the worker's callback raises it in done_.
  uint32_t nextTicket();
  uint32_t raiseReady(Op& op);
  std::function<bool()> readyGate(const Op& op, uint32_t ticket) const;
  // The completion callback of a host op: records the outcome, then raises the done word.
  std::function<void(const std::string&, int)> doneCallback(Op& op, uint32_t ticket);
  void allreduceFlat(Op& op, const at::Tensor& buf, ReduceOp rop);
  // Broadcast: one exchange, or above the one-shot size in groups of more than 2 (in-host) the
  // forwarding exchange (exchangeBroadcastForward).
  void broadcastFlat(Op& op, const at::Tensor& buf, int root);

  GroupContext g_;
  const int rank_, size_;
  mutable std::mutex mu_;  // binding
  std::mutex submit_mu_;   // putting an op on its stream
  int device_ = -1;
  ExchangeTuning tuning_;
  HostPipelineTuning pipe_tuning_;
  std::unique_ptr<HostPipeline> pipe_;  // the host route's ring (set up with the unit between hosts)
  std::optional<c10::cuda::CUDAStream> comm_, recv_;
  std::unique_ptr<ExchangeStaging> staging_;
  std::unique_ptr<MappedArray<ExchangeStatus>> status_;  // kSlots + a sink for captured ops
  std::unique_ptr<MappedArray<uint32_t>> ready_, done_;
  std::unique_ptr<MappedArray<uint32_t>> abort_;  // [0]: raised on a membership change; kernels give up
  std::atomic<uint32_t*> abort_word_{nullptr};    // abort_'s word (the membership listener raises it)
  std::atomic<bool> changed_{false};
  // Staging areas (and their abort words, raised for good, and the GPU tensors their ops
  // read) that ops captured in CUDA graphs still name: kept, so that replaying such a graph
  // after a membership change ends its kernels at once instead of touching freed memory (the
  // graph must be captured again).
  struct Retired {
    std::unique_ptr<ExchangeStaging> staging;
    std::unique_ptr<MappedArray<uint32_t>> abort;
    at::Tensor keep;
  };
  std::vector<Retired> retired_;
  // Keeps `staging` (and `keep`) for the graphs captured over it, with the current abort word
  // raised; a fresh word (raised too, until new areas clear it) serves what comes next.
  void retire(std::unique_ptr<ExchangeStaging> staging, at::Tensor keep = {});
  bool captured_since_stage_ = false;
  bool capable_ = false;      // every rank on this host: the in-host kernels can serve the group
  int ranks_per_host_ = 0;    // MOELINK_RANKS_PER_HOST (0: unset)
  std::unique_ptr<TwoLevel> two_level_;
  // The epoch the two-level route was decided for (every rank decides at its first group op
  // in an epoch), and whether an op captured in a CUDA graph used the areas set up then.
  std::optional<uint64_t> two_level_epoch_;
  bool two_level_captured_ = false;
  // The set of staging areas in use: the epoch it was set up in, its ranks (sorted) and this
  // rank's position among them.
  bool staged_ = false;
  uint64_t staged_epoch_ = 0;
  std::vector<int> members_;
  int me_ = 0;
  // Group ops issued on this rank (every rank issues the same ones, in one order), and the
  // first that runs over the current areas: ops that some ranks issued before they saw a
  // membership change and others after are dropped on the latter, so that ranks stay in step.
  uint64_t seq_ = 0, start_seq_ = 0;
  std::unique_ptr<Completer> completer_;
  std::shared_ptr<EventPool> events_;  // the ops' end events
  cudaEvent_t start_ = nullptr;  // recorded on the caller's stream at each op's start
  uint32_t ticket_ = 0;
  // The group's latest op: its end event, its stream and the capture it was recorded in (0:
  // none). The kernels of a group number themselves on the staging area in the order they
  // run, so an op on another stream than this one waits for it first.
  struct Latest {
    std::shared_ptr<PooledEvent> end;
    cudaStream_t stream = nullptr;
    unsigned long long capture = 0;
  } latest_;
  // Blocks until the group's ops issued so far have run (those of a capture need not).
  void drainGroupOps();
};

template <typename Body>
Work CudaCollectives::run(const Kind& k, Tensors outputs, const Tensors& used, Route route, const Call& call,
                              Body&& body) {
  int device = -1;
  for (const auto& t : used)
    if (t.defined()) {
      device = t.get_device();
      break;
    }
  TORCH_INTERNAL_ASSERT(device >= 0, "a CUDA op without CUDA tensors");
  bind(device, k.name);
  // One op at a time per group: ranks must queue ops in one order, and start_, latest_ and
  // the tickets are shared.
  std::lock_guard<std::mutex> submitting(submit_mu_);
  const auto dev = static_cast<c10::DeviceIndex>(device);
  c10::cuda::CUDAStream user = c10::cuda::getCurrentCUDAStream(dev);
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  unsigned long long capture = 0;
  cudaCheck(cudaStreamGetCaptureInfo(user.stream(), &cs, &capture), "cudaStreamGetCaptureInfo");
  if (cs == cudaStreamCaptureStatusNone) capture = 0;
  // An op that other ranks issued before they saw a membership change, and that failed
  // there (aborted), fails here too, without running: its Work carries the error, as theirs.
  std::string dropped;
  const bool group = route == Route::kGroup;
  if (group) {
    uint64_t seq = seq_++;
    if (capable_ && changed_.load(std::memory_order_acquire))
      seq = restage(k.name, cs != cudaStreamCaptureStatusNone, seq);
    if (seq < start_seq_)
      dropped = c10::str(k.name, " #", seq, ": not run: rank(s) left the group while the ranks were issuing "
                         "CUDA ops (epoch ", staged_epoch_, "), and another rank had issued this op before it saw the "
                         "change, where it failed; the ranks are in step again from op #", start_seq_);
  }
  if (group && two_level_epoch_ != g_.worker->epoch()) setUpTwoLevel(cs != cudaStreamCaptureStatusNone);
  const bool host = !group || !inHost();
  Op op;
  op.captured = cs != cudaStreamCaptureStatusNone;
  TORCH_CHECK(dropped.empty() || !op.captured, dropped);
  TORCH_CHECK_VALUE(!(op.captured && host && !(k.pipe && pipe_)), "moelink ", k.name,
                    ": in this group the op runs through host memory (",
                    !group ? "point-to-point ops always do" : "its ranks are on several hosts",
                    ") and cannot be captured in a CUDA graph",
                    group ? " (there, all_reduce, reduce_scatter, all_gather, broadcast and all_to_all can)" : "");
  // A synchronous group op runs where the caller's next work will wait for it anyway.
  const bool on_caller = group && !call.async;
  op.stream = route == Route::kHostRecv ? *recv_ : on_caller ? user : *comm_;
  op.timeout = call.timeout;
  if (!on_caller) {
    // The wait takes the event's state at this call, so one event serves every op.
    cudaCheck(cudaEventRecord(start_, user.stream()), "cudaEventRecord");
    cudaCheck(cudaStreamWaitEvent(op.stream->stream(), start_, 0), "cudaStreamWaitEvent");
  }
  op.work = c10::make_intrusive<CudaWork>(rank_, k.type, k.title, std::move(outputs), device, events_);
  op.work->setGroupSize(size_);
  op.work->timeout_ms = static_cast<uint64_t>(call.timeout.count());
  op.work->ranOn(op.stream->stream());
  if (group) {
    // After the group's previous op, unless stream order (this stream, or the caller's that
    // this op waits for) already puts it there, or it belongs to no capture this op can
    // depend on (ops issued before a capture began are the caller's to order, as with NCCL).
    const cudaStream_t s = op.stream->stream();
    if (latest_.end && latest_.stream != s && !(!on_caller && latest_.stream == user.stream()) &&
        latest_.capture == capture)
      cudaCheck(cudaStreamWaitEvent(s, latest_.end->get(), 0), "cudaStreamWaitEvent");
    // Its end event is recorded below on every path, the failed one included.
    latest_ = {op.work->endHolder(), s, capture};
  }
  op.slot = op.captured ? kSlots : completer_->reserve();
  {
    c10::cuda::CUDAStreamGuard guard(*op.stream);
    try {
      if (dropped.empty()) {
        body(op);
      } else {
        op.work->host = std::make_shared<HostOutcome>();
        op.work->host->set(dropped, -1);
      }
    } catch (...) {
      // Retire the reserved slot: the work completes once what was queued has run.
      op.work->status = nullptr;
      op.work->host.reset();
      cudaEventRecord(op.work->endEvent(), op.stream->stream());
      completer_->add(op.work);
      throw;
    }
    cudaCheck(cudaEventRecord(op.work->endEvent(), op.stream->stream()), "cudaEventRecord");
    // On another stream than the caller's, the tensors must outlive the op there.
    if (!on_caller)
      for (const auto& t : used)
        if (t.defined() && t.storage().data_ptr().get())
          c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *op.stream);
  }
  if (op.captured)
    op.work->completeCaptured();
  else
    completer_->add(op.work);
  return op.work;
}

}  // namespace moelink::cuda
