// DepthwiseConvGrad's row primitives on 8 AVX2 lanes with FMA (depthwise_conv_grad.h: the
// portable rows' bits).
#include "depthwise_conv_grad.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace normgrad {
namespace {

// The first `count` (< 8) lanes set, for masked loads and stores of a row's last elements.
__m256i first_lanes(size_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// dot: a row's last elements i = 8 q + j go to lane j as in the portable rows (masked loads);
// the lanes past them add +0 * +0 (a lane is never -0: it starts at +0), which leaves them as
// they are.
struct Avx2Rows {
  static void dot(const float* a, const float* b, size_t count, float* lanes) {
    __m256 sum = _mm256_loadu_ps(lanes);
    size_t i = 0;
    for (; i + kDepthwiseLanes <= count; i += kDepthwiseLanes) {
      sum = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), sum);
    }
    if (i < count) {
      const __m256i mask = first_lanes(count - i);
      sum = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, mask), _mm256_maskload_ps(b + i, mask), sum);
    }
    _mm256_storeu_ps(lanes, sum);
  }
  static void axpy(float alpha, const float* x, float* y, size_t count) {
    const __m256 scale = _mm256_set1_ps(alpha);
    size_t i = 0;
    for (; i + kDepthwiseLanes <= count; i += kDepthwiseLanes) {
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(scale, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    }
    for (; i < count; ++i) y[i] = std::fma(alpha, x[i], y[i]);  // (a masked store is microcoded on AMD CPUs)
  }
};

}  // namespace

void depthwise_channel_avx2(const DepthwiseGeometry& g, const float* x, const float* w, const float* dy, float* dx,
                            float* dw, size_t c) {
  depthwise_channel<float, Avx2Rows>(g, x, w, dy, dx, dw, c);
}

}  // namespace normgrad
#endif
