// MatrixTranspose's block copies (ops/matrix_transpose.py): y [n, m] = x [m, n] transposed.
#pragma once

#include <cstddef>

namespace normgrad {

// Rows [row_begin, row_end) of x into columns of y; any element type.
template <class T>
void transpose_rows(const T* x, T* y, size_t m, size_t n, size_t row_begin, size_t row_end) {
  constexpr size_t kTile = 16;
  for (size_t i0 = row_begin; i0 < row_end; i0 += kTile) {
    const size_t i1 = i0 + kTile < row_end ? i0 + kTile : row_end;
    for (size_t j0 = 0; j0 < n; j0 += kTile) {
      const size_t j1 = j0 + kTile < n ? j0 + kTile : n;
      for (size_t j = j0; j < j1; ++j) {
        for (size_t i = i0; i < i1; ++i) y[j * m + i] = x[i * n + j];
      }
    }
  }
}

// The same for float32 on AVX2 (matrix_transpose_avx2.cc): 8 x 8 blocks in registers, the
// edges by transpose_rows. Run only where update_avx2() is true.
void transpose_rows_avx2(const float* x, float* y, size_t m, size_t n, size_t row_begin, size_t row_end);

}  // namespace normgrad
