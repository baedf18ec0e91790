// Host-side launch helpers shared by the EP kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>

#include "moelink/common/error.h"

namespace moelink::ep::kernels {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) MOELINK_THROW(what, " failed: ", cudaGetErrorString(e));
}

// Raises `func`'s dynamic shared memory limit to `smem` on the current device, once per
// device and size seen (a host call per launch costs; buffers of different sizes share the
// kernel, so the largest size set so far stays). `seen` is the kernel's own table.
template <int kMaxDevices = 64>
void ensureSmem(const void* func, size_t smem, std::atomic<size_t> (&seen)[kMaxDevices], const char* what) {
  if (smem <= 48 * 1024) return;  // within the default
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  std::atomic<size_t>* set = device < kMaxDevices ? &seen[device] : nullptr;
  if (set != nullptr && smem <= set->load(std::memory_order_relaxed)) return;
  check(cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)), what);
  if (set == nullptr) return;
  size_t cur = set->load();
  while (smem > cur && !set->compare_exchange_weak(cur, smem)) {
  }
}

}  // namespace moelink::ep::kernels
