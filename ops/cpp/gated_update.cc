// GatedUpdate: update if applied else value (ops/gated_update.py); in place over value, a
// skipped update writes nothing. The input table and the in-place blocked loop are
// update_common.h's.
#include "update_common.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "GatedUpdate";
constexpr int kInputs = 3;
const UpdateInput kTable[kInputs] = {
    {"value", 't', false, false, 0.0f}, {"update", 't', false, false, 0.0f}, {"applied", 'b', false, false, 1.0f}};

struct GatedUpdate final : KernelBase {
  NamedOutputs outputs;
  explicit GatedUpdate(const OrtKernelInfo* info) : outputs(info, 1) {}
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    const UpdateArgs a = read_update_args(ctx, kOp, kTable, kInputs, 2);
    float* const out = update_output(ctx, outputs, 0, a);
    keep_inputs(a.n, a.run ? a.tensor(1) : a.tensor(0), 0.0f, out);
  }
};

}  // namespace

extern const OpDescriptor kGatedUpdate = {
    kOp, kInputs, 1, "TTB", "000", "T", "0", 'd', 0, &create_kernel<GatedUpdate>,
};

}  // namespace normgrad
