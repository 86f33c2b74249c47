// SafeSoftmax's row (ops/safe_softmax.py), written once for a lane traits type L: PortableLanes
// or AVX2Lanes (softmax_cross_entropy_math.h, softmax_avx2_lanes.h), on SoftmaxCrossEntropy's
// exp (L::exp_minus, exp_nonpositive) and scale_row. One IEEE float32 operation per lane in
// the same order on both (fused a*b+c only inside the exp, written as fma), the same scalar
// tails and lane reductions: the same bits. Its reductions are trees of 8-lane vectors (the
// row's max and each block's exp sum), shorter than SoftmaxCrossEntropy's lane-by-lane ones:
// attention's rows are short (128 scores), where those serial chains cost as much as the exps.
#pragma once

#include <cstddef>
#include <cstring>

#include "softmax_cross_entropy_math.h"

namespace normgrad {

// y[0, n) = softmax(x[0, n)), or 0 when its sum is NaN (a NaN or +inf entry, or every entry
// -inf). The exps are summed in 4 interleaved 8-lane float32 accumulators over blocks of
// kExpSumGroups lane groups, each block's then added pairwise in float32 (a fixed tree) to
// two float64 terms of the row's sum, the tail in order: a fixed order (rows never split).
template <class L>
void safe_softmax_row(const float* x, float* y, size_t n) {
  using V = typename L::V;
  alignas(32) float lanes[8];
  size_t c = 0;
  V most[4] = {L::splat(-INFINITY), L::splat(-INFINITY), L::splat(-INFINITY), L::splat(-INFINITY)};
  for (; c + 32 <= n; c += 32) {
    for (int a = 0; a < 4; ++a) most[a] = L::max(most[a], L::load(x + c + 8 * a));
  }
  for (; c + 8 <= n; c += 8) most[0] = L::max(most[0], L::load(x + c));
  L::store(lanes, L::max(L::max(most[0], most[1]), L::max(most[2], most[3])));
  // (a NaN entry makes the sum NaN whatever m is: exp of NaN is NaN)
  float m = lane_max(lane_max(lane_max(lanes[0], lanes[1]), lane_max(lanes[2], lanes[3])),
                     lane_max(lane_max(lanes[4], lanes[5]), lane_max(lanes[6], lanes[7])));
  for (; c < n; ++c) m = lane_max(m, x[c]);
  double sum = 0.0;
  c = 0;
  while (c + 8 <= n) {
    V block[4] = {L::splat(0.0f), L::splat(0.0f), L::splat(0.0f), L::splat(0.0f)};
    for (size_t g = 0; g < kExpSumGroups && c + 8 <= n; ++g, c += 8) {
      const V v = L::exp_minus(L::load(x + c), m);
      L::store(y + c, v);
      block[g % 4] = L::add(block[g % 4], v);
    }
    L::store(lanes, L::add(L::add(block[0], block[1]), L::add(block[2], block[3])));
    sum += static_cast<double>((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
           static_cast<double>((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  }
  for (; c < n; ++c) {
    y[c] = exp_nonpositive(x[c] - m);
    sum += y[c];
  }
  if (sum != sum) {
    std::memset(y, 0, n * sizeof(float));
    return;
  }
  scale_row<L>(y, n, static_cast<float>(1.0 / sum));
}

// The AVX2 lanes (safe_softmax_avx2.cc); call only when softmax_cross_entropy_avx2().
void safe_softmax_row_avx2(const float* x, float* y, size_t n);

}  // namespace normgrad
