// The worker's side of the CUDA host route's pipeline (src/cuda/host_pipeline.h): how an op is
// cut into pieces, and the collective the worker runs over the pinned ring for it. Plain C++
// over host pointers (no CUDA, no torch), so that the CPU tests run it with a thread in the
// GPU stream's place.
//
// Every piece of an op uses one slot of the ring (an `in` area, then an `out` area) and one or
// two marks: words in the ring's ready and done arrays, and the ticket they are raised to. The
// stream raises the ready word when the piece's data is in place and its landing area free;
// the worker raises the done word when it is finished with the slot, after writing a
// reduction's plan (RowsPlan) where the stream reduces.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moelink/collective/algorithms.h"

namespace moelink::cuda {

// What the worker found when a piece's rows had all arrived (written before it raises the
// done word): the rows are those of the ranks active when the op started.
struct RowsPlan {
  uint64_t ticket = 0;  // the piece's; a plan with another ticket is stale and the launch does nothing
  uint64_t off = 0;     // this rank's range within `mine` and `out` (bytes)
  uint64_t len = 0;
  uint64_t stride = 0;  // between the rows
  int32_t rows = 0;     // how many (one per active rank, in rank order)
  int32_t me = 0;       // this rank's index among them (its row is `mine`, not in `rows`)
};

struct PieceMark {
  int word = 0;
  uint32_t ticket = 0;
};

// The host view of a ring: slot s is at base + s * slot_stride, its `in` area first and its
// `out` area slot_bytes later; one plan per slot; the words by PieceMark::word.
struct PieceRing {
  char* base = nullptr;
  uint64_t slot_stride = 0, slot_bytes = 0;
  RowsPlan* plans = nullptr;
  uint32_t* ready = nullptr;
  uint32_t* done = nullptr;
  char* in(int slot) const { return base + slot_stride * static_cast<uint64_t>(slot); }
  char* out(int slot) const { return in(slot) + slot_bytes; }
  // The bytes a slot's `out` area needs for pieces of `slot_bytes` in a group of `world`.
  static uint64_t outBytes(uint64_t slot_bytes, int world) { return slot_bytes + 16ull * static_cast<uint64_t>(world); }
};

// A piece: [off, off + len) of the op (all_reduce, reduce_scatter: elements, of the tensor or
// of each rank's block; all_gather, broadcast: bytes), its slot and marks (all_reduce: first
// the reduce-scatter, second the all-gather; the others: first only).
struct HostPiece {
  uint64_t off = 0, len = 0;
  int slot = 0;
  PieceMark first, second;
};

// The bytes of a slot's side that an op's pieces use: an op that puts `total` bytes through
// the ring is cut into `depth` pieces or more, so that the GPU's copies, the wire and the
// reductions overlap at any size, but into none smaller than `min_piece` (each piece costs
// the stream a wait and the worker a gate) nor larger than the slot (`slot_bytes`).
uint64_t pieceBudget(uint64_t total, int depth, uint64_t min_piece, uint64_t slot_bytes);
// The piece sizes (every rank cuts alike: they depend on the sizes and settings only), from
// the bytes of a slot's side they may use (pieceBudget).
uint64_t allreducePieceElems(size_t elem, uint64_t slot_bytes);
uint64_t reduceScatterPieceElems(size_t elem, uint64_t slot_bytes, int world);  // also its rows' stride / elem
uint64_t allgatherPieceBytes(uint64_t slot_bytes, int world);                   // also its rows' stride
// all_to_all: a pair's bytes per piece, also the stride of the slot's rows (the `in` area by
// destination rank, the `out` area by source rank).
uint64_t alltoallPieceBytes(uint64_t slot_bytes, int world);
// all_to_all: the pieces of the pair of this rank and `peer`, from both directions' lengths
// (each end of a pair knows both, so the two agree): at least one.
uint64_t alltoallPairPieces(uint64_t send_bytes, uint64_t recv_bytes, uint64_t per);
// An op of `total` cut at `per` (at least one piece, empty for an empty op), over `depth`
// slots; `mark(word)` gives each piece's marks (words 2 * slot and, with `two`, 2 * slot + 1).
std::vector<HostPiece> cutPieces(uint64_t total, uint64_t per, int depth, bool two,
                                 const std::function<PieceMark(int word)>& mark);

// Whether the ready word of `m` has reached its ticket (wrap-safe).
std::function<bool()> readyGate(const PieceRing& ring, PieceMark m);

// The context of an op among the active ranks of `among` (ascending ranks of the group, this
// one included); `missing`: "" when every one is active, else why the op cannot complete (it
// must fail, not leave that rank's data out of a reduction).
collective::AlgoContext amongRanks(const collective::AlgoContext& c, const std::vector<int>& among,
                                   std::string* missing);

// The cross-host step of a two-level op (src/cuda/unit.h, TwoLevel): who takes part, and what
// this rank's in-host step before it left behind.
struct RailStep {
  std::vector<int> rail;   // the ranks at this rank's position on every host (ascending)
  std::vector<int> local;  // this host's ranks (ascending)
  uint64_t op_bytes = 0;   // the whole op's bytes (what the ranks compare in the headers)
  // "" when this rank may go on (its in-host step succeeded, the membership is as it was), else
  // why not; asked before each piece goes.
  std::function<std::string()> check;
};

// Whether an all_reduce among `ranks` ranks (a group, or a rail of a two-level op) moves each
// piece in one exchange: every rank sends its whole piece to the other, and each reduces both
// on the GPU. Between two ranks that is what a reduce-scatter and an all-gather put on the wire,
// in one step per piece instead of two, with no exchange waiting for a reduction. (Among more
// ranks it would send the piece to every one of them.)
inline bool allreduceInOneExchange(int ranks) { return ranks == 2; }

// The collective the worker runs for each op, built when the op starts (from the ranks active
// then; `rank` is this rank, `world` the group's size): one gated piece after another
// (collective::appendGatedPiece). all_reduce: per piece a reduce-scatter by active rank into
// the slot's `out` rows, then (after the next piece's) an all-gather of the reduced blocks in
// the slot's `in` area; with `one_exchange` (allreduceInOneExchange, pieces of one mark each),
// the `in` piece to the other active rank, into row 0 of its `out` area, and a plan that reduces
// the whole piece (stride 0: the one received row); reduce_scatter: the `in` rows (by rank,
// `per` elements apart) to their ranks, received by active index; all_gather: the `in` piece to every rank, received by rank
// (an inactive rank's row zeroed); broadcast: the root's `in` piece; all_to_all: piece p moves
// bytes [p * per, (p + 1) * per) of every pair that has that many pieces (alltoallPairPieces;
// this rank's pieces: as many as its longest pair has), from the `in` rows to the peers' `out`
// rows (an inactive rank's row zeroed); this rank's own pair is the stream's.
collective::OpSpec allreducePieces(const collective::AlgoContext& c, const PieceRing& ring,
                                   const std::vector<HostPiece>& pieces, uint64_t count, collective::DType t,
                                   collective::ReduceOp op, int world, int rank, bool one_exchange);
// allreducePieces among `step.rail` (amongRanks), each piece held until step.check() is ""
// (otherwise the op fails here before this rank sends that piece, and its peers with it: also
// when a rank of the rail or of the host is not active), then a barrier among `step.local`
// whose messages go once this rank's last piece is consumed: the op succeeds on a rank only
// when its cross-host step succeeded on every rank of its host (a rank whose step failed sends
// its host's ranks an abort instead), so that no rank gathers a host peer's block that did not
// get its other hosts' part. Before the pieces every active rank sends every other one an
// empty message whose header carries the whole op (step.op_bytes, dtype, reduce op): ranks that
// disagree about it find out from each other, each with the header check's words, as on the
// flat route.
collective::OpSpec railAllreducePieces(const collective::AlgoContext& c, const PieceRing& ring,
                                       const std::vector<HostPiece>& pieces, uint64_t count, collective::DType t,
                                       collective::ReduceOp op, int world, int rank, const RailStep& step,
                                       bool one_exchange);
// The cross-host step of a two-level reduce_scatter, with the same header, gates and barrier:
// the `in` rows packed by position on the rail (`per` elements apart:
// reduceScatterPieceElems(elem, slot, rail size)) to those ranks, received by active index.
collective::OpSpec railReduceScatterPieces(const collective::AlgoContext& c, const PieceRing& ring,
                                           const std::vector<HostPiece>& pieces, uint64_t count, uint64_t per,
                                           collective::DType t, collective::ReduceOp op, int world, int rank,
                                           const RailStep& step);
// The cross-host step of a two-level all_gather, with the same header, gates and barrier:
// this rank's `in` piece to every rank of its rail, each rail rank's row received at its
// position on the rail (`per` bytes apart: allgatherPieceBytes(slot, rail size)).
collective::OpSpec railAllgatherPieces(const collective::AlgoContext& c, const PieceRing& ring,
                                       const std::vector<HostPiece>& pieces, uint64_t bytes, uint64_t per, int world,
                                       int rank, const RailStep& step);
// The cross-host step of a two-level broadcast, with the same header, gates and barrier: the
// root's `in` pieces to every rank of the root's rail (the ranks at its position on every host);
// a rank of another rail has one empty piece (cutPieces of 0 bytes) and nothing on the wire, and
// its host's barrier waits for its host's rank on the root's rail to have had every piece.
collective::OpSpec railBroadcastPieces(const collective::AlgoContext& c, const PieceRing& ring,
                                       const std::vector<HostPiece>& pieces, uint64_t bytes, int root,
                                       const RailStep& step);
collective::OpSpec reduceScatterPieces(const collective::AlgoContext& c, const PieceRing& ring,
                                       const std::vector<HostPiece>& pieces, uint64_t count, uint64_t per,
                                       collective::DType t, collective::ReduceOp op, int world, int rank);
collective::OpSpec allgatherPieces(const collective::AlgoContext& c, const PieceRing& ring,
                                   const std::vector<HostPiece>& pieces, uint64_t bytes, uint64_t per, int world,
                                   int rank);
collective::OpSpec alltoallPieces(const collective::AlgoContext& c, const PieceRing& ring,
                                  const std::vector<HostPiece>& pieces, uint64_t per,
                                  const std::vector<uint64_t>& send_bytes, const std::vector<uint64_t>& recv_bytes,
                                  int world, int rank);
collective::OpSpec broadcastPieces(const collective::AlgoContext& c, const PieceRing& ring,
                                   const std::vector<HostPiece>& pieces, uint64_t bytes, int root);

}  // namespace moelink::cuda
