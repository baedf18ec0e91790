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
  bool signal, fence;
  uint64_t value;  // for the inline WRITE
};

// Two 64-byte blocks per case into `out` (an RDMA WRITE, a control segment) and one into
// `inline_out` (an inline 8-byte WRITE); returns "" or why it could not run (no GPU).
std::string buildWqesOnGpu(const std::vector<WqeCase>& cases, std::vector<unsigned char>& out,
                           std::vector<unsigned char>& inline_out);

// The IBGDA queue protocol driven by GPU threads (ibgda_queue_test.cpp plays the NIC). The
// queues, doorbell records, doorbell word and payload live in mapped host memory (the same
// addresses on the host and the GPU); the ticket counters in GPU memory.
struct GpuQueueRun {
  unsigned char* wqes = nullptr;
  unsigned char* cqes = nullptr;
  uint32_t* sq_dbr = nullptr;
  uint32_t* cq_dbr = nullptr;
  uint64_t* doorbell = nullptr;
  unsigned char* src = nullptr;
  unsigned char* dst = nullptr;
  uint64_t* flags = nullptr;  // one per poster thread, written by its inline WRITE
  size_t bytes = 0;
  uint32_t sq_depth = 0, cq_depth = 0;
  void* counters = nullptr;  // GPU: tickets, ready, completed, errors
  uint64_t total = 0;        // WQEs posted (set by gpuQueueRun)
  uint64_t completed = 0;    // what the GPU's poller saw completed
  int errors = 0;            // error completions, plus 1000 if the poller gave up
};

// "" or why not (no GPU).
std::string gpuQueueAlloc(GpuQueueRun& r, uint32_t sq_depth, uint32_t cq_depth, size_t bytes);
// blocks x threads GPU threads each post per_thread WRITEs of wqe_bytes (src -> dst), then an
// inline WRITE of 0x5eed << 48 | thread into flags[thread] (fenced; all signaled), while one
// more block's thread polls; returns when the kernel has finished. `total` counts every WQE.
std::string gpuQueueRun(GpuQueueRun& r, int blocks, int threads, int per_thread, uint32_t wqe_bytes, uint32_t qpn,
                        uint32_t lkey, uint32_t rkey);
// The same through one QueuePair (postQp / postInlineQp): no poller, the posters poll the
// completion queue themselves; every (signal_mask + 1)-th WQE signaled. `errors`: posts
// dropped, plus 1000 if the queue pair saw an error completion; `completed` is what the
// posters' polls saw (the unsignaled tail is not counted).
std::string gpuQueuePairRun(GpuQueueRun& r, int blocks, int threads, int per_thread, uint32_t wqe_bytes, uint32_t qpn,
                            uint32_t lkey, uint32_t rkey, uint32_t signal_mask);
void gpuQueueFree(GpuQueueRun& r);
