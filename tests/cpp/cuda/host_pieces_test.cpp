// The CUDA host route's pipeline without a GPU: the worker side (moelink/cuda/host_pieces.h)
// runs as in the module, over a ring in plain memory, and each rank's thread does what the op's
// stream does in src/cuda/host_pipeline.cpp (pack a piece, raise its ready word, wait for its
// done word, reduce by the worker's plan or copy back, pack the piece after next). Every op at
// 2-4 ranks over tcp, shared memory and pulled messages, with few, small slots (many pieces,
// reused slots), sizes around the piece boundaries (all_to_all: pairs of different lengths), and
// groups with an inactive rank (blocks, rows and reductions over the active ranks, an inactive
// rank's all-gather and all-to-all rows zeroed).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "moelink/cuda/host_pieces.h"
#include "../test_support.h"
#include "../worker_support.h"

namespace {

using namespace moelink::cuda;
using moelink::collective::AlgoContext;
using moelink::collective::DType;
using moelink::collective::OpSpec;
using moelink::collective::ReduceOp;
using moelink::testing::makeRank;
using moelink::testing::Rank;
using moelink::testing::runRanks;
using moelink::transfer::InProcessStore;
using moelink::transfer::storeBarrier;
using namespace std::chrono;

constexpr uint64_t kSlotBytes = 4096;  // slots of 1024 floats (all_reduce's largest pieces)
constexpr int kDepth = 2;
// An op is cut into kDepth pieces or more, none below this (pieceBudget): the small ops below
// have pieces smaller than a slot, the large ones pieces of a whole slot.
constexpr uint64_t kMinPiece = 1024;
uint64_t budget(uint64_t total) { return pieceBudget(total, kDepth, kMinPiece, kSlotBytes); }

// One rank's ring and the stream's side of it.
struct Ring {
  explicit Ring(int world)
      : out_bytes(PieceRing::outBytes(kSlotBytes, world)),
        mem((kSlotBytes + out_bytes) * kDepth),
        plans(kDepth),
        ready(2 * kDepth, 0),
        done(2 * kDepth, 0) {}
  PieceRing view() {
    PieceRing r;
    r.base = mem.data();
    r.slot_stride = kSlotBytes + out_bytes;
    r.slot_bytes = kSlotBytes;
    r.plans = plans.data();
    r.ready = ready.data();
    r.done = done.data();
    return r;
  }
  PieceMark mark(int word) { return {word, ++ticket}; }
  void raise(PieceMark m) { __atomic_store_n(&ready[m.word], m.ticket, __ATOMIC_RELEASE); }
  void wait(PieceMark m) {
    while (static_cast<int32_t>(__atomic_load_n(&done[m.word], __ATOMIC_ACQUIRE) - m.ticket) < 0)
      std::this_thread::sleep_for(microseconds(20));
  }
  // The GPU's reduction (kernels/rows_reduce.cu) by the plan the worker wrote for `slot`.
  template <typename T>
  void reduce(int slot, uint32_t ticket, char* out, const char* mine, ReduceOp op) {
    RowsPlan p;
    std::memcpy(&p, &plans[slot], sizeof p);
    if (p.ticket != ticket) return;  // no plan (the op failed): the kernel does nothing either
    const char* rows = view().out(slot);
    for (uint64_t i = 0; i < p.len / sizeof(T); ++i) {
      T acc{};
      for (int q = 0; q < p.rows; ++q) {
        const char* src = q == p.me ? mine + p.off : rows + q * p.stride;
        const T v = reinterpret_cast<const T*>(src)[i];
        acc = q == 0 ? v : op == ReduceOp::kMax ? std::max(acc, v) : static_cast<T>(acc + v);
      }
      if (op == ReduceOp::kAvg) acc = static_cast<T>(acc / static_cast<T>(p.rows));
      reinterpret_cast<T*>(out + p.off)[i] = acc;
    }
  }
  uint64_t out_bytes;
  std::vector<char> mem;
  std::vector<RowsPlan> plans;
  std::vector<uint32_t> ready, done;
  uint32_t ticket = 0;
};

// Hands the op to the worker as HostPipeline::submit does; a failure raises every done word.
std::future<std::string> submit(Rank& r, Ring& ring, std::function<OpSpec(const AlgoContext&)> build,
                                const std::vector<PieceMark>& marks, const std::vector<int>& active) {
  auto result = std::make_shared<std::promise<std::string>>();
  auto f = result->get_future();
  PieceRing view = ring.view();
  auto first = readyGate(view, marks.front());
  r.worker->submit(
      moelink::collective::OpBuilder([build, first, active](const AlgoContext& c) {
        AlgoContext ctx = c;
        ctx.ranks = active;  // the ranks active when the op starts
        OpSpec op = build(ctx);
        op.ready = first;
        return op;
      }),
      [result, marks, view](const std::string& err) {
        if (!err.empty())
          for (const PieceMark& m : marks) __atomic_store_n(view.done + m.word, m.ticket, __ATOMIC_RELEASE);
        result->set_value(err);
      },
      seconds(30));
  return f;
}

// The marks the worker's op raises, in ticket order (with `two`, both of each piece's).
std::vector<PieceMark> marksOf(const std::vector<HostPiece>& ps, bool two) {
  std::vector<PieceMark> ms;
  for (const auto& pc : ps) {
    ms.push_back(pc.first);
    if (two) ms.push_back(pc.second);
  }
  return ms;
}

template <typename T>
T input(int rank, uint64_t i) {
  return static_cast<T>((i * 7 + static_cast<uint64_t>(rank) * 13) % 23) - static_cast<T>(5);
}

// memcpy, for lengths that may be 0 (the buffers of an empty op have no data pointer).
void copy(void* dst, const void* src, uint64_t n) {
  if (n != 0) std::memcpy(dst, src, n);
}

// The stream's side of an all_reduce of 4-byte elements in `buf`, as HostPipeline::allreduce
// orders it: the first pieces packed, piece p+1 reduced (`reduce(slot, ticket, piece's bytes)`)
// before piece p's all-gather is waited for, each slot packed again once copied back (after
// `copy_back_delay`: a slow copy keeps the slot in use).
template <typename Reduce>
void streamAllreduce(Ring& ring, const std::vector<HostPiece>& ps, char* buf, Reduce reduce,
                     microseconds copy_back_delay = microseconds(0)) {
  const PieceRing view = ring.view();
  auto pack = [&](const HostPiece& pc) {
    copy(view.in(pc.slot), buf + pc.off * 4, pc.len * 4);
    ring.raise(pc.first);
  };
  auto reduceOne = [&](const HostPiece& pc) {
    ring.wait(pc.first);
    reduce(pc.slot, pc.first.ticket, buf + pc.off * 4);
    ring.raise(pc.second);
  };
  for (size_t p = 0; p < ps.size() && p < static_cast<size_t>(kDepth); ++p) pack(ps[p]);
  reduceOne(ps[0]);
  for (size_t p = 0; p < ps.size(); ++p) {
    if (p + 1 < ps.size()) reduceOne(ps[p + 1]);
    ring.wait(ps[p].second);
    std::this_thread::sleep_for(copy_back_delay);
    copy(buf + ps[p].off * 4, view.in(ps[p].slot), ps[p].len * 4);
    if (p + kDepth < ps.size()) pack(ps[p + kDepth]);
  }
}

// The stream's side of an all_reduce of 4-byte elements in one exchange per piece
// (allreduceInOneExchange), as HostPipeline::allreduce orders it: each piece packed, then,
// once the other rank's piece has come, reduced in place (`reduce(slot, ticket, piece)`) and
// its slot packed again.
template <typename Reduce>
void streamAllreduceOne(Ring& ring, const std::vector<HostPiece>& ps, char* buf, Reduce reduce) {
  const PieceRing view = ring.view();
  auto pack = [&](const HostPiece& pc) {
    copy(view.in(pc.slot), buf + pc.off * 4, pc.len * 4);
    ring.raise(pc.first);
  };
  for (size_t p = 0; p < ps.size() && p < static_cast<size_t>(kDepth); ++p) pack(ps[p]);
  for (size_t p = 0; p < ps.size(); ++p) {
    ring.wait(ps[p].first);
    reduce(ps[p].slot, ps[p].first.ticket, buf + ps[p].off * 4);
    if (p + kDepth < ps.size()) pack(ps[p + kDepth]);
  }
}

// The stream's side of a broadcast of `buf`, as HostPipeline::broadcast orders it: the root packs
// each piece before its ready word, the others copy each piece back once it is done.
void streamBroadcast(Ring& ring, const std::vector<HostPiece>& ps, uint8_t* buf, bool is_root) {
  const PieceRing view = ring.view();
  auto open = [&](const HostPiece& pc) {
    if (is_root) copy(view.in(pc.slot), buf + pc.off, pc.len);
    ring.raise(pc.first);
  };
  for (size_t p = 0; p < ps.size() && p < static_cast<size_t>(kDepth); ++p) open(ps[p]);
  for (size_t p = 0; p < ps.size(); ++p) {
    ring.wait(ps[p].first);
    if (!is_root) copy(buf + ps[p].off, view.in(ps[p].slot), ps[p].len);
    if (p + kDepth < ps.size()) open(ps[p + kDepth]);
  }
}

TEST(HostPieces, AnOpIsCutIntoDepthPiecesWithinItsBounds) {
  constexpr uint64_t kMiB = 1 << 20;
  // 4 slots of 16 MiB, pieces of at least 1 MiB: an op in 4 pieces from 4 MiB to 64 MiB.
  EXPECT_EQ(pieceBudget(4 * kMiB, 4, kMiB, 16 * kMiB), kMiB);
  EXPECT_EQ(pieceBudget(16 * kMiB, 4, kMiB, 16 * kMiB), 4 * kMiB);
  EXPECT_EQ(pieceBudget(64 * kMiB, 4, kMiB, 16 * kMiB), 16 * kMiB);
  EXPECT_EQ(pieceBudget(kMiB << 10, 4, kMiB, 16 * kMiB), 16 * kMiB);  // never above the slot
  EXPECT_EQ(pieceBudget(1, 4, kMiB, 16 * kMiB), kMiB);                // never below the floor
  EXPECT_EQ(pieceBudget(0, 4, kMiB, 16 * kMiB), kMiB);
  EXPECT_EQ(pieceBudget(10 * kMiB + 1, 4, kMiB, 16 * kMiB), 2621456u);  // a quarter, rounded up to 16 bytes
  // A floor above the slot: the slot (the whole op in slots, as with MOELINK_HOST_MIN_PIECE_BYTES
  // at MOELINK_HOST_PIECE_BYTES).
  EXPECT_EQ(pieceBudget(4 * kMiB, 4, 32 * kMiB, 16 * kMiB), 16 * kMiB);
  EXPECT_EQ(pieceBudget(4 * kMiB, 4, kMiB, 64 << 10), 64u << 10);
}

class HostPieces : public ::testing::TestWithParam<std::tuple<std::string, int, bool>> {};

TEST_P(HostPieces, EveryOpThroughTheRing) {
  auto [transport, world, masked] = GetParam();
  auto store = std::make_shared<InProcessStore>();
  // With `masked`, rank 1 is inactive: it keeps its mailboxes alive and takes part in nothing.
  std::vector<int> active;
  for (int q = 0; q < world; ++q)
    if (!(masked && q == 1)) active.push_back(q);
  const auto m = static_cast<int>(active.size());
  runRanks(world, [&, transport = transport, world = world, masked = masked](int rank) {
    Rank r = makeRank(store, rank, world, transport);
    if (masked && rank == 1) {
      storeBarrier(*store, "done", world, seconds(60));
      return;
    }
    Ring ring(world);
    auto mark = [&](int word) { return ring.mark(word); };
    const uint64_t per_ar = allreducePieceElems(4, kSlotBytes);  // the sizes around a slot's
    // Two ranks also in one exchange per piece (allreduceInOneExchange).
    for (bool one : {false, true}) {
      if (one && !allreduceInOneExchange(world)) continue;
      for (uint64_t count : std::vector<uint64_t>{0, 1, per_ar - 1, per_ar, per_ar + 1, 5 * per_ar + 3}) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
          // all_reduce: float (SUM, AVG) or int32 (MAX), in place.
          const bool ints = op == ReduceOp::kMax;
          const DType t = ints ? DType::kInt32 : DType::kFloat32;
          std::vector<char> buf(count * 4);
          for (uint64_t i = 0; i < count; ++i) {
            if (ints) reinterpret_cast<int32_t*>(buf.data())[i] = input<int32_t>(rank, i);
            else reinterpret_cast<float*>(buf.data())[i] = input<float>(rank, i);
          }
          auto ps = cutPieces(count, allreducePieceElems(4, budget(count * 4)), kDepth, !one, mark);
          PieceRing view = ring.view();
          auto done = submit(r, ring, [=](const AlgoContext& c) {
            return allreducePieces(c, view, ps, count, t, op, world, rank, one);
          }, marksOf(ps, !one), active);
          if (one) {
            streamAllreduceOne(ring, ps, buf.data(), [&](int slot, uint32_t ticket, char* piece) {
              if (ints) ring.reduce<int32_t>(slot, ticket, piece, piece, op);
              else ring.reduce<float>(slot, ticket, piece, piece, op);
            });
          } else {
            streamAllreduce(ring, ps, buf.data(), [&](int slot, uint32_t ticket, char* mine) {
              if (ints) ring.reduce<int32_t>(slot, ticket, view.in(slot), mine, op);
              else ring.reduce<float>(slot, ticket, view.in(slot), mine, op);
            }, microseconds(200));
          }
          ASSERT_EQ("", done.get());
          for (uint64_t i = 0; i < count; ++i) {
            if (ints) {
              int32_t want = INT32_MIN;
              for (int q : active) want = std::max(want, input<int32_t>(q, i));
              ASSERT_EQ(reinterpret_cast<int32_t*>(buf.data())[i], want)
                  << "all_reduce MAX count " << count << " i " << i << " one exchange " << one;
            } else {
              float want = 0;
              for (int q : active) want += input<float>(q, i);
              if (op == ReduceOp::kAvg) want /= static_cast<float>(m);
              ASSERT_FLOAT_EQ(reinterpret_cast<float*>(buf.data())[i], want)
                  << "all_reduce count " << count << " i " << i << " one exchange " << one;
            }
          }
        }
      }
    }
    // reduce_scatter (float SUM): rank q's block q of every active rank's input.
    const uint64_t slot_rs = reduceScatterPieceElems(4, kSlotBytes, world);  // the sizes around a slot's
    for (uint64_t count : std::vector<uint64_t>{1, slot_rs, slot_rs + 1, 3 * slot_rs + 2}) {
      const uint64_t per_rs = reduceScatterPieceElems(4, budget(count * 4 * world), world);
      std::vector<float> in(count * world), out(count, -1.f);
      for (uint64_t i = 0; i < in.size(); ++i) in[i] = input<float>(rank, i);
      auto ps = cutPieces(count, per_rs, kDepth, false, mark);
      PieceRing view = ring.view();
      auto done = submit(r, ring, [=](const AlgoContext& c) {
        return reduceScatterPieces(c, view, ps, count, per_rs, DType::kFloat32, ReduceOp::kSum, world, rank);
      }, marksOf(ps, false), active);
      auto pack = [&](const HostPiece& pc) {
        for (int q = 0; q < world; ++q)
          copy(view.in(pc.slot) + q * per_rs * 4, in.data() + q * count + pc.off, pc.len * 4);
        ring.raise(pc.first);
      };
      for (size_t p = 0; p < ps.size() && p < static_cast<size_t>(kDepth); ++p) pack(ps[p]);
      for (size_t p = 0; p < ps.size(); ++p) {
        ring.wait(ps[p].first);
        ring.reduce<float>(ps[p].slot, ps[p].first.ticket, reinterpret_cast<char*>(out.data() + ps[p].off),
                           reinterpret_cast<const char*>(in.data() + rank * count + ps[p].off), ReduceOp::kSum);
        if (p + kDepth < ps.size()) pack(ps[p + kDepth]);
      }
      ASSERT_EQ("", done.get());
      for (uint64_t i = 0; i < count; ++i) {
        float want = 0;
        for (int q : active) want += input<float>(q, rank * count + i);
        ASSERT_FLOAT_EQ(out[i], want) << "reduce_scatter count " << count << " i " << i;
      }
    }
    // all_gather (bytes) and broadcast (from the last active rank).
    const uint64_t slot_ag = allgatherPieceBytes(kSlotBytes, world);  // the sizes around a slot's
    for (uint64_t bytes : std::vector<uint64_t>{1, slot_ag - 1, slot_ag + 1, 4 * slot_ag + 5}) {
      const uint64_t per_ag = allgatherPieceBytes(budget(bytes * world), world);
      std::vector<uint8_t> in(bytes), out(bytes * world, 0xee);
      for (uint64_t i = 0; i < bytes; ++i) in[i] = moelink::testing::pattern(rank, i);
      auto ps = cutPieces(bytes, per_ag, kDepth, false, mark);
      PieceRing view = ring.view();
      auto done = submit(r, ring, [=](const AlgoContext& c) {
        return allgatherPieces(c, view, ps, bytes, per_ag, world, rank);
      }, marksOf(ps, false), active);
      copy(out.data() + rank * bytes, in.data(), bytes);
      auto pack = [&](const HostPiece& pc) {
        copy(view.in(pc.slot), in.data() + pc.off, pc.len);
        ring.raise(pc.first);
      };
      for (size_t p = 0; p < ps.size() && p < static_cast<size_t>(kDepth); ++p) pack(ps[p]);
      for (size_t p = 0; p < ps.size(); ++p) {
        ring.wait(ps[p].first);
        for (int q = 0; q < world; ++q)
          if (q != rank) copy(out.data() + q * bytes + ps[p].off, view.out(ps[p].slot) + q * per_ag, ps[p].len);
        if (p + kDepth < ps.size()) pack(ps[p + kDepth]);
      }
      ASSERT_EQ("", done.get());
      for (int q = 0; q < world; ++q) {
        const bool in_group = std::find(active.begin(), active.end(), q) != active.end();
        for (uint64_t i = 0; i < bytes; ++i)
          ASSERT_EQ(out[q * bytes + i], in_group ? moelink::testing::pattern(q, i) : 0)
              << "all_gather bytes " << bytes << " row " << q << " byte " << i;
      }
    }
    const int root = active.back();  // the last active rank
    for (uint64_t bytes : std::vector<uint64_t>{1, kSlotBytes - 1, kSlotBytes + 1, 5 * kSlotBytes + 7}) {
      std::vector<uint8_t> buf(bytes);
      for (uint64_t i = 0; i < bytes; ++i) buf[i] = rank == root ? moelink::testing::pattern(root, i) : 0;
      auto ps = cutPieces(bytes, budget(bytes), kDepth, false, mark);
      PieceRing view = ring.view();
      auto done = submit(r, ring, [=](const AlgoContext& c) { return broadcastPieces(c, view, ps, bytes, root); },
                         marksOf(ps, false), active);
      streamBroadcast(ring, ps, buf.data(), rank == root);
      ASSERT_EQ("", done.get());
      for (uint64_t i = 0; i < bytes; ++i)
        ASSERT_EQ(buf[i], moelink::testing::pattern(root, i)) << "broadcast bytes " << bytes << " byte " << i;
    }
    // all_to_all: pairs of every length around the piece size (empty ones included), a
    // different one for each (source, destination), each rank's longest pair its own.
    const uint64_t per_aa = alltoallPieceBytes(kSlotBytes, world);
    for (uint64_t salt : {0, 1, 2}) {
      auto len = [&](int src, int dst) {
        const uint64_t sizes[] = {0, 1, per_aa - 1, per_aa, per_aa + 1, 3 * per_aa + 5, 2 * per_aa};
        return sizes[(static_cast<uint64_t>(src * 5 + dst * 3) + salt) % 7];
      };
      auto layoutOf = [&](int q, std::vector<uint64_t>& so, std::vector<uint64_t>& sb, std::vector<uint64_t>& ro,
                          std::vector<uint64_t>& rb) {
        so.assign(world, 0), sb.assign(world, 0), ro.assign(world, 0), rb.assign(world, 0);
        uint64_t at_in = 0, at_out = 0;
        for (int p = 0; p < world; ++p) {
          so[p] = at_in, sb[p] = len(q, p), at_in += sb[p];
          ro[p] = at_out, rb[p] = len(p, q), at_out += rb[p];
        }
      };
      std::vector<uint64_t> so, sb, ro, rb;
      layoutOf(rank, so, sb, ro, rb);
      std::vector<uint8_t> in(so.back() + sb.back()), out(ro.back() + rb.back(), 0xee);
      for (uint64_t i = 0; i < in.size(); ++i) in[i] = moelink::testing::pattern(rank + 10 * static_cast<int>(salt), i);
      uint64_t longest = 0;
      for (int q = 0; q < world; ++q)
        if (q != rank) longest = std::max({longest, sb[q], rb[q]});
      auto ps = cutPieces(longest, per_aa, kDepth, false, mark);
      PieceRing view = ring.view();
      auto done = submit(r, ring, [=](const AlgoContext& c) {
        return alltoallPieces(c, view, ps, per_aa, sb, rb, world, rank);
      }, marksOf(ps, false), active);
      copy(out.data() + ro[rank], in.data() + so[rank], std::min(sb[rank], rb[rank]));
      auto left = [&](uint64_t n, const HostPiece& pc) { return n > pc.off ? std::min(per_aa, n - pc.off) : 0; };
      auto pack = [&](const HostPiece& pc) {
        for (int q = 0; q < world; ++q)
          if (q != rank) copy(view.in(pc.slot) + q * per_aa, in.data() + so[q] + pc.off, left(sb[q], pc));
        ring.raise(pc.first);
      };
      for (size_t p = 0; p < ps.size() && p < static_cast<size_t>(kDepth); ++p) pack(ps[p]);
      for (size_t p = 0; p < ps.size(); ++p) {
        ring.wait(ps[p].first);
        for (int q = 0; q < world; ++q)
          if (q != rank) copy(out.data() + ro[q] + ps[p].off, view.out(ps[p].slot) + q * per_aa, left(rb[q], ps[p]));
        if (p + kDepth < ps.size()) pack(ps[p + kDepth]);
      }
      ASSERT_EQ("", done.get()) << "all_to_all salt " << salt;
      for (int q = 0; q < world; ++q) {
        const bool in_group = std::find(active.begin(), active.end(), q) != active.end();
        std::vector<uint64_t> qso, qsb, qro, qrb;
        layoutOf(q, qso, qsb, qro, qrb);  // where q's row for this rank starts in q's input
        for (uint64_t i = 0; i < rb[q]; ++i)
          ASSERT_EQ(out[ro[q] + i], in_group ? moelink::testing::pattern(q + 10 * static_cast<int>(salt), qso[rank] + i) : 0)
              << "all_to_all salt " << salt << " from rank " << q << " byte " << i << " of " << rb[q];
      }
    }
    storeBarrier(*store, "done", world, seconds(60));
  });
}

INSTANTIATE_TEST_SUITE_P(All, HostPieces,
                         ::testing::Combine(::testing::Values("tcp", "shm", "pull"), ::testing::Values(2, 3, 4),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_w" + std::to_string(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_masked" : "");
                         });

// After a failed op: the group's next op (an all_reduce of rank + 1 over 2 ranks) is exact.
void expectGroupGoesOn(Rank& r, int rank) {
  std::vector<float> x(5000, static_cast<float>(rank + 1));
  EXPECT_EQ("", moelink::testing::run(*r.worker, moelink::collective::allreduceOp(
                                                   r.worker->context(), x.data(), x.size(), DType::kFloat32,
                                                   ReduceOp::kSum)));
  for (float v : x) ASSERT_EQ(v, 3.0f);
}

// An all_to_all over 2 ranks in pieces of `per` with these pair lengths, the stream raising each
// piece and waiting for it (the data does not matter); returns the op's error.
std::string alltoallOutcome(Rank& r, Ring& ring, int rank, uint64_t per, std::vector<uint64_t> sb,
                            std::vector<uint64_t> rb) {
  auto ps = cutPieces(std::max(sb[1 - rank], rb[1 - rank]), per, kDepth, false,
                      [&](int word) { return ring.mark(word); });
  std::vector<PieceMark> marks;
  for (const auto& pc : ps) marks.push_back(pc.first);
  PieceRing view = ring.view();
  auto done = submit(r, ring, [=](const AlgoContext& c) {
    return alltoallPieces(c, view, ps, per, sb, rb, 2, rank);
  }, marks, {0, 1});
  for (const auto& pc : ps) {
    ring.raise(pc.first);
    ring.wait(pc.first);
  }
  return done.get();
}

// Ranks that cut an op differently (MOELINK_HOST_PIECE_BYTES differs) fail it on every rank
// with the message sizes named, without a hang (the failed op raises every done word, so the
// stream gets through), and the group's next op is exact.
TEST(HostPieces, RanksThatCutDifferentlyFailTheOp) {
  auto store = std::make_shared<InProcessStore>();
  runRanks(2, [&](int rank) {
    Rank r = makeRank(store, rank, 2, "tcp");
    Ring ring(2);
    const uint64_t count = 3000, per = rank == 0 ? 1024 : 512;
    std::vector<float> buf(count, static_cast<float>(rank + 1));
    // (two ranks: one exchange per piece, as the pipeline runs them)
    auto ps = cutPieces(count, per, kDepth, false, [&](int word) { return ring.mark(word); });
    const std::vector<PieceMark> marks = marksOf(ps, false);
    PieceRing view = ring.view();
    auto done = submit(r, ring, [=](const AlgoContext& c) {
      return allreducePieces(c, view, ps, count, DType::kFloat32, ReduceOp::kSum, 2, rank, true);
    }, marks, {0, 1});
    char* b = reinterpret_cast<char*>(buf.data());
    for (size_t p = 0; p < ps.size(); ++p) {  // the stream, one piece at a time
      char* piece = b + ps[p].off * 4;
      copy(view.in(ps[p].slot), piece, ps[p].len * 4);
      ring.raise(ps[p].first);
      ring.wait(ps[p].first);
      ring.reduce<float>(ps[p].slot, ps[p].first.ticket, piece, piece, ReduceOp::kSum);
    }
    const std::string err = done.get();
    EXPECT_NE(err.find("allreduce #1: rank " + std::to_string(1 - rank) + " sent a "), std::string::npos) << err;
    EXPECT_NE(err.find("-byte piece, this rank expects"), std::string::npos) << err;
    expectGroupGoesOn(r, rank);  // the same cut on both ranks now
  });
}

// onRails: the cross-host steps of the two-level ops (unit.h, TwoLevel) on 4 ranks as 2 hosts
// ({0, 1} and {2, 3}) of 2, each rank's op among its rail only ({0, 2} and {1, 3}), both rails at
// once. `run(size, active, failed)` runs one op over the `active` ranks, this rank's check
// saying `failed`, checks the values when it passed, and returns its error. The scenarios:
// sizes around the pieces (`per`) are exact; when rank 1's in-host step failed (its check says
// so), the op fails on all four: its rail peer by the abort, its host peer at the barrier, and
// the fourth at its barrier with the rail peer's host peer; the next op is exact. When rank 0
// disagrees about the op's size, every rank fails naming it in the header check's words. With
// rank 2 out of the group, ranks 0 and 3 (whose rail or host has it) fail naming it, rank 1 at
// its check.
using RailRun = std::function<std::string(uint64_t, const std::vector<int>&, const std::string&)>;

constexpr int kRailWorld = 4;

// One rank's part: its group member, ring and rail step (rail and host set; the op sets the
// rest) and its position on the rail; returns its piece size and its `run`.
using RailRank =
    std::function<std::pair<uint64_t, RailRun>(int rank, Rank& r, Ring& ring, RailStep& step, int at)>;

void onRails(const RailRank& make) {
  auto store = std::make_shared<InProcessStore>();
  runRanks(kRailWorld, [&](int rank) {
    Rank r = makeRank(store, rank, kRailWorld, "tcp");
    Ring ring(kRailWorld);
    RailStep step;
    step.rail = rank % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
    step.local = rank < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
    const auto [per, run] = make(rank, r, ring, step, rank < 2 ? 0 : 1);
    const std::vector<int> all{0, 1, 2, 3};
    for (uint64_t size : {uint64_t{1}, per - 1, per + 1, 3 * per + 5}) EXPECT_EQ("", run(size, all, ""));
    const std::string err = run(2 * per + 3, all, rank == 1 ? "the in-host step gave up" : "");
    EXPECT_NE(err, "") << "rank " << rank << ": the op succeeded though rank 1's in-host step failed";
    if (rank == 1) {
      EXPECT_NE(err.find("the in-host step gave up"), std::string::npos) << err;
    }
    EXPECT_EQ("", run(per + 7, all, "")) << "rank " << rank << ": the op after the failed one";
    // Rank 0 disagrees about the size: every rank says so in the header check's words.
    const std::string size_err = run(rank == 0 ? per + 3 : per + 5, all, "");
    EXPECT_NE(size_err.find("this rank expects"), std::string::npos) << "rank " << rank << ": " << size_err;
    EXPECT_EQ("", run(per + 7, all, "")) << "rank " << rank << ": the op after the disagreement";
    storeBarrier(*store, "rails", kRailWorld, seconds(60));
    if (rank != 2) {
      // As after a membership change: every rank's check says so (its kernels gave up).
      const std::string e = run(2 * per + 3, {0, 1, 3}, "the membership changed");
      EXPECT_NE(e, "") << "rank " << rank;
      if (rank == 0 || rank == 3) {
        EXPECT_NE(e.find("rank 2 left the group"), std::string::npos) << e;
      }
    }
    storeBarrier(*store, "done", kRailWorld, seconds(60));
  });
}

// The two-level all_reduce's: each rank gets its rail's sum and nothing of the other rail's.
// Rails of two hosts, as here, take one exchange per piece in the pipeline
// (allreduceInOneExchange); the reduce-scatter and all-gather of longer rails run here too.
void allreduceAmongARail(bool one) {
  onRails([one](int rank, Rank& r, Ring& ring, RailStep& step, int) {
    const std::vector<int>& rail = step.rail;
    const uint64_t per = allreducePieceElems(4, kSlotBytes);
    auto run = [=, &r, &ring, &step](uint64_t count, const std::vector<int>& active, const std::string& failed) {
      step.check = [failed] { return failed; };
      step.op_bytes = count * 4;
      std::vector<float> buf(count);
      for (uint64_t i = 0; i < count; ++i) buf[i] = input<float>(rank, i);
      auto ps = cutPieces(count, per, kDepth, !one, [&](int word) { return ring.mark(word); });
      const std::vector<PieceMark> marks = marksOf(ps, !one);
      PieceRing view = ring.view();
      auto done = submit(r, ring, [=](const AlgoContext& c) {
        return railAllreducePieces(c, view, ps, count, DType::kFloat32, ReduceOp::kSum, kRailWorld, rank, step, one);
      }, marks, active);
      char* b = reinterpret_cast<char*>(buf.data());
      if (one)
        streamAllreduceOne(ring, ps, b, [&](int slot, uint32_t ticket, char* piece) {
          ring.reduce<float>(slot, ticket, piece, piece, ReduceOp::kSum);
        });
      else
        streamAllreduce(ring, ps, b, [&](int slot, uint32_t ticket, char* mine) {
          ring.reduce<float>(slot, ticket, view.in(slot), mine, ReduceOp::kSum);
        });
      const std::string err = done.get();
      if (err.empty()) {
        for (uint64_t i = 0; i < count; ++i)
          EXPECT_FLOAT_EQ(buf[i], input<float>(rail[0], i) + input<float>(rail[1], i))
              << "rank " << rank << " count " << count << " i " << i;
      }
      return err;
    };
    return std::make_pair(per, RailRun(run));
  });
}

TEST(HostPieces, AllreduceAmongARail) { allreduceAmongARail(false); }
TEST(HostPieces, AllreduceAmongARailInOneExchange) { allreduceAmongARail(true); }

// The two-level reduce_scatter's: each rank's input holds a block per position on its rail;
// it gets the sum of its position's blocks over its rail, and nothing of the other rail's.
TEST(HostPieces, ReduceScatterAmongARail) {
  onRails([](int rank, Rank& r, Ring& ring, RailStep& step, int me) {
    const std::vector<int>& rail = step.rail;
    const int rows = static_cast<int>(rail.size());
    const uint64_t per = reduceScatterPieceElems(4, kSlotBytes, rows), row = per * 4;
    auto run = [=, &r, &ring, &step](uint64_t count, const std::vector<int>& active, const std::string& failed) {
      step.check = [failed] { return failed; };
      step.op_bytes = count * 4 * kRailWorld;
      const uint64_t block = count * 4;
      std::vector<float> in(count * rows), out(count, -1.0f);
      for (uint64_t i = 0; i < in.size(); ++i) in[i] = input<float>(rank, i);
      auto ps = cutPieces(count, per, kDepth, false, [&](int word) { return ring.mark(word); });
      PieceRing view = ring.view();
      auto done = submit(r, ring, [=](const AlgoContext& c) {
        return railReduceScatterPieces(c, view, ps, count, per, DType::kFloat32, ReduceOp::kSum, kRailWorld, rank, step);
      }, marksOf(ps, false), active);
      const char* src = reinterpret_cast<const char*>(in.data());
      auto pack = [&](const HostPiece& pc) {
        for (int j = 0; j < rows; ++j)
          if (j != me) copy(view.in(pc.slot) + j * row, src + j * block + pc.off * 4, pc.len * 4);
        ring.raise(pc.first);
      };
      for (size_t p = 0; p < ps.size() && p < static_cast<size_t>(kDepth); ++p) pack(ps[p]);
      for (size_t p = 0; p < ps.size(); ++p) {
        ring.wait(ps[p].first);
        ring.reduce<float>(ps[p].slot, ps[p].first.ticket, reinterpret_cast<char*>(out.data()) + ps[p].off * 4,
                           src + me * block + ps[p].off * 4, ReduceOp::kSum);
        if (p + kDepth < ps.size()) pack(ps[p + kDepth]);
      }
      const std::string err = done.get();
      if (err.empty()) {
        uint64_t i = 0;
        while (i < count && out[i] == input<float>(rail[0], me * count + i) + input<float>(rail[1], me * count + i)) ++i;
        EXPECT_EQ(i, count) << "rank " << rank << " count " << count << ": the sum differs from element " << i;
      }
      return err;
    };
    return std::make_pair(per, RailRun(run));
  });
}

// The two-level all_gather's: each rank gets its rail's blocks, by position on the rail (the
// stream's side as HostPipeline::allgather places them), and nothing of the other rail's.
TEST(HostPieces, AllgatherAmongARail) {
  onRails([](int rank, Rank& r, Ring& ring, RailStep& step, int me) {
    const std::vector<int>& rail = step.rail;
    const int rows = static_cast<int>(rail.size());
    const uint64_t per = allgatherPieceBytes(kSlotBytes, rows);
    auto run = [=, &r, &ring, &step](uint64_t bytes, const std::vector<int>& active, const std::string& failed) {
      step.check = [failed] { return failed; };
      step.op_bytes = bytes * kRailWorld;
      std::vector<uint8_t> in(bytes), out(bytes * rows, 0);
      for (uint64_t i = 0; i < bytes; ++i) in[i] = moelink::testing::pattern(rank, i);
      auto ps = cutPieces(bytes, per, kDepth, false, [&](int word) { return ring.mark(word); });
      std::vector<PieceMark> marks = marksOf(ps, false);
      PieceRing view = ring.view();
      auto done = submit(r, ring, [=](const AlgoContext& c) {
        return railAllgatherPieces(c, view, ps, bytes, per, kRailWorld, rank, step);
      }, marks, active);
      copy(out.data() + me * bytes, in.data(), bytes);
      auto pack = [&](const HostPiece& pc) {
        copy(view.in(pc.slot), in.data() + pc.off, pc.len);
        ring.raise(pc.first);
      };
      for (size_t p = 0; p < ps.size() && p < static_cast<size_t>(kDepth); ++p) pack(ps[p]);
      for (size_t p = 0; p < ps.size(); ++p) {
        ring.wait(ps[p].first);
        for (int j = 0; j < rows; ++j)
          if (j != me) copy(out.data() + j * bytes + ps[p].off, view.out(ps[p].slot) + j * per, ps[p].len);
        if (p + kDepth < ps.size()) pack(ps[p + kDepth]);
      }
      const std::string err = done.get();
      if (err.empty()) {
        for (int j = 0; j < rows; ++j) {
          uint64_t i = 0;
          while (i < bytes && out[j * bytes + i] == moelink::testing::pattern(rail[j], i)) ++i;
          EXPECT_EQ(i, bytes) << "rank " << rank << " bytes " << bytes << ": row " << j << " differs from byte " << i;
        }
      }
      return err;
    };
    return std::make_pair(per, RailRun(run));
  });
}

// The two-level broadcast's: the root's tensor reaches the ranks of its rail (its position on
// each host) and nothing moves on the other rail, whose ranks hand the worker one empty piece
// (as HostPipeline::broadcast does). The root moves from op to op over every position of both
// hosts; where onRails has a rank fail or leave, it is rank 3, on the failing rank's rail, so
// that every rank of both hosts depends on the failure.
TEST(HostPieces, BroadcastAmongARail) {
  onRails([](int rank, Rank& r, Ring& ring, RailStep& step, int) {
    auto calls = std::make_shared<size_t>(0);
    auto run = [=, &r, &ring, &step](uint64_t bytes, const std::vector<int>& active, const std::string& failed) {
      // onRails' calls: 4 exact sizes, rank 1 failing, one after, a disagreement, one after, rank 2 gone.
      static const int roots[] = {0, 3, 2, 1, 3, 1, 0, 2, 3};
      const int root = roots[std::min<size_t>((*calls)++, std::size(roots) - 1)];
      const bool carries = std::find(step.rail.begin(), step.rail.end(), root) != step.rail.end();
      step.check = [failed] { return failed; };
      step.op_bytes = bytes;
      std::vector<uint8_t> buf(bytes);
      for (uint64_t i = 0; i < bytes; ++i) buf[i] = rank == root ? moelink::testing::pattern(root, i) : 0xee;
      auto ps = cutPieces(carries ? bytes : 0, kSlotBytes, kDepth, false, [&](int word) { return ring.mark(word); });
      EXPECT_TRUE(carries || (ps.size() == 1 && ps[0].len == 0)) << "rank " << rank;
      PieceRing view = ring.view();
      auto done = submit(r, ring, [=](const AlgoContext& c) {
        return railBroadcastPieces(c, view, ps, bytes, root, step);
      }, marksOf(ps, false), active);
      streamBroadcast(ring, ps, buf.data(), rank == root);
      const std::string err = done.get();
      if (err.empty()) {
        uint64_t i = 0;
        while (i < bytes && buf[i] == (carries ? moelink::testing::pattern(root, i) : 0xee)) ++i;
        EXPECT_EQ(i, bytes) << "rank " << rank << " root " << root << " bytes " << bytes << ": differs from byte " << i;
      }
      return err;
    };
    return std::make_pair(kSlotBytes, RailRun(run));
  });
}

// An all_to_all whose ranks disagree on a pair's length (rank 0 sends rank 1 more than rank 1
// expects) fails on both ranks with the pair's sizes named, without a hang, and the group's
// next op is exact.
TEST(HostPieces, AlltoallWithSplitsThatDisagreeFails) {
  auto store = std::make_shared<InProcessStore>();
  runRanks(2, [&](int rank) {
    Rank r = makeRank(store, rank, 2, "tcp");
    Ring ring(2);
    const uint64_t per = alltoallPieceBytes(kSlotBytes, 2);
    // rank 0 -> 1: 3 pieces and a bit on rank 0, 2 pieces on rank 1; 1 -> 0 agrees (10 bytes).
    const std::string err = rank == 0 ? alltoallOutcome(r, ring, rank, per, {0, 3 * per + 7}, {0, 10})
                                      : alltoallOutcome(r, ring, rank, per, {10, 0}, {2 * per, 0});
    if (rank == 1)
      EXPECT_NE(err.find("alltoall #1: rank 0 sent " + std::to_string(3 * per + 7) + " bytes to this rank, this "
                         "rank expects " + std::to_string(2 * per)),
                std::string::npos)
          << err;
    else
      EXPECT_FALSE(err.empty());
    expectGroupGoesOn(r, rank);
  });
}

// Ranks whose piece sizes differ (MOELINK_HOST_PIECE_BYTES) cut an all_to_all's longer pairs
// differently: the op fails on both ranks with the message sizes named, and the group's next op
// is exact.
TEST(HostPieces, AlltoallWithPieceSizesThatDifferFails) {
  auto store = std::make_shared<InProcessStore>();
  runRanks(2, [&](int rank) {
    Rank r = makeRank(store, rank, 2, "tcp");
    Ring ring(2);
    const uint64_t per = alltoallPieceBytes(rank == 0 ? kSlotBytes : kSlotBytes / 2, 2);
    // 2 pieces each way on rank 0, 3 on rank 1
    const std::string err = alltoallOutcome(r, ring, rank, per, {3000, 3000}, {3000, 3000});
    EXPECT_NE(err.find("alltoall #1: rank " + std::to_string(1 - rank) + " sent a " +
                       std::to_string(rank == 0 ? per / 2 : 2 * per) + "-byte piece, this rank expects " +
                       std::to_string(per)),
              std::string::npos)
        << err;
    expectGroupGoesOn(r, rank);
  });
}

// The cuts: every op's pieces cover it exactly, once, in order, over the slots in turn, and a
// piece's rows or blocks fit the slot's areas for every group size.
TEST(HostPieces, CutsCoverTheOpAndFitTheSlots) {
  uint32_t t = 0;
  auto mark = [&](int word) { return PieceMark{word, ++t}; };
  for (uint64_t slot : std::vector<uint64_t>{65536, 8u << 20}) {
    for (int world : {1, 2, 3, 7, 8, 64}) {
      for (size_t e : {1, 2, 4, 8, 16}) {
        const uint64_t ar = allreducePieceElems(e, slot), rs = reduceScatterPieceElems(e, slot, world),
                       ag = allgatherPieceBytes(slot, world);
        EXPECT_LE(ar * e, slot);
        EXPECT_LE(rs * e * static_cast<uint64_t>(world), slot) << "world " << world << " elem " << e;
        EXPECT_EQ(rs * e % 16, 0u);
        EXPECT_LE(ag * static_cast<uint64_t>(world), slot);
        EXPECT_EQ(ag % 16, 0u);
        // all_reduce's blocks over m active ranks: m rows of ceil(len / m) rounded to 16 bytes.
        for (int m = 1; m <= world; ++m) {
          const uint64_t vec = e >= 16 ? 1 : 16 / e, blk = (ar + m - 1) / m;
          EXPECT_LE((blk + vec - 1) / vec * vec * e * static_cast<uint64_t>(m), PieceRing::outBytes(slot, world));
        }
      }
      const uint64_t aa = alltoallPieceBytes(slot, world);
      EXPECT_LE(aa * static_cast<uint64_t>(world), slot);
      EXPECT_EQ(aa % 16, 0u);
      // A pair's pieces: the same from both ends, enough for both directions, at least one.
      for (uint64_t a : std::vector<uint64_t>{0, 1, aa, aa + 1, 5 * aa})
        for (uint64_t b : std::vector<uint64_t>{0, aa - 1, 2 * aa + 3}) {
          EXPECT_EQ(alltoallPairPieces(a, b, aa), alltoallPairPieces(b, a, aa));
          EXPECT_EQ(alltoallPairPieces(a, b, aa), std::max<uint64_t>(1, (std::max(a, b) + aa - 1) / aa));
        }
      for (uint64_t total : std::vector<uint64_t>{0, 1, slot - 1, slot, slot + 1, 7 * slot + 3}) {
        auto ps = cutPieces(total, slot, 4, true, mark);
        uint64_t next = 0;
        for (size_t p = 0; p < ps.size(); ++p) {
          EXPECT_EQ(ps[p].off, next);
          EXPECT_EQ(ps[p].slot, static_cast<int>(p % 4));
          EXPECT_EQ(ps[p].first.word, 2 * ps[p].slot);
          EXPECT_EQ(ps[p].second.word, 2 * ps[p].slot + 1);
          EXPECT_LT(ps[p].first.ticket, ps[p].second.ticket);
          next += ps[p].len;
        }
        EXPECT_EQ(next, total);
        EXPECT_EQ(ps.size(), std::max<uint64_t>(1, (total + slot - 1) / slot));
      }
    }
  }
}

}  // namespace
