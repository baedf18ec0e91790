#include "moelink/cuda/exchange.h"

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <tuple>

#include "moelink/common/settings.h"
#include "moelink/collective/message_check.h"
#include "moelink/common/error.h"

namespace moelink::cuda {

using namespace collective;

namespace {

uint64_t alignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

Exchange base(OpKind kind, ExchangeMode mode, int n, DType t, ReduceOp op, int root, uint64_t op_bytes) {
  Exchange x;
  x.kind = kind;
  x.mode = mode;
  x.dtype = t;
  x.redop = op;
  x.root = root;
  x.op_bytes = op_bytes;
  x.send_off.assign(n, 0);
  x.send_bytes.assign(n, 0);
  x.recv_off.assign(n, 0);
  x.recv_bytes.assign(n, 0);
  return x;
}

}  // namespace

Exchange exchangeBroadcast(int n, int me, uint64_t bytes, int root) {
  Exchange x = base(OpKind::kBroadcast, ExchangeMode::kCopy, n, DType::kBytes, ReduceOp::kNone, root, bytes);
  if (me == root) {
    for (int q = 0; q < n; ++q)
      if (q != me) x.send_bytes[q] = bytes;
  } else {
    x.recv_bytes[root] = bytes;
  }
  return x;
}

Exchange exchangeAllreduceOneShot(int n, int me, uint64_t count, DType t, ReduceOp op) {
  uint64_t bytes = count * elementSize(t);
  Exchange x = base(OpKind::kAllreduce, ExchangeMode::kReduce, n, t, op, -1, bytes);
  for (int q = 0; q < n; ++q) {
    x.send_bytes[q] = q == me ? 0 : bytes;
    x.recv_bytes[q] = q == me ? 0 : bytes;
  }
  x.reduce_bytes = bytes;
  return x;
}

Exchange exchangeAllreduceTwoShot(int n, int me, uint64_t count, DType t, ReduceOp op) {
  Exchange x = exchangeAllreduceScatter(n, me, count, t, op);
  x.mode = ExchangeMode::kReduceGather;
  return x;
}

Exchange exchangeAllreduceTwoShotStaged(int n, int me, uint64_t count, DType t, ReduceOp op) {
  Exchange x = exchangeAllreduceScatter(n, me, count, t, op);
  x.mode = ExchangeMode::kReduceGatherStaged;
  return x;
}

std::vector<std::pair<uint64_t, uint64_t>> allreduceBlocks(int n, uint64_t count, DType t) {
  // Block starts on 16-byte boundaries keep the kernel's vector path; elements per
  // alignment unit:
  const uint64_t unit = 16 / elementSize(t) ? 16 / elementSize(t) : 1;
  uint64_t per = alignUp((count + n - 1) / n, unit);
  std::vector<std::pair<uint64_t, uint64_t>> b(n);
  for (int q = 0; q < n; ++q) {
    uint64_t lo = std::min(count, q * per), hi = std::min(count, (q + 1) * per);
    b[q] = {lo, hi};
  }
  return b;
}

Exchange exchangeAllreduceScatter(int n, int me, uint64_t count, DType t, ReduceOp op) {
  const uint64_t es = elementSize(t);
  Exchange x = base(OpKind::kAllreduce, ExchangeMode::kReduce, n, t, op, -1, count * es);
  auto blocks = allreduceBlocks(n, count, t);
  uint64_t mine = (blocks[me].second - blocks[me].first) * es;
  for (int q = 0; q < n; ++q) {
    x.send_off[q] = blocks[q].first * es;
    x.send_bytes[q] = q == me ? 0 : (blocks[q].second - blocks[q].first) * es;
    x.recv_bytes[q] = q == me ? 0 : mine;
  }
  x.reduce_bytes = mine;
  return x;
}

namespace {
// The forwarding broadcast's blocks (offset, length), one per rank but the root, in rank order.
std::vector<std::pair<uint64_t, uint64_t>> forwardBlocks(int n, uint64_t bytes) {
  auto b = allreduceBlocks(n - 1, bytes, DType::kBytes);
  for (auto& [off, len] : b) len -= off;
  return b;
}
}  // namespace

bool broadcastForwards(int n, uint64_t bytes, const ExchangeTuning& t) { return n > 2 && !t.oneShot(n, bytes); }

Exchange exchangeBroadcastForward(int n, int me, uint64_t bytes, int root) {
  MOELINK_CHECK(n >= 3 && n <= kExchangeMaxRanks && root >= 0 && root < n && me >= 0 && me < n,
                "exchangeBroadcastForward: ", n, " ranks, root ", root, ", rank ", me);
  Exchange x = base(OpKind::kBroadcast, ExchangeMode::kForward, n, DType::kBytes, ReduceOp::kNone, root, bytes);
  x.forward_from = root;
  const auto blocks = forwardBlocks(n, bytes);
  const auto of = [&](int q) { return blocks[q < root ? q : q - 1]; };
  for (int q = 0; q < n; ++q) {
    if (q == me || q == root) continue;
    if (me == root) {
      std::tie(x.send_off[q], x.send_bytes[q]) = of(q);
      continue;
    }
    std::tie(x.send_off[q], x.send_bytes[q]) = of(me);  // passed on as it lands
    std::tie(x.recv_off[q], x.recv_bytes[q]) = of(q);
  }
  if (me != root) std::tie(x.recv_off[root], x.recv_bytes[root]) = of(me);
  return x;
}

Exchange exchangeReduce(int n, int me, uint64_t count, DType t, ReduceOp op, int root) {
  uint64_t bytes = count * elementSize(t);
  Exchange x = base(OpKind::kReduce, ExchangeMode::kReduce, n, t, op, root, bytes);
  if (me == root) {
    for (int q = 0; q < n; ++q) x.recv_bytes[q] = q == me ? 0 : bytes;
    x.reduce_bytes = bytes;
  } else {
    x.send_bytes[root] = bytes;
  }
  return x;
}

Exchange exchangeAllgather(int n, int me, uint64_t bytes) {
  Exchange x = base(OpKind::kAllgather, ExchangeMode::kCopy, n, DType::kBytes, ReduceOp::kNone, -1, bytes);
  for (int q = 0; q < n; ++q) {
    x.send_bytes[q] = bytes;  // q == me: the local copy into place
    x.recv_off[q] = q * bytes;
    x.recv_bytes[q] = bytes;
  }
  return x;
}

Exchange exchangeGather(int n, int me, uint64_t bytes, int root) {
  Exchange x = base(OpKind::kGather, ExchangeMode::kCopy, n, DType::kBytes, ReduceOp::kNone, root, bytes);
  if (me == root) {
    for (int q = 0; q < n; ++q) {
      x.recv_off[q] = q * bytes;
      x.recv_bytes[q] = bytes;
    }
    x.send_bytes[me] = bytes;
  } else {
    x.send_bytes[root] = bytes;
  }
  return x;
}

Exchange exchangeScatter(int n, int me, uint64_t bytes, int root) {
  Exchange x = base(OpKind::kScatter, ExchangeMode::kCopy, n, DType::kBytes, ReduceOp::kNone, root, bytes);
  if (me == root) {
    for (int q = 0; q < n; ++q) {
      x.send_off[q] = q * bytes;
      x.send_bytes[q] = bytes;
    }
  } else {
    x.recv_bytes[root] = bytes;
  }
  return x;
}

Exchange exchangeReduceScatter(int n, int me, uint64_t count, DType t, ReduceOp op) {
  uint64_t bytes = count * elementSize(t);
  Exchange x = base(OpKind::kReduceScatter, ExchangeMode::kReduce, n, t, op, -1, bytes);
  for (int q = 0; q < n; ++q) {
    x.send_off[q] = q * bytes;
    x.send_bytes[q] = q == me ? 0 : bytes;
    x.recv_bytes[q] = q == me ? 0 : bytes;
  }
  x.reduce_bytes = bytes;
  return x;
}

Exchange exchangeAlltoall(int n, int me, const std::vector<uint64_t>& send_off,
                          const std::vector<uint64_t>& send_bytes, const std::vector<uint64_t>& recv_off,
                          const std::vector<uint64_t>& recv_bytes) {
  MOELINK_CHECK(static_cast<int>(send_off.size()) == n && static_cast<int>(send_bytes.size()) == n &&
                    static_cast<int>(recv_off.size()) == n && static_cast<int>(recv_bytes.size()) == n,
                "all-to-all needs one offset and size per rank");
  MOELINK_CHECK(send_bytes[me] == recv_bytes[me], "this rank sends itself ", send_bytes[me],
                " bytes but expects ", recv_bytes[me]);
  Exchange x = base(OpKind::kAlltoall, ExchangeMode::kCopy, n, DType::kBytes, ReduceOp::kNone, -1, 0);
  x.send_off = send_off;
  x.send_bytes = send_bytes;
  x.recv_off = recv_off;
  x.recv_bytes = recv_bytes;
  return x;
}

Exchange restrictExchange(const Exchange& x, const std::vector<int>& members) {
  MOELINK_CHECK(x.mode != ExchangeMode::kForward && x.mode != ExchangeMode::kReduceGather &&
                    x.mode != ExchangeMode::kReduceGatherStaged,
                "a forwarding broadcast or a two-shot all_reduce is built over the active ranks, not restricted to "
                "them");
  const int n = static_cast<int>(x.send_bytes.size());
  Exchange y = x;
  y.send_off.clear();
  y.send_bytes.clear();
  y.recv_off.clear();
  y.recv_bytes.clear();
  int prev = -1;
  for (int q : members) {
    MOELINK_CHECK(q > prev && q < n, "a sub-group lists ranks of the group in increasing order, got rank ", q);
    prev = q;
    y.send_off.push_back(x.send_off[q]);
    y.send_bytes.push_back(x.send_bytes[q]);
    y.recv_off.push_back(x.recv_off[q]);
    y.recv_bytes.push_back(x.recv_bytes[q]);
  }
  return y;
}

std::vector<std::pair<uint64_t, uint64_t>> droppedRanges(const Exchange& x, const std::vector<int>& members) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  if (x.mode != ExchangeMode::kCopy) return out;
  std::vector<bool> in(x.recv_bytes.size(), false);
  for (int q : members)
    if (q >= 0 && q < static_cast<int>(in.size())) in[q] = true;
  for (size_t q = 0; q < in.size(); ++q)
    if (!in[q] && x.recv_bytes[q]) out.emplace_back(x.recv_off[q], x.recv_bytes[q]);
  return out;
}

const ExchangeDefaults& exchangeDefaults(int n) {
  // docs/PERF.md, "Defaults by group size", has the sweeps behind the measured rows.
  static const ExchangeDefaults kRows[] = {
      // 2 ranks: the Lamport protocol is ahead of the staged one at every size it can carry;
      // all_reduce is one exchange up to 4 MiB and the two-shot staged one above (each rank
      // sends as many bytes either way; the two-shot reduces half of them and does not hold its
      // pushing blocks behind the reductions in place: even at 4 MiB, 13 / 8 % ahead at 16 / 32
      // MiB in a graph, 2-3 % at 256 MiB-1 GiB, 4 % behind at 64 MiB); a broadcast has no rank to
      // forward through (one exchange). 16 MiB rounds: the two-shot all_reduce moves half a round
      // per pair and round, and gains 10 % at 512 MiB-1 GiB over 8 MiB rounds; the other ops move
      // as fast with either (the 8 / 16 MiB sweep at 2 ranks).
      {2, kLamportMaxBytes, 0, 4 << 20, 64, 16 << 20, 64 << 10, 512,
       "2x H200 (nvidia-h200-x2 and GPUs 0-1 of nvidia-h100-x4)"},
      // 4 ranks: Lamport ahead at every size it carries; 64 blocks and 8 MiB rounds the best of
      // the 32-64 blocks, 8-32 MiB rounds sweep at 1 GiB; more exchanges above 1 MiB (all_reduce's
      // two-shot exchanges, broadcast's forwarding); 256-thread Lamport blocks ahead of 512 and 128 for
      // pairs up to 64 KiB, no better above (the 2-rank row takes the same, unswept).
      {4, kLamportMaxBytes, 2 << 20, 1 << 20, 64, 8 << 20, 64 << 10, 512, "4x H200 (nvidia-h100-x4)"},
      // 5-8 ranks: no machine of this size has been lent. Each rank writes n - 1 lines per
      // 8 bytes, so the Lamport protocol takes the smaller pairs only; its blocks hold every
      // peer's lines in registers, so 256 threads at every size; the rest as at 4 ranks.
      {kExchangeMaxRanks, 64 << 10, 2 << 20, 1 << 20, 64, 8 << 20, 64 << 10, 256, ""},
  };
  MOELINK_CHECK(n >= 1 && n <= kExchangeMaxRanks, "exchange groups hold 1..", kExchangeMaxRanks, " ranks, not ", n);
  for (const auto& row : kRows)
    if (n <= row.up_to) return row;
  return kRows[std::size(kRows) - 1];
}

ExchangeTuning ExchangeTuning::fromEnv(int n) {
  const ExchangeDefaults& d = exchangeDefaults(n);
  ExchangeTuning t;
  t.lamport_bytes = settings::numberIfSet("MOELINK_CUDA_LAMPORT_BYTES").value_or(d.lamport_bytes);
  t.lamport_two_shot_bytes =
      settings::numberIfSet("MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES").value_or(d.lamport_two_shot_bytes);
  t.round_bytes = settings::numberIfSet("MOELINK_CUDA_ROUND_BYTES").value_or(d.round_bytes);
  t.blocks = static_cast<int>(settings::numberIfSet("MOELINK_CUDA_BLOCKS").value_or(static_cast<uint64_t>(d.blocks)));
  t.one_shot_bytes = settings::numberIfSet("MOELINK_CUDA_ONESHOT_BYTES").value_or(d.one_shot_bytes);
  t.split = settings::flag("MOELINK_CUDA_SPLIT");
  t.dependent_launch = settings::flag("MOELINK_CUDA_PDL");
  t.lamport_narrow_bytes = d.lamport_narrow_bytes;
  t.lamport_threads = d.lamport_threads;
  MOELINK_CHECK(t.round_bytes % 16 == 0, "MOELINK_CUDA_ROUND_BYTES must be a multiple of 16, got ", t.round_bytes);
  static_assert(kExchangeMaxBlocks == 64, "MOELINK_CUDA_BLOCKS' range in settings.cpp is 1..kExchangeMaxBlocks");
  return t;
}

ExchangeLayout ExchangeLayout::make(int n, uint64_t round_bytes) {
  MOELINK_CHECK(n >= 1 && n <= kExchangeMaxRanks, "exchange groups hold 1..", kExchangeMaxRanks, " ranks");
  ExchangeLayout l;
  l.round_bytes = round_bytes;
  l.header = 0;
  l.counter = alignUp(2 * kExchangeMaxRanks * sizeof(ExchangeHeader), 128);
  l.flags = l.counter + 128;
  const uint64_t flag_bytes = 2ull * kExchangeMaxRanks * kExchangeMaxBlocks * sizeof(uint64_t);
  l.acks = l.flags + flag_bytes;
  l.gather_flags = l.acks + flag_bytes;
  l.gather_acks = l.gather_flags + flag_bytes;
  l.data = alignUp(l.gather_acks + flag_bytes, 4096);
  l.lamport = l.data + 2ull * n * round_bytes;
  l.total = l.lamport + 2ull * n * kLamportSourceBytes;
  return l;
}

namespace {
// Bytes of the longest pair of `x` (or of its reduction).
uint64_t longestPair(const Exchange& x) {
  uint64_t longest = x.mode != ExchangeMode::kCopy ? x.reduce_bytes : 0;
  for (size_t q = 0; q < x.send_bytes.size(); ++q) longest = std::max({longest, x.send_bytes[q], x.recv_bytes[q]});
  return longest;
}
}  // namespace

bool allreduceTwoShotLamport(int n, uint64_t count, DType t, const ExchangeTuning& tuning) {
  const uint64_t es = elementSize(t), bytes = count * es;
  if (n <= 2 || es > 8 || tuning.lamport_bytes == 0 || bytes <= tuning.lamport_bytes ||
      bytes > tuning.lamport_two_shot_bytes)
    return false;
  const auto blocks = allreduceBlocks(n, count, t);
  return (blocks[0].second - blocks[0].first) * es <= kLamportTwoShotBlockBytes;  // block 0 is the longest
}

bool exchangeLamport(const Exchange& x, const ExchangeTuning& t) {
  if (x.mode == ExchangeMode::kReduceGather) {  // the Lamport kernel's alone: its slots must hold both halves
    MOELINK_CHECK(longestPair(x) <= kLamportTwoShotBlockBytes && elementSize(x.dtype) <= 8,
                  "a two-shot Lamport all_reduce of blocks of ", longestPair(x), " bytes of ", elementSize(x.dtype),
                  "-byte elements (at most ", kLamportTwoShotBlockBytes, " bytes of elements of at most 8)");
    return true;
  }
  if (t.lamport_bytes == 0 || x.mode == ExchangeMode::kForward || x.mode == ExchangeMode::kReduceGatherStaged)
    return false;
  if (longestPair(x) > std::min(t.lamport_bytes, kLamportMaxBytes)) return false;
  return x.mode == ExchangeMode::kCopy || elementSize(x.dtype) <= 8;
}

uint64_t exchangeLamportPairs(const Exchange& x, const ExchangeTuning& t) {
  if (x.mode != ExchangeMode::kCopy) return 0;
  return std::min(t.lamport_bytes, kLamportMaxBytes);
}

int lamportThreadsFor(const Exchange& x, const ExchangeTuning& t) {
  const int threads = longestPair(x) > t.lamport_narrow_bytes ? t.lamport_threads : kLamportNarrowThreads;
  return std::min(threads, lamportThreads(static_cast<int>(x.send_bytes.size())));
}

int lamportBlocks(const Exchange& x, const ExchangeTuning& t) {
  const uint64_t lines = (longestPair(x) + 7) / 8;
  const uint64_t per_block = 2 * static_cast<uint64_t>(lamportThreadsFor(x, t));
  return static_cast<int>(std::max<uint64_t>(1, (lines + per_block - 1) / per_block));
}

int exchangeSms(const Exchange& x, const ExchangeTuning& t) {
  if (exchangeLamport(x, t)) return lamportBlocks(x, t) + 1;
  return exchangeBlocksWithWork(x, t) * (exchangeSplits(x, t) ? 2 : 1);
}

int collectiveSms(OpKind kind, int n, uint64_t bytes, const ExchangeTuning& t) {
  const DType f32 = DType::kFloat32;
  const uint64_t count = bytes / 4, block = bytes / static_cast<uint64_t>(n);
  int most = 0;
  for (int me = 0; me < n; ++me) {
    std::vector<Exchange> xs;
    switch (kind) {
      case OpKind::kAllreduce:
        if (allreduceTwoShotLamport(n, count, f32, t)) {
          xs.push_back(exchangeAllreduceTwoShot(n, me, count, f32, ReduceOp::kSum));
        } else if (t.oneShot(n, bytes)) {
          xs.push_back(exchangeAllreduceOneShot(n, me, count, f32, ReduceOp::kSum));
        } else {
          xs.push_back(exchangeAllreduceTwoShotStaged(n, me, count, f32, ReduceOp::kSum));
        }
        break;
      case OpKind::kBroadcast:
        xs.push_back(broadcastForwards(n, bytes, t) ? exchangeBroadcastForward(n, me, bytes, 0)
                                                    : exchangeBroadcast(n, me, bytes, 0));
        break;
      case OpKind::kAllgather: xs.push_back(exchangeAllgather(n, me, block)); break;
      case OpKind::kReduceScatter: xs.push_back(exchangeReduceScatter(n, me, block / 4, f32, ReduceOp::kSum)); break;
      case OpKind::kAlltoall: {
        std::vector<uint64_t> off(n), len(n, block);
        for (int q = 0; q < n; ++q) off[q] = static_cast<uint64_t>(q) * block;
        xs.push_back(exchangeAlltoall(n, me, off, len, off, len));
        break;
      }
      default: MOELINK_CHECK(false, "collectiveSms: not a collective of the in-host path");
    }
    for (const auto& x : xs) most = std::max(most, exchangeSms(x, t));
  }
  return most;
}

bool exchangeOutputMeetsInput(const Exchange& x, int me, const void* in, const void* out) {
  const auto at = [](const void* base, uint64_t off) { return reinterpret_cast<uintptr_t>(base) + off; };
  // Whether [lo, hi) of the output meets input pushed to a peer.
  const auto pushed = [&](uintptr_t lo, uintptr_t hi) {
    for (size_t p = 0; p < x.send_bytes.size(); ++p)
      if (static_cast<int>(p) != me && x.send_bytes[p] && lo < at(in, x.send_off[p] + x.send_bytes[p]) &&
          at(in, x.send_off[p]) < hi)
        return true;
    return false;
  };
  if (x.mode == ExchangeMode::kReduce) return x.reduce_bytes && pushed(at(out, 0), at(out, x.reduce_bytes));
  if (x.mode == ExchangeMode::kForward || x.mode == ExchangeMode::kReduceGatherStaged) return false;  // (exchange.h)
  for (size_t q = 0; q < x.recv_bytes.size(); ++q) {
    if (x.recv_bytes[q] == 0) continue;
    // This rank's own range in place is not written (the kernel skips the copy).
    if (static_cast<int>(q) == me && at(in, x.send_off[q]) == at(out, x.recv_off[q])) continue;
    if (pushed(at(out, x.recv_off[q]), at(out, x.recv_off[q] + x.recv_bytes[q]))) return true;
  }
  return false;
}

uint64_t exchangeRoundBytes(const Exchange& x, const ExchangeTuning& t) {
  return x.mode == ExchangeMode::kReduceGatherStaged ? t.round_bytes / 32 * 16 : t.round_bytes;
}

bool exchangeSplits(const Exchange& x, const ExchangeTuning& t) {
  return x.mode != ExchangeMode::kForward && t.split && longestPair(x) > exchangeRoundBytes(x, t);
}

int exchangeBlocksWithWork(const Exchange& x, const ExchangeTuning& t) {
  const uint64_t first = std::min(longestPair(x), exchangeRoundBytes(x, t));
  int blocks = 1;  // pieces are consecutive from block 0; at least one block runs
  for (; blocks < t.blocks; ++blocks) {
    uint64_t lo, hi;
    exchangePiece(first, blocks, t.blocks, &lo, &hi);
    if (lo >= hi) break;
  }
  return blocks;
}

ExchangeHeader exchangeHeader(const Exchange& x, int peer, const ExchangeTuning& t) {
  ExchangeHeader h{};
  h.op_bytes = x.op_bytes;
  h.send_bytes = x.send_bytes[peer];
  h.recv_bytes = x.recv_bytes[peer];
  h.round_bytes = t.round_bytes;
  h.kind = static_cast<uint8_t>(x.kind);
  h.dtype = static_cast<uint8_t>(x.dtype);
  h.redop = static_cast<uint8_t>(x.redop);
  h.mode = static_cast<uint8_t>(x.mode);
  h.root = x.root;
  h.blocks = static_cast<uint32_t>(t.blocks);
  h.split = t.split ? 1 : 0;
  h.lamport_bytes = t.lamport_bytes;
  return h;
}

std::string describeMismatch(const ExchangeHeader& mine, const ExchangeHeader& theirs, int peer) {
  auto fields = [](const ExchangeHeader& h) { return OpFields{h.kind, h.seq, h.root, h.dtype, h.redop, h.op_bytes}; };
  if (std::string why = describeOpMismatch(fields(mine), fields(theirs), peer); !why.empty()) return why;
  const std::string who = str(opKindName(static_cast<OpKind>(mine.kind)), " #", mine.seq, ": rank ", peer);
  if (theirs.mode != mine.mode) {  // first: where the ranks chose different plans, the pairs differ too
    const auto step = [](uint8_t m) {
      return m == static_cast<uint8_t>(ExchangeMode::kCopy)      ? "copy"
             : m == static_cast<uint8_t>(ExchangeMode::kReduce)  ? "reduce"
             : m == static_cast<uint8_t>(ExchangeMode::kForward) ? "forwarding broadcast"
             : m == static_cast<uint8_t>(ExchangeMode::kReduceGather) ? "two-shot Lamport"
                                                                       : "two-shot staged";
    };
    return str(who, " ran the ", step(theirs.mode), " step where this rank ran the ", step(mine.mode),
               " step (different MOELINK_CUDA_ONESHOT_BYTES or MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES?)");
  }
  if (theirs.send_bytes != mine.recv_bytes)
    return str(who, " sent ", theirs.send_bytes, " bytes to this rank, this rank expects ", mine.recv_bytes);
  if (theirs.recv_bytes != mine.send_bytes)
    return str(who, " expects ", theirs.recv_bytes, " bytes from this rank, this rank sends ", mine.send_bytes);
  if (theirs.round_bytes != mine.round_bytes || theirs.blocks != mine.blocks || theirs.split != mine.split)
    return str(who, " uses MOELINK_CUDA_ROUND_BYTES=", theirs.round_bytes, " MOELINK_CUDA_BLOCKS=", theirs.blocks,
               " MOELINK_CUDA_SPLIT=", theirs.split, ", this rank ", mine.round_bytes, ", ", mine.blocks, " and ",
               mine.split, "; set them alike on every rank");
  if (theirs.lamport_bytes != mine.lamport_bytes)
    return str(who, " uses MOELINK_CUDA_LAMPORT_BYTES=", theirs.lamport_bytes, ", this rank ", mine.lamport_bytes,
               "; set it alike on every rank");
  return "";
}

std::string describeStatus(const ExchangeStatus& s, uint64_t timeout_ms) {
  switch (s.code) {
    case ExchangeStatus::kOk: return "";
    case ExchangeStatus::kMismatch:
    case ExchangeStatus::kAhead: {
      std::string why = describeMismatch(s.mine, s.theirs, s.peer);
      return why.empty() ? str(opKindName(static_cast<OpKind>(s.mine.kind)), " #", s.seq,
                               ": the ranks disagree about this op (rank ", s.peer, ")")
                         : why;
    }
    case ExchangeStatus::kTimeout:
      return str(opKindName(static_cast<OpKind>(s.mine.kind)), " #", s.seq, ": Timed out after ", timeout_ms,
                 " ms waiting for rank ", s.peer,
                 " on the GPU; this group's CUDA collectives are unusable from now on");
    case ExchangeStatus::kAborted:
      return str(opKindName(static_cast<OpKind>(s.mine.kind)), " #", s.seq, ": rank(s) left the group while this op "
                 "ran on the GPU (waiting for rank ", s.peer, "); later CUDA ops run over the remaining ranks");
  }
  return str("unknown exchange status ", s.code);
}

}  // namespace moelink::cuda
