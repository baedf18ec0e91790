// ProxyCarrier without a GPU: a thread posts what the EP kernels post (rows of tokens in a
// shuffled order into the outbox, counts after some of them) into a small ring, and the peer,
// a second engine over shm or tcp (one stream, or four that the rows spread over or not), checks that
// every signal it sees finds the data posted before it in its inbox, round after round, with the
// ring wrapping and filling up; carried by one thread, and by four with rows split between them.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "moelink/ep/proxy_carrier.h"
#include "moelink/transfer/tcp/transport.h"
#include "moelink/transfer/transfer_engine.h"
#include "test_support.h"

namespace moelink::ep {
namespace {

using namespace std::chrono;
using kernels::ProxyEntry;

constexpr transfer::SegmentId kInbox = 0xE9000042u;
constexpr uint64_t kRow = 3000;     // bytes per row: not a multiple of 8 or 16
constexpr uint64_t kTokens = 96;
constexpr uint64_t kSignalsAt = kTokens * kRow;
constexpr uint64_t kMaxSignals = kTokens;
constexpr uint64_t kCapacity = 64;  // fewer entries than one round posts: the ring wraps and fills
constexpr int kRounds = 12;

uint8_t rowByte(int round, uint64_t token, uint64_t i) {
  return static_cast<uint8_t>((round * 37 + token * 11 + i * 7 + 1) & 0xff);
}

// The order in which round r posts its tokens (both ends compute it).
std::vector<uint64_t> postOrder(int round) {
  std::vector<uint64_t> order(kTokens);
  for (uint64_t t = 0; t < kTokens; ++t) order[t] = t;
  std::mt19937 rng(round);
  std::shuffle(order.begin(), order.end(), rng);
  return order;
}

// A signal after every 7th token of the order: (round + 1) << 32 | tokens posted before it.
uint64_t signalValue(int round, uint64_t posted) { return (static_cast<uint64_t>(round) + 1) << 32 | posted; }

// The poster's side: a ring, its head and an outbox in plain memory, as EpProxy has them
// mapped, and a carrier's settings for them (rank 0 writing to rank 1's inbox).
struct Poster {
  std::vector<ProxyEntry> ring;
  uint64_t head = 0;
  std::vector<char> outbox;
  Poster(uint64_t outbox_bytes, char fill) : ring(kCapacity), outbox(outbox_bytes, fill) {
    std::memset(static_cast<void*>(ring.data()), 0, ring.size() * sizeof(ProxyEntry));
  }
  ProxyCarrier::Config config() {
    return {.rank = 0,
            .peers = {1},
            .inbox = kInbox,
            .entries = ring.data(),
            .head = &head,
            .capacity = kCapacity,
            .outbox = outbox.data(),
            .outbox_bytes = outbox.size(),
            .timeout = seconds(30)};
  }
};

// (transport, carrying threads): with several threads, waves of a few rows split over them.
// "tcp4": four tcp streams, none striping a write for its size: the rows spread over them only
// because the carrier sends them unordered (every batch large enough to spread: spread_bytes 0);
// "tcp4small": the same with no batch large enough (rows in order, on the first stream only);
// "tcp4poll": "tcp4" with the progress threads polling as the proxy's engine has them on a host
// of many cores (proxyTcpTuning).
class ProxyCarrierTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(ProxyCarrierTest, SignalsFollowTheirRowsRoundAfterRound) {
  const std::string transport = std::get<0>(GetParam());
  const int threads = std::get<1>(GetParam());
  auto store = std::make_shared<transfer::InProcessStore>();
  // Rounds the receiver has checked (the poster then may overwrite them); kGaveUp when it
  // found a signal without its rows, or none, so that the poster stops too (no hang).
  constexpr int kGaveUp = 1 << 20;
  std::atomic<int> checked{0};
  testing::runRanks(2, [&](int rank) {
    transfer::EngineOptions o;
    o.rank = rank;
    o.world_size = 2;
    o.transport = transport == "shm" ? "shm" : "tcp";
    o.timeout = seconds(60);
    constexpr int kStreams = 4;
    const bool four = transport == "tcp4" || transport == "tcp4small" || transport == "tcp4poll";
    if (four) o.tcp_tuning = transfer::tcp::TcpTuning{kStreams, 1ull << 40};
    if (transport == "tcp4poll") o.tcp_tuning->spin_us = kProxyTcpSpinUs;
    transfer::TransferEngine engine(store, o);
    if (rank == 1) {  // the receiver: checks each signal against the rows posted before it
      auto* inbox = static_cast<volatile uint8_t*>(engine.allocateSegment(kInbox, kSignalsAt + 8 * kMaxSignals));
      transfer::storeBarrier(*store, "inbox", 2, seconds(60));
      auto checkRound = [&](int round) {
        const auto order = postOrder(round);
        uint64_t posted = 0;
        for (uint64_t k = 0; posted < kTokens; ++k) {
          posted = std::min<uint64_t>(kTokens, (k + 1) * 7);
          const uint64_t want = signalValue(round, posted);
          auto* slot = reinterpret_cast<uint64_t*>(const_cast<uint8_t*>(inbox) + kSignalsAt + 8 * k);
          const auto deadline = steady_clock::now() + seconds(30);
          while (__atomic_load_n(slot, __ATOMIC_ACQUIRE) != want) {
            if (steady_clock::now() > deadline) {
              ADD_FAILURE() << "round " << round << ": signal " << k << " never came";
              return false;
            }
          }
          for (uint64_t j = 0; j < posted; ++j)
            for (uint64_t i = 0; i < kRow; i += 97)
              if (inbox[order[j] * kRow + i] != rowByte(round, order[j], i)) {
                ADD_FAILURE() << "round " << round << ", signal " << k << " seen before token " << order[j]
                              << "'s row (posted before it) was there";
                return false;
              }
        }
        return true;
      };
      for (int round = 0; round < kRounds; ++round) {
        if (!checkRound(round)) {
          checked.store(kGaveUp, std::memory_order_release);
          break;
        }
        checked.store(round + 1, std::memory_order_release);
      }
      transfer::storeBarrier(*store, "done", 2, seconds(60));
      return;
    }
    Poster p(kTokens * kRow, 0);
    uint64_t& head = p.head;
    std::vector<ProxyEntry>& ring = p.ring;
    std::vector<char>& outbox = p.outbox;
    transfer::storeBarrier(*store, "inbox", 2, seconds(60));
    engine.openSegment(1, kInbox);
    ProxyCarrier::Config config = p.config();
    config.threads = threads;
    config.wave_bytes = threads > 1 ? 4 * kRow : kProxyWaveBytes;
    config.part_bytes = kRow / 2;
    config.spread_bytes = transport == "tcp4small" ? ~0ull : 0;
    ProxyCarrier carrier(engine, config);
    uint64_t ticket = 0;
    auto post = [&](int kind, uint64_t local, uint64_t remote, uint64_t length) {
      const auto deadline = steady_clock::now() + seconds(30);
      while (ticket - __atomic_load_n(&head, __ATOMIC_ACQUIRE) >= kCapacity) {
        if (steady_clock::now() > deadline) throw std::runtime_error("the carrier does not drain the ring");
      }
      kernels::postProxyEntryFromHost(ring.data(), kCapacity, ticket++, kind, 1, local, remote, length);
    };
    for (int round = 0; round < kRounds && checked.load() != kGaveUp; ++round) {
      while (checked.load(std::memory_order_acquire) < round) std::this_thread::yield();
      if (checked.load() == kGaveUp) break;
      const auto order = postOrder(round);
      for (uint64_t j = 0; j < kTokens; ++j) {
        const uint64_t t = order[j];
        for (uint64_t i = 0; i < kRow; ++i) outbox[t * kRow + i] = static_cast<char>(rowByte(round, t, i));
        post(kernels::kProxyData, t * kRow, t * kRow, kRow);
        if ((j + 1) % 7 == 0 || j + 1 == kTokens)
          post(kernels::kProxySignal, signalValue(round, j + 1), kSignalsAt + 8 * (j / 7), 8);
      }
    }
    EXPECT_TRUE(carrier.settle(ticket));  // everything posted is carried out
    EXPECT_EQ(__atomic_load_n(&head, __ATOMIC_ACQUIRE), ticket);
    if (four) {
      const std::vector<uint64_t> sent = engine.tcpSentPerStream();
      ASSERT_EQ(sent.size(), static_cast<size_t>(kStreams));
      for (int s = 0; s < kStreams; ++s) {
        if (transport != "tcp4small") {
          EXPECT_GT(sent[s], kRounds * kTokens * kRow / (4 * kStreams)) << "stream " << s << " carried too little";
        } else if (s > 0) {
          EXPECT_EQ(sent[s], 0u) << "stream " << s << " carried rows of batches below spread_bytes";
        }
      }
    }
    transfer::storeBarrier(*store, "done", 2, seconds(60));
  });
}

// Whoever changes the engine's peers (EpProxy::reopen) gets its turn while a poster keeps the
// carrier busy (the carrier takes new batches without waiting for the earlier ones, so it may
// never be idle), and while it holds the turn nothing is with the engine and nothing new is
// taken: the ring's head stands still.
TEST(ProxyCarrier, QuiesceGetsItsTurnUnderSteadyTraffic) {
  auto store = std::make_shared<transfer::InProcessStore>();
  constexpr uint64_t kRows = 256;
  testing::runRanks(2, [&](int rank) {
    transfer::EngineOptions o;
    o.rank = rank;
    o.world_size = 2;
    o.transport = "tcp";
    o.timeout = seconds(60);
    transfer::TransferEngine engine(store, o);
    if (rank == 1) {
      engine.allocateSegment(kInbox, kRows * kRow);
      transfer::storeBarrier(*store, "inbox", 2, seconds(60));
      transfer::storeBarrier(*store, "done", 2, seconds(120));
      return;
    }
    Poster p(kRows * kRow, 7);
    uint64_t& head = p.head;
    std::vector<ProxyEntry>& ring = p.ring;
    transfer::storeBarrier(*store, "inbox", 2, seconds(60));
    engine.openSegment(1, kInbox);
    ProxyCarrier carrier(engine, p.config());
    std::atomic<bool> stop{false};
    std::atomic<uint64_t> posted{0};
    std::thread poster([&] {
      for (uint64_t ticket = 0; !stop.load(std::memory_order_acquire); ++ticket) {
        while (ticket - __atomic_load_n(&head, __ATOMIC_ACQUIRE) >= kCapacity)
          if (stop.load(std::memory_order_acquire)) return;
        const uint64_t at = (ticket % kRows) * kRow;
        kernels::postProxyEntryFromHost(ring.data(), kCapacity, ticket, kernels::kProxyData, 1, at, at, kRow);
        posted.store(ticket + 1, std::memory_order_release);
      }
    });
    for (int turn = 0; turn < 20; ++turn) {
      std::this_thread::sleep_for(milliseconds(2));
      const auto asked = steady_clock::now();
      auto held = carrier.quiesce();
      EXPECT_LT(steady_clock::now() - asked, seconds(10)) << "turn " << turn;
      const uint64_t at = __atomic_load_n(&head, __ATOMIC_ACQUIRE), was_posted = posted.load();
      std::this_thread::sleep_for(milliseconds(3));
      EXPECT_EQ(__atomic_load_n(&head, __ATOMIC_ACQUIRE), at) << "turn " << turn << ": a batch finished while held";
      EXPECT_GE(posted.load(), was_posted);
    }
    stop.store(true, std::memory_order_release);
    poster.join();
    EXPECT_TRUE(carrier.settle(posted.load()));
    EXPECT_GT(__atomic_load_n(&head, __ATOMIC_ACQUIRE), kCapacity) << "the poster's rows were not carried";
    transfer::storeBarrier(*store, "done", 2, seconds(120));
  });
}

// The proxy's engine polls where the process may run on many cores, never on a small host, and
// MOELINK_EP_PROXY_TCP_SPIN_US decides on any host; the rest is the transport's own tuning.
TEST(ProxyCarrier, EngineTuningPollsOnManyCoresOnly) {
  // The caller's values of the two variables come back at the end (later tests read them).
  struct Restore {
    std::vector<std::pair<std::string, std::optional<std::string>>> was;
    Restore() {
      for (const char* name : {"MOELINK_EP_PROXY_TCP_SPIN_US", "MOELINK_TCP_STREAMS"}) {
        const char* v = std::getenv(name);
        was.emplace_back(name, v ? std::optional<std::string>(v) : std::nullopt);
      }
    }
    ~Restore() {
      for (const auto& [name, v] : was) v ? setenv(name.c_str(), v->c_str(), 1) : unsetenv(name.c_str());
    }
  } restore;
  unsetenv("MOELINK_EP_PROXY_TCP_SPIN_US");
  EXPECT_EQ(proxyTcpTuning(4, kProxyTcpSpinCores).spin_us, kProxyTcpSpinUs);
  EXPECT_EQ(proxyTcpTuning(4, 64).spin_us, kProxyTcpSpinUs);
  EXPECT_EQ(proxyTcpTuning(4, kProxyTcpSpinCores - 1).spin_us, 0u);
  EXPECT_EQ(proxyTcpTuning(4, 2).spin_us, 0u);
  setenv("MOELINK_TCP_STREAMS", "3", 1);
  setenv("MOELINK_EP_PROXY_TCP_SPIN_US", "0", 1);
  EXPECT_EQ(proxyTcpTuning(4, 64).spin_us, 0u);
  EXPECT_EQ(proxyTcpTuning(4, 64).streams, 3);
  setenv("MOELINK_EP_PROXY_TCP_SPIN_US", "250", 1);
  EXPECT_EQ(proxyTcpTuning(4, 2).spin_us, 250u);
  setenv("MOELINK_EP_PROXY_TCP_SPIN_US", "-1", 1);
  EXPECT_THROW(proxyTcpTuning(4, 2), std::exception);
}

INSTANTIATE_TEST_SUITE_P(Transports, ProxyCarrierTest,
                         ::testing::Combine(::testing::Values("shm", "tcp", "tcp4", "tcp4small", "tcp4poll"),
                                            ::testing::Values(1, 4)),
                         [](const ::testing::TestParamInfo<std::tuple<std::string, int>>& i) {
                           return std::get<0>(i.param) + "_" + std::to_string(std::get<1>(i.param)) + "threads";
                         });

}  // namespace
}  // namespace moelink::ep
