// DepthwiseConvGrad's primitives on 8 AVX2 lanes with FMA (depthwise_conv_grad.h: the portable
// primitives' bits).
#include "depthwise_conv_grad.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace normgrad {
namespace {

// The first `count` (< 8) lanes set, for masked loads of a row's last elements.
__m256i first_lanes(size_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// kTaps taps' lanes held in registers over every row of the plane.
template <int kTaps>
void dots_of(const float* dy, size_t wo, size_t ho, const float* const* runs, size_t step, float* lanes) {
  __m256 sum[kTaps];
  for (int b = 0; b < kTaps; ++b) sum[b] = _mm256_loadu_ps(lanes + b * kDepthwiseLanes);
  const size_t whole = wo / kDepthwiseLanes * kDepthwiseLanes;
  const __m256i tail = first_lanes(wo - whole);
  for (size_t oh = 0; oh < ho; ++oh) {
    const float* dy_row = dy + oh * wo;
    const size_t row = oh * step;
    for (size_t j = 0; j < whole; j += kDepthwiseLanes) {
      const __m256 d = _mm256_loadu_ps(dy_row + j);
      for (int b = 0; b < kTaps; ++b) sum[b] = _mm256_fmadd_ps(d, _mm256_loadu_ps(runs[b] + row + j), sum[b]);
    }
    if (whole < wo) {  // past the row's end: + 0 * 0, as the portable lanes
      const __m256 d = _mm256_maskload_ps(dy_row + whole, tail);
      for (int b = 0; b < kTaps; ++b) {
        sum[b] = _mm256_fmadd_ps(d, _mm256_maskload_ps(runs[b] + row + whole, tail), sum[b]);
      }
    }
  }
  for (int b = 0; b < kTaps; ++b) _mm256_storeu_ps(lanes + b * kDepthwiseLanes, sum[b]);
}

struct Avx2Rows {
  static void axpy(float alpha, const float* x, float* y, size_t count) {
    const __m256 scale = _mm256_set1_ps(alpha);
    size_t i = 0;
    for (; i + kDepthwiseLanes <= count; i += kDepthwiseLanes) {
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(scale, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    }
    for (; i < count; ++i) y[i] = std::fma(alpha, x[i], y[i]);  // (a masked store is microcoded on AMD CPUs)
  }
  static void dots(const float* dy, size_t wo, size_t ho, const float* const* runs, size_t step, size_t taps,
                   float* lanes) {
    using Dots = void (*)(const float*, size_t, size_t, const float* const*, size_t, float*);
    static constexpr Dots kByTaps[kDepthwiseDotTaps] = {dots_of<1>, dots_of<2>, dots_of<3>,  dots_of<4>,
                                                        dots_of<5>, dots_of<6>, dots_of<7>,  dots_of<8>,
                                                        dots_of<9>, dots_of<10>, dots_of<11>, dots_of<12>};
    kByTaps[taps - 1](dy, wo, ho, runs, step, lanes);
  }
};

struct Avx2Forward {
  static void plane(const DepthwiseGeometry& g, const DepthwiseScratch& s, const float* x, const float* w, float* y) {
    depthwise_forward_plane_avx2(g, s, x, w, 0.0f, y);
  }
};

}  // namespace

void depthwise_channel_avx2(const DepthwiseGradPlan& plan, const float* x, const float* w, const float* dy, float* dx,
                            float* dw, size_t c) {
  depthwise_channel<float, Avx2Rows, Avx2Forward>(plan, x, w, dy, dx, dw, c);
}

}  // namespace normgrad
#endif
