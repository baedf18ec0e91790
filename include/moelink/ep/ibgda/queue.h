// The producer and consumer sides of an mlx5 send queue and completion queue, as GPU threads
// drive them for IBGDA: posting RDMA WRITE WQEs, publishing them through the doorbell record
// and the doorbell register, and polling completions.
//
// Like wqe.h these are __host__ __device__: the tests drive them from host threads, and from
// GPU threads with the queues in mapped host memory, against an emulated NIC that reads the
// queues with rdma-core's own structure definitions (tests/cpp/ibgda_queue_test.cpp). The EP
// kernels post through QueuePair (postQp / postInlineQp), whose queues come from the NIC
// (src/ep/ibgda/: rdma-core's mlx5 provider, or the emulated NIC).
//
// Protocol:
// - post(): a thread takes a ticket (its WQE index), waits until the slot is free (fewer than
//   `depth` WQEs outstanding, as `completed` says), writes the 64-byte WQE, and waits for its turn
//   (`ready` == ticket), since the doorbell record must only ever cover fully written WQEs. It then
//   makes the WQE visible (system-scope fence: the NIC reads it over PCIe), writes the send counter
//   (ticket + 1, big-endian, low 16 bits) into the doorbell record, fences again, writes the WQE's
//   first 8 bytes to the doorbell register, and passes the turn on.
// - poll(): the owner of the completion queue reads the CQE at the consumer index; it is new when
//   its opcode is not INVALID and its owner bit equals the index's pass parity. A requester CQE's
//   wqe_counter names the last WQE it completes (a signaled WQE completes every WQE before it), so
//   `completed` advances to it + 1; the consumer index goes to the doorbell record (24 bits).
#pragma once

#include <chrono>
#include <cstdint>
#if !defined(__CUDACC__)
#include <sched.h>
#endif
#if defined(__CUDACC__)
#include <cuda_runtime.h>
#endif

#include "moelink/ep/ibgda/wqe.h"

namespace moelink::ep::ibgda {

constexpr uint8_t kCqeReq = 0x0;       // MLX5_CQE_REQ
constexpr uint8_t kCqeReqErr = 0xd;    // MLX5_CQE_REQ_ERR
constexpr uint8_t kCqeInvalid = 0xf;   // MLX5_CQE_INVALID
constexpr int kCqeBytes = 64;
constexpr int kCqeWqeCounterOffset = 60;  // struct mlx5_cqe64: __be16 wqe_counter
constexpr int kCqeOpOwnOffset = 63;       // struct mlx5_cqe64: uint8_t op_own
constexpr int kSendDbr = 1;               // MLX5_SND_DBR: the send counter's word in the doorbell record
constexpr int kCqSetCi = 0;               // the CQ doorbell record's consumer-index word

// Memory-order shims: the same source on the GPU (PTX, system scope: the NIC is a PCIe agent)
// and on the host (GCC atomics).
MOELINK_HD uint64_t atomicTicket(uint64_t* p) {
#if defined(__CUDA_ARCH__)
  return atomicAdd(reinterpret_cast<unsigned long long*>(p), 1ull);
#else
  return __atomic_fetch_add(p, 1, __ATOMIC_RELAXED);
#endif
}

MOELINK_HD uint64_t loadAcquire(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

MOELINK_HD void storeRelease(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

MOELINK_HD void fenceSystem() {
#if defined(__CUDA_ARCH__)
  __threadfence_system();
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

// In a spin loop: nothing on the GPU; on the host, let another thread run (the host threads
// that play GPU threads in the tests may outnumber the cores).
MOELINK_HD void spinPause() {
#if !defined(__CUDA_ARCH__) && !defined(__CUDACC__)
  sched_yield();
#endif
}

MOELINK_HD void storeVolatile32(uint32_t* p, uint32_t v) { *reinterpret_cast<volatile uint32_t*>(p) = v; }
MOELINK_HD void storeVolatile64(uint64_t* p, uint64_t v) { *reinterpret_cast<volatile uint64_t*>(p) = v; }

struct SendQueue {
  unsigned char* wqes = nullptr;  // depth * 64 bytes (one basic block per WQE)
  uint32_t depth = 0;             // a power of two
  uint32_t qpn = 0;
  uint32_t* dbr = nullptr;        // doorbell record: [kSendDbr] is the send counter
  uint64_t* doorbell = nullptr;   // the doorbell (BlueFlame) register, mapped
  uint64_t* tickets = nullptr;    // WQE indices handed out
  uint64_t* ready = nullptr;      // WQEs published, in order
  uint64_t* completed = nullptr;  // WQEs the NIC has completed (advanced by poll())
};

struct CompletionQueue {
  const unsigned char* cqes = nullptr;  // depth * 64 bytes
  uint32_t depth = 0;                   // a power of two
  uint32_t* dbr = nullptr;              // doorbell record: [kCqSetCi] is the consumer index
  uint64_t consumer = 0;                // owned by the one polling thread
};

// WQE idx's turn, in index order: with `ring`, the doorbell record and the doorbell tell the
// NIC of it; then the next WQE's turn comes.
MOELINK_HD void publish(const SendQueue& sq, uint64_t idx, const unsigned char* wqe, bool ring) {
  while (loadAcquire(sq.ready) != idx) spinPause();
  if (ring) {
    fenceSystem();  // the WQE before the doorbell record
    storeVolatile32(sq.dbr + kSendDbr, toBig32(static_cast<uint32_t>(idx + 1) & 0xffff));
    fenceSystem();  // the doorbell record before the doorbell
    storeVolatile64(sq.doorbell, *reinterpret_cast<const uint64_t*>(wqe));
  }
  storeRelease(sq.ready, idx + 1);
}

// Posts one WQE that `build(wqe, index)` writes into its 64-byte slot. Returns its index.
template <typename Build>
MOELINK_HD uint64_t postWqe(const SendQueue& sq, Build build) {
  const uint64_t idx = atomicTicket(sq.tickets);
  while (idx - loadAcquire(sq.completed) >= sq.depth) spinPause();  // the slot holds an uncompleted WQE
  unsigned char* wqe = sq.wqes + (idx & (sq.depth - 1)) * kBasicBlockBytes;
  build(wqe, idx);
  publish(sq, idx, wqe, true);
  return idx;
}

// Posts one RDMA WRITE of `length` bytes from (laddr, lkey) to (raddr, rkey); `signal` asks for
// a completion. Returns the WQE's index.
MOELINK_HD uint64_t post(const SendQueue& sq, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                         uint32_t length, bool signal) {
  return postWqe(sq, [&](unsigned char* wqe, uint64_t idx) {
    buildRdmaWrite(wqe, static_cast<uint16_t>(idx), sq.qpn, signal, raddr, rkey, laddr, lkey, length);
  });
}

// Posts an 8-byte WRITE of `value` carried in the WQE (a count or a flag), fenced behind the
// earlier WQEs when `fence` is set. Returns the WQE's index.
MOELINK_HD uint64_t postInline8(const SendQueue& sq, uint64_t raddr, uint32_t rkey, uint64_t value, bool signal,
                                bool fence) {
  return postWqe(sq, [&](unsigned char* wqe, uint64_t idx) {
    buildRdmaWriteInline8(wqe, static_cast<uint16_t>(idx), sq.qpn, signal, fence, raddr, rkey, value);
  });
}

// Polls one CQE. Returns 0 when none is new, 1 when one was consumed (`completed` advanced),
// -1 when it reports an error (its syndrome is left in the CQE).
MOELINK_HD int poll(CompletionQueue& cq, const SendQueue& sq) {
  const unsigned char* cqe = cq.cqes + (cq.consumer & (cq.depth - 1)) * kCqeBytes;
  const uint8_t op_own = *reinterpret_cast<const volatile uint8_t*>(cqe + kCqeOpOwnOffset);
  const uint8_t opcode = op_own >> 4;
  const uint8_t parity = static_cast<uint8_t>((cq.consumer / cq.depth) & 1);
  if (opcode == kCqeInvalid || (op_own & 1) != parity) return 0;
  fenceSystem();  // read the rest of the CQE after its owner byte
  const uint16_t be = *reinterpret_cast<const volatile uint16_t*>(cqe + kCqeWqeCounterOffset);
  const uint16_t wqe_counter = static_cast<uint16_t>((be >> 8) | (be << 8));
  ++cq.consumer;
  storeVolatile32(cq.dbr + kCqSetCi, toBig32(static_cast<uint32_t>(cq.consumer) & 0xffffff));
  if (opcode == kCqeReqErr) return -1;
  // wqe_counter holds the low 16 bits of the index: extend it against what was completed.
  const uint64_t done = loadAcquire(sq.completed);
  const uint64_t idx = done + static_cast<uint16_t>(wqe_counter - static_cast<uint16_t>(done));
  if (idx + 1 > done) storeRelease(sq.completed, idx + 1);
  return 1;
}

// ---- One queue pair shared by many posting threads (the EP kernels) ----
//
// Every WQE whose index has all of `signal_mask`'s bits set asks for a completion (selective
// signaling: a completion covers every WQE before it). Nobody owns the completion queue:
// a thread that finds the send queue more than half full polls it, if it gets `lock`. A
// completion with an error marks the queue pair failed (`error`): later posts are dropped
// instead of waiting for room that will never come, and the receivers' timeouts mask the
// peer. The completion queue holds at least depth / (signal_mask + 1) + 2 entries, so it
// cannot overflow (polls start at half full).
struct QueuePair {
  SendQueue sq;
  CompletionQueue cq;
  uint32_t signal_mask = 63;
  int lock = 0;
  uint64_t error = 0;  // 64-bit, for loadAcquire / storeRelease
};

MOELINK_HD bool tryLock(int* p) {
#if defined(__CUDA_ARCH__)
  const bool got = atomicCAS(p, 0, 1) == 0;
  if (got) __threadfence();  // acquire what the previous holder wrote
  return got;
#else
  int expected = 0;
  return __atomic_compare_exchange_n(p, &expected, 1, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
#endif
}

MOELINK_HD void unlock(int* p) {
#if defined(__CUDA_ARCH__)
  __threadfence();
  atomicExch(p, 0);
#else
  __atomic_store_n(p, 0, __ATOMIC_RELEASE);
#endif
}

// Consumes the completions that are there, if this thread gets the lock.
MOELINK_HD void tryPoll(QueuePair* qp) {
  if (!tryLock(&qp->lock)) return;
  int r;
  while ((r = poll(qp->cq, qp->sq)) == 1) {
  }
  if (r < 0) storeRelease(&qp->error, 1);
  unlock(&qp->lock);
}

// postWqe() for a shared queue pair: polls the completion queue when the send queue is more
// than half full, and drops the WQE once the queue pair has failed (the turn is still passed
// on, so that the WQEs after it are not held up). Returns whether the WQE was posted.
template <typename Build>
MOELINK_HD bool postWqeQp(QueuePair* qp, Build build, uint64_t* index = nullptr) {
  const SendQueue& sq = qp->sq;
  const uint64_t idx = atomicTicket(sq.tickets);
  if (index != nullptr) *index = idx;
  bool failed = false;
  while (idx - loadAcquire(sq.completed) >= sq.depth / 2) {
    if ((failed = loadAcquire(&qp->error) != 0)) break;
    tryPoll(qp);
    if (idx - loadAcquire(sq.completed) < sq.depth) break;  // room already, go on polling only while full
    spinPause();
  }
  unsigned char* wqe = sq.wqes + (idx & (sq.depth - 1)) * kBasicBlockBytes;
  if (!failed) build(wqe, idx, (static_cast<uint32_t>(idx) & qp->signal_mask) == qp->signal_mask);
  publish(sq, idx, wqe, !failed);
  return !failed;
}

// An RDMA WRITE of `length` bytes from (laddr, lkey) to (raddr, rkey) on a shared queue pair.
MOELINK_HD bool postQp(QueuePair* qp, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                       uint32_t length) {
  const uint32_t qpn = qp->sq.qpn;
  return postWqeQp(qp, [&](unsigned char* wqe, uint64_t idx, bool signal) {
    buildRdmaWrite(wqe, static_cast<uint16_t>(idx), qpn, signal, raddr, rkey, laddr, lkey, length);
  });
}

// An 8-byte WRITE carried inline and fenced behind the earlier WQEs (a count or a flag).
MOELINK_HD bool postInlineQp(QueuePair* qp, uint64_t raddr, uint32_t rkey, uint64_t value) {
  const uint32_t qpn = qp->sq.qpn;
  return postWqeQp(qp, [&](unsigned char* wqe, uint64_t idx, bool signal) {
    buildRdmaWriteInline8(wqe, static_cast<uint16_t>(idx), qpn, signal, true, raddr, rkey, value);
  });
}

struct SignaledNop {  // postWqeQp's builder for drainQp (a functor: host and device alike)
  uint32_t qpn;
  MOELINK_HD void operator()(unsigned char* wqe, uint64_t idx, bool) const {
    buildNop(wqe, static_cast<uint16_t>(idx), qpn, true);
  }
};

// Waits, on the host, until the NIC has completed every WQE posted on the queue pair: posts a
// signaled NOP after them and polls for its completion. For teardown, once nothing posts any
// more (the kernels are done): with selective signaling the last WQEs ask for no completion,
// and destroying the queue pair before they complete could cut them. Returns false if the
// queue pair has failed or `deadline` passes first.
inline bool drainQp(QueuePair* qp, std::chrono::steady_clock::time_point deadline) {
  if (loadAcquire(&qp->error) != 0) return false;
  uint64_t idx = 0;
  if (!postWqeQp(qp, SignaledNop{qp->sq.qpn}, &idx)) return false;
  while (loadAcquire(qp->sq.completed) < idx + 1) {
    if (loadAcquire(&qp->error) != 0 || std::chrono::steady_clock::now() > deadline) return false;
    tryPoll(qp);
    spinPause();
  }
  return true;
}

}  // namespace moelink::ep::ibgda
