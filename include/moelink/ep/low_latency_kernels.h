// Launchers of the EP kernels (src/ep/kernels/*.cu). They take raw device pointers, sizes
// and a stream: no torch types. See layout.h for the buffer layout.
//
// Each of dispatch and combine is one kernel with a send phase and a receive phase (the
// `phases` bits); a normal call runs both in one launch, a recv-hook call runs the send
// phase first and the receive phase when the hook is called. The grid is one block per
// SM, so that every block is resident and a block's receive phase may wait on sends of
// other blocks of the same launch.
//
// Where a rank's traffic goes is a table of PeerRoute per (buffer half, peer), built at
// buffer creation: for the local rank and NVLink peers the pointers are into the peers'
// GPU buffers (CUDA IPC mappings); for a proxy peer they are into this rank's host-mapped
// outbox (sends) and inbox (receives), and every send is also posted to the proxy ring
// (see ProxyRing) for the CPU proxy to carry over the transfer engine; for an IBGDA peer
// the sends go into this rank's staging area (GPU memory registered with the NIC) and are
// posted as RDMA WRITEs on the peer's queue pair (ibgda/queue.h), which land in the peer's
// GPU buffer, so receives read this rank's own buffer as for NVLink peers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "moelink/ep/ibgda/queue.h"
#include "moelink/ep/layout.h"
#include "moelink/ep/proxy_ring.h"

namespace moelink::ep::kernels {

enum Phase : int { kSendPhase = 1, kRecvPhase = 2 };

// Scratch integers a buffer keeps (zeroed once at allocation; every call leaves them zero
// again): for dispatch, per global expert a slot counter, a finish counter and the expected
// count, then (after combine's int) per local expert a ready flag: the receive blocks that
// have yet to read the expert's layout; for combine, a counter of the blocks that have read
// the route flags, and after the dispatch's flags the proxy gate's two counters and a relay
// word per rank.
inline int scratchInts(const EpLayout& l) { return 3 * l.num_experts + 3 + l.num_local_experts + l.num_ranks; }
inline int combineScratchOffset(const EpLayout& l) { return 3 * l.num_experts; }
inline int dispatchReadyOffset(const EpLayout& l) { return 3 * l.num_experts + 1; }
inline int combineGateOffset(const EpLayout& l) { return 3 * l.num_experts + 1 + l.num_local_experts; }
inline int combineRelayOffset(const EpLayout& l) { return combineGateOffset(l) + 2; }

struct PeerRoute {
  // Sends to the peer.
  char* dispatch_send = nullptr;  // this rank's dispatch rows at the peer ([token])
  char* index_send = nullptr;     // this rank's slot entries at the peer ([local expert][slot])
  char* count_send = nullptr;     // this rank's count column at the peer (8 B per local expert)
  char* combine_send = nullptr;   // the peer's combine_x region ([token][top-k] rows)
  char* flag_send = nullptr;      // the peer's combine flags ([token][top-k], 8 B each)
  char* route_send = nullptr;     // this rank's combine_route column at the peer
  char* route_flag_send = nullptr;  // this rank's route flag at the peer
  // For a proxy peer, the offsets in the peer's inbox segment that match the seven above; for
  // an IBGDA peer, their addresses in the peer's GPU buffer (as its NIC registration names them).
  uint64_t dispatch_remote = 0, index_remote = 0, count_remote = 0, combine_remote = 0, flag_remote = 0,
           route_remote = 0, route_flag_remote = 0;
  // Receives from the peer (in this rank's GPU buffer, or its inbox for a proxy peer).
  char* dispatch_recv = nullptr;  // the peer's dispatch rows here
  char* index_recv = nullptr;     // the peer's slot entries here
  char* count_recv = nullptr;     // the peer's count column here
  char* combine_recv = nullptr;   // the combine_x region where the peer's experts' rows land
  char* flag_recv = nullptr;      // the combine flags the peer's experts raise
  char* route_recv = nullptr;     // the peer's combine_route column here
  char* route_flag_recv = nullptr;  // the peer's route flag here
  int proxy = 0;
  // IBGDA: the queue pair to the peer (device memory), the key of this rank's staging area
  // and the key of the peer's buffer.
  ibgda::QueuePair* qp = nullptr;
  uint32_t lkey = 0, rkey = 0;
};

struct Common {
  EpLayout layout;
  int rank = 0;
  int half = 0;
  const PeerRoute* routes = nullptr;  // device array [num_ranks] for this half
  int* sent = nullptr;                // this half's dispatch_sent ([token][kMaxTopk] slots, -1 = not sent)
  ProxyRing ring;
  bool ibgda = false;  // some route has a queue pair (selects the kernels with IBGDA posts)
  int num_sms = 0;
  int phases = kSendPhase | kRecvPhase;
  // int32 [num_ranks] on the GPU: 1 = active. A receiver that waits on a source longer
  // than timeout_ns (> 0) clears the source's entry and treats it as having sent nothing;
  // inactive ranks are neither sent to nor waited for.
  int* active = nullptr;
  int64_t timeout_ns = 0;  // <= 0: wait without limit
  // Optional phase timestamps (%globaltimer, ns) for the benchmark's breakdown:
  // [grid][kTracePoints]; nullptr (the default) records nothing.
  uint64_t* trace = nullptr;
};

constexpr int kTracePoints = 8;

struct DispatchArgs {
  Common c;
  const void* x = nullptr;          // bf16 [num_tokens, hidden]
  const int64_t* topk_idx = nullptr;  // [num_tokens, num_topk], -1 = none
  int num_tokens = 0;
  int num_topk = 0;
  bool use_fp8 = false;
  bool round_scale = false;  // FP8 scales rounded up to a power of two
  bool use_tma = false;      // messages to GPU peers as bulk copies (TMA) instead of warp stores
  int* scratch = nullptr;    // scratchInts() int32
  int* ready = nullptr;      // scratch ints (at dispatchReadyOffset()): the receive's ready flags
  // outputs (receive phase)
  void* recv_x = nullptr;        // bf16 or e4m3 [local, ranks*max_tokens, hidden]
  float* recv_scales = nullptr;  // [local, ranks*max_tokens, hidden/128] when FP8
  int* recv_src_info = nullptr;  // [local, ranks*max_tokens]: source token
  int* recv_src_slot = nullptr;  // [local, ranks*max_tokens]: source top-k slot
  int* recv_count = nullptr;     // [local] (written, need not be zeroed)
  int64_t* layout_range = nullptr;  // [local, ranks]: (begin << 32) | count
};

// Send phase: every token goes once to each rank holding one of its experts, with a slot
// entry per (token, top-k), then each expert's count. Receive phase: waits for every
// source's count and packs the tokens per local expert.
void dispatch(const DispatchArgs& a, cudaStream_t stream);

struct CombineArgs {
  Common c;
  const void* x = nullptr;  // bf16 expert outputs [local, ranks*max_tokens, hidden]
  const int64_t* layout_range = nullptr;  // the dispatch's [local, ranks]
  int* blocks_seen = nullptr;  // scratch int (at combineScratchOffset()): blocks that read the route flags
  int* gate = nullptr;         // 2 scratch ints (combineGateOffset()): blocks done sending, blocks past the gate
  int* relay = nullptr;        // scratch ints [num_ranks] (combineRelayOffset()): proxy sources' route flags
  // receive side
  const int64_t* topk_idx = nullptr;
  const float* topk_weights = nullptr;
  int num_tokens = 0;
  int num_topk = 0;
  void* out = nullptr;  // bf16 [num_tokens, hidden]
};

// Send phase: every rank first sends every rank its route entries (expert, slot and weight
// per (token, top-k)); then, per (source, token) with entries here, the weighted sum of the
// token's expert outputs at this rank goes back to the token's rank as one bf16 row,
// followed by its flag. Receive phase: waits for the flags of each token's rows (one per
// rank its dispatch reached) and writes their sum.
void combine(const CombineArgs& a, cudaStream_t stream);

// Load the dispatch and combine kernels' code now. Under lazy module loading (CUDA's
// default) a kernel's first launch loads it, which can wait for the device; a combine
// launched right behind the first dispatch would then wait for a kernel that itself waits
// for another host thread's CUDA calls (the emulated NIC's copies), until it times out.
void preloadDispatch();
void preloadCombine();

}  // namespace moelink::ep::kernels
