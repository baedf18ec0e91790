// EpLayout: where everything lives in an EP buffer, and what sizes are allowed.
//
// Every rank allocates one GPU buffer with the same layout; peers write into it directly
// (NVLink: through CUDA IPC mappings). It holds two halves used by alternate rounds, so
// that a round's dispatch can start while the previous round's buffers are still read.
// One half:
//   dispatch_x     [source rank][source token] rows of dispatch_msg_bytes: the token's
//                  payload (bf16 hidden, or e4m3 hidden + float scales per 128 elements).
//                  A token goes to a rank once, however many of the rank's experts it
//                  selected (its top-k entries there share the row).
//   dispatch_index [source rank][local expert][slot] int32: which row each slot holds,
//                  as token * kMaxTopk + top-k slot. The sender claims slots per expert
//                  (atomicAdd) and writes them along with the rows.
//   dispatch_count [source rank][local expert], 8 bytes each (an int32 in the low half),
//                  written by the source after the expert's slots and rows: -n-1 for n
//                  tokens, so that 0 means "not arrived" (the receiver resets it to 0
//                  after reading)
//   combine_x      [token][top-k slot] bf16 hidden: the weighted sum of the token's
//                  expert outputs at one rank, returning to the token's rank in the slot
//                  of the token's first top-k entry at that rank
//   combine_flag   [token][top-k slot], 8 bytes each: the expert's rank writes 1 after
//                  the row (the token's rank resets it after reading)
//   combine_route  [source rank][token * kMaxTopk + k] entries of 16 bytes (expert, slot,
//                  weight): what the source's combine sends every rank first, so that the
//                  experts' rank can weight and sum a token's rows before sending them back
//   route_flag     [source rank], 8 bytes each: the source's route entries are in (the
//                  value encodes its token count and top-k; reset once every block read it)
//   dispatch_sent  [token][top-k slot] int32, local only: the slot this rank's dispatch
//                  claimed for the entry at its expert, -1 where it sent nothing, so that its
//                  combine names exactly those rows
// Signals are 8 bytes apart so that the CPU proxy can deliver each one as a single
// 8-byte transfer-engine write (which the engine applies atomically, after the data).
// No torch and no CUDA here; the kernels take these offsets as plain integers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace moelink::ep {

constexpr int kMaxTopk = 16;
constexpr int kHiddenAlign = 128;  // FP8 scale group; hidden must be a multiple of it
constexpr int kSignalBytes = 8;    // spacing of counts and flags
constexpr int kMaxTokensLimit = 1 << 24;  // slot entries pack token * kMaxTopk + k in an int32
constexpr int kRouteEntryBytes = 16;      // a combine_route entry: int32 expert, slot, float weight, pad

struct EpLayout {
  int num_ranks = 0;
  int num_experts = 0;
  int num_local_experts = 0;
  int max_tokens = 0;  // num_max_dispatch_tokens_per_rank
  int hidden = 0;

  uint64_t dispatch_msg_bytes = 0;
  uint64_t dispatch_col_bytes = 0;  // one source's rows: max_tokens * msg
  uint64_t index_col_bytes = 0;     // one source's slot entries: local experts * max_tokens * 4
  uint64_t combine_msg_bytes = 0;
  uint64_t off_dispatch_x = 0, off_dispatch_index = 0, off_dispatch_count = 0, off_combine_x = 0,
           off_combine_flag = 0, off_combine_route = 0, off_route_flag = 0, off_dispatch_sent = 0;
  uint64_t half_bytes = 0;

  // Validates the sizes (throws moelink::Error naming the bad one) and lays out a half.
  static EpLayout make(int num_ranks, int num_experts, int max_tokens, int hidden);
  uint64_t totalBytes() const { return 2 * half_bytes; }
  uint64_t entries() const { return static_cast<uint64_t>(max_tokens) * kMaxTopk; }  // (token, k) pairs
  uint64_t combineRegionBytes() const { return entries() * combine_msg_bytes; }
  uint64_t flagRegionBytes() const { return entries() * kSignalBytes; }
  uint64_t routeColBytes() const { return entries() * kRouteEntryBytes; }  // one source's route entries
  uint64_t sentBytes() const { return entries() * 4; }
  uint64_t countColBytes() const { return static_cast<uint64_t>(num_local_experts) * kSignalBytes; }
};

}  // namespace moelink::ep
