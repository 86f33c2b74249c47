// activation_grad_math.h's math on 8 AVX lanes, a few independent vectors per iteration (the
// out-of-order core overlaps their dependency chains). Compiled with -mavx2 but never -mfma:
// every lane operation is the IEEE float32 (or, for the tanh GELU's argument, float64)
// operation the baseline loop does, so both give the same bits. Nothing here runs unless
// update_avx2() says the CPU has AVX2.
#include "activation_grad_math.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cstring>

#include "lanes_avx2.h"

namespace normgrad {
namespace {

struct Mask8 {
  __m256 m;
};
inline F8 operator-(F8 a) { return F8(_mm256_xor_ps(a.v, _mm256_set1_ps(-0.0f))); }
inline Mask8 operator<(F8 a, F8 b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ)}; }
inline Mask8 operator>=(F8 a, F8 b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_GE_OQ)}; }
inline Mask8 operator==(F8 a, F8 b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ)}; }
inline F8 select(Mask8 mask, F8 a, F8 b) { return F8(_mm256_blendv_ps(b.v, a.v, mask.m)); }
inline F8 at_least(F8 v, F8 floor) { return F8(_mm256_max_ps(v.v, floor.v)); }  // floor where v is NaN
inline F8 sign_select(F8 x, F8 a, F8 b) { return F8(_mm256_blendv_ps(b.v, a.v, x.v)); }
inline F8 flip_unless_negative(F8 x, F8 v) {
  return F8(_mm256_xor_ps(v.v, _mm256_andnot_ps(x.v, _mm256_set1_ps(-0.0f))));
}
inline F8 magnitude(F8 x) { return F8(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x.v)); }
inline F8 pow2_from_shifted(F8 shifted) {
  const int offset = 64 + 127 - 0x4b400000;  // 0x4b400000: 1.5 * 2^23's bits
  const __m256i bits = _mm256_add_epi32(_mm256_castps_si256(shifted.v), _mm256_set1_epi32(offset));
  return F8(_mm256_castsi256_ps(_mm256_slli_epi32(bits, 23))) * F8(0x1p-64f);
}
inline F8 head12(F8 x) { return F8(_mm256_and_ps(x.v, _mm256_castsi256_ps(_mm256_set1_epi32(0xfffff000)))); }

// The wide type: 8 float64 lanes as two halves of 4.
struct D8 {
  __m256d low, high;
  D8(__m256d l, __m256d h) : low(l), high(h) {}
  explicit D8(double scalar) : low(_mm256_set1_pd(scalar)), high(low) {}
};
inline D8 operator+(D8 a, D8 b) { return {_mm256_add_pd(a.low, b.low), _mm256_add_pd(a.high, b.high)}; }
inline D8 operator-(D8 a, D8 b) { return {_mm256_sub_pd(a.low, b.low), _mm256_sub_pd(a.high, b.high)}; }
inline D8 operator*(D8 a, D8 b) { return {_mm256_mul_pd(a.low, b.low), _mm256_mul_pd(a.high, b.high)}; }
inline D8 widen(F8 x) {
  return {_mm256_cvtps_pd(_mm256_castps256_ps128(x.v)), _mm256_cvtps_pd(_mm256_extractf128_ps(x.v, 1))};
}
inline F8 narrow(D8 x) { return F8(_mm256_set_m128(_mm256_cvtpd_ps(x.high), _mm256_cvtpd_ps(x.low))); }

template <Activation kind>
inline F8 grad_at(const float* dy, const float* x) {
  return activation_math::grad<kind>(F8(_mm256_loadu_ps(dy)), F8(_mm256_loadu_ps(x)));
}

// kVectors independent vectors per iteration: as many as the 16 AVX registers hold without
// spilling the chains (measured on Zen 3 with bench_activation_grad), then single vectors,
// then the last n < 8 elements in a zero-padded vector (the padded lanes are never stored).
template <Activation kind>
void lanes(const float* dy, const float* x, float* dx, size_t begin, size_t end) {
  constexpr size_t kVectors = kind == Activation::kSilu ? 4 : 3;
  size_t i = begin;
  for (; i + 8 * kVectors <= end; i += 8 * kVectors) {
    F8 out[kVectors];
    for (size_t k = 0; k < kVectors; ++k) out[k] = grad_at<kind>(dy + i + 8 * k, x + i + 8 * k);
    for (size_t k = 0; k < kVectors; ++k) _mm256_storeu_ps(dx + i + 8 * k, out[k].v);
  }
  for (; i + 8 <= end; i += 8) _mm256_storeu_ps(dx + i, grad_at<kind>(dy + i, x + i).v);
  if (i == end) return;
  alignas(32) float dy_block[8] = {}, x_block[8] = {};
  std::memcpy(dy_block, dy + i, (end - i) * sizeof(float));
  std::memcpy(x_block, x + i, (end - i) * sizeof(float));
  _mm256_store_ps(x_block, grad_at<kind>(dy_block, x_block).v);
  std::memcpy(dx + i, x_block, (end - i) * sizeof(float));
}

// swiglu_grad on 4 vectors per iteration, then single vectors, then a zero-padded one.
void swiglu_lanes(const float* dy, const float* gate, const float* up, float* dgate, float* dup, size_t begin,
                  size_t end) {
  constexpr size_t kVectors = 4;
  auto at = [&](size_t i, F8& dg, F8& du) {
    activation_math::swiglu_grad(F8(_mm256_loadu_ps(dy + i)), F8(_mm256_loadu_ps(gate + i)),
                                 F8(_mm256_loadu_ps(up + i)), dg, du);
  };
  size_t i = begin;
  for (; i + 8 * kVectors <= end; i += 8 * kVectors) {
    F8 dg[kVectors], du[kVectors];
    for (size_t k = 0; k < kVectors; ++k) at(i + 8 * k, dg[k], du[k]);
    for (size_t k = 0; k < kVectors; ++k) {
      _mm256_storeu_ps(dgate + i + 8 * k, dg[k].v);
      _mm256_storeu_ps(dup + i + 8 * k, du[k].v);
    }
  }
  F8 dg, du;
  for (; i + 8 <= end; i += 8) {
    at(i, dg, du);
    _mm256_storeu_ps(dgate + i, dg.v);
    _mm256_storeu_ps(dup + i, du.v);
  }
  if (i == end) return;
  alignas(32) float blocks[5][8] = {};
  std::memcpy(blocks[0], dy + i, (end - i) * sizeof(float));
  std::memcpy(blocks[1], gate + i, (end - i) * sizeof(float));
  std::memcpy(blocks[2], up + i, (end - i) * sizeof(float));
  activation_math::swiglu_grad(F8(_mm256_load_ps(blocks[0])), F8(_mm256_load_ps(blocks[1])),
                               F8(_mm256_load_ps(blocks[2])), dg, du);
  _mm256_store_ps(blocks[3], dg.v);
  _mm256_store_ps(blocks[4], du.v);
  std::memcpy(dgate + i, blocks[3], (end - i) * sizeof(float));
  std::memcpy(dup + i, blocks[4], (end - i) * sizeof(float));
}

// silu_mul on 4 vectors per iteration, then single vectors, then a zero-padded one.
void silu_mul_lanes(const float* gate, const float* up, float* y, size_t begin, size_t end) {
  constexpr size_t kVectors = 4;
  auto at = [&](size_t i) {
    return activation_math::silu_mul(F8(_mm256_loadu_ps(gate + i)), F8(_mm256_loadu_ps(up + i)));
  };
  size_t i = begin;
  for (; i + 8 * kVectors <= end; i += 8 * kVectors) {
    F8 out[kVectors];
    for (size_t k = 0; k < kVectors; ++k) out[k] = at(i + 8 * k);
    for (size_t k = 0; k < kVectors; ++k) _mm256_storeu_ps(y + i + 8 * k, out[k].v);
  }
  for (; i + 8 <= end; i += 8) _mm256_storeu_ps(y + i, at(i).v);
  if (i == end) return;
  alignas(32) float gate_block[8] = {}, up_block[8] = {};
  std::memcpy(gate_block, gate + i, (end - i) * sizeof(float));
  std::memcpy(up_block, up + i, (end - i) * sizeof(float));
  const F8 out = activation_math::silu_mul(F8(_mm256_load_ps(gate_block)), F8(_mm256_load_ps(up_block)));
  _mm256_store_ps(gate_block, out.v);
  std::memcpy(y + i, gate_block, (end - i) * sizeof(float));
}

// gelu_with_slope on 3 vectors per iteration (as GeluGrad's lanes), then single vectors,
// then a zero-padded one.
void gelu_with_slope_lanes(const float* x, float* y, float* slope, size_t begin, size_t end) {
  constexpr size_t kVectors = 3;
  auto at = [&](const float* from, F8& value, F8& derivative) {
    activation_math::gelu_with_slope(F8(_mm256_loadu_ps(from)), value, derivative);
  };
  size_t i = begin;
  for (; i + 8 * kVectors <= end; i += 8 * kVectors) {
    F8 values[kVectors], slopes[kVectors];
    for (size_t k = 0; k < kVectors; ++k) at(x + i + 8 * k, values[k], slopes[k]);
    for (size_t k = 0; k < kVectors; ++k) {
      _mm256_storeu_ps(y + i + 8 * k, values[k].v);
      _mm256_storeu_ps(slope + i + 8 * k, slopes[k].v);
    }
  }
  F8 value, derivative;
  for (; i + 8 <= end; i += 8) {
    at(x + i, value, derivative);
    _mm256_storeu_ps(y + i, value.v);
    _mm256_storeu_ps(slope + i, derivative.v);
  }
  if (i == end) return;
  alignas(32) float blocks[3][8] = {};
  std::memcpy(blocks[0], x + i, (end - i) * sizeof(float));
  at(blocks[0], value, derivative);
  _mm256_store_ps(blocks[1], value.v);
  _mm256_store_ps(blocks[2], derivative.v);
  std::memcpy(y + i, blocks[1], (end - i) * sizeof(float));
  std::memcpy(slope + i, blocks[2], (end - i) * sizeof(float));
}

}  // namespace

void silu_mul_avx2(const float* gate, const float* up, float* y, size_t begin, size_t end) {
  silu_mul_lanes(gate, up, y, begin, end);
}

void gelu_with_slope_avx2(const float* x, float* y, float* slope, size_t begin, size_t end) {
  gelu_with_slope_lanes(x, y, slope, begin, end);
}

void swiglu_grad_avx2(const float* dy, const float* gate, const float* up, float* dgate, float* dup, size_t begin,
                      size_t end) {
  swiglu_lanes(dy, gate, up, dgate, dup, begin, end);
}

void activation_grad_avx2(Activation kind, const float* dy, const float* x, float* dx, size_t begin, size_t end) {
  switch (kind) {
    case Activation::kSilu: lanes<Activation::kSilu>(dy, x, dx, begin, end); break;
    case Activation::kGeluErf: lanes<Activation::kGeluErf>(dy, x, dx, begin, end); break;
    case Activation::kGeluTanh: lanes<Activation::kGeluTanh>(dy, x, dx, begin, end); break;
  }
}

}  // namespace normgrad

#else
namespace normgrad {
// Not an x86 CPU: update_avx2() is false, so this is never called.
void activation_grad_avx2(Activation, const float*, const float*, float*, size_t, size_t) { __builtin_trap(); }
void swiglu_grad_avx2(const float*, const float*, const float*, float*, float*, size_t, size_t) { __builtin_trap(); }
void silu_mul_avx2(const float*, const float*, float*, size_t, size_t) { __builtin_trap(); }
void gelu_with_slope_avx2(const float*, float*, float*, size_t, size_t) { __builtin_trap(); }
}  // namespace normgrad
#endif
