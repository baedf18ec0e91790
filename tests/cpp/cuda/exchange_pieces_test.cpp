// The exchange kernel's protocol within one op (src/cuda/kernels/exchange.cu), run on the CPU,
// block by block: a pair's pushing blocks against its consuming blocks; the two-shot staged
// all_reduce (kReduceGatherStaged) and the forwarded broadcast (kForward) on every rank of a
// group. Steps go in a random order, one rank's blocks slower than the others; each model checks
// that a write never lands on bytes their reader has yet to read, that every read finds its own
// round, that nothing is left unread and that the op ends (no deadlock), and that it catches a
// rule that waits for too little. (exchange_protocol_test.cpp: the protocol across ops.)
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
  for (int n : {2, 3, 4, 5})
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

// The forwarded broadcast within one op (ExchangeMode::kForward), block by block on every rank:
// the root's block b pushes piece b of round r of each rank's block into that rank's slot, one
// rank after another (after the acknowledgements of round r-2 from the consumers of the bytes it
// overwrites); every other rank's block b takes the pieces b of round r as their flags come, and
// the root's piece, once the other ranks' consumers have acknowledged round r-2 of this rank's slot
// where it goes, it places and passes on to them in the same step. `len`: the bytes of each
// rank's block (the root's ignored), rounds of `round` bytes. `forward_acks` false: the passing on
// waits for nothing. Returns the first broken guarantee, "deadlock", or "".
std::string runForwardPieces(const std::vector<uint64_t>& len, int root, uint64_t round, int blocks,
                             bool forward_acks, uint32_t seed) {
  constexpr uint64_t kUnit = 16;
  const int n = static_cast<int>(len.size());
  int rounds = 0;
  for (int q = 0; q < n; ++q)
    if (q != root) rounds = std::max(rounds, static_cast<int>((len[q] + round - 1) / round));
  struct Unit {
    int round = -1;
    bool consumed = true;
  };
  // [rank][half][source] -> units; flags and acks [rank whose memory][half][rank][block]
  std::vector<std::vector<std::vector<std::vector<Unit>>>> slot(
      n, std::vector<std::vector<std::vector<Unit>>>(2, std::vector<std::vector<Unit>>(n, std::vector<Unit>(round / kUnit))));
  using Words = std::vector<std::vector<std::vector<std::vector<int>>>>;
  Words flag(n, std::vector<std::vector<std::vector<int>>>(2, std::vector<std::vector<int>>(n, std::vector<int>(blocks, -1))));
  Words ack = flag;
  std::vector<std::vector<int>> next(n, std::vector<int>(blocks, 0));    // the block's round
  std::vector<std::vector<int>> peer(n, std::vector<int>(blocks, 0));    // the root: next rank of the round
  std::vector<std::vector<unsigned>> taken(n, std::vector<unsigned>(blocks, 0));  // sources taken this round
  std::ostringstream why;
  const auto piece = [&](uint64_t bytes, int r, int b, uint64_t* lo, uint64_t* hi) {
    exchangePiece(exchangeRoundLen(bytes, r, round), b, blocks, lo, hi);
    return *lo < *hi;
  };
  const auto acked = [&](int owner, int rank, int r, uint64_t lo, uint64_t hi) {
    if (r < 2) return true;
    for (int c = 0; c < blocks; ++c) {
      uint64_t clo, chi;
      exchangePiece(round, c, blocks, &clo, &chi);
      if (clo < chi && clo < hi && lo < chi && ack[owner][(r - 2) & 1][rank][c] < r - 2) return false;
    }
    return true;
  };
  const auto write = [&](std::vector<Unit>& units, uint64_t lo, uint64_t hi, int r) {
    for (uint64_t u = lo / kUnit; u < (hi + kUnit - 1) / kUnit; ++u) {
      if (!units[u].consumed) {
        why << "round " << r << " written over byte " << u * kUnit << " of round " << units[u].round
            << ", not yet read";
        return false;
      }
      units[u] = {r, false};
    }
    return true;
  };
  const auto read = [&](std::vector<Unit>& units, uint64_t lo, uint64_t hi, int r) {
    for (uint64_t u = lo / kUnit; u < (hi + kUnit - 1) / kUnit; ++u) {
      if (units[u].round != r || units[u].consumed) {
        why << "a read of round " << r << " at byte " << u * kUnit << " finds round " << units[u].round
            << (units[u].consumed ? " (read already)" : "");
        return false;
      }
      units[u].consumed = true;
    }
    return true;
  };
  // The pieces rank `me`'s block b takes in round r: from the root, then from the other ranks.
  const auto sources = [&](int me, int b, int r) {
    unsigned s = 0;
    uint64_t lo, hi;
    for (int q = 0; q < n; ++q)
      if (q != me && piece(q == root ? len[me] : len[q], r, b, &lo, &hi)) s |= 1u << q;
    return s;
  };
  const auto act = [&](int me, int b, bool go) -> bool {
    const int r = next[me][b];
    if (r == rounds) return false;
    const int h = r & 1;
    uint64_t lo, hi;
    if (me == root) {  // the rank peer[me][b] of this round, then the next
      int p = peer[me][b];
      while (p < n && (p == root || !piece(len[p], r, b, &lo, &hi))) ++p;
      if (p < n) {
        if (!acked(me, p, r, lo, hi)) return false;
        if (!go) return true;
        if (!write(slot[p][h][me], lo, hi, r)) return false;
        flag[p][h][me][b] = r;
        peer[me][b] = p + 1;
      } else if (!go) {
        return true;
      }
      if (p >= n - 1) {
        next[me][b]++;
        peer[me][b] = 0;
      }
      return true;
    }
    const unsigned left = sources(me, b, r) & ~taken[me][b];
    int q = -1;
    for (int s = 0; s < n && q < 0; ++s)
      if ((left >> s & 1) && flag[me][h][s][b] >= r) q = s;
    if (left && q < 0) return false;
    if (q == root && forward_acks) {
      piece(len[me], r, b, &lo, &hi);
      for (int p = 0; p < n; ++p)
        if (p != me && p != root && !acked(me, p, r, lo, hi)) return false;
    }
    if (!go) return true;
    if (q >= 0) {
      piece(q == root ? len[me] : len[q], r, b, &lo, &hi);
      if (!read(slot[me][h][q], lo, hi, r)) return false;
      if (q == root)
        for (int p = 0; p < n; ++p)
          if (p != me && p != root) {
            if (!write(slot[p][h][me], lo, hi, r)) return false;
            flag[p][h][me][b] = r;
          }
      ack[q][h][me][b] = r;
      taken[me][b] |= 1u << q;
    }
    if (!(sources(me, b, r) & ~taken[me][b])) {
      next[me][b]++;
      taken[me][b] = 0;
    }
    return true;
  };
  std::mt19937 rng(seed);
  const int slow = static_cast<int>(seed % n);  // one rank's blocks run slowly
  while (true) {
    std::vector<std::pair<int, int>> can, fast;
    for (int me = 0; me < n; ++me)
      for (int b = 0; b < blocks; ++b)
        if (act(me, b, false)) {
          can.emplace_back(me, b);
          if (me != slow) fast.emplace_back(me, b);
        }
    if (!fast.empty() && rng() % 8 != 0) can = fast;
    if (can.empty()) {
      for (int me = 0; me < n; ++me)
        for (int b = 0; b < blocks; ++b)
          if (next[me][b] < rounds) return "deadlock";
      for (int me = 0; me < n; ++me)
        for (int h = 0; h < 2; ++h)
          for (int q = 0; q < n; ++q)
            for (const Unit& u : slot[me][h][q])
              if (!u.consumed) return "unread data left";
      return "";
    }
    const auto [me, b] = can[rng() % can.size()];
    if (!act(me, b, true)) return why.str();
  }
}

TEST(ExchangePieces, ForwardedBroadcastReadsEveryPieceOnceAndNeverOverwritesUnreadBytes) {
  const uint64_t round = 64 << 10;
  for (int n : {3, 4, 5})
    for (int blocks : {1, 3, 8}) {
      std::vector<std::vector<uint64_t>> plans;
      for (uint64_t bytes : {(n - 1) * round, 3 * (n - 1) * round + 7, (n - 1) * round * 5 / 2 + 3, uint64_t{1000}}) {
        std::vector<uint64_t> len;
        for (const auto& [lo, hi] : allreduceBlocks(n - 1, bytes, DType::kBytes)) len.push_back(hi - lo);
        plans.push_back(len);
      }
      std::vector<uint64_t> uneven;
      for (int q = 0; q < n - 1; ++q) uneven.push_back(q * round * 3 / 2 + 16 * q);
      plans.push_back(uneven);
      for (auto len : plans)
        for (int root = 0; root < n; root += n - 1) {
          len.insert(len.begin() + root, 0);  // the root's entry
          for (uint32_t seed = 1; seed <= 6; ++seed)
            ASSERT_EQ(runForwardPieces(len, root, round, blocks, true, seed), "")
                << n << " ranks, root " << root << ", " << blocks << " blocks, seed " << seed;
          len.erase(len.begin() + root);
        }
    }
}

// Passing a piece on without the acknowledgements of round r-2 can overwrite what a slower rank
// has yet to copy out. Where the blocks are alike, that rank's own piece of round r-1, which this
// block takes before round r, comes only after it has taken round r-2; a rank whose block is
// shorter sends none: the model catches it (blocks of 6 rounds but the last rank's, of one).
TEST(ExchangePieces, CatchesAForwardThatReusesASlotUnacknowledged) {
  const uint64_t round = 64 << 10;
  int caught = 0;
  for (uint32_t seed = 1; seed <= 40; ++seed)
    caught += runForwardPieces({0, 6 * round, 6 * round, round}, 0, round, 3, false, seed).find("not yet read") !=
              std::string::npos;
  EXPECT_GT(caught, 0);
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
