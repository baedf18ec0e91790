#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>

#include <gtest/gtest.h>

#include "moelink/transfer/tcp/transport.h"
#include "moelink/transfer/transfer_engine.h"
#include "tcp_raw.h"
#include "test_support.h"

using namespace moelink::transfer;
using moelink::testing::pattern;
using moelink::testing::rawAuthenticated;
using moelink::testing::rawConnect;
using moelink::testing::readWithTimeout;
using moelink::testing::runRanks;
using namespace std::chrono;

namespace {

EngineOptions opts(int rank, int world, const std::string& transport) {
  EngineOptions o;
  o.rank = rank;
  o.world_size = world;
  o.transport = transport;
  o.timeout = seconds(30);
  return o;
}

class TransferEngineTest
    : public ::testing::TestWithParam<std::tuple<std::string, int, uint64_t>> {};

// Every rank writes its pattern into its right neighbour's segment, then reads back from
// that neighbour what it wrote, through the transport under test.
TEST_P(TransferEngineTest, RingWriteThenRead) {
  auto [transport, world, bytes] = GetParam();
  auto store = std::make_shared<InProcessStore>();
  runRanks(world, [&, transport = transport, world = world, bytes = bytes](int rank) {
    TransferEngine engine(store, opts(rank, world, transport));
    char* seg = static_cast<char*>(engine.allocateSegment(7, bytes));
    std::vector<char> mine(bytes), back(bytes, 0);
    for (uint64_t i = 0; i < bytes; ++i) mine[i] = static_cast<char>(pattern(rank, i));
    int right = (rank + 1) % world, left = (rank + world - 1) % world;
    std::string via = engine.openSegment(right, 7);
    EXPECT_EQ(via, world == 1 ? "local" : transport);
    // Split into up to 8 requests in one batch to exercise batching and ordering.
    std::vector<TransferRequest> reqs;
    uint64_t piece = std::max<uint64_t>(1, (bytes + 7) / 8);
    for (uint64_t off = 0; off < bytes; off += piece)
      reqs.push_back({Opcode::kWrite, mine.data() + off, right, 7, off, std::min(piece, bytes - off)});
    if (reqs.empty()) reqs.push_back({Opcode::kWrite, mine.data(), right, 7, 0, 0});
    auto batch = engine.submit(reqs);
    ASSERT_TRUE(batch->wait(seconds(60)));
    ASSERT_FALSE(batch->failed()) << batch->error();
    storeBarrier(*store, "written", world, seconds(60));
    for (uint64_t i = 0; i < bytes; ++i)
      ASSERT_EQ(static_cast<uint8_t>(seg[i]), pattern(left, i)) << "byte " << i;
    auto rd = engine.submit({{Opcode::kRead, back.data(), right, 7, 0, bytes}});
    ASSERT_TRUE(rd->wait(seconds(60)));
    ASSERT_FALSE(rd->failed()) << rd->error();
    if (bytes) {
      ASSERT_EQ(0, std::memcmp(back.data(), mine.data(), bytes));
    }
    storeBarrier(*store, "read", world, seconds(60));
  });
}

std::string paramName(const ::testing::TestParamInfo<TransferEngineTest::ParamType>& info) {
  return std::get<0>(info.param) + "_w" + std::to_string(std::get<1>(info.param)) + "_b" +
         std::to_string(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Small, TransferEngineTest,
                         ::testing::Combine(::testing::Values("tcp", "shm"),
                                            ::testing::Values(2, 3, 4, 7),
                                            ::testing::Values(0, 1, 8, 4097, 1 << 20)),
                         paramName);
INSTANTIATE_TEST_SUITE_P(Large, TransferEngineTest,
                         ::testing::Combine(::testing::Values("tcp", "shm"),
                                            ::testing::Values(2, 4),
                                            ::testing::Values(64ull << 20)),
                         paramName);

TEST(TransferEngine, OutOfBoundsRequestFailsLocally) {
  auto store = std::make_shared<InProcessStore>();
  runRanks(2, [&](int rank) {
    TransferEngine engine(store, opts(rank, 2, "tcp"));
    engine.allocateSegment(1, 100);
    engine.openSegment(1 - rank, 1);
    char buf[64] = {0};
    auto b = engine.submit({{Opcode::kWrite, buf, 1 - rank, 1, 90, 64}});
    ASSERT_TRUE(b->wait(seconds(5)));
    EXPECT_TRUE(b->failed());
    EXPECT_NE(b->error().find("outside segment"), std::string::npos) << b->error();
    auto unopened = engine.submit({{Opcode::kWrite, buf, 1 - rank, 99, 0, 1}});
    EXPECT_TRUE(unopened->failed());
    storeBarrier(*store, "done", 2, seconds(10));
  });
}

TEST(TcpTransport, ReceiverRejectsOutOfBoundsWrite) {
  auto store = std::make_shared<InProcessStore>();
  TransferEngine engine(store, opts(0, 1, "tcp"));
  char* seg = static_cast<char*>(engine.allocateSegment(3, 64));
  int fd = rawAuthenticated(engine);
  ASSERT_GE(fd, 0) << "handshake refused";
  namespace w = moelink::transfer::tcp::wire;
  char payload[32];
  std::memset(payload, 0xAB, sizeof payload);
  w::FrameHeader h{w::kWrite, 0, 1, 3, 0, 48, sizeof payload};  // 48 + 32 > 64
  send(fd, &h, sizeof h, 0);
  send(fd, payload, sizeof payload, 0);
  w::FrameHeader ack{};
  ASSERT_TRUE(readWithTimeout(fd, &ack, sizeof ack, 5000));
  EXPECT_EQ(ack.type, w::kWriteAck);
  EXPECT_EQ(ack.request_id, 1u);
  EXPECT_EQ(ack.status, w::kOutOfBounds);
  for (int i = 0; i < 64; ++i) ASSERT_EQ(seg[i], 0) << "segment modified at " << i;
  // A write inside the bounds on the same connection still works.
  w::FrameHeader ok{w::kWrite, 0, 2, 3, 0, 0, sizeof payload};
  send(fd, &ok, sizeof ok, 0);
  send(fd, payload, sizeof payload, 0);
  ASSERT_TRUE(readWithTimeout(fd, &ack, sizeof ack, 5000));
  EXPECT_EQ(ack.status, w::kOk);
  EXPECT_EQ(static_cast<uint8_t>(seg[0]), 0xAB);
  close(fd);
}

// Writes sent with kNoAck are acknowledged only when rejected: each rejected one at once, with
// its own request id, offset and length; accepted ones never.
TEST(TcpTransport, UnacknowledgedWritesAreAcknowledgedOnlyWhenRejected) {
  auto store = std::make_shared<InProcessStore>();
  TransferEngine engine(store, opts(0, 1, "tcp"));
  char* seg = static_cast<char*>(engine.allocateSegment(3, 64));
  int fd = rawAuthenticated(engine);
  ASSERT_GE(fd, 0) << "handshake refused";
  namespace w = moelink::transfer::tcp::wire;
  char payload[16];
  std::memset(payload, 0x5A, sizeof payload);
  auto write = [&](uint64_t id, uint64_t offset, uint32_t flags) {
    w::FrameHeader h{w::kWrite, 0, id, 3, flags, offset, sizeof payload};
    send(fd, &h, sizeof h, 0);
    send(fd, payload, sizeof payload, 0);
  };
  w::FrameHeader ack{};
  write(1, 0, w::kNoAck);    // fine, no ack
  write(2, 56, w::kNoAck);   // 56 + 16 > 64: rejected, reported now
  ASSERT_TRUE(readWithTimeout(fd, &ack, sizeof ack, 5000));
  EXPECT_EQ(ack.type, w::kWriteAck);
  EXPECT_EQ(ack.request_id, 2u);
  EXPECT_EQ(ack.status, w::kOutOfBounds);
  EXPECT_EQ(ack.offset, 56u);
  EXPECT_EQ(ack.length, sizeof payload);
  write(3, 60, w::kNoAck);   // rejected too, reported on its own
  ASSERT_TRUE(readWithTimeout(fd, &ack, sizeof ack, 5000));
  EXPECT_EQ(ack.request_id, 3u);
  EXPECT_EQ(ack.status, w::kOutOfBounds);
  write(4, 16, w::kNoAck);   // fine
  write(5, 32, 0);           // acknowledged: clean
  ASSERT_TRUE(readWithTimeout(fd, &ack, sizeof ack, 5000));
  EXPECT_EQ(ack.request_id, 5u);
  EXPECT_EQ(ack.status, w::kOk);
  for (int i = 0; i < 48; ++i) ASSERT_EQ(static_cast<uint8_t>(seg[i]), 0x5A) << "byte " << i;
  for (int i = 48; i < 64; ++i) ASSERT_EQ(seg[i], 0) << "rejected write landed at " << i;
  pollfd pf{fd, POLLIN, 0};
  EXPECT_EQ(0, poll(&pf, 1, 200)) << "an acknowledgement came for an accepted kNoAck write";
  close(fd);
}

// The sender's side: a kNoAck write that its receiver rejects (here: the receiver registered its
// segment again, smaller, after the sender opened it) has completed already, so the rejection
// breaks the connection, naming it: later requests to that peer fail at once with that reason.
TEST(TcpTransport, RejectedUnacknowledgedWriteBreaksTheConnection) {
  auto store = std::make_shared<InProcessStore>();
  auto e0 = std::make_unique<TransferEngine>(store, opts(0, 2, "tcp"));
  auto e1 = std::make_unique<TransferEngine>(store, opts(1, 2, "tcp"));
  e0->allocateSegment(1, 64);
  std::vector<char> big(4096, 0), small(64, 0);
  e1->registerSegment(1, big.data(), big.size());
  e0->openSegment(1, 1);
  e1->unregisterSegment(1);
  e1->registerSegment(1, small.data(), small.size());
  std::vector<char> buf(256, 7);
  TransferRequest w{Opcode::kWrite, buf.data(), 1, 1, 1024, buf.size()};
  w.no_ack = true;
  auto b = e0->submit({w});
  ASSERT_TRUE(b->wait(seconds(10)));
  EXPECT_FALSE(b->failed()) << "completes once sent: " << b->error();
  auto t0 = steady_clock::now();
  std::string reason;
  while (reason.empty() && steady_clock::now() - t0 < seconds(10)) {
    reason = e0->lostReason(1);
    std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_NE(reason.find("rejected a write of 256 bytes at offset 1024"), std::string::npos) << reason;
  auto next = e0->submit({{Opcode::kWrite, buf.data(), 1, 1, 0, 8}});
  ASSERT_TRUE(next->wait(seconds(10)));
  EXPECT_TRUE(next->failed());
  EXPECT_NE(next->error().find("rejected a write"), std::string::npos) << next->error();
  for (char c : small) ASSERT_EQ(c, 0);
  for (char c : big) ASSERT_EQ(c, 0);
}

// The secret alone does not open a connection: the rank it claims must be one of the group,
// and the lane below kMaxStreams.
TEST(TcpTransport, HandshakeNamingNoRankOfTheGroupIsRefused) {
  auto store = std::make_shared<InProcessStore>();
  TransferEngine engine(store, opts(0, 2, "tcp"));
  EXPECT_LT(rawAuthenticated(engine, 2), 0);
  EXPECT_LT(rawAuthenticated(engine, -1), 0);
  EXPECT_LT(rawAuthenticated(engine, 1, moelink::transfer::tcp::kMaxStreams), 0);
  EXPECT_LT(rawAuthenticated(engine, 1, -1), 0);
  int fd = rawAuthenticated(engine, 1);
  EXPECT_GE(fd, 0);
  if (fd >= 0) close(fd);
}

TEST(TcpTransport, UnauthenticatedConnectionIsClosed) {
  auto store = std::make_shared<InProcessStore>();
  TransferEngine engine(store, opts(0, 1, "tcp"));
  char* seg = static_cast<char*>(engine.allocateSegment(3, 64));
  int fd = rawConnect(engine.tcpAddress());
  namespace w = moelink::transfer::tcp::wire;
  w::Hello hello{w::kHelloMagic, engine.secret() + 1, 5, 0, 0};
  send(fd, &hello, sizeof hello, MSG_NOSIGNAL);
  char payload[16];
  std::memset(payload, 0xCD, sizeof payload);
  w::FrameHeader h{w::kWrite, 0, 1, 3, 0, 0, sizeof payload};
  send(fd, &h, sizeof h, MSG_NOSIGNAL);
  send(fd, payload, sizeof payload, MSG_NOSIGNAL);
  char c;
  EXPECT_FALSE(readWithTimeout(fd, &c, 1, 5000));  // closed without a reply
  for (int i = 0; i < 64; ++i) ASSERT_EQ(seg[i], 0);
  close(fd);
}

TEST(TcpTransport, IdleConnectionFloodIsBoundedAndExpires) {
  // 300 connections that never send a handshake: beyond the cap they are dropped at once, the
  // rest within the handshake deadline, and two engines keep talking throughout.
  auto store = std::make_shared<InProcessStore>();
  auto e0 = std::make_unique<TransferEngine>(store, opts(0, 2, "tcp"));
  auto e1 = std::make_unique<TransferEngine>(store, opts(1, 2, "tcp"));
  e1->allocateSegment(1, 4096);
  std::vector<int> idle;
  for (int i = 0; i < 300; ++i) idle.push_back(rawConnect(e1->tcpAddress()));
  e0->openSegment(1, 1);
  std::vector<char> buf(4096, 7);
  auto b = e0->submit({{Opcode::kWrite, buf.data(), 1, 1, 0, buf.size()}});
  ASSERT_TRUE(b->wait(seconds(10)));
  ASSERT_FALSE(b->failed()) << b->error();
  // Every idle connection is closed by the server (EOF) within the deadline plus slack.
  auto deadline = steady_clock::now() + seconds(12);
  size_t closed = 0;
  for (int fd : idle) {
    char c;
    int left = static_cast<int>(std::chrono::duration_cast<milliseconds>(deadline - steady_clock::now()).count());
    pollfd pf{fd, POLLIN, 0};
    if (left > 0 && poll(&pf, 1, left) > 0 && recv(fd, &c, 1, 0) == 0) ++closed;
    close(fd);
  }
  EXPECT_EQ(closed, idle.size());
}

TEST(TcpTransport, PeerGoingAwayFailsRequests) {
  auto store = std::make_shared<InProcessStore>();
  auto e0 = std::make_unique<TransferEngine>(store, opts(0, 2, "tcp"));
  auto e1 = std::make_unique<TransferEngine>(store, opts(1, 2, "tcp"));
  e0->allocateSegment(1, 1 << 20);
  e1->allocateSegment(1, 1 << 20);
  e0->openSegment(1, 1);
  std::vector<char> buf(1 << 20, 1);
  auto ok = e0->submit({{Opcode::kWrite, buf.data(), 1, 1, 0, buf.size()}});
  ASSERT_TRUE(ok->wait(seconds(10)));
  ASSERT_FALSE(ok->failed());
  e1.reset();  // the peer goes away
  auto t0 = steady_clock::now();
  bool failed = false;
  for (int i = 0; i < 50 && !failed; ++i) {
    auto b = e0->submit({{Opcode::kWrite, buf.data(), 1, 1, 0, buf.size()}});
    ASSERT_TRUE(b->wait(seconds(10))) << "a request to a departed peer hung";
    failed = b->failed();
    if (failed) {
      EXPECT_NE(b->error().find("rank 1"), std::string::npos) << b->error();
    }
  }
  EXPECT_TRUE(failed);
  EXPECT_LT(steady_clock::now() - t0, seconds(20));
}

TEST(ShmTransport, NamesAreUnlinkedAfterSetup) {
  auto store = std::make_shared<InProcessStore>();
  runRanks(2, [&](int rank) {
    TransferEngine engine(store, opts(rank, 2, "shm"));
    engine.allocateSegment(1, 4096);
    storeBarrier(*store, "alloc", 2, seconds(10));
    engine.openSegment(1 - rank, 1);
    storeBarrier(*store, "open", 2, seconds(10));
    engine.unlinkSharedNames();
    storeBarrier(*store, "unlinked", 2, seconds(10));
    // Still usable after unlinking.
    uint64_t v = 0x1122334455667788ull;
    auto b = engine.submit({{Opcode::kWrite, &v, 1 - rank, 1, 8, 8}});
    ASSERT_TRUE(b->wait(seconds(5)));
    EXPECT_FALSE(b->failed());
  });
}

}  // namespace

namespace {

// Receive redirection: an expected tcp write lands at the destination given, exactly once;
// without an expectation (or once claimed) writes land in the segment.
TEST(TcpTransport, ExpectedWriteLandsAtDestination) {
  auto store = std::make_shared<InProcessStore>();
  runRanks(2, [&](int rank) {
    TransferEngine engine(store, opts(rank, 2, "tcp"));
    char* seg = static_cast<char*>(engine.allocateSegment(4, 4096));
    storeBarrier(*store, "alloc", 2, seconds(10));
    engine.openSegment(1 - rank, 4);
    std::vector<char> dest(1024, 0);
    if (rank == 1) engine.expectWrite(4, 512, dest.data(), dest.size());
    storeBarrier(*store, "expected", 2, seconds(10));
    if (rank == 0) {
      std::vector<char> a(1000, 'a'), b(1000, 'b');
      auto b1 = engine.submit({{Opcode::kWrite, a.data(), 1, 4, 512, a.size()}});
      ASSERT_TRUE(b1->wait(seconds(10)));
      ASSERT_FALSE(b1->failed());
      storeBarrier(*store, "first", 2, seconds(10));
      storeBarrier(*store, "claimed", 2, seconds(10));
      auto b2 = engine.submit({{Opcode::kWrite, b.data(), 1, 4, 512, b.size()}});
      ASSERT_TRUE(b2->wait(seconds(10)));
      storeBarrier(*store, "second", 2, seconds(10));
    } else {
      storeBarrier(*store, "first", 2, seconds(10));
      EXPECT_EQ(engine.claimExpected(4, 512), dest.data());
      EXPECT_EQ(dest[0], 'a');
      EXPECT_EQ(dest[999], 'a');
      EXPECT_EQ(seg[512], 0) << "the redirected write also touched the segment";
      EXPECT_EQ(engine.claimExpected(4, 512), nullptr);  // claimed once
      storeBarrier(*store, "claimed", 2, seconds(10));
      storeBarrier(*store, "second", 2, seconds(10));
      EXPECT_EQ(seg[512], 'b');  // no expectation: the segment receives it
      EXPECT_EQ(dest[0], 'a');
    }
  });
}

}  // namespace
