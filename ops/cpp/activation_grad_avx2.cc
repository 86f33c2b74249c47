// activation_grad_math.h's loops compiled with -mavx2 (8 lanes; no FMA: the same bits as the
// baseline loops).
#include "activation_grad_math.h"

namespace normgrad {

void activation_grad_avx2(Activation kind, const float* dy, const float* x, float* dx, size_t begin, size_t end) {
  activation_grad_loop(kind, dy, x, dx, begin, end);
}

}  // namespace normgrad
