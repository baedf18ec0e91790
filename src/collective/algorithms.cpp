#include "moelink/collective/algorithms.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "moelink/collective/reduce.h"
#include "moelink/common/error.h"

namespace moelink::collective {

const char* opKindName(OpKind k) {
  switch (k) {
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllreduce: return "allreduce";
    case OpKind::kReduce: return "reduce";
    case OpKind::kAllgather: return "allgather";
    case OpKind::kGather: return "gather";
    case OpKind::kScatter: return "scatter";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAlltoall: return "alltoall";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kSend: return "send";
  }
  return "?";
}

namespace {

// Pieces of a range of n units cut every `per` units; an empty range is one empty piece.
struct Pieces {
  uint64_t n, per;
  size_t count() const { return n == 0 ? 1 : static_cast<size_t>((n + per - 1) / per); }
  uint64_t off(size_t i) const { return std::min<uint64_t>(n, i * per); }
  uint64_t len(size_t i) const { return i < count() ? std::min<uint64_t>(per, n - off(i)) : 0; }
};

uint64_t perChunk(const AlgoContext& c, size_t es) { return std::max<uint64_t>(1, c.chunk / es); }

// Elements per piece of a reduction whose blocks hold about `block` elements
// (AlgoContext::reduce_piece_min): every rank computes it from the op's size alone.
uint64_t perReduce(const AlgoContext& c, size_t es, uint64_t block) {
  const uint64_t slot = perChunk(c, es);
  if (!c.reduce_piece_min || c.reduce_pieces < 2) return slot;
  const uint64_t least = std::max<uint64_t>(1, c.reduce_piece_min / es);
  const uint64_t want = (block + c.reduce_pieces - 1) / c.reduce_pieces;
  return std::min(slot, std::max(least, want));
}

char* at(void* p, uint64_t off) { return static_cast<char*>(p) + off; }

int worldOf(const AlgoContext& c) { return c.world ? c.world : static_cast<int>(c.ranks.size()); }

// The ranks of the group that do not take part (their output blocks are zero-filled).
std::vector<int> absent(const AlgoContext& c) {
  std::vector<int> out;
  for (int r = 0; r < worldOf(c); ++r)
    if (!std::binary_search(c.ranks.begin(), c.ranks.end(), r)) out.push_back(r);
  return out;
}

// Copies each received piece to its destination, unless it was received there directly.
void copyIfElsewhere(char* dst, const char* got, uint64_t len) {
  if (got != dst) std::memcpy(dst, got, len);
}
const char* at(const void* p, uint64_t off) { return static_cast<const char*>(p) + off; }

// Whether [a, a+na) and [b, b+nb) share no byte.
bool disjoint(const void* a, uint64_t na, const void* b, uint64_t nb) {
  auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x + na <= y || y + nb <= x;
}

// Reduces, in participant order, `own` (this rank's piece) with the received pieces.
std::function<void(const std::vector<const char*>&)> reduceConsumer(
    const AlgoContext& c, const char* own, char* out, uint64_t count, DType t, ReduceOp op,
    std::shared_ptr<std::vector<char>> scratch) {
  size_t me = indexOf(c, c.me);
  size_t n = c.ranks.size();
  return [=](const std::vector<const char*>& got) {
    std::vector<const void*> inputs;
    inputs.reserve(n);
    for (size_t j = 0, k = 0; j < n; ++j) inputs.push_back(j == me ? own : got[k++]);
    reduceOrdered(out, inputs, count, t, op, *scratch);
    if (op == ReduceOp::kAvg) divideInPlace(out, count, t, static_cast<double>(n));
  };
}

std::vector<StepRecv> fromAllPeers(const AlgoContext& c, uint64_t bytes) {
  std::vector<StepRecv> r;
  for (int p : c.ranks)
    if (p != c.me) r.push_back({p, bytes});
  return r;
}

std::vector<StepSend> toAllPeers(const AlgoContext& c, const char* data, uint64_t bytes) {
  std::vector<StepSend> s;
  for (int p : c.ranks)
    if (p != c.me) s.push_back({p, data, bytes});
  return s;
}

// Receives [off, off+len) of every peer's block into `out` (block j at j * block), the
// step shared by allgather and by gather's root.
void recvBlocksFromAllPeers(const AlgoContext& c, Step& st, void* out, uint64_t block, uint64_t off, uint64_t len) {
  std::vector<char*> dst;
  for (size_t j = 0; j < c.ranks.size(); ++j)
    if (c.ranks[j] != c.me) {
      dst.push_back(at(out, c.ranks[j] * block + off));
      st.recvs.push_back({c.ranks[j], len, dst.back()});
    }
  st.consume = [dst, len](const std::vector<const char*>& got) {
    for (size_t k = 0; k < dst.size(); ++k) copyIfElsewhere(dst[k], got[k], len);
  };
}

// Allreduce as a pipelined ring over the participants in order. Block b (of n) travels the
// ring once accumulating (reduce-scatter: in round k participant i sends block i-k to i+1 and
// adds block i-k-1 from i-1 into its own), ending reduced at participant b-1, and once more as
// the result (allgather). Each piece is forwarded as soon as it is reduced or received (steps
// that send what they consumed), so the rounds overlap piece by piece. Every rank ends with the
// same bytes: each block is reduced once, by one chain of ranks, and then copied.
OpSpec ringAllreduce(const AlgoContext& c, OpSpec s, void* buf, uint64_t count, DType t, ReduceOp op) {
  const size_t es = elementSize(t), n = c.ranks.size(), me = indexOf(c, c.me);
  const int next = c.ranks[(me + 1) % n], prev = c.ranks[(me + n - 1) % n];
  const uint64_t per = perReduce(c, es, count / n);
  auto block_start = [&](size_t b) { return count * b / n; };
  auto piece = [&](size_t b, size_t i, uint64_t* len) {
    Pieces pc{block_start(b + 1) - block_start(b), per};
    *len = pc.len(i);
    return at(buf, (block_start(b) + pc.off(i)) * es);
  };
  auto pieces = [&](size_t b) { return Pieces{block_start(b + 1) - block_start(b), per}.count(); };
  auto mod = [n](int64_t v) { return static_cast<size_t>(((v % static_cast<int64_t>(n)) + n) % n); };
  // Round 0 of the reduce-scatter: this participant's own block, at once.
  for (size_t i = 0; i < pieces(me); ++i) {
    Step st;
    uint64_t len;
    char* p = piece(me, i, &len);
    st.sends = {{next, p, len * es}};
    s.steps.push_back(std::move(st));
  }
  // Reduce-scatter rounds: add block me-k-1 from prev, then pass it on (to start the
  // allgather when this rank's reduction of it is the last).
  for (size_t k = 0; k + 1 < n; ++k) {
    const size_t b = mod(static_cast<int64_t>(me) - static_cast<int64_t>(k) - 1);
    const bool last = k + 2 == n;
    for (size_t i = 0; i < pieces(b); ++i) {
      Step st;
      uint64_t len;
      char* p = piece(b, i, &len);
      st.recvs = {{prev, len * es}};
      st.consume = [p, len, t, op, last, n](const std::vector<const char*>& got) {
        reduceInto(p, got[0], len, t, op);
        if (last && op == ReduceOp::kAvg) divideInPlace(p, len, t, static_cast<double>(n));
      };
      st.sends = {{next, p, len * es}};
      st.send_after = Step::SendAfter::kThisStep;
      s.steps.push_back(std::move(st));
    }
  }
  // Allgather rounds: block me-k arrives reduced from prev; pass it on unless next made it.
  for (size_t k = 0; k + 1 < n; ++k) {
    const size_t b = mod(static_cast<int64_t>(me) - static_cast<int64_t>(k));
    for (size_t i = 0; i < pieces(b); ++i) {
      Step st;
      uint64_t len;
      char* p = piece(b, i, &len);
      st.recvs = {{prev, len * es, p}};
      st.consume = [p, len, es](const std::vector<const char*>& got) { copyIfElsewhere(p, got[0], len * es); };
      if (k + 2 < n) {
        st.sends = {{next, p, len * es}};
        st.send_after = Step::SendAfter::kThisStep;
      }
      s.steps.push_back(std::move(st));
    }
  }
  return s;
}

}  // namespace

size_t indexOf(const AlgoContext& c, int rank) {
  auto it = std::find(c.ranks.begin(), c.ranks.end(), rank);
  MOELINK_CHECK(it != c.ranks.end(), "rank ", rank, " is not active in the group (it left; moelink.recover_ranks readmits a replacement)");
  return static_cast<size_t>(it - c.ranks.begin());
}

OpSpec emptyOp(OpKind k, DType t, ReduceOp op, int root, uint64_t op_bytes) {
  OpSpec s;
  s.kind = k;
  s.dtype = t;
  s.redop = op;
  s.root = root;
  s.op_bytes = op_bytes;
  return s;
}


OpSpec broadcastOp(const AlgoContext& c, void* buf, uint64_t bytes, int root) {
  size_t r = indexOf(c, root);
  OpSpec s = emptyOp(OpKind::kBroadcast, DType::kBytes, ReduceOp::kNone, root, bytes);
  s.pullable = true;  // the root's buffer only changes on the others, a chunk only once before it is forwarded
  // First every other rank tells the root it takes part, with this root in its header: a rank
  // that disagrees about the root then receives a message naming another root, and the op
  // fails on the ranks that disagree instead of leaving them with diverged data.
  Step roll_call;
  if (c.me == root)
    roll_call.recvs = fromAllPeers(c, 0);
  else
    roll_call.sends = {{root, static_cast<const char*>(buf), 0}};
  s.steps.push_back(std::move(roll_call));
  Pieces pc{bytes, c.chunk};
  size_t n = c.ranks.size();
  if (c.chain_broadcast_bytes && bytes > c.chain_broadcast_bytes && n > 2) {
    // Chain root -> root+1 -> ... : every rank forwards each chunk as soon as it has it.
    size_t pos = (indexOf(c, c.me) + n - r) % n;
    int prev = pos ? c.ranks[(r + pos - 1) % n] : -1;
    int next = pos + 1 < n ? c.ranks[(r + pos + 1) % n] : -1;
    for (size_t i = 0; i < pc.count(); ++i) {
      Step st;
      char* p = at(buf, pc.off(i));
      uint64_t len = pc.len(i);
      if (prev >= 0) {
        st.recvs = {{prev, len, p}};
        st.consume = [p, len](const std::vector<const char*>& got) { copyIfElsewhere(p, got[0], len); };
        st.send_after = Step::SendAfter::kThisStep;
      }
      if (next >= 0) st.sends = {{next, p, len}};
      s.steps.push_back(std::move(st));
    }
    return s;
  }
  for (size_t i = 0; i < pc.count(); ++i) {
    Step st;
    char* p = at(buf, pc.off(i));
    uint64_t len = pc.len(i);
    if (c.me == root) {
      st.sends = toAllPeers(c, p, len);
    } else {
      st.recvs = {{root, len, p}};
      st.consume = [p, len](const std::vector<const char*>& got) { copyIfElsewhere(p, got[0], len); };
    }
    s.steps.push_back(std::move(st));
  }
  return s;
}

OpSpec allreduceOp(const AlgoContext& c, void* buf, uint64_t count, DType t, ReduceOp op) {
  size_t es = elementSize(t);
  size_t n = c.ranks.size();
  OpSpec s = emptyOp(OpKind::kAllreduce, t, op, -1, count * es);
  s.inplace = true;
  auto scratch = std::make_shared<std::vector<char>>();
  if (n == 1) return s;  // nothing to combine; AVG of one rank is the input
  if (count * es <= c.allreduce_small_bytes || count < n) {
    // Latency path: everyone sends everything to everyone and reduces locally.
    Pieces pc{count, perChunk(c, es)};
    for (size_t i = 0; i < pc.count(); ++i) {
      Step st;
      char* p = at(buf, pc.off(i) * es);
      st.sends = toAllPeers(c, p, pc.len(i) * es);
      st.recvs = fromAllPeers(c, pc.len(i) * es);
      st.consume = reduceConsumer(c, p, p, pc.len(i), t, op, scratch);
      st.consume_after_sends = true;  // reduces in place over what it sent
      s.steps.push_back(std::move(st));
    }
    return s;
  }
  if (c.ring_allreduce_bytes && count * es >= c.ring_allreduce_bytes && n > 2) return ringAllreduce(c, s, buf, count, t, op);
  // Bandwidth path: reduce-scatter (participant j reduces block j), then allgather.
  std::vector<uint64_t> start(n + 1);
  for (size_t j = 0; j <= n; ++j) start[j] = count * j / n;
  size_t me = indexOf(c, c.me);
  const uint64_t per = perReduce(c, es, count / n);
  auto block = [&](size_t j) { return Pieces{start[j + 1] - start[j], per}; };
  size_t steps = 0;
  for (size_t j = 0; j < n; ++j) steps = std::max(steps, block(j).count());
  std::vector<size_t> reduced(steps, 0);  // the index of reduce-scatter step i in s.steps
  for (int phase = 0; phase < 2; ++phase) {
    for (size_t i = 0; i < steps; ++i) {
      Step st;
      Pieces mine = block(me);
      char* my_piece = at(buf, (start[me] + mine.off(i)) * es);
      for (size_t j = 0; j < n; ++j) {
        if (j == me) continue;
        Pieces b = block(j);
        int peer = c.ranks[j];
        if (phase == 0) {
          if (i < b.count()) st.sends.push_back({peer, at(buf, (start[j] + b.off(i)) * es), b.len(i) * es});
          if (i < mine.count()) st.recvs.push_back({peer, mine.len(i) * es});
        } else {
          if (i < mine.count()) st.sends.push_back({peer, my_piece, mine.len(i) * es});
          if (i < b.count()) st.recvs.push_back({peer, b.len(i) * es, at(buf, (start[j] + b.off(i)) * es)});
        }
      }
      if (phase == 0) {
        if (i < mine.count()) st.consume = reduceConsumer(c, my_piece, my_piece, mine.len(i), t, op, scratch);
      } else {
        // Piece i of this rank's block is final once reduce-scatter step i has been consumed:
        // it goes then, while later pieces are still being reduced and earlier ones are in
        // flight (not one piece per round trip).
        st.send_after = Step::SendAfter::kAfterStep;
        st.after = reduced[i];
        std::vector<std::pair<char*, uint64_t>> dst;
        for (size_t j = 0; j < n; ++j) {
          Pieces b = block(j);
          if (j != me && i < b.count()) dst.push_back({at(buf, (start[j] + b.off(i)) * es), b.len(i) * es});
        }
        st.consume = [dst](const std::vector<const char*>& got) {
          for (size_t k = 0; k < dst.size(); ++k) copyIfElsewhere(dst[k].first, got[k], dst[k].second);
        };
      }
      if (phase == 0) reduced[i] = s.steps.size();  // (never empty: some block has piece i)
      if (!st.sends.empty() || !st.recvs.empty()) s.steps.push_back(std::move(st));
    }
  }
  return s;
}

OpSpec reduceOp(const AlgoContext& c, const void* in, void* out, uint64_t count, DType t,
                ReduceOp op, int root) {
  indexOf(c, root);
  size_t es = elementSize(t);
  OpSpec s = emptyOp(OpKind::kReduce, t, op, root, count * es);
  s.inplace = in == out;
  auto scratch = std::make_shared<std::vector<char>>();
  Pieces pc{count, perChunk(c, es)};
  for (size_t i = 0; i < pc.count(); ++i) {
    Step st;
    uint64_t off = pc.off(i) * es, len = pc.len(i) * es;
    if (c.me == root) {
      st.recvs = fromAllPeers(c, len);
      st.consume = reduceConsumer(c, at(in, off), at(out, off), pc.len(i), t, op, scratch);
    } else {
      st.sends = {{root, at(in, off), len}};
    }
    s.steps.push_back(std::move(st));
  }
  if (c.ranks.size() == 1 && c.me == root) {
    s.finish = [in, out, count, es] {
      if (in != out) std::memmove(out, in, count * es);
    };
  }
  return s;
}

OpSpec allgatherOp(const AlgoContext& c, const void* in, void* out, uint64_t bytes) {
  indexOf(c, c.me);
  const uint64_t me = static_cast<uint64_t>(c.me);
  const auto gone = absent(c);
  OpSpec s = emptyOp(OpKind::kAllgather, DType::kBytes, ReduceOp::kNone, -1, bytes);
  s.pullable = disjoint(in, bytes, out, bytes * worldOf(c)) || in == at(out, me * bytes);
  Pieces pc{bytes, c.chunk};
  for (size_t i = 0; i < pc.count(); ++i) {
    Step st;
    uint64_t off = pc.off(i), len = pc.len(i);
    st.sends = toAllPeers(c, at(in, off), len);
    recvBlocksFromAllPeers(c, st, out, bytes, off, len);
    s.steps.push_back(std::move(st));
  }
  s.finish = [in, out, me, bytes, gone] {
    std::memmove(at(out, me * bytes), in, bytes);
    for (int r : gone) std::memset(at(out, r * bytes), 0, bytes);
  };
  return s;
}

OpSpec gatherOp(const AlgoContext& c, const void* in, void* out, uint64_t bytes, int root) {
  indexOf(c, root);
  indexOf(c, c.me);
  const uint64_t me = static_cast<uint64_t>(c.me);
  const auto gone = absent(c);
  OpSpec s = emptyOp(OpKind::kGather, DType::kBytes, ReduceOp::kNone, root, bytes);
  s.pullable = true;  // only the root receives, and it sends nothing
  Pieces pc{bytes, c.chunk};
  for (size_t i = 0; i < pc.count(); ++i) {
    Step st;
    uint64_t off = pc.off(i), len = pc.len(i);
    if (c.me == root) {
      recvBlocksFromAllPeers(c, st, out, bytes, off, len);
    } else {
      st.sends = {{root, at(in, off), len}};
    }
    s.steps.push_back(std::move(st));
  }
  if (c.me == root)
    s.finish = [in, out, me, bytes, gone] {
      std::memmove(at(out, me * bytes), in, bytes);
      for (int r : gone) std::memset(at(out, r * bytes), 0, bytes);
    };
  return s;
}

OpSpec scatterOp(const AlgoContext& c, const void* in, void* out, uint64_t bytes, int root) {
  indexOf(c, root);
  indexOf(c, c.me);
  const uint64_t me = static_cast<uint64_t>(c.me);
  OpSpec s = emptyOp(OpKind::kScatter, DType::kBytes, ReduceOp::kNone, root, bytes);
  s.pullable = true;  // only the root sends, and it receives nothing
  Pieces pc{bytes, c.chunk};
  for (size_t i = 0; i < pc.count(); ++i) {
    Step st;
    uint64_t off = pc.off(i), len = pc.len(i);
    if (c.me == root) {
      for (int r : c.ranks)
        if (r != c.me) st.sends.push_back({r, at(in, r * bytes + off), len});
    } else {
      char* dst = at(out, off);
      st.recvs = {{root, len, dst}};
      st.consume = [dst, len](const std::vector<const char*>& got) { copyIfElsewhere(dst, got[0], len); };
    }
    s.steps.push_back(std::move(st));
  }
  if (c.me == root) s.finish = [in, out, me, bytes] { std::memmove(out, at(in, me * bytes), bytes); };
  return s;
}

OpSpec reduceScatterOp(const AlgoContext& c, const void* in, void* out, uint64_t count, DType t,
                       ReduceOp op) {
  size_t es = elementSize(t);
  indexOf(c, c.me);
  const uint64_t me = static_cast<uint64_t>(c.me);
  OpSpec s = emptyOp(OpKind::kReduceScatter, t, op, -1, count * es);
  auto scratch = std::make_shared<std::vector<char>>();
  uint64_t block = count * es;
  Pieces pc{count, perReduce(c, es, count)};
  for (size_t i = 0; i < pc.count(); ++i) {
    Step st;
    uint64_t off = pc.off(i) * es, len = pc.len(i) * es;
    for (int r : c.ranks)
      if (r != c.me) st.sends.push_back({r, at(in, r * block + off), len});
    st.recvs = fromAllPeers(c, len);
    st.consume = reduceConsumer(c, at(in, me * block + off), at(out, off), pc.len(i), t, op, scratch);
    s.steps.push_back(std::move(st));
  }
  if (c.ranks.size() == 1) s.finish = [in, out, me, block] { std::memmove(out, at(in, me * block), block); };
  return s;
}

OpSpec alltoallOp(const AlgoContext& c, const void* in, const std::vector<uint64_t>& send_off,
                  const std::vector<uint64_t>& send_bytes, void* out,
                  const std::vector<uint64_t>& recv_off, const std::vector<uint64_t>& recv_bytes) {
  indexOf(c, c.me);
  const size_t w = static_cast<size_t>(worldOf(c));
  MOELINK_CHECK(send_bytes.size() == w && recv_bytes.size() == w, "alltoall needs one split per rank");
  OpSpec s = emptyOp(OpKind::kAlltoall, DType::kBytes, ReduceOp::kNone, -1, 0);
  uint64_t in_end = 0, out_end = 0;
  for (size_t r = 0; r < w; ++r) {
    in_end = std::max(in_end, send_off[r] + send_bytes[r]);
    out_end = std::max(out_end, recv_off[r] + recv_bytes[r]);
  }
  s.pullable = disjoint(in, in_end, out, out_end);  // in place, a receive would overwrite unread data
  // A pair whose receiver reads the sender's memory moves in larger pieces: fewer round trips.
  auto piece = [&](const std::vector<char>& direct, int r) {
    return s.pullable && c.pull_chunk && r < static_cast<int>(direct.size()) && direct[r] ? c.pull_chunk : c.chunk;
  };
  size_t steps = 1;
  for (int r : c.ranks) {
    if (r == c.me) continue;
    steps = std::max({steps, Pieces{send_bytes[r], piece(c.reads_me, r)}.count(),
                      Pieces{recv_bytes[r], piece(c.i_read, r)}.count()});
  }
  // Each rank starts with the rank after it, so that the ranks do not all read from (or write
  // to) the same one first.
  const size_t n = c.ranks.size(), mine = indexOf(c, c.me);
  for (size_t i = 0; i < steps; ++i) {
    Step st;
    std::vector<std::pair<char*, uint64_t>> dst;
    for (size_t k = 1; k < n; ++k) {
      const int r = c.ranks[(mine + k) % n];
      Pieces sp{send_bytes[r], piece(c.reads_me, r)}, rp{recv_bytes[r], piece(c.i_read, r)};
      if (i < sp.count()) st.sends.push_back({r, at(in, send_off[r] + sp.off(i)), sp.len(i)});
      if (i < rp.count()) {
        dst.push_back({at(out, recv_off[r] + rp.off(i)), rp.len(i)});
        st.recvs.push_back({r, rp.len(i), dst.back().first});
      }
    }
    st.consume = [dst](const std::vector<const char*>& got) {
      for (size_t k = 0; k < dst.size(); ++k) copyIfElsewhere(dst[k].first, got[k], dst[k].second);
    };
    if (!st.sends.empty() || !st.recvs.empty()) s.steps.push_back(std::move(st));
  }
  const size_t me = static_cast<size_t>(c.me);
  uint64_t own = std::min(send_bytes[me], recv_bytes[me]);
  const char* src = at(in, send_off[me]);
  char* dst = at(out, recv_off[me]);
  std::vector<std::pair<char*, uint64_t>> zero;
  for (int r : absent(c)) zero.push_back({at(out, recv_off[r]), recv_bytes[r]});
  s.finish = [src, dst, own, zero] {
    std::memmove(dst, src, own);
    for (auto& [p, n] : zero) std::memset(p, 0, n);
  };
  return s;
}

OpSpec barrierOp(const AlgoContext& c) {
  OpSpec s = emptyOp(OpKind::kBarrier, DType::kBytes, ReduceOp::kNone, -1, 0);
  Step st;
  st.sends = toAllPeers(c, nullptr, 0);
  st.recvs = fromAllPeers(c, 0);
  s.steps.push_back(std::move(st));
  return s;
}

void appendGatedPiece(OpSpec& op, OpSpec piece, std::function<bool()> gate, std::function<void()> done) {
  const size_t base = op.steps.size();
  for (Step& st : piece.steps)
    if (st.send_after == Step::SendAfter::kAfterStep) st.after += base;
  // The piece's last step has nothing of its own: it waits for the piece's sends (their
  // memory is read until then; a chain forwards what it received) and then hands it back.
  Step tail;
  tail.after_all_sends = true;
  tail.consume = [finish = std::move(piece.finish), done = std::move(done)](const std::vector<const char*>&) {
    if (finish) finish();
    if (done) done();
  };
  piece.steps.push_back(std::move(tail));
  for (Step& st : piece.steps) {
    st.gate = gate;
    op.steps.push_back(std::move(st));
  }
  op.pullable = (base == 0 || op.pullable) && piece.pullable;
}

}  // namespace moelink::collective
