// planProxyBatch: how the CPU proxy turns one batch of the GPU's requests into engine writes.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "moelink/ep/proxy_ring.h"

namespace moelink::ep {
namespace {

using kernels::kProxyData;
using kernels::kProxySignal;
using kernels::ProxyEntry;

ProxyEntry data(int peer, uint64_t local, uint64_t remote, uint64_t length) {
  return ProxyEntry{0, kProxyData, peer, local, remote, length, 0};
}
ProxyEntry signal(int peer, uint64_t value, uint64_t remote) {
  return ProxyEntry{0, kProxySignal, peer, value, remote, 8, 0};
}

const ProxyLimits kLimits{{2, 3}, 1 << 20};

// The plan's writes in the order the carrier submits them: each wave's data, then its signals.
std::vector<ProxyWrite> flatten(const ProxyPlan& p) {
  std::vector<ProxyWrite> out;
  for (const ProxyWave& w : p.waves) {
    out.insert(out.end(), w.data.begin(), w.data.end());
    out.insert(out.end(), w.signals.begin(), w.signals.end());
  }
  return out;
}

TEST(ProxyRing, RowsOfConsecutiveTokensBecomeOneWriteAndSignalsFollowAllData) {
  // Rows of 100 bytes, token t at outbox 1000 + 100 t and inbox 5000 + 100 t, posted out of
  // order by the blocks; token 4 does not go to the peer; a count between them.
  std::vector<ProxyEntry> e = {data(2, 1200, 5200, 100), data(2, 1000, 5000, 100), signal(2, 7, 64),
                               data(2, 1100, 5100, 100), data(2, 1500, 5500, 100), data(2, 1300, 5300, 100),
                               signal(2, 9, 72)};
  const ProxyPlan p = planProxyBatch(e.data(), e.size(), kLimits);
  EXPECT_TRUE(p.dropped.empty());
  EXPECT_FALSE(p.in_ring_order);
  ASSERT_EQ(p.waves.size(), 1u);  // less data than a wave
  const std::vector<ProxyWrite> writes = flatten(p);
  ASSERT_EQ(writes.size(), 4u);
  EXPECT_FALSE(writes[0].signal);
  EXPECT_EQ(writes[0].local, 1000u);
  EXPECT_EQ(writes[0].remote, 5000u);
  EXPECT_EQ(writes[0].length, 400u);  // tokens 0-3
  EXPECT_EQ(writes[1].remote, 5500u);  // token 5: a gap before it
  EXPECT_EQ(writes[1].length, 100u);
  EXPECT_TRUE(writes[2].signal);
  EXPECT_EQ(writes[2].local, 7u);  // the signals in ring order
  EXPECT_EQ(writes[2].remote, 64u);
  EXPECT_TRUE(writes[3].signal);
  EXPECT_EQ(writes[3].local, 9u);
}

TEST(ProxyRing, NoMergeAcrossPeersOrOutboxGaps) {
  // Inbox ranges that continue each other but come from places of the outbox that do not,
  // and the same ranges to two peers.
  std::vector<ProxyEntry> e = {data(2, 0, 100, 50), data(2, 500, 150, 50), data(3, 50, 200, 50),
                               data(3, 0, 150, 50)};
  const ProxyPlan p = planProxyBatch(e.data(), e.size(), kLimits);
  const std::vector<ProxyWrite> writes = flatten(p);
  ASSERT_EQ(writes.size(), 3u);
  EXPECT_EQ(writes[0].peer, 2);
  EXPECT_EQ(writes[0].length, 50u);
  EXPECT_EQ(writes[1].peer, 2);
  EXPECT_EQ(writes[1].local, 500u);
  EXPECT_EQ(writes[2].peer, 3);
  EXPECT_EQ(writes[2].local, 0u);
  EXPECT_EQ(writes[2].remote, 150u);
  EXPECT_EQ(writes[2].length, 100u);
}

TEST(ProxyRing, MalformedEntriesAreDroppedAndNamed) {
  std::vector<ProxyEntry> e = {data(2, 0, 0, 64),
                               data(5, 0, 64, 64),                    // not a proxy peer
                               data(2, (1 << 20) - 8, 64, 64),        // past the outbox's end
                               ProxyEntry{0, 3, 2, 0, 0, 8, 0},       // unknown kind
                               ProxyEntry{0, kProxySignal, 2, 1, 8, 4, 0},  // a signal is 8 bytes
                               data(2, 64, UINT64_MAX - 10, 64),     // an inbox range that wraps
                               signal(3, 1, 0)};
  const ProxyPlan p = planProxyBatch(e.data(), e.size(), kLimits);
  EXPECT_EQ(p.dropped, (std::vector<size_t>{1, 2, 3, 4, 5}));
  const std::vector<ProxyWrite> writes = flatten(p);
  ASSERT_EQ(writes.size(), 2u);
  EXPECT_EQ(writes[0].peer, 2);
  EXPECT_FALSE(writes[0].signal);
  EXPECT_EQ(writes[1].peer, 3);
  EXPECT_TRUE(writes[1].signal);
}

TEST(ProxyRing, OverlappingWritesKeepTheRingOrder) {
  std::vector<ProxyEntry> e = {data(2, 0, 100, 100), signal(2, 1, 0), data(2, 200, 150, 100), data(2, 400, 0, 100)};
  const ProxyPlan p = planProxyBatch(e.data(), e.size(), kLimits);
  EXPECT_TRUE(p.in_ring_order);  // no data write may overtake another (the carrier keeps them ordered)
  ASSERT_EQ(p.waves.size(), e.size());  // one entry per wave
  const std::vector<ProxyWrite> writes = flatten(p);
  ASSERT_EQ(writes.size(), e.size());
  for (size_t i = 0; i < e.size(); ++i) {
    EXPECT_EQ(writes[i].remote, e[i].remote) << i;
    EXPECT_EQ(writes[i].signal, e[i].kind == kProxySignal) << i;
  }
}

// Random batches of what the kernels post (rows of tokens to two peers, counts and flags),
// planned in one wave and in waves of a few rows: applying the plan leaves every inbox as
// applying the entries in ring order does, each signal is applied after every data entry
// posted before it, and no write covers a byte no entry covers.
TEST(ProxyRing, PlanDeliversWhatTheRingOrderDoes) {
  std::mt19937 rng(7);
  constexpr uint64_t kRow = 48, kTokens = 64, kRows = 0, kSignals = kTokens * kRow;
  for (int round = 0; round < 200; ++round) {
    const uint64_t wave_bytes = round % 2 ? kProxyWaveBytes : kRow * (1 + round % 7);
    std::vector<ProxyEntry> e;
    std::vector<uint64_t> order(kTokens);
    for (uint64_t t = 0; t < kTokens; ++t) order[t] = t;
    std::shuffle(order.begin(), order.end(), rng);
    uint64_t next_signal = 0;
    for (uint64_t t : order) {
      for (int peer : {2, 3}) {
        if (rng() % 4 == 0) continue;  // this token does not go to this peer
        e.push_back(data(peer, peer * 65536 + kRows + t * kRow, kRows + t * kRow, kRow));
        if (rng() % 8 == 0) {
          ++next_signal;
          e.push_back(signal(peer, next_signal, kSignals + 8 * (next_signal % 32)));
        }
      }
    }
    const ProxyPlan p = planProxyBatch(e.data(), e.size(), kLimits, wave_bytes);
    ASSERT_TRUE(p.dropped.empty());
    if (wave_bytes == kProxyWaveBytes) ASSERT_EQ(p.waves.size(), 1u);
    // Every byte carried, from the same outbox bytes, exactly once.
    std::vector<std::vector<int>> want(4, std::vector<int>(kSignals + 8 * 32, -1)), got = want;
    std::vector<uint64_t> want_signal(4 * 32, 0), got_signal = want_signal;
    for (const ProxyEntry& x : e) {
      if (x.kind == kProxySignal) {
        want_signal[x.peer * 32 + (x.remote - kSignals) / 8] = x.local;
        continue;
      }
      for (uint64_t b = 0; b < x.length; ++b) want[x.peer][x.remote + b] = static_cast<int>(x.local + b);
    }
    for (const ProxyWave& wave : p.waves) {
      uint64_t bytes = 0;
      for (const ProxyWrite& w : wave.data) {
        ASSERT_FALSE(w.signal);
        bytes += w.length;
        for (uint64_t b = 0; b < w.length; ++b) {
          ASSERT_EQ(got[w.peer][w.remote + b], -1) << "a byte written twice";
          got[w.peer][w.remote + b] = static_cast<int>(w.local + b);
        }
      }
      ASSERT_EQ(bytes, wave.bytes);
      for (const ProxyWrite& w : wave.signals) {
        ASSERT_TRUE(w.signal);
        got_signal[w.peer * 32 + (w.remote - kSignals) / 8] = w.local;  // in order: the last one wins
        // Every data entry posted before this signal (its value numbers it) has landed.
        for (const ProxyEntry& x : e) {
          if (x.kind == kProxySignal && x.local == w.local) break;
          if (x.kind == kProxyData)
            ASSERT_EQ(got[x.peer][x.remote], static_cast<int>(x.local)) << "signal " << w.local << " before its data";
        }
      }
    }
    ASSERT_EQ(got, want);
    ASSERT_EQ(got_signal, want_signal);
    // One data write per run of consecutive tokens to a peer.
    size_t runs = 0, data_writes = 0;
    for (int peer : {2, 3})
      for (uint64_t t = 0; t < kTokens; ++t)
        runs += want[peer][kRows + t * kRow] >= 0 && (t == 0 || want[peer][kRows + (t - 1) * kRow] < 0);
    for (const ProxyWave& wave : p.waves) data_writes += wave.data.size();
    if (p.waves.size() == 1) ASSERT_EQ(data_writes, runs);
    ASSERT_GE(data_writes, runs);
  }
}

// A flag posted before a long run of rows (the combine's route flag, then its rows) goes in
// the first wave, not behind every row of the batch.
TEST(ProxyRing, ASignalWaitsForAWaveNotForTheBatch) {
  constexpr uint64_t kRow = 64 << 10;
  std::vector<ProxyEntry> e = {data(2, 0, 0, 16 << 10), signal(2, 1, 8 << 20)};
  for (uint64_t t = 0; t < 20; ++t) {
    e.push_back(data(3, 0, 0, 0));  // empty: nothing to carry
    e.push_back(data(2, 16384 + t * 40000, (1 << 20) + t * kRow, 40000));
    e.push_back(signal(2, 2 + t, (8 << 20) + 8 + 8 * t));
  }
  const ProxyPlan p = planProxyBatch(e.data(), e.size(), kLimits);
  ASSERT_TRUE(p.dropped.empty());
  ASSERT_GT(p.waves.size(), 2u);
  EXPECT_EQ(p.waves[0].signals.front().local, 1u);
  EXPECT_GE(p.waves[0].bytes, kProxyWaveBytes);
  EXPECT_LT(p.waves[0].bytes, kProxyWaveBytes + 40000);  // it ends at the first signal after that much
  uint64_t total = 0, signals = 0;
  for (const ProxyWave& w : p.waves) {
    total += w.bytes;
    signals += w.signals.size();
    EXPECT_FALSE(w.signals.empty());  // every wave here ends at a signal
  }
  EXPECT_EQ(total, (16u << 10) + 20u * 40000);
  EXPECT_EQ(signals, 21u);
}

}  // namespace
}  // namespace moelink::ep
