// System-scope signalling between GPUs (and with the host) for every kernel family: peers
// write flags into this GPU's memory over NVLink, so each signal is a release store at
// system scope and each wait an acquire load at the same scope.
#pragma once

#include <cstdint>

namespace moelink::device {

__device__ __forceinline__ uint64_t ldAcquireSys64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void stReleaseSys64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Nanoseconds of the GPU's global timer (for deadlines; coarse).
__device__ __forceinline__ uint64_t globalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace moelink::device
