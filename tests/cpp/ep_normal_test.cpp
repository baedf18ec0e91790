// Host-side sizing of the normal-mode kernels (include/moelink/ep/normal_kernels.h): the bulk-copy
// sender's pieces fit the shared memory the combine kernel asks for and tile a row exactly.
#include <gtest/gtest.h>

#include "moelink/ep/normal_kernels.h"

namespace normal = moelink::ep::normal;

TEST(EpNormal, BulkPiecesTileTheRowAndFitSharedMemory) {
  // Hopper's opt-in limit per block is 227 KiB; the kernel's static shared memory is ~2 KiB.
  constexpr int kLimit = (227 << 10) - (4 << 10);
  for (int ranks = 1; ranks <= normal::kMaxRanks; ++ranks)
    for (int x_bytes : {16, 48, 256, 512, 4096, 7168 * 2, 16384, 4096 * 2 + 16, 65536, 7168 * 8}) {
      SCOPED_TRACE(::testing::Message() << ranks << " ranks, rows of " << x_bytes << " bytes");
      const int piece = normal::bulkPieceBytes(ranks, x_bytes);
      ASSERT_GE(piece, 16);
      EXPECT_EQ(piece % 16, 0);
      EXPECT_LE(piece, x_bytes);
      const int pieces = (x_bytes + piece - 1) / piece;
      // Equal pieces: the last one is not a sliver (at most one 16-byte unit per piece shorter).
      EXPECT_GE(x_bytes - (pieces - 1) * piece, piece - 16 * pieces);
      EXPECT_LE(ranks * normal::kBulkStages * piece, kLimit);
    }
  // A 7168-hidden bf16 row: whole at 2 ranks, in halves at 4, in quarters at 8.
  EXPECT_EQ(normal::bulkPieceBytes(2, 14336), 14336);
  EXPECT_EQ(normal::bulkPieceBytes(4, 14336), 7168);
  EXPECT_EQ(normal::bulkPieceBytes(8, 14336), 3584);
}
