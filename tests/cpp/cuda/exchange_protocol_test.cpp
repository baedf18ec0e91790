// The exchange kernel's protocol across ops (src/cuda/kernels/exchange.cu), run on the
// CPU: ranks run long sequences of ops against each other's staging areas, one step at a time
// in a random order, with ops of no, one and several rounds, ops whose header check fails on
// some ranks, and waits that time out. The model follows the kernel's rules (header slots by
// op parity, halves by exchangeHalf, pushes before the headers by exchangePushesEarly, round
// tags, acknowledgements before a half is reused within an op) and checks that a push never
// overwrites data that its reader may still read, and that every read finds the data of its
// own op and round. (exchange_pieces_test.cpp: the protocol within one op, block by block.)
#include <cstdint>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "moelink/cuda/exchange.h"

using namespace moelink::collective;
using namespace moelink::cuda;

namespace {

constexpr int kMaxN = 4;

uint64_t tagOf(uint64_t seq, int r) { return (seq << 24) | static_cast<uint64_t>(r + 1); }

struct Slot {  // one source's data in one half of a staging area
  uint64_t seq = 0;
  int round = -1;
  bool consumed = true;
};

struct Area {  // one rank's staging area
  uint64_t header[2][kMaxN] = {};  // [op parity][source]: the source's op number
  uint64_t flag[2][kMaxN] = {};    // [half][source]
  uint64_t ack[2][kMaxN] = {};     // [half][consumer]
  Slot data[2][kMaxN];             // [half][source]
  Slot lines[2][kMaxN];            // [op parity][source]: a Lamport op's lines (round 0)
};

struct Op {
  int rounds;               // of every pair (0: nothing to move)
  std::vector<bool> fails;  // per rank: its header check fails (a disagreement it sees)
  bool lamport = false;     // the Lamport kernel (lamport.cu): lines, no flags or acks
};

struct Rank {
  uint64_t done = 0;       // ops ended (the kernel's Counter::seq)
  uint64_t single_ok = 0;  // Counter::single_ok
  uint64_t any_ok = 0;     // Counter::any_ok
  int phase = 0;           // 0: start the op, 1: wait for the headers, 2: rounds
  bool early = false;
  int round = 0;
  bool pushed = false;     // this round's pushes are done
  int early_ops = 0;       // ops that pushed before their headers (the test wants some)
};

// exchangePushesEarly's signature: (seq, single_ok, one_round, roles).
using EarlyRule = std::function<bool(uint64_t, uint64_t, bool, int)>;
// When a Lamport op writes its lines: kind of lamport.cu (at once after an op that succeeded,
// else once every peer's header of this op is in), or at once whatever came before.
enum class LinesRule { kAfterSuccess, kAlways };

class Protocol {
 public:
  Protocol(int n, std::vector<Op> ops, uint32_t seed, EarlyRule rule = exchangePushesEarly,
           LinesRule lines = LinesRule::kAfterSuccess)
      : n_(n), ops_(std::move(ops)), rng_(seed), rule_(std::move(rule)), lines_rule_(lines), areas_(n), ranks_(n) {}
  // The first broken guarantee ("" when none).
  const std::string& violation() const { return violation_; }

  // Lamport ops that ended with their lines read (the test wants some).
  int lamportOps() const { return lamport_ops_; }

  void run() {
    const uint64_t total = ops_.size();
    for (uint64_t steps = 0; steps < 100000000; ++steps) {
      bool finished = true;
      for (auto& k : ranks_) finished &= k.done == total;
      if (finished) return;
      int me = static_cast<int>(rng_() % n_);
      if (ranks_[me].done == total) continue;
      if (!step(me)) {
        // Blocked: a wait with a deadline ends the op now and then, and always when every
        // unfinished rank is blocked (a real group would hang until its time-out).
        bool all_blocked = true;
        for (int q = 0; q < n_ && all_blocked; ++q)
          if (ranks_[q].done < total) all_blocked = !canStep(q);
        if (all_blocked || rng_() % 64 == 0) end(me, false);
      }
      if (!violation_.empty()) return;
    }
    violation_ = "the model did not finish";
  }
  int earlyOps() const {
    int e = 0;
    for (const auto& k : ranks_) e += k.early_ops;
    return e;
  }

 private:
  uint64_t current(int me) const { return ranks_[me].done + 1; }
  const Op& op(int me) const { return ops_[current(me) - 1]; }

  // Whether step(me) would do something (a dry run of its waits).
  bool canStep(int me) {
    std::vector<Area> areas = areas_;
    std::vector<Rank> ranks = ranks_;
    std::string violation = violation_;
    bool ok = step(me);
    areas_ = std::move(areas);
    ranks_ = std::move(ranks);
    violation_ = std::move(violation);
    return ok;
  }

  // One step of rank `me`; false when it waits.
  bool step(int me) {
    Rank& k = ranks_[me];
    const uint64_t s = current(me);
    const Op& o = op(me);
    if (o.lamport) return lamportStep(me);
    if (k.phase == 0) {
      for (int p = 0; p < n_; ++p)
        if (p != me) areas_[p].header[s & 1][me] = s;
      k.early = rule_(s, k.single_ok, o.rounds <= 1, 1);
      k.pushed = false;
      if (k.early && o.rounds >= 1) {
        push(me, 0);
        k.pushed = true;
        k.early_ops++;
      }
      k.phase = 1;
      return true;
    }
    if (k.phase == 1) {
      bool ahead = false;
      for (int q = 0; q < n_; ++q) {
        if (q == me) continue;
        const uint64_t h = areas_[me].header[s & 1][q];
        if (h > s) ahead = true;  // the kernel's kAhead
        else if (h < s) return false;
      }
      if (ahead || o.fails[me]) {
        end(me, false);
        return true;
      }
      k.phase = 2;
      k.round = 0;
      if (o.rounds == 0) end(me, true);
      return true;
    }
    const int r = k.round;
    const int half = exchangeHalf(s, r);
    if (!k.pushed) {
      if (r >= 2)
        for (int p = 0; p < n_; ++p)
          if (p != me && areas_[me].ack[half][p] < tagOf(s, r - 2)) return false;
      push(me, r);
      k.pushed = true;
      return true;
    }
    for (int q = 0; q < n_; ++q)
      if (q != me && areas_[me].flag[half][q] < tagOf(s, r)) return false;
    for (int q = 0; q < n_; ++q) {
      if (q == me) continue;
      Slot& d = areas_[me].data[half][q];
      if (!(d.seq == s && d.round == r && !d.consumed))
        report() << "rank " << me << " op " << s << " round " << r << " reads from rank " << q << " data of op "
                 << d.seq << " round " << d.round << (d.consumed ? " (consumed)" : "");
      d.consumed = true;
      areas_[q].ack[half][me] = tagOf(s, r);
    }
    k.round++;
    k.pushed = false;
    if (k.round == o.rounds) end(me, true);
    return true;
  }

  // The Lamport kernel: the extra block writes the header slots, the data blocks push every
  // peer's lines at once (parity s & 1), then read every peer's lines of op s; a disagreement
  // ends the op as soon as the lines of the peer it concerns are in (or earlier: the model ends
  // it at once, which lets the other peers' reads of an earlier op lag the furthest).
  bool lamportStep(int me) {
    const uint64_t s = current(me);
    const Op& o = op(me);
    Rank& k = ranks_[me];
    const int parity = static_cast<int>(s & 1);
    if (k.phase == 0) {
      for (int p = 0; p < n_; ++p)
        if (p != me) areas_[p].header[parity][me] = s;
      k.phase = 1;
      return true;
    }
    if (k.phase == 1) {
      // linesEarly, else awaitPeersStarted (lamport.cu)
      if (!(lines_rule_ == LinesRule::kAlways || k.any_ok == s - 1))
        for (int q = 0; q < n_; ++q)
          if (q != me && areas_[me].header[parity][q] < s) return false;
      for (int p = 0; p < n_; ++p) {
        if (p == me) continue;
        Slot& d = areas_[p].lines[parity][me];
        if (!(d.consumed || ranks_[p].done >= d.seq))
          report() << "rank " << me << " Lamport op " << s << " overwrites rank " << p << "'s unread lines of op "
                   << d.seq << " (rank " << p << " has ended op " << ranks_[p].done << ")";
        d = {s, 0, false};
      }
      k.phase = 2;
      return true;
    }
    if (o.fails[me]) {
      end(me, false);
      return true;
    }
    for (int q = 0; q < n_; ++q) {
      if (q == me) continue;
      const Slot& d = areas_[me].lines[parity][q];
      if (d.seq == s) continue;
      if (areas_[me].header[parity][q] > s) {  // the header slot watch: kAhead
        end(me, false);
        return true;
      }
      return false;
    }
    for (int q = 0; q < n_; ++q) {
      if (q == me) continue;
      Slot& d = areas_[me].lines[parity][q];
      if (d.consumed)
        report() << "rank " << me << " Lamport op " << s << " reads rank " << q << "'s lines twice";
      d.consumed = true;
    }
    lamport_ops_++;
    end(me, true);
    return true;
  }

  void push(int me, int r) {
    const uint64_t s = current(me);
    const int half = exchangeHalf(s, r);
    for (int p = 0; p < n_; ++p) {
      if (p == me) continue;
      Slot& d = areas_[p].data[half][me];
      // Safe when the reader took it, or ended the op it belonged to (and will not read it).
      if (!(d.consumed || ranks_[p].done >= d.seq))
        report() << "rank " << me << " op " << s << " round " << r << (ranks_[me].early ? " (early)" : "")
                 << " overwrites rank " << p << "'s unread data of op " << d.seq << " round " << d.round
                 << " (rank " << p << " has ended op " << ranks_[p].done << ")";
      d = {s, r, false};
      areas_[p].flag[half][me] = tagOf(s, r);
    }
  }

  void end(int me, bool ok) {
    Rank& k = ranks_[me];
    const uint64_t s = current(me);
    // The Lamport kernel reads no staged half: it counts as one round (finishLaunch).
    k.single_ok = ok && (op(me).lamport || op(me).rounds <= 1) ? s : 0;
    k.any_ok = ok ? s : 0;
    k.done = s;
    k.phase = 0;
    k.round = 0;
    k.pushed = false;
  }

  // Where a violation is described (only the first one is kept).
  struct Report {
    std::string* to;
    std::ostringstream text;
    ~Report() {
      if (to->empty()) *to = text.str();
    }
    template <typename T>
    Report& operator<<(const T& v) {
      text << v;
      return *this;
    }
  };
  Report report() { return Report{&violation_, {}}; }

  int n_;
  std::vector<Op> ops_;
  std::mt19937 rng_;
  EarlyRule rule_;
  LinesRule lines_rule_;
  std::vector<Area> areas_;
  std::vector<Rank> ranks_;
  std::string violation_;
  int lamport_ops_ = 0;
};

// `lamport_one_in`: about one op in this many takes the Lamport kernel (0: none).
std::vector<Op> randomOps(int n, size_t count, uint32_t seed, int fail_one_in, int lamport_one_in = 0) {
  std::mt19937 rng(seed);
  const int rounds[] = {0, 1, 1, 1, 1, 2, 3};
  std::vector<Op> ops;
  for (size_t i = 0; i < count; ++i) {
    Op o{rounds[rng() % 7], std::vector<bool>(n, false)};
    if (lamport_one_in && rng() % lamport_one_in == 0) {
      o.lamport = true;
      o.rounds = 1;
    }
    if (fail_one_in && rng() % fail_one_in == 0) {
      // A disagreement between two ranks: both see it.
      int a = static_cast<int>(rng() % n), b = static_cast<int>(rng() % n);
      if (b == a) b = (a + 1) % n;
      o.fails[a] = o.fails[b] = true;
    }
    ops.push_back(o);
  }
  return ops;
}

class ExchangeProtocol : public ::testing::TestWithParam<int> {};

TEST_P(ExchangeProtocol, PushesNeverOverwriteUnreadDataAndReadsFindTheirOp) {
  const int n = GetParam();
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    Protocol m(n, randomOps(n, 300, seed, seed % 2 ? 12 : 0), seed * 7919);
    m.run();
    ASSERT_EQ(m.violation(), "") << "seed " << seed;
    EXPECT_GT(m.earlyOps(), 0) << "seed " << seed;
  }
}

// Lamport ops among staged ones of every length, with disagreements and waits that time out:
// lines never overwrite lines a peer may still read, a staged op that follows a Lamport op
// pushes early into a free half, and every read finds its own op's data.
TEST_P(ExchangeProtocol, LamportOpsAmongStagedOnes) {
  const int n = GetParam();
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    Protocol m(n, randomOps(n, 300, seed, seed % 2 ? 12 : 0, 2 + seed % 3), seed * 104729);
    m.run();
    ASSERT_EQ(m.violation(), "") << "seed " << seed;
    EXPECT_GT(m.lamportOps(), 0) << "seed " << seed;
    EXPECT_GT(m.earlyOps(), 0) << "seed " << seed;
  }
}

// Lines written at once after a failed op overwrite lines of the op before it that a slower peer
// has yet to read (it would then wait for them until its deadline): the model catches it.
TEST_P(ExchangeProtocol, CatchesLinesWrittenAtOnceAfterAFailure) {
  const int n = GetParam();
  int caught = 0;
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    Protocol m(n, randomOps(n, 300, seed, 12, 2), seed * 104729, exchangePushesEarly, LinesRule::kAlways);
    m.run();
    caught += !m.violation().empty();
  }
  EXPECT_GT(caught, 0);
}

// The same model catches a rule that pushes early without looking at the previous op: then a
// one-round op that follows a two-round one overwrites the peer's second round before the peer
// has read it.
TEST_P(ExchangeProtocol, CatchesARuleThatIgnoresThePreviousOp) {
  const int n = GetParam();
  EarlyRule careless = [](uint64_t, uint64_t, bool one_round, int roles) { return roles == 1 && one_round; };
  int caught = 0;
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    Protocol m(n, randomOps(n, 300, seed, 0), seed * 7919, careless);
    m.run();
    caught += !m.violation().empty();
  }
  EXPECT_GT(caught, 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, ExchangeProtocol, ::testing::Values(2, 3, 4));

// The rule itself: only a one-round op on blocks that push and consume, right after a one-round
// op that succeeded.
TEST(ExchangeProtocolRule, EarlyPushNeedsAOneRoundPredecessor) {
  EXPECT_TRUE(exchangePushesEarly(1, 0, true, 1));  // the first op of a fresh area
  EXPECT_TRUE(exchangePushesEarly(8, 7, true, 1));
  EXPECT_FALSE(exchangePushesEarly(8, 0, true, 1));  // the previous op failed or had more rounds
  EXPECT_FALSE(exchangePushesEarly(8, 6, true, 1));
  EXPECT_FALSE(exchangePushesEarly(8, 7, false, 1));  // this op has more rounds
  EXPECT_FALSE(exchangePushesEarly(8, 7, true, 2));   // split roles
  EXPECT_NE(exchangeHalf(8, 0), exchangeHalf(7, 0));
  EXPECT_EQ(exchangeHalf(8, 0), exchangeHalf(8, 2));
}

}  // namespace
