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

struct OrtKernelInfo;  // onnxruntime_c_api.h

namespace normgrad {

struct DepthwiseGeometry {
  size_t n, c, h, w, kh, kw, ho, wo, sh, sw, pt, pl, dh, dw;
};

constexpr size_t kDepthwiseLanes = 8;

struct Input;  // ort_glue.h

// DepthwiseConv's and DepthwiseConvGrad's attributes, Conv's geometry (depthwise_conv_grad.cc).
struct DepthwiseAttributes {
  const char* op;
  int64_t group;
  std::vector<int64_t> strides, pads, dilations;

  DepthwiseAttributes(const OrtKernelInfo* info, const char* op);
  // The geometry of the Conv of x [N, C, H, W] and w [C, 1, kh, kw] (float32 or float64 alike,
  // group = C, the padded input holding the dilated kernel); else an error naming the operator,
  // the input or attribute and the rule.
  DepthwiseGeometry geometry(const Input& x, const Input& w) const;
};

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

// Where each kernel column's taps fall in a row of x as the kernel reads it: with column stride
// sw > 1 the row split by column phase (column k sw + q at index k of phase q, the phases one
// after another), so that every tap reads a contiguous run; for output columns [first, end).
struct DepthwiseColumns {
  std::vector<size_t> first, end, offset;  // per kernel column: the output columns inside x, the run's start
  std::vector<size_t> phase_start;         // per phase: its start in a split row
};

inline DepthwiseColumns depthwise_columns(const DepthwiseGeometry& g) {
  DepthwiseColumns columns;
  const int64_t sw = static_cast<int64_t>(g.sw), width = static_cast<int64_t>(g.w);
  columns.phase_start.push_back(0);
  for (int64_t q = 0; q < sw; ++q) {
    const int64_t phase_width = q < width ? (width - q + sw - 1) / sw : 0;
    columns.phase_start.push_back(columns.phase_start.back() + static_cast<size_t>(phase_width));
  }
  for (size_t b = 0; b < g.kw; ++b) {
    const int64_t e = static_cast<int64_t>(b * g.dw) - static_cast<int64_t>(g.pl);  // input column of output column 0
    const int64_t phase = ((e % sw) + sw) % sw, base = (e - phase) / sw;
    const int64_t phase_width = static_cast<int64_t>(columns.phase_start[phase + 1] - columns.phase_start[phase]);
    const int64_t first = std::max<int64_t>(0, -base);
    const int64_t end = std::max(first, std::min<int64_t>(static_cast<int64_t>(g.wo), phase_width - base));
    columns.first.push_back(static_cast<size_t>(first));
    columns.end.push_back(static_cast<size_t>(end));
    columns.offset.push_back(columns.phase_start[phase] + static_cast<size_t>(first + base));
  }
  return columns;
}

// Channel c of every sample: dx[:, c] (overwritten) and dw[c] (its taps).
template <class T, class Rows>
void depthwise_channel(const DepthwiseGeometry& g, const T* x, const T* w, const T* dy, T* dx, T* dw, size_t c) {
  const size_t taps = g.kh * g.kw, plane_size = g.h * g.w, sw = g.sw;
  const bool split = sw > 1;
  const DepthwiseColumns columns = depthwise_columns(g);
  thread_local std::vector<T> scratch;
  scratch.assign(taps * kDepthwiseLanes + (split ? 2 * plane_size : 0), T(0));
  T* lanes = scratch.data();
  const int64_t pt = static_cast<int64_t>(g.pt);
  for (size_t n = 0; n < g.n; ++n) {
    const size_t plane = n * g.c + c;
    const T* dyp = dy + plane * g.ho * g.wo;
    const T* xs = x + plane * plane_size;  // x's plane as the kernel reads it (split by phase when strided)
    T* dxs = dx + plane * plane_size;
    if (split) {
      T* x_split = lanes + taps * kDepthwiseLanes;
      for (size_t i = 0; i < g.h; ++i) {
        for (size_t q = 0; q < sw; ++q) {
          for (size_t k = 0, j = q; j < g.w; ++k, j += sw) x_split[i * g.w + columns.phase_start[q] + k] = xs[i * g.w + j];
        }
      }
      xs = x_split;
      dxs = x_split + plane_size;
    }
    std::fill(dxs, dxs + plane_size, T(0));
    for (size_t oh = 0; oh < g.ho; ++oh) {
      const T* dy_row = dyp + oh * g.wo;
      for (size_t a = 0; a < g.kh; ++a) {
        const int64_t ih = static_cast<int64_t>(oh * g.sh + a * g.dh) - pt;
        if (ih < 0 || ih >= static_cast<int64_t>(g.h)) continue;
        const T* xr = xs + ih * g.w;
        T* dxr = dxs + ih * g.w;
        for (size_t b = 0; b < g.kw; ++b) {
          const size_t first = columns.first[b], count = columns.end[b] - first;
          if (count == 0) continue;
          Rows::dot(dy_row + first, xr + columns.offset[b], count, lanes + (a * g.kw + b) * kDepthwiseLanes);
          Rows::axpy(w[c * taps + a * g.kw + b], dy_row + first, dxr + columns.offset[b], count);
        }
      }
    }
    if (split) {  // the phases back into dx's columns
      T* dxp = dx + plane * plane_size;
      for (size_t i = 0; i < g.h; ++i) {
        for (size_t q = 0; q < sw; ++q) {
          for (size_t k = 0, j = q; j < g.w; ++k, j += sw) dxp[i * g.w + j] = dxs[i * g.w + columns.phase_start[q] + k];
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
