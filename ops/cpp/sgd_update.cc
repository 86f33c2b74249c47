// SGDUpdate: one torch.optim.SGD step of a float32 parameter in one pass (ops/sgd_update.py).
//
// The arithmetic is update_math.h's (the contract's float32 ops in its order, never contracted
// into FMAs), on 8 AVX lanes when the CPU has AVX2 (update_avx2.cc), else in the portable
// blocked loop. The input table, the skip rule and the in-place blocked loop are
// update_common.h's (shared with AdamUpdate).
#include "update_common.h"
#include "update_math.h"

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
    SGDScalars s;
    s.lr = a.scalar(kLr), s.momentum = a.scalar(kMomentum), s.one_minus_dampening = a.scalar(kOneMinusDampening);
    s.weight_decay = a.scalar(kWeightDecay), s.grad_scale = a.scalar(kGradScale);
    s.clip = a.in[kGradScale].present, s.damp = a.in[kOneMinusDampening].present;
    s.l2 = s.weight_decay != 0.0f;  // torch: if weight_decay != 0
    s.with_momentum = s.momentum != 0.0f, s.first = a.flag(kFirstStep), s.nesterov = a.flag(kNesterov);
    float* const out[2] = {update_output(ctx, outputs, 0, a), update_output(ctx, outputs, 1, a)};
    const float* const in[3] = {a.tensor(kParam), a.tensor(kGrad), a.tensor(kBuffer)};
    if (!a.run || !s.with_momentum) keep_inputs(a.n, in[2], 0.0f, out[1]);  // torch: no momentum, no buffer update
    if (!a.run) {  // in place: nothing to write
      keep_inputs(a.n, in[0], 0.0f, out[0]);
      return;
    }
    float* const written[2] = {out[0], s.with_momentum ? out[1] : nullptr};
    if (update_avx2()) {
      update_chunks(ctx, a.n, [&](size_t begin, size_t end) { sgd_update_avx2(s, begin, end, in, written); });
      return;
    }
    const float omitted[3] = {0.0f, 0.0f, 0.0f};
    auto body = [&](const float (*x)[kUpdateBlock], float (*y)[kUpdateBlock]) {
      for (size_t i = 0; i < kUpdateBlock; ++i) {
        const float lanes[3] = {x[0][i], x[1][i], x[2][i]};
        float next[2];
        sgd_lanes(s, lanes, next);
        y[0][i] = next[0];
        y[1][i] = next[1];
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
