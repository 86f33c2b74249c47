// MaxPoolGrad's argmax of 8 windows at once on AVX2 lanes (max_pool_grad.h): gathered taps,
// compared and selected in the portable loop's order.
#include "max_pool_grad.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace normgrad {

namespace {

// The argmaxes of output columns ow .. ow + 7 into best[0 .. 7].
void eight_windows(const PoolRow& row, size_t ow, int64_t* best) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int start = static_cast<int>(static_cast<int64_t>(ow * row.sw) + row.first_column);
  const __m256i columns =
      _mm256_add_epi32(_mm256_set1_epi32(start), _mm256_mullo_epi32(lane, _mm256_set1_epi32(static_cast<int>(row.sw))));
  __m256 top = _mm256_setzero_ps();
  __m256i where = _mm256_setzero_si256();
  for (size_t a = 0; a < row.kh; ++a) {
    const int line = static_cast<int>((row.first_row + a * row.dh) * row.w);
    for (size_t b = 0; b < row.kw; ++b) {
      const __m256i index = _mm256_add_epi32(columns, _mm256_set1_epi32(line + static_cast<int>(b * row.dw)));
      const __m256 v = _mm256_i32gather_ps(row.x, index, 4);
      if (a == 0 && b == 0) {
        top = v;
        where = index;
        continue;
      }
      // v > top, or v NaN while top is not
      const __m256 wins = _mm256_or_ps(_mm256_cmp_ps(v, top, _CMP_GT_OQ),
                                       _mm256_and_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), _mm256_cmp_ps(top, top, _CMP_ORD_Q)));
      top = _mm256_blendv_ps(top, v, wins);
      where = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(where), _mm256_castsi256_ps(index), wins));
    }
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), where);
  for (size_t j = 0; j < 8; ++j) best[j] = lanes[j];
}

}  // namespace

size_t max_pool_row_argmax_avx2(const PoolRow& row, size_t ow0, size_t count, int64_t* best) {
  if (count < 8) return 0;
  size_t i = 0;
  for (; i + 8 <= count; i += 8) eight_windows(row, ow0 + i, best + i);
  // the last columns as the last eight again (the windows they share get the same choice)
  if (i < count) eight_windows(row, ow0 + count - 8, best + count - 8);
  return count;
}

}  // namespace normgrad

#endif
