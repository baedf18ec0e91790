// The mailbox's receive redirection over tcp when an op fails or is rerun (clearLandings): a
// message whose payload already went to a landing keeps it, whatever consumes it next; and a
// landing asked too late (the message is here) is not installed.
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "moelink/collective/mailbox.h"
#include "moelink/transfer/transfer_engine.h"
#include "test_support.h"

using moelink::collective::Mailbox;
using moelink::collective::MsgHeader;
using moelink::testing::pattern;
using moelink::testing::runRanks;
using namespace moelink::transfer;
using namespace std::chrono;

namespace {

constexpr SegmentId kBox = 7;
constexpr uint64_t kChunk = 4096;
constexpr int kDepth = 2;

struct Rank {
  std::unique_ptr<TransferEngine> engine;
  std::unique_ptr<Mailbox> box;
};

Rank openRank(const std::shared_ptr<InProcessStore>& store, int rank) {
  EngineOptions o;
  o.rank = rank;
  o.world_size = 2;
  o.transport = "tcp";
  o.timeout = seconds(30);
  Rank r;
  r.engine = std::make_unique<TransferEngine>(store, o);
  r.box = std::make_unique<Mailbox>(*r.engine, kBox, kChunk, kDepth);
  storeBarrier(*store, "boxes", 2, seconds(10));
  r.box->open();
  storeBarrier(*store, "open", 2, seconds(10));
  return r;
}

std::vector<char> payloadOf(int message, uint64_t n) {
  std::vector<char> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = static_cast<char>(pattern(message, i));
  return v;
}

MsgHeader headerOf(uint64_t bytes, uint64_t op_seq) {
  MsgHeader h;
  h.bytes = bytes;
  h.op_seq = op_seq;
  h.sender = 0;
  return h;
}

// Rank 0's side: messages first..last to rank 1, each once the mailbox has credit for it and
// complete before the next.
void sendMessages(Rank& r, int first, int last, uint64_t n) {
  for (int m = first; m <= last; ++m) {
    while (!r.box->canSend(1)) std::this_thread::sleep_for(microseconds(50));
    auto data = payloadOf(m, n);
    auto b = r.box->send(1, headerOf(n, m), data.data());
    ASSERT_TRUE(b->wait(seconds(10)));
    ASSERT_FALSE(b->failed()) << b->error();
  }
}

const MsgHeader* waitForHead(Mailbox& box, int peer) {
  const auto until = steady_clock::now() + seconds(10);
  while (steady_clock::now() < until) {
    if (const MsgHeader* h = box.peek(peer)) return h;
    std::this_thread::sleep_for(microseconds(50));
  }
  return nullptr;
}

// A message received at its landing before the op failed (or was rerun) is consumed after the
// landings were dropped: its payload is read from its slot, with the bytes that landed, and not
// from the failed op's memory, which has changed since. (Found as a rerun of all_to_all over the
// survivors reading a stale slot instead of the peer's count.)
TEST(MailboxLandings, LandedMessageIsPutBackInItsSlot) {
  auto store = std::make_shared<InProcessStore>();
  const uint64_t n = 1000;
  runRanks(2, [&](int rank) {
    Rank r = openRank(store, rank);
    if (rank == 0) {
      storeBarrier(*store, "expected", 2, seconds(10));
      sendMessages(r, 1, 2, n);
      storeBarrier(*store, "done", 2, seconds(10));
      return;
    }
    std::vector<char> landing(n, 0);
    r.box->landAhead(0, 0, landing.data(), landing.size());
    storeBarrier(*store, "expected", 2, seconds(10));
    ASSERT_NE(waitForHead(*r.box, 0), nullptr);
    EXPECT_EQ(landing, payloadOf(1, n)) << "the first message did not land where it was asked to";
    r.box->clearLandings();
    std::memset(landing.data(), 0x5a, n);  // the failed op's buffer is the caller's again
    std::string error;
    const char* got = r.box->payload(0, &error);
    ASSERT_NE(got, nullptr) << error;
    EXPECT_NE(got, landing.data());
    EXPECT_EQ(std::vector<char>(got, got + n), payloadOf(1, n));
    r.box->release(0);
    // The next message goes to its slot as usual.
    ASSERT_NE(waitForHead(*r.box, 0), nullptr);
    got = r.box->payload(0, &error);
    ASSERT_NE(got, nullptr) << error;
    EXPECT_EQ(std::vector<char>(got, got + n), payloadOf(2, n));
    r.box->release(0);
    storeBarrier(*store, "done", 2, seconds(10));
  });
}

// A landing asked for a message that is here already (its payload taken from its slot) is not
// installed: nobody would claim it, and the next message into that slot, depth + 1 messages on,
// would land there instead of in its slot. (Found as the worker asking, once a gate opened, for
// a head message whose step was half consumed.)
TEST(MailboxLandings, NoLandingForAMessageThatIsHere) {
  auto store = std::make_shared<InProcessStore>();
  const uint64_t n = 1000;
  const int messages = kDepth + 2;  // message kDepth + 2 reuses message 1's slot
  runRanks(2, [&](int rank) {
    Rank r = openRank(store, rank);
    if (rank == 0) {
      sendMessages(r, 1, messages, n);
      storeBarrier(*store, "done", 2, seconds(10));
      return;
    }
    std::vector<char> landing(n, 0);
    for (int m = 1; m <= messages; ++m) {
      ASSERT_NE(waitForHead(*r.box, 0), nullptr) << "message " << m;
      std::string error;
      const char* got = r.box->payload(0, &error);
      ASSERT_NE(got, nullptr) << error;
      if (m == 1) r.box->landAhead(0, 0, landing.data(), landing.size());  // the head: here, taken
      EXPECT_EQ(std::vector<char>(got, got + n), payloadOf(m, n)) << "message " << m;
      r.box->release(0);
    }
    EXPECT_EQ(landing, std::vector<char>(n, 0)) << "a message landed where an earlier one had been asked to";
    storeBarrier(*store, "done", 2, seconds(10));
  });
}

// A payload that started landing but whose message had not arrived whole when the landings were
// dropped: the message is refused by name when it comes (its bytes went to memory that is no
// longer the mailbox's), and the pair goes on with the next one.
TEST(MailboxLandings, PayloadNotWholeInTimeIsRefused) {
  auto store = std::make_shared<InProcessStore>();
  const uint64_t n = 512;
  runRanks(2, [&](int rank) {
    Rank r = openRank(store, rank);
    if (rank == 0) {
      storeBarrier(*store, "expected", 2, seconds(10));
      // Message 1 by hand, in two halves of time: its payload now, its header and signal later.
      auto data = payloadOf(1, n);
      auto p = r.engine->submit({{Opcode::kWrite, data.data(), 1, kBox, r.box->headerOffsetOf(0, 1) + sizeof(MsgHeader), n}});
      ASSERT_TRUE(p->wait(seconds(10)));
      storeBarrier(*store, "payload", 2, seconds(10));
      storeBarrier(*store, "cleared", 2, seconds(10));
      MsgHeader h = headerOf(n, 1);
      uint64_t signal = 1;
      auto rest = r.engine->submit({{Opcode::kWrite, &h, 1, kBox, r.box->headerOffsetOf(0, 1), sizeof h},
                                    {Opcode::kWrite, &signal, 1, kBox, r.box->signalOffsetOf(0, 1), 8, true}});
      ASSERT_TRUE(rest->wait(seconds(10)));
      ASSERT_FALSE(rest->failed()) << rest->error();
      storeBarrier(*store, "sent", 2, seconds(10));
      // What the sender's own count says next: its second message.
      storeBarrier(*store, "refused", 2, seconds(10));
      auto next = payloadOf(2, n);
      MsgHeader h2 = headerOf(n, 2);
      uint64_t signal2 = 2;
      auto b = r.engine->submit({{Opcode::kWrite, next.data(), 1, kBox, r.box->headerOffsetOf(0, 2) + sizeof(MsgHeader), n},
                                 {Opcode::kWrite, &h2, 1, kBox, r.box->headerOffsetOf(0, 2), sizeof h2},
                                 {Opcode::kWrite, &signal2, 1, kBox, r.box->signalOffsetOf(0, 2), 8, true}});
      ASSERT_TRUE(b->wait(seconds(10)));
      storeBarrier(*store, "done", 2, seconds(10));
      return;
    }
    std::vector<char> landing(n, 0);
    r.box->landAhead(0, 0, landing.data(), landing.size());
    storeBarrier(*store, "expected", 2, seconds(10));
    storeBarrier(*store, "payload", 2, seconds(10));
    EXPECT_EQ(landing, payloadOf(1, n));
    const auto t0 = steady_clock::now();
    r.box->clearLandings(milliseconds(100));
    EXPECT_GE(steady_clock::now() - t0, milliseconds(100)) << "it did not wait for the rest of the message";
    storeBarrier(*store, "cleared", 2, seconds(10));
    storeBarrier(*store, "sent", 2, seconds(10));
    ASSERT_NE(waitForHead(*r.box, 0), nullptr);
    std::string error;
    EXPECT_EQ(r.box->payload(0, &error), nullptr);
    EXPECT_NE(error.find("rank 0's message #1 was being received into the memory of an op that failed"),
              std::string::npos)
        << error;
    r.box->release(0);
    storeBarrier(*store, "refused", 2, seconds(10));
    ASSERT_NE(waitForHead(*r.box, 0), nullptr);
    const char* got = r.box->payload(0, &error);
    ASSERT_NE(got, nullptr) << error;
    EXPECT_EQ(std::vector<char>(got, got + n), payloadOf(2, n));
    r.box->release(0);
    storeBarrier(*store, "done", 2, seconds(10));
  });
}

}  // namespace
