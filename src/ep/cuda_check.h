// The EP buffer's check of a CUDA runtime call (its torch-facing files).
#pragma once

#include <cuda_runtime_api.h>

#include <c10/util/Exception.h>

namespace moelink::ep {

inline void cudaCheck(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "moelink EP buffer: ", what, " failed: ", cudaGetErrorString(e));
}

}  // namespace moelink::ep
