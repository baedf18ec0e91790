// GPU side of the IBGDA encoder test: threads build WQEs with the same __host__ __device__
// encoders the kernels use; ibgda_wqe_test.cpp compares the bytes with rdma-core's.
#include <cuda_runtime_api.h>

#include "ibgda_wqe_gpu.h"
#include "moelink/ep/ibgda/wqe.h"

namespace {

__global__ void buildKernel(const WqeCase* cases, int n, unsigned char* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const WqeCase& c = cases[i];
  unsigned char* w = out + static_cast<size_t>(i) * 2 * moelink::ep::ibgda::kBasicBlockBytes;
  // Block 0: a whole RDMA WRITE; block 1: a control segment with every field random.
  moelink::ep::ibgda::buildRdmaWrite(w, c.pi, c.qpn, c.signal, c.raddr, c.rkey, c.laddr, c.lkey, c.length);
  auto* ctrl = reinterpret_cast<moelink::ep::ibgda::CtrlSeg*>(w + moelink::ep::ibgda::kBasicBlockBytes);
  ctrl->dci_stream_channel_id = 0;
  moelink::ep::ibgda::setCtrlSeg(ctrl, c.pi, c.opcode, c.opmod, c.qpn, c.fm_ce_se, c.ds, c.signature, c.imm);
}

}  // namespace

std::string buildWqesOnGpu(const std::vector<WqeCase>& cases, std::vector<unsigned char>& out) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return "no CUDA device";
  const size_t bytes = cases.size() * 2 * moelink::ep::ibgda::kBasicBlockBytes;
  WqeCase* d_cases = nullptr;
  unsigned char* d_out = nullptr;
  cudaMalloc(&d_cases, cases.size() * sizeof(WqeCase));
  cudaMalloc(&d_out, bytes);
  cudaMemcpy(d_cases, cases.data(), cases.size() * sizeof(WqeCase), cudaMemcpyHostToDevice);
  cudaMemset(d_out, 0, bytes);
  buildKernel<<<(static_cast<int>(cases.size()) + 127) / 128, 128>>>(d_cases, static_cast<int>(cases.size()), d_out);
  out.assign(bytes, 0);
  cudaError_t err = cudaMemcpy(out.data(), d_out, bytes, cudaMemcpyDeviceToHost);
  cudaFree(d_cases);
  cudaFree(d_out);
  return err == cudaSuccess ? std::string() : std::string("CUDA error: ") + cudaGetErrorString(err);
}

// The queue protocol compiles for the GPU too (it runs on the host in ibgda_queue_test.cpp;
// no GPU test of it has run yet).
#include "moelink/ep/ibgda/queue.h"

__global__ void ibgdaQueueCompileCheck(moelink::ep::ibgda::SendQueue sq, moelink::ep::ibgda::CompletionQueue cq) {
  moelink::ep::ibgda::post(sq, 0, 0, 0, 0, 0, true);
  moelink::ep::ibgda::poll(cq, sq);
}
