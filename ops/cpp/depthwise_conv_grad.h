// DepthwiseConvGrad (ops/depthwise_conv_grad.py): dx and dw of a 2-D depthwise Conv, one
// channel at a time (its dw sums over the samples in order). Each sample's plane of x is laid
// out as the forward reads it (depthwise_conv.h's scratch). dw: each tap's eight lanes take the
// products of dy's columns j = l (mod 8) (zero past the row's end), over the rows and samples
// in order, each lane one chain of fused multiply-adds; the lanes are added in a fixed tree.
// dx: at stride 1 the forward's kernel over dy with the kernel flipped (each element one chain
// over the taps), at larger strides one fused multiply-add per tap and element. The portable
// and the AVX2 primitives round alike, so every path gives the same bits.
#pragma once

#include "depthwise_conv.h"

namespace normgrad {

// The most taps whose lanes one pass over dy keeps (in registers, on AVX2).
constexpr size_t kDepthwiseDotTaps = 12;

// The portable primitives (std::fma: one rounding, as the vector lanes).
template <class T>
struct ScalarRows {
  static void axpy(T alpha, const T* x, T* y, size_t count) {
    for (size_t i = 0; i < count; ++i) y[i] = std::fma(alpha, x[i], y[i]);
  }
  // lanes[i 8 + l] += dy[oh, j] runs[i][oh step + j] for j = l (mod 8), j < wo (beyond it,
  // + 0 * 0), over the rows oh < ho in order, for the `taps` (<= kDepthwiseDotTaps) runs.
  static void dots(const T* dy, size_t wo, size_t ho, const T* const* runs, size_t step, size_t taps, T* lanes) {
    for (size_t oh = 0; oh < ho; ++oh) {
      for (size_t j = 0; j < wo; j += kDepthwiseLanes) {
        for (size_t i = 0; i < taps; ++i) {
          for (size_t l = 0; l < kDepthwiseLanes; ++l) {
            const bool inside = j + l < wo;
            const T a = inside ? dy[oh * wo + j + l] : T(0), x = inside ? runs[i][oh * step + j + l] : T(0);
            lanes[i * kDepthwiseLanes + l] = std::fma(a, x, lanes[i * kDepthwiseLanes + l]);
          }
        }
      }
    }
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

// row[k stride + q] = phase[k] for k < count, the stride known when compiled (vectorizable).
template <class T, size_t kStride>
inline void scatter_phase(const T* phase, size_t q, size_t count, T* row) {
  for (size_t k = 0; k < count; ++k) row[k * kStride + q] = phase[k];
}

// dx of one plane at a stride above 1: for each output row and tap, dy's row times the tap
// added into x's row as the kernel read it (split by column phase when strided along columns).
template <class T, class Rows>
void depthwise_strided_dx(const DepthwiseGeometry& g, const DepthwiseColumns& columns, const T* w_taps,
                          const T* dy_plane, T* dx_plane, std::vector<T>& split) {
  const size_t plane_size = g.h * g.w, sw = g.sw;
  const int64_t pt = static_cast<int64_t>(g.pt);
  T* dxs = dx_plane;
  if (sw > 1) {
    split.assign(plane_size, T(0));
    dxs = split.data();
  } else {
    std::fill(dx_plane, dx_plane + plane_size, T(0));
  }
  for (size_t oh = 0; oh < g.ho; ++oh) {
    const T* dy_row = dy_plane + oh * g.wo;
    for (size_t a = 0; a < g.kh; ++a) {
      const int64_t ih = static_cast<int64_t>(oh * g.sh + a * g.dh) - pt;
      if (ih < 0 || ih >= static_cast<int64_t>(g.h)) continue;
      T* dxr = dxs + ih * g.w;
      for (size_t b = 0; b < g.kw; ++b) {
        const size_t first = columns.first[b], count = columns.end[b] - first;
        if (count > 0) Rows::axpy(w_taps[a * g.kw + b], dy_row + first, dxr + columns.offset[b], count);
      }
    }
  }
  if (sw > 1) {  // the phases back into dx's columns
    for (size_t i = 0; i < g.h; ++i) {
      for (size_t q = 0; q < sw; ++q) {
        const T* phase = dxs + i * g.w + columns.phase_start[q];
        T* row = dx_plane + i * g.w;
        const size_t count = columns.phase_start[q + 1] - columns.phase_start[q];
        if (sw == 2) {
          scatter_phase<T, 2>(phase, q, count, row);
        } else {
          for (size_t k = 0; k < count; ++k) row[k * sw + q] = phase[k];
        }
      }
    }
  }
}

// The forward's portable plane with no bias (dx at stride 1).
template <class T>
struct ScalarForward {
  static void plane(const DepthwiseGeometry& g, const DepthwiseScratch& s, const T* x, const T* w, T* y) {
    depthwise_forward_plane<T, ScalarTaps<T>>(g, s, x, w, T(0), y);
  }
};

// dx's geometry at stride 1: the forward Conv of dy with the kernel flipped, padded so that its
// output is x's size (needs each pad at most the dilated kernel's extent less one).
inline bool depthwise_transposed(const DepthwiseGeometry& g, DepthwiseGeometry* t) {
  const size_t reach_h = (g.kh - 1) * g.dh, reach_w = (g.kw - 1) * g.dw;
  if (g.sh != 1 || g.sw != 1 || g.pt > reach_h || g.pl > reach_w || g.ho > g.h + g.pt || g.wo > g.w + g.pl) {
    return false;
  }
  *t = {g.n, g.c, g.ho, g.wo, g.kh, g.kw, g.h, g.w, 1, 1, reach_h - g.pt, reach_w - g.pl, g.dh, g.dw};
  return true;
}

// What every channel's task reads, laid out once per run: x's scratch and dx's form (at stride
// 1 the transposed forward and its scratch, else the row columns of the strided form).
struct DepthwiseGradPlan {
  DepthwiseGeometry g, t{};
  DepthwiseScratch s, ts;
  bool transposed;
  DepthwiseColumns columns;

  explicit DepthwiseGradPlan(const DepthwiseGeometry& geometry)
      : g(geometry), s(depthwise_scratch(geometry)), transposed(depthwise_transposed(geometry, &t)) {
    if (transposed) {
      ts = depthwise_scratch(t);
    } else {
      columns = depthwise_columns(g);
    }
  }
};

// Channel c of every sample: dx[:, c] (overwritten) and dw[c] (its taps).
template <class T, class Rows, class Forward>
void depthwise_channel(const DepthwiseGradPlan& plan, const T* x, const T* w, const T* dy, T* dx, T* dw, size_t c) {
  const DepthwiseGeometry& g = plan.g;
  const DepthwiseScratch& s = plan.s;
  const size_t taps = g.kh * g.kw, plane_size = g.h * g.w, out_size = g.ho * g.wo;
  thread_local std::vector<T> scratch, lanes, flipped, split;
  thread_local std::vector<const T*> runs;
  lanes.assign(taps * kDepthwiseLanes, T(0));
  if (plan.transposed) {
    flipped.assign(w + c * taps, w + (c + 1) * taps);
    std::reverse(flipped.begin(), flipped.end());
  }
  for (size_t n = 0; n < g.n; ++n) {
    const size_t plane = n * g.c + c;
    const T* dyp = dy + plane * out_size;
    fill_depthwise_scratch(g, s, x + plane * plane_size, scratch);
    runs.clear();
    for (const size_t offset : s.tap_offset) runs.push_back(scratch.data() + offset);
    for (size_t tap = 0; tap < taps; tap += kDepthwiseDotTaps) {
      Rows::dots(dyp, g.wo, g.ho, &runs[tap], g.sh * s.row_stride, std::min(kDepthwiseDotTaps, taps - tap),
                 &lanes[tap * kDepthwiseLanes]);
    }
    if (plan.transposed) {
      Forward::plane(plan.t, plan.ts, dyp, flipped.data(), dx + plane * plane_size);
    } else {
      depthwise_strided_dx<T, Rows>(g, plan.columns, w + c * taps, dyp, dx + plane * plane_size, split);
    }
  }
  for (size_t tap = 0; tap < taps; ++tap) {
    const T* l = &lanes[tap * kDepthwiseLanes];
    dw[c * taps + tap] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  }
}

// Channel c on AVX2 + FMA (depthwise_conv_grad_avx2.cc); run only where update_avx2() is true.
void depthwise_channel_avx2(const DepthwiseGradPlan& plan, const float* x, const float* w, const float* dy, float* dx,
                            float* dw, size_t c);

}  // namespace normgrad
