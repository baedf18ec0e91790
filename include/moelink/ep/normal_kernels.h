// Normal (high-throughput) mode kernels for ranks on one host (NVLink): raw device pointers
// and a stream, no torch types. The torch-facing side is ep/normal_buffer.h.
//
// Each rank owns one NVL buffer that every peer maps (CUDA IPC). It holds, per source rank s
// and channel c, a ring of `ring_tokens` token slots that only s writes into, with a tail (slots
// s has filled, written by s) and a head (slots this rank has consumed, read by s for flow
// control); plus per-source barrier words and a notify area where each source leaves its counts.
//
// A call's tokens are split into `num_channels` contiguous ranges; channel c is served by two
// blocks: block 2c sends (warp groups per destination rank stream the channel's tokens into the
// destination's ring for (this rank, c)), block 2c+1 receives (warp groups per source rank copy
// their ring's slots into the outputs). Order within a (source, channel) stream is the token
// order, so the receiver knows each slot's output row without per-token metadata beyond the
// source index, and combine, which streams the rows back in the same order, knows where each
// token's rows arrive (send_head).
//
// Every call starts with a barrier across the ranks (in notify or prepare), so no rank writes
// into a ring that a peer is still reading from an earlier call; each rank clears its own
// rings before it enters the barrier. The barrier's sequence number lives in the rank's own
// buffer and the kernels advance it, so calls captured in a CUDA graph count on every replay.
//
// A dispatch with `max_rows` (DeepEP's num_worst_tokens) needs no host wait: its outputs have
// max_rows rows, a pad kernel fills the rows past the received count (known on the device
// only), receivers drop rows past max_rows and the notify kernel reports how many arrived then
// (HostReport::overflow), for the host to raise at its next call.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace moelink::ep::normal {

constexpr int kMaxRanks = 8;
constexpr int kMaxChannels = 64;
constexpr int kThreads = 768;  // 24 warps per block, split between the peers
constexpr int kWarps = kThreads / 32;

// Host-mapped words the notify kernel fills for the host, and the kernels' error report.
struct HostReport {
  volatile int ticket;        // the host's ticket of the notify launch that wrote the counts
  volatile int num_recv;      // rows this rank receives
  volatile int error;         // nonzero: a kernel gave up waiting on a peer (first one wins)
  volatile int error_rank;    // which peer
  volatile int overflow;      // nonzero: rows that arrived in a dispatch bounded by fewer max_rows
  volatile int per_expert[1];  // [num_local_experts]: received (token, local expert) pairs
};

// Where things are in one rank's NVL buffer, the same on every rank for a call.
struct RingLayout {
  int num_ranks = 0, num_channels = 0, ring_tokens = 0;
  int x_bytes = 0;      // bytes of one token's row (hidden * element size), a multiple of 16
  int num_scales = 0;   // float scales per token (FP8), else 0
  int num_topk = 0;     // top-k entries per token (dispatch with top-k), else 0
  // Offsets from the buffer base.
  uint64_t off_barrier = 0;  // int [num_ranks]: sequence number each source reached
  uint64_t off_seq = 0;      // int: this rank's own barrier count (advanced by the kernels)
  uint64_t off_notify = 0;   // int [2][num_ranks][notify_ints]: counts each source left here, by call parity
  int notify_ints = 0;
  uint64_t off_counters = 0;  // int [num_ranks][num_channels][2]: tail, head (each on its own 16 B)
  uint64_t off_rings = 0;
  uint64_t ring_bytes = 0;  // one (source, channel) ring
  // Inside a ring: rows, source token index, top-k ids (int32, local), weights, scales.
  uint64_t r_src = 0, r_idx = 0, r_w = 0, r_scales = 0;
  uint64_t total = 0;

  // num_local_experts: for the notify area.
  static RingLayout make(int num_ranks, int num_channels, int ring_tokens, int x_bytes, int num_scales,
                         int num_topk, int num_local_experts);
};

struct Peers {
  char* base[kMaxRanks] = {};  // every rank's NVL buffer, mapped here (this rank's own at its index)
};

// DeepEP's get_dispatch_layout: per token, the ranks its experts live on (is_token_in_rank,
// bool [num_tokens, num_ranks]); per rank and per expert, how many tokens go there. Entries
// of -1 or out of range route nowhere. The counts must be zeroed before the launch.
struct LayoutArgs {
  const int64_t* topk_idx = nullptr;  // [num_tokens, num_topk]
  int num_tokens = 0, num_topk = 0, num_experts = 0, num_ranks = 0;
  int* num_tokens_per_rank = nullptr;    // [num_ranks]
  int* num_tokens_per_expert = nullptr;  // [num_experts]
  bool* is_token_in_rank = nullptr;      // [num_tokens, num_ranks]
};

constexpr int kLayoutMaxExperts = 4096;
constexpr int kLayoutMaxRanks = 64;

void layout(const LayoutArgs& a, cudaStream_t stream);

struct NotifyArgs {
  RingLayout L;
  Peers peers;
  int rank = 0;
  int ticket = 0;    // written to the report with the counts (the host waits for its own)
  int max_rows = 0;  // > 0: more received rows than this is reported as an overflow
  int num_tokens = 0, num_experts = 0, num_local_experts = 0;
  const bool* is_token_in_rank = nullptr;      // [num_tokens, num_ranks]
  const int* num_tokens_per_expert = nullptr;  // [num_experts]
  // outputs
  int* channel_prefix = nullptr;       // [num_ranks, num_channels]: tokens sent to r in channels <= c
  int* rank_prefix = nullptr;          // [num_ranks]: rows received from sources <= s
  int* recv_channel_prefix = nullptr;  // [num_ranks, num_channels + 1]: where channel c of source s starts in its rows
  HostReport* report = nullptr;
  int64_t timeout_ns = 0;
};

// Clears this rank's rings, leaves its counts at every peer, waits for every peer's, and
// computes the prefixes and the host report. One block.
void notify(const NotifyArgs& a, cudaStream_t stream);

struct PrepareArgs {
  RingLayout L;
  Peers peers;
  int rank = 0;
  HostReport* report = nullptr;
  int64_t timeout_ns = 0;
};

// The barrier (after clearing this rank's rings) that starts a cached dispatch or a combine.
void prepare(const PrepareArgs& a, cudaStream_t stream);

struct DispatchArgs {
  RingLayout L;
  Peers peers;
  int rank = 0;
  int num_tokens = 0, num_local_experts = 0, send_chunk = 1;
  const void* x = nullptr;           // [num_tokens, x_bytes]
  const float* scales = nullptr;     // [num_tokens, num_scales]
  const int64_t* topk_idx = nullptr;  // [num_tokens, num_topk] global expert ids
  const float* topk_weights = nullptr;
  const bool* is_token_in_rank = nullptr;
  const int* channel_prefix = nullptr;
  const int* rank_prefix = nullptr;
  const int* recv_channel_prefix = nullptr;
  // outputs
  void* recv_x = nullptr;
  float* recv_scales = nullptr;
  int64_t* recv_topk_idx = nullptr;  // local ids or -1
  float* recv_topk_weights = nullptr;
  int* recv_src_idx = nullptr;
  // [num_tokens, num_ranks]: the token's place in its (rank, channel) stream (the rows sent there
  // before it); -place - 1 where the token does not go to that rank
  int* send_head = nullptr;
  int max_rows = 0;          // > 0: the outputs' rows; received rows past them are dropped
  HostReport* report = nullptr;
  int64_t timeout_ns = 0;
};

void dispatch(const DispatchArgs& a, cudaStream_t stream);

// Fills the output rows from the received count (rank_prefix[num_ranks - 1], on the device)
// up to max_rows: zero rows and scales, top-k -1 with weight 0, source index -1.
struct PadArgs {
  int num_ranks = 0, max_rows = 0, x_bytes = 0, num_scales = 0, num_topk = 0;
  const int* rank_prefix = nullptr;
  void* recv_x = nullptr;
  float* recv_scales = nullptr;
  int64_t* recv_topk_idx = nullptr;
  float* recv_topk_weights = nullptr;
  int* recv_src_idx = nullptr;
};

void pad(const PadArgs& a, cudaStream_t stream);

struct CombineArgs {
  RingLayout L;
  Peers peers;
  int rank = 0;
  int num_tokens = 0, send_chunk = 1;
  const void* x = nullptr;  // bf16 [received rows, hidden]
  const float* topk_weights = nullptr;  // [received rows, num_topk] or null
  const int* rank_prefix = nullptr;
  const int* recv_channel_prefix = nullptr;
  const int* send_head = nullptr;
  const void* bias0 = nullptr;  // bf16 [num_tokens, hidden] or null
  const void* bias1 = nullptr;
  // outputs
  void* out = nullptr;          // bf16 [num_tokens, hidden]
  float* out_weights = nullptr;  // [num_tokens, num_topk] or null
  int max_rows = 0;  // > 0: rows of x (a bounded dispatch's); rows past them go back as zeros
  // > 0: the sender moves rows with bulk copies (TMA) through shared memory, in pieces of this
  // many bytes (bulkPieceBytes); 0: with warp copies
  int piece_bytes = 0;
  int bulk_warps = 1;  // with bulk copies: warps per destination (bulkWarps)
  HostReport* report = nullptr;
  int64_t timeout_ns = 0;
};

// Combine's bulk-copy sender: bulkWarps(num_ranks) warps per destination, which take the
// destination's chunks in turn, each warp with kBulkStages shared-memory stages, all of them in
// about kBulkSmemBytes (the block's dynamic shared memory is warps * kBulkStages * piece).
constexpr int kBulkStages = 6;
constexpr int kBulkSmemBytes = 200 << 10;
constexpr int kBulkWarpsPerDest = 4;  // from a sweep of 1-6 at 4 ranks (docs/PERF.md)

// Warps per destination: kBulkWarpsPerDest, fewer where the block has too few warps for them.
inline int bulkWarps(int num_ranks) {
  const int fit = kWarps / (num_ranks > 0 ? num_ranks : 1);
  return fit < 1 ? 1 : fit < kBulkWarpsPerDest ? fit : kBulkWarpsPerDest;
}

// The piece size that fits `warps` warps' bulk-copy stages into shared memory: x_bytes (a
// multiple of 16) cut into equal pieces, each a multiple of 16.
int bulkPieceBytes(int warps, int x_bytes);

void combine(const CombineArgs& a, cudaStream_t stream);

}  // namespace moelink::ep::normal
