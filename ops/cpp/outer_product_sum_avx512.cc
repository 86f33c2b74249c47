// OuterProductSum's 14 x 32 register tile on AVX-512 (28 accumulators).
#include "outer_product_sum.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "outer_product_sum_tile.h"

namespace normgrad {
namespace {

struct Avx512 {
  using Vector = __m512;
  static constexpr size_t kWidth = 16;
  static Vector zero() { return _mm512_setzero_ps(); }
  static Vector load(const float* p) { return _mm512_loadu_ps(p); }
  static Vector broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static Vector fma(Vector a, Vector b, Vector c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, Vector v) { _mm512_storeu_ps(p, v); }
};

}  // namespace

extern const OuterTile kOuterTileAvx512 = {14, 32, &outer_tile<Avx512, 14, 2>};

}  // namespace normgrad
#endif
