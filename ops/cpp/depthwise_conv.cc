// DepthwiseConv (ops/depthwise_conv.py): a 2-D depthwise Conv's output. The (sample, channel)
// planes go to the intra-op threads, each whole and independent, so the bits do not depend on
// the thread count (depthwise_conv.h).
#include <string>
#include <type_traits>
#include <vector>

#include "depthwise_conv.h"
#include "ops.h"
#include "update_math.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "DepthwiseConv";

struct DepthwiseConv final : KernelBase {
  DepthwiseAttributes attributes;

  explicit DepthwiseConv(const OrtKernelInfo* info) : attributes(info, kOp) {}
  const char* name() const override { return kOp; }

  template <class T>
  void run(OrtKernelContext* ctx, const DepthwiseGeometry& g, const Input& x, const Input& w, const Input& b,
           void* y) {
    const DepthwiseScratch s = depthwise_scratch(g);
    const T *xt = static_cast<const T*>(x.data), *wt = static_cast<const T*>(w.data);
    const T* bt = b.present ? static_cast<const T*>(b.data) : nullptr;
    T* yt = static_cast<T*>(y);
    const bool avx2 = std::is_same<T, float>::value && update_avx2();
    const size_t taps = g.kh * g.kw;
    auto plane = [&](size_t p) {
      const size_t c = p % g.c;
      const T* x_plane = xt + p * g.h * g.w;
      const T* w_taps = wt + c * taps;
      const T bias = bt != nullptr ? bt[c] : T(0);
      T* y_plane = yt + p * g.ho * g.wo;
      if constexpr (std::is_same<T, float>::value) {
        if (avx2) return depthwise_forward_plane_avx2(g, s, x_plane, w_taps, bias, y_plane);
      }
      depthwise_forward_plane<T, ScalarTaps<T>>(g, s, x_plane, w_taps, bias, y_plane);
    };
    parallel_for(ctx, g.n * g.c, plane, g.n * g.c * g.ho * g.wo * g.kh * g.kw);
  }

  void compute(OrtKernelContext* ctx) override {
    const Input x = get_input_any_type(ctx, 0, kOp, "x");
    const Input w = get_input_any_type(ctx, 1, kOp, "w");
    const Input b = get_input_any_type(ctx, 2, kOp, "b");
    const DepthwiseGeometry g = attributes.geometry(x, w);
    if (b.present && (b.onnx_type != x.onnx_type || b.shape != std::vector<int64_t>{x.shape[1]})) {
      fail(std::string(kOp) + ": input 'b' must be [C] = " + shape_str({x.shape[1]}) + " of x's type " +
           dtype_name(x.onnx_type) + "; got " + dtype_name(b.onnx_type) + " " + shape_str(b.shape));
    }
    void* y = get_output(ctx, 0, {x.shape[0], x.shape[1], static_cast<int64_t>(g.ho), static_cast<int64_t>(g.wo)});
    if (x.size == 0) return;
    if (x.onnx_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE) {
      run<double>(ctx, g, x, w, b, y);
    } else {
      run<float>(ctx, g, x, w, b, y);
    }
  }
};

}  // namespace

extern const OpDescriptor kDepthwiseConv = {
    kOp, 3, 1, "TTT", "001", "T", "0", 'd', 0, &create_kernel<DepthwiseConv>,
};

}  // namespace normgrad
