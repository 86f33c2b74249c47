// softmax_cross_entropy_math.h's row passes on AVX2 lanes: the same float32 operations as
// PortableLanes, 8 at a time. Compiled with -mavx2 -mfma -ffp-contract=off (a fused a*b+c only
// where the header writes std::fma); runs only where softmax_cross_entropy_avx2().
#include "softmax_avx2_lanes.h"
#include "softmax_cross_entropy_math.h"
#include "update_math.h"

#if defined(__x86_64__) || defined(__i386__)
namespace normgrad {

bool softmax_cross_entropy_avx2() {
  static const bool supported = update_avx2() && __builtin_cpu_supports("fma");
  return supported;
}

SoftmaxRow softmax_row_avx2(const float* x, const float* bias, float* e, size_t n) {
  return softmax_row<AVX2Lanes>(x, bias, e, n);
}

void scale_row_avx2(float* e, size_t n, float scale, float* total) { scale_row<AVX2Lanes>(e, n, scale, total); }

}  // namespace normgrad
#else
namespace normgrad {
bool softmax_cross_entropy_avx2() { return false; }
SoftmaxRow softmax_row_avx2(const float*, const float*, float*, size_t) { return {}; }
void scale_row_avx2(float*, size_t, float, float*) {}
}  // namespace normgrad
#endif
