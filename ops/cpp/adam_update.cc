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

#include "ops.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "AdamUpdate";
constexpr size_t kChunk = size_t(1) << 14;  // a multiple of kBlock
constexpr size_t kBlock = 64;
constexpr int kInputs = 14;
const char* const kNames[kInputs] = {"param",          "grad",    "exp_avg",         "exp_avg_sq", "step_size",
                                     "correction2_sqrt", "one_minus_beta1", "beta2", "one_minus_beta2",
                                     "epsilon",        "param_scale", "grad_scale",   "weight_decay", "applied"};
enum : int { kStepSize = 4, kOneMinusBeta1 = 6, kBeta2, kOneMinusBeta2, kEpsilon, kParamScale, kGradScale,
             kWeightDecay, kApplied };
constexpr int kOptional = kParamScale;  // omitted: no operation at all

struct AdamUpdate final : KernelBase {
  explicit AdamUpdate(const OrtKernelInfo*) {}
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    Input in[kInputs];
    for (int i = 0; i < kInputs; ++i) {
      in[i] = get_input_any_type(ctx, i, kOp, kNames[i]);
      if (!in[i].present) {
        if (i >= kOptional) continue;
        fail(std::string(kOp) + ": input '" + kNames[i] + "' is required");
      }
      const auto wanted = i == kApplied ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
      if (in[i].onnx_type != wanted) {
        fail(std::string(kOp) + ": input '" + kNames[i] + "' must be " + (i == kApplied ? "bool" : "float32") +
             "; got " + dtype_name(in[i].onnx_type));
      }
      if (i >= 1 && i < 4 && in[i].shape != in[0].shape) {
        fail(std::string(kOp) + ": input '" + kNames[i] + "' must have the shape of 'param' " + shape_str(in[0].shape) +
             "; got " + shape_str(in[i].shape));
      }
      if (i >= kStepSize && in[i].size != 1) {
        fail(std::string(kOp) + ": input '" + kNames[i] + "' must be a scalar; got shape " + shape_str(in[i].shape));
      }
    }
    const float* p = static_cast<const float*>(in[0].data);
    const float* g = static_cast<const float*>(in[1].data);
    const float* m = static_cast<const float*>(in[2].data);
    const float* v = static_cast<const float*>(in[3].data);
    auto scalar = [&](int i, float omitted) { return in[i].present ? *static_cast<const float*>(in[i].data) : omitted; };
    const float step_size = scalar(kStepSize, 0.0f), correction2_sqrt = scalar(kStepSize + 1, 0.0f);
    const float one_minus_beta1 = scalar(kOneMinusBeta1, 0.0f), beta2 = scalar(kBeta2, 0.0f);
    const float one_minus_beta2 = scalar(kOneMinusBeta2, 0.0f), epsilon = scalar(kEpsilon, 0.0f);
    const bool decay = in[kParamScale].present, clip = in[kGradScale].present;
    const float param_scale = scalar(kParamScale, 1.0f), grad_scale = scalar(kGradScale, 1.0f);
    const float weight_decay = scalar(kWeightDecay, 0.0f);
    const bool l2 = weight_decay != 0.0f;  // torch: if weight_decay != 0
    // the update is skipped (outputs = inputs) unless applied and the scalars keep the rule
    // (ops/adam_update.py skip_reason): every one finite, the hyperparameters >= 0
    bool run = !in[kApplied].present || *static_cast<const bool*>(in[kApplied].data);
    for (int i = kStepSize; i < kApplied; ++i) {
      const float value = scalar(i, 0.0f);
      run = run && std::isfinite(value) && (i < kOneMinusBeta1 || i > kEpsilon || value >= 0.0f);
    }
    float* p_next = static_cast<float*>(get_output(ctx, 0, in[0].shape));
    float* m_next = static_cast<float*>(get_output(ctx, 1, in[0].shape));
    float* v_next = static_cast<float*>(get_output(ctx, 2, in[0].shape));
    const size_t n = in[0].size;
    if (!run) {  // in place: nothing to write
      if (p_next != p) std::copy(p, p + n, p_next);
      if (m_next != m) std::copy(m, m + n, m_next);
      if (v_next != v) std::copy(v, v + n, v_next);
      return;
    }
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
          const float scaled = clip ? in_g[i] * grad_scale : in_g[i];
          const float gi = l2 ? scaled + in_p[i] * weight_decay : scaled;
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
    kOp, kInputs, 3, "TTTTTTTTTTTTTB", "00000000001111", "TTT", "000", 'd', 0, &create_kernel<AdamUpdate>,
};

}  // namespace normgrad
