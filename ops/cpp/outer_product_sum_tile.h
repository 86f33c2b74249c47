// OuterProductSum's register tile over any vector lanes (included by the files compiled for
// those lanes): kRows x kVectors vectors of y kept in registers while the depth runs, one
// broadcast of a and kVectors vectors of b per step, each a fused multiply-add.
#pragma once

#include <cstddef>

namespace normgrad {

// Lanes: Vector, kWidth, zero(), load(p), broadcast(p), fma(a, b, c) = a * b + c rounded once, store(p, v).
template <class Lanes, size_t kRows, size_t kVectors>
void outer_tile(size_t depth, const float* a, const float* b, float* y, size_t ldy, bool first) {
  using Vector = typename Lanes::Vector;
  constexpr size_t kColumns = kVectors * Lanes::kWidth;
  Vector acc[kRows][kVectors];
  for (size_t i = 0; i < kRows; ++i) {
    for (size_t v = 0; v < kVectors; ++v) {
      acc[i][v] = first ? Lanes::zero() : Lanes::load(y + i * ldy + v * Lanes::kWidth);
    }
  }
  for (size_t k = 0; k < depth; ++k) {
    Vector columns[kVectors];
    for (size_t v = 0; v < kVectors; ++v) columns[v] = Lanes::load(b + k * kColumns + v * Lanes::kWidth);
#pragma GCC unroll 16
    for (size_t i = 0; i < kRows; ++i) {
      const Vector row = Lanes::broadcast(a + k * kRows + i);
      for (size_t v = 0; v < kVectors; ++v) acc[i][v] = Lanes::fma(row, columns[v], acc[i][v]);
    }
  }
  for (size_t i = 0; i < kRows; ++i) {
    for (size_t v = 0; v < kVectors; ++v) Lanes::store(y + i * ldy + v * Lanes::kWidth, acc[i][v]);
  }
}

}  // namespace normgrad
