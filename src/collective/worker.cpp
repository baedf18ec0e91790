#include "moelink/collective/worker.h"

#include <algorithm>
#include <cstdlib>

#include <glog/logging.h>

#include "moelink/collective/message_check.h"
#include "moelink/common/settings.h"
#include "moelink/common/error.h"
#include "moelink/common/spin.h"
#include "moelink/transfer/records.h"
#include "worker_internal.h"

namespace moelink::collective {

using namespace std::chrono;

namespace {

constexpr transfer::SegmentId kCollectiveSegment = 1;
constexpr transfer::SegmentId kP2PSegment = 2;

}  // namespace

std::string describeTimeout(const char* what, uint64_t seq, milliseconds timeout,
                            const std::vector<int>& waiting_for) {
  std::vector<int> sorted = waiting_for;  // a rank can be waited on for a message and for credit
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  std::string ranks;
  for (int r : sorted) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  return str(what, " #", seq, ": Timed out after ", timeout.count(), " ms",
             ranks.empty() ? std::string() : str(" waiting for rank(s) ", ranks));
}

WorkerOptions WorkerOptions::fromEnv(milliseconds timeout) {
  WorkerOptions o;
  o.chunk_bytes = settings::numberIfSet("MOELINK_CHUNK_BYTES").value_or(0);
  o.depth = static_cast<int>(settings::number("MOELINK_MAILBOX_DEPTH"));
  o.allreduce_small_bytes = settings::number("MOELINK_ALLREDUCE_SMALL_BYTES");
  o.pull_min_bytes = settings::number("MOELINK_PULL_MIN_BYTES");
  o.pull_chunk_bytes = settings::number("MOELINK_PULL_CHUNK_BYTES");
  if (auto v = settings::numberIfSet("MOELINK_CHAIN_BROADCAST_BYTES")) o.chain_broadcast_bytes = static_cast<int64_t>(*v);
  if (auto v = settings::numberIfSet("MOELINK_RING_ALLREDUCE_BYTES")) o.ring_allreduce_bytes = static_cast<int64_t>(*v);
  if (auto v = settings::numberIfSet("MOELINK_REDUCE_PIECE_BYTES")) o.reduce_piece_bytes = static_cast<int64_t>(*v);
  o.timeout = timeout;
  return o;
}

CollectiveWorker::CollectiveWorker(transfer::TransferEngine& engine,
                                   transfer::MetadataStore& store, WorkerOptions options)
    : engine_(engine), opts_(options), rank_(engine.rank()), world_(engine.worldSize()), store_(store) {
  const int initial = opts_.initial_size > 0 ? std::min(opts_.initial_size, world_) : world_;
  const uint64_t chunk = chunkBytes(initial);
  coll_ = std::make_unique<Mailbox>(engine_, kCollectiveSegment, chunk, opts_.depth);
  p2p_ = std::make_unique<Mailbox>(engine_, kP2PSegment, chunk, opts_.depth);
  membership_ = std::make_unique<Membership>(engine_, MembershipOptions::fromEnv(opts_.raise_on_peer_failure));
  active_.assign(world_, 0);
  std::fill(active_.begin(), active_.begin() + initial, 1);
  seen_incarnation_.assign(world_, 0);  // the newest process readmitted per rank (0: none yet)
  std::fill(seen_incarnation_.begin(), seen_incarnation_.begin() + initial, 1);
  if (opts_.extension) {
    waitAdmission();  // sets active_, the op numbers and the epoch; opens the active peers
  } else {
    MOELINK_CHECK(rank_ < initial, "rank ", rank_, " is reserved (the group starts with ranks 0..", initial - 1,
                  "): join it with is_extension=True");
    transfer::storeBarrier(store, "worker/allocated", initial, opts_.timeout, transfer::kRefusedKey);
    checkChunkBytes(initial);
    coll_->open(active_);
    p2p_->open(active_);
    membership_->open(active_);
    transfer::storeBarrier(store, "worker/opened", initial, opts_.timeout, transfer::kRefusedKey);
    // A rank 0 that serves the store and exits as soon as the group is made waits for the ranks
    // still polling the release above; one whose process is gone is not waited for.
    transfer::storeLeaveHostLast(store, "worker/opened", rank_, initial, opts_.timeout, [this](int r) {
      try {
        return engine_.probe(r, std::chrono::milliseconds(200), 0);
      } catch (const std::exception&) {
        return std::string();  // not known to be gone: waited for
      }
    });
  }
  // Shared-memory names stay until shutdown (or exit): a process that replaces a failed rank
  // opens its peers' segments by name. A killed process's names are reclaimed by the
  // survivors when they forget it, or by the next process of the host that creates one.
  // Algorithm choices must agree across ranks, so they rest on facts every rank sees
  // alike: the transport mode and whether the group spans hosts.
  bool spans_hosts = false;
  int local_ranks = 0;  // the group's ranks on this host, whatever transport they use
  for (int p = 0; p < world_; ++p) {
    if (!active_[p]) continue;
    const bool here = engine_.hostIdOf(p) == engine_.hostId();
    spans_hosts |= !here;
    local_ranks += here;
  }
  bool tcp_group = engine_.transportMode() == "tcp" || spans_hosts;
  chain_broadcast_bytes_ = opts_.chain_broadcast_bytes >= 0
                               ? static_cast<uint64_t>(opts_.chain_broadcast_bytes)
                               : (spans_hosts ? (1u << 20) : 0);
  ring_allreduce_bytes_ = opts_.ring_allreduce_bytes >= 0 ? static_cast<uint64_t>(opts_.ring_allreduce_bytes)
                                                          : (tcp_group ? (4u << 20) : 0);
  reduce_piece_bytes_ = opts_.reduce_piece_bytes >= 0 ? static_cast<uint64_t>(opts_.reduce_piece_bytes)
                                                      : (tcp_group ? (256u << 10) : 0);
  live_ = active_;
  probed_loss_.assign(world_, 0);
  sends_.resize(world_);
  receiver_ = std::make_unique<P2PReceiver>(*p2p_, rank_, world_);
  abort_pending_.assign(world_, 0);
  p2p_sent_.assign(world_, 0);
  lost_.assign(world_, "");
  // MOELINK_WORKER_SPIN: pause-loop iterations before the worker sleeps on its doorbell.
  // Default: 256 when this host has a core for each of its ranks' workers, else 0:
  // spinning on an oversubscribed host steals the peers' time slices (whatever transport
  // the ranks use between them: forced tcp on one host shares its cores just the same).
  spin_ = static_cast<int>(
      settings::numberIfSet("MOELINK_WORKER_SPIN").value_or(settings::usableCores() >= local_ranks ? 256 : 0));
  gate_spin_ = microseconds(settings::numberIfSet("MOELINK_WORKER_GATE_SPIN_US")
                                .value_or(settings::usableCores() >= 2 * local_ranks ? 200 : 0));
  thread_ = std::thread([this] { loop(); });
}

namespace {
constexpr uint64_t kChunkBytes = 512 << 10;     // slots between ranks of one host (shared memory)
constexpr uint64_t kTcpChunkBytes = 2 << 20;    // slots of a group that uses tcp (docs/PERF.md)
const char* const kGroupChunkKey = "worker/chunk_bytes";
}  // namespace

uint64_t CollectiveWorker::chunkBytes(int initial) {
  if (opts_.extension) {
    // The group's segments are laid out already: a joining process takes their slot size.
    const std::string text = store_.get(kGroupChunkKey, opts_.timeout);
    const uint64_t group = transfer::parseCount(text, "the group's mailbox slot size");
    // The record sizes this process's segments: only a size that a group makes (a whole number of
    // cache lines within MOELINK_CHUNK_BYTES' range) is taken.
    const settings::Setting& range = settings::find("MOELINK_CHUNK_BYTES");
    MOELINK_CHECK(group >= range.min && group <= range.max && group == Mailbox::slotChunk(group),
                  "the group's mailbox slot size in the store, ", group, " bytes, is not one a group makes");
    MOELINK_CHECK(opts_.chunk_bytes == 0 || Mailbox::slotChunk(opts_.chunk_bytes) == group, "MOELINK_CHUNK_BYTES is ",
                  opts_.chunk_bytes, " in this process, but the group it joins uses slots of ", group,
                  " bytes (set it alike on every rank, or on none)");
    return group;
  }
  // Every first rank's engine has published its record (its host id) once all are here; a rank
  // that the group refused (another world size) ends the wait at once, as the later barriers do.
  transfer::storeBarrier(store_, "worker/engines", initial, opts_.timeout, transfer::kRefusedKey);
  uint64_t chunk = opts_.chunk_bytes;
  if (chunk == 0) {
    // Every rank sees the same transport mode and host ids: they decide alike.
    bool tcp = engine_.transportMode() == "tcp";
    for (int p = 0; p < initial && !tcp; ++p) tcp = engine_.hostIdOf(p) != engine_.hostId();
    chunk = tcp ? kTcpChunkBytes : kChunkBytes;
  }
  store_.set(str("worker/chunk/", rank_), std::to_string(chunk));
  return chunk;
}

void CollectiveWorker::checkChunkBytes(int initial) {
  const uint64_t mine = coll_->chunkBytes();
  for (int p = 0; p < initial; ++p) {
    if (p == rank_) continue;
    const std::string key = str("worker/chunk/", p);
    const uint64_t theirs = transfer::parseCount(store_.get(key, opts_.timeout), key);  // compared only
    MOELINK_CHECK(Mailbox::slotChunk(theirs) == mine, "rank ", p, " uses mailbox slots of ", Mailbox::slotChunk(theirs),
                  " bytes and this rank ", mine,
                  " (MOELINK_CHUNK_BYTES must be the same on every rank, or unset on all)");
  }
  store_.set(kGroupChunkKey, std::to_string(mine));
}

CollectiveWorker::~CollectiveWorker() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  engine_.ringLocal();
  if (thread_.joinable()) thread_.join();
  // Tell the peers this is a clean exit (the thread is gone: the unit is this thread's now).
  try {
    if (out_.empty()) membership_->announceLeave(completed_seq_, live_);
  } catch (const std::exception& e) {
    VLOG(1) << "moelink: rank " << rank_ << " could not announce its exit: " << e.what();
  }
  coll_->revokePulls();  // the ops below end here: their memory is the callers' again
  const std::string why = "the process group was shut down before this op finished";
  if (current_) current_->done(why);
  for (auto& c : queue_) c->done(why);
  for (auto& s : new_sends_) s->done(why);
  for (auto& r : new_recvs_) r->done(why, -1);
  for (auto& q : sends_)
    for (auto& s : q) s->done(why);
  receiver_->failAll(why);
}

bool CollectiveWorker::isActive(int rank) const {
  std::lock_guard<std::mutex> g(mu_);
  return rank >= 0 && rank < world_ && active_[rank];
}

std::vector<char> CollectiveWorker::mask() const {
  std::lock_guard<std::mutex> g(mu_);
  return active_;
}

std::string CollectiveWorker::outReason() const {
  std::lock_guard<std::mutex> g(mu_);
  return out_;
}

AlgoContext CollectiveWorker::context() const {
  AlgoContext c;
  c.me = rank_;
  c.chunk = coll_->chunkBytes();
  c.allreduce_small_bytes = opts_.allreduce_small_bytes;
  c.chain_broadcast_bytes = chain_broadcast_bytes_;
  c.ring_allreduce_bytes = ring_allreduce_bytes_;
  c.reduce_piece_min = reduce_piece_bytes_;
  c.reduce_pieces = coll_->depth();
  c.world = world_;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (int r = 0; r < world_; ++r)
      if (active_[r] || r == rank_) c.ranks.push_back(r);
  }
  // Which pairs pull (mailbox.h). A process that has just taken a rank says so as it opens
  // its mailbox, right after its admission: wait for that briefly rather than disagree.
  c.pull_chunk = opts_.pull_chunk_bytes;
  c.reads_me.assign(world_, 0);
  c.i_read.assign(world_, 0);
  const auto until = Clock::now() + seconds(5);
  for (int r : c.ranks) {
    if (r == rank_ || coll_->transportTo(r) != "shm") continue;
    while (!coll_->peerHasSaid(r) && Clock::now() < until) std::this_thread::sleep_for(microseconds(100));
    c.reads_me[r] = coll_->canPull(r);
    c.i_read[r] = coll_->readsFrom(r);
  }
  return c;
}

void CollectiveWorker::submit(OpSpec spec, OpCallback done, milliseconds timeout) {
  auto op = std::make_unique<Collective>();
  op->spec = std::move(spec);
  op->built = true;
  enqueue(std::move(op), std::move(done), timeout);
}

void CollectiveWorker::submit(OpBuilder build, OpCallback done, milliseconds timeout) {
  auto op = std::make_unique<Collective>();
  op->build = std::move(build);
  enqueue(std::move(op), std::move(done), timeout);
}

void CollectiveWorker::enqueue(std::unique_ptr<Collective> op, OpCallback done, milliseconds timeout) {
  op->done = std::move(done);
  op->timeout = timeout;
  {
    std::lock_guard<std::mutex> g(mu_);
    MOELINK_CHECK(!stop_, "the process group is shut down");
    op->seq = ++next_seq_;
    queue_.push_back(std::move(op));
  }
  engine_.ringLocal();
}

void CollectiveWorker::loop() {
  int idle = 0;
  Clock::time_point gated_since{};  // when the current wait on a gate began (unset: none is waited on)
  while (true) {
    // Read the bell before looking for work: a ring after this point ends the sleep below.
    uint32_t seen = engine_.doorbellValue();
    bool busy = false, progressed = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_) return;
      if (!current_ && !queue_.empty()) {
        current_ = std::move(queue_.front());
        queue_.pop_front();
      }
      while (!new_sends_.empty()) {
        auto s = std::move(new_sends_.front());
        new_sends_.pop_front();
        sends_[s->peer].push_back(std::move(s));
      }
      while (!new_recvs_.empty()) {
        receiver_->post(std::move(new_recvs_.front()));
        new_recvs_.pop_front();
      }
    }
    if (pollMembership()) progressed = true;
    if (current_ && !current_->built && !startCollective(*current_)) progressed = true;
    const bool holding = membership_->changing();  // a change is being agreed: collectives wait
    bool gated = false;  // an op waits for its data (no doorbell will ring for it)
    if (current_ && !current_->started && current_->spec.ready) {
      if (current_->spec.ready())
        current_->spec.ready = nullptr;
      else
        gated = busy = true;
    }
    for (int p = 0; p < world_ && !gated; ++p)
      gated = !sends_[p].empty() && sends_[p].front()->ready != nullptr;
    if (current_ && holding) busy = true;
    if (current_ && !current_->spec.ready && !holding) {
      busy = true;
      Collective& op = *current_;
      try {
        progressed |= op.draining ? progressDrain(op) : progressCollective(op);
      } catch (const std::exception& e) {
        failCollective(op, e.what());
        progressed = true;
      }
      if (current_ && !op.started) {  // the progress functions clear `started` when the op is over
        std::string err = op.error;
        finishCollective(op, err);
        progressed = true;
      }
    }
    // An op stopped at a step's gate (data being produced elsewhere) or at sends still in
    // flight (after_all_sends) is polled too.
    if (current_ && current_->started && current_->must_poll) gated = true;
    for (int p = 0; p < world_; ++p)
      if (!sends_[p].empty()) busy = true;
    if (receiver_->busy()) busy = true;
    if (busy) {
      progressed |= progressSends();
      progressed |= receiver_->progress(live_);
    }
    if (progressed) {
      idle = 0;
      gated_since = {};
      continue;
    }
    if (busy && ++idle < spin_) {
      cpuRelax();
      continue;
    }
    // Data that rings no doorbell (a GPU's copy, a send completing) comes within tens of
    // microseconds: spun on for gate_spin_, it is seen at once rather than after a timed sleep.
    if (gated && gate_spin_.count() > 0) {
      const auto now = Clock::now();
      if (gated_since == Clock::time_point{}) gated_since = now;
      if (now - gated_since < gate_spin_) {
        cpuRelax();
        continue;
      }
    } else {
      gated_since = {};  // the next wait on a gate gets its own spin
    }
    // Deadlines are checked at least every few milliseconds while work is pending.
    engine_.waitDoorbell(seen, gated ? microseconds(20) : busy ? microseconds(2000) : microseconds(100000));
  }
}

// ---- collectives ----

namespace {

void prepare(CollectiveWorker::Collective& op, int world, milliseconds timeout) {
  op.started = true;
  op.deadline = Clock::now() + timeout;
  op.sendq.assign(world, {});
  op.sendpos.assign(world, 0);
  op.pair_send.assign(world, 0);
  op.pair_recv.assign(world, 0);
  op.recv_msgs.assign(world, 0);
  op.recvq.assign(world, {});
  op.recvq_step.assign(world, {});
  op.land_asked.assign(world, {});
  op.gated_landings = false;
  op.gate_open.assign(op.spec.steps.size(), 0);
  op.sent_through = 0;
  op.recv_done.assign(world, 0);
  op.last_sent.assign(world, 0);
  op.last_seen.assign(world, 0);
  op.abort_sent.assign(world, 0);
  op.sends_issued.assign(op.spec.steps.size(), 0);
  op.step_batches.assign(op.spec.steps.size(), {});
  for (uint32_t s = 0; s < op.spec.steps.size(); ++s) {
    const Step& st = op.spec.steps[s];
    op.gate_open[s] = st.gate ? 0 : 1;
    for (uint32_t k = 0; k < st.sends.size(); ++k) {
      op.sendq[st.sends[k].peer].push_back({s, k});
      op.pair_send[st.sends[k].peer] += st.sends[k].bytes;
    }
    for (const auto& r : st.recvs) {
      op.pair_recv[r.peer] += r.bytes;
      op.recv_msgs[r.peer]++;
      op.recvq[r.peer].push_back(&r);
      op.recvq_step[r.peer].push_back(s);
      op.land_asked[r.peer].push_back(0);
      op.gated_landings |= st.gate && r.landing;
    }
  }
}

MsgHeader headerFor(const CollectiveWorker::Collective& op, int sender, uint64_t epoch) {
  MsgHeader h;
  h.kind = static_cast<uint8_t>(op.spec.kind);
  h.dtype = static_cast<uint8_t>(op.spec.dtype);
  h.redop = static_cast<uint8_t>(op.spec.redop);
  h.root = op.spec.root;
  h.op_seq = op.seq;
  h.op_bytes = op.spec.op_bytes;
  h.sender = sender;
  h.epoch = epoch;
  return h;
}

}  // namespace

ExpectedPiece CollectiveWorker::expectedPiece(const Collective& op, int peer, uint64_t bytes) const {
  ExpectedPiece want;
  want.op = {static_cast<uint8_t>(op.spec.kind), op.seq, op.spec.root, static_cast<uint8_t>(op.spec.dtype),
             static_cast<uint8_t>(op.spec.redop), op.spec.op_bytes};
  want.pair_bytes = op.pair_recv[peer];
  want.bytes = bytes;
  return want;
}

bool CollectiveWorker::anyPeerLost() {
  if (uint64_t n = engine_.losses(); n != losses_seen_) {
    losses_seen_ = n;
    any_lost_ = false;
    for (int p = 0; p < world_; ++p) {
      lost_[p] = engine_.lostReason(p);
      any_lost_ |= !lost_[p].empty();
    }
  }
  return any_lost_;
}

const std::string& CollectiveWorker::lostPeer(int peer) {
  anyPeerLost();
  return lost_[peer];
}

// The next message of op `seq` or later from `peer`, discarding leftovers of earlier ops.
const MsgHeader* CollectiveWorker::nextFresh(int peer, uint64_t seq) {
  const uint64_t epoch = membership_->epoch();
  while (const MsgHeader* h = coll_->peek(peer)) {
    // A message of a newer epoch waits until this rank has applied that change too.
    if (h->epoch > epoch) return nullptr;
    if (h->op_seq > seq || (h->op_seq == seq && h->epoch == epoch)) return h;
    VLOG(1) << "moelink: rank " << rank_ << " discards a leftover message of op #" << h->op_seq
            << " from rank " << peer;
    coll_->release(peer);
  }
  return nullptr;
}

// One pass over the op: sends what credit and data allow, consumes the steps whose messages
// are here, settles finished transfers, finishes the op, or looks at why it stalls. Each step
// that fails the op (failCollective) ends the pass; true when something happened.
bool CollectiveWorker::progressCollective(Collective& op) {
  op.must_poll = false;
  if (!op.started)
    startOp(op);
  else if (op.gated_landings)
    askLandings(op);
  bool progressed = sendPieces(op);
  if (!op.draining) progressed |= consumeSteps(op);
  if (!op.draining) settleTransfers(op);
  if (op.draining) return true;
  if (finishIfDone(op)) return true;
  if (progressed) {
    op.last_progress = Clock::now();
    return true;
  }
  return checkStall(op);
}

void CollectiveWorker::startOp(Collective& op) {
  prepare(op, world_, op.timeout);
  askLandings(op);  // this op's first messages
  VLOG(1) << "moelink: rank " << rank_ << " starts " << opKindName(op.spec.kind) << " #" << op.seq << " ("
          << op.spec.steps.size() << " steps)";
}

// Has the mailbox receive, straight at their landings, the messages of the op that are due
// next from each peer (the `depth` after the last one consumed: their slots' credits have gone
// out, or go out with the message consumed before them), once their steps' gates are open (the
// landing's memory is free then). Those whose gates open after the op started (the host
// route's pieces coming off the GPU one after another) are asked for as their gates open, on
// each pass, lest they land in their slots and be copied out. A message that has begun arriving
// when asked for lands in its slot as before. Only while no op has failed: a failed op can leave
// messages behind that would shift which message lands where.
void CollectiveWorker::askLandings(Collective& op) {
  if (had_failure_) return;
  for (int p = 0; p < world_; ++p) {
    const auto& q = op.recvq[p];
    const uint64_t head = op.recv_done[p], end = std::min<uint64_t>(q.size(), head + coll_->depth());
    for (uint64_t k = head; k < end; ++k) {
      if (!q[k]->landing || op.land_asked[p][k] || !gateOpen(op, op.recvq_step[p][k])) continue;
      coll_->landAhead(p, k - head, q[k]->landing, q[k]->bytes);
      op.land_asked[p][k] = 1;
    }
  }
}

// Whether step `s` may go on (Step::gate); a closed gate has the thread poll for it.
bool CollectiveWorker::gateOpen(Collective& op, size_t s) {
  if (op.gate_open[s]) return true;
  if (op.spec.steps[s].gate()) {
    op.gate_open[s] = 1;
    return true;
  }
  op.must_poll = true;
  return false;
}

// Sends, per peer in order, as far as mailbox credit and data readiness allow.
bool CollectiveWorker::sendPieces(Collective& op) {
  bool progressed = false;
  const auto& steps = op.spec.steps;
  for (int p = 0; p < world_; ++p) {
    auto& q = op.sendq[p];
    while (op.sendpos[p] < q.size()) {
      auto [s, k] = q[op.sendpos[p]];
      if (!gateOpen(op, s)) break;
      if (steps[s].send_after == Step::SendAfter::kAfterStep && op.next_step <= steps[s].after) break;
      if (steps[s].send_after == Step::SendAfter::kThisStep && op.next_step <= s) break;
      if (!coll_->canSend(p)) {
        if (std::string fault = coll_->creditFault(p); !fault.empty()) {
          failCollective(op, str(opKindName(op.spec.kind), " #", op.seq, ": ", fault));
          return true;
        }
        break;
      }
      const StepSend& snd = steps[s].sends[k];
      MsgHeader h = headerFor(op, rank_, membership_->epoch());
      h.pair_bytes = op.pair_send[p];
      h.bytes = snd.bytes;
      bool last = op.sendpos[p] + 1 == q.size();
      h.flags = (op.sendpos[p] == 0 ? kFirst : 0) | (last ? kLast : 0);
      // A piece larger than a slot is pulled (the pair pulls: AlgoContext::reads_me).
      const bool big = snd.bytes >= opts_.pull_min_bytes || snd.bytes > coll_->chunkBytes();
      auto batch = op.spec.pullable && big && coll_->canPull(p) ? coll_->sendPull(p, h, snd.data)
                                                                 : coll_->send(p, h, snd.data);
      op.step_batches[s].push_back(batch);
      op.inflight.push_back(std::move(batch));
      op.sends_issued[s]++;
      op.sendpos[p]++;
      if (last) op.last_sent[p] = 1;
      progressed = true;
    }
  }
  return progressed;
}

// Consumes steps in order once all of a step's messages are there.
bool CollectiveWorker::consumeSteps(Collective& op) {
  bool progressed = false;
  const auto& steps = op.spec.steps;
  std::vector<const char*> got;
  while (op.next_step < steps.size()) {
    const Step& st = steps[op.next_step];
    if (!gateOpen(op, op.next_step)) break;
    if (st.consume_after_sends) {
      if (op.sends_issued[op.next_step] < st.sends.size()) break;
      bool sent = true;
      for (auto& b : op.step_batches[op.next_step]) sent &= b->done();
      if (!sent) break;
    }
    if (st.after_all_sends) {
      while (op.sent_through < op.next_step) {
        const size_t k = op.sent_through;
        if (op.sends_issued[k] < steps[k].sends.size()) break;
        bool sent = true;
        for (auto& b : op.step_batches[k]) sent = sent && b->done();
        if (!sent) break;
        op.step_batches[k].clear();
        op.sent_through++;
      }
      if (op.sent_through < op.next_step) {
        op.must_poll = true;  // a completed write rings no doorbell
        break;
      }
    }
    got.clear();
    bool ready = true;
    // Every message of the step that is here is taken at once (a pulled one is read now,
    // so that its sender is free sooner), whether or not the others have come.
    for (const auto& r : st.recvs) {
      const MsgHeader* h = nextFresh(r.peer, op.seq);
      if (!h) {
        ready = false;
        continue;
      }
      std::string bad = checkCollectivePiece(*h, r.peer, expectedPiece(op, r.peer, r.bytes));
      if (!bad.empty()) {
        failCollective(op, bad);
        return true;
      }
      const char* data = coll_->payload(r.peer, &bad, r.landing, r.bytes);
      if (!data) {
        failCollective(op, str(opKindName(op.spec.kind), " #", op.seq, ": ", bad));
        return true;
      }
      got.push_back(data);
    }
    if (!ready) break;
    if (st.consume) st.consume(got);
    for (const auto& r : st.recvs) {
      if (coll_->peek(r.peer)->flags & kLast) op.last_seen[r.peer] = 1;
      // The credit lets the sender send this op's message `depth` places later: have it
      // received where it will end up, if the consumer only copies it.
      size_t later = op.recv_done[r.peer]++ + coll_->depth();
      const StepRecv* next = later < op.recvq[r.peer].size() ? op.recvq[r.peer][later] : nullptr;
      if (next && next->landing && gateOpen(op, op.recvq_step[r.peer][later])) {
        coll_->release(r.peer, next->landing, next->bytes);
        op.land_asked[r.peer][later] = 1;
      } else {
        coll_->release(r.peer);  // (a gated one is asked for once its gate opens: askLandings)
      }
    }
    // Its finished send batches go; the others stay for an after_all_sends step to wait on.
    auto& batches = op.step_batches[op.next_step];
    batches.erase(std::remove_if(batches.begin(), batches.end(), [](const auto& b) { return b->done(); }),
                  batches.end());
    op.next_step++;
    progressed = true;
  }
  return progressed;
}

// Transfers: a failure fails the op; finished ones are dropped.
void CollectiveWorker::settleTransfers(Collective& op) {
  coll_->pollPulls();
  for (size_t i = 0; i < op.inflight.size();) {
    if (op.inflight[i]->failed()) {
      // A write to a peer whose connection broke: the membership unit probes that peer and,
      // if it is dead, reruns or fails this op by agreement; a live one leaves it to the deadline.
      if (anyPeerLost()) {
        op.inflight[i] = std::move(op.inflight.back());
        op.inflight.pop_back();
        continue;
      }
      failCollective(op, str(opKindName(op.spec.kind), " #", op.seq, ": ", op.inflight[i]->error()));
      return;
    }
    if (op.inflight[i]->done()) {
      op.inflight[i] = std::move(op.inflight.back());
      op.inflight.pop_back();
    } else {
      ++i;
    }
  }
}

// Every step consumed, every piece sent and settled: the op ends (or fails, see below). True
// when it has.
bool CollectiveWorker::finishIfDone(Collective& op) {
  bool all_sent = true;
  for (int p = 0; p < world_; ++p) all_sent &= op.sendpos[p] == op.sendq[p].size();
  if (op.next_step < op.spec.steps.size() || !all_sent || !op.inflight.empty()) return false;
  // A peer that failed this op after sending its part left an ABORT behind it: then this
  // rank's result rests on an op that failed there, and it fails too (a late rank meets
  // the ABORT of a peer that timed out waiting for it).
  for (int p = 0; p < world_; ++p) {
    const MsgHeader* h = op.recv_msgs[p] ? coll_->peek(p) : nullptr;
    if (h && h->op_seq == op.seq && (h->flags & kAbort)) {
      coll_->release(p);
      failCollective(op, str(opKindName(op.spec.kind), " #", op.seq, ": rank ", p,
                             " gave up on this op after sending its part (it failed there, e.g. timed out "
                             "waiting for this rank)"));
      return true;
    }
  }
  if (op.spec.finish) op.spec.finish();
  op.started = false;  // tells the loop it is finished
  return true;
}

// Nothing moved: past the deadline the op fails; stalled 100 ms, or with a peer known gone, the
// peers it waits for are checked (a dead one starts a membership change, which reruns or fails
// the op). True when the op failed.
bool CollectiveWorker::checkStall(Collective& op) {
  const auto now = Clock::now();
  const bool late = now > op.deadline;
  const bool stalled = now - op.last_progress > milliseconds(100);
  if (!late && !stalled && !anyPeerLost()) return false;
  // On whom?
  std::vector<int> waiting;
  if (op.next_step < op.spec.steps.size())
    for (const auto& r : op.spec.steps[op.next_step].recvs)
      if (!coll_->peek(r.peer)) waiting.push_back(r.peer);
  for (int p = 0; p < world_; ++p)
    if (op.sendpos[p] < op.sendq[p].size() && !coll_->canSend(p)) waiting.push_back(p);
  // Everything received and sent, but writes not yet acknowledged: over a cut link the ack never
  // comes, and nothing is left to receive. The ranks this op writes to are checked then.
  if (waiting.empty() && !op.inflight.empty())
    for (int p = 0; p < world_; ++p)
      if (p != rank_ && !op.sendq[p].empty()) waiting.push_back(p);
  if (!late) {
    detect(op, waiting);
    return false;
  }
  for (int p : waiting)
    if (const std::string& lost = lostPeer(p); !lost.empty()) {
      failCollective(op, str(opKindName(op.spec.kind), " #", op.seq, ": rank ", p, " is gone (", lost, ")"));
      return true;
    }
  failCollective(op, describeTimeout(opKindName(op.spec.kind), op.seq, op.timeout, waiting));
  return true;
}

void CollectiveWorker::failCollective(Collective& op, const std::string& why) {
  if (op.draining) return;
  LOG(WARNING) << "moelink: rank " << rank_ << ": " << why;
  coll_->clearLandings();  // later messages of this op go to the slots and are discarded
  had_failure_ = true;
  op.error = why;
  op.draining = true;
  if (!op.started) prepare(op, world_, op.timeout);
  // Drain until the op's own deadline, and at least briefly (for ABORTs) when it has passed.
  op.drain_deadline = std::max(op.deadline, Clock::now() + milliseconds(200));
}

// After a failure: owe every send-peer an ABORT|LAST (also those that have had all their
// data: they fail the op when they find it behind that data), discard what recv-peers still
// send for this op, wait for our own writes to finish (they read the caller's memory).
bool CollectiveWorker::progressDrain(Collective& op) {
  bool progressed = false, pending = false;
  coll_->revokePulls();  // this op's data may change once it has failed
  for (int p = 0; p < world_; ++p) {
    if (!lostPeer(p).empty()) {  // gone: nothing to tell it, nothing more will come from it
      op.abort_sent[p] = op.last_sent[p] = op.last_seen[p] = 1;
      continue;
    }
    if (!op.sendq[p].empty() && !op.abort_sent[p]) {
      if (coll_->canSendControl(p)) {
        MsgHeader h = headerFor(op, rank_, membership_->epoch());
        h.flags = kAbort | kLast;
        h.pair_bytes = op.pair_send[p];
        op.inflight.push_back(coll_->send(p, h, nullptr));
        op.last_sent[p] = 1;
        op.abort_sent[p] = 1;
        progressed = true;
      } else {
        pending = true;
      }
    }
    while (op.recv_msgs[p] && !op.last_seen[p]) {
      const MsgHeader* h = nextFresh(p, op.seq);
      if (!h) {
        pending = true;
        break;
      }
      if (h->op_seq > op.seq) {  // the peer has moved on; nothing more for this op
        op.last_seen[p] = 1;
        break;
      }
      if (h->flags & kLast) op.last_seen[p] = 1;
      coll_->release(p);
      progressed = true;
    }
  }
  for (size_t i = 0; i < op.inflight.size();) {
    if (op.inflight[i]->done()) {
      op.inflight[i] = std::move(op.inflight.back());
      op.inflight.pop_back();
    } else {
      ++i;
    }
  }
  pending |= !op.inflight.empty();
  if (!pending || Clock::now() > op.drain_deadline) {
    op.started = false;
    return true;
  }
  return progressed;
}

}  // namespace moelink::collective
