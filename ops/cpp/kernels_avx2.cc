// AVX2 + FMA + F16C inner loops. This file alone is compiled with -mavx2 -mfma -mf16c;
// nothing here runs unless __builtin_cpu_supports reported all three (kernels_generic.cc).
// Everything lives in an anonymous namespace so that no inline function compiled with
// AVX2 can be picked by the linker for the baseline code.
#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <cstring>

namespace normgrad {
namespace {

template <int T>
struct Io;

template <>
struct Io<kF32> {
  using S = float;
  static __m256 load(const S* p) { return _mm256_loadu_ps(p); }
  static void store(S* p, __m256 v) { _mm256_storeu_ps(p, v); }
};

template <>
struct Io<kF16> {
  using S = uint16_t;
  static __m256 load(const S* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(S* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
};

template <>
struct Io<kBF16> {
  using S = uint16_t;
  static __m256 load(const S* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static void store(S* p, __m256 v) {
    // Round to nearest even; NaNs stay (quiet) NaNs (a branch: they are rare, and the blend
    // costs as much as the rounding). Both candidates are < 0x10000, so packus does not saturate.
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, lsb), _mm256_set1_epi32(0x7fff)), 16);
    const __m256 is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    if (__builtin_expect(_mm256_movemask_ps(is_nan) != 0, 0)) {
      const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
      r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(is_nan));
    }
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
};

// Copies n < 8 elements into a zero-padded block of 8.
template <int T>
inline void pad8(const typename Io<T>::S* p, size_t n, typename Io<T>::S* block) {
  std::memset(block, 0, 8 * sizeof(typename Io<T>::S));
  std::memcpy(block, p, n * sizeof(typename Io<T>::S));
}

// All ones in the first n < 8 lanes: the tail's padded lanes are masked out of products
// (a zero pad times a non-finite x - mean would be NaN, which IEEE sums of the real
// elements never give).
inline __m256 lanes_below(size_t n) {
  return _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// The gradient lanes the BatchNorm kernels read: dy, or with the ReLU mask (kMasked) dy where
// y > 0 and +0 elsewhere (an AND with the comparison: a select, as relu_select in kernels.h).
template <int T, bool kMasked>
inline __m256 grad_lanes(__m256 dy, const typename Io<T>::S* y, size_t i) {
  if (!kMasked) return dy;
  return _mm256_and_ps(_mm256_cmp_ps(Io<T>::load(y + i), _mm256_setzero_ps(), _CMP_GT_OQ), dy);
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                // 4 lanes
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));       // 2 lanes
  s = _mm_add_ss(s, _mm_movehdup_ps(s));        // 1 lane
  return _mm_cvtss_f32(s);
}

template <int T, bool kMasked>
void sum_dy_dyxmu_block(const void* dy_, const void* x_, const void* y_, size_t n, float mean, double* out) {
  using S = typename Io<T>::S;
  const S* dy = static_cast<const S*>(dy_);
  const S* x = static_cast<const S*>(x_);
  const S* y = static_cast<const S*>(y_);
  const __m256 m = _mm256_set1_ps(mean);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256 d0 = grad_lanes<T, kMasked>(Io<T>::load(dy + i), y, i);
    __m256 d1 = grad_lanes<T, kMasked>(Io<T>::load(dy + i + 8), y, i + 8);
    __m256 d2 = grad_lanes<T, kMasked>(Io<T>::load(dy + i + 16), y, i + 16);
    __m256 d3 = grad_lanes<T, kMasked>(Io<T>::load(dy + i + 24), y, i + 24);
    __m256 x0 = _mm256_sub_ps(Io<T>::load(x + i), m), x1 = _mm256_sub_ps(Io<T>::load(x + i + 8), m);
    __m256 x2 = _mm256_sub_ps(Io<T>::load(x + i + 16), m), x3 = _mm256_sub_ps(Io<T>::load(x + i + 24), m);
    a0 = _mm256_add_ps(a0, d0);
    a1 = _mm256_add_ps(a1, d1);
    a2 = _mm256_add_ps(a2, d2);
    a3 = _mm256_add_ps(a3, d3);
    b0 = _mm256_fmadd_ps(d0, x0, b0);
    b1 = _mm256_fmadd_ps(d1, x1, b1);
    b2 = _mm256_fmadd_ps(d2, x2, b2);
    b3 = _mm256_fmadd_ps(d3, x3, b3);
  }
  for (; i + 8 <= n; i += 8) {
    __m256 d = grad_lanes<T, kMasked>(Io<T>::load(dy + i), y, i);
    a0 = _mm256_add_ps(a0, d);
    b0 = _mm256_fmadd_ps(d, _mm256_sub_ps(Io<T>::load(x + i), m), b0);
  }
  if (i < n) {
    S bd[8], bx[8], by[8];
    pad8<T>(dy + i, n - i, bd);
    pad8<T>(x + i, n - i, bx);
    if (kMasked) pad8<T>(y + i, n - i, by);
    // padding is dy = 0 (masked out with y = 0) and x - mean masked to 0: adds nothing
    __m256 d = grad_lanes<T, kMasked>(Io<T>::load(bd), by, 0);
    a1 = _mm256_add_ps(a1, d);
    b1 = _mm256_fmadd_ps(d, _mm256_and_ps(lanes_below(n - i), _mm256_sub_ps(Io<T>::load(bx), m)), b1);
  }
  out[0] += hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  out[1] += hsum(_mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));
}

template <int T>
void sum_gdy_gdyxmu_block(const void* dy_, const void* x_, const void* g_, size_t n, float mean, double* out) {
  using S = typename Io<T>::S;
  const S* dy = static_cast<const S*>(dy_);
  const S* x = static_cast<const S*>(x_);
  const S* g = static_cast<const S*>(g_);
  const __m256 m = _mm256_set1_ps(mean);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 d0 = _mm256_mul_ps(Io<T>::load(dy + i), Io<T>::load(g + i));
    __m256 d1 = _mm256_mul_ps(Io<T>::load(dy + i + 8), Io<T>::load(g + i + 8));
    a0 = _mm256_add_ps(a0, d0);
    a1 = _mm256_add_ps(a1, d1);
    b0 = _mm256_fmadd_ps(d0, _mm256_sub_ps(Io<T>::load(x + i), m), b0);
    b1 = _mm256_fmadd_ps(d1, _mm256_sub_ps(Io<T>::load(x + i + 8), m), b1);
  }
  for (; i + 8 <= n; i += 8) {
    __m256 d = _mm256_mul_ps(Io<T>::load(dy + i), Io<T>::load(g + i));
    a0 = _mm256_add_ps(a0, d);
    b0 = _mm256_fmadd_ps(d, _mm256_sub_ps(Io<T>::load(x + i), m), b0);
  }
  if (i < n) {
    S bd[8], bx[8], bg[8];
    pad8<T>(dy + i, n - i, bd);
    pad8<T>(x + i, n - i, bx);
    pad8<T>(g + i, n - i, bg);
    __m256 d = _mm256_mul_ps(Io<T>::load(bd), Io<T>::load(bg));
    a1 = _mm256_add_ps(a1, d);
    b1 = _mm256_fmadd_ps(d, _mm256_and_ps(lanes_below(n - i), _mm256_sub_ps(Io<T>::load(bx), m)), b1);
  }
  out[0] += hsum(_mm256_add_ps(a0, a1));
  out[1] += hsum(_mm256_add_ps(b0, b1));
}

// The kernels' entry points: the run in blocks of kSumBlock elements, each block's float32
// partials added to `out` in double, in order.
template <int T>
void sum_dy_dyxmu(const void* dy, const void* x, const void* y, size_t n, float mean, double* out) {
  constexpr size_t es = T == kF32 ? 4 : 2;
  const char* d = static_cast<const char*>(dy);
  const char* v = static_cast<const char*>(x);
  const char* m = static_cast<const char*>(y);
  for (size_t i = 0; i < n; i += kSumBlock) {
    const size_t len = n - i < kSumBlock ? n - i : kSumBlock;
    const char* run_y = m != nullptr ? m + i * es : nullptr;
    with_relu_mask(run_y, [&](auto masked) {
      sum_dy_dyxmu_block<T, decltype(masked)::value>(d + i * es, v + i * es, run_y, len, mean, out);
    });
  }
}

template <int T>
void sum_gdy_gdyxmu(const void* dy, const void* x, const void* g, size_t n, float mean, double* out) {
  constexpr size_t es = T == kF32 ? 4 : 2;
  const char* d = static_cast<const char*>(dy);
  const char* v = static_cast<const char*>(x);
  const char* w = static_cast<const char*>(g);
  for (size_t i = 0; i < n; i += kSumBlock) {
    const size_t len = n - i < kSumBlock ? n - i : kSumBlock;
    sum_gdy_gdyxmu_block<T>(d + i * es, v + i * es, w + i * es, len, mean, out);
  }
}

template <int T, bool kMasked>
void affine_run(const void* dy_, const void* x_, const void* y_, void* out_, size_t n, float mean, float a, float b,
                float d) {
  using S = typename Io<T>::S;
  const S* dy = static_cast<const S*>(dy_);
  const S* x = static_cast<const S*>(x_);
  const S* y = static_cast<const S*>(y_);
  S* out = static_cast<S*>(out_);
  const __m256 m = _mm256_set1_ps(mean), va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b), vd = _mm256_set1_ps(d);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 r0 = _mm256_fmadd_ps(va, grad_lanes<T, kMasked>(Io<T>::load(dy + i), y, i),
                                _mm256_fmadd_ps(vb, _mm256_sub_ps(Io<T>::load(x + i), m), vd));
    __m256 r1 = _mm256_fmadd_ps(va, grad_lanes<T, kMasked>(Io<T>::load(dy + i + 8), y, i + 8),
                                _mm256_fmadd_ps(vb, _mm256_sub_ps(Io<T>::load(x + i + 8), m), vd));
    Io<T>::store(out + i, r0);
    Io<T>::store(out + i + 8, r1);
  }
  for (; i + 8 <= n; i += 8) {
    Io<T>::store(out + i, _mm256_fmadd_ps(va, grad_lanes<T, kMasked>(Io<T>::load(dy + i), y, i),
                                          _mm256_fmadd_ps(vb, _mm256_sub_ps(Io<T>::load(x + i), m), vd)));
  }
  if (i < n) {
    S bd[8], bx[8], by[8], bo[8];
    pad8<T>(dy + i, n - i, bd);
    pad8<T>(x + i, n - i, bx);
    if (kMasked) pad8<T>(y + i, n - i, by);
    Io<T>::store(bo, _mm256_fmadd_ps(va, grad_lanes<T, kMasked>(Io<T>::load(bd), by, 0),
                                     _mm256_fmadd_ps(vb, _mm256_sub_ps(Io<T>::load(bx), m), vd)));
    std::memcpy(out + i, bo, (n - i) * sizeof(S));
  }
}

template <int T>
void affine(const void* dy, const void* x, const void* y, void* out, size_t n, float mean, float a, float b, float d) {
  with_relu_mask(y, [&](auto masked) { affine_run<T, decltype(masked)::value>(dy, x, y, out, n, mean, a, b, d); });
}

// 8 columns of rows_affine_acc: dx of each row stored, the rows' sums returned.
template <int T, int kRows, bool kTail>
inline void rows_affine8(const typename Io<T>::S* dy, const typename Io<T>::S* x, __m256 gv,
                         typename Io<T>::S* out, size_t n, const RowCoef* q, __m256 mask, __m256* sum_xhat,
                         __m256* sum_dy) {
  for (int r = 0; r < kRows; ++r) {
    const __m256 dv = Io<T>::load(dy + r * n);
    __m256 xm = _mm256_sub_ps(Io<T>::load(x + r * n), _mm256_set1_ps(q[r].mean));
    if (kTail) xm = _mm256_and_ps(mask, xm);
    *sum_xhat = _mm256_fmadd_ps(dv, _mm256_mul_ps(xm, _mm256_set1_ps(q[r].rstd)), *sum_xhat);
    *sum_dy = _mm256_add_ps(*sum_dy, dv);
    Io<T>::store(out + r * n, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(q[r].a), gv), dv,
                                              _mm256_fmadd_ps(_mm256_set1_ps(q[r].b), xm, _mm256_set1_ps(q[r].d))));
  }
}

template <int T, int kRows>
void rows_affine_acc_impl(const void* dy_, const void* x_, const void* g_, void* out_, size_t n, const RowCoef* q,
                          float* acc_xhat, float* acc_dy) {
  using S = typename Io<T>::S;
  const S* dy = static_cast<const S*>(dy_);
  const S* x = static_cast<const S*>(x_);
  const S* g = static_cast<const S*>(g_);
  S* out = static_cast<S*>(out_);
  // The next kRows rows follow these in memory: fetch them into cache meanwhile, so that
  // the caller's reduction pass over them does not wait for memory.
  const char* next_dy = reinterpret_cast<const char*>(dy + kRows * n);
  const char* next_x = reinterpret_cast<const char*>(x + kRows * n);
  constexpr size_t kAhead = kRows * 8 * sizeof(S);  // bytes of the next rows per 8 columns
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (size_t b = 0; b < kAhead; b += 64) {
      _mm_prefetch(next_dy + i * kRows * sizeof(S) + b, _MM_HINT_T1);
      _mm_prefetch(next_x + i * kRows * sizeof(S) + b, _MM_HINT_T1);
    }
    __m256 sx = _mm256_setzero_ps(), sd = sx;
    rows_affine8<T, kRows, false>(dy + i, x + i, Io<T>::load(g + i), out + i, n, q, __m256(), &sx, &sd);
    if (acc_xhat) _mm256_storeu_ps(acc_xhat + i, _mm256_add_ps(_mm256_loadu_ps(acc_xhat + i), sx));
    if (acc_dy) _mm256_storeu_ps(acc_dy + i, _mm256_add_ps(_mm256_loadu_ps(acc_dy + i), sd));
  }
  if (i < n) {
    // The last columns through zero-padded copies; padded lanes have dy = 0 and x − mean
    // masked to 0 (so 0 · inf gives no NaN), and are never written back.
    const size_t rest = n - i;
    S bd[kRows * 8], bx[kRows * 8], bg[8], bo[kRows * 8];
    for (int r = 0; r < kRows; ++r) {
      pad8<T>(dy + r * n + i, rest, bd + r * 8);
      pad8<T>(x + r * n + i, rest, bx + r * 8);
    }
    pad8<T>(g + i, rest, bg);
    __m256 sx = _mm256_setzero_ps(), sd = sx;
    rows_affine8<T, kRows, true>(bd, bx, Io<T>::load(bg), bo, 8, q, lanes_below(rest), &sx, &sd);
    for (int r = 0; r < kRows; ++r) std::memcpy(out + r * n + i, bo + r * 8, rest * sizeof(S));
    float lanes[8];
    if (acc_xhat) {
      _mm256_storeu_ps(lanes, sx);
      for (size_t j = 0; j < rest; ++j) acc_xhat[i + j] += lanes[j];
    }
    if (acc_dy) {
      _mm256_storeu_ps(lanes, sd);
      for (size_t j = 0; j < rest; ++j) acc_dy[i + j] += lanes[j];
    }
  }
}

template <int T>
void rows_affine_acc(const void* dy, const void* x, const void* g, void* out, size_t n, size_t rows, const RowCoef* q,
                     float* acc_xhat, float* acc_dy) {
  switch (rows) {
    case 1: return rows_affine_acc_impl<T, 1>(dy, x, g, out, n, q, acc_xhat, acc_dy);
    case 2: return rows_affine_acc_impl<T, 2>(dy, x, g, out, n, q, acc_xhat, acc_dy);
    case 3: return rows_affine_acc_impl<T, 3>(dy, x, g, out, n, q, acc_xhat, acc_dy);
    default: return rows_affine_acc_impl<T, 4>(dy, x, g, out, n, q, acc_xhat, acc_dy);
  }
}

template <int T>
void affine_g(const void* dy, const void* x, const void* g, void* out, size_t n, float mean, float a, float b,
              float d) {
  const RowCoef q{mean, a, b, d, 0.0f};
  rows_affine_acc_impl<T, 1>(dy, x, g, out, n, &q, nullptr, nullptr);
}

}  // namespace

extern const KernelTable kAvx2Kernels = {
    "avx2",
    {sum_dy_dyxmu<kF32>, sum_dy_dyxmu<kF16>, sum_dy_dyxmu<kBF16>},
    {sum_gdy_gdyxmu<kF32>, sum_gdy_gdyxmu<kF16>, sum_gdy_gdyxmu<kBF16>},
    {affine<kF32>, affine<kF16>, affine<kBF16>},
    {affine_g<kF32>, affine_g<kF16>, affine_g<kBF16>},
    {rows_affine_acc<kF32>, rows_affine_acc<kF16>, rows_affine_acc<kBF16>},
};

}  // namespace normgrad
#endif
