// The exchange kernel's protocol across ops (src/collective/kernels/exchange.cu), run on the
// CPU: ranks run long sequences of ops against each other's staging areas, one step at a time
// in a random order, with ops of no, one and several rounds, ops whose header check fails on
// some ranks, and waits that time out. The model follows the kernel's rules (header slots by
// op parity, halves by exchangeHalf, pushes before the headers by exchangePushesEarly, round
// tags, acknowledgements before a half is reused within an op) and checks that a push never
// overwrites data that its reader may still read, and that every read finds the data of its
// own op and round.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
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

// Within one op, block by block: the kernel's pushing blocks of one pair against the consuming
// blocks of its receiver, over byte ranges cut by exchangePiece, rounds of `round` bytes in two
// halves, a short last round whose pieces differ from a full round's. A pushing block waits, before
// it writes round r >= 2 into a half, for the acknowledgements of round r-2 that `waits` names
// (by consumer block); a consuming block waits for its namesake's flag of the round. The model
// checks that a push never overwrites bytes a consumer has yet to read and that every read finds
// its own round.
using AckRule = std::function<bool(int consumer, uint64_t clo, uint64_t chi, uint64_t lo, uint64_t hi, int b)>;

std::string runPieces(uint64_t bytes, uint64_t round, int blocks, uint32_t seed, const AckRule& waits) {
  constexpr uint64_t kUnit = 16;
  const int rounds = static_cast<int>((bytes + round - 1) / round);
  struct Unit {
    int round = -1;
    bool consumed = true;
  };
  std::vector<std::vector<Unit>> half(2, std::vector<Unit>(round / kUnit));
  std::vector<std::vector<int>> flag(2, std::vector<int>(blocks, -1)), ack(2, std::vector<int>(blocks, -1));
  std::vector<int> pushed(blocks, 0), consumed(blocks, 0);  // the next round of each block
  std::ostringstream why;
  // Whether block b's push (or read) of its next round may go now.
  auto ready = [&](int b, bool push) {
    const int r = push ? pushed[b] : consumed[b];
    if (r == rounds) return false;
    const int h = r & 1;
    if (!push) return flag[h][b] >= r;
    if (r < 2) return true;
    uint64_t lo, hi;
    exchangePiece(exchangeRoundLen(bytes, r, round), b, blocks, &lo, &hi);
    for (int c = 0; c < blocks; ++c) {
      uint64_t clo, chi;
      exchangePiece(round, c, blocks, &clo, &chi);
      if (clo < chi && waits(c, clo, chi, lo, hi, b) && ack[h][c] < r - 2) return false;
    }
    return true;
  };
  // Moves it; false with `why` set when it breaks a guarantee.
  auto move = [&](int b, bool push) {
    const int r = push ? pushed[b]++ : consumed[b]++;
    const int h = r & 1;
    uint64_t lo, hi;
    exchangePiece(exchangeRoundLen(bytes, r, round), b, blocks, &lo, &hi);
    for (uint64_t u = lo / kUnit; u < (hi + kUnit - 1) / kUnit; ++u) {
      Unit& x = half[h][u];
      if (push && !x.consumed) {
        why << "block " << b << " pushes round " << r << " over byte " << u * kUnit << " of round " << x.round
            << ", not yet read";
        return false;
      }
      if (!push && (x.round != r || x.consumed)) {
        why << "block " << b << " reads round " << r << " at byte " << u * kUnit << " and finds round " << x.round
            << (x.consumed ? " (read already)" : "");
        return false;
      }
      x = push ? Unit{r, false} : Unit{r, true};
    }
    (push ? flag : ack)[h][b] = r;
    return true;
  };
  std::mt19937 rng(seed);
  while (true) {
    std::vector<std::pair<int, bool>> can;
    for (int b = 0; b < blocks; ++b)
      for (bool push : {true, false})
        if (ready(b, push)) can.emplace_back(b, push);
    if (can.empty()) {
      for (int b = 0; b < blocks; ++b)
        if (pushed[b] < rounds || consumed[b] < rounds) return "deadlock";
      return "";
    }
    const auto [b, push] = can[rng() % can.size()];
    if (!move(b, push)) return why.str();
  }
}

// The kernel's rule: the consumer blocks whose full-round piece meets the bytes this piece
// overwrites (exchange.cu, pushRound).
const AckRule kOverlapping = [](int, uint64_t clo, uint64_t chi, uint64_t lo, uint64_t hi, int) {
  return clo < hi && lo < chi;
};

TEST(ExchangePieces, PushesWaitForTheConsumersOfTheBytesTheyOverwrite) {
  const uint64_t round = 256 << 10;
  for (int blocks : {1, 3, 8, 16})
    for (uint64_t bytes : {round * 5, round * 4 + 16, round * 5 + (40 << 10), round * 6 + round / 2 + 48,
                           round * 3 - 16})
      for (uint32_t seed = 1; seed <= 20; ++seed)
        ASSERT_EQ(runPieces(bytes, round, blocks, seed, kOverlapping), "")
            << blocks << " blocks, " << bytes << " bytes, seed " << seed;
}

// Waiting for the namesake consumer alone is right in full rounds only: a short last round cuts
// smaller pieces, which start inside other consumers' ranges.
TEST(ExchangePieces, CatchesAPushThatWaitsForItsNamesakeAlone) {
  const uint64_t round = 256 << 10;
  const AckRule namesake = [](int c, uint64_t, uint64_t, uint64_t, uint64_t, int b) { return c == b; };
  int caught = 0;
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    const std::string v = runPieces(round * 4 + (64 << 10), round, 8, seed, namesake);
    EXPECT_NE(v, "deadlock");
    caught += v.find("not yet read") != std::string::npos;
  }
  EXPECT_GT(caught, 0);
  for (uint32_t seed = 1; seed <= 20; ++seed)  // full rounds only: the namesake suffices
    EXPECT_EQ(runPieces(round * 6, round, 8, seed, namesake), "") << seed;
}

// The two-shot staged all_reduce within one op (ExchangeMode::kReduceGatherStaged), block by block
// on every rank: pushing block b pushes piece b of each peer's block of round r into the peer's
// slot (after the acknowledgements of round r-2 from the consumers of the bytes it overwrites);
// consuming block b, once every peer's piece b of its own block has come (and the peers' consumers
// have acknowledged the gather pieces of round r-2 where its result goes, when `gather_acks`),
// reduces it, writing the result into every peer's gather slot, acknowledges the pieces it read,
// raises the gather flags, then takes the peers' reduced pieces b of round r in any order the
// flags allow and acknowledges each. Unsplit (`split` false), one block does all of it in turn.
// `len`: the bytes of each rank's block (allreduceBlocks' are alike but for the last few bytes;
// the kernel takes any), rounds of `round` bytes. Returns the first broken guarantee (a write over
// bytes not yet read, a read that finds another round or no data), "deadlock", or "".
std::string runTwoShotPieces(const std::vector<uint64_t>& len, uint64_t round, int blocks, bool split,
                             bool gather_acks, uint32_t seed) {
  constexpr uint64_t kUnit = 16;
  const int n = static_cast<int>(len.size());
  int rounds = 0;
  for (int q = 0; q < n; ++q) rounds = std::max(rounds, static_cast<int>((len[q] + round - 1) / round));
  struct Unit {
    int round = -1;
    bool consumed = true;
  };
  // [rank][kind: 0 scatter, 1 gather][half][source] -> units of the slot
  using Slots = std::vector<std::vector<Unit>>;
  std::vector<std::vector<std::vector<Slots>>> slot(
      n, std::vector<std::vector<Slots>>(2, std::vector<Slots>(2, Slots(n, std::vector<Unit>(round / kUnit)))));
  // [rank whose memory][kind: 0 flag, 1 ack, 2 gather flag, 3 gather ack][half][rank][block]
  std::vector<std::vector<std::vector<std::vector<std::vector<int>>>>> word(
      n, std::vector<std::vector<std::vector<std::vector<int>>>>(
             4, std::vector<std::vector<std::vector<int>>>(
                    2, std::vector<std::vector<int>>(n, std::vector<int>(blocks, -1)))));
  enum { kFlag, kAck, kGatherFlag, kGatherAck };
  // Per rank and block: the pusher's next round; the consumer's round and stage (0: reduce, 1:
  // gather) and the sources whose gather piece it has taken this round.
  std::vector<std::vector<int>> pushed(n, std::vector<int>(blocks, 0)), consumed(n, std::vector<int>(blocks, 0)),
      stage(n, std::vector<int>(blocks, 0));
  std::vector<std::vector<unsigned>> taken(n, std::vector<unsigned>(blocks, 0));
  std::ostringstream why;
  const auto piece = [&](uint64_t bytes, int r, int b, uint64_t* lo, uint64_t* hi) {
    exchangePiece(exchangeRoundLen(bytes, r, round), b, blocks, lo, hi);
    return *lo < *hi;
  };
  // Whether the consumers of `rank` (acks in the memory of `owner`, kind `ack`) that read round
  // r-2 where [lo, hi) goes have acknowledged it.
  const auto acked = [&](int owner, int ack, int rank, int r, uint64_t lo, uint64_t hi) {
    if (r < 2) return true;
    for (int c = 0; c < blocks; ++c) {
      uint64_t clo, chi;
      exchangePiece(round, c, blocks, &clo, &chi);
      if (clo < chi && clo < hi && lo < chi && word[owner][ack][(r - 2) & 1][rank][c] < r - 2) return false;
    }
    return true;
  };
  const auto write = [&](std::vector<Unit>& units, uint64_t lo, uint64_t hi, int r, const char* what) {
    for (uint64_t u = lo / kUnit; u < (hi + kUnit - 1) / kUnit; ++u) {
      if (!units[u].consumed) {
        why << what << " round " << r << " over byte " << u * kUnit << " of round " << units[u].round
            << ", not yet read";
        return false;
      }
      units[u] = {r, false};
    }
    return true;
  };
  const auto read = [&](std::vector<Unit>& units, uint64_t lo, uint64_t hi, int r, const char* what) {
    for (uint64_t u = lo / kUnit; u < (hi + kUnit - 1) / kUnit; ++u) {
      if (units[u].round != r || units[u].consumed) {
        why << what << " round " << r << " at byte " << u * kUnit << " finds round " << units[u].round
            << (units[u].consumed ? " (read already)" : "");
        return false;
      }
      units[u].consumed = true;
    }
    return true;
  };
  // Actions: 0 push, 1 reduce, 2 take a gather piece. `go`: do it (else: whether it can go).
  const auto act = [&](int me, int b, int what, bool go) -> bool {
    const int r = what == 0 ? pushed[me][b] : consumed[me][b];
    if (r == rounds) return false;
    if (!split) {  // in turn: push r, reduce r, gather r, push r + 1
      const int turn = pushed[me][b] > consumed[me][b] ? 1 + stage[me][b] : 0;
      if (what != turn) return false;
    } else if (what != 0 && what != 1 + stage[me][b]) {
      return false;
    }
    const int h = r & 1;
    uint64_t lo, hi;
    if (what == 0) {
      for (int p = 0; p < n; ++p)
        if (p != me && piece(len[p], r, b, &lo, &hi) && !acked(me, kAck, p, r, lo, hi)) return false;
      if (!go) return true;
      for (int p = 0; p < n; ++p) {
        if (p == me || !piece(len[p], r, b, &lo, &hi)) continue;
        if (!write(slot[p][0][h][me], lo, hi, r, "a pushing block writes")) return false;
        word[p][kFlag][h][me][b] = r;
      }
      pushed[me][b]++;
      return true;
    }
    if (what == 1) {
      if (piece(len[me], r, b, &lo, &hi)) {
        for (int q = 0; q < n; ++q)
          if (q != me && (word[me][kFlag][h][q][b] < r || (gather_acks && !acked(me, kGatherAck, q, r, lo, hi))))
            return false;
        if (!go) return true;
        for (int q = 0; q < n; ++q) {
          if (q == me) continue;
          if (!read(slot[me][0][h][q], lo, hi, r, "a consuming block reduces") ||
              !write(slot[q][1][h][me], lo, hi, r, "a consuming block writes its reduced piece"))
            return false;
          word[q][kAck][h][me][b] = r;
          word[q][kGatherFlag][h][me][b] = r;
        }
      } else if (!go) {
        return true;
      }
      stage[me][b] = 1;
      taken[me][b] = 0;
    } else {
      int from = -1;
      for (int q = 0; q < n && from < 0; ++q)
        if (q != me && !(taken[me][b] >> q & 1) && piece(len[q], r, b, &lo, &hi) &&
            word[me][kGatherFlag][h][q][b] >= r)
          from = q;
      bool left = false;  // a piece still to come
      for (int q = 0; q < n; ++q) left |= q != me && !(taken[me][b] >> q & 1) && piece(len[q], r, b, &lo, &hi);
      if (from < 0 && left) return false;
      if (!go) return true;
      if (from >= 0) {
        piece(len[from], r, b, &lo, &hi);
        if (!read(slot[me][1][h][from], lo, hi, r, "a consuming block copies a reduced piece")) return false;
        word[from][kGatherAck][h][me][b] = r;
        taken[me][b] |= 1u << from;
        left = false;
        for (int q = 0; q < n; ++q) left |= q != me && !(taken[me][b] >> q & 1) && piece(len[q], r, b, &lo, &hi);
      }
      if (!left) {
        stage[me][b] = 0;
        consumed[me][b]++;
      }
    }
    return true;
  };
  std::mt19937 rng(seed);
  // One rank's consuming blocks run slowly (chosen one time in 8 where anything else can go), so
  // that the others get rounds ahead of them.
  const int slow = static_cast<int>(seed % n);
  while (true) {
    std::vector<std::tuple<int, int, int>> can, fast;
    for (int me = 0; me < n; ++me)
      for (int b = 0; b < blocks; ++b)
        for (int what : {0, 1, 2})
          if (act(me, b, what, false)) {
            can.emplace_back(me, b, what);
            if (me != slow || what == 0) fast.emplace_back(me, b, what);
          }
    if (!fast.empty() && rng() % 8 != 0) can = fast;
    if (can.empty()) {
      for (int me = 0; me < n; ++me)
        for (int b = 0; b < blocks; ++b)
          if (pushed[me][b] < rounds || consumed[me][b] < rounds) return "deadlock";
      for (int me = 0; me < n; ++me)  // every piece read
        for (int k = 0; k < 2; ++k)
          for (int h = 0; h < 2; ++h)
            for (int q = 0; q < n; ++q)
              for (const Unit& u : slot[me][k][h][q])
                if (!u.consumed) return "unread data left";
      return "";
    }
    const auto [me, b, what] = can[rng() % can.size()];
    if (!act(me, b, what, true)) return why.str();
  }
}

std::vector<uint64_t> floatBlocks(int n, uint64_t count) {
  std::vector<uint64_t> len;
  for (const auto& [lo, hi] : allreduceBlocks(n, count, DType::kFloat32)) len.push_back((hi - lo) * 4);
  return len;
}

TEST(ExchangePieces, TwoShotStagedReadsEveryPieceOnceAndNeverOverwritesUnreadBytes) {
  const uint64_t round = 64 << 10;
  for (int n : {3, 4, 5})
    for (int blocks : {1, 3, 8})
      for (bool split : {true, false}) {
        // allreduceBlocks: blocks of one round, several full rounds, a short last round, a few
        // bytes between the first and the last block, blocks of less than a piece
        std::vector<std::vector<uint64_t>> plans;
        for (uint64_t count : {n * round / 4, n * round, n * round + 7, (n * round * 5) / 8 + 3, uint64_t{1000}})
          plans.push_back(floatBlocks(n, count));
        // blocks of very different lengths, one of them empty
        std::vector<uint64_t> uneven(n, 0);
        for (int q = 1; q < n; ++q) uneven[q] = q * round * 3 / 2 + 16 * q;
        plans.push_back(uneven);
        for (const auto& len : plans)
          for (uint32_t seed = 1; seed <= 6; ++seed)
            ASSERT_EQ(runTwoShotPieces(len, round, blocks, split, true, seed), "")
                << n << " ranks, " << blocks << " blocks, split " << split << ", block 1 of " << len[1]
                << " bytes, seed " << seed;
      }
}

// Without the acknowledgements of the gather pieces, a reducing block can overwrite a peer's
// gather slot of round r-2 before that peer has copied it out. Where the blocks are alike (as
// allreduceBlocks cuts them) the peer's reduced piece of round r-1, which this block waits for,
// comes only after that copy; a peer whose block is shorter sends none: the model catches it
// (blocks of 8 rounds but the last rank's, of one).
TEST(ExchangePieces, CatchesATwoShotThatReusesAGatherSlotUnacknowledged) {
  const uint64_t round = 64 << 10;
  int caught = 0;
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    const std::string v = runTwoShotPieces({8 * round, 8 * round, 8 * round, round}, round, 3, true, false, seed);
    caught += v.find("reduced piece round") != std::string::npos && v.find("not yet read") != std::string::npos;
  }
  EXPECT_GT(caught, 0);
}

}  // namespace
