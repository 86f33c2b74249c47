// SoftmaxCrossEntropy's row passes (ops/softmax_cross_entropy.py), written once for a lane
// traits type L: PortableLanes below (8 floats in a loop) or the AVX2 lanes of
// softmax_cross_entropy_avx2.cc. Each step is one IEEE float32 operation per lane in the same
// order (a*b+c only where written as fma: one rounding on both, std::fma and the FMA
// instruction), the files are compiled with -ffp-contract=off, and the tails and lane
// reductions are the same scalar code, so both give the same bits. The scalar helpers are
// static (each file keeps its own compiled copy: the AVX2 file's must never serve the other).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace normgrad {

// exp(x) for x <= 0 or NaN (a logit minus its row's largest): Cephes' expf, range-reduced by
// n = floor(x log2(e) + 1/2), a degree-5 polynomial of r = x - n ln(2) (ln(2) split in two),
// times 2**n; 0 below ln(2**-126) (-inf included), NaN for NaN. Relative error below 2e-7.
namespace exp_constants {
constexpr float kLow = -87.3365478515625f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kMinusLn2High = -0.693359375f;
constexpr float kMinusLn2Low = 2.12194440e-4f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_constants

static inline float exp_nonpositive(float x) {
  using namespace exp_constants;
  if (x < kLow) return 0.0f;
  const float n = std::floor(std::fma(x, kLog2e, 0.5f));
  const float r = std::fma(n, kMinusLn2Low, std::fma(n, kMinusLn2High, x));
  float p = kP[0];
  for (int k = 1; k < 6; ++k) p = std::fma(p, r, kP[k]);
  const float y = std::fma(p, r * r, r) + 1.0f;
  const int32_t exponent = n == n ? static_cast<int32_t>(n) : 0;  // NaN: y is NaN already
  const uint32_t bits = static_cast<uint32_t>(exponent + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// The larger of a and b as _mm256_max_ps gives it: b when either is NaN.
static inline float lane_max(float a, float b) { return a > b ? a : b; }

struct PortableLanes {
  struct V {
    float f[8];
  };
  static V load(const float* p) {
    V v;
    std::memcpy(v.f, p, sizeof v.f);
    return v;
  }
  static void store(float* p, const V& v) { std::memcpy(p, v.f, sizeof v.f); }
  static V splat(float s) {
    V v;
    for (float& f : v.f) f = s;
    return v;
  }
  static V max(const V& a, const V& b) {
    V v;
    for (int k = 0; k < 8; ++k) v.f[k] = lane_max(a.f[k], b.f[k]);
    return v;
  }
  static V add(const V& a, const V& b) {
    V v;
    for (int k = 0; k < 8; ++k) v.f[k] = a.f[k] + b.f[k];
    return v;
  }
  static V sub(const V& a, const V& b) {
    V v;
    for (int k = 0; k < 8; ++k) v.f[k] = a.f[k] - b.f[k];
    return v;
  }
  static V mul(const V& a, const V& b) {
    V v;
    for (int k = 0; k < 8; ++k) v.f[k] = a.f[k] * b.f[k];
    return v;
  }
  static V exp_minus(const V& x, float m) {  // exp_nonpositive(x - m) per lane
    V v;
    for (int k = 0; k < 8; ++k) v.f[k] = exp_nonpositive(x.f[k] - m);
    return v;
  }
};

struct SoftmaxRow {
  float max;   // the row's largest logit (NaN-skipping as lane_max; a NaN makes sum NaN)
  double sum;  // sum_c exp(x_c - max)
};

// Lane groups per float32 partial sum: 4 interleaved accumulators over blocks of this many
// groups, each block's then added pairwise in float32 (a fixed tree) to two float64 terms of
// the row's sum.
constexpr size_t kExpSumGroups = 32;

// Writes exp(z_c - max) to e[0, n) (e may be x) and returns (max, their sum), with z = x, or
// z = x + bias (float32) when bias is not null, added in both passes (the same bits; cheaper
// than storing z and reading it back). The max and each block's exp sum are reduced as trees
// of 8-lane vectors (short serial chains: attention's rows are only 128 wide), the tails in
// order: a fixed order, rows never split.
template <class L>
SoftmaxRow softmax_row(const float* x, const float* bias, float* e, size_t n) {
  using V = typename L::V;
  alignas(32) float lanes[8];
  size_t c = 0;
  V most[4] = {L::splat(-INFINITY), L::splat(-INFINITY), L::splat(-INFINITY), L::splat(-INFINITY)};
  auto z = [&](size_t at) { return bias != nullptr ? L::add(L::load(x + at), L::load(bias + at)) : L::load(x + at); };
  auto z_scalar = [&](size_t at) { return bias != nullptr ? x[at] + bias[at] : x[at]; };
  for (; c + 32 <= n; c += 32) {
    for (int a = 0; a < 4; ++a) most[a] = L::max(most[a], z(c + 8 * a));
  }
  for (; c + 8 <= n; c += 8) most[0] = L::max(most[0], z(c));
  L::store(lanes, L::max(L::max(most[0], most[1]), L::max(most[2], most[3])));
  // (a NaN entry makes the sum NaN whatever m is: exp of NaN is NaN)
  float m = lane_max(lane_max(lane_max(lanes[0], lanes[1]), lane_max(lanes[2], lanes[3])),
                     lane_max(lane_max(lanes[4], lanes[5]), lane_max(lanes[6], lanes[7])));
  for (; c < n; ++c) m = lane_max(m, z_scalar(c));
  double sum = 0.0;
  c = 0;
  while (c + 8 <= n) {
    V block[4] = {L::splat(0.0f), L::splat(0.0f), L::splat(0.0f), L::splat(0.0f)};
    for (size_t g = 0; g < kExpSumGroups && c + 8 <= n; ++g, c += 8) {
      const V v = L::exp_minus(z(c), m);
      L::store(e + c, v);
      block[g % 4] = L::add(block[g % 4], v);
    }
    L::store(lanes, L::add(L::add(block[0], block[1]), L::add(block[2], block[3])));
    sum += static_cast<double>((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
           static_cast<double>((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  }
  for (; c < n; ++c) {
    e[c] = exp_nonpositive(z_scalar(c) - m);
    sum += e[c];
  }
  return {m, sum};
}

// e[0, n) *= scale; then, when total is not null, total[0, n) += e[0, n) (float32).
template <class L>
void scale_row(float* e, size_t n, float scale, float* total) {
  const typename L::V factor = L::splat(scale);
  size_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const typename L::V v = L::mul(L::load(e + c), factor);
    L::store(e + c, v);
    if (total != nullptr) L::store(total + c, L::add(L::load(total + c), v));
  }
  for (; c < n; ++c) {
    e[c] *= scale;
    if (total != nullptr) total[c] += e[c];
  }
}

// The AVX2 and FMA lanes; call only when softmax_cross_entropy_avx2() (the CPU has both and
// NORMGRAD_KERNELS is not "generic").
bool softmax_cross_entropy_avx2();
SoftmaxRow softmax_row_avx2(const float* x, const float* bias, float* e, size_t n);
void scale_row_avx2(float* e, size_t n, float scale, float* total);

}  // namespace normgrad
