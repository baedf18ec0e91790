// storeAllAgree (moelink/transfer/metadata_store.h): every participant's answer counted once, a
// no heard by all, a participant that says no waiting for nobody, and the wait for one that
// never answers ending on cancellation or timeout.
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

}  // namespace
