// Element types and reduction operators understood by the collective layer. The backend
// maps torch's ScalarType and c10d::ReduceOp onto these; nothing here knows torch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace moelink::collective {

enum class DType : uint8_t {
  kFloat32, kFloat64, kFloat16, kBFloat16,
  kInt8, kInt16, kInt32, kInt64, kUInt8, kBool,
  kComplex64, kComplex128,
  kBytes,  // opaque bytes: moved, never reduced
};

enum class ReduceOp : uint8_t { kSum, kAvg, kProduct, kMin, kMax, kBand, kBor, kBxor, kNone };

size_t elementSize(DType t);
const char* dtypeName(DType t);
const char* reduceOpName(ReduceOp op);
bool isFloating(DType t);  // float/half/bfloat16/double
bool isComplex(DType t);

// "" when `op` can reduce `t`, else why not (for example "MAX is not defined for complex").
std::string reduceUnsupportedReason(DType t, ReduceOp op);

}  // namespace moelink::collective
