// The two-level route's ranks (moelink/cuda/two_level.h): hosts of consecutive or interleaved
// ranks, a rail per position, and the layouts where the route does not apply.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moelink/cuda/two_level.h"

namespace {

using moelink::cuda::twoLevelRanks;

// Rank q's host is hosts[q].
auto hostsOf(const std::string& hosts) {
  return [hosts](int q) { return std::string(1, hosts[q]); };
}

TEST(TwoLevelRanks, ConsecutiveHosts) {
  // 2 hosts of 2: {0, 1} and {2, 3}; rails {0, 2} and {1, 3}.
  auto r0 = twoLevelRanks(4, 0, hostsOf("AABB"), 8);
  ASSERT_TRUE(r0);
  EXPECT_EQ(r0->local, (std::vector<int>{0, 1}));
  EXPECT_EQ(r0->me, 0);
  EXPECT_EQ(r0->rail, (std::vector<int>{0, 2}));
  EXPECT_EQ(r0->hosts, 2);
  auto r3 = twoLevelRanks(4, 3, hostsOf("AABB"), 8);
  ASSERT_TRUE(r3);
  EXPECT_EQ(r3->local, (std::vector<int>{2, 3}));
  EXPECT_EQ(r3->me, 1);
  EXPECT_EQ(r3->rail, (std::vector<int>{1, 3}));
}

TEST(TwoLevelRanks, InterleavedHostsAndLargeGroups) {
  // Hosts {0, 2} and {1, 3}: rank 2 is position 1 of its host, its rail {2, 3}.
  auto r2 = twoLevelRanks(4, 2, hostsOf("ABAB"), 8);
  ASSERT_TRUE(r2);
  EXPECT_EQ(r2->local, (std::vector<int>{0, 2}));
  EXPECT_EQ(r2->me, 1);
  EXPECT_EQ(r2->rail, (std::vector<int>{2, 3}));
  // 2 hosts of 8 (16 ranks) and 3 hosts of 3: every rail has a rank of every host.
  auto r9 = twoLevelRanks(16, 9, hostsOf("AAAAAAAABBBBBBBB"), 8);
  ASSERT_TRUE(r9);
  EXPECT_EQ(r9->me, 1);
  EXPECT_EQ(r9->rail, (std::vector<int>{1, 9}));
  auto r4 = twoLevelRanks(9, 4, hostsOf("CCCAAABBB"), 8);
  ASSERT_TRUE(r4);
  EXPECT_EQ(r4->local, (std::vector<int>{3, 4, 5}));
  EXPECT_EQ(r4->rail, (std::vector<int>{1, 4, 7}));
  EXPECT_EQ(r4->hosts, 3);
  // Every rank of a group finds the same rails: each rank is on exactly one.
  for (int q = 0; q < 16; ++q) {
    auto r = twoLevelRanks(16, q, hostsOf("ABABABABABABABAB"), 8);
    ASSERT_TRUE(r);
    for (int p : r->rail) EXPECT_EQ(twoLevelRanks(16, p, hostsOf("ABABABABABABABAB"), 8)->rail, r->rail);
  }
  // Every rank knows every position's rail alike (the two-level all_gather places the blocks by
  // them); hosts {0, 3} and {1, 2}: a host's place on a rail differs between the rails.
  for (int q = 0; q < 4; ++q) {
    auto r = twoLevelRanks(4, q, hostsOf("ABBA"), 8);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->rails, (std::vector<std::vector<int>>{{0, 1}, {2, 3}})) << "rank " << q;
    EXPECT_EQ(r->rail, r->rails[static_cast<size_t>(r->me)]) << "rank " << q;
  }
}

TEST(TwoLevelRanks, DoesNotApply) {
  EXPECT_FALSE(twoLevelRanks(4, 0, hostsOf("AAAA"), 8));   // one host
  EXPECT_FALSE(twoLevelRanks(2, 0, hostsOf("AB"), 8));     // hosts of one rank: the flat route
  EXPECT_FALSE(twoLevelRanks(5, 0, hostsOf("AAABB"), 8));  // hosts of different sizes
  EXPECT_FALSE(twoLevelRanks(5, 4, hostsOf("AAABB"), 8));
  EXPECT_FALSE(twoLevelRanks(18, 0, hostsOf("AAAAAAAAABBBBBBBBB"), 8));  // more ranks on a host than the kernels take
}

}  // namespace
