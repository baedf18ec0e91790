// The tcp transport with several streams per peer: large writes striped over them, the order of
// everything else kept across them, and a sender that speaks the lanes' protocol by hand (parts
// forged, a lane cut) never corrupting memory or hanging a peer.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "moelink/transfer/tcp/socket.h"
#include "moelink/transfer/tcp/transport.h"
#include "moelink/transfer/transfer_engine.h"
#include "tcp_raw.h"
#include "test_support.h"

using namespace moelink::transfer;
using moelink::testing::pattern;
using moelink::testing::rawAuthenticated;
using moelink::testing::readWithTimeout;
using moelink::testing::runRanks;
using namespace std::chrono;
namespace w = moelink::transfer::tcp::wire;

namespace {

EngineOptions striped(int rank, int world, int streams, uint64_t stripe_bytes = 128 << 10, uint64_t spin_us = 0) {
  EngineOptions o;
  o.rank = rank;
  o.world_size = world;
  o.transport = "tcp";
  o.timeout = seconds(30);
  o.tcp_tuning = tcp::TcpTuning{streams, stripe_bytes, spin_us};
  return o;
}

class StripedWrites : public ::testing::TestWithParam<std::tuple<int, int, uint64_t>> {};

// Every rank writes its pattern into its right neighbour's segment in one write (striped when
// large enough), then reads it back, at sizes around the part boundaries.
TEST_P(StripedWrites, LandWhole) {
  auto [streams, world, bytes] = GetParam();
  auto store = std::make_shared<InProcessStore>();
  runRanks(world, [&, streams = streams, world = world, bytes = bytes](int rank) {
    TransferEngine engine(store, striped(rank, world, streams));
    char* seg = static_cast<char*>(engine.allocateSegment(7, bytes + 64));
    std::vector<char> mine(bytes), back(bytes, 0);
    for (uint64_t i = 0; i < bytes; ++i) mine[i] = static_cast<char>(pattern(rank, i));
    const int right = (rank + 1) % world, left = (rank + world - 1) % world;
    engine.openSegment(right, 7);
    auto b = engine.submit({{Opcode::kWrite, mine.data(), right, 7, 64, bytes}});
    ASSERT_TRUE(b->wait(seconds(60)));
    ASSERT_FALSE(b->failed()) << b->error();
    storeBarrier(*store, "written", world, seconds(60));
    for (uint64_t i = 0; i < 64; ++i) ASSERT_EQ(seg[i], 0) << "byte " << i << " before the write";
    for (uint64_t i = 0; i < bytes; ++i) ASSERT_EQ(static_cast<uint8_t>(seg[64 + i]), pattern(left, i)) << "byte " << i;
    auto rd = engine.submit({{Opcode::kRead, back.data(), right, 7, 64, bytes}});
    ASSERT_TRUE(rd->wait(seconds(60)));
    ASSERT_FALSE(rd->failed()) << rd->error();
    ASSERT_EQ(0, std::memcmp(back.data(), mine.data(), bytes));
    storeBarrier(*store, "read", world, seconds(60));
  });
}

std::string stripedName(const ::testing::TestParamInfo<StripedWrites::ParamType>& info) {
  return "s" + std::to_string(std::get<0>(info.param)) + "_w" + std::to_string(std::get<1>(info.param)) + "_b" +
         std::to_string(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Sizes, StripedWrites,
                         ::testing::Combine(::testing::Values(2, 4, 16), ::testing::Values(2, 3),
                                            ::testing::Values((128ull << 10) - 1, 128ull << 10, (128ull << 10) + 1,
                                                              (1ull << 20) + 4095, 16ull << 20)),
                         stripedName);

// Rounds between two ranks over tcp (`streams` streams, writes of at least `stripe` bytes
// striped) on a segment of `bytes` followed by a signal word and a credit word: in round r
// (1..rounds) rank 0 waits for rank 1's credit r - 1, then `send(engine, r, word)` writes the data
// and the signal (word holds r); rank 1 waits for the signal r, then `check(seg, r)` looks at the
// data before it answers with credit r (the sender rewrites its data only after it, as the
// engine's callers do).
void creditRounds(int streams, uint64_t stripe, uint64_t bytes, int rounds,
                  const std::function<void(TransferEngine&, int, uint64_t&)>& send,
                  const std::function<void(const char*, int)>& check) {
  ASSERT_EQ(bytes % 8, 0u) << "the signal must be 8-byte aligned to be applied as one store";
  auto store = std::make_shared<InProcessStore>();
  runRanks(2, [&](int rank) {
    TransferEngine engine(store, striped(rank, 2, streams, stripe));
    char* seg = static_cast<char*>(engine.allocateSegment(3, bytes + 64));
    storeBarrier(*store, "alloc", 2, seconds(10));
    engine.openSegment(1 - rank, 3);
    auto* signal = reinterpret_cast<uint64_t*>(seg + bytes);
    auto* credit = reinterpret_cast<uint64_t*>(seg + bytes + 8);
    uint64_t word = 0;
    for (int r = 1; r <= rounds; ++r) {
      uint64_t* wait_on = rank == 0 ? credit : signal;
      const uint64_t want = rank == 0 ? static_cast<uint64_t>(r - 1) : static_cast<uint64_t>(r);
      const auto deadline = steady_clock::now() + seconds(30);
      while (__atomic_load_n(wait_on, __ATOMIC_ACQUIRE) != want)
        ASSERT_LT(steady_clock::now(), deadline) << "no " << (rank == 0 ? "credit" : "signal") << " for round " << r;
      word = r;
      if (rank == 0) {
        send(engine, r, word);
        if (::testing::Test::HasFatalFailure()) return;
      } else {
        check(seg, r);
        if (::testing::Test::HasFatalFailure()) return;
        auto b = engine.submit({{Opcode::kWrite, &word, 0, 3, bytes + 8, 8}});
        ASSERT_TRUE(b->wait(seconds(30)));
        ASSERT_FALSE(b->failed()) << b->error();
      }
    }
    storeBarrier(*store, "done", 2, seconds(30));
  });
}

// A signal written after a striped write is applied after all of its parts: the receiver that
// sees the signal sees every byte of the data, round after round, whether the data's parts are
// acknowledged or complete once sent (a mailbox message's payload).
TEST(TcpStriping, SignalAfterStripedWriteSeesAllData) {
  constexpr uint64_t kBytes = 3 << 20;
  std::vector<char> data(kBytes);
  creditRounds(
      4, 64 << 10, kBytes, 60,
      [&](TransferEngine& engine, int r, uint64_t& word) {
        std::memset(data.data(), r, kBytes);
        // Data and signal in one batch (the data goes unacknowledged: the signal's acknowledgement
        // covers it), in two batches, and in two batches of which neither is acknowledged.
        if (r % 3 == 0) {
          auto b = engine.submit({{Opcode::kWrite, data.data(), 1, 3, 0, kBytes},
                                  {Opcode::kWrite, &word, 1, 3, kBytes, 8, true}});
          ASSERT_TRUE(b->wait(seconds(30)));
          ASSERT_FALSE(b->failed()) << b->error();
        } else {
          TransferRequest payload{Opcode::kWrite, data.data(), 1, 3, 0, kBytes};
          TransferRequest signal{Opcode::kWrite, &word, 1, 3, kBytes, 8, true};
          payload.no_ack = signal.no_ack = r % 3 == 2;
          auto b1 = engine.submit({payload});
          auto b2 = engine.submit({signal});
          ASSERT_TRUE(b1->wait(seconds(30)) && b2->wait(seconds(30)));
          ASSERT_FALSE(b1->failed() || b2->failed()) << b1->error() << b2->error();
        }
      },
      [&](const char* seg, int r) {
        for (uint64_t i = 0; i < kBytes; ++i)
          ASSERT_EQ(static_cast<uint8_t>(seg[i]), static_cast<uint8_t>(r)) << "round " << r << " byte " << i;
      });
}

// Writes marked unordered (TransferRequest::unordered, as the EP proxy sends its rows) spread
// over the streams from 2 KiB (one part below two parts' size, several above; smaller ones stay
// in order on the first stream), with
// or without their acknowledgements, and a signal after them still lands after all of them; the
// same writes in order all travel on the first stream.
TEST(TcpStriping, UnorderedWritesSpreadAndSignalAfterThem) {
  constexpr int kStreams = 4, kRounds = 30, kRepeat = 12;
  const std::vector<uint64_t> sizes{1, 100, 128, 129, 0, 2047, 2048, 7168, 7169, 70000, 200000};
  uint64_t span = 0;
  for (uint64_t s : sizes) span += s + 64;  // each write, then a gap that stays untouched
  const uint64_t bytes = (span * kRepeat + 63) / 64 * 64;  // the signal after them 8-byte aligned
  std::vector<char> data(bytes);
  creditRounds(
      kStreams, 1ull << 40, bytes, 2 * kRounds,  // nothing striped for its size
      [&](TransferEngine& engine, int r, uint64_t& word) {
        const bool unordered = r <= kRounds;
        const std::vector<uint64_t> before = engine.tcpSentPerStream();
        std::memset(data.data(), r, bytes);
        std::vector<TransferRequest> batch;
        uint64_t at = 0;
        for (int k = 0; k < kRepeat; ++k)
          for (uint64_t s : sizes) {
            TransferRequest w{Opcode::kWrite, data.data() + at, 1, 3, at, s};
            w.unordered = unordered;
            w.no_ack = k % 2 == 0;  // half of them complete once sent, as the EP proxy's rows do
            batch.push_back(w);
            at += s + 64;
          }
        const TransferRequest sig{Opcode::kWrite, &word, 1, 3, bytes, 8, true};
        if (r % 2 == 0) {
          batch.push_back(sig);
          auto b = engine.submit(batch);
          ASSERT_TRUE(b->wait(seconds(30)));
          ASSERT_FALSE(b->failed()) << b->error();
        } else {
          auto b1 = engine.submit(batch);
          auto b2 = engine.submit({sig});
          ASSERT_TRUE(b1->wait(seconds(30)) && b2->wait(seconds(30)));
          ASSERT_FALSE(b1->failed() || b2->failed()) << b1->error() << b2->error();
        }
        const std::vector<uint64_t> after = engine.tcpSentPerStream();
        ASSERT_EQ(after.size(), static_cast<size_t>(kStreams));
        for (int s = 1; s < kStreams; ++s) {
          const uint64_t moved = after[s] - before[s];
          if (unordered)
            EXPECT_GT(moved, bytes / kStreams / 2) << "round " << r << ": stream " << s << " carried " << moved;
          else
            EXPECT_EQ(moved, 0u) << "round " << r << ": stream " << s << " carried an ordered write";
        }
      },
      [&](const char* seg, int r) {
        uint64_t at = 0;
        for (int k = 0; k < kRepeat; ++k)
          for (uint64_t s : sizes) {
            for (uint64_t i = 0; i < s; ++i)
              ASSERT_EQ(seg[at + i], static_cast<char>(r)) << "round " << r << " write of " << s;
            for (uint64_t i = s; i < s + 64; ++i) ASSERT_EQ(seg[at + i], 0) << "round " << r << " gap after " << s;
            at += s + 64;
          }
      });
}

TEST(TcpStriping, ExpectedStripedWriteLandsAtDestination) {
  constexpr uint64_t kBytes = 1 << 20;
  auto store = std::make_shared<InProcessStore>();
  runRanks(2, [&](int rank) {
    TransferEngine engine(store, striped(rank, 2, 4, 64 << 10));
    char* seg = static_cast<char*>(engine.allocateSegment(4, 2 * kBytes));
    storeBarrier(*store, "alloc", 2, seconds(10));
    engine.openSegment(1 - rank, 4);
    std::vector<char> dest(kBytes, 0);
    if (rank == 1) engine.expectWrite(4, kBytes, dest.data(), dest.size());
    storeBarrier(*store, "expected", 2, seconds(10));
    if (rank == 0) {
      std::vector<char> a(kBytes);
      for (uint64_t i = 0; i < kBytes; ++i) a[i] = static_cast<char>(pattern(0, i));
      auto b = engine.submit({{Opcode::kWrite, a.data(), 1, 4, kBytes, kBytes}});
      ASSERT_TRUE(b->wait(seconds(10)));
      ASSERT_FALSE(b->failed()) << b->error();
    }
    storeBarrier(*store, "written", 2, seconds(10));
    if (rank == 1) {
      EXPECT_EQ(engine.claimExpected(4, kBytes), dest.data());
      for (uint64_t i = 0; i < kBytes; ++i) ASSERT_EQ(static_cast<uint8_t>(dest[i]), pattern(0, i)) << "byte " << i;
      for (uint64_t i = 0; i < 2 * kBytes; ++i) ASSERT_EQ(seg[i], 0) << "the segment got byte " << i;
    }
  });
}

// Two engines over 4 tcp streams (writes of `stripe` bytes striped) where rank 0 opened rank 1's
// segment 1 at `opened` bytes, which rank 1 then registered again as `small` (`now` bytes): rank
// 0 passes writes that the receiver then rejects.
struct ShrunkSegment {
  ShrunkSegment(uint64_t stripe, uint64_t opened, uint64_t now)
      : store(std::make_shared<InProcessStore>()),
        e0(std::make_unique<TransferEngine>(store, striped(0, 2, 4, stripe))),
        e1(std::make_unique<TransferEngine>(store, striped(1, 2, 4, stripe))),
        big(opened, 0),
        small(now, 0) {
    e1->registerSegment(1, big.data(), big.size());
    e0->allocateSegment(1, 64);
    e0->openSegment(1, 1);
    e1->unregisterSegment(1);
    e1->registerSegment(1, small.data(), small.size());
  }
  std::shared_ptr<InProcessStore> store;
  std::unique_ptr<TransferEngine> e0, e1;
  std::vector<char> big, small;
};

// Rank 0's batch `b` holds a write that the receiver rejects without acknowledging it: the
// reason that `b` or the small writes (from `src`) that rank 0 sends after it fail with once the
// pair is broken ("" if none does within a second).
std::string reasonOfBreak(TransferEngine& e0, const BatchPtr& b, void* src) {
  if (!b->wait(seconds(10))) {
    ADD_FAILURE() << "the rejected write's batch did not complete";
    return "";
  }
  std::string why = b->failed() ? b->error() : "";
  for (int i = 0; i < 100 && why.empty(); ++i) {
    std::this_thread::sleep_for(milliseconds(10));
    auto next = e0.submit({{Opcode::kWrite, src, 1, 1, 0, 8}});
    if (!next->wait(seconds(10))) {
      ADD_FAILURE() << "a request after the rejected write hung";
      return "";
    }
    if (next->failed()) why = next->error();
  }
  return why;
}

// A striped write outside the receiver's segment fails with the receiver's reason, touches
// nothing, and the pair keeps working.
TEST(TcpStriping, OutOfBoundsStripedWriteFails) {
  ShrunkSegment s(64 << 10, 4 << 20, 1 << 20);
  auto& e0 = s.e0;
  const std::vector<char>& small = s.small;
  std::vector<char> buf(2 << 20, 9);
  auto b = e0->submit({{Opcode::kWrite, buf.data(), 1, 1, 0, buf.size()}});
  ASSERT_TRUE(b->wait(seconds(10)));
  EXPECT_TRUE(b->failed());
  EXPECT_NE(b->error().find("rejected a write"), std::string::npos) << b->error();
  for (char c : small) ASSERT_EQ(c, 0);
  auto ok = e0->submit({{Opcode::kWrite, buf.data(), 1, 1, 0, small.size()}});
  ASSERT_TRUE(ok->wait(seconds(10)));
  EXPECT_FALSE(ok->failed()) << ok->error();
  EXPECT_EQ(small[0], 9);
  EXPECT_EQ(small.back(), 9);
}

// An unordered write sent without an acknowledgement (as the EP proxy sends its rows) that the
// receiver rejects touches nothing and breaks the pair, with the receiver's reason, at the sender:
// the requests after it assumed it landed.
TEST(TcpStriping, RejectedUnacknowledgedUnorderedWriteBreaksThePair) {
  ShrunkSegment s(1ull << 40, 1 << 20, 64 << 10);
  auto& e0 = s.e0;
  const std::vector<char>& small = s.small;
  std::vector<char> buf(8 << 10, 9);
  TransferRequest row{Opcode::kWrite, buf.data(), 1, 1, small.size() + 4096, buf.size()};
  row.unordered = row.no_ack = true;
  auto b = e0->submit({row, {Opcode::kWrite, buf.data(), 1, 1, 0, 8}});
  const std::string why = reasonOfBreak(*e0, b, buf.data());
  EXPECT_NE(why.find("rejected a write"), std::string::npos) << why;
  for (size_t i = 8; i < small.size(); ++i) ASSERT_EQ(small[i], 0) << "byte " << i;
}

// The same for an ordered write striped over the streams without acknowledgements (a mailbox
// message's payload): its parts complete once sent, and the receiver's rejection of any of them
// breaks the pair with its reason; nothing outside the receiver's segment is touched.
TEST(TcpStriping, RejectedUnacknowledgedStripedWriteBreaksThePair) {
  ShrunkSegment s(64 << 10, 4 << 20, 1 << 20);
  auto& e0 = s.e0;
  const std::vector<char>& small = s.small;
  std::vector<char> buf(2 << 20, 9);
  TransferRequest payload{Opcode::kWrite, buf.data(), 1, 1, 0, buf.size()};
  payload.no_ack = true;
  auto b = e0->submit({payload});
  const std::string why = reasonOfBreak(*e0, b, buf.data());
  EXPECT_NE(why.find("rejected a write"), std::string::npos) << why;
  EXPECT_NE(e0->lostReason(1), "");
  for (size_t i = 8; i < small.size(); ++i) ASSERT_EQ(small[i], 0) << "byte " << i;
}

// A peer that goes away fails requests on every stream, promptly, and never hangs one.
TEST(TcpStriping, PeerGoingAwayFailsStripedRequests) {
  auto store = std::make_shared<InProcessStore>();
  auto e0 = std::make_unique<TransferEngine>(store, striped(0, 2, 4, 64 << 10));
  auto e1 = std::make_unique<TransferEngine>(store, striped(1, 2, 4, 64 << 10));
  e0->allocateSegment(1, 8 << 20);
  e1->allocateSegment(1, 8 << 20);
  e0->openSegment(1, 1);
  std::vector<char> buf(8 << 20, 1);
  auto ok = e0->submit({{Opcode::kWrite, buf.data(), 1, 1, 0, buf.size()}});
  ASSERT_TRUE(ok->wait(seconds(10)));
  ASSERT_FALSE(ok->failed()) << ok->error();
  e1.reset();
  bool failed = false;
  for (int i = 0; i < 50 && !failed; ++i) {
    auto b = e0->submit({{Opcode::kWrite, buf.data(), 1, 1, 0, buf.size()}, {Opcode::kWrite, buf.data(), 1, 1, 0, 8}});
    ASSERT_TRUE(b->wait(seconds(10))) << "a request to a departed peer hung";
    failed = b->failed();
    if (failed) {
      EXPECT_NE(b->error().find("rank 1"), std::string::npos) << b->error();
    }
  }
  EXPECT_TRUE(failed);
  EXPECT_NE(e0->lostReason(1), "");
}

// The default number of streams keeps a large group's connections (one out and one in per stream
// and peer) within half of the process's file-descriptor limit.
// Several threads submit to one peer at once, each its own data and then its signal: small
// writes that a submitter sends itself (flush's own pass over a loop) race with the loops'
// threads and with the other submitters' passes, large ones go striped, some unordered; a
// signal never lands before its thread's data, on 1 and 4 streams, with progress threads that
// sleep at once and with ones that poll after their work (MOELINK_TCP_SPIN_US).
TEST(TcpStriping, ConcurrentSubmittersKeepEachThreadsOrder) {
  constexpr int kThreads = 4, kRounds = 40;
  const std::vector<uint64_t> sizes{8, 1000, 40 << 10, 100 << 10, 300 << 10};
  uint64_t per_thread = 0;
  for (int r = 0; r < kRounds; ++r) per_thread += (sizes[r % sizes.size()] + 63) / 64 * 64;
  const uint64_t signals = kThreads * per_thread;
  for (auto [streams, spin_us] : {std::pair<int, uint64_t>{1, 0}, {4, 0}, {4, 200}}) {
    auto store = std::make_shared<InProcessStore>();
    runRanks(2, [&](int rank) {
      TransferEngine engine(store, striped(rank, 2, streams, 128 << 10, spin_us));
      char* seg = static_cast<char*>(engine.allocateSegment(3, signals + 8 * kThreads));
      storeBarrier(*store, "alloc" + std::to_string(streams), 2, seconds(10));
      engine.openSegment(1 - rank, 3);
      auto block = [&](int t, int r) {  // where thread t's round r lands, and its size
        uint64_t at = t * per_thread;
        for (int k = 0; k < r; ++k) at += (sizes[k % sizes.size()] + 63) / 64 * 64;
        return std::make_pair(at, sizes[r % sizes.size()]);
      };
      auto byte = [](int t, int r, uint64_t i) { return static_cast<char>((i * 7 + t * 31 + r * 13) & 0xff); };
      if (rank == 0) {
        runRanks(kThreads, [&](int t) {
          std::vector<uint64_t> words(kRounds);  // each signal's value lives until its batch is done
          std::vector<BatchPtr> batches;
          for (int r = 0; r < kRounds; ++r) {
            const auto [at, len] = block(t, r);
            std::vector<char> mine(len);
            for (uint64_t i = 0; i < len; ++i) mine[i] = byte(t, r, i);
            words[r] = r + 1;
            TransferRequest w{Opcode::kWrite, mine.data(), 1, 3, at, len};
            w.unordered = r % 3 == 1;
            w.no_ack = r % 2 == 1;
            const TransferRequest sig{Opcode::kWrite, &words[r], 1, 3, signals + 8 * t, 8};
            auto b = engine.submit({w});
            batches.push_back(engine.submit({sig}));
            ASSERT_TRUE(b->wait(seconds(30)));  // (`mine` goes out of scope)
            ASSERT_FALSE(b->failed()) << b->error();
          }
          for (auto& b : batches) {
            ASSERT_TRUE(b->wait(seconds(30)));
            ASSERT_FALSE(b->failed()) << b->error();
          }
        });
      } else {
        std::vector<int> seen(kThreads, 0);  // rounds of each thread checked
        const auto deadline = steady_clock::now() + seconds(60);
        while (*std::min_element(seen.begin(), seen.end()) < kRounds) {
          ASSERT_LT(steady_clock::now(), deadline) << "signals missing";
          for (int t = 0; t < kThreads; ++t) {
            const auto now = static_cast<int>(
                __atomic_load_n(reinterpret_cast<uint64_t*>(seg + signals + 8 * t), __ATOMIC_ACQUIRE));
            for (; seen[t] < now; ++seen[t]) {
              const auto [at, len] = block(t, seen[t]);
              for (uint64_t i = 0; i < len; ++i)
                ASSERT_EQ(seg[at + i], byte(t, seen[t], i))
                    << streams << " streams, spin " << spin_us << " us: thread " << t << " round " << seen[t] << " byte " << i
                    << " not there when signal " << now << " was";
            }
          }
        }
      }
      storeBarrier(*store, "done" + std::to_string(streams), 2, seconds(60));
    });
  }
}

TEST(TcpStriping, DefaultStreamsFitTheDescriptorLimit) {
  if (std::getenv("MOELINK_TCP_STREAMS")) GTEST_SKIP() << "MOELINK_TCP_STREAMS is set";
  rlimit saved{};
  ASSERT_EQ(0, getrlimit(RLIMIT_NOFILE, &saved));
  if (saved.rlim_max != RLIM_INFINITY && saved.rlim_max < 1024) GTEST_SKIP() << "hard limit below 1024";
  const int small_group = tcp::TcpTuning::fromEnv(2).streams;
  EXPECT_GE(small_group, 1);
  rlimit lim = saved;
  lim.rlim_cur = 1024;
  ASSERT_EQ(0, setrlimit(RLIMIT_NOFILE, &lim));
  EXPECT_EQ(tcp::TcpTuning::fromEnv(2).streams, small_group);          // 1024 / 2 / 2 fits any default
  EXPECT_EQ(tcp::TcpTuning::fromEnv(256).streams, 1);                  // 1024 / 2 / 510 < 1: at least one
  EXPECT_LE(tcp::TcpTuning::fromEnv(64).streams * 2 * 63, 1024 / 2);  // 4 at most
  EXPECT_GE(tcp::TcpTuning::fromEnv(64).streams, 1);
  ASSERT_EQ(0, setrlimit(RLIMIT_NOFILE, &saved));
}

// ---- By hand: a client that presents the secret and speaks the lanes' protocol ----

void sendWrite(int fd, uint64_t number, uint64_t offset, const std::string& payload) {
  w::FrameHeader h{w::kWrite, 0, number, 3, 0, offset, payload.size()};
  send(fd, &h, sizeof h, MSG_NOSIGNAL);
  send(fd, payload.data(), payload.size(), MSG_NOSIGNAL);
}

void sendPart(int fd, uint64_t number, uint64_t offset, uint64_t total, uint64_t part_offset,
              const std::string& payload) {
  w::FrameHeader h{w::kWritePart, 0, number, 3, 0, offset, payload.size()};
  w::PartHeader p{total, part_offset};
  send(fd, &h, sizeof h, MSG_NOSIGNAL);
  send(fd, &p, sizeof p, MSG_NOSIGNAL);
  send(fd, payload.data(), payload.size(), MSG_NOSIGNAL);
}

// The receiving engine of the tests below (rank 0 of 2, `streams` streams) and its segment 3.
struct Receiver {
  explicit Receiver(int streams)
      : engine(store, striped(0, 2, streams)), seg(static_cast<char*>(engine.allocateSegment(3, 4096))) {}
  std::shared_ptr<InProcessStore> store = std::make_shared<InProcessStore>();
  TransferEngine engine;
  char* seg;
};

// A sender's session made by hand (rank 1 of the engine's group): its primary connection and its
// lanes 1..lanes, closed at the end of the scope.
struct HandSession {
  HandSession(TransferEngine& engine, uint64_t session, int lanes) {
    for (int lane = 0; lane <= lanes; ++lane) fds.push_back(rawAuthenticated(engine, 1, lane, session));
  }
  ~HandSession() {
    for (int fd : fds) close(fd);
  }
  bool connected() const { return std::all_of(fds.begin(), fds.end(), [](int fd) { return fd >= 0; }); }
  int primary() const { return fds[0]; }
  int lane(int i) const { return fds[static_cast<size_t>(i)]; }
  std::vector<int> fds;
};

bool closedWithin(int fd, int ms) {
  const auto deadline = steady_clock::now() + milliseconds(ms);
  char sink[256];
  while (steady_clock::now() < deadline) {
    pollfd pf{fd, POLLIN, 0};
    if (poll(&pf, 1, 50) <= 0) continue;
    ssize_t r = recv(fd, sink, sizeof sink, 0);
    if (r == 0 || (r < 0 && errno != EINTR && errno != EAGAIN)) return true;
  }
  return false;
}

// The primary's request 2 waits for request 1, a striped write whose parts come on two lanes:
// it lands only after both parts did, whichever order they come in.
TEST(TcpStriping, PrimaryWaitsForEarlierStripedWrite) {
  Receiver r(3);
  TransferEngine& engine = r.engine;
  char* seg = r.seg;
  HandSession s(engine, 991, 2);
  ASSERT_TRUE(s.connected());
  const int primary = s.primary(), lane1 = s.lane(1), lane2 = s.lane(2);
  sendWrite(primary, 2, 1000, "SIGNAL!!");  // after request 1 (parts at 0..15)
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_EQ(seg[1000], 0) << "request 2 landed before request 1";
  sendPart(lane2, 1, 0, 16, 8, "BBBBBBBB");
  w::FrameHeader ack{};
  ASSERT_TRUE(readWithTimeout(lane2, &ack, sizeof ack, 5000));
  EXPECT_EQ(ack.type, w::kWriteAck);
  EXPECT_EQ(ack.request_id, 1u);
  EXPECT_EQ(ack.status, w::kOk);
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_EQ(seg[1000], 0) << "request 2 landed before all of request 1";
  EXPECT_EQ(seg[8], 'B');
  sendPart(lane1, 1, 0, 16, 0, "AAAAAAAA");
  ASSERT_TRUE(readWithTimeout(lane1, &ack, sizeof ack, 5000));
  ASSERT_TRUE(readWithTimeout(primary, &ack, sizeof ack, 5000)) << "request 2 never applied";
  EXPECT_EQ(ack.request_id, 2u);
  EXPECT_EQ(ack.status, w::kOk);
  EXPECT_EQ(std::string(seg, 16), "AAAAAAAABBBBBBBB");
  EXPECT_EQ(std::string(seg + 1000, 8), "SIGNAL!!");
}

// Writes of one part (unordered writes: each lands whole on whichever connection carries it, the
// primary included) are recorded in the session in bunches; a later request still waits for each.
TEST(TcpStriping, PrimaryWaitsForEarlierWritesOfOnePart) {
  Receiver r(2);
  TransferEngine& engine = r.engine;
  char* seg = r.seg;
  HandSession s(engine, 992, 1);
  ASSERT_TRUE(s.connected());
  const int primary = s.primary(), lane = s.lane(1);
  // Request 1 on the primary itself, then request 3 behind it and behind request 2, still to come.
  sendPart(primary, 1, 0, 8, 0, "PRIMARY1");
  sendWrite(primary, 3, 1000, "SIGNAL!!");
  w::FrameHeader ack{};
  ASSERT_TRUE(readWithTimeout(primary, &ack, sizeof ack, 5000));
  EXPECT_EQ(ack.request_id, 1u);
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_EQ(seg[1000], 0) << "request 3 landed before request 2";
  sendPart(lane, 2, 8, 8, 0, "LANE---2");
  ASSERT_TRUE(readWithTimeout(lane, &ack, sizeof ack, 5000));
  EXPECT_EQ(ack.request_id, 2u);
  EXPECT_EQ(ack.status, w::kOk);
  ASSERT_TRUE(readWithTimeout(primary, &ack, sizeof ack, 5000)) << "request 3 never applied";
  EXPECT_EQ(ack.request_id, 3u);
  EXPECT_EQ(std::string(seg, 16), "PRIMARY1LANE---2");
  EXPECT_EQ(std::string(seg + 1000, 8), "SIGNAL!!");
  // More of them than a connection records at once, then a request after all of them.
  std::string burst;
  for (uint64_t n = 4; n < 4 + 200; ++n) {
    w::FrameHeader h{w::kWritePart, 0, n, 3, w::kNoAck, 2048 + 8 * (n - 4), 8};
    w::PartHeader p{8, 0};
    burst.append(reinterpret_cast<const char*>(&h), sizeof h);
    burst.append(reinterpret_cast<const char*>(&p), sizeof p);
    burst.append("ROW-" + std::to_string(1000 + n - 4));
  }
  sendWrite(primary, 204, 1008, "SIGNAL-2");
  ASSERT_EQ(send(lane, burst.data(), burst.size(), MSG_NOSIGNAL), static_cast<ssize_t>(burst.size()));
  ASSERT_TRUE(readWithTimeout(primary, &ack, sizeof ack, 5000)) << "request 204 never applied";
  EXPECT_EQ(ack.request_id, 204u);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(std::string(seg + 2048 + 8 * i, 8), "ROW-" + std::to_string(1000 + i));
  EXPECT_EQ(std::string(seg + 1008, 8), "SIGNAL-2");
}

// A write of one part whose number the session has already applied closes its connection, and the
// session's primary at its next request.
TEST(TcpStriping, ReplayedWriteOfOnePartClosesTheSession) {
  Receiver r(2);
  TransferEngine& engine = r.engine;
  char* seg = r.seg;
  HandSession s(engine, 993, 1);
  ASSERT_TRUE(s.connected());
  const int primary = s.primary(), lane = s.lane(1);
  sendWrite(primary, 1, 0, "APPLIED!");
  w::FrameHeader ack{};
  ASSERT_TRUE(readWithTimeout(primary, &ack, sizeof ack, 5000));
  sendPart(lane, 1, 8, 8, 0, "REPLAYED");
  EXPECT_TRUE(closedWithin(lane, 5000)) << "the lane that replayed request 1 stayed open";
  sendWrite(primary, 2, 16, "AFTER-IT");
  EXPECT_TRUE(closedWithin(primary, 5000)) << "the primary of a broken session stayed open";
  EXPECT_EQ(std::string(seg, 8), "APPLIED!");
  EXPECT_EQ(seg[16], 0) << "a request of a broken session landed";
}

// A sender that leaves closes its connections one by one, and the receiver may see a lane's end
// before it has read the primary's last requests: those still land in order (a lane's parts that
// landed before it closed count), as they would on one connection.
TEST(TcpStriping, PrimaryGoesOnAfterALaneClosed) {
  Receiver r(2);
  TransferEngine& engine = r.engine;
  char* seg = r.seg;
  HandSession s(engine, 994, 1);
  ASSERT_TRUE(s.connected());
  sendPart(s.lane(1), 1, 0, 8, 0, "LANE-ROW");
  close(s.lane(1));
  s.fds[1] = -1;
  std::this_thread::sleep_for(milliseconds(100));  // the lane's end is seen first
  sendWrite(s.primary(), 2, 8, "PRIMARY!");
  w::FrameHeader ack{};
  ASSERT_TRUE(readWithTimeout(s.primary(), &ack, sizeof ack, 5000)) << "request 2 was refused";
  EXPECT_EQ(ack.request_id, 2u);
  EXPECT_EQ(std::string(seg, 8), "LANE-ROW");
  EXPECT_EQ(std::string(seg + 8, 8), "PRIMARY!");
  // A request that waits for one that no lane is left to bring fails: the primary closes.
  sendWrite(s.primary(), 4, 16, "NEVER!!!");
  EXPECT_TRUE(closedWithin(s.primary(), 5000)) << "the primary waits for request 3, which cannot come";
  EXPECT_EQ(seg[16], 0);
}

// A second primary connection for a session is refused; the first one goes on.
TEST(TcpStriping, SecondPrimaryIsRefused) {
  Receiver r(2);
  HandSession s(r.engine, 996, 1);
  ASSERT_TRUE(s.connected());
  EXPECT_EQ(rawAuthenticated(r.engine, 1, 0, 996), -1) << "a second primary was taken";
  sendWrite(s.primary(), 1, 0, "FIRST-OK");
  w::FrameHeader ack{};
  ASSERT_TRUE(readWithTimeout(s.primary(), &ack, sizeof ack, 5000)) << "the first primary stopped";
  EXPECT_EQ(std::string(r.seg, 8), "FIRST-OK");
}

// A lane that closes leaves the primary waiting for the lanes still open: the request it waits
// for comes on one of them, and it lands after it.
TEST(TcpStriping, PrimaryWaitsForALaneStillOpen) {
  Receiver r(3);
  TransferEngine& engine = r.engine;
  char* seg = r.seg;
  HandSession s(engine, 995, 2);
  ASSERT_TRUE(s.connected());
  close(s.lane(2));
  s.fds[2] = -1;
  std::this_thread::sleep_for(milliseconds(50));
  sendWrite(s.primary(), 2, 16, "WAITING!");  // after request 1
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_EQ(seg[16], 0) << "request 2 landed before request 1";
  sendPart(s.lane(1), 1, 0, 16, 0, "FROM-LANE-ONE-16");
  w::FrameHeader ack{};
  ASSERT_TRUE(readWithTimeout(s.primary(), &ack, sizeof ack, 5000)) << "request 2 never applied";
  EXPECT_EQ(ack.request_id, 2u);
  EXPECT_EQ(std::string(seg, 16), "FROM-LANE-ONE-16");
  EXPECT_EQ(std::string(seg + 16, 8), "WAITING!");
}

// Forged parts: each closes its connection (and the waiting primary of its session) without
// touching memory outside what the write named.
TEST(TcpStriping, ForgedPartsCloseTheSession) {
  Receiver r(2);
  TransferEngine& engine = r.engine;
  char* seg = r.seg;
  uint64_t session = 5000;
  auto attempt = [&](const std::function<void(int)>& forge) {
    HandSession s(engine, ++session, 1);
    EXPECT_TRUE(s.connected());
    sendWrite(s.primary(), 3, 2000, "PARKED!!");  // waits for requests 1 and 2
    forge(s.lane(1));
    EXPECT_TRUE(closedWithin(s.lane(1), 5000)) << "the lane with a forged part stayed open";
    EXPECT_TRUE(closedWithin(s.primary(), 5000)) << "the waiting primary of a broken session stayed open";
  };
  // A part past the write's end (bytes 12..19 of a 16-byte write).
  attempt([](int lane) { sendPart(lane, 1, 0, 16, 12, "PAST-END"); });
  // Parts adding up to more than the write.
  attempt([](int lane) {
    sendPart(lane, 1, 0, 16, 0, "THE-WHOLE-WRITE!");
    sendPart(lane, 1, 0, 16, 0, "ONE-MORE");
  });
  // One request twice, whole each time.
  attempt([](int lane) {
    sendPart(lane, 1, 0, 8, 0, "WHOLE-01");
    sendPart(lane, 1, 0, 8, 0, "AGAIN-01");
  });
  // Parts of one request naming different writes.
  attempt([](int lane) {
    sendPart(lane, 1, 0, 16, 0, "AT-OFF-0");
    sendPart(lane, 1, 64, 16, 8, "AT-OFF64");
  });
  // A plain write on a lane.
  attempt([](int lane) { sendWrite(lane, 1, 0, "ON-LANE!"); });
  for (int i = 16; i < 4096; ++i) {
    ASSERT_EQ(seg[i], 0) << "byte " << i << " changed";
  }
  EXPECT_EQ(seg[2000], 0) << "a parked request of a broken session landed";
  // A lane that goes away breaks its session too: its waiting primary closes.
  ++session;
  int primary = rawAuthenticated(engine, 1, 0, session), lane = rawAuthenticated(engine, 1, 1, session);
  ASSERT_GE(primary, 0);
  ASSERT_GE(lane, 0);
  sendWrite(primary, 2, 3000, "PARKED!!");
  std::this_thread::sleep_for(milliseconds(50));
  close(lane);
  EXPECT_TRUE(closedWithin(primary, 5000));
  close(primary);
  EXPECT_EQ(seg[3000], 0);
}

}  // namespace
