// MaxPoolGrad (ops/max_pool_grad.py): the input gradient of a 2-D MaxPool, each window's
// maximum found again in x (the first in row-major order; a NaN counts as the maximum). The
// planes go to the intra-op threads, each whole, and every plane adds its windows' dy into dx
// in dy's row-major order: the same bits at any thread count, and the function body's
// (ScatterElements with reduction "add" adds in that order too).
#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "max_pool_grad.h"
#include "ops.h"
#include "update_math.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "MaxPoolGrad";

// The kernel taps [first, end) of each output position along one axis that fall inside the input.
struct AxisTaps {
  std::vector<size_t> first, end;
  std::vector<int64_t> start;  // input position of tap 0 (may be negative: in the head pad)
};

AxisTaps axis_taps(int64_t outputs, int64_t size, int64_t kernel, int64_t stride, int64_t head, int64_t dilation) {
  AxisTaps taps;
  for (int64_t o = 0; o < outputs; ++o) {
    const int64_t start = o * stride - head;
    int64_t first = 0, end = kernel;
    while (first < kernel && start + first * dilation < 0) ++first;
    while (end > first && start + (end - 1) * dilation >= size) --end;
    taps.first.push_back(static_cast<size_t>(first));
    taps.end.push_back(static_cast<size_t>(end));
    taps.start.push_back(start);
  }
  return taps;
}

// MaxPool's possible output sizes along one axis (ops/max_pool_grad.py output_sizes): the floor
// size; with ceil_mode the ceil size and, where its last window starts past the head pad, one less.
std::vector<int64_t> output_sizes(int64_t size, int64_t kernel, int64_t stride, int64_t head, int64_t tail,
                                  int64_t dilation, int64_t ceil_mode) {
  const int64_t room = size + head + tail - (kernel - 1) * dilation - 1;
  if (room < 0) return {};
  if (!ceil_mode) return {room / stride + 1};
  const int64_t ceil = (room + stride - 1) / stride + 1;
  if ((ceil - 1) * stride >= size + head) return {ceil - 1, ceil};
  return {ceil};
}

// The output columns [lo, hi) whose windows lie wholly inside the input.
std::pair<size_t, size_t> interior(const AxisTaps& columns, size_t kernel) {
  size_t lo = 0, hi = columns.first.size();
  while (lo < hi && (columns.first[lo] != 0 || columns.end[lo] != kernel)) ++lo;
  size_t end = lo;
  while (end < hi && columns.first[end] == 0 && columns.end[end] == kernel) ++end;
  return {lo, end};
}

// The flat plane index of window (oh, ow)'s first maximum; -1 for a window all in the padding.
template <class T>
int64_t window_argmax(const T* x, size_t w, const AxisTaps& rows, const AxisTaps& columns, size_t oh, size_t ow,
                      size_t dh, size_t dw) {
  int64_t at = -1;
  T top = T(0);
  for (size_t a = rows.first[oh]; a < rows.end[oh]; ++a) {
    const size_t row = static_cast<size_t>(rows.start[oh] + static_cast<int64_t>(a * dh));
    for (size_t b = columns.first[ow]; b < columns.end[ow]; ++b) {
      const size_t index = row * w + static_cast<size_t>(columns.start[ow] + static_cast<int64_t>(b * dw));
      const T v = x[index];
      if (at < 0 || v > top || (v != v && top == top)) {
        top = v;
        at = static_cast<int64_t>(index);
      }
    }
  }
  return at;
}

struct PlaneGeometry {
  size_t w, dh, dw, kh, kw, sw;
  AxisTaps rows, columns;
  std::pair<size_t, size_t> inner;  // interior output columns
  bool avx2;                        // float planes, indices below 2^31, update_avx2()
};

// dx of one plane: each output row's argmaxes (the interior ones 8 at a time on AVX2), then
// dy added there in dy's order.
template <class T>
void plane_gradient(const PlaneGeometry& g, const T* x, const T* dy, T* dx, std::vector<int64_t>& best) {
  const size_t ho = g.rows.first.size(), wo = g.columns.first.size();
  for (size_t oh = 0; oh < ho; ++oh, dy += wo) {
    size_t ow = 0;
    if constexpr (std::is_same<T, float>::value) {
      if (g.avx2 && g.rows.end[oh] > g.rows.first[oh]) {
        for (; ow < g.inner.first; ++ow) best[ow] = window_argmax(x, g.w, g.rows, g.columns, oh, ow, g.dh, g.dw);
        const size_t first_row = static_cast<size_t>(g.rows.start[oh] + static_cast<int64_t>(g.rows.first[oh] * g.dh));
        const PoolRow row{x, g.w, first_row, g.rows.end[oh] - g.rows.first[oh], g.dh, g.kw, g.dw, g.sw,
                          g.columns.start[0]};
        ow += max_pool_row_argmax_avx2(row, ow, g.inner.second - ow, best.data() + ow);
      }
    }
    for (; ow < wo; ++ow) best[ow] = window_argmax(x, g.w, g.rows, g.columns, oh, ow, g.dh, g.dw);
    for (ow = 0; ow < wo; ++ow) {
      if (best[ow] >= 0) dx[best[ow]] += dy[ow];
    }
  }
}

struct MaxPoolGrad final : KernelBase {
  std::vector<int64_t> kernel_shape, strides, pads, dilations;
  int64_t ceil_mode;

  explicit MaxPoolGrad(const OrtKernelInfo* info)
      : kernel_shape(geometry_attribute(info, kOp, "kernel_shape", 2, 1)),
        strides(geometry_attribute(info, kOp, "strides", 2, 1)),
        pads(geometry_attribute(info, kOp, "pads", 4, 0)),
        dilations(geometry_attribute(info, kOp, "dilations", 2, 1)),
        ceil_mode(attribute_int(info, kOp, "ceil_mode", 0)) {
    if (ceil_mode != 0 && ceil_mode != 1) {
      fail(std::string(kOp) + ": attribute 'ceil_mode' must be 0 or 1; got " + std::to_string(ceil_mode));
    }
  }
  const char* name() const override { return kOp; }

  void check(const Input& x, const Input& dy) const {
    const Input* inputs[] = {&x, &dy};
    const char* names[] = {"x", "dy"};
    const char* dims[] = {"[N, C, H, W]", "[N, C, Ho, Wo]"};
    check_float_images(kOp, inputs, names, dims, 2);
    std::vector<int64_t> sizes[2];
    for (size_t i = 0; i < 2; ++i) {
      sizes[i] = output_sizes(x.shape[2 + i], kernel_shape[i], strides[i], pads[i], pads[i + 2], dilations[i], ceil_mode);
    }
    if (sizes[0].empty() || sizes[1].empty()) {
      fail(std::string(kOp) + ": the padded input " +
           shape_str({x.shape[2] + pads[0] + pads[2], x.shape[3] + pads[1] + pads[3]}) +
           " must hold the dilated kernel " + shape_str(kernel_shape));
    }
    bool valid = dy.shape[0] == x.shape[0] && dy.shape[1] == x.shape[1];
    for (size_t i = 0; i < 2; ++i) {
      valid = valid && std::find(sizes[i].begin(), sizes[i].end(), dy.shape[2 + i]) != sizes[i].end();
    }
    if (!valid) {
      fail(std::string(kOp) + ": input 'dy' must have the MaxPool's output shape " +
           shape_str({x.shape[0], x.shape[1], sizes[0].back(), sizes[1].back()}) + "; got " + shape_str(dy.shape));
    }
  }

  template <class T>
  void run(OrtKernelContext* ctx, const Input& x, const Input& dy, T* dx) const {
    const size_t w = static_cast<size_t>(x.shape[3]);
    const size_t planes = static_cast<size_t>(x.shape[0] * x.shape[1]);
    const size_t in_plane = static_cast<size_t>(x.shape[2]) * w, out_plane = static_cast<size_t>(dy.shape[2] * dy.shape[3]);
    const AxisTaps rows = axis_taps(dy.shape[2], x.shape[2], kernel_shape[0], strides[0], pads[0], dilations[0]);
    const AxisTaps columns = axis_taps(dy.shape[3], x.shape[3], kernel_shape[1], strides[1], pads[1], dilations[1]);
    const size_t kw = static_cast<size_t>(kernel_shape[1]);
    const PlaneGeometry g{w, static_cast<size_t>(dilations[0]), static_cast<size_t>(dilations[1]),
                          static_cast<size_t>(kernel_shape[0]), kw, static_cast<size_t>(strides[1]), rows, columns,
                          interior(columns, kw), in_plane < (size_t(1) << 31) && update_avx2()};
    const T* xt = static_cast<const T*>(x.data);
    const T* dyt = static_cast<const T*>(dy.data);
    auto plane = [&](size_t p) {
      T* out = dx + p * in_plane;
      std::fill(out, out + in_plane, T(0));
      std::vector<int64_t> best(static_cast<size_t>(dy.shape[3]));
      plane_gradient(g, xt + p * in_plane, dyt + p * out_plane, out, best);
    };
    parallel_for(ctx, planes, plane, x.size + dy.size * static_cast<size_t>(kernel_shape[0] * kernel_shape[1]));
  }

  void compute(OrtKernelContext* ctx) override {
    const Input x = get_input_any_type(ctx, 0, kOp, "x");
    const Input dy = get_input_any_type(ctx, 1, kOp, "dy");
    check(x, dy);
    void* dx = get_output(ctx, 0, x.shape);
    if (x.onnx_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE) {
      run(ctx, x, dy, static_cast<double*>(dx));
    } else {
      run(ctx, x, dy, static_cast<float*>(dx));
    }
  }
};

}  // namespace

extern const OpDescriptor kMaxPoolGrad = {
    kOp, 2, 1, "TT", "00", "T", "0", 'd', 0, &create_kernel<MaxPoolGrad>,
};

}  // namespace normgrad
