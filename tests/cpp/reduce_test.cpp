#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "moelink/collective/reduce.h"

using namespace moelink::collective;

TEST(Reduce, Float32AllOps) {
  std::vector<float> a{1, -2, 3, 4}, b{5, 6, -7, 0.5};
  auto run = [&](ReduceOp op) {
    auto acc = a;
    reduceInto(acc.data(), b.data(), acc.size(), DType::kFloat32, op);
    return acc;
  };
  EXPECT_EQ(run(ReduceOp::kSum), (std::vector<float>{6, 4, -4, 4.5}));
  EXPECT_EQ(run(ReduceOp::kProduct), (std::vector<float>{5, -12, -21, 2}));
  EXPECT_EQ(run(ReduceOp::kMin), (std::vector<float>{1, -2, -7, 0.5}));
  EXPECT_EQ(run(ReduceOp::kMax), (std::vector<float>{5, 6, 3, 4}));
}

TEST(Reduce, IntegerBitwise) {
  std::vector<int32_t> a{0b1100, 7}, b{0b1010, 1};
  auto acc = a;
  reduceInto(acc.data(), b.data(), 2, DType::kInt32, ReduceOp::kBand);
  EXPECT_EQ(acc, (std::vector<int32_t>{0b1000, 1}));
  acc = a;
  reduceInto(acc.data(), b.data(), 2, DType::kInt32, ReduceOp::kBor);
  EXPECT_EQ(acc, (std::vector<int32_t>{0b1110, 7}));
  acc = a;
  reduceInto(acc.data(), b.data(), 2, DType::kInt32, ReduceOp::kBxor);
  EXPECT_EQ(acc, (std::vector<int32_t>{0b0110, 6}));
}

TEST(Reduce, BoolIsLogical) {
  std::vector<uint8_t> a{0, 1, 1, 0}, b{0, 0, 1, 1};
  auto acc = a;
  reduceInto(acc.data(), b.data(), 4, DType::kBool, ReduceOp::kSum);
  EXPECT_EQ(acc, (std::vector<uint8_t>{0, 1, 1, 1}));
  acc = a;
  reduceInto(acc.data(), b.data(), 4, DType::kBool, ReduceOp::kProduct);
  EXPECT_EQ(acc, (std::vector<uint8_t>{0, 0, 1, 0}));
}

TEST(Reduce, HalfAndBFloat16RoundTrip) {
  // 1.5 + 2.25 = 3.75 is exact in both formats.
  uint16_t h1 = 0x3E00, h2 = 0x4080;  // half 1.5, 2.25
  reduceInto(&h1, &h2, 1, DType::kFloat16, ReduceOp::kSum);
  EXPECT_EQ(h1, 0x4380);  // half 3.75
  uint16_t b1 = 0x3FC0, b2 = 0x4010;  // bf16 1.5, 2.25
  reduceInto(&b1, &b2, 1, DType::kBFloat16, ReduceOp::kSum);
  EXPECT_EQ(b1, 0x4070);  // bf16 3.75
  uint16_t half_two = 0x4000;  // 2.0 / 4 = 0.5
  divideInPlace(&half_two, 1, DType::kFloat16, 4);
  EXPECT_EQ(half_two, 0x3800);
}

TEST(Reduce, ComplexProduct) {
  std::vector<std::complex<float>> a{{1, 2}}, b{{3, -1}};
  reduceInto(a.data(), b.data(), 1, DType::kComplex64, ReduceOp::kProduct);
  EXPECT_EQ(a[0], std::complex<float>(5, 5));
}

TEST(Reduce, OrderedHandlesAliasing) {
  std::vector<double> x0{1, 2}, x1{10, 20}, x2{100, 200};
  std::vector<char> scratch;
  // out aliases the middle input: the result must not depend on the aliasing.
  reduceOrdered(x1.data(), {x0.data(), x1.data(), x2.data()}, 2, DType::kFloat64, ReduceOp::kSum, scratch);
  EXPECT_EQ(x1, (std::vector<double>{111, 222}));
}

// In input order, bit for bit, wherever `out` is: a float sum whose value depends on the order
// ((1e8 + 1) - 1e8 ... ), every count around the 64-byte blocks, `out` each input or none.
TEST(Reduce, OrderedIsInInputOrderWhereverTheOutputIs) {
  for (size_t n = 1; n <= 5; ++n)
    for (size_t count : {1u, 15u, 16u, 17u, 33u, 100u})
      for (size_t where = 0; where <= n; ++where) {  // out is inputs[where]; n: a buffer of its own
        std::vector<std::vector<float>> in(n, std::vector<float>(count));
        for (size_t j = 0; j < n; ++j)
          for (size_t i = 0; i < count; ++i) in[j][i] = j % 2 ? -1e8f + static_cast<float>(i) : 1e8f * (j + 1) + 1.0f;
        std::vector<float> want = in[0];
        for (size_t j = 1; j < n; ++j)
          for (size_t i = 0; i < count; ++i) want[i] = want[i] + in[j][i];
        std::vector<float> own(count, 7.0f);
        std::vector<const void*> ptrs;
        for (auto& v : in) ptrs.push_back(v.data());
        float* out = where < n ? in[where].data() : own.data();
        std::vector<char> scratch;
        reduceOrdered(out, ptrs, count, DType::kFloat32, ReduceOp::kSum, scratch);
        for (size_t i = 0; i < count; ++i)
          ASSERT_EQ(out[i], want[i]) << "n " << n << " count " << count << " out at " << where << " i " << i;
      }
}

// reduceTwo with `out` as either operand or apart, against one element at a time: the blocked
// loops and their tails for every width, and MIN's choice between +0 and -0 kept in order.
TEST(Reduce, TwoOperandsWhereverTheOutputIs) {
  auto check = [](auto zero, DType t, ReduceOp op) {
    using T = decltype(zero);
    for (size_t count : {1u, 7u, 8u, 63u, 64u, 65u, 200u}) {
      std::vector<T> a(count), b(count);
      for (size_t i = 0; i < count; ++i) {
        a[i] = static_cast<T>((i * 7) % 13);
        b[i] = static_cast<T>((i * 5) % 11 + 1);
      }
      std::vector<T> want(count);
      for (size_t i = 0; i < count; ++i) want[i] = op == ReduceOp::kProduct ? static_cast<T>(a[i] * b[i]) : static_cast<T>(a[i] + b[i]);
      for (int where = 0; where < 3; ++where) {
        std::vector<T> x = a, y = b, o(count);
        T* out = where == 0 ? x.data() : where == 1 ? y.data() : o.data();
        reduceTwo(out, x.data(), y.data(), count, t, op);
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(out[i], want[i]) << "count " << count << " out " << where;
      }
    }
  };
  check(float{}, DType::kFloat32, ReduceOp::kSum);
  check(double{}, DType::kFloat64, ReduceOp::kProduct);
  check(int8_t{}, DType::kInt8, ReduceOp::kSum);
  check(uint8_t{}, DType::kUInt8, ReduceOp::kProduct);
  check(int64_t{}, DType::kInt64, ReduceOp::kSum);
  float pz = 0.0f, nz = -0.0f, r;
  reduceTwo(&r, &pz, &nz, 1, DType::kFloat32, ReduceOp::kMin);
  EXPECT_FALSE(std::signbit(r));
  reduceTwo(&r, &nz, &pz, 1, DType::kFloat32, ReduceOp::kMin);
  EXPECT_TRUE(std::signbit(r));
}

TEST(Reduce, UnsupportedCombinationsAreNamed) {
  EXPECT_NE(reduceUnsupportedReason(DType::kFloat32, ReduceOp::kBand), "");
  EXPECT_NE(reduceUnsupportedReason(DType::kComplex64, ReduceOp::kMax), "");
  EXPECT_NE(reduceUnsupportedReason(DType::kInt32, ReduceOp::kAvg), "");
  EXPECT_EQ(reduceUnsupportedReason(DType::kInt32, ReduceOp::kBxor), "");
}
