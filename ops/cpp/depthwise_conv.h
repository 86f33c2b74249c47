// DepthwiseConv (ops/depthwise_conv.py): a 2-D depthwise Conv's output, one (sample, channel)
// plane at a time. The plane is copied once into a zero-padded scratch, split by column phase
// when strided, so that every tap reads one contiguous run with no edge cases; each y element
// is one chain of fused multiply-adds over the taps in order (row by row of the kernel),
// starting from the bias. The portable and the AVX2 block (depthwise_conv_avx2.cc) compute
// those chains alike, so every path gives the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "depthwise_conv_grad.h"

namespace normgrad {

// Elements read past a run's last output: the vector block's over-read, within the scratch.
constexpr size_t kDepthwiseSlack = 8;
// The most kernel rows the kernel takes (the Python side writes the operator for no more).
constexpr size_t kDepthwiseMaxRows = 64;

// A plane of x as the taps read it: rows (oh sh + a dh), each the phases of the padded columns.
struct DepthwiseScratch {
  size_t rows, columns;            // the padded rows and columns the taps read
  size_t phase, row_stride;        // phase: one phase's length (with the slack)
  std::vector<size_t> offset;      // per kernel column: where its run starts in a row
};

inline DepthwiseScratch depthwise_scratch(const DepthwiseGeometry& g) {
  DepthwiseScratch s;
  s.rows = (g.ho - 1) * g.sh + (g.kh - 1) * g.dh + 1;
  s.columns = (g.wo - 1) * g.sw + (g.kw - 1) * g.dw + 1;
  s.phase = (s.columns + g.sw - 1) / g.sw + kDepthwiseSlack;
  s.row_stride = g.sw * s.phase;
  for (size_t b = 0; b < g.kw; ++b) s.offset.push_back((b * g.dw) % g.sw * s.phase + (b * g.dw) / g.sw);
  return s;
}

// The portable block: y[j] = fma chain over the taps from bias, for j < count.
template <class T>
struct ScalarTaps {
  static void row(const T* const* rows, const size_t* offset, const T* w, size_t kh, size_t kw, T bias, T* y,
                  size_t count) {
    for (size_t j = 0; j < count; ++j) {
      T sum = bias;
      for (size_t a = 0; a < kh; ++a) {
        for (size_t b = 0; b < kw; ++b) sum = std::fma(w[a * kw + b], rows[a][offset[b] + j], sum);
      }
      y[j] = sum;
    }
  }
};

// y's plane `plane` (= n C + c) from x's.
template <class T, class Taps>
void depthwise_forward_plane(const DepthwiseGeometry& g, const DepthwiseScratch& s, const T* x, const T* w,
                             const T* bias, T* y, size_t plane) {
  const size_t c = plane % g.c, taps = g.kh * g.kw;
  thread_local std::vector<T> scratch;
  scratch.assign(s.rows * s.row_stride, T(0));
  const T* xp = x + plane * g.h * g.w;
  const size_t first = g.pl, end = std::min(g.pl + g.w, s.columns);  // the padded columns holding x
  for (size_t i = 0; i < s.rows; ++i) {
    const ptrdiff_t ih = static_cast<ptrdiff_t>(i) - static_cast<ptrdiff_t>(g.pt);
    if (ih < 0 || ih >= static_cast<ptrdiff_t>(g.h) || first >= end) continue;
    const T* source = xp + ih * g.w - g.pl;  // source[j]: padded column j
    T* row = scratch.data() + i * s.row_stride;
    for (size_t q = 0; q < g.sw; ++q) {  // phase q: the padded columns j = k sw + q
      T* phase = row + q * s.phase;
      size_t k = (first + g.sw - 1 - q) / g.sw;  // the first k with k sw + q >= first
      for (size_t j = k * g.sw + q; j < end; j += g.sw, ++k) phase[k] = source[j];
    }
  }
  const T* rows[kDepthwiseMaxRows];
  const T b = bias != nullptr ? bias[c] : T(0);
  for (size_t oh = 0; oh < g.ho; ++oh) {
    for (size_t a = 0; a < g.kh; ++a) rows[a] = scratch.data() + (oh * g.sh + a * g.dh) * s.row_stride;
    Taps::row(rows, s.offset.data(), w + c * taps, g.kh, g.kw, b, y + (plane * g.ho + oh) * g.wo, g.wo);
  }
}

// Plane `plane` on AVX2 + FMA (depthwise_conv_avx2.cc); run only where update_avx2() is true.
void depthwise_forward_plane_avx2(const DepthwiseGeometry& g, const DepthwiseScratch& s, const float* x,
                                  const float* w, const float* bias, float* y, size_t plane);

}  // namespace normgrad
