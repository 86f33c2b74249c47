// F8: 8 float32 AVX lanes with the IEEE operators, for the files compiled with -mavx2 (and
// only those: include it nowhere else). In an anonymous namespace, so every function or
// template instantiated on it stays local to the AVX2 file that uses it.
#pragma once

#include <immintrin.h>

namespace normgrad {
namespace {

struct F8 {
  __m256 v;
  F8() = default;
  explicit F8(__m256 lanes) : v(lanes) {}
  explicit F8(float scalar) : v(_mm256_set1_ps(scalar)) {}
};
inline F8 operator+(F8 a, F8 b) { return F8(_mm256_add_ps(a.v, b.v)); }
inline F8 operator-(F8 a, F8 b) { return F8(_mm256_sub_ps(a.v, b.v)); }
inline F8 operator*(F8 a, F8 b) { return F8(_mm256_mul_ps(a.v, b.v)); }
inline F8 operator/(F8 a, F8 b) { return F8(_mm256_div_ps(a.v, b.v)); }

}  // namespace
}  // namespace normgrad
