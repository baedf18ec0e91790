// The normal-mode route decision (include/moelink/ep/routes.h) against the cases a group meets:
// one NVLink host, hosts of several ranks, masked-out ranks, a buffer not yet reconnected,
// no GPU, virtual hosts from MOELINK_EP_RANKS_PER_HOST, and layouts the two-hop route refuses.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moelink/common/error.h"
#include "moelink/ep/routes.h"

using moelink::ep::agreedRanksPerHost;
using moelink::ep::chooseNormalRoute;
using moelink::ep::NormalRoute;
using moelink::ep::ranksPerHostSeen;
using moelink::ep::RouteFacts;
using moelink::ep::twoHopRanksPerHost;

namespace {

// A group of `world` ranks on hosts of `per_host` consecutive ranks, seen from `rank`, with
// the GPU buffer's paths (NVLink inside the host, `across` between hosts) when `kernels`,
// else the backend's transports (shm inside the host, tcp between hosts).
RouteFacts group(int rank, int world, int per_host, bool kernels, const std::string& across = "proxy") {
  RouteFacts f;
  f.rank = rank;
  f.world = world;
  f.active.assign(world, 1);
  f.kernels = kernels;
  f.connected = true;
  for (int r = 0; r < world; ++r) {
    const bool here = r / per_host == rank / per_host;
    if (kernels) {
      f.kernel_paths.push_back(r == rank ? "local" : here ? "nvlink" : across);
    } else {
      f.group_paths.push_back(r == rank ? "local" : here ? "shm" : "tcp");
    }
  }
  return f;
}

}  // namespace

TEST(EpRoutes, OneNvlinkHostTakesTheKernels) {
  for (int world : {2, 4, 8}) {
    for (int rank = 0; rank < world; ++rank) {
      auto f = group(rank, world, world, true);
      EXPECT_EQ(chooseNormalRoute(f), NormalRoute::kNvlink) << world << " " << rank;
      EXPECT_EQ(ranksPerHostSeen(f), 0) << "one host is no two-hop layout";
    }
  }
}

TEST(EpRoutes, MoreThanEightRanksOnNvlinkAskTheGroup) {
  auto f = group(3, 16, 16, true);
  EXPECT_EQ(chooseNormalRoute(f), NormalRoute::kAsk);  // the kernels serve at most 8 ranks
  EXPECT_EQ(ranksPerHostSeen(f), 0);                    // nor is one host of 16 a two-hop layout
}

TEST(EpRoutes, HostsOfSeveralRanksSeeTheirHostSize) {
  for (bool kernels : {true, false}) {
    for (int per_host : {2, 4, 8}) {
      const int world = per_host * 2;
      for (int rank = 0; rank < world; ++rank) {
        auto f = group(rank, world, per_host, kernels);
        EXPECT_EQ(chooseNormalRoute(f), NormalRoute::kAsk) << kernels << per_host << rank;
        EXPECT_EQ(ranksPerHostSeen(f), per_host) << kernels << per_host << rank;
      }
    }
  }
  auto ibgda = group(5, 8, 4, true, "ibgda");
  EXPECT_EQ(ranksPerHostSeen(ibgda), 4);
}

TEST(EpRoutes, AMaskedOutRankMeansTheGroupPath) {
  for (bool kernels : {true, false}) {
    auto f = group(0, 4, 4, kernels);
    f.active[2] = 0;
    EXPECT_EQ(chooseNormalRoute(f), NormalRoute::kGroup);
  }
}

TEST(EpRoutes, ABufferNotReconnectedMeansTheGroupPath) {
  auto f = group(1, 4, 4, true);
  f.connected = false;
  EXPECT_EQ(chooseNormalRoute(f), NormalRoute::kGroup);
  auto cpu = group(1, 4, 4, false);
  cpu.connected = false;  // no GPU buffer involved: the host path follows the group by itself
  EXPECT_EQ(chooseNormalRoute(cpu), NormalRoute::kAsk);
}

TEST(EpRoutes, TwoHopSwitchedOffSeesNoHosts) {
  auto f = group(2, 8, 4, true);
  f.two_hop = false;
  EXPECT_EQ(ranksPerHostSeen(f), 0);
}

TEST(EpRoutes, VirtualHostsComeFromTheSettingWithoutKernels) {
  auto f = group(5, 8, 8, false);  // one real host: every peer over shm
  EXPECT_EQ(ranksPerHostSeen(f), 0);
  f.ranks_per_host = 2;
  f.group_paths.clear();  // not consulted when the setting names the hosts
  EXPECT_EQ(ranksPerHostSeen(f), 2);
  f.ranks_per_host = 3;  // 8 ranks are no whole number of hosts of 3
  EXPECT_EQ(ranksPerHostSeen(f), 0);
}

TEST(EpRoutes, LayoutsTheTwoHopRouteRefuses) {
  EXPECT_EQ(twoHopRanksPerHost(0, 8, {0}), 0);                       // a host of one
  EXPECT_EQ(twoHopRanksPerHost(0, 8, {0, 1, 2}), 0);                 // 8 ranks are no hosts of 3
  EXPECT_EQ(twoHopRanksPerHost(1, 4, {1, 2}), 0);                    // not an aligned block
  EXPECT_EQ(twoHopRanksPerHost(2, 4, {0, 2}), 0);                    // not consecutive
  EXPECT_EQ(twoHopRanksPerHost(0, 4, {0, 1, 2, 3}), 0);              // one host
  EXPECT_EQ(twoHopRanksPerHost(0, 32, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}), 0);  // over 8
  EXPECT_EQ(twoHopRanksPerHost(6, 8, {7, 6, 5, 4}), 4);              // order does not matter
  EXPECT_EQ(twoHopRanksPerHost(3, 6, {3, 4, 5}), 3);
}

TEST(EpRoutes, TheGroupMustAgree) {
  EXPECT_EQ(agreedRanksPerHost(4, 4), 4);
  EXPECT_EQ(agreedRanksPerHost(4, 0), 0);  // one rank sees no two-hop layout
  EXPECT_EQ(agreedRanksPerHost(4, 2), 0);  // the ranks see different hosts
  EXPECT_EQ(agreedRanksPerHost(0, 0), 0);
  EXPECT_EQ(agreedRanksPerHost(16, 16), 0);
}

TEST(EpRoutes, FactsThatDoNotFitTheGroupAreRefused) {
  auto f = group(0, 4, 2, true);
  f.active.pop_back();
  EXPECT_THROW(chooseNormalRoute(f), moelink::Error);
  auto g = group(0, 4, 2, true);
  g.kernel_paths.resize(2);
  EXPECT_THROW(ranksPerHostSeen(g), moelink::Error);
  auto h = group(0, 4, 2, false);
  h.rank = 4;
  EXPECT_THROW(chooseNormalRoute(h), moelink::Error);
}
