// Element-wise reductions over raw buffers.
#pragma once

#include <cstddef>
#include <vector>

#include "moelink/collective/dtype.h"

namespace moelink::collective {

// out[i] = a[i] op b[i] for i < count; `out` may be `a` or `b` (not a partial overlap). AVG
// reduces as SUM (see divideInPlace).
void reduceTwo(void* out, const void* a, const void* b, size_t count, DType t, ReduceOp op);
// acc[i] = acc[i] op src[i] for i < count.
void reduceInto(void* acc, const void* src, size_t count, DType t, ReduceOp op);

// buf[i] /= divisor (floating and complex types only).
void divideInPlace(void* buf, size_t count, DType t, double divisor);

// out = inputs[0] op inputs[1] op ... in that order, so that every rank that reduces the
// same inputs gets bit-identical results, without copying any input. `out` may alias any
// input; `scratch` is grown and used when it aliases one after inputs[1].
void reduceOrdered(void* out, const std::vector<const void*>& inputs, size_t count, DType t,
                   ReduceOp op, std::vector<char>& scratch);

}  // namespace moelink::collective
