// SoftmaxGrad's row pass (ops/softmax_grad.py), written once for a lane traits type L:
// PortableLanes or AVX2Lanes (softmax_cross_entropy_math.h, softmax_avx2_lanes.h). One IEEE
// float32 operation per lane in the same order on both (no fused a*b+c: the files are
// compiled with -ffp-contract=off), the same scalar tails and lane reductions: the same bits.
#pragma once

#include <cstddef>

#include "softmax_cross_entropy_math.h"

namespace normgrad {

// dx[0, n) = y * (dy - s), s = sum_c dy[c] y[c]: float32 products summed in 4 interleaved
// 8-lane float32 accumulators over blocks of kExpSumGroups lane groups, each block's
// accumulators then added pairwise in float32 (a fixed tree) to two float64 terms of the
// row's sum, the tail in order (a fixed order: the row is never split between threads).
template <class L>
void softmax_grad_row(const float* dy, const float* y, float* dx, size_t n) {
  using V = typename L::V;
  alignas(32) float lanes[8];
  double sum = 0.0;
  size_t c = 0;
  while (c + 8 <= n) {
    V block[4] = {L::splat(0.0f), L::splat(0.0f), L::splat(0.0f), L::splat(0.0f)};
    for (size_t g = 0; g < kExpSumGroups && c + 8 <= n; ++g, c += 8) {
      block[g % 4] = L::add(block[g % 4], L::mul(L::load(dy + c), L::load(y + c)));
    }
    L::store(lanes, L::add(L::add(block[0], block[1]), L::add(block[2], block[3])));
    sum += static_cast<double>((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
           static_cast<double>((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  }
  for (; c < n; ++c) sum += dy[c] * y[c];
  const float s = static_cast<float>(sum);
  const V total = L::splat(s);
  c = 0;
  for (; c + 8 <= n; c += 8) L::store(dx + c, L::mul(L::load(y + c), L::sub(L::load(dy + c), total)));
  for (; c < n; ++c) dx[c] = y[c] * (dy[c] - s);
}

// The AVX2 lanes (softmax_grad_avx2.cc); call only when softmax_cross_entropy_avx2().
void softmax_grad_row_avx2(const float* dy, const float* y, float* dx, size_t n);

}  // namespace normgrad
