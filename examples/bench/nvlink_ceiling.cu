// The NVLink all-to-all ceiling of one host: what each way of moving bytes between GPUs reaches
// when every GPU sends the same amount to every other at once (the traffic of an all-to-all, of
// EP dispatch and combine, and of a collective's rounds). examples/bench/nvlink.py runs it.
//
//   moelink_nvlink_bench [--gpus N] [--bytes PER_PAIR] [--sms 8,16,32,64] [--iters 10]
//
// Ways (one line each: way, SMs per GPU, GB/s per GPU and direction, median of --iters):
//   store  each GPU's blocks load their rows locally and store them into the peers' memory
//          (16-byte vectors, 4 in flight per thread), 512 threads per block
//   load   each GPU's blocks load the peers' rows and store them locally (pull)
//   bulk   stores by bulk copies (TMA): a warp's lane loads a piece into shared memory and
//          stores it to the peer with cp.async.bulk, 4 stages per warp, 8 warps per block
//   ce     copy engines: one cudaMemcpyPeerAsync per (GPU, peer) pair, each on its own stream
// A line's SMs are blocks of one per SM; the copy engines hold none (SMs 0).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_check.h"
#include "sync.cuh"

namespace {

constexpr int kMaxGpus = 8;
constexpr int kThreads = 512;
constexpr int kBulkWarps = 8, kBulkStages = 4, kBulkPiece = 6144;  // 192 KiB of shared memory

struct Pairs {
  // src[q]: what this GPU's kernel reads for pair q; dst[q]: where it writes it.
  int4* src[kMaxGpus];
  int4* dst[kMaxGpus];
  int peers[kMaxGpus];  // the pairs, in an order that differs per GPU (so links are balanced)
  int npeers;
  uint64_t n16;  // 16-byte vectors per pair
};

using moelink::ep::kernels::ldNc;  // the EP kernels' load of their inputs

// Block b takes pair b % npeers and its share of that pair's vectors.
__global__ void __launch_bounds__(kThreads, 1) copyKernel(Pairs p) {
  const int per_pair = max(1, static_cast<int>(gridDim.x) / p.npeers);
  const int q = p.peers[blockIdx.x % p.npeers];
  const int part = blockIdx.x / p.npeers;
  if (part >= per_pair) return;
  const uint64_t chunk = (p.n16 + per_pair - 1) / per_pair;
  const uint64_t lo = part * chunk, hi = min(p.n16, lo + chunk);
  const int4* s = p.src[q];
  int4* d = p.dst[q];
  constexpr int kU = 4;
  for (uint64_t i = lo + threadIdx.x; i < hi; i += kThreads * kU) {
    int4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (i + u * kThreads < hi) v[u] = ldNc(s + i + u * kThreads);
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (i + u * kThreads < hi) d[i + u * kThreads] = v[u];
  }
}

// The EP kernels' bulk copies (sync.cuh), as combine's sender runs them: per piece a load into
// shared memory, then a store group to the peer.
__global__ void __launch_bounds__(kBulkWarps * 32, 1) bulkKernel(Pairs p) {
  using namespace moelink::ep::kernels;
  extern __shared__ __align__(128) char stage[];
  __shared__ uint64_t bar[kBulkWarps][kBulkStages];
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 != 0) return;
  // Warp w of block b: one of gridDim.x * kBulkWarps workers, spread over the pairs.
  const int workers = gridDim.x * kBulkWarps, id = blockIdx.x * kBulkWarps + warp;
  const int per_pair = max(1, workers / p.npeers);
  const int q = p.peers[id % p.npeers];
  const int part = id / p.npeers;
  if (part >= per_pair) return;
  const uint64_t bytes = p.n16 * 16;
  const uint64_t chunk = ((bytes + per_pair - 1) / per_pair + kBulkPiece - 1) / kBulkPiece * kBulkPiece;
  const uint64_t lo = part * chunk, hi = min(bytes, lo + chunk);
  char* st = stage + warp * kBulkStages * kBulkPiece;
  for (int i = 0; i < kBulkStages; ++i) mbarInit(&bar[warp][i]);
  mbarInitDone();
  const char* s = reinterpret_cast<const char*>(p.src[q]);
  char* d = reinterpret_cast<char*>(p.dst[q]);
  uint32_t n = 0;
  for (uint64_t off = lo; off < hi; off += kBulkPiece, ++n) {
    const uint32_t len = static_cast<uint32_t>(min(static_cast<uint64_t>(kBulkPiece), hi - off));
    const int k = n % kBulkStages;
    if (n >= kBulkStages) bulkWaitRead<kBulkStages - 1>();
    bulkLoad(st + k * kBulkPiece, s + off, len, &bar[warp][k]);
    mbarWait(&bar[warp][k], (n / kBulkStages) & 1);
    bulkStoreGroup(d + off, st + k * kBulkPiece, len);
  }
  bulkWaitAll();
}

std::vector<int> parseList(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  int gpus = 0, iters = 10;
  uint64_t bytes = 256ull << 20;
  std::vector<int> sms = {4, 8, 16, 24, 32, 48, 64};
  std::vector<std::string> ways = {"store", "load", "bulk", "ce"};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--gpus")) gpus = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--bytes")) bytes = std::strtoull(argv[i + 1], nullptr, 10);
    else if (!std::strcmp(argv[i], "--sms")) sms = parseList(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  int have = 0;
  CHECK(cudaGetDeviceCount(&have));
  if (gpus == 0) gpus = have;
  if (gpus < 2 || gpus > have || gpus > kMaxGpus) {
    std::fprintf(stderr, "needs 2 to %d GPUs (%d present, %d asked)\n", kMaxGpus, have, gpus);
    return 2;
  }
  bytes = bytes / 16 * 16;
  // in[g][q]: GPU g's rows for GPU q; out[g][q]: GPU g's rows from GPU q.
  std::vector<std::vector<char*>> in(gpus, std::vector<char*>(gpus)), out(gpus, std::vector<char*>(gpus));
  std::vector<std::vector<cudaStream_t>> streams(gpus, std::vector<cudaStream_t>(gpus));
  for (int g = 0; g < gpus; ++g) {
    CHECK(cudaSetDevice(g));
    for (int q = 0; q < gpus; ++q) {
      if (q != g) {
        int ok = 0;
        CHECK(cudaDeviceCanAccessPeer(&ok, g, q));
        if (!ok) {
          std::fprintf(stderr, "GPU %d cannot access GPU %d\n", g, q);
          return 1;
        }
        CHECK(cudaDeviceEnablePeerAccess(q, 0));
      }
      CHECK(cudaMalloc(&in[g][q], bytes));
      CHECK(cudaMalloc(&out[g][q], bytes));
      CHECK(cudaMemset(in[g][q], g + 1, bytes));
      CHECK(cudaStreamCreateWithFlags(&streams[g][q], cudaStreamNonBlocking));
    }
    CHECK(cudaFuncSetAttribute(bulkKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               kBulkWarps * kBulkStages * kBulkPiece));
  }
  auto pairsOf = [&](int g, bool pull) {
    Pairs p{};
    p.npeers = gpus - 1;
    p.n16 = bytes / 16;
    for (int i = 0; i < gpus - 1; ++i) {
      const int q = (g + 1 + i) % gpus;  // GPU g starts with g + 1: at any moment the links differ
      p.peers[i] = q;
      p.src[q] = reinterpret_cast<int4*>(pull ? in[q][g] : in[g][q]);
      p.dst[q] = reinterpret_cast<int4*>(pull ? out[g][q] : out[q][g]);
    }
    return p;
  };
  auto syncAll = [&] {
    for (int g = 0; g < gpus; ++g) {
      CHECK(cudaSetDevice(g));
      CHECK(cudaDeviceSynchronize());
    }
  };
  auto runOnce = [&](const std::string& way, int n) {
    syncAll();
    const auto t0 = std::chrono::steady_clock::now();
    for (int g = 0; g < gpus; ++g) {
      CHECK(cudaSetDevice(g));
      if (way == "store" || way == "load") {
        copyKernel<<<n, kThreads, 0, streams[g][g]>>>(pairsOf(g, way == "load"));
      } else if (way == "bulk") {
        bulkKernel<<<n, kBulkWarps * 32, kBulkWarps * kBulkStages * kBulkPiece, streams[g][g]>>>(pairsOf(g, false));
      } else {
        for (int i = 1; i < gpus; ++i) {
          const int q = (g + i) % gpus;
          CHECK(cudaMemcpyPeerAsync(out[q][g], q, in[g][q], g, bytes, streams[g][q]));
        }
      }
      CHECK(cudaGetLastError());
    }
    syncAll();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (const auto& way : ways) {
    std::vector<int> counts = way == "ce" ? std::vector<int>{0} : sms;
    for (int n : counts) {
      runOnce(way, n);  // warm up
      std::vector<double> t;
      for (int i = 0; i < iters; ++i) t.push_back(runOnce(way, n));
      std::sort(t.begin(), t.end());
      const double med = t[t.size() / 2];
      std::printf("%s %d %.1f\n", way.c_str(), n, static_cast<double>(bytes) * (gpus - 1) / med / 1e9);
      std::fflush(stdout);
    }
  }
  // The rows arrived: out[g][q] holds q + 1 everywhere (checked at both ends and the middle).
  for (int g = 0; g < gpus; ++g)
    for (int q = 0; q < gpus; ++q) {
      if (q == g) continue;
      CHECK(cudaSetDevice(g));
      for (uint64_t at : {uint64_t{0}, bytes / 2, bytes - 1}) {
        char c = 0;
        CHECK(cudaMemcpy(&c, out[g][q] + at, 1, cudaMemcpyDeviceToHost));
        if (c != q + 1) {
          std::fprintf(stderr, "GPU %d: byte %llu from GPU %d is %d, not %d\n", g, static_cast<unsigned long long>(at),
                       q, c, q + 1);
          return 1;
        }
      }
    }
  return 0;
}
