#include <atomic>
#include <future>
#include <numeric>
#include <string>
#include <thread>
#include <tuple>

#include <gtest/gtest.h>

#include "moelink/collective/algorithms.h"
#include "moelink/collective/message_check.h"
#include "moelink/collective/worker.h"
#include "moelink/common/error.h"
#include "moelink/transfer/transfer_engine.h"
#include "test_support.h"
#include "worker_support.h"

using namespace moelink::collective;
using namespace moelink::transfer;
using moelink::testing::makeRank;
using moelink::testing::Rank;
using moelink::testing::run;
using moelink::testing::runRanks;
using namespace std::chrono;

namespace {

class CollectiveTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(CollectiveTest, AllreduceMatchesLocalSum) {
  auto [transport, world] = GetParam();
  auto store = std::make_shared<InProcessStore>();
  runRanks(world, [&, transport = transport, world = world](int rank) {
    Rank r = makeRank(store, rank, world, transport);
    for (uint64_t count : {0ull, 1ull, 3ull, 100ull, 5000ull, 100000ull}) {
      std::vector<float> x(count);
      for (uint64_t i = 0; i < count; ++i) x[i] = static_cast<float>((rank + 1) * (i % 7));
      ASSERT_EQ("", run(*r.worker, allreduceOp(r.worker->context(), x.data(), count, DType::kFloat32, ReduceOp::kSum)));
      float ranksum = static_cast<float>(world * (world + 1) / 2);
      for (uint64_t i = 0; i < count; ++i) ASSERT_EQ(x[i], ranksum * (i % 7)) << "count " << count << " i " << i;
    }
    // The pipelined ring (forced here; chosen by default for large tcp allreduces): blocks of
    // uneven sizes crossing many chunks, SUM, AVG and MAX.
    AlgoContext ring = r.worker->context();
    ring.ring_allreduce_bytes = 1;
    for (uint64_t count : {5ull, 1001ull, 5000ull, 100003ull}) {
      std::vector<float> x(count), a(count);
      std::vector<int32_t> m(count);
      for (uint64_t i = 0; i < count; ++i) {
        x[i] = a[i] = static_cast<float>((rank + 1) * (i % 7));
        m[i] = static_cast<int32_t>((i * 7 + static_cast<uint64_t>(rank) * 13) % 101) - 50;
      }
      ASSERT_EQ("", run(*r.worker, allreduceOp(ring, x.data(), count, DType::kFloat32, ReduceOp::kSum)));
      ASSERT_EQ("", run(*r.worker, allreduceOp(ring, a.data(), count, DType::kFloat32, ReduceOp::kAvg)));
      ASSERT_EQ("", run(*r.worker, allreduceOp(ring, m.data(), count, DType::kInt32, ReduceOp::kMax)));
      float ranksum = static_cast<float>(world * (world + 1) / 2);
      for (uint64_t i = 0; i < count; ++i) {
        ASSERT_EQ(x[i], ranksum * (i % 7)) << "ring count " << count << " i " << i;
        ASSERT_FLOAT_EQ(a[i], ranksum * (i % 7) / world) << "ring avg count " << count << " i " << i;
        int32_t want = INT32_MIN;
        for (int q = 0; q < world; ++q)
          want = std::max(want, static_cast<int32_t>((i * 7 + static_cast<uint64_t>(q) * 13) % 101) - 50);
        ASSERT_EQ(m[i], want) << "ring max count " << count << " i " << i;
      }
    }
  });
}

// Reductions in pieces smaller than a slot (AlgoContext::reduce_piece_min, on by default over
// tcp): the reduce-scatter + allgather, the ring and reduce-scatter, with blocks that are not
// a whole number of pieces and pieces of every rank's block cut alike.
TEST_P(CollectiveTest, ReductionsInPiecesSmallerThanASlot) {
  auto [transport, world] = GetParam();
  auto store = std::make_shared<InProcessStore>();
  runRanks(world, [&, transport = transport, world = world](int rank) {
    Rank r = makeRank(store, rank, world, transport);
    AlgoContext c = r.worker->context();
    c.reduce_piece_min = 512;  // 128 floats; slots hold 1024
    c.reduce_pieces = 4;
    const float ranksum = static_cast<float>(world * (world + 1) / 2);
    for (uint64_t ring : {0ull, 1ull}) {
      c.ring_allreduce_bytes = ring;
      for (uint64_t count : {1023ull, 1024ull, 2047ull, 5000ull, 9001ull}) {
        std::vector<float> x(count);
        for (uint64_t i = 0; i < count; ++i) x[i] = static_cast<float>((rank + 1) * (i % 7));
        ASSERT_EQ("", run(*r.worker, allreduceOp(c, x.data(), count, DType::kFloat32, ReduceOp::kSum)));
        for (uint64_t i = 0; i < count; ++i)
          ASSERT_EQ(x[i], ranksum * (i % 7)) << "ring " << ring << " count " << count << " i " << i;
      }
    }
    for (uint64_t count : {127ull, 128ull, 129ull, 511ull, 1500ull, 4097ull}) {
      std::vector<float> in(count * world), out(count);
      for (uint64_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>((rank + 1) * (i % 5));
      ASSERT_EQ("", run(*r.worker, reduceScatterOp(c, in.data(), out.data(), count, DType::kFloat32, ReduceOp::kSum)));
      for (uint64_t i = 0; i < count; ++i)
        ASSERT_EQ(out[i], ranksum * ((rank * count + i) % 5)) << "reduce_scatter count " << count << " i " << i;
    }
  });
}

// How many pieces a block becomes: up to reduce_pieces of at least reduce_piece_min bytes,
// never more than a slot; off (0), the slots.
TEST(Collective, ReductionPiecesFollowTheSettings) {
  AlgoContext c;
  c.me = 0;
  c.ranks = {0, 1};
  c.chunk = 4096;  // 1024 floats
  c.allreduce_small_bytes = 1024;
  auto steps = [&](uint64_t min, uint64_t count) {
    c.reduce_piece_min = min;
    c.reduce_pieces = 4;
    return allreduceOp(c, nullptr, count, DType::kFloat32, ReduceOp::kSum).steps.size() / 2;  // per phase
  };
  EXPECT_EQ(2u, steps(0, 4096));     // blocks of 2048 floats: two slots
  EXPECT_EQ(4u, steps(512, 4096));   // four pieces of 512
  EXPECT_EQ(2u, steps(4096, 4096));  // at least a slot: the slots
  EXPECT_EQ(4u, steps(512, 1024));   // blocks of 512: four pieces of 128, the least
  EXPECT_EQ(3u, steps(512, 768));    // blocks of 384: three pieces of the least, 128
  EXPECT_EQ(4u, steps(512, 8192));   // blocks of 4096: four slots
  EXPECT_EQ(8u, steps(512, 16384));  // blocks of 8192: pieces are at most a slot
  c.reduce_piece_min = 512;
  EXPECT_EQ(4u, reduceScatterOp(c, nullptr, nullptr, 2048, DType::kFloat32, ReduceOp::kSum).steps.size());
  EXPECT_EQ(3u, reduceScatterOp(c, nullptr, nullptr, 257, DType::kFloat32, ReduceOp::kSum).steps.size());
}

TEST_P(CollectiveTest, AlltoallUnevenAndBroadcast) {
  auto [transport, world] = GetParam();
  auto store = std::make_shared<InProcessStore>();
  runRanks(world, [&, transport = transport, world = world](int rank) {
    Rank r = makeRank(store, rank, world, transport);
    // rank s sends (s + d) * 1000 bytes of value s*16+d to rank d.
    std::vector<uint64_t> soff(world), sb(world), roff(world), rb(world);
    uint64_t st = 0, rt = 0;
    for (int d = 0; d < world; ++d) {
      sb[d] = static_cast<uint64_t>(rank + d) * 1000;
      soff[d] = st;
      st += sb[d];
      rb[d] = static_cast<uint64_t>(d + rank) * 1000;
      roff[d] = rt;
      rt += rb[d];
    }
    std::vector<uint8_t> in(st), out(rt, 0xff);
    for (int d = 0; d < world; ++d) std::fill_n(in.begin() + soff[d], sb[d], static_cast<uint8_t>(rank * 16 + d));
    ASSERT_EQ("", run(*r.worker, alltoallOp(r.worker->context(), in.data(), soff, sb, out.data(), roff, rb)));
    for (int s = 0; s < world; ++s)
      for (uint64_t i = 0; i < rb[s]; ++i) ASSERT_EQ(out[roff[s] + i], s * 16 + rank);
    std::vector<int> b(9000, rank == 1 ? 42 : 0);
    ASSERT_EQ("", run(*r.worker, broadcastOp(r.worker->context(), b.data(), b.size() * 4, 1)));
    for (int v : b) ASSERT_EQ(v, 42);
    // The pipelined chain (forced here; chosen by default for large broadcasts across hosts).
    AlgoContext chain = r.worker->context();
    chain.chain_broadcast_bytes = 1;
    std::vector<int> c(9000, rank == world - 1 ? 7 : -1);
    for (int i = 0; i < 9000 && rank == world - 1; ++i) c[i] = i;
    ASSERT_EQ("", run(*r.worker, broadcastOp(chain, c.data(), c.size() * 4, world - 1)));
    for (int i = 0; i < 9000; ++i) ASSERT_EQ(c[i], i);
  });
}

// A pipelined op over a ring of two slots that another thread fills and drains piece by piece
// (as the CUDA host route's stream does with its pinned ring): each piece is gated on the
// slot's ready word, and its done word lets the producer check the slot and reuse it. The
// producer dawdles while a slot is still in use, so that data of the piece after next, which
// peers send as soon as their own slot is ready, arrives then: it must wait in the mailbox (no
// receive in place before the gate) and the senders' slots must not be reused before their
// sends have completed (pulled messages are read from the slot). An all-gather, then a
// chained broadcast (whose pieces forward what they received).
TEST_P(CollectiveTest, GatedPiecesThroughReusedSlots) {
  auto [transport, world] = GetParam();
  auto store = std::make_shared<InProcessStore>();
  runRanks(world, [&, transport = transport, world = world](int rank) {
    Rank r = makeRank(store, rank, world, transport);
    constexpr int kSlots = 2, kPieces = 7;
    const uint64_t len = 10000;  // several mailbox chunks per pair and piece
    std::vector<std::vector<uint8_t>> in(kSlots, std::vector<uint8_t>(len)),
        out(kSlots, std::vector<uint8_t>(len * world));
    std::atomic<uint32_t> ready[kSlots] = {}, done[kSlots] = {};
    auto value = [](int src, int piece) { return static_cast<uint8_t>(src * 16 + piece); };
    for (int root : {-1, world - 1}) {  // -1: the all-gather
      for (int s = 0; s < kSlots; ++s) ready[s] = done[s] = 0;
      AlgoContext ctx = r.worker->context();
      ctx.chain_broadcast_bytes = 1;
      OpSpec op;
      op.kind = root < 0 ? OpKind::kAllgather : OpKind::kBroadcast;
      op.root = root;
      for (int p = 0; p < kPieces; ++p) {
        const int s = p % kSlots;
        const uint32_t t = static_cast<uint32_t>(p + 1);
        std::vector<uint64_t> so(world, 0), sb(world, len), ro(world), rb(world, len);
        for (int q = 0; q < world; ++q) ro[q] = static_cast<uint64_t>(q) * len;
        sb[rank] = rb[rank] = 0;
        OpSpec piece = root < 0 ? alltoallOp(ctx, in[s].data(), so, sb, out[s].data(), ro, rb)
                                : broadcastOp(ctx, in[s].data(), len, root);
        appendGatedPiece(op, std::move(piece), [&ready, s, t] { return ready[s].load() >= t; },
                         [&done, s, t] { done[s].store(t); });
      }
      std::promise<std::string> result;
      r.worker->submit(std::move(op), [&](const std::string& e) { result.set_value(e); }, seconds(30));
      const bool sends_own = root < 0 || rank == root;  // in[s] holds this rank's data (else what it received)
      // Waits for piece p, refills its slot's input with piece `next` at once (its sends are
      // over), then reads the piece slowly.
      auto check = [&](int p, int next) {
        const int s = p % kSlots;
        while (done[s].load() < static_cast<uint32_t>(p + 1)) std::this_thread::sleep_for(microseconds(50));
        if (sends_own && next < kPieces) std::fill(in[s].begin(), in[s].end(), value(rank, next));
        std::this_thread::sleep_for(milliseconds(3));
        if (root < 0) {
          for (int q = 0; q < world; ++q)
            for (uint64_t i = 0; i < len && q != rank; ++i)
              ASSERT_EQ(out[s][q * len + i], value(q, p)) << "piece " << p << " from rank " << q << " byte " << i;
        } else {
          for (uint64_t i = 0; i < len && !sends_own; ++i)
            ASSERT_EQ(in[s][i], value(root, p)) << "broadcast piece " << p << " byte " << i;
        }
      };
      for (int p = 0; p < kPieces; ++p) {
        const int s = p % kSlots;
        if (p >= kSlots)
          check(p - kSlots, p);
        else if (sends_own)
          std::fill(in[s].begin(), in[s].end(), value(rank, p));
        ready[s].store(static_cast<uint32_t>(p + 1));
      }
      for (int p = kPieces - kSlots; p < kPieces; ++p) check(p, kPieces);
      ASSERT_EQ("", result.get_future().get());
    }
  });
}

// Over tcp a message is received straight at its step's landing when the mailbox was asked for
// that before it came; a gated step's landing is its memory, free only once the gate opens. Here
// every gate opens after the op started (as the host route's pieces come off the GPU one after
// another), rank 0's well before rank 1's: each of rank 1's pieces reaches rank 0 after rank
// 0's gate for it opened, so it lands in place, not in a mailbox slot to be copied out; rank 0's
// pieces reach rank 1 before its gates open and wait in the slots. Both get every byte.
TEST(Collective, GatedPiecesLandInPlaceOnceTheirGatesOpen) {
  auto store = std::make_shared<InProcessStore>();
  runRanks(2, [&](int rank) {
    Rank r = makeRank(store, rank, 2, "tcp");
    constexpr int kPieces = 4;  // within the mailbox's depth: the op's messages are all due at its start
    const uint64_t len = 4000;  // one message per piece and pair
    const int peer = 1 - rank;
    std::vector<std::vector<uint8_t>> in(kPieces, std::vector<uint8_t>(len)), out(kPieces, std::vector<uint8_t>(len, 0));
    std::atomic<bool> ready[kPieces] = {};
    std::atomic<int> in_place{0}, copied{0};
    auto value = [](int src, int piece, uint64_t i) { return static_cast<uint8_t>(src * 64 + piece * 8 + i % 7); };
    OpSpec op;
    op.kind = OpKind::kAlltoall;
    AlgoContext ctx = r.worker->context();
    for (int p = 0; p < kPieces; ++p) {
      for (uint64_t i = 0; i < len; ++i) in[p][i] = value(rank, p, i);
      std::vector<uint64_t> zero(2, 0), bytes(2, 0);
      bytes[peer] = len;
      appendGatedPiece(op, alltoallOp(ctx, in[p].data(), zero, bytes, out[p].data(), zero, bytes),
                       [&ready, p] { return ready[p].load(); }, nullptr);
    }
    for (Step& st : op.steps) {
      if (st.recvs.empty()) continue;
      ASSERT_NE(st.recvs[0].landing, nullptr);
      st.consume = [inner = std::move(st.consume), landing = st.recvs[0].landing, &in_place,
                    &copied](const std::vector<const char*>& got) {
        (got[0] == landing ? in_place : copied)++;
        inner(got);
      };
    }
    std::promise<std::string> result;
    r.worker->submit(std::move(op), [&](const std::string& e) { result.set_value(e); }, seconds(30));
    for (int p = 0; p < kPieces; ++p) {
      storeBarrier(*store, "piece" + std::to_string(p), 2, seconds(10));
      if (rank == 1) std::this_thread::sleep_for(milliseconds(50));  // rank 0's worker sees its gate first
      ready[p].store(true);
    }
    ASSERT_EQ("", result.get_future().get());
    for (int p = 0; p < kPieces; ++p)
      for (uint64_t i = 0; i < len; ++i) ASSERT_EQ(out[p][i], value(peer, p, i)) << "piece " << p << " byte " << i;
    EXPECT_EQ(in_place + copied, kPieces);
    if (rank == 0) EXPECT_EQ(in_place, kPieces) << "pieces whose gates opened after the op started were copied out of the mailbox";
  });
}

// After a membership change ops are built over the active ranks only: per-rank blocks stay laid
// out by rank over the whole group, and the blocks of an inactive rank are zero-filled outputs
// and ignored inputs. Rank 1 of 3 is inactive here (it only keeps its mailboxes alive).
TEST(CollectiveMask, BlocksByRankAndZeroFilledForInactiveRanks) {
  auto store = std::make_shared<InProcessStore>();
  runRanks(3, [&](int rank) {
    Rank r = makeRank(store, rank, 3, "shm");
    if (rank != 1) {
      AlgoContext c = r.worker->context();
      c.ranks = {0, 2};
      const uint64_t n = 3000;  // floats per block: crosses chunks
      auto val = [](int src, int dst, uint64_t i) { return static_cast<float>(src * 100 + dst * 10 + i % 7); };
      // allgather
      std::vector<float> in(n), out(3 * n, -1.f);
      for (uint64_t i = 0; i < n; ++i) in[i] = val(rank, 0, i);
      ASSERT_EQ("", run(*r.worker, allgatherOp(c, in.data(), out.data(), n * 4)));
      for (int s = 0; s < 3; ++s)
        for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(out[s * n + i], s == 1 ? 0.f : val(s, 0, i)) << s << " " << i;
      // reduce_scatter: in holds a block per rank; rank 1's block is ignored
      std::vector<float> rs_in(3 * n), rs_out(n, -1.f);
      for (int d = 0; d < 3; ++d)
        for (uint64_t i = 0; i < n; ++i) rs_in[d * n + i] = d == 1 ? 1e9f : val(rank, d, i);
      ASSERT_EQ("", run(*r.worker, reduceScatterOp(c, rs_in.data(), rs_out.data(), n, DType::kFloat32, ReduceOp::kSum)));
      for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(rs_out[i], val(0, rank, i) + val(2, rank, i));
      // allreduce over the two
      std::vector<float> ar(n);
      for (uint64_t i = 0; i < n; ++i) ar[i] = val(rank, 0, i);
      ASSERT_EQ("", run(*r.worker, allreduceOp(c, ar.data(), n, DType::kFloat32, ReduceOp::kAvg)));
      for (uint64_t i = 0; i < n; ++i) ASSERT_FLOAT_EQ(ar[i], (val(0, 0, i) + val(2, 0, i)) / 2);
      // alltoall with splits per rank: what rank 1 would send or receive is skipped / zeroed
      std::vector<uint64_t> soff(3), sb(3), roff(3), rb(3);
      uint64_t st = 0, rt = 0;
      for (int q = 0; q < 3; ++q) {
        sb[q] = rb[q] = 1000 * static_cast<uint64_t>(rank + q + 1);
        soff[q] = st;
        roff[q] = rt;
        st += sb[q];
        rt += rb[q];
      }
      std::vector<uint8_t> a_in(st), a_out(rt, 0xff);
      for (int q = 0; q < 3; ++q) std::fill_n(a_in.begin() + soff[q], sb[q], static_cast<uint8_t>(rank * 16 + q));
      ASSERT_EQ("", run(*r.worker, alltoallOp(c, a_in.data(), soff, sb, a_out.data(), roff, rb)));
      for (int q = 0; q < 3; ++q)
        for (uint64_t i = 0; i < rb[q]; ++i) ASSERT_EQ(a_out[roff[q] + i], q == 1 ? 0 : q * 16 + rank);
      // gather to rank 2 and scatter from rank 0
      std::vector<float> g_out(rank == 2 ? 3 * n : 0, -1.f);
      ASSERT_EQ("", run(*r.worker, gatherOp(c, in.data(), g_out.data(), n * 4, 2)));
      if (rank == 2) {
        for (int s = 0; s < 3; ++s) {
          for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(g_out[s * n + i], s == 1 ? 0.f : val(s, 0, i));
        }
      }
      std::vector<float> sc_in(rank == 0 ? 3 * n : 0), sc_out(n, -1.f);
      for (uint64_t i = 0; i < sc_in.size(); ++i) sc_in[i] = static_cast<float>(i);
      ASSERT_EQ("", run(*r.worker, scatterOp(c, sc_in.data(), sc_out.data(), n * 4, 0)));
      for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(sc_out[i], static_cast<float>(rank * n + i));
      // an inactive root is refused when the op is built
      EXPECT_THROW(broadcastOp(c, in.data(), 4, 1), moelink::Error);
    }
    storeBarrier(*store, "mask-end", 3, seconds(30));
  });
}

INSTANTIATE_TEST_SUITE_P(All, CollectiveTest,
                         ::testing::Combine(::testing::Values("tcp", "shm", "pull"), ::testing::Values(2, 3, 4)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_w" + std::to_string(std::get<1>(info.param));
                         });

// An op one rank runs whole and another in pieces (the CUDA host route's pipeline) is named so.
TEST(Collective, OpSizesInPiecesReadAsSuch) {
  using moelink::collective::OpFields;
  const auto kind = static_cast<uint8_t>(moelink::collective::OpKind::kAllreduce);
  const OpFields whole{kind, 5, -1, 0, 0, 1 << 20};
  OpFields pieces = whole;
  pieces.op_bytes |= moelink::collective::kOpBytesInPieces;
  EXPECT_EQ(moelink::collective::describeOpMismatch(whole, pieces, 2),
            "allreduce #5: rank 2 sent 1048576 bytes in pieces, this rank expects 1048576");
  EXPECT_EQ(moelink::collective::describeOpMismatch(pieces, whole, 2),
            "allreduce #5: rank 2 sent 1048576 bytes, this rank expects 1048576 in pieces");
  EXPECT_EQ(moelink::collective::describeOpMismatch(pieces, pieces, 2), "");
}

TEST(Collective, SizeMismatchFailsBothSidesThenRecovers) {
  auto store = std::make_shared<InProcessStore>();
  runRanks(2, [&](int rank) {
    Rank r = makeRank(store, rank, 2, "shm");
    std::vector<float> x(rank == 0 ? 1024 : 2048, 1.0f);
    std::string err = run(*r.worker, allreduceOp(r.worker->context(), x.data(), x.size(), DType::kFloat32, ReduceOp::kSum));
    std::string theirs = rank == 0 ? "8192" : "4096", mine = rank == 0 ? "4096" : "8192";
    EXPECT_NE(err.find("allreduce #1: rank " + std::to_string(1 - rank) + " sent " + theirs +
                       " bytes, this rank expects " + mine), std::string::npos) << err;
    // The group stays usable.
    std::vector<float> y(5000, static_cast<float>(rank + 1));
    ASSERT_EQ("", run(*r.worker, allreduceOp(r.worker->context(), y.data(), y.size(), DType::kFloat32, ReduceOp::kSum)));
    for (float v : y) ASSERT_EQ(v, 3.0f);
  });
}

// A pulled send whose op fails on the sender (here: it times out before the receiver comes)
// is withdrawn: the late receiver fails instead of reading memory that has changed since, and
// the next op is exact.
TEST(Collective, PulledDataIsWithdrawnWhenTheSenderFails) {
  auto store = std::make_shared<InProcessStore>();
  runRanks(2, [&](int rank) {
    Rank r = makeRank(store, rank, 2, "pull");
    const uint64_t n = 3 * 4096 * 2;  // three chunks to each rank
    std::vector<uint64_t> off{0, n / 2}, len{n / 2, n / 2};
    std::vector<uint8_t> in(n, static_cast<uint8_t>(10 + rank)), out(n, 0);
    if (rank == 1) {
      std::string err = run(*r.worker, alltoallOp(r.worker->context(), in.data(), off, len, out.data(), off, len),
                            milliseconds(300));
      EXPECT_NE(err.find("Timed out"), std::string::npos) << err;
      std::fill(in.begin(), in.end(), 0xEE);  // the caller's memory again
      storeBarrier(*store, "failed", 2, seconds(30));
    } else {
      storeBarrier(*store, "failed", 2, seconds(30));
      std::string err = run(*r.worker, alltoallOp(r.worker->context(), in.data(), off, len, out.data(), off, len));
      EXPECT_NE(err, "") << "a late rank took data from an op that failed on its sender";
    }
    storeBarrier(*store, "next", 2, seconds(30));
    std::vector<uint8_t> in2(n, static_cast<uint8_t>(20 + rank)), out2(n, 0);
    ASSERT_EQ("", run(*r.worker, alltoallOp(r.worker->context(), in2.data(), off, len, out2.data(), off, len)));
    for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(out2[i], 20 + i / (n / 2)) << i;
  });
}

TEST(Collective, MissingPeerTimesOut) {
  auto store = std::make_shared<InProcessStore>();
  runRanks(2, [&](int rank) {
    Rank r = makeRank(store, rank, 2, "tcp");
    if (rank == 0) {
      std::vector<float> x(10, 1.0f);
      auto t0 = steady_clock::now();
      std::string err = run(*r.worker, allreduceOp(r.worker->context(), x.data(), x.size(), DType::kFloat32, ReduceOp::kSum),
                            milliseconds(300));
      EXPECT_NE(err.find("Timed out"), std::string::npos) << err;
      EXPECT_NE(err.find("rank(s) 1"), std::string::npos) << err;
      EXPECT_LT(steady_clock::now() - t0, seconds(5));
    }
    storeBarrier(*store, "end", 2, seconds(30));
  });
}

TEST(Collective, SendRecvAnySourceAndTags) {
  auto store = std::make_shared<InProcessStore>();
  runRanks(3, [&](int rank) {
    Rank r = makeRank(store, rank, 3, "shm");
    if (rank == 0) {
      // Two receives from any source, then a recv whose tag no send carries: it times out and
      // names the tag that did arrive.
      std::vector<int> got;
      for (int k = 0; k < 2; ++k) {
        std::vector<int> buf(3000, -1);
        std::promise<int> p;
        r.worker->recv(-1, buf.data(), buf.size() * 4, 0, [&](const std::string& e, int src) {
          EXPECT_EQ(e, "");
          p.set_value(src);
        }, seconds(30));
        int src = p.get_future().get();
        for (int v : buf) ASSERT_EQ(v, src * 100);
        got.push_back(src);
      }
      std::sort(got.begin(), got.end());
      EXPECT_EQ(got, (std::vector<int>{1, 2}));
      int v = 0;
      std::promise<std::string> p;
      r.worker->recv(1, &v, 4, 9, [&](const std::string& e, int) { p.set_value(e); }, milliseconds(500));
      std::string err = p.get_future().get();
      EXPECT_NE(err.find("Timed out"), std::string::npos) << err;
      EXPECT_NE(err.find("unmatched sends with tags 3"), std::string::npos) << err;
      // The send with tag 3 is still there for a recv that asks for it.
      std::promise<std::string> q;
      r.worker->recv(1, &v, 4, 3, [&](const std::string& e, int) { q.set_value(e); }, seconds(30));
      EXPECT_EQ(q.get_future().get(), "");
      EXPECT_EQ(v, 5);
    } else {
      std::vector<int> buf(3000, rank * 100);
      std::promise<std::string> p;
      r.worker->send(0, buf.data(), buf.size() * 4, 0, [&](const std::string& e) { p.set_value(e); }, seconds(30));
      EXPECT_EQ(p.get_future().get(), "");
      if (rank == 1) {
        int v = 5;
        std::promise<std::string> q;
        r.worker->send(0, &v, 4, 3, [&](const std::string& e) { q.set_value(e); }, seconds(30));
        EXPECT_EQ(q.get_future().get(), "");
      }
    }
    storeBarrier(*store, "end", 3, seconds(30));
  });
}

TEST(Collective, SendsMatchRecvsBySourceAndTag) {
  // isend(tag 2), isend(tag 1) against irecv(tag 1), irecv(tag 2), with messages larger than a
  // mailbox slot; then a size disagreement on one tag fails that recv only.
  for (const char* transport : {"shm", "tcp"}) {
    auto store = std::make_shared<InProcessStore>();
    runRanks(2, [&](int rank) {
      Rank r = makeRank(store, rank, 2, transport);
      const size_t n = 300000;  // > one 512 KiB chunk of ints
      if (rank == 1) {
        std::vector<int> a(n, 2), b(n, 1);
        std::promise<std::string> pa, pb;
        r.worker->send(0, a.data(), n * 4, 2, [&](const std::string& e) { pa.set_value(e); }, seconds(30));
        r.worker->send(0, b.data(), n * 4, 1, [&](const std::string& e) { pb.set_value(e); }, seconds(30));
        EXPECT_EQ(pa.get_future().get(), "");
        EXPECT_EQ(pb.get_future().get(), "");
        int v = 7;
        std::promise<std::string> pc;
        r.worker->send(0, &v, 4, 5, [&](const std::string& e) { pc.set_value(e); }, seconds(30));
        EXPECT_EQ(pc.get_future().get(), "");
      } else {
        std::vector<int> one(n, -1), two(n, -1);
        std::promise<std::string> p1, p2;
        r.worker->recv(1, one.data(), n * 4, 1, [&](const std::string& e, int) { p1.set_value(e); }, seconds(30));
        r.worker->recv(1, two.data(), n * 4, 2, [&](const std::string& e, int) { p2.set_value(e); }, seconds(30));
        EXPECT_EQ(p1.get_future().get(), "");
        EXPECT_EQ(p2.get_future().get(), "");
        EXPECT_TRUE(std::all_of(one.begin(), one.end(), [](int x) { return x == 1; }));
        EXPECT_TRUE(std::all_of(two.begin(), two.end(), [](int x) { return x == 2; }));
        int64_t w = 0;
        std::promise<std::string> p3;
        r.worker->recv(1, &w, 8, 5, [&](const std::string& e, int) { p3.set_value(e); }, seconds(30));
        std::string err = p3.get_future().get();
        EXPECT_NE(err.find("sent 4 bytes, this rank expects 8"), std::string::npos) << err;
      }
      storeBarrier(*store, "end", 2, seconds(30));
    });
  }
}

}  // namespace
