// SafeSoftmax's row (ops/safe_softmax.py), written once for a lane traits type L: PortableLanes
// or AVX2Lanes (softmax_cross_entropy_math.h, softmax_avx2_lanes.h), on SoftmaxCrossEntropy's
// softmax_row and scale_row: the same bits on both lane types and at every thread count.
#pragma once

#include <cstddef>
#include <cstring>

#include "softmax_cross_entropy_math.h"

namespace normgrad {

// y[0, n) = softmax(z), z = x[0, n) (+ bias[0, n) in float32 when bias is not null), or 0
// when its sum is NaN (a NaN or +inf entry, or every entry -inf).
template <class L>
void safe_softmax_row(const float* x, const float* bias, float* y, size_t n) {
  const SoftmaxRow row = softmax_row<L>(x, bias, y, n);
  if (row.sum != row.sum) {
    std::memset(y, 0, n * sizeof(float));
    return;
  }
  scale_row<L>(y, n, static_cast<float>(1.0 / row.sum), nullptr);
}

// The AVX2 lanes (safe_softmax_avx2.cc); call only when softmax_cross_entropy_avx2().
void safe_softmax_row_avx2(const float* x, const float* bias, float* y, size_t n);

}  // namespace normgrad
