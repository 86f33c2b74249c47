// RotateHalfEmbedding's row (ops/rotate_half_embedding.py): one row of x's last axis (2h
// elements) with its rows of cos and sin. Each element is the standard nodes' float32
// operations in their order (the products, the negation, the sum); the files compiling it
// have -ffp-contract=off, so the portable and AVX2 builds give the same bits.
#pragma once

#include <cstddef>

#include "update_math.h"

namespace normgrad {

// transposed = false: y = x cos + [-x2, x1] sin; true: y = x cos + [z2, -z1], z = x sin.
inline void rotate_half_row(const float* x, const float* c, const float* s, float* y, size_t h, bool transposed) {
  const float* x2 = x + h;
  const float* c2 = c + h;
  const float* s2 = s + h;
  float* y2 = y + h;
  if (transposed) {
    for (size_t j = 0; j < h; ++j) y[j] = x[j] * c[j] + x2[j] * s2[j];
    for (size_t j = 0; j < h; ++j) y2[j] = x2[j] * c2[j] + -(x[j] * s[j]);
  } else {
    for (size_t j = 0; j < h; ++j) y[j] = x[j] * c[j] + -x2[j] * s[j];
    for (size_t j = 0; j < h; ++j) y2[j] = x2[j] * c2[j] + x[j] * s2[j];
  }
}

// The row compiled with -mavx2 (rotate_half_embedding_avx2.cc); run only where update_avx2().
void rotate_half_row_avx2(const float* x, const float* c, const float* s, float* y, size_t h, bool transposed);

}  // namespace normgrad
