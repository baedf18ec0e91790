// Memory-model helpers shared by the EP kernels. Peers write into this GPU's memory over
// NVLink, so every signal is a system-scope release/acquire pair.
#pragma once

#include <cstdint>

namespace moelink::ep::kernels {

__device__ __forceinline__ int ldAcquireSys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void stReleaseSys(int* p, int v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int ldAcquireGpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t globalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int warpSum(int v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warpMax(float v) {
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Spins until *p != 0 (returns it) or the timeout passes (returns 0).
__device__ __forceinline__ int waitNonZero(const int* p, int64_t timeout_ns) {
  uint64_t start = timeout_ns > 0 ? globalTimerNs() : 0;
  int v;
  while ((v = ldAcquireSys(p)) == 0) {
    if (timeout_ns > 0 && static_cast<int64_t>(globalTimerNs() - start) > timeout_ns) return 0;
  }
  return v;
}

}  // namespace moelink::ep::kernels
