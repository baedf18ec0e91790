// Builds WQEs on the GPU (ibgda_wqe_gpu.cu) for ibgda_wqe_test.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

struct WqeCase {
  uint64_t raddr, laddr;
  uint32_t qpn, rkey, lkey, length, imm;
  uint16_t pi;
  uint8_t opcode, opmod, fm_ce_se, ds, signature;
  bool signal;
};

// Two 64-byte blocks per case into `out`; returns "" or why it could not run (no GPU).
std::string buildWqesOnGpu(const std::vector<WqeCase>& cases, std::vector<unsigned char>& out);
