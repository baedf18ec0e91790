// The in-host GPU collectives' plans (cuda/exchange.h) on the CPU, beyond what they move
// (exchange_plan_test.cpp): the piece split and the blocks and roles a launch runs, the
// protocols' thresholds, the SMs an op holds, the staging layout, the mismatch messages and the
// tuning read from the environment.
#include <algorithm>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "moelink/cuda/exchange.h"
#include "moelink/common/error.h"

using namespace moelink::collective;
using namespace moelink::cuda;

namespace {

TEST(ExchangePiece, PartitionsEveryRound) {
  for (uint64_t len : {0ull, 1ull, 15ull, 16ull, 16385ull, 1000000ull, 8388608ull})
    for (int blocks : {1, 3, 24, 64}) {
      uint64_t next = 0;
      for (int b = 0; b < blocks; ++b) {
        uint64_t lo, hi;
        exchangePiece(len, b, blocks, &lo, &hi);
        ASSERT_EQ(lo, next < len ? next : len);
        ASSERT_LE(lo, hi);
        if (lo < len) {
          ASSERT_EQ(lo % 16, 0u);
        }
        if (hi < len) {
          ASSERT_GE(hi - lo, kExchangeMinPiece);
        }
        next = hi > next ? hi : next;
      }
      ASSERT_EQ(next, len) << "len " << len << " blocks " << blocks;
    }
}

TEST(ExchangePiece, LaunchedBlocksAndRolesFollowTheLongestPair) {
  ExchangeTuning t;  // 64 blocks, 8 MiB rounds, pieces of at least 16 KiB
  auto oneShot = [&](uint64_t bytes) {
    return exchangeBlocksWithWork(exchangeAllreduceOneShot(2, 0, bytes / 4, DType::kFloat32, ReduceOp::kSum), t);
  };
  EXPECT_EQ(oneShot(0), 1);
  EXPECT_EQ(oneShot(8 << 10), 1);
  EXPECT_EQ(oneShot(16 << 10), 1);
  EXPECT_EQ(oneShot((16 << 10) + 16), 2);
  EXPECT_EQ(oneShot(256 << 10), 16);
  EXPECT_EQ(oneShot(1 << 20), 64);
  EXPECT_EQ(oneShot(64 << 20), 64);
  // The largest pair counts, whichever way it goes.
  EXPECT_EQ(exchangeBlocksWithWork(exchangeAlltoall(2, 0, {0, 0}, {0, 4096}, {0, 0}, {0, 100 << 10}), t), 7);
  EXPECT_EQ(exchangeBlocksWithWork(exchangeAllgather(4, 1, 40 << 10), t), 3);
  // Separate pushing and consuming blocks from the second round on, and only when split.
  auto splits = [&](uint64_t bytes) {
    return exchangeSplits(exchangeAllreduceOneShot(2, 0, bytes / 4, DType::kFloat32, ReduceOp::kSum), t);
  };
  EXPECT_FALSE(splits(8 << 10));
  EXPECT_FALSE(splits(8 << 20));
  EXPECT_TRUE(splits((8 << 20) + 16));
  EXPECT_TRUE(exchangeSplits(exchangeAllgather(2, 0, 16 << 20), t));
  // The two-shot staged all_reduce moves half a staging round per pair and round (a slot holds a
  // piece of each half): 4 ranks, blocks of a quarter of the buffer.
  auto twoShot = [&](uint64_t bytes) {
    return exchangeAllreduceTwoShotStaged(4, 1, bytes / 4, DType::kFloat32, ReduceOp::kSum);
  };
  EXPECT_EQ(exchangeRoundBytes(twoShot(16 << 20), t), uint64_t{4} << 20);
  EXPECT_EQ(exchangeRoundBytes(exchangeAllgather(4, 0, 16 << 20), t), t.round_bytes);
  EXPECT_EQ(exchangeBlocksWithWork(twoShot(16 << 20), t), 64);
  EXPECT_EQ(exchangeBlocksWithWork(twoShot(1 << 20), t), 16);  // blocks of 256 KiB
  EXPECT_FALSE(exchangeSplits(twoShot(16 << 20), t));           // blocks of 4 MiB: one round
  EXPECT_TRUE(exchangeSplits(twoShot((16 << 20) + 64), t));
  for (uint64_t round : {uint64_t{64} << 10, (uint64_t{64} << 10) + 16, uint64_t{8} << 20, (uint64_t{1} << 32) - 16}) {
    ExchangeTuning r = t;
    r.round_bytes = round;  // MOELINK_CUDA_ROUND_BYTES: a multiple of 16 from 64 KiB
    const uint64_t half = exchangeRoundBytes(twoShot(64 << 20), r);
    EXPECT_EQ(half % 16, 0u) << round;
    EXPECT_LE(2 * half, round) << round;
    EXPECT_GE(2 * half + 16, round) << round;
  }
  t.split = false;
  EXPECT_FALSE(splits(64 << 20));
  EXPECT_FALSE(exchangeSplits(twoShot(64 << 20), t));
}

TEST(ExchangePlanBroadcast, ForwardsAboveTheOneShotSizeInGroupsOfMoreThanTwo) {
  ExchangeTuning t;
  t.one_shot_bytes = 1 << 20;
  EXPECT_FALSE(broadcastForwards(2, uint64_t{1} << 30, t));  // no rank to forward through
  EXPECT_FALSE(broadcastForwards(4, 1 << 20, t));
  EXPECT_TRUE(broadcastForwards(4, (1 << 20) + 1, t));
  EXPECT_TRUE(broadcastForwards(8, (1 << 20) + 1, t));
  t.one_shot_bytes = 0;  // every size, blocks of a few bytes or none
  EXPECT_TRUE(broadcastForwards(3, 1, t));
  // blocks in rank order over the ranks but the root, the last one what is left (none here)
  const auto x = exchangeBroadcastForward(8, 3, 16, 5);
  EXPECT_EQ(x.recv_bytes[5], 0u);
  EXPECT_EQ(exchangeBroadcastForward(8, 0, 16, 5).recv_bytes[5], 16u);
  EXPECT_EQ(exchangeBroadcastForward(8, 0, 16, 5).send_bytes[1], 16u);
  EXPECT_THROW(exchangeBroadcastForward(2, 0, 1 << 20, 0), moelink::Error);  // 2 ranks: one exchange
  EXPECT_THROW(exchangeBroadcastForward(4, 0, 1 << 20, 4), moelink::Error);
  EXPECT_THROW(restrictExchange(exchangeBroadcastForward(4, 0, 1 << 20, 1), {0, 1, 2}), moelink::Error);
  // never on separate pushing and consuming blocks, one round or more: the root only pushes, the
  // others only consume (and pass on what they place)
  for (uint64_t bytes : {uint64_t{1} << 20, uint64_t{1} << 30}) {
    const Exchange root = exchangeBroadcastForward(4, 1, bytes, 1), other = exchangeBroadcastForward(4, 0, bytes, 1);
    EXPECT_FALSE(exchangeSplits(root, t));
    EXPECT_FALSE(exchangeSplits(other, t));
    EXPECT_EQ(exchangeSms(other, t), exchangeBlocksWithWork(other, t));
  }
}

TEST(ExchangePiece, RolesWaitForEachOtherOnlyWhereTheOutputMeetsPushedInput) {
  std::vector<char> buf(1 << 20), other(1 << 20);
  const uint64_t count = buf.size() / 4;
  // In place, but the ranges the consumers write are never pushed: a rank reduces its own block
  // (the reduce-scatter half into place), and the peers' reduced blocks land where this rank
  // pushed from only once the peers have reduced what it pushed (the two-shot staged all_reduce);
  // or pushed only once they have landed: the forwarding broadcast.
  for (int me = 0; me < 4; ++me) {
    const auto blocks = allreduceBlocks(4, count, DType::kFloat32);
    EXPECT_FALSE(exchangeOutputMeetsInput(exchangeAllreduceScatter(4, me, count, DType::kFloat32, ReduceOp::kSum), me,
                                          buf.data(), buf.data() + blocks[me].first * 4));
    EXPECT_FALSE(exchangeOutputMeetsInput(
        exchangeAllreduceTwoShotStaged(4, me, count, DType::kFloat32, ReduceOp::kSum), me, buf.data(), buf.data()));
    EXPECT_FALSE(exchangeOutputMeetsInput(exchangeBroadcastForward(4, me, buf.size(), 1), me, buf.data(),
                                          buf.data()));
  }
  // A one-shot all_reduce in place writes all of what it pushes.
  EXPECT_TRUE(exchangeOutputMeetsInput(exchangeAllreduceOneShot(4, 2, count, DType::kFloat32, ReduceOp::kSum), 2,
                                       buf.data(), buf.data()));
  // Out of place: never.
  EXPECT_FALSE(exchangeOutputMeetsInput(exchangeAllreduceOneShot(4, 2, count, DType::kFloat32, ReduceOp::kSum), 2,
                                        buf.data(), other.data()));
  EXPECT_FALSE(exchangeOutputMeetsInput(exchangeAllgather(4, 1, 1000), 1, buf.data(), other.data()));
  // An all-to-all whose output overlaps the input: only where a received range meets a sent
  // one; the own pair copied onto itself writes nothing.
  const uint64_t q = 1000;
  Exchange a2a = exchangeAlltoall(2, 0, {0, q}, {q, q}, {0, q}, {q, q});
  EXPECT_TRUE(exchangeOutputMeetsInput(a2a, 0, buf.data(), buf.data()));
  EXPECT_FALSE(exchangeOutputMeetsInput(a2a, 0, buf.data(), buf.data() + 2 * q));
  EXPECT_TRUE(exchangeOutputMeetsInput(a2a, 0, buf.data(), buf.data() + 2 * q - 1));
  Exchange self_only = exchangeAlltoall(2, 0, {0, q}, {q, q}, {0, 2 * q}, {q, 0});
  EXPECT_FALSE(exchangeOutputMeetsInput(self_only, 0, buf.data(), buf.data()));
}

ExchangeTuning off_tuning(ExchangeTuning t) {
  t.lamport_bytes = 0;
  return t;
}

TEST(ExchangePiece, SmsACollectiveHolds) {
  const ExchangeTuning t = ExchangeTuning::fromEnv(4);  // 64 blocks, 8 MiB rounds, Lamport to 256 KiB
  // Lamport: one block per 4 KiB of the longest pair up to 64 KiB, per 8 KiB above (two lines
  // per thread), plus the header block.
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 4, 8 << 10, t), 3);
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 4, 256 << 10, t), 33);
  EXPECT_EQ(collectiveSms(OpKind::kAllgather, 4, 256 << 10, t), 17);  // pairs of 64 KiB
  // The two-shot Lamport all_reduce: blocks for the lines of its longest block (2 MiB: blocks of
  // 512 KiB, 65536 lines, 1024 per 512-thread block) and the header block.
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 4, 2 << 20, t), 65);
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 4, (256 << 10) + 4, t), 9 + 1);
  // Staged, one round: a block per 16 KiB piece of the longest pair (4 MiB all_reduce: the
  // two-shot staged exchange's blocks of 1 MiB; up to 16 MiB, blocks of one 4 MiB round).
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 4, 4 << 20, t), 64);
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 4, 16 << 20, t), 64);
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 4, 32 << 20, t), 128);
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 4, 2 << 20, off_tuning(t)), 32);
  EXPECT_EQ(collectiveSms(OpKind::kAlltoall, 4, 4 << 20, t), 64);
  // More than one round: pushing and consuming blocks.
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 4, 1ull << 30, t), 128);
  // A forwarded broadcast never: its root pushes, the others consume (2 MiB in blocks of 699056
  // bytes, 43 pieces of 16 KiB).
  EXPECT_EQ(collectiveSms(OpKind::kBroadcast, 4, 1ull << 30, t), 64);
  EXPECT_EQ(collectiveSms(OpKind::kBroadcast, 4, 2 << 20, t), 43);
  EXPECT_EQ(collectiveSms(OpKind::kBroadcast, 4, 1 << 20, t), 64);  // one exchange: 1 MiB pairs
  // 2 ranks: one exchange at every size.
  const ExchangeTuning t2 = ExchangeTuning::fromEnv(2);
  EXPECT_EQ(collectiveSms(OpKind::kAllreduce, 2, 2 << 20, t2), 64);
  // What one launch holds, as the launch describes it.
  const Exchange x = exchangeAllgather(4, 1, 40 << 20);
  EXPECT_EQ(exchangeSms(x, t), exchangeBlocksWithWork(x, t) * 2);
  EXPECT_THROW(collectiveSms(OpKind::kSend, 4, 1 << 20, t), moelink::Error);
}

TEST(ExchangeLayout, FitsTheRoundsAndAligns) {
  auto l = ExchangeLayout::make(4, 8 << 20);
  EXPECT_EQ(l.data % 4096, 0u);
  EXPECT_EQ(l.lamport, l.data + 2ull * 4 * (8 << 20));
  EXPECT_EQ(l.lamport % 16, 0u);  // lines are 16-byte stores
  EXPECT_EQ(l.total, l.lamport + 2ull * 4 * kLamportSourceBytes);
  EXPECT_GE(l.flags, l.counter + 32);  // seq, done, failed, single_ok, any_ok (exchange_common.cuh)
  // four arrays of [2 halves][kExchangeMaxRanks][kExchangeMaxBlocks] words, apart, before the data
  const uint64_t words = 2ull * kExchangeMaxRanks * kExchangeMaxBlocks * 8;
  EXPECT_EQ(l.acks, l.flags + words);
  EXPECT_EQ(l.gather_flags, l.acks + words);
  EXPECT_EQ(l.gather_acks, l.gather_flags + words);
  EXPECT_LE(l.gather_acks + words, l.data);
  EXPECT_THROW(ExchangeLayout::make(kExchangeMaxRanks + 1, 1 << 20), moelink::Error);
}

TEST(ExchangeLamport, TakesSmallExchangesAndTheShortPairsOfStagedCopies) {
  ExchangeTuning t;
  t.lamport_bytes = 64 << 10;
  for (int n : {2, 4, 8}) {
    const uint64_t at = (64 << 10) / 4;  // float32 elements of a full pair
    EXPECT_TRUE(exchangeLamport(exchangeAllreduceOneShot(n, 1, at, DType::kFloat32, ReduceOp::kSum), t));
    EXPECT_FALSE(exchangeLamport(exchangeAllreduceOneShot(n, 1, at + 1, DType::kFloat32, ReduceOp::kSum), t));
    EXPECT_TRUE(exchangeLamport(exchangeAllgather(n, 0, 64 << 10), t));
    EXPECT_FALSE(exchangeLamport(exchangeAllgather(n, 0, (64 << 10) + 1), t));
    EXPECT_TRUE(exchangeLamport(exchangeBroadcast(n, n - 1, 64 << 10, 0), t));
    EXPECT_FALSE(exchangeLamport(exchangeBroadcast(n, 0, (64 << 10) + 1, 0), t));
    EXPECT_TRUE(exchangeLamport(exchangeReduceScatter(n, 0, at, DType::kFloat32, ReduceOp::kMax), t));
    EXPECT_FALSE(exchangeLamport(exchangeReduceScatter(n, 0, at + 1, DType::kFloat32, ReduceOp::kMax), t));
    EXPECT_TRUE(exchangeLamport(exchangeGather(n, 1, 100, 0), t));
    EXPECT_TRUE(exchangeLamport(exchangeScatter(n, 0, 100, 0), t));
    EXPECT_TRUE(exchangeLamport(exchangeReduce(n, 0, 100, DType::kInt8, ReduceOp::kBxor, 1), t));
    // an all-to-all whose pairs are all small: Lamport; one with a long pair: staged, its small
    // pairs as lines (so that a peer whose pairs are all small, on the Lamport kernel, meets it)
    std::vector<uint64_t> off(n, 0), bytes(n, 64);
    for (int q = 0; q < n; ++q) off[q] = 64ull * q;
    EXPECT_TRUE(exchangeLamport(exchangeAlltoall(n, 0, off, bytes, off, bytes), t));
    std::vector<uint64_t> big = bytes, big_off = off;
    big[1] = (64 << 10) + 1;
    for (int q = 2; q < n; ++q) big_off[q] = big_off[q - 1] + big[q - 1];
    auto mixed = exchangeAlltoall(n, 0, big_off, big, off, bytes);
    EXPECT_FALSE(exchangeLamport(mixed, t));
    EXPECT_EQ(exchangeLamportPairs(mixed, t), 64u << 10);
    EXPECT_EQ(exchangeLamportPairs(mixed, off_tuning(t)), 0u);
    // every staged copy exchange; no reduction (each rank meets its longest pair, so all take one
    // protocol) and no forwarding broadcast (every rank of it is on the staged kernel)
    EXPECT_EQ(exchangeLamportPairs(exchangeBroadcast(n, 0, (1 << 20) + 16, 0), t), 64u << 10);
    EXPECT_EQ(exchangeLamportPairs(exchangeBroadcastForward(std::max(n, 3), 0, (1 << 20) + 16, 0), t), 0u);
    EXPECT_FALSE(exchangeLamport(exchangeBroadcastForward(std::max(n, 3), 0, 64, 0), t));
    EXPECT_EQ(exchangeLamportPairs(exchangeAllreduceScatter(n, 0, 1 << 20, DType::kFloat32, ReduceOp::kSum), t), 0u);
    // a line carries 8 bytes: complex128 moves but does not reduce by lines
    EXPECT_TRUE(exchangeLamport(exchangeAllgather(n, 0, 1600), t));
    EXPECT_FALSE(exchangeLamport(exchangeAllreduceOneShot(n, 0, 100, DType::kComplex128, ReduceOp::kSum), t));
    EXPECT_TRUE(exchangeLamport(exchangeAllreduceOneShot(n, 0, 100, DType::kComplex64, ReduceOp::kSum), t));
    // empty ops too (their header lines still meet every peer)
    EXPECT_TRUE(exchangeLamport(exchangeAllreduceOneShot(n, 0, 0, DType::kFloat32, ReduceOp::kSum), t));
  }
  ExchangeTuning off = t;
  off.lamport_bytes = 0;
  EXPECT_FALSE(exchangeLamport(exchangeAllreduceOneShot(2, 0, 1, DType::kFloat32, ReduceOp::kSum), off));
  // the area holds kLamportMaxBytes per pair whatever the setting says
  ExchangeTuning big = t;
  big.lamport_bytes = UINT64_MAX;
  EXPECT_TRUE(exchangeLamport(exchangeAllgather(2, 0, kLamportMaxBytes), big));
  EXPECT_FALSE(exchangeLamport(exchangeAllgather(2, 0, kLamportMaxBytes + 1), big));
  // two lines per thread: 256-thread blocks up to the row's lamport_narrow_bytes (64 KiB),
  // 512-thread blocks above (256 in groups above 4 ranks)
  const ExchangeTuning t4 = ExchangeTuning::fromEnv(4), t8 = ExchangeTuning::fromEnv(8);
  const uint64_t narrow = t4.lamport_narrow_bytes;
  EXPECT_EQ(narrow, 64u << 10);
  EXPECT_EQ(lamportThreadsFor(exchangeAllgather(4, 0, 0), t4), 256);
  EXPECT_EQ(lamportBlocks(exchangeAllgather(4, 0, 0), t4), 1);
  EXPECT_EQ(lamportBlocks(exchangeAllgather(4, 0, 4096), t4), 1);
  EXPECT_EQ(lamportBlocks(exchangeAllgather(4, 0, 4097), t4), 2);
  EXPECT_EQ(lamportThreadsFor(exchangeAllgather(4, 0, narrow), t4), 256);
  EXPECT_EQ(lamportBlocks(exchangeAllgather(4, 0, narrow), t4), 16);
  EXPECT_EQ(lamportThreadsFor(exchangeAllgather(4, 0, narrow + 1), t4), 512);
  EXPECT_EQ(lamportBlocks(exchangeAllgather(4, 0, narrow + 1), t4), 9);
  EXPECT_EQ(lamportBlocks(exchangeAllgather(4, 0, kLamportMaxBytes), t4), 32);
  EXPECT_EQ(lamportThreadsFor(exchangeAllgather(8, 0, kLamportMaxBytes), t8), 256);
  EXPECT_EQ(lamportBlocks(exchangeAllgather(8, 0, kLamportMaxBytes), t8), 64);
  // never more than the kernel's bound, whatever the tuning says
  ExchangeTuning wide = t8;
  wide.lamport_threads = 512;
  EXPECT_EQ(lamportThreadsFor(exchangeAllgather(8, 0, kLamportMaxBytes), wide), 256);
  EXPECT_EQ(kLamportSourceBytes, (kLamportHeaderLines + 2 * kLamportGatherLine) * kLamportLineBytes);
  EXPECT_GE(kLamportGatherLine * 8, kLamportMaxBytes);
  EXPECT_GE(kLamportHeaderLines * 8, sizeof(ExchangeHeader));
}

TEST(ExchangeLamport, TwoShotAllreduceBetweenTheOneShotAndTheStagedTwoShot) {
  const ExchangeTuning t4 = ExchangeTuning::fromEnv(4), t2 = ExchangeTuning::fromEnv(2), t8 = ExchangeTuning::fromEnv(8);
  const uint64_t one = t4.lamport_bytes / 4, two = t4.lamport_two_shot_bytes / 4;  // float32 elements
  EXPECT_FALSE(allreduceTwoShotLamport(4, one, DType::kFloat32, t4));  // one Lamport exchange
  EXPECT_TRUE(allreduceTwoShotLamport(4, one + 1, DType::kFloat32, t4));
  EXPECT_TRUE(allreduceTwoShotLamport(4, two, DType::kFloat32, t4));
  EXPECT_FALSE(allreduceTwoShotLamport(4, two + 1, DType::kFloat32, t4));  // the staged two-shot
  EXPECT_FALSE(allreduceTwoShotLamport(4, two, DType::kComplex64, t4));  // 4 MiB
  EXPECT_TRUE(allreduceTwoShotLamport(4, two / 2, DType::kComplex64, t4));
  EXPECT_FALSE(allreduceTwoShotLamport(4, two / 4, DType::kComplex128, t4));  // a line carries 8 bytes
  EXPECT_TRUE(allreduceTwoShotLamport(4, 2 * two, DType::kBFloat16, t4));
  EXPECT_FALSE(allreduceTwoShotLamport(2, one + 1, DType::kFloat32, t2));  // 2 ranks: one exchange moves as much
  EXPECT_FALSE(allreduceTwoShotLamport(4, one + 1, DType::kFloat32, off_tuning(t4)));  // no Lamport at all
  EXPECT_TRUE(allreduceTwoShotLamport(8, t8.lamport_bytes / 4 + 1, DType::kFloat32, t8));
  // blocks within what a slot holds, whatever the setting says: 3 ranks, 2 MiB has blocks of 683 KiB
  EXPECT_FALSE(allreduceTwoShotLamport(3, two, DType::kFloat32, t4));
  ExchangeTuning wide = t4;
  wide.lamport_two_shot_bytes = UINT64_MAX;
  EXPECT_TRUE(allreduceTwoShotLamport(4, 4 * kLamportTwoShotBlockBytes / 4, DType::kFloat32, wide));
  EXPECT_FALSE(allreduceTwoShotLamport(4, 4 * kLamportTwoShotBlockBytes / 4 + 4, DType::kFloat32, wide));
  // always the Lamport kernel, its blocks over the longest block, whatever the pairs' setting
  const Exchange x = exchangeAllreduceTwoShot(4, 3, two, DType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(x.mode, ExchangeMode::kReduceGather);
  EXPECT_TRUE(exchangeLamport(x, off_tuning(t4)));
  EXPECT_EQ(lamportBlocks(x, t4), 64);
  EXPECT_EQ(exchangeLamportPairs(x, t4), 0u);
  // a plan the predicate refuses never reaches the kernel: the slots hold blocks of 512 KiB of 8-byte lines
  EXPECT_THROW(exchangeLamport(exchangeAllreduceTwoShot(4, 0, 2 * two, DType::kFloat32, ReduceOp::kSum), t4),
               moelink::Error);
  EXPECT_THROW(exchangeLamport(exchangeAllreduceTwoShot(4, 0, 64, DType::kComplex128, ReduceOp::kSum), t4),
               moelink::Error);
  // a rank on the staged two-shot kernel against one on the Lamport one, or on one exchange: the
  // modes differ
  auto mine = exchangeHeader(x, 0, t4);
  auto theirs = exchangeHeader(exchangeAllreduceTwoShotStaged(4, 0, two, DType::kFloat32, ReduceOp::kSum), 3, t4);
  mine.seq = theirs.seq = 5;
  EXPECT_EQ(describeMismatch(mine, theirs, 0),
            "allreduce #5: rank 0 ran the two-shot staged step where this rank ran the two-shot Lamport step "
            "(different MOELINK_CUDA_ONESHOT_BYTES or MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES?)");
  theirs = exchangeHeader(exchangeAllreduceOneShot(4, 0, two, DType::kFloat32, ReduceOp::kSum), 3, t4);
  theirs.seq = 5;
  EXPECT_NE(describeMismatch(mine, theirs, 0).find("rank 0 ran the reduce step where this rank ran the two-shot"),
            std::string::npos);
}

TEST(ExchangePlanAllreduce, TwoShotStagedAboveTheOneShotSizeOnTheStagedKernel) {
  const ExchangeTuning t4 = ExchangeTuning::fromEnv(4);
  // the staged kernel at every size, Lamport setting or not (its peers decide alike: the mode is in
  // the header)
  for (uint64_t count : {uint64_t{1}, uint64_t{1000}, uint64_t{1} << 20}) {
    const Exchange x = exchangeAllreduceTwoShotStaged(4, 2, count, DType::kFloat32, ReduceOp::kSum);
    EXPECT_EQ(x.mode, ExchangeMode::kReduceGatherStaged);
    EXPECT_FALSE(exchangeLamport(x, t4));
    EXPECT_EQ(exchangeLamportPairs(x, t4), 0u);
    // the pairs of the reduce-scatter half: block q of the buffer to rank q, this rank's block from each
    const auto blocks = allreduceBlocks(4, count, DType::kFloat32);
    for (int q = 0; q < 4; ++q) {
      EXPECT_EQ(x.send_off[q], blocks[q].first * 4);
      EXPECT_EQ(x.send_bytes[q], q == 2 ? 0 : (blocks[q].second - blocks[q].first) * 4);
      EXPECT_EQ(x.recv_bytes[q], q == 2 ? 0 : x.reduce_bytes);
    }
    EXPECT_EQ(x.reduce_bytes, (blocks[2].second - blocks[2].first) * 4);
  }
  // built over the active ranks, never restricted to them (its blocks are the ranks')
  EXPECT_THROW(restrictExchange(exchangeAllreduceTwoShotStaged(4, 0, 1 << 20, DType::kFloat32, ReduceOp::kSum),
                                {0, 1, 3}),
               moelink::Error);
  EXPECT_THROW(restrictExchange(exchangeAllreduceTwoShot(4, 0, 1 << 18, DType::kFloat32, ReduceOp::kSum), {0, 1, 3}),
               moelink::Error);
  EXPECT_TRUE(droppedRanges(exchangeAllreduceTwoShotStaged(4, 0, 1 << 20, DType::kFloat32, ReduceOp::kSum), {0, 1})
                  .empty());
}

TEST(ExchangeHeader, MismatchesReadLikeTheCpuPath) {
  ExchangeTuning t;
  auto mine = exchangeHeader(exchangeAllreduceOneShot(2, 0, 2048, DType::kFloat32, ReduceOp::kSum), 1, t);
  auto theirs = exchangeHeader(exchangeAllreduceOneShot(2, 1, 1024, DType::kFloat32, ReduceOp::kSum), 0, t);
  mine.seq = theirs.seq = 17;
  EXPECT_EQ(describeMismatch(mine, theirs, 1), "allreduce #17: rank 1 sent 4096 bytes, this rank expects 8192");
  auto same = exchangeHeader(exchangeAllreduceOneShot(2, 1, 2048, DType::kFloat32, ReduceOp::kSum), 0, t);
  same.seq = 17;
  EXPECT_EQ(describeMismatch(mine, same, 1), "");
  auto maxop = exchangeHeader(exchangeAllreduceOneShot(2, 1, 2048, DType::kFloat32, ReduceOp::kMax), 0, t);
  maxop.seq = 17;
  EXPECT_NE(describeMismatch(mine, maxop, 1).find("reduces with MAX, this rank with SUM"), std::string::npos);
  auto bc = exchangeHeader(exchangeBroadcast(2, 1, 8192, 1), 0, t);
  bc.seq = 17;
  EXPECT_NE(describeMismatch(mine, bc, 1).find("called broadcast"), std::string::npos);
  ExchangeTuning unsplit;
  unsplit.split = false;
  auto other = exchangeHeader(exchangeAllreduceOneShot(2, 1, 2048, DType::kFloat32, ReduceOp::kSum), 0, unsplit);
  other.seq = 17;
  EXPECT_NE(describeMismatch(mine, other, 1).find("MOELINK_CUDA_SPLIT=0, this rank 8388608, 64 and 1"),
            std::string::npos);
  ExchangeTuning lamport;
  lamport.lamport_bytes = 4096;
  auto other_lamport = exchangeHeader(exchangeAllreduceOneShot(2, 1, 2048, DType::kFloat32, ReduceOp::kSum), 0, lamport);
  other_lamport.seq = 17;
  EXPECT_NE(describeMismatch(mine, other_lamport, 1).find("MOELINK_CUDA_LAMPORT_BYTES=4096, this rank 0"),
            std::string::npos);
  ExchangeStatus s{};
  s.code = ExchangeStatus::kTimeout;
  s.peer = 1;
  s.seq = 17;
  s.mine = mine;
  EXPECT_NE(describeStatus(s, 5000).find("Timed out after 5000 ms waiting for rank 1"), std::string::npos);
}

TEST(ExchangeTuning, ReadsAndChecksTheEnvironment) {
  setenv("MOELINK_CUDA_BLOCKS", "65", 1);
  EXPECT_THROW(ExchangeTuning::fromEnv(), moelink::Error);
  setenv("MOELINK_CUDA_BLOCKS", "8", 1);
  setenv("MOELINK_CUDA_ROUND_BYTES", "1000", 1);
  EXPECT_THROW(ExchangeTuning::fromEnv(), moelink::Error);
  setenv("MOELINK_CUDA_ROUND_BYTES", "1048576", 1);
  setenv("MOELINK_CUDA_SPLIT", "2", 1);
  EXPECT_THROW(ExchangeTuning::fromEnv(), moelink::Error);
  setenv("MOELINK_CUDA_SPLIT", "0", 1);
  EXPECT_FALSE(ExchangeTuning::fromEnv().split);
  unsetenv("MOELINK_CUDA_SPLIT");
  auto t = ExchangeTuning::fromEnv(4);
  EXPECT_TRUE(t.split);
  EXPECT_EQ(t.blocks, 8);
  EXPECT_EQ(t.round_bytes, 1048576u);
  EXPECT_FALSE(t.oneShot(4, 2ull << 20));
  EXPECT_TRUE(ExchangeTuning::fromEnv(2).oneShot(2, 4ull << 20));  // the 2-rank row
  EXPECT_FALSE(ExchangeTuning::fromEnv(2).oneShot(2, (4ull << 20) + 1));
  setenv("MOELINK_CUDA_ONESHOT_BYTES", "8388608", 1);
  EXPECT_TRUE(ExchangeTuning::fromEnv(4).oneShot(4, 8ull << 20));
  EXPECT_TRUE(ExchangeTuning::fromEnv(2).oneShot(2, 8ull << 20));  // a set variable holds for 2 ranks too
  EXPECT_FALSE(ExchangeTuning::fromEnv(2).oneShot(2, (8ull << 20) + 1));
  unsetenv("MOELINK_CUDA_ONESHOT_BYTES");
  unsetenv("MOELINK_CUDA_BLOCKS");
  unsetenv("MOELINK_CUDA_ROUND_BYTES");
  // the Lamport thresholds: per group size unless set, 0 turns them off, at most what the area holds
  const auto limited = [](const char* name, uint64_t ExchangeDefaults::*row, uint64_t ExchangeTuning::*field,
                          const char* over) {
    for (int n : {2, 4, 8}) EXPECT_EQ(ExchangeTuning::fromEnv(n).*field, exchangeDefaults(n).*row) << name << " " << n;
    setenv(name, "0", 1);
    EXPECT_EQ(ExchangeTuning::fromEnv(4).*field, 0u) << name;
    setenv(name, over, 1);
    EXPECT_THROW(ExchangeTuning::fromEnv(4), moelink::Error) << name;
    unsetenv(name);
  };
  limited("MOELINK_CUDA_LAMPORT_BYTES", &ExchangeDefaults::lamport_bytes, &ExchangeTuning::lamport_bytes, "262145");
  limited("MOELINK_CUDA_LAMPORT_TWO_SHOT_BYTES", &ExchangeDefaults::lamport_two_shot_bytes,
          &ExchangeTuning::lamport_two_shot_bytes, "4194305");
}

TEST(ExchangeTuning, EveryGroupSizeHasARowOfDefaultsThatTheSettingsAllow) {
  for (int n = 1; n <= kExchangeMaxRanks; ++n) {
    const ExchangeDefaults& d = exchangeDefaults(n);
    EXPECT_GE(d.up_to, n);
    EXPECT_LE(d.lamport_bytes, kLamportMaxBytes);
    EXPECT_GE(d.blocks, 1);
    EXPECT_LE(d.blocks, kExchangeMaxBlocks);
    EXPECT_EQ(d.round_bytes % 16, 0u);
    EXPECT_GE(d.round_bytes, 64u << 10);
    // Unset, the tuning is the row.
    const ExchangeTuning t = ExchangeTuning::fromEnv(n);
    EXPECT_EQ(t.lamport_bytes, d.lamport_bytes);
    EXPECT_EQ(t.lamport_two_shot_bytes, d.lamport_two_shot_bytes);
    // where the row takes the two-shot Lamport all_reduce, the first size above the one-shot
    // Lamport exchange takes it at every group size of the row but 2 ranks
    if (d.lamport_two_shot_bytes && n > 2) {
      EXPECT_TRUE(allreduceTwoShotLamport(n, d.lamport_bytes / 4 + 1, DType::kFloat32, t)) << n;
    }
    EXPECT_EQ(t.blocks, d.blocks);
    EXPECT_EQ(t.round_bytes, d.round_bytes);
    EXPECT_EQ(t.one_shot_bytes, d.one_shot_bytes);
    EXPECT_EQ(t.lamport_narrow_bytes, d.lamport_narrow_bytes);
    EXPECT_EQ(t.lamport_threads, d.lamport_threads);
    // whole warps, enough threads for every peer's header lines, within the kernel's bound
    EXPECT_EQ(d.lamport_threads % 32, 0);
    EXPECT_GE(d.lamport_threads, static_cast<int>(d.up_to * kLamportHeaderLines));
    EXPECT_LE(d.lamport_threads, lamportThreads(d.up_to));
    EXPECT_LE(kLamportNarrowThreads, lamportThreads(d.up_to));
    EXPECT_GE(kLamportNarrowThreads, static_cast<int>(d.up_to * kLamportHeaderLines));
  }
  // The rows measured so far, and the larger groups' row, which no machine has measured.
  EXPECT_EQ(exchangeDefaults(2).lamport_bytes, 256u << 10);
  EXPECT_EQ(exchangeDefaults(4).lamport_bytes, 256u << 10);
  EXPECT_EQ(exchangeDefaults(4).one_shot_bytes, 1u << 20);
  EXPECT_EQ(exchangeDefaults(2).lamport_two_shot_bytes, 0u);
  EXPECT_EQ(exchangeDefaults(4).lamport_two_shot_bytes, 2u << 20);
  EXPECT_NE(std::string(exchangeDefaults(4).measured), "");
  EXPECT_EQ(exchangeDefaults(5).lamport_bytes, 64u << 10);
  EXPECT_EQ(std::string(exchangeDefaults(8).measured), "");
  EXPECT_THROW(exchangeDefaults(0), moelink::Error);
  EXPECT_THROW(exchangeDefaults(kExchangeMaxRanks + 1), moelink::Error);
}

}  // namespace
