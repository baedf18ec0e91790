// The store records every engine reads from its peers (records.h), and what the engine does
// with the records of a rank someone else holds (claimRank) or a group of another size.
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "moelink/common/error.h"
#include "moelink/transfer/records.h"
#include "moelink/transfer/transfer_engine.h"

using namespace moelink::transfer;
using namespace std::chrono;

namespace {

EngineOptions opts(int rank, int world, bool extension = false) {
  EngineOptions o;
  o.rank = rank;
  o.world_size = world;
  o.transport = "tcp";
  o.timeout = seconds(5);
  o.extension = extension;
  return o;
}

std::string thrown(const std::function<void()>& f) {
  try {
    f();
  } catch (const moelink::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Records, NumbersAreParsedStrictly) {
  EXPECT_EQ(parseCount("0", "x"), 0u);
  EXPECT_EQ(parseCount("18446744073709551615", "x"), UINT64_MAX);
  for (const char* bad : {"", "-1", " 1", "1 ", "1x", "0x10", "18446744073709551616", "99999999999999999999999"})
    EXPECT_NE(thrown([&] { parseCount(bad, "counter"); }).find("malformed counter"), std::string::npos) << bad;
}

TEST(Records, EndpointRecordRoundTripsAndRejectsMalformedOnes) {
  PeerInfo me;
  me.host_id = "h/boot";
  me.tcp_address = "10.0.0.1:4242";
  me.pid = 77;
  me.start_time = 12345;
  me.pid_ns = "pid:[4026531836]";
  me.read_probe = 0x7f00aa;
  PeerInfo back = parseEndpointRecord(endpointRecord(me), 3);
  EXPECT_EQ(back.rank, 3);
  EXPECT_EQ(back.host_id, me.host_id);
  EXPECT_EQ(back.tcp_address, me.tcp_address);
  EXPECT_EQ(back.pid, 77);
  EXPECT_EQ(back.start_time, 12345u);
  EXPECT_EQ(back.pid_ns, me.pid_ns);
  EXPECT_EQ(back.read_probe, 0x7f00aau);
  for (const char* bad : {"", "h\n1.2.3.4:5", "h\n1.2.3.4:0\n7\n1\nns\n0", "h\n1.2.3.4:70000\n7\n1\nns\n0",
                          "h\nhost:5\n7\n1\nns\n0", "h\n1.2.3.4:5\n-7\n1\nns\n0", "h\n1.2.3.4:5\n0\n1\nns\n0",
                          "\n1.2.3.4:5\n7\n1\nns\n0", "h\n1.2.3.4:5\n7\nx\nns\n0", "h\n1.2.3.4:5\n7\n1\nns\n0\nextra"})
    EXPECT_NE(thrown([&] { parseEndpointRecord(bad, 3); }).find("endpoint record of rank 3"), std::string::npos) << bad;
}

TEST(Records, SegmentRecordMustNameTheSegmentAndMoelinkMemory) {
  SegmentDesc d{2, 5, 4096, "/moelink.1.2.3"};
  EXPECT_EQ(parseSegmentRecord(d.serialize(), 2, 5).length, 4096u);
  EXPECT_FALSE(thrown([&] { parseSegmentRecord(d.serialize(), 1, 5); }).empty());  // another rank's
  EXPECT_FALSE(thrown([&] { parseSegmentRecord(d.serialize(), 2, 6); }).empty());  // another segment
  for (const char* name : {"/other", "/moelink.x/../y", "moelink.1"}) {
    SegmentDesc e{2, 5, 64, name};
    EXPECT_NE(thrown([&] { parseSegmentRecord(e.serialize(), 2, 5); }).find("not moelink's"), std::string::npos);
  }
  EXPECT_FALSE(thrown([&] { parseSegmentRecord("2 5", 2, 5); }).empty());
}

// A second process (here: engine) for a rank that a live one holds is refused, and leaves the
// group's records as they were; once the holder is gone, the rank can be taken again.
TEST(RankClaim, LiveHolderRefusesNewcomer) {
  auto store = std::make_shared<InProcessStore>();
  TransferEngine zero(store, opts(0, 2));
  auto first = std::make_unique<TransferEngine>(store, opts(1, 2));
  const std::string record = store->get("engine/peer/1.1", seconds(1));
  const std::string why = thrown([&] { TransferEngine again(store, opts(1, 2)); });
  EXPECT_NE(why.find("rank 1 of this group is held by pid"), std::string::npos) << why;
  EXPECT_EQ(store->add("engine/incarnation/1", 0), 1);
  EXPECT_FALSE(store->check("engine/peer/1.2"));
  EXPECT_EQ(store->get("engine/peer/1.1", seconds(1)), record);
  // As an extension too: a replacement joins only for a rank whose process is gone.
  EXPECT_FALSE(thrown([&] { TransferEngine ext(store, opts(1, 2, true)); }).empty());
  first.reset();
  TransferEngine next(store, opts(1, 2, true));
  EXPECT_EQ(next.incarnation(), 2);
}

TEST(RankClaim, DifferentWorldSizeIsNamedOnBothSides) {
  auto store = std::make_shared<InProcessStore>();
  TransferEngine zero(store, opts(0, 2));
  const std::string why = thrown([&] { TransferEngine one(store, opts(1, 3)); });
  EXPECT_NE(why.find("rank 1 was started with world size 3, rank 0 with 2"), std::string::npos) << why;
  // A rank waiting for the group at a barrier fails at once with the same words.
  const auto t0 = steady_clock::now();
  const std::string waiting = thrown([&] { storeBarrier(*store, "b", 2, seconds(30), kRefusedKey); });
  EXPECT_NE(waiting.find("world size 3"), std::string::npos) << waiting;
  EXPECT_LT(steady_clock::now() - t0, seconds(5));
}
