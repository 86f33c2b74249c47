// AdamUpdate: one Adam/AdamW step of a float32 parameter in one pass (ops/adam_update.py).
//
// The arithmetic is the contract's float32 ops in its order (the function body's), never
// contracted into FMAs (this file is compiled without -mfma and with -ffp-contract=off), so
// the kernel gives the roundings of separate ONNX ops. Each element's inputs are read before its outputs are written and
// no element depends on another, so an output may share its input's buffer (the trainer
// updates the optimizer state in place). Fixed chunks: the same bits for any thread count.
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "ops.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "AdamUpdate";
constexpr size_t kChunk = size_t(1) << 14;  // a multiple of kBlock
constexpr size_t kBlock = 64;
constexpr int kInputs = 8;
const char* const kNames[kInputs] = {"param",     "grad",             "exp_avg",     "exp_avg_sq",
                                     "step_size", "correction2_sqrt", "param_scale", "grad_scale"};
constexpr int kOptional = 6;  // param_scale and grad_scale: omitted, no multiplication at all

struct AdamUpdate final : KernelBase {
  float beta2, one_minus_beta1, one_minus_beta2, epsilon;

  explicit AdamUpdate(const OrtKernelInfo* info)
      : beta2(attribute_float(info, kOp, "beta2", 0.999f)),
        one_minus_beta1(attribute_float(info, kOp, "one_minus_beta1", 0.1f)),
        one_minus_beta2(attribute_float(info, kOp, "one_minus_beta2", 0.001f)),
        epsilon(attribute_float(info, kOp, "epsilon", 1e-8f)) {
    // the contract's rule (ops/adam_update.py validate): refused at session creation
    const std::pair<const char*, float> attributes[] = {
        {"beta2", beta2}, {"one_minus_beta1", one_minus_beta1}, {"one_minus_beta2", one_minus_beta2}, {"epsilon", epsilon}};
    for (const auto& [name, value] : attributes) {
      if (!std::isfinite(value) || value < 0.0f) {
        fail(std::string(kOp) + ": attribute '" + name + "' must be a finite float >= 0; got " + std::to_string(value));
      }
    }
  }
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    Input in[kInputs];
    for (int i = 0; i < kInputs; ++i) {
      in[i] = get_input_any_type(ctx, i, kOp, kNames[i]);
      if (!in[i].present) {
        if (i >= kOptional) continue;
        fail(std::string(kOp) + ": input '" + kNames[i] + "' is required");
      }
      if (in[i].onnx_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
        fail(std::string(kOp) + ": input '" + kNames[i] + "' must be float32; got " + dtype_name(in[i].onnx_type));
      }
      if (i >= 1 && i < 4 && in[i].shape != in[0].shape) {
        fail(std::string(kOp) + ": input '" + kNames[i] + "' must have the shape of 'param' " + shape_str(in[0].shape) +
             "; got " + shape_str(in[i].shape));
      }
      if (i >= 4 && in[i].size != 1) {
        fail(std::string(kOp) + ": input '" + kNames[i] + "' must be a scalar; got shape " + shape_str(in[i].shape));
      }
    }
    const float* p = static_cast<const float*>(in[0].data);
    const float* g = static_cast<const float*>(in[1].data);
    const float* m = static_cast<const float*>(in[2].data);
    const float* v = static_cast<const float*>(in[3].data);
    const float step_size = *static_cast<const float*>(in[4].data);
    const float correction2_sqrt = *static_cast<const float*>(in[5].data);
    const bool decay = in[6].present, clip = in[7].present;
    const float param_scale = decay ? *static_cast<const float*>(in[6].data) : 1.0f;
    const float grad_scale = clip ? *static_cast<const float*>(in[7].data) : 1.0f;
    float* p_next = static_cast<float*>(get_output(ctx, 0, in[0].shape));
    float* m_next = static_cast<float*>(get_output(ctx, 1, in[0].shape));
    float* v_next = static_cast<float*>(get_output(ctx, 2, in[0].shape));
    const size_t n = in[0].size;
    // Blocks go through local arrays: the arithmetic loop then has a fixed trip count and
    // no possible aliasing, so it vectorizes even when the outputs are the inputs' buffers
    // (the compiler's overlap check would send the in-place case down a scalar loop).
    auto chunk = [&](size_t c) {
      float in_p[kBlock] = {}, in_g[kBlock] = {}, in_m[kBlock] = {}, in_v[kBlock] = {};
      float out_p[kBlock], out_m[kBlock], out_v[kBlock];
      const size_t end = std::min(n, (c + 1) * kChunk);
      for (size_t begin = c * kChunk; begin < end; begin += kBlock) {
        const size_t len = std::min(kBlock, end - begin);
        std::copy(p + begin, p + begin + len, in_p);
        std::copy(g + begin, g + begin + len, in_g);
        std::copy(m + begin, m + begin + len, in_m);
        std::copy(v + begin, v + begin + len, in_v);
        for (size_t i = 0; i < kBlock; ++i) {
          const float gi = clip ? in_g[i] * grad_scale : in_g[i];
          const float avg_next = in_m[i] + (gi - in_m[i]) * one_minus_beta1;
          const float sq_next = in_v[i] * beta2 + (gi * gi) * one_minus_beta2;
          const float denominator = std::sqrt(sq_next) / correction2_sqrt + epsilon;
          out_p[i] = (decay ? in_p[i] * param_scale : in_p[i]) - avg_next / denominator * step_size;
          out_m[i] = avg_next;
          out_v[i] = sq_next;
        }
        std::copy(out_p, out_p + len, p_next + begin);
        std::copy(out_m, out_m + len, m_next + begin);
        std::copy(out_v, out_v + len, v_next + begin);
      }
    };
    parallel_for(ctx, (n + kChunk - 1) / kChunk, chunk, n);
  }
};

}  // namespace

extern const OpDescriptor kAdamUpdate = {
    kOp, kInputs, 3, "TTTTTTTT", "00000011", "TTT", "000", 'd', 0, &create_kernel<AdamUpdate>,
};

}  // namespace normgrad
