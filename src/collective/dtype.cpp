#include "moelink/collective/dtype.h"

namespace moelink::collective {

size_t elementSize(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt8: return 1;
    case DType::kInt16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
    case DType::kBool: return 1;
    case DType::kComplex64: return 8;
    case DType::kComplex128: return 16;
    case DType::kBytes: return 1;
  }
  return 1;
}

const char* dtypeName(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt8: return "int8";
    case DType::kInt16: return "int16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kBool: return "bool";
    case DType::kComplex64: return "complex64";
    case DType::kComplex128: return "complex128";
    case DType::kBytes: return "bytes";
  }
  return "?";
}

const char* reduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "SUM";
    case ReduceOp::kAvg: return "AVG";
    case ReduceOp::kProduct: return "PRODUCT";
    case ReduceOp::kMin: return "MIN";
    case ReduceOp::kMax: return "MAX";
    case ReduceOp::kBand: return "BAND";
    case ReduceOp::kBor: return "BOR";
    case ReduceOp::kBxor: return "BXOR";
    case ReduceOp::kNone: return "NONE";
  }
  return "?";
}

bool isFloating(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kFloat16 ||
         t == DType::kBFloat16;
}

bool isComplex(DType t) { return t == DType::kComplex64 || t == DType::kComplex128; }

std::string reduceUnsupportedReason(DType t, ReduceOp op) {
  if (t == DType::kBytes || op == ReduceOp::kNone)
    return "this operation does not reduce";
  bool bitwise = op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
  if (bitwise && (isFloating(t) || isComplex(t)))
    return std::string(reduceOpName(op)) + " is only defined for integer and bool tensors, not " +
           dtypeName(t);
  if ((op == ReduceOp::kMin || op == ReduceOp::kMax) && isComplex(t))
    return std::string(reduceOpName(op)) + " is not defined for complex tensors";
  if (op == ReduceOp::kAvg && !(isFloating(t) || isComplex(t)))
    return std::string("AVG needs a floating-point or complex tensor, not ") + dtypeName(t);
  return "";
}

}  // namespace moelink::collective
