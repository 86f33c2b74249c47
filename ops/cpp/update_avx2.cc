// The AVX2 loops of AdamUpdate and SGDUpdate: update_math.h's arithmetic on 8 lanes at a
// time, read and written straight from the tensors. This file is compiled with -mavx2 and
// -ffp-contract=off but without -mfma (no a*b+c can become one rounding), and nothing here
// runs unless update_avx2() says the CPU has AVX2. The lane type is lanes_avx2.h's F8.
#include "update_math.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cstring>

#include "lanes_avx2.h"

namespace normgrad {
namespace {

inline F8 lane_sqrt(F8 a) { return F8(_mm256_sqrt_ps(a.v)); }
inline F8 lane_max_nan(F8 a, F8 b) {  // a where a > b or a is NaN, else b (NaN b: b)
  const __m256 take_a = _mm256_or_ps(_mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ), _mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q));
  return F8(_mm256_blendv_ps(b.v, a.v, take_a));
}

// body(x, y) over [begin, end) in groups of 8 lanes; the last n < 8 elements through
// zero-padded blocks (the padded lanes are computed and never stored). Each group is loaded
// before it is stored, so an output may be its input's buffer.
template <int NIn, int NOut, class Body>
void lanes_loop(size_t begin, size_t end, const float* const (&in)[NIn], float* const (&out)[NOut], Body body) {
  F8 x[NIn], y[NOut];
  for (int k = 0; k < NIn; ++k) x[k] = F8(0.0f);
  size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    for (int k = 0; k < NIn; ++k) {
      if (in[k]) x[k] = F8(_mm256_loadu_ps(in[k] + i));
    }
    body(x, y);
    for (int j = 0; j < NOut; ++j) {
      if (out[j]) _mm256_storeu_ps(out[j] + i, y[j].v);
    }
  }
  if (i == end) return;
  const size_t len = end - i;
  alignas(32) float block[8];
  for (int k = 0; k < NIn; ++k) {
    if (!in[k]) continue;
    std::memset(block, 0, sizeof block);
    std::memcpy(block, in[k] + i, len * sizeof(float));
    x[k] = F8(_mm256_load_ps(block));
  }
  body(x, y);
  for (int j = 0; j < NOut; ++j) {
    if (!out[j]) continue;
    _mm256_store_ps(block, y[j].v);
    std::memcpy(out[j] + i, block, len * sizeof(float));
  }
}

}  // namespace

void adam_update_avx2(const AdamScalars& s, bool amsgrad, size_t begin, size_t end, const float* const (&in)[5],
                      float* const (&out)[4]) {
  if (amsgrad) {
    lanes_loop(begin, end, in, out, [&](const F8 (&x)[5], F8 (&y)[4]) { adam_lanes<true>(s, x, y); });
  } else {
    lanes_loop(begin, end, in, out, [&](const F8 (&x)[5], F8 (&y)[4]) { adam_lanes<false>(s, x, y); });
  }
}

void sgd_update_avx2(const SGDScalars& s, size_t begin, size_t end, const float* const (&in)[3],
                     float* const (&out)[2]) {
  lanes_loop(begin, end, in, out, [&](const F8 (&x)[3], F8 (&y)[2]) { sgd_lanes(s, x, y); });
}

}  // namespace normgrad

#else
namespace normgrad {
// Not an x86 CPU: update_avx2() is false, so these are never called.
void adam_update_avx2(const AdamScalars&, bool, size_t, size_t, const float* const (&)[5], float* const (&)[4]) {
  __builtin_trap();
}
void sgd_update_avx2(const SGDScalars&, size_t, size_t, const float* const (&)[3], float* const (&)[2]) {
  __builtin_trap();
}
}  // namespace normgrad
#endif
