// OuterProductSum's 6 x 16 register tile on AVX2 + FMA (12 accumulators).
#include "outer_product_sum.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "outer_product_sum_tile.h"

namespace normgrad {
namespace {

struct Avx2 {
  using Vector = __m256;
  static constexpr size_t kWidth = 8;
  static Vector zero() { return _mm256_setzero_ps(); }
  static Vector load(const float* p) { return _mm256_loadu_ps(p); }
  static Vector broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static Vector fma(Vector a, Vector b, Vector c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, Vector v) { _mm256_storeu_ps(p, v); }
};

}  // namespace

extern const OuterTile kOuterTileAvx2 = {6, 16, &outer_tile<Avx2, 6, 2>};

}  // namespace normgrad
#endif
