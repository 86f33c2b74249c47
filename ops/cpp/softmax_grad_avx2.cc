// softmax_grad_math.h's row pass on AVX2 lanes. Compiled with -mavx2 -mfma -ffp-contract=off
// (the lanes' header needs FMA for the exp it also holds; this pass has no fused a*b+c);
// runs only where softmax_cross_entropy_avx2().
#include "softmax_grad_math.h"

#if defined(__x86_64__) || defined(__i386__)
#include "softmax_avx2_lanes.h"

namespace normgrad {

void softmax_grad_row_avx2(const float* dy, const float* y, float* dx, size_t n) {
  softmax_grad_row<AVX2Lanes>(dy, y, dx, n);
}

}  // namespace normgrad
#else
namespace normgrad {
void softmax_grad_row_avx2(const float*, const float*, float*, size_t) {}
}  // namespace normgrad
#endif
