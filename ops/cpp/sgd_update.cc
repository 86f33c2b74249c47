// SGDUpdate: one torch.optim.SGD step of a float32 parameter in one pass (ops/sgd_update.py).
//
// The arithmetic is the contract's float32 ops in its order (the function body's), never
// contracted into FMAs (this file is compiled with -ffp-contract=off), so the kernel gives
// the roundings of separate ONNX ops. The input table, the skip rule and the in-place
// blocked loop are update_common.h's (shared with AdamUpdate).
#include "update_common.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "SGDUpdate";
constexpr int kInputs = 11;
const UpdateInput kTable[kInputs] = {
    {"param", 't', false, false, 0.0f},         {"grad", 't', false, false, 0.0f},
    {"lr", 's', false, true, 0.0f},             {"momentum_buffer", 't', true, false, 0.0f},
    {"momentum", 's', true, true, 0.0f},        {"one_minus_dampening", 's', true, false, 1.0f},
    {"weight_decay", 's', true, true, 0.0f},    {"grad_scale", 's', true, false, 1.0f},
    {"first_step", 'b', true, false, 0.0f},     {"nesterov", 'b', true, false, 0.0f},
    {"applied", 'b', true, false, 1.0f},
};
enum : int { kParam, kGrad, kLr, kBuffer, kMomentum, kOneMinusDampening, kWeightDecay, kGradScale, kFirstStep,
             kNesterov, kApplied };

struct SGDUpdate final : KernelBase {
  NamedOutputs outputs;
  explicit SGDUpdate(const OrtKernelInfo* info) : outputs(info, 2) {}
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    const UpdateArgs a = read_update_args(ctx, kOp, kTable, kInputs, kApplied);
    const float lr = a.scalar(kLr), momentum = a.scalar(kMomentum), one_minus_dampening = a.scalar(kOneMinusDampening);
    const float weight_decay = a.scalar(kWeightDecay), grad_scale = a.scalar(kGradScale);
    const bool clip = a.in[kGradScale].present, damp = a.in[kOneMinusDampening].present;
    const bool l2 = weight_decay != 0.0f;  // torch: if weight_decay != 0
    const bool with_momentum = momentum != 0.0f, first = a.flag(kFirstStep), nesterov = a.flag(kNesterov);
    float* const out[2] = {update_output(ctx, outputs, 0, a), update_output(ctx, outputs, 1, a)};
    const float* const in[3] = {a.tensor(kParam), a.tensor(kGrad), a.tensor(kBuffer)};
    if (!a.run || !with_momentum) keep_inputs(a.n, in[2], 0.0f, out[1]);  // torch: no momentum, no buffer update
    if (!a.run) {  // in place: nothing to write
      keep_inputs(a.n, in[0], 0.0f, out[0]);
      return;
    }
    float* const written[2] = {out[0], with_momentum ? out[1] : nullptr};
    const float omitted[3] = {0.0f, 0.0f, 0.0f};
    auto body = [&](const float (*x)[kUpdateBlock], float (*y)[kUpdateBlock]) {
      for (size_t i = 0; i < kUpdateBlock; ++i) {
        const float p = x[0][i];
        const float scaled = clip ? x[1][i] * grad_scale : x[1][i];
        float g = l2 ? scaled + p * weight_decay : scaled;
        if (with_momentum) {
          const float buffer = first ? g : x[2][i] * momentum + (damp ? g * one_minus_dampening : g);
          g = nesterov ? g + buffer * momentum : buffer;
          y[1][i] = buffer;
        }
        y[0][i] = p - g * lr;
      }
    };
    update_blocks<3, 2>(ctx, a.n, in, omitted, written, body);
  }
};

}  // namespace

extern const OpDescriptor kSGDUpdate = {
    kOp, kInputs, 2, "TTTTTTTTBBB", "00011111111", "TT", "01", 'd', 0, &create_kernel<SGDUpdate>,
};

}  // namespace normgrad
