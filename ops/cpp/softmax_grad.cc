// SoftmaxGrad: the gradient of a softmax over the last axis (ops/softmax_grad.py),
// dx = y * (dy - sum(dy * y)), one row pass each (softmax_grad_math.h). Rows go to the
// intra-op threads whole, so any thread count gives the same bits.
#include <string>

#include "ops.h"
#include "softmax_grad_math.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "SoftmaxGrad";
constexpr size_t kRowsPerTask = 16;

struct SoftmaxGrad final : KernelBase {
  explicit SoftmaxGrad(const OrtKernelInfo*) {}
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    const std::vector<Input> in = float32_inputs_alike(ctx, kOp, {"dy", "y"}, 1);
    const Input &dy = in[0], &y = in[1];
    if (y.shape.empty()) fail(std::string(kOp) + ": input 'y' must have rank >= 1 (rows along the last axis); got a scalar");
    float* const dx = static_cast<float*>(get_output(ctx, 0, y.shape));
    const size_t n = static_cast<size_t>(y.shape.back());
    if (n == 0 || y.size == 0) return;
    const size_t rows = y.size / n;
    const float* const dy_data = static_cast<const float*>(dy.data);
    const float* const y_data = static_cast<const float*>(y.data);
    const bool avx2 = softmax_cross_entropy_avx2();
    auto task = [&](size_t t) {
      const size_t end = (t + 1) * kRowsPerTask < rows ? (t + 1) * kRowsPerTask : rows;
      for (size_t i = t * kRowsPerTask; i < end; ++i) {
        if (avx2) {
          softmax_grad_row_avx2(dy_data + i * n, y_data + i * n, dx + i * n, n);
        } else {
          softmax_grad_row<PortableLanes>(dy_data + i * n, y_data + i * n, dx + i * n, n);
        }
      }
    };
    parallel_for(ctx, (rows + kRowsPerTask - 1) / kRowsPerTask, task, y.size);
  }
};

}  // namespace

extern const OpDescriptor kSoftmaxGrad = {
    kOp, 2, 1, "TT", "00", "T", "0", 'd', 1, &create_kernel<SoftmaxGrad>,
};

}  // namespace normgrad
