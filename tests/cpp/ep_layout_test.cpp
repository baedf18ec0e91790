// EpLayout (include/moelink/ep/layout.h): the regions of a buffer half follow each other
// without overlap, on the alignments the kernels rely on, and bad sizes are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "moelink/common/error.h"
#include "moelink/ep/layout.h"

using moelink::ep::EpLayout;

namespace {

struct Region {
  const char* name;
  uint64_t begin, bytes;
};

std::vector<Region> regions(const EpLayout& l) {
  const uint64_t ranks = l.num_ranks;
  return {{"dispatch_x", l.off_dispatch_x, ranks * l.dispatch_col_bytes},
          {"dispatch_index", l.off_dispatch_index, ranks * l.index_col_bytes},
          {"dispatch_count", l.off_dispatch_count, ranks * l.countColBytes()},
          {"combine_x", l.off_combine_x, l.combineRegionBytes()},
          {"combine_flag", l.off_combine_flag, l.flagRegionBytes()},
          {"combine_route", l.off_combine_route, ranks * l.routeColBytes()},
          {"route_flag", l.off_route_flag, ranks * moelink::ep::kSignalBytes},
          {"dispatch_sent", l.off_dispatch_sent, l.sentBytes()}};
}

}  // namespace

TEST(EpLayout, RegionsFollowEachOtherAligned) {
  for (auto [ranks, experts, tokens, hidden] :
       std::vector<std::tuple<int, int, int, int>>{{1, 8, 1, 128},     {2, 256, 128, 7168}, {4, 256, 128, 7168},
                                                   {8, 256, 256, 7168}, {3, 9, 17, 384},     {16, 64, 1024, 2048}}) {
    const EpLayout l = EpLayout::make(ranks, experts, tokens, hidden);
    SCOPED_TRACE(::testing::Message() << ranks << " ranks, " << experts << " experts, " << tokens << " tokens, hidden "
                                      << hidden);
    EXPECT_EQ(l.num_local_experts * ranks, experts);
    EXPECT_EQ(l.dispatch_msg_bytes % 128, 0u);  // rows on 128-byte lines
    EXPECT_GE(l.dispatch_msg_bytes, 2ull * hidden);  // a bf16 row fits, so an e4m3 row with its scales does
    EXPECT_GE(2ull * hidden, static_cast<uint64_t>(hidden) + hidden / 128 * 4);
    EXPECT_EQ(l.index_col_bytes % 16, 0u);
    EXPECT_GE(l.index_col_bytes, static_cast<uint64_t>(l.num_local_experts) * tokens * 4);
    uint64_t end = 0;
    for (const Region& r : regions(l)) {
      EXPECT_EQ(r.begin % 128, 0u) << r.name;
      EXPECT_GE(r.begin, end) << r.name << " overlaps the region before it";
      end = r.begin + r.bytes;
    }
    EXPECT_GE(l.half_bytes, end);
    EXPECT_EQ(l.half_bytes % 4096, 0u);
    EXPECT_EQ(l.totalBytes(), 2 * l.half_bytes);
  }
}

TEST(EpLayout, SizeOfTheBenchmarkConfiguration) {
  // EP4, 128 tokens, hidden 7168, 256 experts: one row per (source, token), not per expert.
  const EpLayout l = EpLayout::make(4, 256, 128, 7168);
  EXPECT_EQ(l.dispatch_col_bytes, 128u * 14336u);
  EXPECT_LT(l.totalBytes(), 80ull << 20);
}

TEST(EpLayout, BadSizesAreRefused) {
  EXPECT_THROW(EpLayout::make(0, 8, 1, 128), moelink::Error);
  EXPECT_THROW(EpLayout::make(4, 10, 1, 128), moelink::Error);  // not a multiple of the ranks
  EXPECT_THROW(EpLayout::make(4, 2, 1, 128), moelink::Error);   // fewer experts than ranks
  EXPECT_THROW(EpLayout::make(4, 8, 0, 128), moelink::Error);
  EXPECT_THROW(EpLayout::make(4, 8, moelink::ep::kMaxTokensLimit + 1, 128), moelink::Error);
  EXPECT_THROW(EpLayout::make(4, 8, 1, 100), moelink::Error);   // not a multiple of 128
  EXPECT_THROW(EpLayout::make(4, 8, 1, 0), moelink::Error);
  try {
    EpLayout::make(4, 8, 1, 2000);
    FAIL() << "hidden 2000 accepted";
  } catch (const moelink::Error& e) {
    EXPECT_NE(std::string(e.what()).find("hidden (2000)"), std::string::npos) << e.what();
  }
}
