#include "moelink/collective/membership.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include <glog/logging.h>

#include "moelink/common/settings.h"
#include "moelink/common/error.h"

namespace moelink::collective {

using namespace std::chrono;
using Clock = steady_clock;

namespace {

constexpr transfer::SegmentId kBoardSegment = 3;

using Kind = BoardMessage::Kind;
constexpr Kind kReport = BoardMessage::kReport, kQuery = BoardMessage::kQuery, kResume = BoardMessage::kResume,
               kDecide = BoardMessage::kDecide, kOut = BoardMessage::kOut, kLeave = BoardMessage::kLeave;

}  // namespace

uint64_t boardSlotBytes(int world) { return sizeof(BoardMessage) + (static_cast<uint64_t>(world) + 63) / 64 * 64; }

std::string decodeBoardMessage(const char* slot, int src, int world, uint64_t epoch, BoardMessage* m,
                               std::vector<char>* bits) {
  std::memcpy(m, slot, sizeof *m);
  if (m->kind < kReport || m->kind > kLeave) return str("unknown message kind ", m->kind);
  if (m->from != src) return str("a message in rank ", src, "'s slot names rank ", m->from, " as its sender");
  // Rounds decide the next epoch; a newer one can only come from ranks that applied decisions
  // this rank has not read yet, one per rank at most.
  if (m->kind != kLeave && m->target > epoch + static_cast<uint64_t>(world))
    return str("epoch ", m->target, " is out of reach of this rank's epoch ", epoch);
  if (m->restartable > 1) return str("restartable field ", m->restartable);
  const char* b = slot + sizeof *m;
  const uint64_t bit_bytes = boardSlotBytes(world) - sizeof *m;
  bits->assign(world, 0);
  for (uint64_t i = 0; i < bit_bytes; ++i)
    for (int k = 0; k < 8; ++k) {
      if (!((static_cast<unsigned char>(b[i]) >> k) & 1)) continue;
      const uint64_t r = i * 8 + k;
      if (r >= static_cast<uint64_t>(world)) return str("rank bit ", r, " beyond the group of ", world);
      (*bits)[r] = 1;
    }
  if (m->kind == kDecide && !(*bits)[src]) return str("a decision by rank ", src, " that leaves rank ", src, " out");
  return "";
}

MembershipOptions MembershipOptions::fromEnv(bool raise) {
  MembershipOptions o;
  o.probe_after = milliseconds(settings::number("MOELINK_FAILURE_PROBE_MS"));
  o.probe_timeout = milliseconds(settings::number("MOELINK_FAILURE_PROBE_TIMEOUT_MS"));
  o.raise = raise;
  return o;
}

Membership::Membership(transfer::TransferEngine& engine, MembershipOptions options)
    : engine_(engine), opts_(options), rank_(engine.rank()), world_(engine.worldSize()) {
  slot_bytes_ = boardSlotBytes(world_);
  // Two slots per source: [0] reports and queries, [1] decisions (so a decision is never
  // overwritten by the next round's query before it is read).
  board_ = static_cast<char*>(engine_.allocateSegment(kBoardSegment, slot_bytes_ * 2 * world_));
  seen_.assign(2 * world_, 0);
  out_version_.assign(2 * world_, 0);
  out_staging_.assign(2 * world_, std::vector<char>(slot_bytes_ + 16));
  out_pending_.assign(2 * world_, nullptr);
  opened_.assign(world_, 0);
  suspects_.assign(world_, 0);
  alive_.assign(world_, 0);
  certain_.assign(world_, 0);
  left_.assign(world_, 0);
  why_.assign(world_, "");
  reports_.assign(world_, {});
  last_probe_.assign(world_, Clock::time_point{});
}

void Membership::open(const std::vector<char>& mask) {
  for (int p = 0; p < world_; ++p)
    if (mask[p] && p != rank_ && !opened_[p]) {
      engine_.openSegment(p, kBoardSegment);
      opened_[p] = 1;
    }
}

void Membership::reopen(int peer) {
  for (int k = 0; k < 2; ++k) {
    std::memset(board_ + (2 * peer + k) * slot_bytes_, 0, slot_bytes_);
    seen_[2 * peer + k] = 0;
    out_version_[2 * peer + k] = 0;
    out_pending_[2 * peer + k] = nullptr;
  }
  left_[peer] = 0;
  engine_.openSegment(peer, kBoardSegment);
  opened_[peer] = 1;
}

void Membership::announceLeave(uint64_t completed, const std::vector<char>& mask) {
  Msg m;
  m.kind = kLeave;
  m.completed = completed;
  std::vector<char> none(world_, 0);
  for (int p = 0; p < world_; ++p)
    if (mask[p] && p != rank_) send(p, m, none);
  for (auto& b : out_pending_)
    if (b) b->wait(milliseconds(200));  // tcp: let the messages leave before the engine closes
}

void Membership::send(int to, const Msg& m, const std::vector<char>& bits) {
  if (!opened_[to]) return;
  const int slot = 2 * rank_ + ((m.kind == kDecide || m.kind == kOut) ? 1 : 0);  // in the receiver's board
  const int k = 2 * to + (slot & 1);
  if (out_pending_[k] && !out_pending_[k]->done()) {
    // The last write to this slot is still under way (tcp): wait for it briefly; a state
    // message that cannot go now goes with the next poll.
    if (!out_pending_[k]->wait(milliseconds(50))) return;
  }
  auto& buf = out_staging_[k];
  uint64_t v = out_version_[k] + 2;
  out_version_[k] = v;
  Msg copy = m;
  copy.from = rank_;
  copy.version = v;
  std::memcpy(buf.data(), &copy, sizeof copy);
  std::memset(buf.data() + sizeof copy, 0, slot_bytes_ - sizeof copy);
  for (int r = 0; r < world_; ++r)
    if (bits[r]) buf[sizeof copy + r / 8] |= static_cast<char>(1 << (r % 8));
  uint64_t odd = v - 1;
  std::memcpy(buf.data() + slot_bytes_, &odd, 8);
  const uint64_t base = static_cast<uint64_t>(slot) * slot_bytes_;
  std::vector<transfer::TransferRequest> reqs(3);
  reqs[0] = {transfer::Opcode::kWrite, buf.data() + slot_bytes_, to, kBoardSegment, base, 8, false};
  reqs[1] = {transfer::Opcode::kWrite, buf.data() + 8, to, kBoardSegment, base + 8, slot_bytes_ - 8, false};
  reqs[2] = {transfer::Opcode::kWrite, buf.data(), to, kBoardSegment, base, 8, true};
  out_pending_[k] = engine_.submit(reqs);
}

bool Membership::read(int slot, Msg& m, std::vector<char>& bits) {
  const char* p = board_ + static_cast<uint64_t>(slot) * slot_bytes_;
  const auto* ver = reinterpret_cast<const uint64_t*>(p);
  uint64_t v1 = __atomic_load_n(ver, __ATOMIC_ACQUIRE);
  if ((v1 & 1) || v1 == seen_[slot]) return false;
  std::vector<char> raw(slot_bytes_);
  std::memcpy(raw.data(), p, slot_bytes_);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (__atomic_load_n(ver, __ATOMIC_ACQUIRE) != v1) return false;  // rewritten meanwhile: next poll
  seen_[slot] = v1;
  const int src = slot / 2;
  if (std::string why = decodeBoardMessage(raw.data(), src, world_, epoch_, &m, &bits); !why.empty()) {
    LOG(WARNING) << "moelink: rank " << rank_ << " ignores a malformed membership message from rank " << src << ": "
                 << why;
    return false;
  }
  return true;
}

int Membership::leader(const std::vector<char>& mask) const {
  for (int r = 0; r < world_; ++r)
    if (mask[r] && !suspects_[r]) return r;
  return rank_;
}

std::string Membership::check(int peer) {
  bool certain = false;
  std::string why = engine_.probe(peer, opts_.probe_timeout, 0, &certain);
  if (!why.empty()) {
    suspects_[peer] = 1;
    why_[peer] = why;
    certain_[peer] = certain;
  }
  return why;
}

void Membership::suspect(int peer, const std::string& why, bool certain) {
  if (peer == rank_ || suspects_[peer]) return;
  LOG(WARNING) << "moelink: rank " << rank_ << " finds rank " << peer << " gone: " << why;
  suspects_[peer] = 1;
  why_[peer] = why;
  certain_[peer] = certain;
  if (!round_) round_ = epoch_ + 1;
}

void Membership::watch(const std::vector<int>& waiting, Clock::duration stalled, const std::vector<char>& mask) {
  if (stalled < milliseconds(100)) return;
  auto now = Clock::now();
  for (int p : waiting) {
    if (p == rank_ || !mask[p] || suspects_[p]) continue;
    if (now - last_probe_[p] < milliseconds(100)) continue;
    const bool local = engine_.hostIdOf(p) == engine_.hostId();
    if (!local && (stalled < opts_.probe_after || now - last_probe_[p] < opts_.probe_after)) continue;
    last_probe_[p] = now;
    bool certain = false;
    std::string why = engine_.probe(p, opts_.probe_timeout, 0, &certain);
    if (!why.empty()) suspect(p, why, certain);
  }
}

std::optional<MembershipChange> Membership::poll(const LocalProgress& me, const std::vector<char>& mask) {
  if (auto decided = readBoard(mask)) {
    endRound();
    return decided;
  }
  if (!round_) return std::nullopt;
  if (leader(mask) == rank_) return lead(me, mask);
  follow(me, mask);
  return std::nullopt;
}

void Membership::endRound() {
  round_ = 0;
  std::fill(suspects_.begin(), suspects_.end(), 0);
  std::fill(alive_.begin(), alive_.end(), 0);
  std::fill(certain_.begin(), certain_.end(), 0);
  std::fill(why_.begin(), why_.end(), "");
  reports_.assign(world_, {});
  reported_to_ = -1;
}

// Every new message on the board: a decision (returned), a peer's clean exit, a query or a
// report of the round under way.
std::optional<MembershipChange> Membership::readBoard(const std::vector<char>& mask) {
  Msg m;
  std::vector<char> bits;
  std::optional<MembershipChange> decided;
  for (int src = 0; src < world_ && !decided; ++src) {
    if (src == rank_ || !mask[src]) continue;
    if (read(2 * src + 1, m, bits) && m.target > epoch_) {  // a decision
      MembershipChange c;
      c.epoch = m.target;
      if (m.kind == kOut) {
        c.out = true;
        c.why = str("rank ", src, " found that its side of the group lost the majority of it");
      } else if (!bits[rank_]) {  // the leader could not reach this rank: it is out
        c.out = true;
        c.why = str("rank ", src, " (the leader) could not reach this rank and decided the group goes on without it");
      } else {
        c.mask = bits;
        c.fail_through = m.fail_through;
        for (int r = 0; r < world_; ++r)
          if (mask[r] && !bits[r]) c.removed.push_back(r);
        c.why = str("decided by rank ", src);
      }
      decided = c;
      break;
    }
    if (!read(2 * src, m, bits)) continue;
    if (m.kind == kLeave) {
      left_[src] = m.completed;  // (0: it left before finishing any op, which counts as not left)
      continue;
    }
    if (m.kind == kResume) {
      if (round_ && m.target == round_) {
        MembershipChange c;
        c.resume = true;
        c.epoch = epoch_;
        decided = c;
      }
      continue;
    }
    if (m.target <= epoch_) continue;  // about a round that is over
    if (round_ && m.target > round_) reports_.assign(world_, {});  // a newer round: older reports do not count
    if (!round_ || m.target > round_) round_ = m.target;
    if (m.kind == kQuery) {
      for (int r = 0; r < world_; ++r)
        if (bits[r] && !suspects_[r]) {
          suspects_[r] = 1;
          why_[r] = str("found gone by rank ", src);
        }
      reported_to_ = -1;  // report (again) to the querying leader
    } else if (m.kind == kReport && m.target == round_) {
      reports_[src].have = true;
      reports_[src].p = {m.completed, m.current, m.restartable != 0};
      for (int r = 0; r < world_; ++r)
        if (bits[r] && mask[r] && r != rank_ && !suspects_[r] && !alive_[r]) {
          // A peer's suspicion: checked here before it counts (a slow rank is not evicted).
          if (check(r).empty()) alive_[r] = 1;
        }
    }
  }
  return decided;
}

// The leader of a round: once every survivor has reported, decides (RESUME, OUT or the new
// mask and the ops that fail); until then queries the silent ones and probes them.
std::optional<MembershipChange> Membership::lead(const LocalProgress& me, const std::vector<char>& mask) {
  auto now = Clock::now();
  reports_[rank_].have = true;
  reports_[rank_].p = me;
  bool all = true;
  for (int r = 0; r < world_; ++r) {
    if (!mask[r] || suspects_[r] || r == rank_) continue;
    if (!reports_[r].have) all = false;
  }
  if (!all) {
    if (now - last_sent_ > milliseconds(200)) {
      Msg q;
      q.kind = kQuery;
      q.target = round_;
      for (int r = 0; r < world_; ++r)
        if (mask[r] && !suspects_[r] && r != rank_ && !reports_[r].have) send(r, q, suspects_);
      // A survivor that does not answer in a while is probed like any stalled peer.
      for (int r = 0; r < world_; ++r)
        if (mask[r] && !suspects_[r] && r != rank_ && !reports_[r].have &&
            now - last_probe_[r] > opts_.probe_after) {
          last_probe_[r] = now;
          check(r);
        }
      last_sent_ = now;
    }
    return std::nullopt;
  }
  return decide(mask);
}

// Every survivor has reported: RESUME when no suspect is dead, OUT when this side holds no
// majority of the old mask, else the new mask and the last op that fails; sent to the
// survivors and returned.
std::optional<MembershipChange> Membership::decide(const std::vector<char>& mask) {
  MembershipChange c;
  std::vector<char> survivors(world_, 0);
  int old_n = 0, new_n = 0, lowest = -1;
  for (int r = 0; r < world_; ++r) {
    if (!mask[r]) continue;
    if (lowest < 0) lowest = r;
    if (!certain_[r]) old_n++;
    if (suspects_[r]) {
      c.removed.push_back(r);
    } else {
      survivors[r] = 1;
      new_n++;
    }
  }
  std::string found;
  for (int r : c.removed) found += str(found.empty() ? "" : "; ", "rank ", r, ": ", why_[r]);
  Msg d;
  d.target = round_;
  if (c.removed.empty()) {
    d.kind = kResume;
    for (int r = 0; r < world_; ++r)
      if (survivors[r] && r != rank_) send(r, d, survivors);
    c.resume = true;
    c.epoch = epoch_;
    endRound();
    return c;
  }
  c.epoch = round_;
  if (2 * new_n < old_n || (2 * new_n == old_n && !survivors[lowest] && !certain_[lowest])) {
    d.kind = kOut;
    for (int r = 0; r < world_; ++r)
      if (survivors[r] && r != rank_) send(r, d, survivors);
    c.out = true;
    c.why = str("this rank's side of the group (", new_n, " of ", old_n,
                " ranks) lost contact with the rest (", found, ")");
    endRound();
    return c;
  }
  uint64_t newest = 0;
  for (int r = 0; r < world_; ++r)
    if (survivors[r]) newest = std::max(newest, reports_[r].p.completed);
  uint64_t fail_through = newest;
  for (int r = 0; r < world_; ++r)
    if (survivors[r] && reports_[r].p.current == newest + 1 && !reports_[r].p.restartable) fail_through = newest + 1;
  if (opts_.raise) fail_through = newest + 1;
  d.kind = kDecide;
  d.fail_through = fail_through;
  for (int r = 0; r < world_; ++r)
    if (survivors[r] && r != rank_) send(r, d, survivors);
  c.mask = survivors;
  c.fail_through = fail_through;
  c.why = found;
  LOG(WARNING) << "moelink: rank " << rank_ << " (leader) decides epoch " << c.epoch << ": " << new_n << " of "
               << new_n + c.removed.size() << " ranks stay; ops up to #" << fail_through << " that are unfinished fail (" << found
               << ")";
  endRound();
  return c;
}

// A member of a round: reports to the leader (again when something changed, and now and
// then), and checks that the leader lives.
void Membership::follow(const LocalProgress& me, const std::vector<char>& mask) {
  auto now = Clock::now();
  const int lead = leader(mask);
  uint64_t sig = me.completed * 1000003 + me.current * 31 + me.restartable;
  for (int r = 0; r < world_; ++r) sig = sig * 131 + suspects_[r];
  if (lead != reported_to_ || sig != reported_sig_ || now - last_sent_ > milliseconds(500)) {
    Msg rep;
    rep.kind = kReport;
    rep.target = round_;
    rep.completed = me.completed;
    rep.current = me.current;
    rep.restartable = me.restartable ? 1 : 0;
    send(lead, rep, suspects_);
    reported_to_ = lead;
    reported_sig_ = sig;
    last_sent_ = now;
  }
  if (now - last_leader_probe_ > opts_.probe_after) {
    last_leader_probe_ = now;
    if (!check(lead).empty())
      LOG(WARNING) << "moelink: rank " << rank_ << " finds its leader, rank " << lead << ", gone: " << why_[lead];
  }
}

}  // namespace moelink::collective
