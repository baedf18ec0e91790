#include "moelink/collective/reduce.h"

#include <algorithm>
#include <complex>
#include <cstdint>
#include <cstring>

#include "moelink/common/error.h"

namespace moelink::collective {

namespace {

// IEEE half and bfloat16 through float, rounding to nearest even like torch's CPU ops.
float halfToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t floatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0));
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow to inf
  if (absx < 0x38800000u) {  // subnormal or zero in half
    float a;
    std::memcpy(&a, &absx, 4);
    // 2^-24 is the smallest half subnormal; scale and round to nearest even.
    float scaled = a * 16777216.0f;
    uint32_t m = static_cast<uint32_t>(scaled);
    float rem = scaled - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1))) ++m;
    return static_cast<uint16_t>(sign | m);
  }
  uint32_t mant = absx & 0x7fffffu;
  uint32_t exp = (absx >> 23) - 127 + 15;
  uint32_t h = (exp << 10) | (mant >> 13);
  uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float bf16ToFloat(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t floatToBf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // NaN
  uint32_t lsb = (x >> 16) & 1;
  x += 0x7fffu + lsb;
  return static_cast<uint16_t>(x >> 16);
}

template <typename T>
T applyOp(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return static_cast<T>(a + b);
    case ReduceOp::kProduct: return static_cast<T>(a * b);
    case ReduceOp::kMin: return std::min(a, b);
    case ReduceOp::kMax: return std::max(a, b);
    default: break;
  }
  if constexpr (std::is_integral_v<T>) {
    switch (op) {
      case ReduceOp::kBand: return static_cast<T>(a & b);
      case ReduceOp::kBor: return static_cast<T>(a | b);
      case ReduceOp::kBxor: return static_cast<T>(a ^ b);
      default: break;
    }
  }
  return a;
}

// NaN propagates through MIN/MAX as in torch.
template <typename T>
T applyFloatOp(T a, T b, ReduceOp op) {
  if ((op == ReduceOp::kMin || op == ReduceOp::kMax) && (a != a || b != b)) return a != a ? a : b;
  return applyOp(a, b, op);
}

template <typename T>
void reduceTyped(T* acc, const T* src, size_t n, ReduceOp op) {
  switch (op) {  // the common cases as plain loops the compiler vectorizes
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      for (size_t i = 0; i < n; ++i) acc[i] = static_cast<T>(acc[i] + src[i]);
      return;
    case ReduceOp::kProduct:
      for (size_t i = 0; i < n; ++i) acc[i] = static_cast<T>(acc[i] * src[i]);
      return;
    default:
      for (size_t i = 0; i < n; ++i) {
        if constexpr (std::is_floating_point_v<T>)
          acc[i] = applyFloatOp(acc[i], src[i], op);
        else
          acc[i] = applyOp(acc[i], src[i], op);
      }
  }
}

template <typename T>
void reduceComplex(std::complex<T>* acc, const std::complex<T>* src, size_t n, ReduceOp op) {
  for (size_t i = 0; i < n; ++i) acc[i] = op == ReduceOp::kProduct ? acc[i] * src[i] : acc[i] + src[i];
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void reduce16(uint16_t* acc, const uint16_t* src, size_t n, ReduceOp op) {
  for (size_t i = 0; i < n; ++i) acc[i] = FromF(applyFloatOp(ToF(acc[i]), ToF(src[i]), op));
}

void reduceBool(uint8_t* acc, const uint8_t* src, size_t n, ReduceOp op) {
  for (size_t i = 0; i < n; ++i) {
    bool a = acc[i] != 0, b = src[i] != 0, r;
    switch (op) {
      case ReduceOp::kSum: case ReduceOp::kMax: case ReduceOp::kBor: r = a || b; break;
      case ReduceOp::kProduct: case ReduceOp::kMin: case ReduceOp::kBand: r = a && b; break;
      case ReduceOp::kBxor: r = a != b; break;
      default: r = a;
    }
    acc[i] = r;
  }
}

}  // namespace

void reduceInto(void* acc, const void* src, size_t n, DType t, ReduceOp op) {
  switch (t) {
    case DType::kFloat32: return reduceTyped(static_cast<float*>(acc), static_cast<const float*>(src), n, op);
    case DType::kFloat64: return reduceTyped(static_cast<double*>(acc), static_cast<const double*>(src), n, op);
    case DType::kFloat16:
      return reduce16<halfToFloat, floatToHalf>(static_cast<uint16_t*>(acc), static_cast<const uint16_t*>(src), n, op);
    case DType::kBFloat16:
      return reduce16<bf16ToFloat, floatToBf16>(static_cast<uint16_t*>(acc), static_cast<const uint16_t*>(src), n, op);
    case DType::kInt8: return reduceTyped(static_cast<int8_t*>(acc), static_cast<const int8_t*>(src), n, op);
    case DType::kInt16: return reduceTyped(static_cast<int16_t*>(acc), static_cast<const int16_t*>(src), n, op);
    case DType::kInt32: return reduceTyped(static_cast<int32_t*>(acc), static_cast<const int32_t*>(src), n, op);
    case DType::kInt64: return reduceTyped(static_cast<int64_t*>(acc), static_cast<const int64_t*>(src), n, op);
    case DType::kUInt8: return reduceTyped(static_cast<uint8_t*>(acc), static_cast<const uint8_t*>(src), n, op);
    case DType::kBool: return reduceBool(static_cast<uint8_t*>(acc), static_cast<const uint8_t*>(src), n, op);
    case DType::kComplex64:
      return reduceComplex(static_cast<std::complex<float>*>(acc), static_cast<const std::complex<float>*>(src), n, op);
    case DType::kComplex128:
      return reduceComplex(static_cast<std::complex<double>*>(acc), static_cast<const std::complex<double>*>(src), n, op);
    case DType::kBytes: break;
  }
  MOELINK_THROW("cannot reduce dtype ", dtypeName(t));
}

void divideInPlace(void* buf, size_t n, DType t, double d) {
  switch (t) {
    case DType::kFloat32: {
      auto* p = static_cast<float*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] = static_cast<float>(p[i] / d);
      return;
    }
    case DType::kFloat64: {
      auto* p = static_cast<double*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] /= d;
      return;
    }
    case DType::kFloat16: {
      auto* p = static_cast<uint16_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] = floatToHalf(static_cast<float>(halfToFloat(p[i]) / d));
      return;
    }
    case DType::kBFloat16: {
      auto* p = static_cast<uint16_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] = floatToBf16(static_cast<float>(bf16ToFloat(p[i]) / d));
      return;
    }
    case DType::kComplex64: {
      auto* p = static_cast<std::complex<float>*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] /= static_cast<float>(d);
      return;
    }
    case DType::kComplex128: {
      auto* p = static_cast<std::complex<double>*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] /= d;
      return;
    }
    default: break;
  }
  MOELINK_THROW("cannot divide dtype ", dtypeName(t));
}

void reduceOrdered(void* out, const std::vector<const void*>& inputs, size_t count, DType t,
                   ReduceOp op, std::vector<char>& scratch) {
  if (inputs.empty() || count == 0) return;
  size_t bytes = count * elementSize(t);
  bool aliased = false;
  for (size_t i = 1; i < inputs.size(); ++i) aliased |= inputs[i] == out;
  void* acc = out;
  if (aliased) {
    if (scratch.size() < bytes) scratch.resize(bytes);
    acc = scratch.data();
  }
  if (acc != inputs[0]) std::memcpy(acc, inputs[0], bytes);
  for (size_t i = 1; i < inputs.size(); ++i) reduceInto(acc, inputs[i], count, t, op);
  if (acc != out) std::memcpy(out, acc, bytes);
}

}  // namespace moelink::collective
