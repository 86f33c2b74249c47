// rotate_half_embedding_math.h's row vectorized for AVX2 (-mavx2 -ffp-contract=off: no fused
// a*b+c, the portable build's bits); run only where update_avx2().
#include "rotate_half_embedding_math.h"

namespace normgrad {

void rotate_half_row_avx2(const float* x, const float* c, const float* s, float* y, size_t h, bool transposed) {
  rotate_half_row(x, c, s, y, h, transposed);
}

}  // namespace normgrad
