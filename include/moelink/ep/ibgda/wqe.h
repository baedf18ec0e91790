// mlx5 work-queue entries as a GPU thread builds them for IBGDA (GPU-initiated RDMA).
//
// queue.h posts these WQEs and polls completions; nic.h gives the queues (rdma-core's mlx5
// provider through the plugin, or the emulated NIC; docs/EP.md). These functions
// are __host__ __device__: the same code runs on the host and in GPU threads, and
// tests/cpp/ibgda_wqe_test.cpp compares both with rdma-core's own mlx5dv.h definitions
// (mlx5dv_set_ctrl_seg, mlx5dv_set_data_seg, struct mlx5_wqe_raddr_seg, struct
// mlx5_wqe_inl_data_seg). All multi-byte fields are big-endian on the wire.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOELINK_HD __host__ __device__ __forceinline__
#else
#define MOELINK_HD inline
#endif

namespace moelink::ep::ibgda {

constexpr uint8_t kOpcodeNop = 0x00;           // MLX5_OPCODE_NOP
constexpr uint8_t kOpcodeRdmaWrite = 0x08;     // MLX5_OPCODE_RDMA_WRITE
constexpr uint8_t kOpcodeRdmaWriteImm = 0x09;  // MLX5_OPCODE_RDMA_WRITE_IMM
constexpr uint8_t kCqUpdate = 2 << 2;          // MLX5_WQE_CTRL_CQ_UPDATE: signal a completion
constexpr uint8_t kFence = 4 << 5;             // MLX5_WQE_CTRL_FENCE: start after the earlier WQEs completed
constexpr uint32_t kInlineSeg = 0x80000000u;   // MLX5_INLINE_SEG: the data follows in the WQE
constexpr int kSegmentBytes = 16;              // the "ds" unit
constexpr int kBasicBlockBytes = 64;           // a WQEBB

struct __attribute__((packed, aligned(4))) CtrlSeg {
  uint32_t opmod_idx_opcode;
  uint32_t qpn_ds;
  uint8_t signature;
  uint16_t dci_stream_channel_id;
  uint8_t fm_ce_se;
  uint32_t imm;
};

struct RaddrSeg {
  uint64_t raddr;
  uint32_t rkey;
  uint32_t reserved;
};

struct DataSeg {
  uint32_t byte_count;
  uint32_t lkey;
  uint64_t addr;
};

static_assert(sizeof(CtrlSeg) == kSegmentBytes && sizeof(RaddrSeg) == kSegmentBytes &&
                  sizeof(DataSeg) == kSegmentBytes,
              "mlx5 segments are 16 bytes");

MOELINK_HD uint32_t toBig32(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(v, 0, 0x0123);
#else
  return __builtin_bswap32(v);
#endif
}

MOELINK_HD uint64_t toBig64(uint64_t v) {
  return (static_cast<uint64_t>(toBig32(static_cast<uint32_t>(v))) << 32) | toBig32(static_cast<uint32_t>(v >> 32));
}

// As mlx5dv_set_ctrl_seg: `pi` is the WQE index, `ds` the WQE size in 16-byte segments;
// `imm` is stored as given (already big-endian where the opcode needs it).
MOELINK_HD void setCtrlSeg(CtrlSeg* s, uint16_t pi, uint8_t opcode, uint8_t opmod, uint32_t qpn,
                           uint8_t fm_ce_se, uint8_t ds, uint8_t signature, uint32_t imm) {
  s->opmod_idx_opcode = toBig32((static_cast<uint32_t>(opmod) << 24) | (static_cast<uint32_t>(pi) << 8) | opcode);
  s->qpn_ds = toBig32((qpn << 8) | ds);
  s->signature = signature;
  s->fm_ce_se = fm_ce_se;
  s->imm = imm;
}

MOELINK_HD void setRaddrSeg(RaddrSeg* s, uint64_t raddr, uint32_t rkey) {
  s->raddr = toBig64(raddr);
  s->rkey = toBig32(rkey);
  s->reserved = 0;
}

// As mlx5dv_set_data_seg.
MOELINK_HD void setDataSeg(DataSeg* s, uint32_t length, uint32_t lkey, uint64_t addr) {
  s->byte_count = toBig32(length);
  s->lkey = toBig32(lkey);
  s->addr = toBig64(addr);
}

// One RDMA WRITE of `length` bytes from (laddr, lkey) to (raddr, rkey): control, remote
// address and one data segment (ds = 3) in the first 48 bytes of a 64-byte basic block.
MOELINK_HD void buildRdmaWrite(void* wqe, uint16_t pi, uint32_t qpn, bool signal, uint64_t raddr, uint32_t rkey,
                               uint64_t laddr, uint32_t lkey, uint32_t length) {
  auto* base = static_cast<char*>(wqe);
  CtrlSeg* ctrl = reinterpret_cast<CtrlSeg*>(base);
  ctrl->dci_stream_channel_id = 0;
  setCtrlSeg(ctrl, pi, kOpcodeRdmaWrite, 0, qpn, signal ? kCqUpdate : 0, 3, 0, 0);
  setRaddrSeg(reinterpret_cast<RaddrSeg*>(base + kSegmentBytes), raddr, rkey);
  setDataSeg(reinterpret_cast<DataSeg*>(base + 2 * kSegmentBytes), length, lkey, laddr);
}

// One RDMA WRITE of an 8-byte value carried inline (a count or a flag): control, remote
// address, the inline header (byte count | MLX5_INLINE_SEG) and the value's bytes as they
// are in memory here, padded to ds = 3. With `fence` the NIC starts it only after every
// earlier WQE of the queue has completed, so that the signal lands after the data it covers.
MOELINK_HD void buildRdmaWriteInline8(void* wqe, uint16_t pi, uint32_t qpn, bool signal, bool fence, uint64_t raddr,
                                      uint32_t rkey, uint64_t value) {
  auto* base = static_cast<char*>(wqe);
  CtrlSeg* ctrl = reinterpret_cast<CtrlSeg*>(base);
  ctrl->dci_stream_channel_id = 0;
  const uint8_t flags = static_cast<uint8_t>((signal ? kCqUpdate : 0) | (fence ? kFence : 0));
  setCtrlSeg(ctrl, pi, kOpcodeRdmaWrite, 0, qpn, flags, 3, 0, 0);
  setRaddrSeg(reinterpret_cast<RaddrSeg*>(base + kSegmentBytes), raddr, rkey);
  // 4-byte stores: the value sits at offset 36, not 8-byte aligned.
  auto* words = reinterpret_cast<uint32_t*>(base + 2 * kSegmentBytes);
  words[0] = toBig32(kInlineSeg | 8u);
  words[1] = static_cast<uint32_t>(value);
  words[2] = static_cast<uint32_t>(value >> 32);
  words[3] = 0;
}

// A NOP: the control segment alone (ds = 1). Signaled, its completion tells that every WQE
// before it on the queue has completed (an RC send queue completes in order).
MOELINK_HD void buildNop(void* wqe, uint16_t pi, uint32_t qpn, bool signal) {
  CtrlSeg* ctrl = static_cast<CtrlSeg*>(wqe);
  ctrl->dci_stream_channel_id = 0;
  setCtrlSeg(ctrl, pi, kOpcodeNop, 0, qpn, signal ? kCqUpdate : 0, 1, 0, 0);
}

}  // namespace moelink::ep::ibgda
