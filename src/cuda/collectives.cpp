// The CUDA unit of backend "ep" (see collectives.h). Every op is put on its stream by run()
// (the caller's for a synchronous group op, else the group's communication stream): the op's
// GPU-side preparation (contiguous copies, flattened lists) is shared by both routes, and its
// data movement is one flat collective, which flat() runs as exchange kernels (in-host) or as
// a worker op over pinned copies (host-staged, hostFlat()).
#include "moelink/backend/collectives.h"
#include "moelink/cuda/collectives.h"

#include "unit.h"

namespace moelink::cuda {

CudaCollectives::~CudaCollectives() {
  if (device_ < 0) return;
  c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device_));
  // Kernels still waiting on peers give up, so that the streams drain.
  if (staging_) staging_->abortWaits();
  if (two_level_) two_level_->staging->abortWaits();
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
    // (A group of more than kExchangeMaxRanks never runs the in-host kernels over all of its
    // ranks: the largest row's settings, which are read and checked all the same.)
    tuning_ = ExchangeTuning::fromEnv(std::min(size_, kExchangeMaxRanks));
    pipe_tuning_ = HostPipelineTuning::fromEnv();
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
  ranks_per_host_ = rph;
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
  // Between hosts (or where the in-host areas could not be set up) every group op takes the
  // host route: its ring now, so that such ops can be captured from the start.
  if (!one_host || (staged_ && !staging_))
    pipe_ = std::make_unique<HostPipeline>(g_.worker, rank_, size_, pipe_tuning_);
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
    if (captured_since_stage_ && staging_) retire(std::move(staging_));  // graphs may replay them
    captured_since_stage_ = false;
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

void CudaCollectives::retire(std::unique_ptr<ExchangeStaging> staging, at::Tensor keep) {
  __atomic_store_n(abort_->host(0), 1u, __ATOMIC_RELEASE);
  retired_.push_back(Retired{std::move(staging), std::move(abort_), std::move(keep)});
  abort_ = std::make_unique<MappedArray<uint32_t>>(1);
  __atomic_store_n(abort_->host(0), 1u, __ATOMIC_RELEASE);
  abort_word_.store(abort_->host(0));
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
  if (op.captured) captured_since_stage_ = true;
  launch(op, x, InHostSet{staging_.get(), members_, me_, tuning_}, in, out);
}

void CudaCollectives::launch(Op& op, const Exchange& x, const InHostSet& set, const void* in, void* out) {
  const int n = static_cast<int>(set.members.size());
  ExchangeLaunch l;
  describeLaunch(x, set.me, set.tuning, l);
  l.in = static_cast<const char*>(in);
  l.out = static_cast<char*>(out);
  l.guard_input = exchangeOutputMeetsInput(x, set.me, in, out);
  for (int j = 0; j < n; ++j) l.staging[j] = set.staging->area(set.members[j]);
  l.layout = set.staging->layout();
  l.timeout_ns = static_cast<uint64_t>(op.timeout.count()) * 1000000ull;
  l.status = status_->dev(op.slot);
  l.abort = abort_->dev(0);
  op.work->status = op.captured ? nullptr : status_->host(op.slot);
  if (n < size_) op.work->peers = set.members;
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
  TORCH_INTERNAL_ASSERT(!op.captured, "a host-staged op in a CUDA graph");
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

bool CudaCollectives::pipes(const Op& op, uint64_t bytes) {
  if (!op.captured && bytes < pipe_tuning_.min_bytes) return false;
  // A group that came to the host route after a membership change sets its ring up here
  // (not in a capture: run() refuses that).
  if (!pipe_ && !op.captured) pipe_ = std::make_unique<HostPipeline>(g_.worker, rank_, size_, pipe_tuning_);
  return pipe_ != nullptr;
}

HostPipeline::Call CudaCollectives::pipeCall(Op& op) {
  HostPipeline::Call c;
  c.stream = op.stream->stream();
  c.timeout = op.timeout;
  c.captured = op.captured;
  if (!op.captured) {
    auto outcome = std::make_shared<HostOutcome>();
    op.work->host = outcome;
    c.done = [outcome](const std::string& err, const std::vector<int>& lost) {
      outcome->lost = lost;
      outcome->set(err, -1);
    };
  }
  return c;
}

void CudaCollectives::flat(Op& op, const Exchange& x, const at::Tensor& in, const at::Tensor& out,
                               const HostSpec& host, const Piped& piped, bool any_size) {
  if (inHost())
    exchange(op, x, ptr(in), ptr(out));
  else if (piped && pipes(op, any_size ? UINT64_MAX
                                       : std::max(in.defined() ? nbytes(in) : 0, out.defined() ? nbytes(out) : 0)))
    piped(*pipe_, pipeCall(op));
  else
    hostFlat(op, in, out, host);
}

void CudaCollectives::broadcastFlat(Op& op, const at::Tensor& buf, int root) {
  if (!inHost() && twoLevel()) {
    broadcastTwoLevel(op, buf, root);
    return;
  }
  const uint64_t bytes = nbytes(buf);
  const int n = static_cast<int>(members_.size());
  if (!inHost() || !broadcastForwards(n, bytes, tuning_)) {
    flat(op, exchangeBroadcast(size_, rank_, bytes, root), buf, buf,
         [=](const algo::AlgoContext& c, char* in, char*) { return algo::broadcastOp(c, in, bytes, root); },
         [&](HostPipeline& p, const HostPipeline::Call& c) { p.broadcast(c, ptr(buf), bytes, root); });
    return;
  }
  // Over the active ranks: the root's position among them builds the plan; its header names
  // the root by its rank in the group, as every rank's does.
  const auto it = std::lower_bound(members_.begin(), members_.end(), root);
  TORCH_CHECK_VALUE(it != members_.end() && *it == root, "moelink: root rank ", root,
                    " is not active in the group (it left; moelink.recover_ranks readmits it)");
  Exchange x = exchangeBroadcastForward(n, me_, bytes, static_cast<int>(it - members_.begin()));
  x.root = root;
  exchange(op, x, ptr(buf), ptr(buf));
}

void CudaCollectives::allreduceFlat(Op& op, const at::Tensor& buf, ReduceOp rop) {
  const auto t = toDType(buf.scalar_type());
  const uint64_t count = static_cast<uint64_t>(buf.numel());
  if (!inHost()) {
    if (twoLevel())
      allreduceTwoLevel(op, buf, rop);
    else if (pipes(op, nbytes(buf)))
      pipe_->allreduce(pipeCall(op), ptr(buf), count, t, rop);
    else
      hostFlat(op, buf, buf, [=](const algo::AlgoContext& c, char* in, char*) {
        return algo::allreduceOp(c, in, count, t, rop);
      });
  } else {
    // Over the active ranks (all of them unless the membership changed).
    const int n = static_cast<int>(members_.size());
    if (allreduceTwoShotLamport(n, count, t, tuning_)) {
      exchange(op, exchangeAllreduceTwoShot(n, me_, count, t, rop), ptr(buf), ptr(buf));
    } else if (tuning_.oneShot(n, nbytes(buf))) {
      exchange(op, exchangeAllreduceOneShot(n, me_, count, t, rop), ptr(buf), ptr(buf));
    } else {
      exchange(op, exchangeAllreduceTwoShotStaged(n, me_, count, t, rop), ptr(buf), ptr(buf));
    }
  }
}

}  // namespace moelink::cuda
