// The lane traits of softmax_cross_entropy_math.h and softmax_grad_math.h on AVX2: the same
// float32 operations as PortableLanes, 8 at a time. Include only from files compiled with
// -mavx2 -mfma -ffp-contract=off (run where softmax_cross_entropy_avx2()).
#pragma once

#include "softmax_cross_entropy_math.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace normgrad {

struct AVX2Lanes {
  using V = __m256;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V splat(float s) { return _mm256_set1_ps(s); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }  // b where either is NaN, as lane_max
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V exp_minus(V logits, float m) {
    using namespace exp_constants;
    const V x = _mm256_sub_ps(logits, _mm256_set1_ps(m));
    const V n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
    const V r = _mm256_fmadd_ps(n, _mm256_set1_ps(kMinusLn2Low),
                                _mm256_fmadd_ps(n, _mm256_set1_ps(kMinusLn2High), x));
    V p = _mm256_set1_ps(kP[0]);
    for (int k = 1; k < 6; ++k) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP[k]));
    const V y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    const V value = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
    return _mm256_blendv_ps(value, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(kLow), _CMP_LT_OQ));
  }
};

}  // namespace normgrad
#endif
