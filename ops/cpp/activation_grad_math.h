// SiLUGrad, GeluGrad, GeluTanhGrad (ops/activation_grad.py): dx = dy * f'(x) in float32, one
// branch-free loop per activation that the compiler vectorizes. Every operation is one IEEE
// float32 operation (compiled with -ffp-contract=off, never -mfma), so activation_grad.cc's
// baseline loop and activation_grad_avx2.cc's -mavx2 copy give the same bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace normgrad {

enum class Activation : int { kSilu = 0, kGeluErf = 1, kGeluTanh = 2 };

namespace activation_math {

inline float from_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

inline uint32_t to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

// exp(hi + lo) for hi + lo <= ~1 (lo small beside hi, or 0): Cephes' expf polynomial after a
// Cody-Waite reduction by n ln 2 that takes lo in, times 2^n (n >= -149: a float, subnormal
// below -126, so results down to the subnormals round once). 0 below -103 (where exp is
// below 2^-148; and for a NaN hi: callers mask NaN x). The loop is latency-bound: the
// steps are ordered for short dependency chains (Estrin's scheme for the polynomial).
inline float exp_split(float hi, float lo) {
  const bool in_range = hi >= -103.0f;
  const float a = in_range ? hi : -103.0f;
  const float b = in_range ? lo : 0.0f;
  const float shifted = (a + b) * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23: round to integer
  const float n = shifted - 12582912.0f;                             // in [-149, 2]
  const float r = (a - n * 0.693359375f) + (b - n * -2.12194440e-4f);  // n * ln 2's 9-bit head is exact
  const float r2 = r * r;
  const float r4 = r2 * r2;
  const float p = (5.0000001201e-1f + 1.6666665459e-1f * r) + (4.1665795894e-2f + 8.3334519073e-3f * r) * r2 +
                  (1.3981999507e-3f + 1.9875691500e-4f * r) * r4;
  // shifted's low mantissa bits hold n (two's complement): 2^(n + 64) as exponent bits, times 2^-64
  const float scale = from_bits((to_bits(shifted) - to_bits(12582912.0f) + (64u + 127u)) << 23) * 0x1p-64f;
  const float y = (p * r2 + (r + 1.0f)) * scale;
  return in_range ? y : 0.0f;
}

// s + c s (1 - s), s = sigmoid(v) for v = hi + lo (lo small beside hi, or 0), with s and 1 - s
// from e = exp(-|v|) (neither by a subtraction from 1); the product term is 0 where s (1 - s)
// is (|v| past ~104, or infinite v).
inline float sigmoid_slope(float hi, float lo, float c) {
  const bool negative = hi < 0.0f;
  const float e = exp_split(negative ? hi : -hi, negative ? lo : -lo);
  const float big = 1.0f / (1.0f + e);
  const float small = e * big;
  const float s = negative ? small : big;
  const float spread = big * small;
  return s + (spread == 0.0f ? 0.0f : c * spread);
}

// Phi(x) + x phi(x). E = exp(-x^2 / 2) with x^2 / 2 = h + l (x's 12-bit head squared is exact);
// Phi(-|x|) = erfc(a) / 2 = E erfcx(a) / 2, a = |x| / sqrt 2, erfcx(a) = t g(u) with
// t = 1 / (1 + a / 2) and g a degree-10 polynomial in u = (2t - 1.15) / 0.85 (a weighted
// Chebyshev fit of erfcx(a) / t over t in [0.15, 1], i.e. a <= 11.3, past which E is 0;
// relative error 5e-9, 1.8e-7 in float32 arithmetic).
inline float gelu_erf_slope(float x) {
  const float head = from_bits(to_bits(x) & 0xfffff000u);
  const float tail = x - head;
  const float h = 0.5f * (head * head);
  const float l = 0.5f * (tail * (x + head));
  const float density = exp_split(-h, -l);  // exp(-x^2 / 2)
  const float a = (x < 0.0f ? -x : x) * 0.707106781186547524f;
  const float t = 1.0f / (1.0f + 0.5f * a);
  const float u = t * 2.35294118f + -1.35294118f;
  const float u2 = u * u;
  const float u4 = u2 * u2;
  const float g = ((5.655282736e-01f + 3.285916448e-01f * u) + (1.057643220e-01f + 6.847580429e-03f * u) * u2) +
                  ((-6.591075566e-03f + -7.633089554e-04f * u) + (6.714848569e-04f + 1.802346378e-05f * u) * u2) * u4 +
                  ((-8.070564218e-05f + 6.516255326e-06f * u) + 7.251941497e-06f * u2) * (u4 * u4);
  const float tail_cdf = 0.5f * (density * (t * g));  // Phi(-|x|)
  const float cdf = x >= 0.0f ? 1.0f - tail_cdf : tail_cdf;
  return cdf + (density == 0.0f ? 0.0f : x * (density * 0.398942280401432678f));
}

// torch's gelu(approximate="tanh"): x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3). 2u and
// its derivative are computed in double, 2u split into two floats: exp(-|2u|) changes by |2u|
// times 2u's relative error (x = -9: 2u = -65, and float32 arithmetic gave 170 ulps).
inline float gelu_tanh_slope(float x) {
  const double wide = x;
  const double v = 1.5957691216057308 * (wide * (1.0 + 0.044715 * (wide * wide)));  // 2 sqrt(2/pi) ...
  const float hi = static_cast<float>(v);
  const float lo = static_cast<float>(v - static_cast<double>(hi));
  const float c = static_cast<float>(1.5957691216057308 * (wide * (1.0 + 0.134145 * (wide * wide))));
  return sigmoid_slope(hi, lo, c);
}

template <Activation kind>
inline float slope(float x) {
  if (kind == Activation::kSilu) return sigmoid_slope(x, 0.0f, x);
  if (kind == Activation::kGeluErf) return gelu_erf_slope(x);
  return gelu_tanh_slope(x);
}

// Two independent halves of [begin, end) per iteration: twice the instruction-level
// parallelism for the latency-bound chain; each element's arithmetic is the same.
template <Activation kind>
inline void loop(const float* dy, const float* x, float* dx, size_t begin, size_t end) {
  const size_t half = (end - begin) / 2;
  const size_t mid = begin + half;
  for (size_t i = begin; i < mid; ++i) {
    const float xa = x[i], xb = x[i + half];
    const float fa = slope<kind>(xa), fb = slope<kind>(xb);
    dx[i] = dy[i] * (xa == xa ? fa : xa);
    dx[i + half] = dy[i + half] * (xb == xb ? fb : xb);
  }
  for (size_t i = begin + 2 * half; i < end; ++i) {
    const float xi = x[i];
    dx[i] = dy[i] * (xi == xi ? slope<kind>(xi) : xi);
  }
}

}  // namespace activation_math

// dx[i] = dy[i] * f'(x[i]) for i in [begin, end).
inline void activation_grad_loop(Activation kind, const float* dy, const float* x, float* dx, size_t begin,
                                 size_t end) {
  switch (kind) {
    case Activation::kSilu: activation_math::loop<Activation::kSilu>(dy, x, dx, begin, end); break;
    case Activation::kGeluErf: activation_math::loop<Activation::kGeluErf>(dy, x, dx, begin, end); break;
    case Activation::kGeluTanh: activation_math::loop<Activation::kGeluTanh>(dy, x, dx, begin, end); break;
  }
}

// The loop compiled with -mavx2 (activation_grad_avx2.cc); run only where update_avx2() is true.
void activation_grad_avx2(Activation kind, const float* dy, const float* x, float* dx, size_t begin, size_t end);

}  // namespace normgrad
