// The collective worker's side of membership: building ops over the active ranks, finding
// dead peers, applying agreed changes, readmitting replacement processes.
#include <glog/logging.h>

#include <algorithm>
#include <sstream>
#include <thread>

#include "moelink/collective/worker.h"
#include "moelink/common/error.h"
#include "moelink/transfer/records.h"
#include "worker_internal.h"

namespace moelink::collective {

using namespace std::chrono;

namespace {

std::string rankList(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

std::string maskText(const std::vector<char>& mask) {
  std::string s;
  for (char c : mask) s += c ? '1' : '0';
  return s;
}

}  // namespace

uint64_t CollectiveWorker::epoch() const { return membership_->epoch(); }

void CollectiveWorker::notifyChange() {
  std::vector<std::function<void()>> listeners;
  {
    std::lock_guard<std::mutex> g(mu_);
    listeners = on_change_;
  }
  for (auto& f : listeners) f();
}

// A replacement process: announce this incarnation, wait until the active ranks readmit it.
void CollectiveWorker::waitAdmission() {
  const int64_t inc = engine_.incarnation();
  store_.set(str("member/waiting/", rank_), std::to_string(inc));
  std::string rec;
  try {
    rec = store_.get(str("member/admit/", rank_, ".", inc), opts_.timeout);
  } catch (const std::exception& e) {
    MOELINK_THROW("rank ", rank_, " joined as an extension, but the group did not readmit it within ",
                  opts_.timeout.count(), " ms (the active ranks call moelink.recover_ranks([", rank_, "])): ",
                  e.what());
  }
  std::istringstream in(rec);
  std::string seq_text, epoch_text, bits, extra;
  in >> seq_text >> epoch_text >> bits >> extra;
  const uint64_t seq = transfer::parseCount(seq_text, "op number of the admission record");
  const uint64_t epoch = transfer::parseCount(epoch_text, "epoch of the admission record");
  MOELINK_CHECK(bits.size() == static_cast<size_t>(world_) && extra.empty() &&
                    bits.find_first_not_of("01") == std::string::npos && bits[rank_] == '1',
                "malformed admission record '", rec, "' (a mask of ", world_, " ranks that holds this rank)");
  for (int r = 0; r < world_; ++r) {
    active_[r] = bits[r] == '1';
    if (active_[r]) seen_incarnation_[r] = std::max<int64_t>(seen_incarnation_[r], 1);
  }
  next_seq_ = completed_seq_ = seq;
  membership_->setEpoch(epoch);
  coll_->open(active_);
  p2p_->open(active_);
  membership_->open(active_);
  LOG(INFO) << "moelink: rank " << rank_ << " (incarnation " << inc << ") readmitted at op #" << seq + 1
            << ", epoch " << epoch;
}

bool CollectiveWorker::peerWaiting(int rank) {
  MOELINK_CHECK(rank >= 0 && rank < world_, "rank ", rank, " is outside the group of size ", world_);
  if (rank == rank_) return true;
  const auto timeout = membership_->options().probe_timeout;
  const std::string key = str("member/waiting/", rank);
  if (store_.check(key)) {
    const int64_t inc = static_cast<int64_t>(transfer::parseCount(store_.get(key, opts_.timeout), key));
    if (inc > seen_incarnation_[rank]) return engine_.probe(rank, timeout, inc).empty();
  }
  // No newer process waits: an active rank counts while its process answers (one that died
  // before an op found it gone does not, so that a poll waits for its replacement).
  return isActive(rank) && engine_.probe(rank, timeout, 0).empty();
}

void CollectiveWorker::readmit(const std::vector<int>& ranks, OpCallback done, milliseconds timeout) {
  for (int r : ranks)
    MOELINK_CHECK(r >= 0 && r < world_ && r != rank_ && !isActive(r), "rank ", r, " cannot be readmitted (",
                  r == rank_ ? "it is this rank" : "it is active or outside the group", ")");
  submit(
      [this, ranks](const AlgoContext& c) {
        // Worker thread, at this op's start: the pairs with the new processes start afresh.
        std::vector<int64_t> incs;
        for (int r : ranks) {
          const std::string key = str("member/waiting/", r);
          const int64_t inc = static_cast<int64_t>(transfer::parseCount(store_.get(key, opts_.timeout), key));
          incs.push_back(inc);
          coll_->dropPeer(r);
          engine_.forgetPeer(r);
          coll_->resetPeer(r);
          p2p_->resetPeer(r);
          membership_->reopen(r);
          p2p_sent_[r] = 0;
          lost_[r].clear();
          abort_pending_[r] = 0;
          receiver_->resetPeer(r);
          probed_loss_[r] = 0;
        }
        OpSpec s = barrierOp(c);  // every active rank has reset its pairs before anyone goes on
        const bool leader = c.ranks.front() == c.me;
        s.finish = [this, ranks, incs, leader] {
          uint64_t seq = current_->seq;
          std::vector<char> m;
          {
            std::lock_guard<std::mutex> g(mu_);
            for (int r : ranks) active_[r] = 1;
            m = active_;
          }
          live_ = m;
          const uint64_t epoch = membership_->epoch() + 1;
          membership_->setEpoch(epoch);
          notifyChange();
          for (size_t i = 0; i < ranks.size(); ++i) {
            seen_incarnation_[ranks[i]] = incs[i];
            if (leader)
              store_.set(str("member/admit/", ranks[i], ".", incs[i]), str(seq, " ", epoch, " ", maskText(m)));
          }
          LOG(INFO) << "moelink: rank " << rank_ << " readmits rank(s) " << rankList(ranks) << " after op #" << seq;
        };
        return s;
      },
      std::move(done), timeout);
}

bool CollectiveWorker::startCollective(Collective& op) {
  std::string out = outReason();
  if (!out.empty()) {
    finishCollective(op, str(opKindName(op.spec.kind), " #", op.seq, ": this rank is out of the group: ", out));
    return false;
  }
  if (op.seq <= fail_through_) {
    finishCollective(op, str("op #", op.seq, ": ", fail_why_));
    return false;
  }
  if (op.build) {
    try {
      op.spec = op.build(context());
    } catch (const std::exception& e) {
      finishCollective(op, str("op #", op.seq, ": ", e.what()));
      return false;
    }
  }
  op.built = true;
  op.last_progress = Clock::now();
  return true;
}

void CollectiveWorker::finishCollective(Collective& op, const std::string& error) {
  if (!error.empty()) coll_->revokePulls();  // what peers have not read yet is the caller's again
  completed_seq_ = std::max(completed_seq_, op.seq);
  auto done = std::move(op.done);
  op_lost_ = op.lost;
  if (current_.get() == &op) current_.reset();
  if (done) done(error);
  op_lost_.clear();
}

void CollectiveWorker::watchPeers() {
  watch_requested_.store(true, std::memory_order_release);
  engine_.ringLocal();
}

void CollectiveWorker::onChange(std::function<void()> f) {
  std::lock_guard<std::mutex> g(mu_);
  on_change_.push_back(std::move(f));
}

bool CollectiveWorker::pollMembership() {
  // Out of the group: nothing is left to agree on, and the rest of the group (and the store
  // with it) may be out of reach, so nothing here may wait on them.
  if (is_out_) return false;
  const std::vector<char>& m = live_;  // the worker thread's copy: no lock on this hot path
  if (watch_requested_.exchange(false, std::memory_order_acq_rel)) {
    std::vector<int> peers;
    for (int p = 0; p < world_; ++p)
      if (m[p] && p != rank_) peers.push_back(p);
    membership_->watch(peers, hours(1), m);
  }
  LocalProgress me;
  me.completed = completed_seq_;
  if (current_) {
    me.current = current_->seq;
    const Collective& op = *current_;
    me.restartable = !op.built || !op.started ||
                     (op.build && !op.draining && !(op.spec.inplace && op.next_step > 0));
  }
  // The board first: a peer's LEAVE, written before its connections closed, is read before
  // the loss of those connections is looked at.
  if (auto change = membership_->poll(me, m)) {
    applyChange(*change);
    return true;
  }
  // A peer that left cleanly after op k is no failure while this rank finishes ops up to k.
  const uint64_t needed = current_ ? current_->seq : completed_seq_ + 1;
  if (anyPeerLost()) {
    for (int p = 0; p < world_; ++p)
      if (m[p] && !lost_[p].empty() && !probed_loss_[p] && membership_->leftAfter(p) < needed) {
        probed_loss_[p] = 1;
        bool certain = false;
        std::string why = engine_.probe(p, membership_->options().probe_timeout, 0, &certain);
        if (!why.empty()) membership_->suspect(p, str(lost_[p], "; ", why), certain);
      }
  }
  return false;
}

void CollectiveWorker::detect(Collective& op, const std::vector<int>& waiting) {
  std::vector<int> check;
  for (int p : waiting) {
    if (membership_->leftBefore(p, op.seq)) {  // gone for this op, even where its process lives on
      membership_->suspect(p, str("it left the group after op #", membership_->leftAfter(p)), true);
    } else if (membership_->leftAfter(p) < op.seq) {
      check.push_back(p);
    }
  }
  membership_->watch(check, Clock::now() - op.last_progress, mask());
}

void CollectiveWorker::applyChange(const MembershipChange& c) {
  if (c.resume) return;
  std::string why;
  if (c.out) {
    {
      std::lock_guard<std::mutex> g(mu_);
      out_ = c.why;
    }
    why = str("this rank is out of the group: ", c.why);
    LOG(WARNING) << "moelink: rank " << rank_ << ": " << why;
    fail_through_ = UINT64_MAX;
    fail_why_ = why;
    is_out_ = true;
  } else {
    {
      std::lock_guard<std::mutex> g(mu_);
      active_ = c.mask;
    }
    live_ = c.mask;
    membership_->setEpoch(c.epoch);
    why = str("rank(s) ", rankList(c.removed), " left the group while this op ran (", c.why, ")");
    if (c.fail_through > fail_through_) {
      fail_through_ = c.fail_through;
      fail_why_ = str(why, "; the op cannot be completed over the remaining ranks (it had finished on some of them, "
                           "had combined part of its result in place, or on_peer_failure is 'raise')");
    }
    LOG(WARNING) << "moelink: rank " << rank_ << " now in epoch " << c.epoch << " with ranks "
                 << maskText(c.mask) << ": " << why;
  }
  coll_->clearLandings();
  had_failure_ = true;
  // Drop what is still queued for the ranks that left: a tcp connection over a cut link keeps
  // its frames, which point into the callers' memory, until it is closed.
  // (A rank that is out of the group keeps its connections until its group is destroyed.)
  for (int p : c.removed) {
    coll_->revokePulls(p);
    coll_->dropPeer(p);
    engine_.forgetPeer(p);
  }
  if (current_ && current_->built) {
    // The op's own writes read its buffers: let them settle (those to the ranks that left fail
    // as their connections close) before the op is failed or rerun.
    const auto until = Clock::now() + seconds(2);
    for (auto& b : current_->inflight)
      while (!b->done() && Clock::now() < until) {
        std::this_thread::sleep_for(microseconds(50));
        coll_->pollPulls();
      }
    coll_->revokePulls();  // the op is failed or rerun from its inputs: unread data is withdrawn
  }
  notifyChange();
  for (int p = 0; p < world_; ++p)
    if (!c.out ? std::find(c.removed.begin(), c.removed.end(), p) != c.removed.end() : p != rank_)
      failPeerP2P(p, c.out ? why : str("rank ", p, " left the group (", c.why, ")"));
  if (!current_ || !current_->built) return;
  Collective& op = *current_;
  if (op.seq <= fail_through_ || !op.build) {
    finishCollective(op, str(opKindName(op.spec.kind), " #", op.seq, ": ", op.seq <= fail_through_ ? fail_why_ : why));
    return;
  }
  // Run it again over the survivors, under the new epoch.
  for (int r : c.removed) op.lost.push_back(r);
  op.started = false;
  op.draining = false;
  op.error.clear();
  op.next_step = 0;
  op.inflight.clear();
  if (!startCollective(op)) return;
  VLOG(1) << "moelink: rank " << rank_ << " reruns op #" << op.seq << " over the survivors";
}

}  // namespace moelink::collective
