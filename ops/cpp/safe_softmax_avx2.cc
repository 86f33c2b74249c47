// safe_softmax_math.h's row on AVX2 lanes. Compiled with -mavx2 -mfma -ffp-contract=off
// (fused a*b+c only where the exp writes it); runs only where softmax_cross_entropy_avx2().
#include "safe_softmax_math.h"

#if defined(__x86_64__) || defined(__i386__)
#include "softmax_avx2_lanes.h"

namespace normgrad {

void safe_softmax_row_avx2(const float* x, const float* bias, float* y, size_t n) {
  safe_softmax_row<AVX2Lanes>(x, bias, y, n);
}

}  // namespace normgrad
#else
namespace normgrad {
void safe_softmax_row_avx2(const float*, const float*, float*, size_t) {}
}  // namespace normgrad
#endif
