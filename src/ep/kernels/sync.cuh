// Memory-model and copy helpers shared by the EP kernels. Peers write into this GPU's
// memory over NVLink (and the CPU proxy into host memory that the GPU reads), so every
// signal is a system-scope release/acquire pair.
#pragma once

#include <cstdint>

#include "moelink/common/device_sync.cuh"
#include "moelink/ep/low_latency_kernels.h"

namespace moelink::ep::kernels {

using device::globalTimerNs;
using device::ldAcquireSys64;
using device::stReleaseSys64;

__device__ __forceinline__ int ldAcquireSys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// A coherent read of an int a peer (or the CPU proxy) wrote, ordered by an earlier acquire.
__device__ __forceinline__ int ldRelaxedSys(const int* p) {
  int v;
  asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long ldAcquireGpu64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int ldAcquireGpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void stReleaseGpu(int* p, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void stReleaseSys(int* p, int v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int atomicAddAcqRelGpu(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// Read-only input (not written while the kernel runs): the non-coherent path, no L1 fill.
__device__ __forceinline__ int4 ldNc(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Data a peer wrote (read after acquiring its signal): coherent, no L1 fill.
__device__ __forceinline__ int4 ldRecv(const int4* p) {
  int4 v;
  asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// The same for a proxy source's data in host memory (the inbox): volatile, so that no cached
// copy from an earlier round can answer.
__device__ __forceinline__ int4 ldRecvSys(const int4* p) {
  int4 v;
  asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// Resets a signal (count or flag) for a later round: a system-scope store, so that it
// reaches host memory (a proxy inbox) at once instead of lingering in a cache where it
// could land after the next round's signal.
__device__ __forceinline__ void resetSignal(int* p) {
  asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(p), "r"(0) : "memory");
}

__device__ __forceinline__ void stNa(int4* p, int4 v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// ---- Bulk copies (TMA): global -> shared memory under an mbarrier, shared -> global memory
// (a peer's, through its mapping) in bulk-copy groups. Sizes and addresses: multiples of 16. ----

__device__ __forceinline__ uint32_t smemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A barrier that one arrival (with its transaction bytes) completes per phase.
__device__ __forceinline__ void mbarInit(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smemAddr(bar)) : "memory");
}

// Makes this thread's generic-proxy writes to shared memory visible to bulk copies.
__device__ __forceinline__ void fenceProxyAsyncShared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// After mbarInit of a thread's barriers: they (and its shared memory) are visible to the bulk copies.
__device__ __forceinline__ void mbarInitDone() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  fenceProxyAsyncShared();
}

// Starts a bulk copy of `bytes` from global memory into shared memory; the barrier's current
// phase completes once they have landed.
__device__ __forceinline__ void bulkLoad(void* smem_dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smemAddr(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smemAddr(smem_dst)),
               "l"(src), "r"(bytes), "r"(smemAddr(bar))
               : "memory");
}

// Completes the barrier's current phase without a copy (a stage with nothing to load).
__device__ __forceinline__ void mbarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smemAddr(bar)) : "memory");
}

__device__ __forceinline__ void mbarWait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smemAddr(bar)), "r"(parity)
        : "memory");
}

// One bulk-copy group: `bytes` from shared memory to (a peer's) global memory.
__device__ __forceinline__ void bulkStoreGroup(void* dst, const void* smem_src, uint32_t bytes) {
  if (bytes > 0)
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smemAddr(smem_src)),
                 "r"(bytes)
                 : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Until every bulk-copy group but the newest N has read its shared memory.
template <int N>
__device__ __forceinline__ void bulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Until every bulk-copy group of this thread has completed (its writes visible to the thread,
// whose later release covers them).
__device__ __forceinline__ void bulkWaitAll() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// One bulk copy of `bytes` from shared memory to global memory, returning once its writes are
// complete (visible to this thread, whose later release then covers them).
__device__ __forceinline__ void bulkStoreAndWait(void* dst, const void* smem_src, uint32_t bytes) {
  bulkStoreGroup(dst, smem_src, bytes);
  bulkWaitAll();
}

__device__ __forceinline__ void tracePoint(const Common& c, int point) {
  if (c.trace != nullptr) c.trace[blockIdx.x * kTracePoints + point] = globalTimerNs();
}

// Whether top-k entry k is the first of the token's entries sent to its rank: the one that
// carries the token's row there in dispatch, and whose combine_x slot the rank's weighted sum
// comes back in. s_dest: the destination rank per entry, -1 = not sent.
__device__ __forceinline__ bool leadsRow(const int* s_dest, int k) {
  if (s_dest[k] < 0) return false;
  for (int j = 0; j < k; ++j)
    if (s_dest[j] == s_dest[k]) return false;
  return true;
}

// Spins until *p != 0 (returns it) or the timeout passes (returns 0). Each spin is an
// acquire, at system scope (a peer's or the proxy's signal) or, kGpu, at GPU scope (a word
// that other blocks of the kernel write). Relaxed spins with one acquire after them made the
// waits on a proxy source's inbox (host memory that the proxy or its engine writes meanwhile)
// slower, not faster, on 4x H200 (EP4 over 2 virtual hosts, 128 tokens: combine 1001-1129 ->
// 1449 us over shm, dispatch + combine 4133 -> 5501 us over tcp).
template <bool kGpu = false>
__device__ __forceinline__ int waitNonZero(const int* p, int64_t timeout_ns) {
  uint64_t start = timeout_ns > 0 ? globalTimerNs() : 0;
  int v;
  while ((v = kGpu ? ldAcquireGpu(p) : ldAcquireSys(p)) == 0) {
    if (timeout_ns > 0 && static_cast<int64_t>(globalTimerNs() - start) > timeout_ns) return 0;
  }
  return v;
}

// Posts one request to the CPU proxy. Everything the request covers must have been written
// by this thread or ordered before this call by a barrier: the release store of `seq` makes
// it visible to the proxy first.
__device__ __forceinline__ void proxyPost(const ProxyRing& ring, int kind, int peer, uint64_t local,
                                          uint64_t remote, uint64_t length) {
  const unsigned long long ticket = atomicAdd(ring.tail, 1ull);
  // The proxy's head is in host memory. Reading it (a system-scope acquire) in every post held
  // the dispatch's row posts for a median ~230 us per block on an H200 (EP4 over 2 virtual
  // hosts; 25 us with this): the GPU keeps the highest head it has read in its own memory
  // (ring.head_seen, never ahead of the proxy's) and reads the host's only when that copy says
  // the ring may be full, which a ring of 65536 entries (proxy.cpp) almost never is.
  if (ticket - ldAcquireGpu64(ring.head_seen) >= ring.capacity) {
    unsigned long long head;
    while (ticket - (head = ldAcquireSys64(ring.head)) >= ring.capacity) {  // full: the proxy drains it
    }
    // A release, so that a post that reads this copy (an acquire) is ordered after the
    // proxy's consumption of the entries the copy frees, as if it had read the host's head.
    asm volatile("red.release.gpu.global.max.u64 [%0], %1;" ::"l"(ring.head_seen), "l"(head) : "memory");
  }
  ProxyEntry* e = ring.entries + ticket % ring.capacity;
  e->kind = kind;
  e->peer = peer;
  e->local = local;
  e->remote = remote;
  e->length = length;
  stReleaseSys64(&e->seq, ticket + 1);
}

// IBGDA: `bytes` from this rank's staging area (`local`, inside the registered range) to
// `remote` in the peer's buffer, as one RDMA WRITE on the peer's queue pair. Everything the
// WRITE covers must have been written by this thread or ordered before this call by a
// barrier (the post's system-scope fence then makes it visible to the NIC).
static __device__ __noinline__ void ibgdaPostData(const PeerRoute& route, const void* local, uint64_t remote,
                                              uint64_t bytes) {
  ibgda::postQp(route.qp, reinterpret_cast<uint64_t>(local), route.lkey, remote, route.rkey,
                static_cast<uint32_t>(bytes));
}

// IBGDA: an 8-byte signal (count or flag) written inline, fenced behind the WRITEs posted
// before it on the queue pair.
static __device__ __noinline__ void ibgdaPostSignal(const PeerRoute& route, uint64_t remote, int value) {
  ibgda::postInlineQp(route.qp, remote, route.rkey, static_cast<uint32_t>(value));
}

}  // namespace moelink::ep::kernels
