// A 2-D depthwise Conv's geometry and forward (DepthwiseConv, ops/depthwise_conv.py; its
// gradient's kernel, depthwise_conv_grad.h, builds on them). A (sample, channel) plane is
// copied once into a zero-padded scratch, split by column phase when strided, so that every
// tap reads one contiguous run with no edge cases; each y element is one chain of fused
// multiply-adds over the taps in order (row by row of the kernel), starting from the bias. The
// portable and the AVX2 block (depthwise_conv_avx2.cc) compute those chains alike, so every
// path gives the same bits.
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
// Elements read past a run's last output: the vector block's over-read, within the scratch.
constexpr size_t kDepthwiseSlack = 8;
// The most kernel rows the kernels take (the Python side writes the operators for no more).
constexpr size_t kDepthwiseMaxRows = 64;

struct Input;  // ort_glue.h

// DepthwiseConv's and DepthwiseConvGrad's attributes, Conv's geometry (depthwise_conv_grad.cc).
struct DepthwiseAttributes {
  const char* op;
  int64_t group;
  std::vector<int64_t> strides, pads, dilations;

  DepthwiseAttributes(const OrtKernelInfo* info, const char* op);
  // The geometry of the Conv of x [N, C, H, W] and w [C, 1, kh, kw] (float32 or float64 alike,
  // group = C, the padded input holding the dilated kernel, kh <= kDepthwiseMaxRows); else an
  // error naming the operator, the input or attribute and the rule.
  DepthwiseGeometry geometry(const Input& x, const Input& w) const;
};

// A plane of x as the taps read it: rows (oh sh + a dh), each the phases of the padded columns.
struct DepthwiseScratch {
  size_t rows, columns;      // the padded rows and columns the taps read
  size_t phase, row_stride;  // phase: one phase's length (with the slack)
  std::vector<size_t> offset;  // per kernel column: where its run starts in a row
  std::vector<size_t> tap_offset;  // per tap (row by row of the kernel): where its run starts in the plane
};

inline DepthwiseScratch depthwise_scratch(const DepthwiseGeometry& g) {
  DepthwiseScratch s;
  s.rows = (g.ho - 1) * g.sh + (g.kh - 1) * g.dh + 1;
  s.columns = (g.wo - 1) * g.sw + (g.kw - 1) * g.dw + 1;
  s.phase = (s.columns + g.sw - 1) / g.sw + kDepthwiseSlack;
  s.row_stride = g.sw * s.phase;
  for (size_t b = 0; b < g.kw; ++b) s.offset.push_back((b * g.dw) % g.sw * s.phase + (b * g.dw) / g.sw);
  for (size_t a = 0; a < g.kh; ++a) {
    for (size_t b = 0; b < g.kw; ++b) s.tap_offset.push_back(a * g.dh * s.row_stride + s.offset[b]);
  }
  return s;
}

// Phase `phase` [k0, k1) of padded row `source` (source[j]: padded column j) at stride `sw`:
// phase[k] = source[k sw + q]. A compile-time stride for the common ones, so the copy is
// a memcpy at 1 and a vectorizable gather at 2.
template <class T, size_t kStride>
inline void copy_phase(const T* source, size_t q, size_t k0, size_t k1, T* phase) {
  for (size_t k = k0; k < k1; ++k) phase[k] = source[k * kStride + q];
}

template <class T>
inline void copy_phase(const T* source, size_t sw, size_t q, size_t k0, size_t k1, T* phase) {
  if (sw == 1) {
    std::copy(source + k0, source + k1, phase + k0);
  } else if (sw == 2) {
    copy_phase<T, 2>(source, q, k0, k1, phase);
  } else {
    for (size_t k = k0; k < k1; ++k) phase[k] = source[k * sw + q];
  }
}

// The plane x_plane [h, w] into `scratch` (s.rows x s.row_stride, resized; what the plane does
// not cover is zero). Each element is written once: the padding and slack are zeroed around
// the copied runs, not under them.
template <class T>
void fill_depthwise_scratch(const DepthwiseGeometry& g, const DepthwiseScratch& s, const T* x_plane,
                            std::vector<T>& scratch) {
  scratch.resize(s.rows * s.row_stride);
  const size_t first = g.pl, end = std::min(g.pl + g.w, s.columns);  // the padded columns holding x
  for (size_t i = 0; i < s.rows; ++i) {
    T* row = scratch.data() + i * s.row_stride;
    const ptrdiff_t ih = static_cast<ptrdiff_t>(i) - static_cast<ptrdiff_t>(g.pt);
    if (first >= end || ih < 0 || ih >= static_cast<ptrdiff_t>(g.h)) {
      std::fill(row, row + s.row_stride, T(0));
      continue;
    }
    const T* source = x_plane + ih * g.w - g.pl;  // source[j]: padded column j
    for (size_t q = 0; q < g.sw; ++q) {  // phase q: the padded columns j = k sw + q
      T* phase = row + q * s.phase;
      const size_t k0 = (first + g.sw - 1 - q) / g.sw;  // the first k with k sw + q >= first
      const size_t k1 = std::max(k0, (end + g.sw - 1 - q) / g.sw);  // the first k with k sw + q >= end
      std::fill(phase, phase + k0, T(0));
      copy_phase(source, g.sw, q, k0, k1, phase);
      std::fill(phase + k1, phase + s.phase, T(0));
    }
  }
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

// y_plane [ho, wo] from x_plane [h, w], the channel's taps w_taps [kh kw] and its bias.
template <class T, class Taps>
void depthwise_forward_plane(const DepthwiseGeometry& g, const DepthwiseScratch& s, const T* x_plane,
                             const T* w_taps, T bias, T* y_plane) {
  thread_local std::vector<T> scratch;
  fill_depthwise_scratch(g, s, x_plane, scratch);
  const T* rows[kDepthwiseMaxRows];
  for (size_t oh = 0; oh < g.ho; ++oh) {
    for (size_t a = 0; a < g.kh; ++a) rows[a] = scratch.data() + (oh * g.sh + a * g.dh) * s.row_stride;
    Taps::row(rows, s.offset.data(), w_taps, g.kh, g.kw, bias, y_plane + oh * g.wo, g.wo);
  }
}

// The same on AVX2 + FMA (depthwise_conv_avx2.cc); run only where update_avx2() is true.
void depthwise_forward_plane_avx2(const DepthwiseGeometry& g, const DepthwiseScratch& s, const float* x_plane,
                                  const float* w_taps, float bias, float* y_plane);

}  // namespace normgrad
