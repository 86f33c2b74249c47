// SafeSoftmax: softmax over the last axis, rows that would be NaN written as 0
// (ops/safe_softmax.py), each row from cache (safe_softmax_math.h): max, exp(x - max) and
// its float64 sum, then scaled by 1 / sum. Rows go to the intra-op threads whole: any thread
// count gives the same bits.
#include <string>

#include "ops.h"
#include "safe_softmax_math.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "SafeSoftmax";
constexpr size_t kRowsPerTask = 16;

struct SafeSoftmax final : KernelBase {
  explicit SafeSoftmax(const OrtKernelInfo*) {}
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    const Input x = get_input_any_type(ctx, 0, kOp, "x");
    if (!x.present) fail(std::string(kOp) + ": input 'x' is required");
    if (x.onnx_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      fail(std::string(kOp) + ": input 'x' must be float32; got " + dtype_name(x.onnx_type));
    }
    if (x.shape.empty()) fail(std::string(kOp) + ": input 'x' must have rank >= 1 (rows along the last axis); got a scalar");
    float* const y = static_cast<float*>(get_output(ctx, 0, x.shape));
    const size_t n = static_cast<size_t>(x.shape.back());
    if (n == 0 || x.size == 0) return;
    const size_t rows = x.size / n;
    const float* const x_data = static_cast<const float*>(x.data);
    const bool avx2 = softmax_cross_entropy_avx2();
    auto task = [&](size_t t) {
      const size_t end = (t + 1) * kRowsPerTask < rows ? (t + 1) * kRowsPerTask : rows;
      for (size_t i = t * kRowsPerTask; i < end; ++i) {
        if (avx2) {
          safe_softmax_row_avx2(x_data + i * n, y + i * n, n);
        } else {
          safe_softmax_row<PortableLanes>(x_data + i * n, y + i * n, n);
        }
      }
    };
    parallel_for(ctx, (rows + kRowsPerTask - 1) / kRowsPerTask, task, x.size);
  }
};

}  // namespace

extern const OpDescriptor kSafeSoftmax = {
    kOp, 1, 1, "T", "0", "T", "0", 'd', 0, &create_kernel<SafeSoftmax>,
};

}  // namespace normgrad
