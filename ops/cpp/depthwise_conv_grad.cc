// DepthwiseConvGrad (ops/depthwise_conv_grad.py): dx and dw of a 2-D depthwise Conv. The
// channels go to the intra-op threads, each whole (all samples: its dw sums over them in
// order), so the bits do not depend on the thread count (depthwise_conv_grad.h).
#include <string>
#include <vector>

#include "depthwise_conv_grad.h"
#include "ops.h"
#include "update_math.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "DepthwiseConvGrad";

// Conv's output size along one axis; < 1 where the padded input does not hold the dilated kernel.
int64_t output_size(int64_t size, int64_t kernel, int64_t stride, int64_t head, int64_t tail, int64_t dilation) {
  const int64_t room = size + head + tail - (kernel - 1) * dilation - 1;
  return room < 0 ? 0 : room / stride + 1;
}

}  // namespace

DepthwiseAttributes::DepthwiseAttributes(const OrtKernelInfo* info, const char* op)
    : op(op),
      group(attribute_int(info, op, "group", 1)),
      strides(geometry_attribute(info, op, "strides", 2, 1)),
      pads(geometry_attribute(info, op, "pads", 4, 0)),
      dilations(geometry_attribute(info, op, "dilations", 2, 1)) {}

DepthwiseGeometry DepthwiseAttributes::geometry(const Input& x, const Input& w) const {
  const Input* inputs[] = {&x, &w};
  const char* names[] = {"x", "w"};
  const char* dims[] = {"[N, C, H, W]", "[C, 1, kh, kw]"};
  check_float_images(op, inputs, names, dims, 2);
  const int64_t c = x.shape[1];
  if (w.shape[0] != c || w.shape[1] != 1) {
    fail(std::string(op) + ": input 'w' must be [C, 1, kh, kw] with x's C = " + std::to_string(c) + "; got shape " +
         shape_str(w.shape));
  }
  if (group != c) {
    fail(std::string(op) + ": attribute 'group' must equal x's channels " + std::to_string(c) + "; got " +
         std::to_string(group));
  }
  const int64_t ho = output_size(x.shape[2], w.shape[2], strides[0], pads[0], pads[2], dilations[0]);
  const int64_t wo = output_size(x.shape[3], w.shape[3], strides[1], pads[1], pads[3], dilations[1]);
  if (ho < 1 || wo < 1 || w.shape[2] < 1 || w.shape[3] < 1) {
    fail(std::string(op) + ": the padded input " +
         shape_str({x.shape[2] + pads[0] + pads[2], x.shape[3] + pads[1] + pads[3]}) +
         " must hold the dilated kernel of 'w' " + shape_str(w.shape));
  }
  if (w.shape[2] > static_cast<int64_t>(kDepthwiseMaxRows)) {
    fail(std::string(op) + ": input 'w' must have at most " + std::to_string(kDepthwiseMaxRows) +
         " kernel rows; got shape " + shape_str(w.shape));
  }
  auto u = [](int64_t v) { return static_cast<size_t>(v); };
  return {u(x.shape[0]), u(c), u(x.shape[2]), u(x.shape[3]), u(w.shape[2]), u(w.shape[3]), u(ho), u(wo),
          u(strides[0]), u(strides[1]), u(pads[0]), u(pads[1]), u(dilations[0]), u(dilations[1])};
}

namespace {

struct DepthwiseConvGrad final : KernelBase {
  DepthwiseAttributes attributes;

  explicit DepthwiseConvGrad(const OrtKernelInfo* info) : attributes(info, kOp) {}
  const char* name() const override { return kOp; }

  DepthwiseGeometry check(const Input& x, const Input& w, const Input& dy) const {
    const Input* inputs[] = {&x, &w, &dy};
    const char* names[] = {"x", "w", "dy"};
    const char* dims[] = {"[N, C, H, W]", "[C, 1, kh, kw]", "[N, C, Ho, Wo]"};
    check_float_images(kOp, inputs, names, dims, 3);
    const DepthwiseGeometry g = attributes.geometry(x, w);
    const std::vector<int64_t> expected = {x.shape[0], x.shape[1], static_cast<int64_t>(g.ho), static_cast<int64_t>(g.wo)};
    if (dy.shape != expected) {
      fail(std::string(kOp) + ": input 'dy' must have the Conv's output shape " + shape_str(expected) + "; got " +
           shape_str(dy.shape));
    }
    return g;
  }

  void compute(OrtKernelContext* ctx) override {
    const Input x = get_input_any_type(ctx, 0, kOp, "x");
    const Input w = get_input_any_type(ctx, 1, kOp, "w");
    const Input dy = get_input_any_type(ctx, 2, kOp, "dy");
    const DepthwiseGeometry g = check(x, w, dy);
    void* dx = get_output(ctx, 0, x.shape);
    void* dw = get_output(ctx, 1, w.shape);
    if (x.size == 0) {  // no samples (or no channels): dw sums nothing
      if (w.onnx_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
        std::fill(static_cast<float*>(dw), static_cast<float*>(dw) + w.size, 0.0f);
      } else {
        std::fill(static_cast<double*>(dw), static_cast<double*>(dw) + w.size, 0.0);
      }
      return;
    }
    const size_t work = x.size * g.kh * g.kw;
    const DepthwiseGradPlan plan(g);
    if (x.onnx_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE) {
      auto run = [&](size_t c) {
        depthwise_channel<double, ScalarRows<double>, ScalarForward<double>>(
            plan, static_cast<const double*>(x.data), static_cast<const double*>(w.data),
            static_cast<const double*>(dy.data), static_cast<double*>(dx), static_cast<double*>(dw), c);
      };
      parallel_for(ctx, g.c, run, work);
      return;
    }
    const bool avx2 = update_avx2();
    auto run = [&](size_t c) {
      const float *xf = static_cast<const float*>(x.data), *wf = static_cast<const float*>(w.data),
                  *dyf = static_cast<const float*>(dy.data);
      if (avx2) {
        depthwise_channel_avx2(plan, xf, wf, dyf, static_cast<float*>(dx), static_cast<float*>(dw), c);
      } else {
        depthwise_channel<float, ScalarRows<float>, ScalarForward<float>>(plan, xf, wf, dyf, static_cast<float*>(dx),
                                                                          static_cast<float*>(dw), c);
      }
    };
    parallel_for(ctx, g.c, run, work);
  }
};

}  // namespace

extern const OpDescriptor kDepthwiseConvGrad = {
    kOp, 3, 2, "TTT", "000", "TT", "00", 'd', 0, &create_kernel<DepthwiseConvGrad>,
};

}  // namespace normgrad
