// AdamUpdate: one Adam/AdamW step (amsgrad too) of a float32 parameter in one pass (ops/adam_update.py).
//
// The arithmetic is update_math.h's (the contract's float32 ops in its order, never contracted
// into FMAs), on 8 AVX lanes when the CPU has AVX2 (update_avx2.cc), else in the portable
// blocked loop. The input table, the skip rule and the in-place blocked loop are
// update_common.h's (shared with SGDUpdate).
#include <type_traits>

#include "update_common.h"
#include "update_math.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "AdamUpdate";
constexpr int kInputs = 15;
const UpdateInput kTable[kInputs] = {
    {"param", 't', false, false, 0.0f},           {"grad", 't', false, false, 0.0f},
    {"exp_avg", 't', false, false, 0.0f},         {"exp_avg_sq", 't', false, false, 0.0f},
    {"step_size", 's', false, false, 0.0f},       {"correction2_sqrt", 's', false, false, 0.0f},
    {"one_minus_beta1", 's', false, true, 0.0f},  {"beta2", 's', false, true, 0.0f},
    {"one_minus_beta2", 's', false, true, 0.0f},  {"epsilon", 's', false, true, 0.0f},
    {"param_scale", 's', true, false, 1.0f},      {"grad_scale", 's', true, false, 1.0f},
    {"weight_decay", 's', true, false, 0.0f},     {"applied", 'b', true, false, 1.0f},
    {"max_exp_avg_sq", 't', true, false, 0.0f},
};
enum : int { kParam, kGrad, kExpAvg, kExpAvgSq, kStepSize, kCorrection2Sqrt, kOneMinusBeta1, kBeta2, kOneMinusBeta2,
             kEpsilon, kParamScale, kGradScale, kWeightDecay, kApplied, kMaxExpAvgSq };

struct AdamUpdate final : KernelBase {
  NamedOutputs outputs;
  explicit AdamUpdate(const OrtKernelInfo* info) : outputs(info, 4) {}
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    const UpdateArgs a = read_update_args(ctx, kOp, kTable, kInputs, kApplied);
    AdamScalars s;
    s.step_size = a.scalar(kStepSize), s.correction2_sqrt = a.scalar(kCorrection2Sqrt);
    s.one_minus_beta1 = a.scalar(kOneMinusBeta1), s.beta2 = a.scalar(kBeta2);
    s.one_minus_beta2 = a.scalar(kOneMinusBeta2), s.epsilon = a.scalar(kEpsilon);
    s.param_scale = a.scalar(kParamScale), s.grad_scale = a.scalar(kGradScale), s.weight_decay = a.scalar(kWeightDecay);
    s.decay = a.in[kParamScale].present, s.clip = a.in[kGradScale].present;
    s.l2 = s.weight_decay != 0.0f;  // torch: if weight_decay != 0
    const bool amsgrad = a.in[kMaxExpAvgSq].present;
    float* const out[4] = {update_output(ctx, outputs, 0, a), update_output(ctx, outputs, 1, a),
                           update_output(ctx, outputs, 2, a), update_output(ctx, outputs, 3, a)};
    const float* const in[5] = {a.tensor(kParam), a.tensor(kGrad), a.tensor(kExpAvg), a.tensor(kExpAvgSq),
                                a.tensor(kMaxExpAvgSq)};
    if (!a.run) {  // in place: nothing to write
      keep_inputs(a.n, in[0], 0.0f, out[0]);
      keep_inputs(a.n, in[2], 0.0f, out[1]);
      keep_inputs(a.n, in[3], 0.0f, out[2]);
      keep_inputs(a.n, amsgrad ? in[4] : in[3], 0.0f, out[3]);  // without amsgrad: exp_avg_sq_next
      return;
    }
    if (update_avx2()) {
      update_chunks(ctx, a.n, [&](size_t begin, size_t end) { adam_update_avx2(s, amsgrad, begin, end, in, out); });
      return;
    }
    const float omitted[5] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    // with and without amsgrad (std::true_type / std::false_type): no maximum in Adam's loop,
    // and its fourth output only when the node names it
    auto body = [&](auto with_max, auto write_max) {
      return [&](const float (*x)[kUpdateBlock], float (*y)[kUpdateBlock]) {
        for (size_t i = 0; i < kUpdateBlock; ++i) {
          const float lanes[5] = {x[0][i], x[1][i], x[2][i], x[3][i], x[4][i]};
          float next[4];
          adam_lanes<decltype(with_max)::value>(s, lanes, next);
          y[0][i] = next[0];
          y[1][i] = next[1];
          y[2][i] = next[2];
          if constexpr (decltype(write_max)::value) y[3][i] = next[3];
        }
      };
    };
    if (amsgrad) {
      update_blocks<5, 4>(ctx, a.n, in, omitted, out, body(std::true_type{}, std::true_type{}));
    } else if (out[3] != nullptr) {
      update_blocks<5, 4>(ctx, a.n, in, omitted, out, body(std::false_type{}, std::true_type{}));
    } else {
      float* const adam_out[3] = {out[0], out[1], out[2]};
      update_blocks<5, 3>(ctx, a.n, in, omitted, adam_out, body(std::false_type{}, std::false_type{}));
    }
  }
};

}  // namespace

extern const OpDescriptor kAdamUpdate = {
    kOp, kInputs, 4, "TTTTTTTTTTTTTBT", "000000000011111", "TTTT", "0001", 'd', 0, &create_kernel<AdamUpdate>,
};

}  // namespace normgrad
