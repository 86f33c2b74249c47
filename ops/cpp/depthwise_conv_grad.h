// DepthwiseConvGrad (ops/depthwise_conv_grad.py): dx and dw of a 2-D depthwise Conv, one
// channel at a time. The loops are shared by the portable and the AVX2 path (this template);
// only the two row primitives differ, and both round alike: axpy is one fused multiply-add per
// element, dot deals a row's products to eight lanes by their index mod 8, each lane one chain
// of fused multiply-adds. So every path gives the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace normgrad {

struct DepthwiseGeometry {
  size_t n, c, h, w, kh, kw, ho, wo, sh, sw, pt, pl, dh, dw;
};

constexpr size_t kDepthwiseLanes = 8;

// The portable row primitives (std::fma: one rounding, as the vector lanes).
template <class T>
struct ScalarRows {
  static void dot(const T* a, const T* b, size_t count, T* lanes) {
    for (size_t i = 0; i < count; ++i) lanes[i % kDepthwiseLanes] = std::fma(a[i], b[i], lanes[i % kDepthwiseLanes]);
  }
  static void axpy(T alpha, const T* x, T* y, size_t count) {
    for (size_t i = 0; i < count; ++i) y[i] = std::fma(alpha, x[i], y[i]);
  }
};

// Channel c of every sample: dx[:, c] (overwritten) and dw[c] (its taps).
template <class T, class Rows>
void depthwise_channel(const DepthwiseGeometry& g, const T* x, const T* w, const T* dy, T* dx, T* dw, size_t c) {
  const size_t taps = g.kh * g.kw;
  thread_local std::vector<T> scratch;
  scratch.assign(taps * kDepthwiseLanes + 2 * g.wo, T(0));
  T* lanes = scratch.data();
  T* x_row = lanes + taps * kDepthwiseLanes;  // a strided row of x or dx, gathered
  T* dx_row = x_row + g.wo;
  const int64_t pt = static_cast<int64_t>(g.pt), pl = static_cast<int64_t>(g.pl);
  std::vector<size_t> first(g.kw), end(g.kw);  // per kernel column: the output columns inside x
  for (size_t b = 0; b < g.kw; ++b) {
    const int64_t offset = static_cast<int64_t>(b * g.dw) - pl, stride = static_cast<int64_t>(g.sw);
    const int64_t lo = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
    const int64_t last = static_cast<int64_t>(g.w) - 1 - offset;
    const int64_t hi = last < 0 ? 0 : std::min<int64_t>(static_cast<int64_t>(g.wo), last / stride + 1);
    first[b] = static_cast<size_t>(lo);
    end[b] = static_cast<size_t>(std::max(lo, hi));
  }
  for (size_t n = 0; n < g.n; ++n) {
    const size_t plane = n * g.c + c;
    const T* xp = x + plane * g.h * g.w;
    const T* dyp = dy + plane * g.ho * g.wo;
    T* dxp = dx + plane * g.h * g.w;
    std::fill(dxp, dxp + g.h * g.w, T(0));
    for (size_t oh = 0; oh < g.ho; ++oh) {
      const T* dy_row = dyp + oh * g.wo;
      for (size_t a = 0; a < g.kh; ++a) {
        const int64_t ih = static_cast<int64_t>(oh * g.sh + a * g.dh) - pt;
        if (ih < 0 || ih >= static_cast<int64_t>(g.h)) continue;
        const T* xr = xp + ih * g.w;
        T* dxr = dxp + ih * g.w;
        for (size_t b = 0; b < g.kw; ++b) {
          if (first[b] >= end[b]) continue;
          const size_t count = end[b] - first[b];
          const size_t iw = first[b] * g.sw + b * g.dw - g.pl;
          T* tap_lanes = lanes + (a * g.kw + b) * kDepthwiseLanes;
          const T weight = w[c * taps + a * g.kw + b];
          if (g.sw == 1) {
            Rows::dot(dy_row + first[b], xr + iw, count, tap_lanes);
            Rows::axpy(weight, dy_row + first[b], dxr + iw, count);
            continue;
          }
          for (size_t i = 0; i < count; ++i) {
            x_row[i] = xr[iw + i * g.sw];
            dx_row[i] = dxr[iw + i * g.sw];
          }
          Rows::dot(dy_row + first[b], x_row, count, tap_lanes);
          Rows::axpy(weight, dy_row + first[b], dx_row, count);
          for (size_t i = 0; i < count; ++i) dxr[iw + i * g.sw] = dx_row[i];
        }
      }
    }
  }
  for (size_t t = 0; t < taps; ++t) {
    const T* l = lanes + t * kDepthwiseLanes;
    dw[c * taps + t] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  }
}

// Channel c on AVX2 + FMA (depthwise_conv_grad_avx2.cc); run only where update_avx2() is true.
void depthwise_channel_avx2(const DepthwiseGeometry& g, const float* x, const float* w, const float* dy, float* dx,
                            float* dw, size_t c);

}  // namespace normgrad
