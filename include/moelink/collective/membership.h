// Membership: which ranks of a group are active, changed by agreement when a peer fails.
//
// The collective worker consults this unit; it owns no thread. Every rank has a board
// (one registered segment): a slot per source rank that the source overwrites with its
// latest message, framed as a seqlock (version odd while being written), and rings the
// owner's doorbell. Messages are states, not a stream: a newer one replaces an older one.
//
// A change is a round that decides epoch E+1:
//   - A rank that finds a peer dead (a broken connection, a gone process, a failed
//     liveness probe after an op stalled; TransferEngine::probe) suspects it, stops
//     progressing collectives and REPORTs {completed op, current op, whether that op can
//     be run again, suspects} to the leader: the lowest rank of the mask it does not suspect.
//   - The leader checks the suspects with its own probe (a slow peer is never evicted: it
//     answers), QUERYs every other survivor, which stops too and reports, and once every
//     survivor has reported DECIDEs: the new mask, the epoch, and the last op that fails
//     (`fail_through`): ops up to the newest op any survivor completed keep their result
//     where they completed and fail where they did not (they cannot be run without the
//     lost rank on ranks that already finished them); the next op is run again over the
//     survivors by every rank that is in it, unless one of them had already combined part
//     of it in place (then it fails everywhere too). Every later op runs over the new mask.
//   - A leader that cannot reach a majority of the old mask (half counts when it holds the
//     old mask's lowest rank; ranks whose process is known to be gone do not count, as they
//     cannot be on the other side of a partition) sends OUT instead: its side leaves.
//   - A rank that suspects its leader probes it; a dead leader is suspected in turn.
//   - A rank that shuts down cleanly announces the last op it finished (LEAVE): its exit is
//     not a failure for ops up to that one.
// If the leader finds no suspect dead, it sends RESUME: the ranks go on as they were.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moelink/transfer/transfer_engine.h"

namespace moelink::collective {

// One slot of a board as its source writes it: this header, then one bit per rank (suspects,
// or the decided mask), padded to whole cache lines.
struct BoardMessage {
  enum Kind : uint32_t { kReport = 1, kQuery, kResume, kDecide, kOut, kLeave };
  uint64_t version = 0;  // seqlock: odd while the writer is in the middle
  uint32_t kind = 0;
  int32_t from = -1;
  uint64_t target = 0;  // the epoch the round decides
  uint64_t completed = 0;
  uint64_t current = 0;
  uint64_t fail_through = 0;
  uint32_t restartable = 0;
  uint32_t pad = 0;
  uint64_t reserved = 0;
};
static_assert(sizeof(BoardMessage) == 64, "a board message header is one cache line");

// Bytes of one board slot in a group of `world` ranks.
uint64_t boardSlotBytes(int world);
// Checks and decodes a copy of the slot that rank `src` writes on this rank's board: "" with
// *m and *bits (one entry per rank) filled, or why it cannot be a message of `src` in a group
// of `world` ranks whose epoch is `epoch` here (an unknown kind, another sender's name, bits
// beyond the group, an epoch out of reach, a decision that leaves out its own leader). The
// caller ignores such a slot: the board holds states, so the sender's next one replaces it.
std::string decodeBoardMessage(const char* slot, int src, int world, uint64_t epoch, BoardMessage* m,
                               std::vector<char>* bits);

struct MembershipOptions {
  // MOELINK_FAILURE_PROBE_MS: an op that makes no progress this long probes the peers it
  // waits for over tcp (same-host peers are checked through /proc after 100 ms).
  std::chrono::milliseconds probe_after{2000};
  std::chrono::milliseconds probe_timeout{1000};  // MOELINK_FAILURE_PROBE_TIMEOUT_MS
  bool raise = false;  // on_peer_failure="raise": the op in flight fails on every survivor
  static MembershipOptions fromEnv(bool raise);
};

// What the worker tells the unit about itself.
struct LocalProgress {
  uint64_t completed = 0;    // the newest collective finished here (seq)
  uint64_t current = 0;      // the collective in progress (0: none)
  bool restartable = true;   // whether `current` can be run again from its inputs
};

// A decision to apply.
struct MembershipChange {
  uint64_t epoch = 0;
  std::vector<char> mask;      // per rank: active
  std::vector<int> removed;    // ranks that left
  uint64_t fail_through = 0;   // unfinished ops with seq <= this fail
  bool resume = false;         // nothing changes; go on
  bool out = false;            // this rank's side lost the group
  std::string why;             // what was found
};

class Membership {
 public:
  Membership(transfer::TransferEngine& engine, MembershipOptions options);
  // Opens the boards of the ranks in `mask` (after every one has allocated its own).
  void open(const std::vector<char>& mask);
  // A replacement of `peer` has joined: clears its slot and opens its board.
  void reopen(int peer);

  // Any thread may read the epoch; the worker thread sets it.
  uint64_t epoch() const { return epoch_.load(std::memory_order_acquire); }
  void setEpoch(uint64_t e) { epoch_.store(e, std::memory_order_release); }
  bool changing() const { return round_ != 0; }
  const MembershipOptions& options() const { return opts_; }

  // This rank shuts down cleanly after op `completed`: tells the active peers, so that they do
  // not take its exit for a failure while they finish ops it has finished (best effort).
  void announceLeave(uint64_t completed, const std::vector<char>& mask);
  // The last op that `peer` finished before it left cleanly (0: it has not left, or finished
  // none): its exit is no failure for ops up to this one.
  uint64_t leftAfter(int peer) const { return left_[peer]; }
  // Whether `peer` left cleanly before op `seq` (it announced LEAVE after finishing an earlier
  // op): it takes no part in `seq`, whether its process still runs or not.
  bool leftBefore(int peer, uint64_t seq) const { return left_[peer] > 0 && left_[peer] < seq; }
  // `peer` is dead (as found by the caller; `certain`: its process is known to be gone, so
  // it cannot be on the other side of a partition); starts a round.
  void suspect(int peer, const std::string& why, bool certain);
  // Checks the peers an op has been waiting on for `stalled`; suspects the dead ones.
  void watch(const std::vector<int>& waiting, std::chrono::steady_clock::duration stalled,
             const std::vector<char>& mask);
  // Reads the board and advances a round; returns a decision once, when one is made.
  std::optional<MembershipChange> poll(const LocalProgress& me, const std::vector<char>& mask);

 private:
  using Msg = BoardMessage;
  void send(int to, const Msg& m, const std::vector<char>& bits);
  // The newest message in board slot `slot` (2 * source + 0 or 1), once; false when there is
  // none, it is being written, or it is malformed (logged).
  bool read(int slot, Msg& m, std::vector<char>& bits);
  int leader(const std::vector<char>& mask) const;
  // poll()'s steps (membership.cpp).
  std::optional<MembershipChange> readBoard(const std::vector<char>& mask);
  std::optional<MembershipChange> lead(const LocalProgress& me, const std::vector<char>& mask);
  std::optional<MembershipChange> decide(const std::vector<char>& mask);
  void follow(const LocalProgress& me, const std::vector<char>& mask);
  void endRound();
  std::string check(int peer);  // probe, remembered per round

  transfer::TransferEngine& engine_;
  MembershipOptions opts_;
  int rank_, world_;
  uint64_t slot_bytes_;
  char* board_ = nullptr;
  std::vector<uint64_t> seen_;        // per source: version read last
  std::vector<uint64_t> out_version_; // per destination
  std::vector<std::vector<char>> out_staging_;
  std::vector<transfer::BatchPtr> out_pending_;
  std::vector<char> opened_;

  std::atomic<uint64_t> epoch_{0};
  uint64_t round_ = 0;                  // the epoch being decided (0: none)
  std::vector<char> suspects_;          // per rank: found dead this round
  std::vector<std::string> why_;
  std::vector<char> alive_;             // per rank: probed alive this round
  std::vector<char> certain_;           // per rank: its process is known to be gone
  std::vector<uint64_t> left_;          // per rank: announced a clean exit after this op
  struct Report {
    bool have = false;
    LocalProgress p;
  };
  std::vector<Report> reports_;         // leader: per rank, this round
  std::chrono::steady_clock::time_point last_sent_{}, last_leader_probe_{};
  std::vector<std::chrono::steady_clock::time_point> last_probe_;  // per peer (stall watch)
  int reported_to_ = -1;
  uint64_t reported_sig_ = 0;
};

}  // namespace moelink::collective
