// Inner loops of the normgrad kernels, one set per instruction set.
//
// kernels_avx2.cc (compiled with -mavx2 -mfma -mf16c) and kernels_generic.cc (baseline
// x86-64 / any CPU) each fill a KernelTable; kernels() (in kernels_generic.cc) picks one
// at load time with __builtin_cpu_supports; NORMGRAD_KERNELS=generic forces the portable
// one. Every function works on one contiguous run of n elements and sums in float32 lanes
// combined in a fixed order, so results do not depend on threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace normgrad {

// Element types, indexed like the tables below.
enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kNumDTypes = 3 };

// Per-row coefficients of rows_affine_acc.
struct RowCoef {
  float mean, a, b, d, rstd;
};
constexpr size_t kMaxRows = 4;

// The fused ReLU backward of the BatchNorm operators (their optional input relu_output, y):
// the gradient they read is g = dy where y > 0, else +0. A select, never a product: a NaN or
// inf dy where y <= 0 (or y is NaN) gives 0. The AVX2 kernels do the same per lane.
inline float relu_select(float dy, float y) { return y > 0.0f ? dy : 0.0f; }

// Runs body(std::true_type()) when y (relu_output) is given, body(std::false_type()) when not:
// the kernels' entry points pick their masked or unmasked instantiation with it.
template <class Body>
inline void with_relu_mask(const void* y, Body&& body) {
  if (y != nullptr) {
    body(std::true_type());
  } else {
    body(std::false_type());
  }
}

struct KernelTable {
  const char* name;
  // out[0] += Σ g, out[1] += Σ g·(x − mean)              (x, dy, y of type t)
  // g = dy, or relu_select(dy, y) when y (n elements, like dy) is not null.
  void (*sum_dy_dyxmu[kNumDTypes])(const void* dy, const void* x, const void* y, size_t n, float mean, double* out);
  // out[0] += Σ g·dy, out[1] += Σ g·dy·(x − mean)        (x, dy, g of type t)
  void (*sum_gdy_gdyxmu[kNumDTypes])(const void* dy, const void* x, const void* g, size_t n, float mean,
                                     double* out);
  // out = a·g + b·(x − mean) + d                         (g as in sum_dy_dyxmu)
  void (*affine[kNumDTypes])(const void* dy, const void* x, const void* y, void* out, size_t n, float mean, float a,
                             float b, float d);
  // out = a·g·dy + b·(x − mean) + d
  void (*affine_g[kNumDTypes])(const void* dy, const void* x, const void* g, void* out, size_t n, float mean,
                               float a, float b, float d);
  // For rows = 1..kMaxRows consecutive rows of n elements (row r at element offset r·n of
  // dy, x and out), with coefficients q[r]: out_r = q.a·g·dy_r + q.b·(x_r − q.mean) + q.d,
  // and the float32 column sums acc_xhat[i] += Σ_r dy_r·(x_r − q.mean)·q.rstd,
  // acc_dy[i] += Σ_r dy_r (rows summed first, in order, then added; either may be null).
  void (*rows_affine_acc[kNumDTypes])(const void* dy, const void* x, const void* g, void* out, size_t n, size_t rows,
                                      const struct RowCoef* q, float* acc_xhat, float* acc_dy);
};

// The sum kernels add their float32 lane partials into the double outputs every kSumBlock
// elements (a fixed split of the run), so no float32 lane ever accumulates more than
// kSumBlock / lanes terms: the rounding error does not grow with the run length (a group
// of GroupNormalizationGrad can be millions of elements long).
constexpr size_t kSumBlock = 4096;

extern const KernelTable kGenericKernels;
#if defined(__x86_64__) || defined(__i386__)
extern const KernelTable kAvx2Kernels;
#endif

// The table for this CPU (AVX2+FMA+F16C when available).
const KernelTable& kernels();

// Scalar conversions (portable, round-to-nearest-even, NaN-preserving).
float f16_to_float(uint16_t h);
uint16_t float_to_f16(float f);
inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float load_float(DType t, const void* p, size_t i) {
  switch (t) {
    case kF32: return static_cast<const float*>(p)[i];
    case kF16: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}
inline void store_float(DType t, void* p, size_t i, float v) {
  switch (t) {
    case kF32: static_cast<float*>(p)[i] = v; break;
    case kF16: static_cast<uint16_t*>(p)[i] = float_to_f16(v); break;
    default: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); break;
  }
}
inline size_t dtype_size(DType t) { return t == kF32 ? 4 : 2; }

}  // namespace normgrad
