// MatrixTranspose's float32 copy on AVX2: each 8 x 8 block is loaded as 8 rows, transposed
// in registers (unpack, shuffle, lane permute) and stored as 8 rows of y. A copy: the same
// bits as the portable loop.
#include "matrix_transpose.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace normgrad {
namespace {

inline void transpose_8x8(const float* x, size_t ldx, float* y, size_t ldy) {
  __m256 r[8], t[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(x + k * ldx);
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    r[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44);
    r[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
    r[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44);
    r[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(y + k * ldy, _mm256_permute2f128_ps(r[k], r[k + 4], 0x20));
    _mm256_storeu_ps(y + (k + 4) * ldy, _mm256_permute2f128_ps(r[k], r[k + 4], 0x31));
  }
}

}  // namespace

void transpose_rows_avx2(const float* x, float* y, size_t m, size_t n, size_t row_begin, size_t row_end) {
  constexpr size_t kTile = 64;  // 64 x 64 floats: 16 KiB read, 16 KiB written per tile
  const size_t full_rows = row_begin + (row_end - row_begin) / 8 * 8, full_cols = n / 8 * 8;
  for (size_t i0 = row_begin; i0 < full_rows; i0 += kTile) {
    const size_t i1 = i0 + kTile < full_rows ? i0 + kTile : full_rows;
    for (size_t j0 = 0; j0 < full_cols; j0 += kTile) {
      const size_t j1 = j0 + kTile < full_cols ? j0 + kTile : full_cols;
      for (size_t i = i0; i < i1; i += 8) {
        for (size_t j = j0; j < j1; j += 8) transpose_8x8(x + i * n + j, n, y + j * m + i, m);
      }
    }
  }
  if (full_cols < n) {  // the last n % 8 columns of the full rows
    for (size_t i = row_begin; i < full_rows; ++i) {
      for (size_t j = full_cols; j < n; ++j) y[j * m + i] = x[i * n + j];
    }
  }
  transpose_rows(x, y, m, n, full_rows, row_end);  // the last (row_end - row_begin) % 8 rows
}

}  // namespace normgrad
#endif
