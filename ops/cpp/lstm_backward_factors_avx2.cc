// lstm_backward_factors_math.h's step on AVX2 lanes (-mavx2 -ffp-contract=off: no fused a*b+c,
// the portable build's bits); run only where update_avx2().
#include "lstm_backward_factors_math.h"

namespace normgrad {

void lstm_step_factors_avx2(const float* const* in, const float* c_prev, size_t block, float* factors, float* a_c,
                            float* keep) {
  lstm_step_factors(in, c_prev, block, factors, a_c, keep);
}

void lstm_step_factors_avx2(const double* const* in, const double* c_prev, size_t block, double* factors,
                            double* a_c, double* keep) {
  lstm_step_factors(in, c_prev, block, factors, a_c, keep);
}

}  // namespace normgrad
