// DepthwiseConv's block on 8 AVX2 lanes with FMA: each lane one output's chain over the taps,
// as the portable block's (depthwise_conv.h), four vectors of a row at a time.
#include "depthwise_conv.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace normgrad {
namespace {

template <int kVectors>
inline void block(const float* const* rows, const size_t* offset, const float* w, size_t kh, size_t kw, float bias,
                  float* out) {
  __m256 sum[kVectors];
  for (int v = 0; v < kVectors; ++v) sum[v] = _mm256_set1_ps(bias);
  for (size_t a = 0; a < kh; ++a) {
    const float* row = rows[a];
    for (size_t b = 0; b < kw; ++b) {
      const __m256 tap = _mm256_set1_ps(w[a * kw + b]);
      const float* run = row + offset[b];
      for (int v = 0; v < kVectors; ++v) sum[v] = _mm256_fmadd_ps(tap, _mm256_loadu_ps(run + 8 * v), sum[v]);
    }
  }
  for (int v = 0; v < kVectors; ++v) _mm256_storeu_ps(out + 8 * v, sum[v]);
}

struct Avx2Taps {
  static void row(const float* const* rows, const size_t* offset, const float* w, size_t kh, size_t kw, float bias,
                  float* y, size_t count) {
    size_t j = 0;
    const float* shifted[kDepthwiseMaxRows];  // the rows moved to column j
    auto at = [&](size_t column) {
      for (size_t a = 0; a < kh; ++a) shifted[a] = rows[a] + column;
      return shifted;
    };
    for (; j + 32 <= count; j += 32) block<4>(at(j), offset, w, kh, kw, bias, y + j);
    for (; j + 8 <= count; j += 8) block<1>(at(j), offset, w, kh, kw, bias, y + j);
    if (j < count) {  // the last outputs: a whole vector (the scratch's slack), the first of it kept
      alignas(32) float last[8];
      block<1>(at(j), offset, w, kh, kw, bias, last);
      std::copy(last, last + (count - j), y + j);
    }
  }
};

}  // namespace

void depthwise_forward_plane_avx2(const DepthwiseGeometry& g, const DepthwiseScratch& s, const float* x_plane,
                                  const float* w_taps, float bias, float* y_plane) {
  depthwise_forward_plane<float, Avx2Taps>(g, s, x_plane, w_taps, bias, y_plane);
}

}  // namespace normgrad
#endif
