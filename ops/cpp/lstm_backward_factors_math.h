// LSTMBackwardFactors' step (ops/lstm_backward_factors.py): one step's factors from the kept
// gates. Each value is the standard form's IEEE operations in its order; the files compiling it
// never contract a*b+c (no -mfma; -ffp-contract=off on the AVX2 one), so the portable and AVX2
// builds give the function body's bits.
#pragma once

#include <cstddef>

#include "update_math.h"

namespace normgrad {

// in: i, o, f, g, (cells, unused), act_c; c_prev the previous step's cells (c0 at step 0).
template <class T>
inline void lstm_step_factors(const T* const* in, const T* c_prev, size_t block, T* factors, T* a_c, T* keep) {
  const T* __restrict i = in[0];
  const T* __restrict o = in[1];
  const T* __restrict f = in[2];
  const T* __restrict g = in[3];
  const T* __restrict act_c = in[5];
  const T* __restrict previous = c_prev;
  T* __restrict factor_i = factors;
  T* __restrict factor_o = factors + block;
  T* __restrict factor_f = factors + 2 * block;
  T* __restrict factor_g = factors + 3 * block;
  T* __restrict cell = a_c;
  T* __restrict kept = keep;
  const T one = 1;
  // One output at a time over a chunk that stays in L1: twelve streams at once, all at the same
  // offset of their page-aligned tensors, thrash the cache (4.3x slower at [128, 256, 32] on a
  // Zen 4, 1 thread).
  constexpr size_t kChunk = 1024;
  for (size_t begin = 0; begin < block; begin += kChunk) {
    const size_t end = begin + kChunk < block ? begin + kChunk : block;
    for (size_t e = begin; e < end; ++e) factor_i[e] = g[e] * (i[e] * (one - i[e]));
    for (size_t e = begin; e < end; ++e) factor_o[e] = act_c[e] * (o[e] * (one - o[e]));
    for (size_t e = begin; e < end; ++e) factor_f[e] = previous[e] * (f[e] * (one - f[e]));
    for (size_t e = begin; e < end; ++e) factor_g[e] = i[e] * (one - g[e] * g[e]);
    for (size_t e = begin; e < end; ++e) cell[e] = o[e] * (one - act_c[e] * act_c[e]);
    for (size_t e = begin; e < end; ++e) kept[e] = f[e];
  }
}

// The step compiled with -mavx2 (lstm_backward_factors_avx2.cc); run only where update_avx2().
void lstm_step_factors_avx2(const float* const* in, const float* c_prev, size_t block, float* factors, float* a_c,
                            float* keep);
void lstm_step_factors_avx2(const double* const* in, const double* c_prev, size_t block, double* factors,
                            double* a_c, double* keep);

}  // namespace normgrad
