// storeAllAgree (moelink/transfer/metadata_store.h): every participant's answer counted once, a
// no heard by all, a participant that says no waiting for nobody, and the wait for one that
// never answers ending on cancellation or timeout. storeLeaveHostLast: rank 0 returns only after
// every other rank's last store step, or once a missing one is gone, or at the timeout.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "moelink/transfer/metadata_store.h"
#include "test_support.h"

namespace {

using moelink::testing::runRanks;
using moelink::transfer::InProcessStore;
using moelink::transfer::storeAllAgree;
using moelink::transfer::storeLeaveHostLast;
using namespace std::chrono;

TEST(StoreAllAgree, AllYesAndOneNo) {
  InProcessStore store;
  constexpr int kRanks = 6;
  std::vector<int> all_yes(kRanks), one_no(kRanks);
  runRanks(kRanks, [&](int rank) {
    // Ranks answer at different times; every one waits for the last.
    std::this_thread::sleep_for(milliseconds(5 * rank));
    all_yes[rank] = storeAllAgree(store, "v1", kRanks, true, seconds(30));
    one_no[rank] = storeAllAgree(store, "v2", kRanks, rank != 3, seconds(30));
  });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(all_yes[r]) << "rank " << r;
    EXPECT_FALSE(one_no[r]) << "rank " << r;
  }
}

TEST(StoreAllAgree, NoWaitsForNobodyAndYesGivesUp) {
  InProcessStore store;
  // A participant that says no returns at once though the others never answer.
  const auto t0 = steady_clock::now();
  EXPECT_FALSE(storeAllAgree(store, "v", 4, false, seconds(30)));
  EXPECT_LT(steady_clock::now() - t0, seconds(5));
  // One that says yes while a participant never answers: false when cancelled, or at the timeout.
  std::atomic<bool> cancel{false};
  std::thread later([&] {
    std::this_thread::sleep_for(milliseconds(50));
    cancel = true;
  });
  EXPECT_FALSE(storeAllAgree(store, "w", 3, true, seconds(30), [&] { return cancel.load(); }));
  later.join();
  EXPECT_FALSE(storeAllAgree(store, "x", 2, true, milliseconds(100)));
}

TEST(StoreLeaveHostLast, RankZeroLeavesAfterTheOthers) {
  InProcessStore store;
  constexpr int kRanks = 4;
  std::atomic<int> left{0};
  std::atomic<int> seen_by_zero{-1};
  runRanks(kRanks, [&](int rank) {
    if (rank == 0) {
      storeLeaveHostLast(store, "s", 0, kRanks, seconds(30), [](int) { return std::string(); });
      seen_by_zero = left.load();
      return;
    }
    std::this_thread::sleep_for(milliseconds(60 * rank));  // the last one long after rank 0 arrived
    left.fetch_add(1);
    storeLeaveHostLast(store, "s", rank, kRanks, seconds(30), nullptr);
  });
  EXPECT_EQ(seen_by_zero.load(), kRanks - 1);
}

TEST(StoreLeaveHostLast, AGoneRankIsNotWaitedForAndAWedgedOneUntilTheTimeout) {
  InProcessStore store;
  storeLeaveHostLast(store, "t", 1, 3, seconds(30), nullptr);  // rank 1 leaves; rank 2 never does
  std::atomic<int> asked{0};
  auto t0 = steady_clock::now();
  storeLeaveHostLast(store, "t", 0, 3, seconds(30), [&](int r) {
    asked.fetch_add(1);
    EXPECT_EQ(r, 2);  // rank 1 has left: only the missing one is asked about
    return std::string("its process has exited");
  });
  EXPECT_LT(steady_clock::now() - t0, seconds(10));
  EXPECT_EQ(asked.load(), 1);
  t0 = steady_clock::now();
  storeLeaveHostLast(store, "u", 0, 2, milliseconds(300), [](int) { return std::string(); });
  const auto waited = steady_clock::now() - t0;
  EXPECT_GE(waited, milliseconds(300));
  EXPECT_LT(waited, seconds(10));
}

}  // namespace
