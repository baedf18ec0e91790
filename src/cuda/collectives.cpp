// The CUDA unit of backend "ep" (see collectives.h). Every op is put on its stream by run()
// (the caller's for a synchronous group op, else the group's communication stream): the op's
// GPU-side preparation (contiguous copies, flattened lists) is shared by both routes, and its
// data movement is one flat collective, which flat() runs as exchange kernels (in-host) or as
// a worker op over pinned copies (host-staged, hostFlat()).
#include "moelink/backend/collectives.h"
#include "moelink/cuda/collectives.h"

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
#include "moelink/transfer/records.h"
#include "staging.h"
#include "work.h"

namespace moelink::cuda {

namespace {

using backend::Call;
using backend::Collectives;
using backend::GroupContext;
using backend::nbytes;
using backend::PairLayout;
using backend::toDType;
using c10d::OpType;
using Work = Collectives::Work;
using Tensors = Collectives::Tensors;
using Timeout = std::chrono::milliseconds;
namespace algo = collective;

constexpr size_t kSlots = 1024;  // ops in flight per group (status and ticket rings)

char* ptr(const at::Tensor& t) { return t.defined() ? static_cast<char*>(t.data_ptr()) : nullptr; }

at::Tensor pinnedLike(const at::Tensor& t) {
  return at::empty(t.sizes(), at::TensorOptions().dtype(t.dtype()).pinned_memory(true));
}

// `t` itself when contiguous, else a contiguous buffer for an output (copy back with settle()).
at::Tensor contiguousOut(const at::Tensor& t) {
  return t.is_contiguous() ? t : at::empty_like(t, at::MemoryFormat::Contiguous);
}

// Copies `buf` into `t` when they differ (an output that was not contiguous).
void settle(at::Tensor& t, const at::Tensor& buf) {
  if (!buf.is_same(t)) t.copy_(buf);
}

// Flat, contiguous concatenation of `ts`.
at::Tensor flatten(const Tensors& ts) {
  std::vector<at::Tensor> flat;
  for (const auto& t : ts) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

// Copies consecutive slices of `flat` into `outs`.
void unflatten(const at::Tensor& flat, Tensors& outs) {
  int64_t off = 0;
  for (auto& o : outs) {
    o.copy_(flat.narrow(0, off, o.numel()).view(o.sizes()));
    off += o.numel();
  }
}

Tensors joined(const Tensors& a, const Tensors& b) {
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
    return device_ < 0 ? "" : inHost() ? "nvlink" : "host";
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
  void flat(Op& op, const Exchange& x, const at::Tensor& in, const at::Tensor& out, const HostSpec& host);
  void exchange(Op& op, const Exchange& x, const void* in, void* out);
  void hostFlat(Op& op, const at::Tensor& in, const at::Tensor& out, const HostSpec& host);
  // Tickets number host ops; the stream raises an op's ticket in its slot of ready_ when its
  // data is in host memory (raiseReady), the worker's callback raises it in done_.
  uint32_t nextTicket();
  uint32_t raiseReady(Op& op);
  std::function<bool()> readyGate(const Op& op, uint32_t ticket) const;
  // The completion callback of a host op: records the outcome, then raises the done word.
  std::function<void(const std::string&, int)> doneCallback(Op& op, uint32_t ticket);
  void allreduceFlat(Op& op, const at::Tensor& buf, ReduceOp rop);

  GroupContext g_;
  const int rank_, size_;
  mutable std::mutex mu_;  // binding
  std::mutex submit_mu_;   // putting an op on its stream
  int device_ = -1;
  ExchangeTuning tuning_;
  std::optional<c10::cuda::CUDAStream> comm_, recv_;
  std::unique_ptr<ExchangeStaging> staging_;
  std::unique_ptr<MappedArray<ExchangeStatus>> status_;  // kSlots + a sink for captured ops
  std::unique_ptr<MappedArray<uint32_t>> ready_, done_;
  std::unique_ptr<MappedArray<uint32_t>> abort_;  // [0]: raised on a membership change; kernels give up
  std::atomic<uint32_t*> abort_word_{nullptr};    // abort_'s word (the membership listener raises it)
  std::atomic<bool> changed_{false};
  // Staging areas (and their abort words, raised for good) that ops captured in CUDA graphs
  // still name: kept, so that replaying such a graph after a membership change ends its
  // kernels at once instead of touching freed memory (the graph must be captured again).
  std::vector<std::pair<std::unique_ptr<ExchangeStaging>, std::unique_ptr<MappedArray<uint32_t>>>> retired_;
  bool captured_since_stage_ = false;
  bool capable_ = false;      // every rank on this host: the in-host kernels can serve the group
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

CudaCollectives::~CudaCollectives() {
  if (device_ < 0) return;
  c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device_));
  // Kernels still waiting on peers give up, so that the streams drain.
  if (staging_) staging_->abortWaits();
  completer_.reset();  // completes what was handed in
  cudaStreamSynchronize(comm_->stream());
  cudaStreamSynchronize(recv_->stream());
  if (latest_.end && latest_.capture == 0) cudaEventSynchronize(latest_.end->get());
  latest_ = {};
  staging_.reset();
  cudaEventDestroy(start_);
}

void CudaCollectives::bind(int device, const char* opname) {
  std::lock_guard<std::mutex> g(mu_);
  if (device_ >= 0) {
    TORCH_CHECK_VALUE(device == device_, "moelink ", opname, ": this rank's CUDA collectives run on cuda:", device_,
                      " (its first CUDA op used it); got a tensor on cuda:", device);
    return;
  }
  const int current = c10::cuda::current_device();
  TORCH_CHECK_VALUE(device == current, "moelink ", opname, ": got a tensor on cuda:", device, ", but this rank's "
                    "current CUDA device is cuda:", current, "; call torch.cuda.set_device() with the rank's device "
                    "before its first CUDA collective");
  c10::cuda::CUDAGuard dg(static_cast<c10::DeviceIndex>(device));
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream(), &cs);
  TORCH_CHECK_VALUE(cs == cudaStreamCaptureStatusNone, "moelink ", opname, ": the first CUDA op of a group sets up "
                    "its GPU buffers and cannot be captured; run one CUDA collective on this group before capturing");
  try {
    tuning_ = ExchangeTuning::fromEnv();
  } catch (const moelink::Error& e) {
    TORCH_CHECK_VALUE(false, "moelink: ", e.what());
  }
  comm_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, static_cast<c10::DeviceIndex>(device));
  recv_ = c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device));
  status_ = std::make_unique<MappedArray<ExchangeStatus>>(kSlots + 1);
  ready_ = std::make_unique<MappedArray<uint32_t>>(kSlots);
  done_ = std::make_unique<MappedArray<uint32_t>>(kSlots);
  abort_ = std::make_unique<MappedArray<uint32_t>>(1);
  abort_word_.store(abort_->host(0));
  std::atomic<bool>* changed = &changed_;
  std::atomic<uint32_t*>* abort_word = &abort_word_;
  // The worker outlives no CUDA unit of its group (shutdown destroys the worker first).
  g_.worker->onChange([abort_word, changed] {
    changed->store(true, std::memory_order_release);
    __atomic_store_n(abort_word->load(), 1u, __ATOMIC_RELEASE);
  });
  // In-host when every rank is on this host (MOELINK_RANKS_PER_HOST=n declares virtual hosts
  // of n ranks, as for the EP buffer) and every rank maps every peer's staging area.
  // MOELINK_RANKS_PER_HOST: group ranks [0, n), [n, 2n), ... into virtual hosts, so that the
  // host-staged route runs on one machine.
  int rph = 0;
  try {
    rph = static_cast<int>(settings::number("MOELINK_RANKS_PER_HOST"));
  } catch (const moelink::Error& e) {
    TORCH_CHECK_VALUE(false, "moelink: ", e.what());
  }
  bool one_host = size_ <= kExchangeMaxRanks && (rph == 0 || rph >= size_);
  for (int q = 0; q < size_ && one_host; ++q) one_host = g_.host_of(q) == g_.host_of(rank_);
  capable_ = one_host;
  // The group's first areas, with every rank at its first CUDA op; after a membership change,
  // restage() sets them up at the next op, with the ranks active then.
  bool all_active = true;
  for (int q = 0; q < size_; ++q) all_active = all_active && g_.worker->isActive(q);
  if (one_host && all_active && g_.worker->epoch() == 0) {
    std::string why;
    staging_ = ExchangeStaging::open(g_.store, rank_, size_, tuning_, &why);
    if (!staging_) LOG(WARNING) << "moelink: CUDA collectives go through host memory: " << why;
    staged_ = true;
    for (int q = 0; q < size_; ++q) members_.push_back(q);
    me_ = rank_;
  } else if (one_host) {
    changed_ = true;
  }
  collective::CollectiveWorker* worker = g_.worker;
  completer_ = std::make_unique<Completer>(device, kSlots, [worker] { worker->watchPeers(); });
  events_ = std::make_shared<EventPool>(device);
  cudaCheck(cudaEventCreateWithFlags(&start_, cudaEventDisableTiming), "cudaEventCreate");
  device_ = device;
  VLOG(1) << "moelink: rank " << rank_ << " CUDA collectives on cuda:" << device << " via "
          << (staging_ ? "nvlink" : "host");
}

uint64_t CudaCollectives::restage(const char* opname, bool capturing, uint64_t seq) {
  collective::CollectiveWorker& w = *g_.worker;
  for (;;) {
    const uint64_t epoch = w.epoch();
    if (staged_ && epoch == staged_epoch_) {
      changed_.store(false, std::memory_order_release);
      return seq;
    }
    std::vector<int> members;
    for (int q = 0; q < size_; ++q)
      if (w.isActive(q)) members.push_back(q);
    if (!w.isActive(rank_)) return seq;  // out of the group: the host route says so
    TORCH_CHECK_VALUE(!capturing, "moelink ", opname, ": the first CUDA op after the group's membership changed "
                      "sets up its GPU buffers anew and cannot be captured; run one CUDA collective on this group "
                      "first");
    std::lock_guard<std::mutex> g(mu_);
    c10::cuda::CUDAGuard dg(static_cast<c10::DeviceIndex>(device_));
    // The group's earlier ops are done with the old areas (host-route ops finish through the
    // worker; in-host ones that waited on a rank that left were aborted by the change).
    // Point-to-point ops (the receive stream) never use the areas, and one may wait for a
    // peer's later send: not waited for.
    drainGroupOps();
    if (captured_since_stage_ && staging_) {
      // Graphs captured over these areas may be replayed: keep them, their abort word raised.
      __atomic_store_n(abort_->host(0), 1u, __ATOMIC_RELEASE);
      retired_.emplace_back(std::move(staging_), std::move(abort_));
      abort_ = std::make_unique<MappedArray<uint32_t>>(1);
      abort_word_.store(abort_->host(0));
      captured_since_stage_ = false;
    }
    staging_.reset();
    // Each member publishes the number of the op it is issuing (a rank with no areas yet, a
    // replacement, publishes none): the new areas serve ops from the largest on.
    const std::string tag = std::string("e").append(std::to_string(epoch));
    const std::string seq_key = "moelink_cuda/" + tag + "/seq/";
    const std::string mine = staged_ ? std::to_string(seq) : "-";
    g_.store->set(seq_key + std::to_string(rank_), std::vector<uint8_t>(mine.begin(), mine.end()));
    auto moved = [&w, epoch] { return w.epoch() != epoch; };
    std::string why;
    staging_ = ExchangeStaging::open(g_.store, rank_, size_, tuning_, &why, tag, members, moved);
    if (!staging_ && moved()) continue;  // another change while setting up: over again
    uint64_t start = seq;
    bool any = false;
    for (int q : members) {
      if (!g_.store->check({seq_key + std::to_string(q)})) continue;  // (a failed set-up)
      auto v = g_.store->get(seq_key + std::to_string(q));
      const std::string text(v.begin(), v.end());
      if (text == "-") continue;
      const uint64_t theirs = transfer::parseCount(text, seq_key + std::to_string(q));
      start = any ? std::max(start, theirs) : theirs;
      any = true;
    }
    if (!staged_ || !any) {  // a rank new to the group takes the others' numbering
      seq = start;
      seq_ = start + 1;
    }
    start_seq_ = start;
    staged_ = true;
    staged_epoch_ = epoch;
    members_ = members;
    me_ = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    if (!staging_) {
      LOG(WARNING) << "moelink: CUDA collectives go through host memory after the membership change: " << why;
      return seq;
    }
    __atomic_store_n(abort_->host(0), 0u, __ATOMIC_RELEASE);
    changed_.store(false, std::memory_order_release);
    // A change decided meanwhile (the worker sets the epoch before it calls the listeners)
    // raises the flags again; one from here on does so itself.
    if (w.epoch() != epoch) {
      changed_.store(true, std::memory_order_release);
      __atomic_store_n(abort_->host(0), 1u, __ATOMIC_RELEASE);
    }
    LOG(INFO) << "moelink: rank " << rank_ << " CUDA collectives on the in-host kernels over " << members.size()
              << " rank(s) from epoch " << epoch << ", op #" << start;
    return seq;
  }
}

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
  const bool host = !group || !inHost();
  Op op;
  op.captured = cs != cudaStreamCaptureStatusNone;
  TORCH_CHECK(dropped.empty() || !op.captured, dropped);
  TORCH_CHECK_VALUE(!(op.captured && host), "moelink ", k.name, ": in this group the op runs through host memory (",
                    !group ? "point-to-point ops always do" : "its ranks are on several hosts",
                    ") and cannot be captured in a CUDA graph");
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

void CudaCollectives::drainGroupOps() {
  cudaCheck(cudaStreamSynchronize(comm_->stream()), "cudaStreamSynchronize");
  if (latest_.end && latest_.capture == 0) cudaCheck(cudaEventSynchronize(latest_.end->get()), "cudaEventSynchronize");
}

void CudaCollectives::exchange(Op& op, const Exchange& full, const void* in, void* out) {
  // Over the active ranks after a membership change: the group's plan restricted to them
  // (plans built for the sub-group already, the two-shot halves, pass as they are), with
  // zeros where an inactive rank's data would land.
  const int n = static_cast<int>(members_.size());
  const bool restrict = n < size_ && static_cast<int>(full.send_bytes.size()) == size_;
  if (full.root >= 0)
    TORCH_CHECK_VALUE(std::binary_search(members_.begin(), members_.end(), full.root), "moelink: root rank ",
                      full.root, " is not active in the group (it left; moelink.recover_ranks readmits it)");
  const Exchange x = restrict ? restrictExchange(full, members_) : full;
  if (restrict)
    for (auto [off, len] : droppedRanges(full, members_))
      cudaCheck(cudaMemsetAsync(static_cast<char*>(out) + off, 0, len, op.stream->stream()), "cudaMemsetAsync");
  ExchangeLaunch l;
  describeLaunch(x, me_, tuning_, l);
  l.in = static_cast<const char*>(in);
  l.out = static_cast<char*>(out);
  for (int j = 0; j < n; ++j) l.staging[j] = staging_->area(members_[j]);
  l.layout = staging_->layout();
  l.timeout_ns = static_cast<uint64_t>(op.timeout.count()) * 1000000ull;
  l.status = status_->dev(op.slot);
  l.abort = abort_->dev(0);
  op.work->status = op.captured ? nullptr : status_->host(op.slot);
  if (op.captured) captured_since_stage_ = true;
  if (n < size_) op.work->peers = members_;
  cudaCheck(launchExchange(l, op.stream->stream()), "launching the exchange kernel");
}

uint32_t CudaCollectives::nextTicket() {
  return ++ticket_ ? ticket_ : ++ticket_;  // never 0 (the words start at 0)
}

uint32_t CudaCollectives::raiseReady(Op& op) {
  const uint32_t ticket = nextTicket();
  StreamMemOps::write(op.stream->stream(), ready_->dev(op.slot), ticket);
  return ticket;
}

std::function<bool()> CudaCollectives::readyGate(const Op& op, uint32_t ticket) const {
  uint32_t* word = ready_->host(op.slot);
  return [word, ticket] { return *reinterpret_cast<volatile uint32_t*>(word) == ticket; };
}

std::function<void(const std::string&, int)> CudaCollectives::doneCallback(Op& op, uint32_t ticket) {
  auto outcome = std::make_shared<HostOutcome>();
  op.work->host = outcome;
  uint32_t* done = done_->host(op.slot);
  collective::CollectiveWorker* worker = g_.worker;
  return [outcome, done, ticket, worker](const std::string& err, int source) {
    outcome->lost = worker->opLost();  // worker thread, inside the op's completion
    outcome->set(err, source);
    *reinterpret_cast<volatile uint32_t*>(done) = ticket;
  };
}

void CudaCollectives::hostFlat(Op& op, const at::Tensor& in, const at::Tensor& out, const HostSpec& host) {
  at::Tensor pin_in, pin_out;
  if (in.defined()) {
    pin_in = pinnedLike(in);
    pin_in.copy_(in, /*non_blocking=*/true);
    op.work->keep(pin_in);
  }
  if (out.defined()) {
    pin_out = out.is_same(in) ? pin_in : pinnedLike(out);
    op.work->keep(pin_out);
  }
  const uint32_t ticket = raiseReady(op);
  const auto dtype = toDType((in.defined() ? in : out).scalar_type());
  char* pi = ptr(pin_in);
  char* po = ptr(pin_out);
  auto gate = readyGate(op, ticket);
  auto done = doneCallback(op, ticket);
  // Built when the worker starts it (and again if a membership change reruns it).
  g_.worker->submit(
      collective::OpBuilder([host, pi, po, dtype, gate](const algo::AlgoContext& c) {
        collective::OpSpec spec = host(c, pi, po);
        if (spec.dtype == collective::DType::kBytes) spec.dtype = dtype;
        spec.ready = gate;
        return spec;
      }),
      [done](const std::string& err) { done(err, -1); }, op.timeout);
  StreamMemOps::wait(op.stream->stream(), done_->dev(op.slot), ticket);
  if (out.defined()) out.copy_(pin_out, /*non_blocking=*/true);
}

void CudaCollectives::flat(Op& op, const Exchange& x, const at::Tensor& in, const at::Tensor& out,
                               const HostSpec& host) {
  if (inHost())
    exchange(op, x, ptr(in), ptr(out));
  else
    hostFlat(op, in, out, host);
}

void CudaCollectives::allreduceFlat(Op& op, const at::Tensor& buf, ReduceOp rop) {
  const auto t = toDType(buf.scalar_type());
  const uint64_t count = static_cast<uint64_t>(buf.numel());
  if (!inHost()) {
    hostFlat(op, buf, buf, [=](const algo::AlgoContext& c, char* in, char*) {
      return algo::allreduceOp(c, in, count, t, rop);
    });
  } else {
    // Over the active ranks (all of them unless the membership changed).
    const int n = static_cast<int>(members_.size());
    if (tuning_.oneShot(n, nbytes(buf))) {
      exchange(op, exchangeAllreduceOneShot(n, me_, count, t, rop), ptr(buf), ptr(buf));
    } else {
      auto blocks = allreduceBlocks(n, count, t);
      exchange(op, exchangeAllreduceScatter(n, me_, count, t, rop), ptr(buf),
               ptr(buf) + blocks[me_].first * collective::elementSize(t));
      exchange(op, exchangeAllreduceGather(n, me_, count, t), ptr(buf), ptr(buf));
    }
  }
}

// ---- the collectives ----

Work CudaCollectives::broadcast(at::Tensor& t, int root, const Call& call) {
  return run({"broadcast", OpType::BROADCAST, "ep:broadcast"}, {t}, {t}, Route::kGroup, call, [&](Op& op) {
    at::Tensor buf = t.contiguous();
    flat(op, exchangeBroadcast(size_, rank_, nbytes(buf), root), buf, buf,
         [=](const algo::AlgoContext& c, char* in, char*) { return algo::broadcastOp(c, in, nbytes(buf), root); });
    settle(t, buf);
  });
}

Work CudaCollectives::allreduce(Tensors& ts, ReduceOp rop, const Call& call) {
  const bool one = ts.size() == 1;
  Kind k = one ? Kind{"allreduce", OpType::ALLREDUCE, "ep:all_reduce"}
               : Kind{"allreduce_coalesced", OpType::ALLREDUCE_COALESCED, "ep:all_reduce_coalesced"};
  return run(k, ts, ts, Route::kGroup, call, [&](Op& op) {
    at::Tensor buf = one ? ts[0].contiguous() : flatten(ts);
    allreduceFlat(op, buf, rop);
    if (one)
      settle(ts[0], buf);
    else
      unflatten(buf, ts);
  });
}

Work CudaCollectives::reduce(at::Tensor& t, ReduceOp rop, int root, const Call& call) {
  return run({"reduce", OpType::REDUCE, "ep:reduce"}, {t}, {t}, Route::kGroup, call, [&](Op& op) {
    at::Tensor buf = t.contiguous();
    const auto dt = toDType(buf.scalar_type());
    const uint64_t count = static_cast<uint64_t>(buf.numel());
    flat(op, exchangeReduce(size_, rank_, count, dt, rop, root), buf, buf,
         [=](const algo::AlgoContext& c, char* in, char*) { return algo::reduceOp(c, in, in, count, dt, rop, root); });
    settle(t, buf);
  });
}

Work CudaCollectives::allgather(at::Tensor& output, at::Tensor& input, const Call& call) {
  Kind k{"all_gather_into_tensor", OpType::_ALLGATHER_BASE, "ep:_all_gather_base"};
  return run(k, {output}, {input, output}, Route::kGroup, call, [&](Op& op) {
    at::Tensor in = input.contiguous(), out = contiguousOut(output);
    flat(op, exchangeAllgather(size_, rank_, nbytes(in)), in, out,
         [=](const algo::AlgoContext& c, char* i, char* o) { return algo::allgatherOp(c, i, o, nbytes(in)); });
    settle(output, out);
  });
}

Work CudaCollectives::allgather(Tensors& outputs, at::Tensor& input, const Call& call) {
  return run({"allgather", OpType::ALLGATHER, "ep:all_gather"}, outputs, joined(outputs, {input}), Route::kGroup,
             call, [&](Op& op) {
               at::Tensor in = input.contiguous();
               at::Tensor out = at::empty({in.numel() * size_}, in.options());
               flat(op, exchangeAllgather(size_, rank_, nbytes(in)), in, out,
                    [=](const algo::AlgoContext& c, char* i, char* o) {
                      return algo::allgatherOp(c, i, o, nbytes(in));
                    });
               unflatten(out, outputs);
             });
}

Work CudaCollectives::allgatherCoalesced(Tensors& outputs, Tensors& inputs, const Call& call) {
  Kind k{"allgather_into_tensor_coalesced", OpType::COALESCED, "ep:allgather_into_tensor_coalesced"};
  return run(k, outputs, joined(outputs, inputs), Route::kGroup, call, [&](Op& op) {
    at::Tensor in = flatten(inputs);
    at::Tensor out = at::empty({in.numel() * size_}, in.options());
    flat(op, exchangeAllgather(size_, rank_, nbytes(in)), in, out,
         [=](const algo::AlgoContext& c, char* i, char* o) { return algo::allgatherOp(c, i, o, nbytes(in)); });
    // out is [rank][input 0 | input 1 | ...]; output i gathers every rank's input i.
    int64_t off = 0;
    for (size_t i = 0; i < outputs.size(); ++i) {
      int64_t n = inputs[i].numel();
      outputs[i].copy_(out.view({size_, in.numel()}).narrow(1, off, n).reshape(outputs[i].sizes()));
      off += n;
    }
  });
}

// outputs[r][j] <- rank r's inputs[j]: one all-gather of the concatenated inputs, then copies
// on the caller's current stream behind it.
Work CudaCollectives::allgatherLists(std::vector<Tensors>& outputs, Tensors& inputs, const Call& call) {
  at::Tensor in = flatten(inputs);
  at::Tensor out = at::empty({in.numel() * size_}, in.options());
  Work work = allgather(out, in, call);
  work->wait();  // the current stream waits for the op; the copies below follow it
  const int64_t per_rank = in.numel();
  for (int r = 0; r < size_; ++r) {
    int64_t off = 0;
    for (size_t j = 0; j < inputs.size(); ++j) {
      const int64_t n = inputs[j].numel();
      outputs[r][j].copy_(out.narrow(0, r * per_rank + off, n).view(outputs[r][j].sizes()));
      off += n;
    }
  }
  return work;
}

Work CudaCollectives::gather(Tensors& outputs, at::Tensor& input, int root, const Call& call) {
  return run({"gather", OpType::GATHER, "ep:gather"}, outputs, joined(outputs, {input}), Route::kGroup, call,
             [&](Op& op) {
               at::Tensor in = input.contiguous();
               at::Tensor out = rank_ == root ? at::empty({in.numel() * size_}, in.options()) : at::Tensor();
               flat(op, exchangeGather(size_, rank_, nbytes(in), root), in, out,
                    [=](const algo::AlgoContext& c, char* i, char* o) {
                      return algo::gatherOp(c, i, o, nbytes(in), root);
                    });
               if (rank_ == root) unflatten(out, outputs);
             });
}

Work CudaCollectives::scatter(at::Tensor& output, const Tensors& inputs, int root, const Call& call) {
  return run({"scatter", OpType::SCATTER, "ep:scatter"}, {output}, joined({output}, inputs), Route::kGroup, call,
             [&](Op& op) {
               at::Tensor in = rank_ == root ? flatten(inputs) : at::Tensor();
               at::Tensor out = contiguousOut(output);
               flat(op, exchangeScatter(size_, rank_, nbytes(out), root), in, out,
                    [=](const algo::AlgoContext& c, char* i, char* o) {
                      return algo::scatterOp(c, i, o, nbytes(out), root);
                    });
               settle(output, out);
             });
}

Work CudaCollectives::reduceScatter(at::Tensor& output, at::Tensor& input, ReduceOp rop, const Call& call) {
  Kind k{"reduce_scatter_tensor", OpType::_REDUCE_SCATTER_BASE, "ep:_reduce_scatter_base"};
  return run(k, {output}, {input, output}, Route::kGroup, call, [&](Op& op) {
    at::Tensor in = input.contiguous(), out = contiguousOut(output);
    const auto dt = toDType(out.scalar_type());
    const uint64_t count = static_cast<uint64_t>(out.numel());
    flat(op, exchangeReduceScatter(size_, rank_, count, dt, rop), in, out,
         [=](const algo::AlgoContext& c, char* i, char* o) { return algo::reduceScatterOp(c, i, o, count, dt, rop); });
    settle(output, out);
  });
}

Work CudaCollectives::reduceScatter(at::Tensor& output, Tensors& inputs, ReduceOp rop, const Call& call) {
  Kind k{"reduce_scatter", OpType::REDUCE_SCATTER, "ep:reduce_scatter"};
  return run(k, {output}, joined({output}, inputs), Route::kGroup, call, [&](Op& op) {
    at::Tensor in = flatten(inputs), out = contiguousOut(output);
    const auto dt = toDType(out.scalar_type());
    const uint64_t count = static_cast<uint64_t>(out.numel());
    flat(op, exchangeReduceScatter(size_, rank_, count, dt, rop), in, out,
         [=](const algo::AlgoContext& c, char* i, char* o) { return algo::reduceScatterOp(c, i, o, count, dt, rop); });
    settle(output, out);
  });
}

Work CudaCollectives::reduceScatterCoalesced(Tensors& outputs, Tensors& inputs, ReduceOp rop, const Call& call) {
  Kind k{"reduce_scatter_tensor_coalesced", OpType::COALESCED, "ep:reduce_scatter_tensor_coalesced"};
  return run(k, outputs, joined(outputs, inputs), Route::kGroup, call, [&](Op& op) {
    // Block layout [rank][output 0 | output 1 | ...] built from each input's rank slices.
    Tensors pieces;
    for (int r = 0; r < size_; ++r)
      for (size_t i = 0; i < inputs.size(); ++i) {
        int64_t n = outputs[i].numel();
        pieces.push_back(inputs[i].reshape({-1}).narrow(0, r * n, n));
      }
    at::Tensor in = at::cat(pieces);
    at::Tensor out = at::empty({in.numel() / size_}, in.options());
    const auto dt = toDType(out.scalar_type());
    const uint64_t count = static_cast<uint64_t>(out.numel());
    flat(op, exchangeReduceScatter(size_, rank_, count, dt, rop), in, out,
         [=](const algo::AlgoContext& c, char* i, char* o) { return algo::reduceScatterOp(c, i, o, count, dt, rop); });
    unflatten(out, outputs);
  });
}

Work CudaCollectives::alltoall(at::Tensor& output, at::Tensor& input, const PairLayout& l, const Call& call) {
  Kind k{"all_to_all_single", OpType::ALLTOALL_BASE, "ep:all_to_all"};
  return run(k, {output}, {input, output}, Route::kGroup, call, [&](Op& op) {
    at::Tensor in = input.contiguous(), out = contiguousOut(output);
    flat(op, exchangeAlltoall(size_, rank_, l.send_off, l.send_bytes, l.recv_off, l.recv_bytes), in, out,
         [=](const algo::AlgoContext& c, char* i, char* o) {
           return algo::alltoallOp(c, i, l.send_off, l.send_bytes, o, l.recv_off, l.recv_bytes);
         });
    settle(output, out);
  });
}

Work CudaCollectives::alltoall(Tensors& outputs, Tensors& inputs, const PairLayout& l, const Call& call) {
  return run({"all_to_all", OpType::ALLTOALL, "ep:all_to_all"}, outputs, joined(outputs, inputs), Route::kGroup,
             call, [&](Op& op) {
               at::Tensor in = flatten(inputs);
               const uint64_t total = l.recv_off.back() + l.recv_bytes.back();
               at::Tensor out = at::empty({static_cast<int64_t>(total / in.element_size())}, in.options());
               flat(op,
                    exchangeAlltoall(size_, rank_, l.send_off, l.send_bytes, l.recv_off, l.recv_bytes),
                    in, out, [=](const algo::AlgoContext& c, char* i, char* o) {
                      return algo::alltoallOp(c, i, l.send_off, l.send_bytes, o, l.recv_off, l.recv_bytes);
                    });
               unflatten(out, outputs);
             });
}

// ---- point to point: host-staged in every group ----

Work CudaCollectives::send(at::Tensor& t, int dst, int tag, const Call& call) {
  return run({"send", OpType::SEND, "ep:send"}, {t}, {t}, Route::kHost, call, [&](Op& op) {
    at::Tensor pin = pinnedLike(t);
    pin.copy_(t, /*non_blocking=*/true);
    op.work->keep(pin);
    const uint32_t ticket = raiseReady(op);
    auto done = doneCallback(op, ticket);
    g_.worker->send(dst, ptr(pin), nbytes(pin), tag, [done](const std::string& err) { done(err, -1); },
                     call.timeout, readyGate(op, ticket));
  });
}

Work CudaCollectives::recv(at::Tensor& t, int src, int tag, const Call& call) {
  Kind k = src < 0 ? Kind{"recv", OpType::RECVANYSOURCE, "ep:recvAnySource"} : Kind{"recv", OpType::RECV, "ep:recv"};
  return run(k, {t}, {t}, Route::kHostRecv, call, [&](Op& op) {
    at::Tensor pin = pinnedLike(t);
    op.work->keep(pin);
    const uint32_t ticket = nextTicket();
    g_.worker->recv(src, ptr(pin), nbytes(pin), tag, doneCallback(op, ticket), call.timeout);
    StreamMemOps::wait(op.stream->stream(), done_->dev(op.slot), ticket);
    t.copy_(pin, /*non_blocking=*/true);
  });
}

const bool registered = backend::registerCollectives(c10::DeviceType::CUDA, [](const GroupContext& g) {
  return std::make_unique<CudaCollectives>(g);
});

}  // namespace

}  // namespace moelink::cuda
