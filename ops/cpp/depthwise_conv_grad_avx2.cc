// DepthwiseConvGrad's row primitives on 8 AVX2 lanes with FMA (depthwise_conv_grad.h: the
// portable rows' bits).
#include "depthwise_conv_grad.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace normgrad {
namespace {

struct Avx2Rows {
  static void dot(const float* a, const float* b, size_t count, float* lanes) {
    size_t i = 0;
    if (count >= kDepthwiseLanes) {
      __m256 sum = _mm256_loadu_ps(lanes);
      for (; i + kDepthwiseLanes <= count; i += kDepthwiseLanes) {
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), sum);
      }
      _mm256_storeu_ps(lanes, sum);
    }
    for (; i < count; ++i) lanes[i % kDepthwiseLanes] = std::fma(a[i], b[i], lanes[i % kDepthwiseLanes]);
  }
  static void axpy(float alpha, const float* x, float* y, size_t count) {
    const __m256 scale = _mm256_set1_ps(alpha);
    size_t i = 0;
    for (; i + kDepthwiseLanes <= count; i += kDepthwiseLanes) {
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(scale, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    }
    for (; i < count; ++i) y[i] = std::fma(alpha, x[i], y[i]);
  }
};

}  // namespace

void depthwise_channel_avx2(const DepthwiseGeometry& g, const float* x, const float* w, const float* dy, float* dx,
                            float* dw, size_t c) {
  depthwise_channel<float, Avx2Rows>(g, x, w, dy, dx, dw, c);
}

}  // namespace normgrad
#endif
