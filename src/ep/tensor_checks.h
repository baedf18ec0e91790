// The EP buffers' checks of the tensors a caller passes (their torch-facing files).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace moelink::ep {

// The kernels move rows in 16-byte vectors (and bulk copies, which need 16-byte alignment): a
// view that starts between two such addresses (a misaligned access would end the process's CUDA
// context) is refused before any launch. `what` names the tensor with its call's prefix.
inline void checkAligned(const at::Tensor& t, const char* what) {
  const auto off = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16;
  TORCH_CHECK_VALUE(off == 0, what, " must start at a 16-byte aligned address (a view at an offset of ", off,
                    " bytes from one; pass a copy)");
}

}  // namespace moelink::ep
