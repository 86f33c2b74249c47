// Portable inner loops (any CPU), the float16 conversions, and the run-time choice of the
// kernel table.
#include <cstdlib>
#include <cstring>

#include "kernels.h"
#include "update_math.h"

namespace normgrad {

float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t absu = u & 0x7fffffffu;
  if (absu > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((absu >> 13) & 0x3ffu));  // nan
  if (absu >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow (after rounding) / inf
  if (absu >= 0x38800000u) {  // normal half
    uint32_t r = absu - 0x38000000u;  // rebias exponent 127 -> 15
    r += 0xfffu + ((r >> 13) & 1u);    // round to nearest even
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  if (absu < 0x33000000u) return sign;  // rounds to zero (below half the smallest subnormal)
  // subnormal half
  const uint32_t exp = absu >> 23;
  const uint32_t mant = (absu & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - exp;  // 14..24
  uint32_t r = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

namespace {

template <int T>
inline float ld(const void* p, size_t i) {
  if (T == kF32) return static_cast<const float*>(p)[i];
  if (T == kF16) return f16_to_float(static_cast<const uint16_t*>(p)[i]);
  return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
}

template <int T>
inline void st(void* p, size_t i, float v) {
  if (T == kF32) {
    static_cast<float*>(p)[i] = v;
  } else if (T == kF16) {
    static_cast<uint16_t*>(p)[i] = float_to_f16(v);
  } else {
    static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
  }
}

// dy[i], or relu_select(dy[i], y[i]) with the ReLU mask (kMasked).
template <int T, bool kMasked>
inline float ld_grad(const void* dy, const void* y, size_t i) {
  return kMasked ? relu_select(ld<T>(dy, i), ld<T>(y, i)) : ld<T>(dy, i);
}

template <int T, bool kMasked>
void sum_dy_dyxmu_block(const void* dy, const void* x, const void* y, size_t n, float mean, double* out) {
  float a[4] = {0, 0, 0, 0}, b[4] = {0, 0, 0, 0};
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int k = 0; k < 4; ++k) {
      const float d = ld_grad<T, kMasked>(dy, y, i + k);
      a[k] += d;
      b[k] += d * (ld<T>(x, i + k) - mean);
    }
  }
  for (; i < n; ++i) {
    const float d = ld_grad<T, kMasked>(dy, y, i);
    a[0] += d;
    b[0] += d * (ld<T>(x, i) - mean);
  }
  out[0] += (a[0] + a[1]) + (a[2] + a[3]);
  out[1] += (b[0] + b[1]) + (b[2] + b[3]);
}

template <int T>
void sum_gdy_gdyxmu_block(const void* dy, const void* x, const void* g, size_t n, float mean, double* out) {
  float a[4] = {0, 0, 0, 0}, b[4] = {0, 0, 0, 0};
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int k = 0; k < 4; ++k) {
      const float d = ld<T>(dy, i + k) * ld<T>(g, i + k);
      a[k] += d;
      b[k] += d * (ld<T>(x, i + k) - mean);
    }
  }
  for (; i < n; ++i) {
    const float d = ld<T>(dy, i) * ld<T>(g, i);
    a[0] += d;
    b[0] += d * (ld<T>(x, i) - mean);
  }
  out[0] += (a[0] + a[1]) + (a[2] + a[3]);
  out[1] += (b[0] + b[1]) + (b[2] + b[3]);
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
void affine_run(const void* dy, const void* x, const void* y, void* out, size_t n, float mean, float a, float b,
                float d) {
  for (size_t i = 0; i < n; ++i) st<T>(out, i, a * ld_grad<T, kMasked>(dy, y, i) + (b * (ld<T>(x, i) - mean) + d));
}

template <int T>
void affine(const void* dy, const void* x, const void* y, void* out, size_t n, float mean, float a, float b, float d) {
  with_relu_mask(y, [&](auto masked) { affine_run<T, decltype(masked)::value>(dy, x, y, out, n, mean, a, b, d); });
}

template <int T>
void affine_g(const void* dy, const void* x, const void* g, void* out, size_t n, float mean, float a, float b,
              float d) {
  for (size_t i = 0; i < n; ++i) st<T>(out, i, (a * ld<T>(g, i)) * ld<T>(dy, i) + (b * (ld<T>(x, i) - mean) + d));
}

template <int T>
void rows_affine_acc(const void* dy, const void* x, const void* g, void* out, size_t n, size_t rows, const RowCoef* q,
                     float* acc_xhat, float* acc_dy) {
  for (size_t i = 0; i < n; ++i) {
    const float gv = ld<T>(g, i);
    float sum_xhat = 0.0f, sum_dy = 0.0f;
    for (size_t r = 0; r < rows; ++r) {
      const float dv = ld<T>(dy, r * n + i), xm = ld<T>(x, r * n + i) - q[r].mean;
      st<T>(out, r * n + i, (q[r].a * gv) * dv + (q[r].b * xm + q[r].d));
      sum_xhat += dv * (xm * q[r].rstd);
      sum_dy += dv;
    }
    if (acc_xhat) acc_xhat[i] += sum_xhat;
    if (acc_dy) acc_dy[i] += sum_dy;
  }
}

}  // namespace

extern const KernelTable kGenericKernels = {
    "generic",
    {sum_dy_dyxmu<kF32>, sum_dy_dyxmu<kF16>, sum_dy_dyxmu<kBF16>},
    {sum_gdy_gdyxmu<kF32>, sum_gdy_gdyxmu<kF16>, sum_gdy_gdyxmu<kBF16>},
    {affine<kF32>, affine<kF16>, affine<kBF16>},
    {affine_g<kF32>, affine_g<kF16>, affine_g<kBF16>},
    {rows_affine_acc<kF32>, rows_affine_acc<kF16>, rows_affine_acc<kBF16>},
};

static const KernelTable* choose_kernels() {
#if defined(__x86_64__) || defined(__i386__)
  const char* force = std::getenv("NORMGRAD_KERNELS");
  if (force != nullptr && std::strcmp(force, "generic") == 0) return &kGenericKernels;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return &kAvx2Kernels;
  }
#endif
  return &kGenericKernels;
}

const KernelTable& kernels() {
  static const KernelTable* table = choose_kernels();
  return *table;
}

// The optimizer updates' AVX2 loops (update_avx2.cc) go with the AVX2 kernel table, so
// NORMGRAD_KERNELS=generic forces their portable loops too.
bool update_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  return &kernels() == &kAvx2Kernels;
#else
  return false;
#endif
}

}  // namespace normgrad
