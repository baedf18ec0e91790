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

// out[i] = f(a[i], b[i]), where `out` may be `a` or `b` (the same elements, never a partial
// overlap): a loop per case, so that the compiler sees the alias and vectorizes each.
template <typename T, typename F>
void zip(T* out, const T* a, const T* b, size_t n, F f) {
  if (out == a) {
    for (size_t i = 0; i < n; ++i) out[i] = f(out[i], b[i]);
  } else if (out == b) {
    for (size_t i = 0; i < n; ++i) out[i] = f(a[i], out[i]);
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = f(a[i], b[i]);
  }
}

template <typename T>
void reduceTyped(T* out, const T* a, const T* b, size_t n, ReduceOp op) {
  switch (op) {  // the common cases as loops the compiler vectorizes
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return zip(out, a, b, n, [](T x, T y) { return static_cast<T>(x + y); });
    case ReduceOp::kProduct: return zip(out, a, b, n, [](T x, T y) { return static_cast<T>(x * y); });
    default:
      for (size_t i = 0; i < n; ++i) {
        if constexpr (std::is_floating_point_v<T>)
          out[i] = applyFloatOp(a[i], b[i], op);
        else
          out[i] = applyOp(a[i], b[i], op);
      }
  }
}

template <typename T>
void reduceComplex(std::complex<T>* out, const std::complex<T>* a, const std::complex<T>* b, size_t n, ReduceOp op) {
  for (size_t i = 0; i < n; ++i) out[i] = op == ReduceOp::kProduct ? a[i] * b[i] : a[i] + b[i];
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void reduce16(uint16_t* out, const uint16_t* a, const uint16_t* b, size_t n, ReduceOp op) {
  for (size_t i = 0; i < n; ++i) out[i] = FromF(applyFloatOp(ToF(a[i]), ToF(b[i]), op));
}

void reduceBool(uint8_t* out, const uint8_t* x, const uint8_t* y, size_t n, ReduceOp op) {
  for (size_t i = 0; i < n; ++i) {
    bool a = x[i] != 0, b = y[i] != 0, r;
    switch (op) {
      case ReduceOp::kSum: case ReduceOp::kMax: case ReduceOp::kBor: r = a || b; break;
      case ReduceOp::kProduct: case ReduceOp::kMin: case ReduceOp::kBand: r = a && b; break;
      case ReduceOp::kBxor: r = a != b; break;
      default: r = a;
    }
    out[i] = r;
  }
}

template <typename T>
void typed(void* out, const void* a, const void* b, size_t n, ReduceOp op) {
  reduceTyped(static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), n, op);
}

template <typename T>
void complexTyped(void* out, const void* a, const void* b, size_t n, ReduceOp op) {
  using C = std::complex<T>;
  reduceComplex(static_cast<C*>(out), static_cast<const C*>(a), static_cast<const C*>(b), n, op);
}

}  // namespace

void reduceTwo(void* out, const void* a, const void* b, size_t n, DType t, ReduceOp op) {
  auto* o16 = static_cast<uint16_t*>(out);
  auto* a16 = static_cast<const uint16_t*>(a);
  auto* b16 = static_cast<const uint16_t*>(b);
  switch (t) {
    case DType::kFloat32: return typed<float>(out, a, b, n, op);
    case DType::kFloat64: return typed<double>(out, a, b, n, op);
    case DType::kFloat16: return reduce16<halfToFloat, floatToHalf>(o16, a16, b16, n, op);
    case DType::kBFloat16: return reduce16<bf16ToFloat, floatToBf16>(o16, a16, b16, n, op);
    case DType::kInt8: return typed<int8_t>(out, a, b, n, op);
    case DType::kInt16: return typed<int16_t>(out, a, b, n, op);
    case DType::kInt32: return typed<int32_t>(out, a, b, n, op);
    case DType::kInt64: return typed<int64_t>(out, a, b, n, op);
    case DType::kUInt8: return typed<uint8_t>(out, a, b, n, op);
    case DType::kBool:
      return reduceBool(static_cast<uint8_t*>(out), static_cast<const uint8_t*>(a), static_cast<const uint8_t*>(b), n,
                        op);
    case DType::kComplex64: return complexTyped<float>(out, a, b, n, op);
    case DType::kComplex128: return complexTyped<double>(out, a, b, n, op);
    case DType::kBytes: break;
  }
  MOELINK_THROW("cannot reduce dtype ", dtypeName(t));
}

void reduceInto(void* acc, const void* src, size_t n, DType t, ReduceOp op) { reduceTwo(acc, acc, src, n, t, op); }

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
  const size_t n = inputs.size(), bytes = count * elementSize(t);
  if (n == 1) {
    if (out != inputs[0]) std::memcpy(out, inputs[0], bytes);
    return;
  }
  // The running result goes into `out` unless an input still to be read after the first
  // step is `out` itself; then into scratch, with the last step writing `out`. No copies.
  bool aliased = false;
  for (size_t i = 2; i < n; ++i) aliased |= inputs[i] == out;
  void* acc = out;
  if (aliased) {
    if (scratch.size() < bytes) scratch.resize(bytes);
    acc = scratch.data();
  }
  const size_t last = aliased ? n - 1 : n;  // inputs reduced into acc (n >= 3 when aliased)
  reduceTwo(acc, inputs[0], inputs[1], count, t, op);
  for (size_t i = 2; i < last; ++i) reduceInto(acc, inputs[i], count, t, op);
  if (aliased) reduceTwo(out, acc, inputs[n - 1], count, t, op);
}

}  // namespace moelink::collective
