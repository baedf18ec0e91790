// Host-side sizing of the normal-mode kernels (include/moelink/ep/normal_kernels.h): the bulk-copy
// sender's pieces fit the shared memory the combine kernel asks for and tile a row exactly.
#include <gtest/gtest.h>

#include "moelink/ep/normal_kernels.h"

namespace normal = moelink::ep::normal;

TEST(EpNormal, BulkPiecesTileTheRowAndFitSharedMemory) {
  // Hopper's opt-in limit per block is 227 KiB; the kernel's static shared memory is ~2 KiB.
  constexpr int kLimit = (227 << 10) - (4 << 10);
  for (int ranks = 1; ranks <= normal::kMaxRanks; ++ranks) {
    const int per_dest = normal::bulkWarps(ranks);
    ASSERT_GE(per_dest, 1);
    ASSERT_LE(per_dest, normal::kBulkWarpsPerDest);
    ASSERT_LE(ranks * per_dest, normal::kWarps) << ranks << " ranks";  // every destination has its warps
    const int warps = ranks * per_dest;
    for (int x_bytes : {16, 48, 256, 512, 4096, 7168 * 2, 16384, 4096 * 2 + 16, 65536, 7168 * 8}) {
      SCOPED_TRACE(::testing::Message() << ranks << " ranks, rows of " << x_bytes << " bytes");
      const int piece = normal::bulkPieceBytes(warps, x_bytes);
      ASSERT_GE(piece, 16);
      EXPECT_EQ(piece % 16, 0);
      EXPECT_LE(piece, x_bytes);
      const int pieces = (x_bytes + piece - 1) / piece;
      // Equal pieces: the last one is not a sliver (at most one 16-byte unit per piece shorter).
      EXPECT_GE(x_bytes - (pieces - 1) * piece, piece - 16 * pieces);
      EXPECT_LE(warps * normal::kBulkStages * piece, kLimit);
    }
  }
  // Four warps per destination up to 6 ranks, then as many as 24 warps allow.
  EXPECT_EQ(normal::bulkWarps(2), 4);
  EXPECT_EQ(normal::bulkWarps(4), 4);
  EXPECT_EQ(normal::bulkWarps(8), 3);
  // A 7168-hidden bf16 row at 4 ranks (16 warps): 7 pieces of 2 KiB.
  EXPECT_EQ(normal::bulkPieceBytes(16, 14336), 2048);
  EXPECT_EQ(normal::bulkPieceBytes(24, 14336), 1312);  // 11 pieces, the last shorter
}
