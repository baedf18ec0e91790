#include "moelink/ep/layout.h"

#include "moelink/common/error.h"

namespace moelink::ep {

namespace {
uint64_t align(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
}  // namespace

EpLayout EpLayout::make(int num_ranks, int num_experts, int max_tokens, int hidden) {
  MOELINK_CHECK(num_ranks >= 1, "the group has no ranks");
  MOELINK_CHECK(num_experts >= num_ranks && num_experts % num_ranks == 0, "num_experts (", num_experts,
                ") must be a positive multiple of the group size (", num_ranks, ")");
  MOELINK_CHECK(max_tokens >= 1 && max_tokens <= kMaxTokensLimit, "num_max_dispatch_tokens_per_rank must be 1..",
                kMaxTokensLimit, ", got ", max_tokens);
  MOELINK_CHECK(hidden >= kHiddenAlign && hidden % kHiddenAlign == 0, "hidden (", hidden,
                ") must be a positive multiple of ", kHiddenAlign);
  EpLayout l;
  l.num_ranks = num_ranks;
  l.num_experts = num_experts;
  l.num_local_experts = num_experts / num_ranks;
  l.max_tokens = max_tokens;
  l.hidden = hidden;
  // A bf16 payload (2 bytes per element) is larger than e4m3 + scales, so it sizes the row.
  // Rows start on 128-byte lines, so that stores cover whole lines (partial-line writes
  // over NVLink travel as masked writes and waste link bandwidth).
  l.dispatch_msg_bytes = align(2ull * hidden, 128);
  l.combine_msg_bytes = 2ull * hidden;
  l.dispatch_col_bytes = static_cast<uint64_t>(max_tokens) * l.dispatch_msg_bytes;
  l.index_col_bytes = align(static_cast<uint64_t>(l.num_local_experts) * max_tokens * 4, 16);
  l.off_dispatch_x = 0;
  l.off_dispatch_index = align(l.off_dispatch_x + num_ranks * l.dispatch_col_bytes, 128);
  l.off_dispatch_count = align(l.off_dispatch_index + num_ranks * l.index_col_bytes, 128);
  l.off_combine_x = align(l.off_dispatch_count + num_ranks * l.countColBytes(), 128);
  l.off_combine_flag = align(l.off_combine_x + l.combineRegionBytes(), 128);
  l.off_combine_route = align(l.off_combine_flag + l.flagRegionBytes(), 128);
  l.off_route_flag = align(l.off_combine_route + num_ranks * l.routeColBytes(), 128);
  l.off_dispatch_sent = align(l.off_route_flag + static_cast<uint64_t>(num_ranks) * kSignalBytes, 128);
  l.half_bytes = align(l.off_dispatch_sent + l.sentBytes(), 4096);
  return l;
}

}  // namespace moelink::ep
