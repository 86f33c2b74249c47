// SiLUGrad, GeluGrad, GeluTanhGrad (ops/activation_grad.py): dx = dy * f'(x) in float32, the
// math written once over a lane type: float in activation_grad.cc's baseline loop (branch-free,
// the compiler vectorizes it), 8 AVX lanes in activation_grad_avx2.cc. Every operation is one
// IEEE operation (compiled with -ffp-contract=off, never -mfma), so both give the same bits.
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

// The math below is written once for a lane type V: float here (the baseline loop), 8 AVX
// lanes in activation_grad_avx2.cc, both with the same operations in the same order. A lane
// type has + - * / and unary -, comparisons giving a mask, V(float) and the helpers below
// (select, at_least, sign_select, flip_unless_negative, magnitude, pow2_from_shifted, head12); its wide
// type (double here) has + - * with widen and narrow.
inline float select(bool mask, float a, float b) { return mask ? a : b; }

// v where v >= floor, else floor (a NaN v too): one max instruction on lanes.
inline float at_least(float v, float floor) { return v >= floor ? v : floor; }

// a where x's sign bit is set (x negative, -0 or a negative NaN), else b.
inline float sign_select(float x, float a, float b) { return (to_bits(x) >> 31) ? a : b; }

// v, negated where x's sign bit is clear: flip_unless_negative(x, x) is -|x|.
inline float flip_unless_negative(float x, float v) { return from_bits(to_bits(v) ^ (~to_bits(x) & 0x80000000u)); }

// |x|: x with its sign bit cleared.
inline float magnitude(float x) { return from_bits(to_bits(x) & 0x7fffffffu); }

// 2^n from shifted = n + 1.5 * 2^23 (n in its low mantissa bits, two's complement), n >= -149:
// 2^(n + 64) as exponent bits, times 2^-64.
inline float pow2_from_shifted(float shifted) {
  return from_bits((to_bits(shifted) - to_bits(12582912.0f) + (64u + 127u)) << 23) * 0x1p-64f;
}

// x with its low 12 mantissa bits cleared: a 12-bit head whose square is exact.
inline float head12(float x) { return from_bits(to_bits(x) & 0xfffff000u); }

inline double widen(float x) { return x; }
inline float narrow(double x) { return static_cast<float>(x); }

// exp(r) 2^n for the reduced r (|r| <= ln 2 / 2) and shifted = n + 1.5 * 2^23: 1 + r + r^2 p(r),
// p of degree 4 fitted for relative error (3.6e-9 with these float32 coefficients, as small as
// Cephes' expf polynomial of one degree more; Estrin's scheme: short dependency chains), times
// 2^n (n >= -149: a float, subnormal below -126, so results down to the subnormals round once).
template <class V>
inline V exp_reduced(V r, V shifted) {
  const V r2 = r * r;
  const V r4 = r2 * r2;
  const V p = (V(4.999999404e-1f) + V(1.666652113e-1f) * r) + (V(4.166818783e-2f) + V(8.368702605e-3f) * r) * r2 +
              V(1.382572926e-3f) * r4;
  return (p * r2 + (r + V(1.0f))) * pow2_from_shifted(shifted);
}

// exp(hi + lo) for hi + lo <= ~1 (lo small beside hi): a Cody-Waite reduction by n ln 2 that
// takes lo in (n ln 2's 9-bit head is exact), then exp_reduced. 0 below -103 (where exp is
// below 2^-148; and for a NaN hi: callers mask NaN x).
template <class V>
inline V exp_split(V hi, V lo) {
  const auto in_range = hi >= V(-103.0f);
  const V a = at_least(hi, V(-103.0f));
  const V b = select(in_range, lo, V(0.0f));
  const V shifted = (a + b) * V(1.44269504088896341f) + V(12582912.0f);  // 1.5 * 2^23: round to integer
  const V n = shifted - V(12582912.0f);                                  // in [-149, 2]
  const V r = (a - n * V(0.693359375f)) + (b - n * V(-2.12194440e-4f));
  return select(in_range, exp_reduced(r, shifted), V(0.0f));
}

// exp_split(hi, 0) without lo's operations: the same values.
template <class V>
inline V exp_single(V hi) {
  const auto in_range = hi >= V(-103.0f);
  const V a = at_least(hi, V(-103.0f));
  const V shifted = a * V(1.44269504088896341f) + V(12582912.0f);
  const V n = shifted - V(12582912.0f);
  const V r = (a - n * V(0.693359375f)) - n * V(-2.12194440e-4f);
  return select(in_range, exp_reduced(r, shifted), V(0.0f));
}

// s + c s (1 - s), s = sigmoid(v), from e = exp(-|v|) (neither s nor 1 - s by a subtraction
// from 1); the product term is 0 where s (1 - s) is (|v| past ~104, or infinite v).
template <class V>
struct SigmoidSlope {
  V sigmoid, slope;
};
template <class V>
inline SigmoidSlope<V> sigmoid_and_slope(V v, V e, V c) {
  const V big = V(1.0f) / (V(1.0f) + e);
  const V small = e * big;
  const V s = sign_select(v, small, big);
  const V spread = big * small;
  return {s, s + select(spread == V(0.0f), V(0.0f), c * spread)};
}
template <class V>
inline V sigmoid_slope_from(V v, V e, V c) {
  return sigmoid_and_slope(v, e, c).slope;
}

// sigmoid(gate) and silu'(gate) = sigmoid_slope_from(gate, exp(-|gate|), gate): SiLUGrad's,
// SwiGLUGrad's and SiLUMul's one source.
template <class V>
inline SigmoidSlope<V> silu_sigmoid_and_slope(V gate) {
  return sigmoid_and_slope(gate, exp_single(flip_unless_negative(gate, gate)), gate);
}

// sigmoid_slope_from for v = hi + lo (lo small beside hi).
template <class V>
inline V sigmoid_slope(V hi, V lo, V c) {
  return sigmoid_slope_from(hi, exp_split(flip_unless_negative(hi, hi), flip_unless_negative(hi, lo)), c);
}

// Phi(x) + x phi(x). E = exp(-x^2 / 2) with x^2 / 2 = h + l (x's 12-bit head squared is exact);
// Phi(-|x|) = erfc(a) / 2 = E erfcx(a) / 2, a = |x| / sqrt 2, erfcx(a) = t g(u) with
// t = 1 / (1 + a / 2) and g a degree-10 polynomial in u = (2t - 1.15) / 0.85 (a weighted
// Chebyshev fit of erfcx(a) / t over t in [0.15, 1], i.e. a <= 11.3, past which E is 0;
// relative error 5e-9, 1.8e-7 in float32 arithmetic). With the slope, the erf GELU itself,
// x Phi(x) (GeluWithSlope): x (1 - Phi(-|x|)) for x >= 0, and E (x / 2 erfcx(a)) below, where
// one rounding of the product keeps the subnormal results (x < -13.2) within an ulp; a NaN x
// gives NaN for both, gelu(-inf) is NaN (-inf times 0, as torch's).
template <class V>
struct GeluErf {
  V value, slope;
};
template <class V>
inline GeluErf<V> gelu_erf_and_slope(V x) {
  const V head = head12(x);
  const V tail = x - head;
  const V density = exp_split(V(-0.5f) * (head * head), V(-0.5f) * (tail * (x + head)));  // exp(-x^2 / 2)
  const V t = V(1.0f) / (V(1.0f) + magnitude(x) * V(0.353553390593273762f));  // a / 2 = |x| / sqrt 8
  const V u = t * V(2.35294118f) + V(-1.35294118f);
  const V u2 = u * u;
  const V u4 = u2 * u2;
  const V g =
      ((V(5.655282736e-01f) + V(3.285916448e-01f) * u) + (V(1.057643220e-01f) + V(6.847580429e-03f) * u) * u2) +
      ((V(-6.591075566e-03f) + V(-7.633089554e-04f) * u) + (V(6.714848569e-04f) + V(1.802346378e-05f) * u) * u2) * u4 +
      ((V(-8.070564218e-05f) + V(6.516255326e-06f) * u) + V(7.251941497e-06f) * u2) * (u4 * u4);
  const V erfcx = t * g;
  const V tail_cdf = V(0.5f) * (density * erfcx);  // Phi(-|x|)
  const auto negative = x < V(0.0f);
  const V cdf = select(negative, tail_cdf, V(1.0f) - tail_cdf);
  const V slope = cdf + select(density == V(0.0f), V(0.0f), x * (density * V(0.398942280401432678f)));
  return {select(negative, density * ((V(0.5f) * x) * erfcx), x * cdf), slope};
}
template <class V>
inline V gelu_erf_slope(V x) {
  return gelu_erf_and_slope(x).slope;
}

// torch's gelu(approximate="tanh"): x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3). 2u and
// its derivative are computed in double, 2u split into two floats: exp(-|2u|) changes by |2u|
// times 2u's relative error (x = -9: 2u = -65, and float32 arithmetic gave 170 ulps).
template <class V>
inline V gelu_tanh_slope(V x) {
  using W = decltype(widen(x));
  const W wide = widen(x);
  const W square = wide * wide;
  const W v = W(1.5957691216057308) * (wide * (W(1.0) + W(0.044715) * square));  // 2 sqrt(2/pi) ...
  const V hi = narrow(v);
  const V lo = narrow(v - widen(hi));
  const V c = narrow(W(1.5957691216057308) * (wide * (W(1.0) + W(0.134145) * square)));
  return sigmoid_slope(hi, lo, c);
}

// dy * f'(x), a NaN x giving NaN.
template <Activation kind, class V>
inline V grad(V dy, V x) {
  V slope;
  if (kind == Activation::kSilu) {
    slope = silu_sigmoid_and_slope(x).slope;
  } else if (kind == Activation::kGeluErf) {
    slope = gelu_erf_slope(x);
  } else {
    slope = gelu_tanh_slope(x);
  }
  return dy * select(x == x, slope, x);
}

// SwiGLUGrad (ops/swiglu_grad.py), y = silu(gate) up: dgate = (dy up) silu'(gate), bitwise
// SiLUGrad's dx for dy up; dup = dy (gate sigmoid(gate)). A NaN gate gives NaN for both.
template <class V>
inline void swiglu_grad(V dy, V gate, V up, V& dgate, V& dup) {
  const SigmoidSlope<V> parts = silu_sigmoid_and_slope(gate);
  dgate = (dy * up) * select(gate == gate, parts.slope, gate);
  dup = dy * (gate * parts.sigmoid);
}

// SiLUMul (ops/silu_mul.py): y = (gate sigmoid(gate)) up, with swiglu_grad's silu(gate) bits
// (only the sigmoid is computed: the slope's operations are dead and compiled away).
template <class V>
inline V silu_mul(V gate, V up) {
  return (gate * silu_sigmoid_and_slope(gate).sigmoid) * up;
}

// GeluWithSlope (ops/gelu_with_slope.py): y = x Phi(x) and slope = Phi(x) + x phi(x), NaN for a
// NaN x as in grad, so that Mul(dy, slope) is GeluGrad's dx bitwise.
template <class V>
inline void gelu_with_slope(V x, V& y, V& slope) {
  const GeluErf<V> parts = gelu_erf_and_slope(x);
  y = parts.value;
  slope = select(x == x, parts.slope, x);
}

// Two independent halves of [begin, end) per iteration: twice the instruction-level
// parallelism for the latency-bound chain; each element's arithmetic is the same.
template <Activation kind>
inline void loop(const float* dy, const float* x, float* dx, size_t begin, size_t end) {
  const size_t half = (end - begin) / 2;
  const size_t mid = begin + half;
  for (size_t i = begin; i < mid; ++i) {
    dx[i] = grad<kind>(dy[i], x[i]);
    dx[i + half] = grad<kind>(dy[i + half], x[i + half]);
  }
  for (size_t i = begin + 2 * half; i < end; ++i) dx[i] = grad<kind>(dy[i], x[i]);
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

// SwiGLUGrad over [begin, end).
inline void swiglu_grad_loop(const float* dy, const float* gate, const float* up, float* dgate, float* dup,
                             size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) activation_math::swiglu_grad(dy[i], gate[i], up[i], dgate[i], dup[i]);
}

// SiLUMul over [begin, end).
inline void silu_mul_loop(const float* gate, const float* up, float* y, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) y[i] = activation_math::silu_mul(gate[i], up[i]);
}

// GeluWithSlope over [begin, end).
inline void gelu_with_slope_loop(const float* x, float* y, float* slope, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) activation_math::gelu_with_slope(x[i], y[i], slope[i]);
}

// The loops compiled with -mavx2 (activation_grad_avx2.cc); run only where update_avx2() is true.
void silu_mul_avx2(const float* gate, const float* up, float* y, size_t begin, size_t end);
void swiglu_grad_avx2(const float* dy, const float* gate, const float* up, float* dgate, float* dup, size_t begin,
                      size_t end);
void activation_grad_avx2(Activation kind, const float* dy, const float* x, float* dx, size_t begin, size_t end);
void gelu_with_slope_avx2(const float* x, float* y, float* slope, size_t begin, size_t end);

}  // namespace normgrad
