// The in-host GPU collectives as exchanges (plain C++: no CUDA, no torch).
//
// Every collective on CUDA tensors between ranks of one host runs as one exchange: each rank
// sends byte ranges of its input to peers and receives byte ranges from them, then either
// copies what arrived into place (kCopy: broadcast, all-gather, gather, scatter, all-to-all) or
// reduces it with its own range, in rank order (kReduce: allreduce, reduce, reduce-scatter),
// or, above the one-shot size, reduces its block of an all_reduce and sends the result on
// (kReduceGather, kReduceGatherStaged: a reduce-scatter and an all-gather in one launch).
// An Exchange says what this rank sends and receives; the kernel (exchange_kernel.h) moves
// it through a staging area that every rank of the group maps (CUDA IPC), in rounds of at
// most `round_bytes` per (source, destination) pair and two halves, so round r+1 travels
// while round r is consumed.
//
// Small exchanges (exchangeLamport) travel by the Lamport protocol instead: each 8 bytes of
// a pair go as one 16-byte line that carries the op's number beside the data, written into
// the receiver's Lamport area (two parities by op number), so the receiver polls the data
// itself: no flag after the data, no acknowledgement, no wait before the next op writes.
//
// Every rank writes its op header into each peer's header slot and checks the headers it
// receives (kind, dtype, reduce op, root, total bytes, the bytes of each pair, and the
// tunables that shape the rounds) before it consumes anything a peer sent, and before it
// sends anything unless exchangePushesEarly lets it push first: a disagreement ends
// the op on every rank with an error naming both sides (describeMismatch), never a hang.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moelink/collective/dtype.h"
#include "moelink/collective/operation.h"

#ifdef __CUDACC__
#define MOELINK_HOST_DEVICE __host__ __device__
#else
#define MOELINK_HOST_DEVICE
#endif

namespace moelink::cuda {

// The collective layer's vocabulary, which the plans share.
using collective::DType;
using collective::OpKind;
using collective::ReduceOp;

constexpr int kExchangeMaxRanks = 8;    // in-host groups larger than this are host-staged
constexpr int kExchangeMaxBlocks = 64;  // upper bound of MOELINK_CUDA_BLOCKS
// A block takes at least this many bytes of a round, so that small messages use few blocks.
constexpr uint64_t kExchangeMinPiece = 16 << 10;
// The Lamport protocol: pairs of at most this many bytes (MOELINK_CUDA_LAMPORT_BYTES' upper
// bound; the Lamport area holds them), each 8 bytes one 16-byte line, behind the header's lines.
constexpr uint64_t kLamportMaxBytes = 256 << 10;
constexpr uint64_t kLamportLineBytes = 16;
constexpr uint64_t kLamportHeaderLines = 8;  // an ExchangeHeader, 8 data bytes per line
// The two-shot Lamport all_reduce (ExchangeMode::kReduceGather): blocks of at most this many
// bytes. A source's lines of the gather half start kLamportGatherLine lines into its slot,
// behind the room for the scatter half's.
constexpr uint64_t kLamportTwoShotBlockBytes = 512 << 10;
constexpr uint64_t kLamportGatherLine = kLamportTwoShotBlockBytes / 8;
static_assert(kLamportGatherLine * 8 >= kLamportMaxBytes, "a slot holds the longest pair of a one-shot exchange");
// One source's slot of the Lamport area: the header's lines, then the data's.
constexpr uint64_t kLamportSourceBytes = (kLamportHeaderLines + 2 * kLamportGatherLine) * kLamportLineBytes;
// Threads of a Lamport block at most (each moves two lines of every pair at a time, every peer's
// lines in registers): fewer in groups above 4 ranks. A block carries twice its threads' lines.
constexpr int lamportThreads(int n) { return n > 4 ? 256 : 512; }
// Threads of a Lamport block where the longest pair is short (ExchangeDefaults::lamport_narrow_bytes).
constexpr int kLamportNarrowThreads = 256;

// kReduceGather: the two-shot all_reduce in one launch of the Lamport kernel (exchangeAllreduceTwoShot):
// the reduce-scatter half's pairs and reduction, then this rank's reduced block to every peer and
// theirs into place; never on the staged kernel.
// kForward: a copy in which every rank but Exchange::forward_from passes on what that rank sends
// it, piece by piece, in the same stores that place it (exchangeBroadcastForward); the staged
// kernel only.
// kReduceGatherStaged: the same two halves as kReduceGather in one launch of the staged kernel
// (exchangeAllreduceTwoShotStaged): a consuming block that has reduced its piece of this rank's
// block writes it into every peer's staging area as it stores it, and copies the peers' reduced
// pieces into place as they arrive, so that round r's all-gather overlaps round r + 1's
// reduce-scatter (the pushing blocks run ahead).
enum class ExchangeMode : uint8_t { kCopy, kReduce, kReduceGather, kForward, kReduceGatherStaged };

// What one rank does in one exchange. Offsets are in bytes from `in` / `out` (device
// pointers supplied at launch).
struct Exchange {
  OpKind kind = OpKind::kBarrier;  // for the header check and messages
  ExchangeMode mode = ExchangeMode::kCopy;
  DType dtype = DType::kBytes;
  ReduceOp redop = ReduceOp::kNone;
  int root = -1;
  uint64_t op_bytes = 0;  // compared across ranks when non-zero on both sides
  // Per rank of the group (this rank included): bytes sent to it from in + send_off, and
  // bytes received from it, placed at out + recv_off (kCopy).
  std::vector<uint64_t> send_off, send_bytes, recv_off, recv_bytes;
  // kReduce: out[0, reduce_bytes) = op over ranks q in order of (q == me ? in + send_off[me] :
  // what q sent), every recv_bytes[q] (q != me) being reduce_bytes. AVG divides by the group
  // size at the end. kReduceGather, kReduceGatherStaged: the same reduction lands at
  // out + send_off[me], is sent to every peer, and peer q's (send_bytes[q] bytes) lands at
  // out + send_off[q].
  uint64_t reduce_bytes = 0;
  // kForward: the rank (index into the vectors above) whose pair this rank passes on. Every pair
  // this rank sends is that pair again (the same bytes, send_off its place in `out`); the kernel
  // passes each piece on from the staging slot it arrives in, as it places it.
  int forward_from = -1;
};

// Builders. `n` ranks, this one `me`; counts are elements of `dtype`, bytes are bytes.
Exchange exchangeBroadcast(int n, int me, uint64_t bytes, int root);
// One-shot: every rank sends all of `count` to every rank and reduces everything.
Exchange exchangeAllreduceOneShot(int n, int me, uint64_t count, DType t, ReduceOp op);
// Two-shot: the reduce-scatter half (rank q reduces block q of the buffer; as a kReduce
// exchange it lands at `out`) and the all-gather half (every rank sends its reduced block to
// all). Blocks: allreduceBlocks. An all_reduce runs both halves in one exchange:
Exchange exchangeAllreduceScatter(int n, int me, uint64_t count, DType t, ReduceOp op);
// The two halves in one exchange (ExchangeMode::kReduceGather), in place: the scatter half's pairs,
// then each rank's reduced block to all. Lamport kernel only: allreduceTwoShotLamport says when.
Exchange exchangeAllreduceTwoShot(int n, int me, uint64_t count, DType t, ReduceOp op);
// The same on the staged kernel (ExchangeMode::kReduceGatherStaged), in place: all_reduce above
// the one-shot size in groups of more than 2, where the two-shot Lamport kernel does not take it.
Exchange exchangeAllreduceTwoShotStaged(int n, int me, uint64_t count, DType t, ReduceOp op);
// Element ranges [begin, end) of the two-shot blocks: count split as evenly as 16-byte
// alignment of the block starts allows.
std::vector<std::pair<uint64_t, uint64_t>> allreduceBlocks(int n, uint64_t count, DType t);
// Broadcast above the one-shot size in groups of more than 2 (broadcastForwards), in one launch
// of the staged kernel, in place: the buffer cut into n - 1 blocks, one per rank but the root
// (allreduceBlocks over them in rank order); the root sends each rank its block, and each rank
// passes every piece of it on to the others but the root as it places it (ExchangeMode::kForward). The root sends the buffer once and every other rank receives it once,
// and from the first pieces on the root's NVLink ports and the others' carry it at once (a
// scatter and then an all-gather would have the root send its own block n - 1 times more, and
// keep every link but the root's idle while it scatters).
Exchange exchangeBroadcastForward(int n, int me, uint64_t bytes, int root);
Exchange exchangeReduce(int n, int me, uint64_t count, DType t, ReduceOp op, int root);
// in: `bytes`; out: n blocks of `bytes` in rank order.
Exchange exchangeAllgather(int n, int me, uint64_t bytes);
Exchange exchangeGather(int n, int me, uint64_t bytes, int root);
// root's in: n blocks of `bytes`; out: `bytes`.
Exchange exchangeScatter(int n, int me, uint64_t bytes, int root);
// in: n blocks of `count` elements; out: this rank's reduced block.
Exchange exchangeReduceScatter(int n, int me, uint64_t count, DType t, ReduceOp op);
// send_bytes[q] / recv_bytes[q] at the given offsets.
Exchange exchangeAlltoall(int n, int me, const std::vector<uint64_t>& send_off,
                          const std::vector<uint64_t>& send_bytes,
                          const std::vector<uint64_t>& recv_off,
                          const std::vector<uint64_t>& recv_bytes);

// The same exchange over a sub-group (after a membership change: the active ranks).
// `members`: sorted ranks of the group, `x`'s rank among them. Pairs between members keep
// their offsets and sizes, at the member's position in `members`; pairs with other ranks are
// dropped. Valid for every builder above but the two-shot ones and the forwarding broadcast
// (whose blocks belong to ranks: build those over the sub-group's size instead; a kForward,
// kReduceGather or kReduceGatherStaged exchange is refused). A reduction is then over the
// members, and AVG divides by their number.
Exchange restrictExchange(const Exchange& x, const std::vector<int>& members);
// The (offset, bytes) ranges of the output that a kCopy exchange `x` receives from ranks
// outside `members`: the caller zero-fills them (an inactive rank's slot is zeros, never stale).
std::vector<std::pair<uint64_t, uint64_t>> droppedRanges(const Exchange& x, const std::vector<int>& members);

// The in-host path's defaults by group size: one row per class of sizes, the settings that an
// unset MOELINK_CUDA_* variable takes. docs/PERF.md ("Defaults by group size") has the sweeps
// behind each measured row; a row that no machine of its size has measured says so, and its
// values are the next measured row's, narrowed where more ranks write more lines.
struct ExchangeDefaults {
  int up_to = 0;                // groups of at most this many ranks
  uint64_t lamport_bytes = 0;   // MOELINK_CUDA_LAMPORT_BYTES
  uint64_t lamport_two_shot_bytes = 0;  // MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES
  uint64_t one_shot_bytes = 0;  // MOELINK_CUDA_ONESHOT_BYTES
  int blocks = 0;               // MOELINK_CUDA_BLOCKS
  uint64_t round_bytes = 0;     // MOELINK_CUDA_ROUND_BYTES
  // The Lamport kernel's blocks (lamportThreadsFor): kLamportNarrowThreads where the longest
  // pair is at most lamport_narrow_bytes (twice the blocks of 512: more SMs store into NVLink at
  // once), lamport_threads above (at most lamportThreads(n)).
  uint64_t lamport_narrow_bytes = 0;
  int lamport_threads = 0;
  const char* measured = "";    // the machine whose sweeps chose the row; "" where none has
};
// The row for a group of `n` ranks (1..kExchangeMaxRanks).
const ExchangeDefaults& exchangeDefaults(int n);

// Tunables every rank must share (checked in the header).
struct ExchangeTuning {
  uint64_t round_bytes = 8 << 20;   // per (source, destination) pair and round
  int blocks = 64;                  // MOELINK_CUDA_BLOCKS (per role: the kernel holds 2 x blocks SMs when split)
  // MOELINK_CUDA_ONESHOT_BYTES: allreduce and broadcast up to it take one exchange that moves
  // the whole buffer to every peer; above it allreduce is two-shot (allreduceTwoShotLamport, else
  // exchangeAllreduceTwoShotStaged), broadcast forwards in groups of more than 2
  // (broadcastForwards; a group of 2 has no rank to forward through: one exchange).
  uint64_t one_shot_bytes = 1 << 20;
  // MOELINK_CUDA_SPLIT: pushing to the peers and consuming what they sent run on separate
  // blocks (`blocks` of each), so that the next round's NVLink writes overlap this round's
  // copy or reduction (ops of more than one round, exchangeSplits); 0: every block does both
  // in turn.
  bool split = true;
  // MOELINK_CUDA_LAMPORT_BYTES: exchanges whose pairs are all at most this long take the
  // Lamport protocol (0: never).
  uint64_t lamport_bytes = 0;
  // MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES: all_reduce above lamport_bytes and up to this many bytes
  // takes the two-shot Lamport kernel (allreduceTwoShotLamport; 0: never).
  uint64_t lamport_two_shot_bytes = 0;
  // The row's Lamport block sizes (no setting; a rank's own choice, which its peers never see).
  uint64_t lamport_narrow_bytes = 64 << 10;
  int lamport_threads = 512;
  // MOELINK_CUDA_PDL: the Lamport kernel launches as a programmatic dependent (a rank's own
  // choice; it changes nothing its peers see).
  bool dependent_launch = true;
  // Reads MOELINK_CUDA_* over exchangeDefaults(n) for a group of `n` ranks; throws
  // moelink::Error on a bad value.
  static ExchangeTuning fromEnv(int n = 2);
  bool oneShot(int n, uint64_t bytes) const { return n <= 1 || bytes <= one_shot_bytes; }
};
// Whether a broadcast of `bytes` over `n` ranks takes exchangeBroadcastForward rather than one
// exchange: groups of more than 2, above t.one_shot_bytes. Every rank decides alike from the
// same tuning (one that decides otherwise fails the op on every rank: the exchanges' modes differ).
bool broadcastForwards(int n, uint64_t bytes, const ExchangeTuning& t);
// Whether an all_reduce of `count` elements of `t` over `n` ranks takes the two-shot Lamport kernel
// (exchangeAllreduceTwoShot) rather than one exchange or the two-shot staged one: groups of more than
// 2, above t.lamport_bytes (never where that is 0), at most t.lamport_two_shot_bytes, every block within
// kLamportTwoShotBlockBytes, elements of at most 8 bytes. Every rank decides alike from the same
// tuning (a rank that decides otherwise fails the op on every rank: the exchanges' modes differ).
bool allreduceTwoShotLamport(int n, uint64_t count, DType t, const ExchangeTuning& tuning);
// Whether `x` takes the Lamport protocol: every pair and the reduction within
// t.lamport_bytes (and kLamportMaxBytes). Reductions of 16-byte elements (complex128) stay on
// the staged protocol (a line carries 8 bytes). A kReduceGather exchange always does (the staged
// kernel has no such mode); one whose blocks exceed kLamportTwoShotBlockBytes, or of 16-byte
// elements, throws moelink::Error (allreduceTwoShotLamport never builds one). A kForward or
// kReduceGatherStaged exchange never does (every rank of it is on the staged kernel, whatever
// its pairs' sizes).
bool exchangeLamport(const Exchange& x, const ExchangeTuning& t);
// A copy exchange on the staged kernel (some pair of this rank is too long for lines) sends and
// receives its pairs of at most this many bytes as Lamport lines all the same (0: none; a
// reduction has none). Both ends of a pair know its size, so a peer whose pairs are all short
// (on the Lamport kernel) and this rank move it alike: an all-to-all, where each rank knows
// only its own pairs. A reduction takes one protocol on every rank: each rank sends or receives
// its longest pair (one-shot, reduce and reduce-scatter pairs are all alike; in the two-shot
// scatter half the owner of the longest block receives it and every other rank sends it). A
// kForward exchange has none (its pieces are passed on as they land in their staging halves).
uint64_t exchangeLamportPairs(const Exchange& x, const ExchangeTuning& t);
// Threads of each block of a Lamport launch: kLamportNarrowThreads where the longest pair is at most
// t.lamport_narrow_bytes, t.lamport_threads above, never more than lamportThreads(n). A rank's
// own choice: a line's place in the area does not depend on which block moves it.
int lamportThreadsFor(const Exchange& x, const ExchangeTuning& t);
// Blocks of a Lamport launch (lamportThreadsFor threads, two lines of the longest pair per thread).
int lamportBlocks(const Exchange& x, const ExchangeTuning& t);
// The SMs (one block each) that this rank's launch of `x` holds while it runs: the Lamport
// kernel's blocks and its header block, or the staged kernel's blocks with work, twice that
// when it splits them into roles.
int exchangeSms(const Exchange& x, const ExchangeTuning& t);
// The most SMs any rank's launch holds for one collective on the in-host path (the larger of
// its two exchanges where it takes two), for a group of `n`: `kind` one of all_reduce,
// all_gather, reduce_scatter, all_to_all (even pairs) and broadcast (from rank 0), `bytes` its
// largest tensor (all_gather's output, reduce_scatter's and all_to_all's input, the buffer of
// the others), reductions of float32.
int collectiveSms(OpKind kind, int n, uint64_t bytes, const ExchangeTuning& t);

// Where things live in a rank's staging area (the same on every rank of the group).
struct ExchangeLayout {
  uint64_t header = 0;   // [2 parities][kExchangeMaxRanks] ExchangeHeader
  uint64_t counter = 0;  // ExchangeCounter
  uint64_t flags = 0;    // [2 halves][kExchangeMaxRanks source][kExchangeMaxBlocks] uint64
  uint64_t acks = 0;     // [2 halves][kExchangeMaxRanks consumer][kExchangeMaxBlocks] uint64
  // kReduceGatherStaged's all-gather half: the flags of the reduced pieces a source wrote, and
  // the acknowledgements of the consumers that copied them out, laid out as flags and acks.
  uint64_t gather_flags = 0, gather_acks = 0;
  // [2 halves][n source][round_bytes]; kReduceGatherStaged puts a source's reduce-scatter piece
  // in the first exchangeRoundBytes of its slot and its reduced piece in the next.
  uint64_t data = 0;
  uint64_t lamport = 0;  // [2 parities][n source][kLamportSourceBytes]
  uint64_t round_bytes = 0;
  uint64_t total = 0;
  static ExchangeLayout make(int n, uint64_t round_bytes);
};

// The byte range [lo, hi) of a round's `len` bytes that block `b` of `blocks` handles:
// pieces of at least kExchangeMinPiece, 16-byte aligned.
MOELINK_HOST_DEVICE inline void exchangePiece(uint64_t len, int b, int blocks, uint64_t* lo, uint64_t* hi) {
  uint64_t piece = ((len + blocks - 1) / blocks + 15) / 16 * 16;
  if (piece < kExchangeMinPiece) piece = kExchangeMinPiece;
  const uint64_t l = static_cast<uint64_t>(b) * piece;
  *lo = l < len ? l : len;
  *hi = l + piece < len ? l + piece : len;
}
// The blocks (per role) that have a piece of some pair of `x` in its first, largest round:
// the launch runs only those, so that a small exchange occupies a few SMs. A pair longer than
// two rounds has a piece on each of them on both of its ranks (the kernel's acknowledgements
// rely on it).
int exchangeBlocksWithWork(const Exchange& x, const ExchangeTuning& t);
// Bytes per pair and round that the staged kernel moves for `x`: t.round_bytes, but half of it
// (16-byte aligned) for kReduceGatherStaged, whose pairs' slots hold a piece of each half.
uint64_t exchangeRoundBytes(const Exchange& x, const ExchangeTuning& t);
// Whether this rank runs `x` on separate pushing and consuming blocks: with
// ExchangeTuning::split, when `x` has more than one round (exchangeRoundBytes). Within a round
// the consumers wait for every pusher, so an op of one round gains nothing from them and would
// only pay that wait. A kForward exchange never splits: its root only pushes, and every other
// rank only consumes (passing its pieces on from the consuming block). A rank-local choice: ranks
// pair their blocks by index whatever their roles.
bool exchangeSplits(const Exchange& x, const ExchangeTuning& t);
// Whether some range of the output that `x` writes at `out` (every received pair, or the
// reduction's bytes) overlaps input that this rank pushes to a peer from `in` (an in-place
// op whose pieces meet): then a rank that splits its blocks into roles must not consume a
// round before its pushing blocks have read it. Addresses only; nothing is dereferenced.
// False for kForward: what it passes on is the piece it places, and no other pair writes its
// place. False for kReduceGatherStaged: its reduction writes its own block, which it
// pushes to no peer, and a peer's reduced piece lands on the input this rank pushed to that
// peer only after the peer has reduced it, having received it.
bool exchangeOutputMeetsInput(const Exchange& x, int me, const void* in, const void* out);
// Bytes of round r of a pair that moves `bytes` (0 past the end).
MOELINK_HOST_DEVICE inline uint64_t exchangeRoundLen(uint64_t bytes, uint64_t r, uint64_t round_bytes) {
  uint64_t start = r * round_bytes;
  return bytes > start ? (bytes - start < round_bytes ? bytes - start : round_bytes) : 0;
}

// The staging half (of the two per source) that round r of op `seq` uses.
MOELINK_HOST_DEVICE inline int exchangeHalf(uint64_t seq, uint64_t r) { return static_cast<int>((seq + r) & 1); }
// Whether op `seq` pushes its first round before it has seen its peers' headers: when every
// pair of this rank moves at most one round (`one_round`) on blocks that both push and consume,
// and this rank's previous op succeeded with every pair in one round (`single_ok`, the seq of
// the latest such op). That op saw each peer's header of it, so each peer had ended every
// earlier op, and in it a peer read only half exchangeHalf(seq - 1, 0) of its area: the half
// this op writes is free.
MOELINK_HOST_DEVICE inline bool exchangePushesEarly(uint64_t seq, uint64_t single_ok, bool one_round, int roles) {
  return roles == 1 && one_round && seq >= 1 && single_ok == seq - 1;
}

// The header one rank writes to a peer (64 bytes; seq is written last).
struct ExchangeHeader {
  uint64_t op_bytes;
  uint64_t send_bytes;  // writer -> reader
  uint64_t recv_bytes;  // reader -> writer
  uint64_t round_bytes;
  uint8_t kind, dtype, redop, mode;
  int32_t root;
  uint32_t blocks;
  uint32_t split;
  uint64_t lamport_bytes;  // the tuning's threshold (the protocol must be alike on both ends)
  uint64_t seq;  // op number on this group's exchange path, from 1
};
static_assert(sizeof(ExchangeHeader) == 64, "one header slot is 64 bytes");

// What a failed kernel leaves for the host (in host-mapped memory).
struct ExchangeStatus {
  enum Code : uint32_t { kOk = 0, kMismatch = 1, kTimeout = 2, kAhead = 3, kAborted = 4 };
  uint32_t code;
  int32_t peer;
  uint64_t seq;
  ExchangeHeader mine, theirs;  // this rank's expectation of the peer's header, and the header
};

// The header this rank expects from / sends to `peer` for `x`.
ExchangeHeader exchangeHeader(const Exchange& x, int peer, const ExchangeTuning& t);
// "" when `theirs` (from `peer`) agrees with `mine`, else the reason, phrased as the CPU path
// phrases it ("allreduce #17: rank 2 sent 4096 bytes, this rank expects 8192").
std::string describeMismatch(const ExchangeHeader& mine, const ExchangeHeader& theirs, int peer);
// The error text for a failed status.
std::string describeStatus(const ExchangeStatus& s, uint64_t timeout_ms);

}  // namespace moelink::cuda
