// The worker's side of the host route's pipeline (moelink/cuda/host_pieces.h).
#include "moelink/cuda/host_pieces.h"

#include <algorithm>
#include <memory>

#include "moelink/common/error.h"

namespace moelink::cuda {

using collective::AlgoContext;
using collective::DType;
using collective::OpKind;
using collective::OpSpec;
using collective::ReduceOp;

namespace {

uint64_t ceilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
uint64_t roundUp(uint64_t v, uint64_t a) { return ceilDiv(v, a) * a; }
// Elements per 16-byte vector of the GPU's reduction (at least one).
uint64_t vecOf(size_t e) { return e >= 16 ? 1 : 16 / e; }

// Pipeline ops carry their size marked (collective::kOpBytesInPieces), so that a rank on the
// one-shot route and one on the pipeline (a size near the threshold read differently, or an op
// captured on one rank only) fail the op on the header check rather than mix their messages.
OpSpec pipelineOp(OpKind kind, DType t, ReduceOp op, int root, uint64_t bytes) {
  OpSpec s = collective::emptyOp(kind, t, op, root, bytes | collective::kOpBytesInPieces);
  // A consumed piece cannot be taken back: a membership change after it fails the op.
  s.inplace = true;
  return s;
}

// Appends `piece` gated on m's ready word; when it is done, `before` (a plan), then the done word.
void append(OpSpec& op, const PieceRing& ring, OpSpec piece, PieceMark m, std::function<void()> before) {
  uint32_t* done = ring.done + m.word;
  const uint32_t ticket = m.ticket;
  collective::appendGatedPiece(op, std::move(piece), readyGate(ring, m), [before = std::move(before), done, ticket] {
    if (before) before();
    __atomic_store_n(done, ticket, __ATOMIC_RELEASE);
  });
}

// Writes a reduction's plan for the stream, its ticket last.
std::function<void()> publish(RowsPlan* dst, const RowsPlan& p) {
  return [dst, p] {
    volatile RowsPlan* d = dst;
    d->off = p.off;
    d->len = p.len;
    d->stride = p.stride;
    d->rows = p.rows;
    d->me = p.me;
    __atomic_store_n(&dst->ticket, p.ticket, __ATOMIC_RELEASE);
  };
}

}  // namespace

uint64_t pieceBudget(uint64_t total, int depth, uint64_t min_piece, uint64_t slot_bytes) {
  const uint64_t even = roundUp(ceilDiv(total, static_cast<uint64_t>(std::max(depth, 1))), 16);
  return std::min(slot_bytes, std::max(even, min_piece));
}

uint64_t allreducePieceElems(size_t elem, uint64_t slot_bytes) {
  const uint64_t vec = vecOf(elem);
  return std::max<uint64_t>(vec, slot_bytes / elem / vec * vec);
}

uint64_t reduceScatterPieceElems(size_t elem, uint64_t slot_bytes, int world) {
  const uint64_t vec = vecOf(elem);
  return std::max<uint64_t>(vec, slot_bytes / (elem * static_cast<uint64_t>(world)) / vec * vec);
}

uint64_t allgatherPieceBytes(uint64_t slot_bytes, int world) {
  return std::max<uint64_t>(16, slot_bytes / static_cast<uint64_t>(world) / 16 * 16);
}

uint64_t alltoallPieceBytes(uint64_t slot_bytes, int world) { return allgatherPieceBytes(slot_bytes, world); }

uint64_t alltoallPairPieces(uint64_t send_bytes, uint64_t recv_bytes, uint64_t per) {
  return std::max<uint64_t>(1, ceilDiv(std::max(send_bytes, recv_bytes), per));
}

std::vector<HostPiece> cutPieces(uint64_t total, uint64_t per, int depth, bool two,
                                 const std::function<PieceMark(int word)>& mark) {
  const uint64_t n = std::max<uint64_t>(1, ceilDiv(total, per));
  std::vector<HostPiece> ps(n);
  for (uint64_t p = 0; p < n; ++p) {
    HostPiece& pc = ps[p];
    pc.off = std::min(total, p * per);
    pc.len = std::min(per, total - pc.off);
    pc.slot = static_cast<int>(p % static_cast<uint64_t>(depth));
    pc.first = mark(2 * pc.slot);
    if (two) pc.second = mark(2 * pc.slot + 1);
  }
  return ps;
}

std::function<bool()> readyGate(const PieceRing& ring, PieceMark m) {
  uint32_t* word = ring.ready + m.word;
  const uint32_t ticket = m.ticket;
  return [word, ticket] { return static_cast<int32_t>(__atomic_load_n(word, __ATOMIC_ACQUIRE) - ticket) >= 0; };
}

AlgoContext amongRanks(const AlgoContext& c, const std::vector<int>& among, std::string* missing) {
  AlgoContext sub = c;
  sub.world = c.world ? c.world : static_cast<int>(c.ranks.size());
  sub.ranks.clear();
  for (int r : among) {
    if (std::binary_search(c.ranks.begin(), c.ranks.end(), r))
      sub.ranks.push_back(r);
    else if (missing->empty())
      *missing = moelink::str("rank ", r, " left the group, and this rank's two-level op exchanges with it (the op "
                              "fails; the next ones run over the ranks left, every rank on the wire)");
  }
  return sub;
}

OpSpec allreducePieces(const AlgoContext& ctx, const PieceRing& ring, const std::vector<HostPiece>& ps,
                       uint64_t count, DType t, ReduceOp rop, int world, int rank, bool one_exchange) {
  const uint64_t e = collective::elementSize(t), vec = vecOf(e);
  OpSpec op = pipelineOp(OpKind::kAllreduce, t, rop, -1, count * e);
  const int m = static_cast<int>(ctx.ranks.size()), me = static_cast<int>(collective::indexOf(ctx, rank));
  if (one_exchange) {
    // Of two ranks (or one left): the other's whole piece lands in row 0 of `out`.
    MOELINK_CHECK(m <= 2, "an all_reduce in one exchange per piece among ", m, " ranks");
    std::vector<uint64_t> zero(world, 0), bytes(world, 0);
    for (const HostPiece& pc : ps) {
      for (int r : ctx.ranks) bytes[r] = r == rank ? 0 : pc.len * e;
      append(op, ring, collective::alltoallOp(ctx, ring.in(pc.slot), zero, bytes, ring.out(pc.slot), zero, bytes),
             pc.first, publish(ring.plans + pc.slot, RowsPlan{pc.first.ticket, 0, pc.len * e, 0, m, me}));
    }
    return op;
  }
  // The all-gather halves read and write the same slot, so the op is not pullable
  // (appendGatedPiece): no piece may be cut for pulled messages.
  AlgoContext c1 = ctx;
  c1.pull_chunk = 0;
  // Block i of a piece (of m, by active rank): byte offset and length; returns the stride.
  auto block = [&](const HostPiece& pc, int i, uint64_t* off, uint64_t* len) {
    const uint64_t blk = roundUp(ceilDiv(pc.len, static_cast<uint64_t>(m)), vec);
    const uint64_t b = std::min(pc.len, i * blk), end = std::min(pc.len, (i + 1) * blk);
    *off = b * e;
    *len = (end - b) * e;
    return blk * e;
  };
  std::vector<uint64_t> so(world), sb(world), ro(world), rb(world);
  auto scatterOf = [&](const HostPiece& pc) {
    uint64_t moff, mlen;
    const uint64_t stride = block(pc, me, &moff, &mlen);
    std::fill(sb.begin(), sb.end(), 0);
    std::fill(rb.begin(), rb.end(), 0);
    for (int i = 0; i < m; ++i) {
      const int r = ctx.ranks[i];
      if (r == rank) continue;
      block(pc, i, &so[r], &sb[r]);
      ro[r] = static_cast<uint64_t>(i) * stride;
      rb[r] = mlen;
    }
    append(op, ring, collective::alltoallOp(c1, ring.in(pc.slot), so, sb, ring.out(pc.slot), ro, rb), pc.first,
           publish(ring.plans + pc.slot, RowsPlan{pc.first.ticket, moff, mlen, stride, m, me}));
  };
  auto gatherOf = [&](const HostPiece& pc) {
    uint64_t moff, mlen;
    block(pc, me, &moff, &mlen);
    std::fill(sb.begin(), sb.end(), 0);
    std::fill(rb.begin(), rb.end(), 0);
    for (int i = 0; i < m; ++i) {
      const int r = ctx.ranks[i];
      if (r == rank) continue;
      so[r] = moff;
      sb[r] = mlen;
      block(pc, i, &ro[r], &rb[r]);
    }
    append(op, ring, collective::alltoallOp(c1, ring.in(pc.slot), so, sb, ring.in(pc.slot), ro, rb), pc.second,
           nullptr);
  };
  // Piece p+1's reduce-scatter before piece p's all-gather: the wire is busy while the GPU
  // reduces piece p.
  scatterOf(ps[0]);
  for (size_t p = 0; p < ps.size(); ++p) {
    if (p + 1 < ps.size()) scatterOf(ps[p + 1]);
    gatherOf(ps[p]);
  }
  return op;
}

namespace {

// The rail's active ranks. A rank of the rail or of the host that left fails the op at its
// first gate (`missing` says so), as a failed check does: the op has been set up with the ranks
// left, who get this rank's abort (a failure while building would leave them waiting for its
// messages until their deadline).
AlgoContext railContext(const AlgoContext& ctx, const RailStep& step, std::string* missing) {
  AlgoContext rail = amongRanks(ctx, step.rail, missing);
  amongRanks(ctx, step.local, missing);
  return rail;
}

// `op` (built among the rail's active ranks) as the cross-host step of a two-level op: a header
// to every active rank first, each piece held until step.check() is "" (and `missing`, why a
// rank of the rail or host is absent, fails it), the host's barrier last.
OpSpec railOp(const AlgoContext& ctx, OpSpec op, const RailStep& step, const std::string& missing) {
  std::string known;  // the caller's `missing` has it
  const AlgoContext local = amongRanks(ctx, step.local, &known);
  op.op_bytes = step.op_bytes | collective::kOpBytesInPieces;
  // No piece goes before every rank's header has come and passed the check (so that a rank
  // that fails here has first told every rank what it runs). The pieces' steps move one down,
  // behind the header's.
  auto announced = std::make_shared<bool>(false);
  for (collective::Step& st : op.steps) {
    st.gate = [gate = std::move(st.gate), check = step.check, missing, announced] {
      if (!*announced || (gate && !gate())) return false;
      const std::string why = !missing.empty() ? missing : check ? check() : "";
      if (!why.empty()) throw moelink::Error(why);  // fails the op (the worker's progress catches it)
      return true;
    };
    if (st.send_after == collective::Step::SendAfter::kAfterStep) ++st.after;
  }
  // First, the op's header to every active rank (sent as the op starts).
  collective::Step hello = std::move(collective::barrierOp(ctx).steps.front());
  hello.consume = [announced](const std::vector<const char*>&) { *announced = true; };
  op.steps.insert(op.steps.begin(), std::move(hello));
  // Last, the host's barrier.
  collective::Step st = std::move(collective::barrierOp(local).steps.front());
  st.send_after = collective::Step::SendAfter::kAfterStep;
  st.after = op.steps.size() - 1;  // the last piece's hand-back
  op.steps.push_back(std::move(st));
  return op;
}

}  // namespace

OpSpec railAllreducePieces(const AlgoContext& ctx, const PieceRing& ring, const std::vector<HostPiece>& ps,
                           uint64_t count, DType t, ReduceOp rop, int world, int rank, const RailStep& step,
                           bool one_exchange) {
  std::string missing;
  const AlgoContext rail = railContext(ctx, step, &missing);
  return railOp(ctx, allreducePieces(rail, ring, ps, count, t, rop, world, rank, one_exchange), step, missing);
}

OpSpec railAllgatherPieces(const AlgoContext& ctx, const PieceRing& ring, const std::vector<HostPiece>& ps,
                           uint64_t bytes, uint64_t per, int world, int rank, const RailStep& step) {
  std::string missing;
  const AlgoContext rail = railContext(ctx, step, &missing);
  OpSpec op = pipelineOp(OpKind::kAllgather, DType::kBytes, ReduceOp::kNone, -1, bytes);
  // Rows by position on the rail (the stream places them so): its active index, as every rank
  // of the rail is active (or `missing` fails the op before a piece goes).
  std::vector<uint64_t> so(world, 0), sb(world, 0), ro(world, 0), rb(world, 0);
  for (const HostPiece& pc : ps) {
    for (size_t i = 0; i < rail.ranks.size(); ++i) {
      const int r = rail.ranks[i];
      if (r == rank) continue;
      sb[r] = rb[r] = pc.len;
      ro[r] = i * per;
    }
    append(op, ring, collective::alltoallOp(rail, ring.in(pc.slot), so, sb, ring.out(pc.slot), ro, rb), pc.first,
           nullptr);
  }
  return railOp(ctx, std::move(op), step, missing);
}

OpSpec railBroadcastPieces(const AlgoContext& ctx, const PieceRing& ring, const std::vector<HostPiece>& ps,
                           uint64_t bytes, int root, const RailStep& step) {
  std::string missing;
  const AlgoContext rail = railContext(ctx, step, &missing);
  // Off the root's rail (or with the root gone, which `missing` says before a piece goes) the
  // pieces have nothing to move: each is its gate and its hand-back.
  const bool carries = std::binary_search(rail.ranks.begin(), rail.ranks.end(), root);
  OpSpec op = pipelineOp(OpKind::kBroadcast, DType::kBytes, ReduceOp::kNone, root, bytes);
  for (const HostPiece& pc : ps)
    append(op, ring, carries ? collective::broadcastOp(rail, ring.in(pc.slot), pc.len, root) : OpSpec{}, pc.first,
           nullptr);
  return railOp(ctx, std::move(op), step, missing);
}

namespace {

// Appends the pieces of a reduce-scatter among c's ranks to `op`: each piece's block for the rank
// at active index i leaves from row i of its slot when `by_position`, else from row r (its rank),
// and lands at row i of the receiver's; the slot's plan then reduces the rows received.
void appendReduceScatterPieces(OpSpec& op, const AlgoContext& c, const PieceRing& ring,
                               const std::vector<HostPiece>& ps, uint64_t e, uint64_t row, int world, int rank,
                               bool by_position) {
  const int m = static_cast<int>(c.ranks.size()), me = static_cast<int>(collective::indexOf(c, rank));
  std::vector<uint64_t> so(world), sb(world), ro(world), rb(world);
  for (const HostPiece& pc : ps) {
    std::fill(sb.begin(), sb.end(), 0);
    std::fill(rb.begin(), rb.end(), 0);
    for (int i = 0; i < m; ++i) {
      const int r = c.ranks[i];
      if (r == rank) continue;
      so[r] = static_cast<uint64_t>(by_position ? i : r) * row;
      ro[r] = static_cast<uint64_t>(i) * row;
      sb[r] = rb[r] = pc.len * e;
    }
    append(op, ring, collective::alltoallOp(c, ring.in(pc.slot), so, sb, ring.out(pc.slot), ro, rb), pc.first,
           publish(ring.plans + pc.slot, RowsPlan{pc.first.ticket, 0, pc.len * e, row, m, me}));
  }
}

}  // namespace

OpSpec railReduceScatterPieces(const AlgoContext& ctx, const PieceRing& ring, const std::vector<HostPiece>& ps,
                               uint64_t count, uint64_t per, DType t, ReduceOp rop, int world, int rank,
                               const RailStep& step) {
  std::string missing;
  const AlgoContext rail = railContext(ctx, step, &missing);
  const uint64_t e = collective::elementSize(t);
  OpSpec op = pipelineOp(OpKind::kReduceScatter, t, rop, -1, 0);
  // Packed by position on the rail, received by active index: the same, as every rank of the
  // rail is active (or `missing` fails the op before a piece goes).
  appendReduceScatterPieces(op, rail, ring, ps, e, per * e, world, rank, true);
  return railOp(ctx, std::move(op), step, missing);
}

OpSpec reduceScatterPieces(const AlgoContext& ctx, const PieceRing& ring, const std::vector<HostPiece>& ps,
                           uint64_t count, uint64_t per, DType t, ReduceOp rop, int world, int rank) {
  const uint64_t e = collective::elementSize(t);
  OpSpec op = pipelineOp(OpKind::kReduceScatter, t, rop, -1, count * e * static_cast<uint64_t>(world));
  appendReduceScatterPieces(op, ctx, ring, ps, e, per * e, world, rank, false);  // packed by rank
  return op;
}

OpSpec allgatherPieces(const AlgoContext& ctx, const PieceRing& ring, const std::vector<HostPiece>& ps,
                       uint64_t bytes, uint64_t per, int world, int rank) {
  OpSpec op = pipelineOp(OpKind::kAllgather, DType::kBytes, ReduceOp::kNone, -1, bytes);
  std::vector<uint64_t> so(world, 0), sb(world), ro(world), rb(world);
  for (const HostPiece& pc : ps) {
    for (int r = 0; r < world; ++r) {
      // Every rank's row at its rank; an inactive rank's is zeroed (alltoallOp's finish).
      sb[r] = r == rank || !std::binary_search(ctx.ranks.begin(), ctx.ranks.end(), r) ? 0 : pc.len;
      ro[r] = static_cast<uint64_t>(r) * per;
      rb[r] = r == rank ? 0 : pc.len;
    }
    append(op, ring, collective::alltoallOp(ctx, ring.in(pc.slot), so, sb, ring.out(pc.slot), ro, rb), pc.first,
           nullptr);
  }
  return op;
}

OpSpec alltoallPieces(const AlgoContext& ctx, const PieceRing& ring, const std::vector<HostPiece>& ps, uint64_t per,
                      const std::vector<uint64_t>& send_bytes, const std::vector<uint64_t>& recv_bytes, int world,
                      int rank) {
  // No size to compare (the ranks' differ). Ranks whose piece sizes differ still place every row
  // by their own cut: where a pair's cuts differ, the message sizes disagree and fail the op.
  OpSpec op = pipelineOp(OpKind::kAlltoall, DType::kBytes, ReduceOp::kNone, -1, 0);
  std::vector<uint64_t> off(world), sb(world), rb(world);
  for (int r = 0; r < world; ++r) off[r] = static_cast<uint64_t>(r) * per;
  for (size_t p = 0; p < ps.size(); ++p) {
    const HostPiece& pc = ps[p];
    auto left = [&](uint64_t n) { return n > pc.off ? std::min(per, n - pc.off) : 0; };
    // The piece's part: this rank and every active peer whose pair has a piece p; the others'
    // rows of the slot are zeroed (an inactive rank's) or empty.
    AlgoContext part = ctx;
    part.world = world;
    part.ranks.clear();
    for (int r = 0; r < world; ++r) {
      const bool active = std::binary_search(ctx.ranks.begin(), ctx.ranks.end(), r);
      sb[r] = r == rank || !active ? 0 : left(send_bytes[r]);
      rb[r] = r == rank ? 0 : left(recv_bytes[r]);
      if (r == rank || (active && p < alltoallPairPieces(send_bytes[r], recv_bytes[r], per))) part.ranks.push_back(r);
    }
    append(op, ring, collective::alltoallOp(part, ring.in(pc.slot), off, sb, ring.out(pc.slot), off, rb), pc.first,
           nullptr);
  }
  return op;
}

OpSpec broadcastPieces(const AlgoContext& ctx, const PieceRing& ring, const std::vector<HostPiece>& ps,
                       uint64_t bytes, int root) {
  OpSpec op = pipelineOp(OpKind::kBroadcast, DType::kBytes, ReduceOp::kNone, root, bytes);
  for (const HostPiece& pc : ps)
    append(op, ring, collective::broadcastOp(ctx, ring.in(pc.slot), pc.len, root), pc.first, nullptr);
  return op;
}

}  // namespace moelink::cuda
