// The launch floor of one GPU: what CUDA events around a call see beyond the kernel's own span
// when the kernel does nothing, for a launch shape (blocks, threads, dynamic shared memory). The
// EP benchmark's trace (examples/bench/ep.py --trace) compares each rank's event time and span
// with it, so what lies outside a kernel reads against what any kernel of that shape pays.
//
//   moelink_launch_bench [--blocks N] [--threads 1024] [--smem BYTES] [--work-ns NS] [--iters 300]
//
// Each call is timed as ep.py times one: a 1 ms spin kernel first (so the launch itself is not
// on the clock), an event, the kernel, an event, then a synchronize. Each block records its
// start (%globaltimer, thread 0 on entry) and its end (after a block barrier and --work-ns of
// spinning), and the span is the earliest start to the latest end. Prints one line: blocks,
// threads, smem, then the medians of the event time, the span and their difference (us).
// --blocks 0 (the default) launches a block per SM.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench_check.h"

namespace {

constexpr int kMaxThreads = 1024;

__device__ __forceinline__ uint64_t globalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spinKernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// stamps: [block][2] = start, end. The shared-memory store keeps the dynamic allocation live.
__global__ void __launch_bounds__(kMaxThreads, 1) emptyKernel(uint64_t* stamps, uint64_t work_ns) {
  extern __shared__ char smem[];
  if (threadIdx.x == 0) stamps[2 * blockIdx.x] = globalTimer();
  if (work_ns > 0) {
    const uint64_t start = globalTimer();
    while (globalTimer() - start < work_ns) {
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    smem[0] = 1;
    stamps[2 * blockIdx.x + 1] = globalTimer();
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int blocks = 0, threads = kMaxThreads, iters = 300;
  long long smem = 0, work_ns = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--blocks")) blocks = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--smem")) smem = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--work-ns")) work_ns = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "argument %s needs a value\n", argv[argc - 1]);
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  if (blocks <= 0) blocks = prop.multiProcessorCount;
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  if (threads < 1 || threads > kMaxThreads || iters < 1 || smem < 0 || work_ns < 0 ||
      smem > static_cast<long long>(prop.sharedMemPerBlockOptin)) {
    std::fprintf(stderr, "need 1 <= threads <= %d, iters >= 1, 0 <= smem <= %zu, work-ns >= 0\n", kMaxThreads,
                 prop.sharedMemPerBlockOptin);
    return 2;
  }
  const size_t dyn = std::max<long long>(smem, 16);  // the kernel's one store needs a byte
  CHECK(cudaFuncSetAttribute(emptyKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dyn)));
  uint64_t* stamps = nullptr;
  CHECK(cudaMalloc(&stamps, 2 * sizeof(uint64_t) * blocks));
  std::vector<uint64_t> host(2 * blocks);
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t before, after;
  CHECK(cudaEventCreate(&before));
  CHECK(cudaEventCreate(&after));
  std::vector<double> events, spans, outside;
  const int warmup = 20;
  for (int i = 0; i < warmup + iters; ++i) {
    CHECK(cudaMemsetAsync(stamps, 0, 2 * sizeof(uint64_t) * blocks, stream));
    spinKernel<<<1, 1, 0, stream>>>(clock_khz);  // kHz: the cycles of 1 ms
    CHECK(cudaEventRecord(before, stream));
    emptyKernel<<<blocks, threads, dyn, stream>>>(stamps, static_cast<uint64_t>(work_ns));
    CHECK(cudaEventRecord(after, stream));
    CHECK(cudaStreamSynchronize(stream));
    CHECK(cudaGetLastError());
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, before, after));
    CHECK(cudaMemcpy(host.data(), stamps, host.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
    uint64_t first = UINT64_MAX, last = 0;
    for (int b = 0; b < blocks; ++b) {
      first = std::min(first, host[2 * b]);
      last = std::max(last, host[2 * b + 1]);
    }
    if (i < warmup) continue;
    const double event_us = ms * 1e3, span_us = static_cast<double>(last - first) / 1e3;
    events.push_back(event_us);
    spans.push_back(span_us);
    outside.push_back(event_us - span_us);
  }
  std::printf("%d %d %lld %.2f %.2f %.2f\n", blocks, threads, smem, median(events), median(spans), median(outside));
  CHECK(cudaFree(stamps));
  return 0;
}
