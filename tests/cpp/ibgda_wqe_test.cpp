// The IBGDA WQE encoders produce the same bytes as rdma-core's own mlx5dv.h definitions:
// the host instantiation of the __host__ __device__ code here, and (when built with CUDA
// and a GPU is present) the GPU instantiation, run by GPU threads in ibgda_wqe_gpu.cu.
#include <infiniband/mlx5dv.h>

#include <cstring>
#include <random>

#include <gtest/gtest.h>

#include "moelink/ep/ibgda/wqe.h"

using namespace moelink::ep::ibgda;

static_assert(sizeof(CtrlSeg) == sizeof(mlx5_wqe_ctrl_seg), "ctrl segment size");
static_assert(sizeof(RaddrSeg) == sizeof(mlx5_wqe_raddr_seg), "raddr segment size");
static_assert(sizeof(DataSeg) == sizeof(mlx5_wqe_data_seg), "data segment size");
static_assert(kOpcodeRdmaWrite == MLX5_OPCODE_RDMA_WRITE && kOpcodeRdmaWriteImm == MLX5_OPCODE_RDMA_WRITE_IMM &&
                  kOpcodeNop == MLX5_OPCODE_NOP,
              "opcodes");
static_assert(kCqUpdate == MLX5_WQE_CTRL_CQ_UPDATE && kFence == MLX5_WQE_CTRL_FENCE, "control flags");
static_assert(kInlineSeg == MLX5_INLINE_SEG && sizeof(mlx5_wqe_inl_data_seg) == 4, "inline segment");

namespace {

// An inline 8-byte RDMA WRITE as rdma-core's definitions compose it (the provider's own
// inline sizing: ds counts 16-byte units of ctrl + raddr + align(header + data, 16)).
void inlineWriteWant(unsigned char* want, uint16_t pi, uint32_t qpn, bool signal, bool fence, uint64_t raddr,
                     uint32_t rkey, uint64_t value) {
  const int inl = (sizeof(mlx5_wqe_inl_data_seg) + 8 + 15) / 16;
  mlx5dv_set_ctrl_seg(reinterpret_cast<mlx5_wqe_ctrl_seg*>(want), pi, MLX5_OPCODE_RDMA_WRITE, 0, qpn,
                      (signal ? MLX5_WQE_CTRL_CQ_UPDATE : 0) | (fence ? MLX5_WQE_CTRL_FENCE : 0), 2 + inl, 0, 0);
  auto* r = reinterpret_cast<mlx5_wqe_raddr_seg*>(want + 16);
  r->raddr = htobe64(raddr);
  r->rkey = htobe32(rkey);
  auto* seg = reinterpret_cast<mlx5_wqe_inl_data_seg*>(want + 32);
  seg->byte_count = htobe32(8 | MLX5_INLINE_SEG);
  std::memcpy(seg + 1, &value, 8);
}

}  // namespace

TEST(IbgdaWqe, SegmentsMatchRdmaCore) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 10000; ++i) {
    uint16_t pi = static_cast<uint16_t>(rng());
    uint8_t opcode = static_cast<uint8_t>(rng()), opmod = static_cast<uint8_t>(rng());
    uint32_t qpn = static_cast<uint32_t>(rng()) & 0xffffff, imm = static_cast<uint32_t>(rng());
    uint8_t fm = static_cast<uint8_t>(rng()), ds = static_cast<uint8_t>(rng() & 0x3f), sig = static_cast<uint8_t>(rng());
    mlx5_wqe_ctrl_seg want{};
    CtrlSeg got{};
    mlx5dv_set_ctrl_seg(&want, pi, opcode, opmod, qpn, fm, ds, sig, imm);
    setCtrlSeg(&got, pi, opcode, opmod, qpn, fm, ds, sig, imm);
    ASSERT_EQ(0, std::memcmp(&want, &got, sizeof want)) << "ctrl segment, case " << i;

    uint32_t len = static_cast<uint32_t>(rng()), lkey = static_cast<uint32_t>(rng());
    uint64_t addr = rng();
    mlx5_wqe_data_seg dwant{};
    DataSeg dgot{};
    mlx5dv_set_data_seg(&dwant, len, lkey, addr);
    setDataSeg(&dgot, len, lkey, addr);
    ASSERT_EQ(0, std::memcmp(&dwant, &dgot, sizeof dwant)) << "data segment, case " << i;

    uint64_t raddr = rng();
    uint32_t rkey = static_cast<uint32_t>(rng());
    mlx5_wqe_raddr_seg rwant{};
    rwant.raddr = htobe64(raddr);
    rwant.rkey = htobe32(rkey);
    RaddrSeg rgot{};
    setRaddrSeg(&rgot, raddr, rkey);
    ASSERT_EQ(0, std::memcmp(&rwant, &rgot, sizeof rwant)) << "raddr segment, case " << i;
  }
}

TEST(IbgdaWqe, RdmaWriteWqeMatchesRdmaCoreComposition) {
  alignas(64) unsigned char want[64] = {0}, got[64] = {0};
  auto* ctrl = reinterpret_cast<mlx5_wqe_ctrl_seg*>(want);
  mlx5dv_set_ctrl_seg(ctrl, 0x1234, MLX5_OPCODE_RDMA_WRITE, 0, 0xabcde, MLX5_WQE_CTRL_CQ_UPDATE, 3, 0, 0);
  auto* raddr = reinterpret_cast<mlx5_wqe_raddr_seg*>(want + 16);
  raddr->raddr = htobe64(0x7f00deadbeef0000ull);
  raddr->rkey = htobe32(0x11223344);
  mlx5dv_set_data_seg(reinterpret_cast<mlx5_wqe_data_seg*>(want + 32), 7392, 0x55667788, 0x7f1122334455ull);
  buildRdmaWrite(got, 0x1234, 0xabcde, true, 0x7f00deadbeef0000ull, 0x11223344, 0x7f1122334455ull, 0x55667788, 7392);
  EXPECT_EQ(0, std::memcmp(want, got, sizeof want));
}

TEST(IbgdaWqe, InlineWriteMatchesRdmaCoreComposition) {
  std::mt19937_64 rng(13);
  for (int i = 0; i < 1000; ++i) {
    const uint16_t pi = static_cast<uint16_t>(rng());
    const uint32_t qpn = static_cast<uint32_t>(rng()) & 0xffffff, rkey = static_cast<uint32_t>(rng());
    const uint64_t raddr = rng(), value = rng();
    const bool signal = rng() & 1, fence = rng() & 1;
    alignas(64) unsigned char want[64] = {0}, got[64];
    std::memset(got, 0xee, sizeof got);  // the encoder must write every byte of the 48
    inlineWriteWant(want, pi, qpn, signal, fence, raddr, rkey, value);
    buildRdmaWriteInline8(got, pi, qpn, signal, fence, raddr, rkey, value);
    ASSERT_EQ(0, std::memcmp(want, got, 48)) << "case " << i;
  }
}

#if defined(MOELINK_TEST_GPU_WQE)
#include "ibgda_wqe_gpu.h"

// The bytes GPU threads build equal rdma-core's, composed on the host.
TEST(IbgdaWqe, GpuBuiltWqesMatchRdmaCore) {
  std::mt19937_64 rng(11);
  std::vector<WqeCase> cases(4096);
  for (auto& c : cases) {
    c.raddr = rng();
    c.laddr = rng();
    c.qpn = static_cast<uint32_t>(rng()) & 0xffffff;
    c.rkey = static_cast<uint32_t>(rng());
    c.lkey = static_cast<uint32_t>(rng());
    c.length = static_cast<uint32_t>(rng());
    c.imm = static_cast<uint32_t>(rng());
    c.pi = static_cast<uint16_t>(rng());
    c.opcode = static_cast<uint8_t>(rng());
    c.opmod = static_cast<uint8_t>(rng());
    c.fm_ce_se = static_cast<uint8_t>(rng());
    c.ds = static_cast<uint8_t>(rng() & 0x3f);
    c.signature = static_cast<uint8_t>(rng());
    c.signal = rng() & 1;
    c.fence = rng() & 1;
    c.value = rng();
  }
  std::vector<unsigned char> got, inline_got;
  std::string why = buildWqesOnGpu(cases, got, inline_got);
  if (!why.empty()) GTEST_SKIP() << why;
  for (size_t i = 0; i < cases.size(); ++i) {
    const WqeCase& c = cases[i];
    alignas(64) unsigned char want[128] = {0};
    mlx5dv_set_ctrl_seg(reinterpret_cast<mlx5_wqe_ctrl_seg*>(want), c.pi, MLX5_OPCODE_RDMA_WRITE, 0, c.qpn,
                        c.signal ? MLX5_WQE_CTRL_CQ_UPDATE : 0, 3, 0, 0);
    auto* raddr = reinterpret_cast<mlx5_wqe_raddr_seg*>(want + 16);
    raddr->raddr = htobe64(c.raddr);
    raddr->rkey = htobe32(c.rkey);
    mlx5dv_set_data_seg(reinterpret_cast<mlx5_wqe_data_seg*>(want + 32), c.length, c.lkey, c.laddr);
    mlx5dv_set_ctrl_seg(reinterpret_cast<mlx5_wqe_ctrl_seg*>(want + 64), c.pi, c.opcode, c.opmod, c.qpn, c.fm_ce_se,
                        c.ds, c.signature, c.imm);
    ASSERT_EQ(0, std::memcmp(want, got.data() + i * 128, 48)) << "RDMA WRITE WQE, case " << i;
    ASSERT_EQ(0, std::memcmp(want + 64, got.data() + i * 128 + 64, 16)) << "control segment, case " << i;
    alignas(64) unsigned char inl[64] = {0};
    inlineWriteWant(inl, c.pi, c.qpn, c.signal, c.fence, c.raddr, c.rkey, c.value);
    ASSERT_EQ(0, std::memcmp(inl, inline_got.data() + i * 64, 48)) << "inline WRITE WQE, case " << i;
  }
}
#endif

TEST(IbgdaWqe, NopMatchesRdmaCore) {
  for (bool signal : {false, true}) {
    alignas(64) unsigned char want[64] = {0}, got[64] = {0};
    mlx5dv_set_ctrl_seg(reinterpret_cast<mlx5_wqe_ctrl_seg*>(want), 0xfedc, MLX5_OPCODE_NOP, 0, 0x12345,
                        signal ? MLX5_WQE_CTRL_CQ_UPDATE : 0, 1, 0, 0);
    buildNop(got, 0xfedc, 0x12345, signal);
    EXPECT_EQ(0, std::memcmp(want, got, sizeof want)) << "signal " << signal;
  }
}
