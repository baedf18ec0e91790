// Builders of OpSpecs for each collective, over raw memory. `ranks` lists the
// participating (active) ranks in ascending order and includes `me`. Per-rank blocks
// (gathered outputs, scattered inputs, all-to-all splits) are laid out by rank over the whole
// group (`world` blocks); the blocks of ranks that do not take part are zero-filled in
// outputs and ignored in inputs. Every participant
// pair that the op connects exchanges at least one message, so that the message pattern
// depends on the op kind and the root only, never on sizes: a size mismatch is then
// detected from the headers instead of leaving a peer waiting.
//
// Chunking: payloads are cut at `chunk` bytes (a multiple of the element size).
// Reductions are done in rank order by every rank that reduces, so results agree bit for
// bit across ranks.
#pragma once

#include <vector>

#include "moelink/collective/operation.h"

namespace moelink::collective {

struct AlgoContext {
  int me;
  std::vector<int> ranks;  // participants, ascending
  int world = 0;           // the group's size (0: ranks.size(), for a context of every rank)
  uint64_t chunk;          // mailbox payload bytes
  uint64_t allreduce_small_bytes;  // at or below: every rank reduces everything
  // Above this (0: never), broadcast is a pipelined chain from the root instead of direct
  // writes, so that the root sends the data once (chosen for groups that talk over tcp).
  uint64_t chain_broadcast_bytes = 0;
  // From this size (0: never), allreduce is a pipelined ring (reduce-scatter then allgather,
  // each rank talking to its two neighbours only) instead of direct exchanges with every
  // participant: over tcp a rank then keeps one stream in and one out, which costs less CPU
  // per byte than one per peer (chosen for groups that talk over tcp).
  uint64_t ring_allreduce_bytes = 0;
  // Reductions (allreduce's reduce-scatter + allgather and ring, reduce-scatter) cut each
  // rank's block into up to `reduce_pieces` pieces of at least `reduce_piece_min` bytes (at most
  // `chunk`), rather than into slots: a block of a few slots then still flows as a pipeline,
  // one piece on the wire while the one before is reduced (0: pieces of `chunk`).
  uint64_t reduce_piece_min = 0;
  uint64_t reduce_pieces = 1;
  // Pairs whose receiver reads the sender's memory itself (pulled messages, mailbox.h), per
  // rank: `reads_me[r]`, rank r reads this rank's; `i_read[r]`, this rank reads rank r's.
  // Both ends of a pair see the same answer. all_to_all cuts such a pair's data into pieces
  // of `pull_chunk` bytes rather than `chunk` (a piece needs no slot). Empty: none.
  std::vector<char> reads_me, i_read;
  uint64_t pull_chunk = 0;
};

// The position of `rank` among c.ranks; throws moelink::Error when it is not an active rank.
size_t indexOf(const AlgoContext& c, int rank);
// An op of this kind with no steps yet (op_bytes: what the ranks compare in the headers).
OpSpec emptyOp(OpKind k, DType t, ReduceOp op, int root, uint64_t op_bytes);

OpSpec broadcastOp(const AlgoContext& c, void* buf, uint64_t bytes, int root);
// in: count elements; inout may alias. Allreduce in place on `buf`.
OpSpec allreduceOp(const AlgoContext& c, void* buf, uint64_t count, DType t, ReduceOp op);
// Root's `out` receives the reduction of every rank's `in` (count elements).
OpSpec reduceOp(const AlgoContext& c, const void* in, void* out, uint64_t count, DType t,
                ReduceOp op, int root);
// out holds world blocks of `bytes`, by rank.
OpSpec allgatherOp(const AlgoContext& c, const void* in, void* out, uint64_t bytes);
OpSpec gatherOp(const AlgoContext& c, const void* in, void* out, uint64_t bytes, int root);
// root's `in` holds one block of `bytes` per rank.
OpSpec scatterOp(const AlgoContext& c, const void* in, void* out, uint64_t bytes, int root);
// in holds one block of `count` elements per rank; out gets this rank's reduced block.
OpSpec reduceScatterOp(const AlgoContext& c, const void* in, void* out, uint64_t count, DType t,
                       ReduceOp op);
// send_bytes[r] / recv_bytes[r]: bytes to / from rank r, at the given offsets (world entries).
OpSpec alltoallOp(const AlgoContext& c, const void* in, const std::vector<uint64_t>& send_off,
                  const std::vector<uint64_t>& send_bytes, void* out,
                  const std::vector<uint64_t>& recv_off, const std::vector<uint64_t>& recv_bytes);
OpSpec barrierOp(const AlgoContext& c);

// Pipelined ops over buffers that something outside the worker fills and drains piece by
// piece (the CUDA host route's pinned ring): appends `piece`'s steps to `op` so that nothing
// of them happens before `gate` returns true (Step::gate: the piece's data is in place and its
// landing area free), and, once they have all been consumed and every send of the piece has
// completed, runs the piece's finish and then `done` (its memory may be reused from then on).
// `op` keeps its own kind and sizes; it is pullable only if every piece is, so pieces built
// with pulled messages in mind (cut at AlgoContext::pull_chunk) need all others pullable too:
// build them with pull_chunk 0 otherwise.
void appendGatedPiece(OpSpec& op, OpSpec piece, std::function<bool()> gate, std::function<void()> done);

}  // namespace moelink::collective
