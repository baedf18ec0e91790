// GPU side of the IBGDA encoder test: threads build WQEs with the same __host__ __device__
// encoders the kernels use; ibgda_wqe_test.cpp compares the bytes with rdma-core's.
#include <cuda_runtime_api.h>

#include <cstring>

#include "ibgda_wqe_gpu.h"
#include "moelink/ep/ibgda/wqe.h"

namespace {

__global__ void buildKernel(const WqeCase* cases, int n, unsigned char* out, unsigned char* inline_out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const WqeCase& c = cases[i];
  unsigned char* w = out + static_cast<size_t>(i) * 2 * moelink::ep::ibgda::kBasicBlockBytes;
  // Block 0: a whole RDMA WRITE; block 1: a control segment with every field random.
  moelink::ep::ibgda::buildRdmaWrite(w, c.pi, c.qpn, c.signal, c.raddr, c.rkey, c.laddr, c.lkey, c.length);
  auto* ctrl = reinterpret_cast<moelink::ep::ibgda::CtrlSeg*>(w + moelink::ep::ibgda::kBasicBlockBytes);
  ctrl->dci_stream_channel_id = 0;
  moelink::ep::ibgda::setCtrlSeg(ctrl, c.pi, c.opcode, c.opmod, c.qpn, c.fm_ce_se, c.ds, c.signature, c.imm);
  moelink::ep::ibgda::buildRdmaWriteInline8(inline_out + static_cast<size_t>(i) * 64, c.pi, c.qpn, c.signal, c.fence,
                                            c.raddr, c.rkey, c.value);
}

}  // namespace

std::string buildWqesOnGpu(const std::vector<WqeCase>& cases, std::vector<unsigned char>& out,
                           std::vector<unsigned char>& inline_out) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return "no CUDA device";
  const size_t bytes = cases.size() * 2 * moelink::ep::ibgda::kBasicBlockBytes;
  WqeCase* d_cases = nullptr;
  unsigned char* d_out = nullptr;
  unsigned char* d_inline = nullptr;
  const size_t inline_bytes = cases.size() * 64;
  cudaMalloc(&d_cases, cases.size() * sizeof(WqeCase));
  cudaMalloc(&d_out, bytes);
  cudaMalloc(&d_inline, inline_bytes);
  cudaMemcpy(d_cases, cases.data(), cases.size() * sizeof(WqeCase), cudaMemcpyHostToDevice);
  cudaMemset(d_out, 0, bytes);
  cudaMemset(d_inline, 0xee, inline_bytes);  // every byte of the 48 must be written
  buildKernel<<<(static_cast<int>(cases.size()) + 127) / 128, 128>>>(d_cases, static_cast<int>(cases.size()), d_out,
                                                                    d_inline);
  out.assign(bytes, 0);
  inline_out.assign(inline_bytes, 0);
  cudaError_t err = cudaMemcpy(out.data(), d_out, bytes, cudaMemcpyDeviceToHost);
  if (err == cudaSuccess) err = cudaMemcpy(inline_out.data(), d_inline, inline_bytes, cudaMemcpyDeviceToHost);
  cudaFree(d_cases);
  cudaFree(d_out);
  cudaFree(d_inline);
  return err == cudaSuccess ? std::string() : std::string("CUDA error: ") + cudaGetErrorString(err);
}

// The queue protocol run by GPU threads: posters, and one polling thread in block 0.
#include "moelink/ep/ibgda/queue.h"

namespace {

using moelink::ep::ibgda::CompletionQueue;
using moelink::ep::ibgda::SendQueue;

__device__ uint64_t nowNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void queueKernel(SendQueue sq, CompletionQueue cq, const unsigned char* src, unsigned char* dst,
                            uint64_t* flags, int per_thread, uint32_t bytes, uint32_t lkey, uint32_t rkey, uint64_t total,
                            int* errors) {
  if (blockIdx.x == 0) {
    if (threadIdx.x != 0) return;
    const uint64_t start = nowNs();
    while (moelink::ep::ibgda::loadAcquire(sq.completed) < total) {
      if (moelink::ep::ibgda::poll(cq, sq) < 0) atomicAdd(errors, 1);
      if (nowNs() - start > 60ull * 1000 * 1000 * 1000) {
        atomicAdd(errors, 1000);
        return;
      }
    }
    return;
  }
  const uint64_t t = static_cast<uint64_t>(blockIdx.x - 1) * blockDim.x + threadIdx.x;
  for (int i = 0; i < per_thread; ++i) {
    const uint64_t off = (t * per_thread + i) * bytes;
    moelink::ep::ibgda::post(sq, reinterpret_cast<uint64_t>(src + off), lkey, reinterpret_cast<uint64_t>(dst + off),
                             rkey, bytes, true);
  }
  moelink::ep::ibgda::postInline8(sq, reinterpret_cast<uint64_t>(flags + t), rkey, 0x5eed000000000000ull + t, true,
                                  true);
}

// The same through one shared QueuePair (what the EP kernels use): no poller thread, the
// posters poll the completion queue themselves, every (signal_mask + 1)-th WQE signaled.
__global__ void queuePairKernel(moelink::ep::ibgda::QueuePair* qp, const unsigned char* src, unsigned char* dst,
                                uint64_t* flags, int per_thread, uint32_t bytes, uint32_t lkey, uint32_t rkey,
                                int* dropped) {
  const uint64_t t = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int i = 0; i < per_thread; ++i) {
    const uint64_t off = (t * per_thread + i) * bytes;
    if (!moelink::ep::ibgda::postQp(qp, reinterpret_cast<uint64_t>(src + off), lkey,
                                    reinterpret_cast<uint64_t>(dst + off), rkey, bytes))
      atomicAdd(dropped, 1);
  }
  if (!moelink::ep::ibgda::postInlineQp(qp, reinterpret_cast<uint64_t>(flags + t), rkey, 0x5eed000000000000ull + t))
    atomicAdd(dropped, 1);
}

template <typename T>
bool mapped(T*& p, size_t bytes) {
  void* v = nullptr;
  if (cudaHostAlloc(&v, bytes, cudaHostAllocMapped) != cudaSuccess) return false;
  std::memset(v, 0, bytes);
  p = static_cast<T*>(v);
  return true;
}

}  // namespace

std::string gpuQueueAlloc(GpuQueueRun& r, uint32_t sq_depth, uint32_t cq_depth, size_t bytes) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return "no CUDA device";
  int uva = 0;
  cudaDeviceGetAttribute(&uva, cudaDevAttrUnifiedAddressing, 0);
  if (!uva) return "no unified addressing (mapped host memory would have other addresses on the GPU)";
  r.sq_depth = sq_depth;
  r.cq_depth = cq_depth;
  r.bytes = bytes;
  const bool ok = mapped(r.wqes, sq_depth * moelink::ep::ibgda::kBasicBlockBytes) &&
                  mapped(r.cqes, cq_depth * moelink::ep::ibgda::kCqeBytes) && mapped(r.sq_dbr, 64) &&
                  mapped(r.cq_dbr, 64) && mapped(r.doorbell, 64) && mapped(r.src, bytes) && mapped(r.dst, bytes) &&
                  mapped(r.flags, bytes / 8) &&
                  cudaMalloc(&r.counters, 64) == cudaSuccess && cudaMemset(r.counters, 0, 64) == cudaSuccess;
  return ok ? std::string() : std::string("CUDA allocation failed: ") + cudaGetErrorString(cudaGetLastError());
}

std::string gpuQueueRun(GpuQueueRun& r, int blocks, int threads, int per_thread, uint32_t wqe_bytes, uint32_t qpn,
                        uint32_t lkey, uint32_t rkey) {
  auto* c = static_cast<uint64_t*>(r.counters);
  SendQueue sq;
  sq.wqes = r.wqes;
  sq.depth = r.sq_depth;
  sq.qpn = qpn;
  sq.dbr = r.sq_dbr;
  sq.doorbell = r.doorbell;
  sq.tickets = c;
  sq.ready = c + 1;
  sq.completed = c + 2;
  CompletionQueue cq;
  cq.cqes = r.cqes;
  cq.depth = r.cq_depth;
  cq.dbr = r.cq_dbr;
  const uint64_t posters = static_cast<uint64_t>(blocks) * threads;
  r.total = posters * (per_thread + 1);
  if (posters * per_thread * wqe_bytes > r.bytes || posters * 8 > r.bytes / 8) return "payload buffers too small";
  int* errors = reinterpret_cast<int*>(c + 3);
  queueKernel<<<blocks + 1, threads>>>(sq, cq, r.src, r.dst, r.flags, per_thread, wqe_bytes, lkey, rkey, r.total,
                                       errors);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) return std::string("CUDA error: ") + cudaGetErrorString(e);
  cudaMemcpy(&r.completed, c + 2, sizeof r.completed, cudaMemcpyDeviceToHost);
  cudaMemcpy(&r.errors, errors, sizeof r.errors, cudaMemcpyDeviceToHost);
  return std::string();
}

std::string gpuQueuePairRun(GpuQueueRun& r, int blocks, int threads, int per_thread, uint32_t wqe_bytes, uint32_t qpn,
                            uint32_t lkey, uint32_t rkey, uint32_t signal_mask) {
  auto* c = static_cast<uint64_t*>(r.counters);
  moelink::ep::ibgda::QueuePair qp;
  qp.sq.wqes = r.wqes;
  qp.sq.depth = r.sq_depth;
  qp.sq.qpn = qpn;
  qp.sq.dbr = r.sq_dbr;
  qp.sq.doorbell = r.doorbell;
  qp.sq.tickets = c;
  qp.sq.ready = c + 1;
  qp.sq.completed = c + 2;
  qp.cq.cqes = r.cqes;
  qp.cq.depth = r.cq_depth;
  qp.cq.dbr = r.cq_dbr;
  qp.signal_mask = signal_mask;
  const uint64_t posters = static_cast<uint64_t>(blocks) * threads;
  r.total = posters * (per_thread + 1);
  if (posters * per_thread * wqe_bytes > r.bytes || posters * 8 > r.bytes / 8) return "payload buffers too small";
  int* dropped = reinterpret_cast<int*>(c + 3);
  moelink::ep::ibgda::QueuePair* dev = nullptr;
  if (cudaMalloc(&dev, sizeof qp) != cudaSuccess || cudaMemcpy(dev, &qp, sizeof qp, cudaMemcpyHostToDevice) != cudaSuccess)
    return "CUDA allocation failed";
  queuePairKernel<<<blocks, threads>>>(dev, r.src, r.dst, r.flags, per_thread, wqe_bytes, lkey, rkey, dropped);
  cudaError_t e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaMemcpy(&qp, dev, sizeof qp, cudaMemcpyDeviceToHost);
  cudaFree(dev);
  if (e != cudaSuccess) return std::string("CUDA error: ") + cudaGetErrorString(e);
  cudaMemcpy(&r.completed, c + 2, sizeof r.completed, cudaMemcpyDeviceToHost);
  cudaMemcpy(&r.errors, dropped, sizeof r.errors, cudaMemcpyDeviceToHost);
  r.errors += qp.error ? 1000 : 0;
  return std::string();
}

void gpuQueueFree(GpuQueueRun& r) {
  for (void* p : {static_cast<void*>(r.wqes), static_cast<void*>(r.cqes), static_cast<void*>(r.sq_dbr),
                  static_cast<void*>(r.cq_dbr), static_cast<void*>(r.doorbell), static_cast<void*>(r.src),
                  static_cast<void*>(r.dst), static_cast<void*>(r.flags)})
    if (p) cudaFreeHost(p);
  if (r.counters) cudaFree(r.counters);
  r = GpuQueueRun{};
}
