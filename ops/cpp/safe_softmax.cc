// SafeSoftmax: softmax over the last axis, rows that would be NaN written as 0
// (ops/safe_softmax.py), each row from cache (safe_softmax_math.h): max, exp(x - max) and
// its float64 sum, then scaled by 1 / sum. Rows go to the intra-op threads whole: any thread
// count gives the same bits.
// BiasSafeSoftmax (ops/bias_safe_softmax.py) is the same with a bias broadcast over x's
// leading axes, added to each row in both of its passes (float32, as the Add).
#include <string>
#include <vector>

#include "ops.h"
#include "safe_softmax_math.h"

namespace normgrad {
namespace {

constexpr size_t kRowsPerTask = 16;

template <bool kWithBias>
struct SafeSoftmax final : KernelBase {
  static constexpr const char* kOp = kWithBias ? "BiasSafeSoftmax" : "SafeSoftmax";
  explicit SafeSoftmax(const OrtKernelInfo*) {}
  const char* name() const override { return kOp; }

  static Input float_input(OrtKernelContext* ctx, size_t index, const char* name) {
    const Input in = get_input_any_type(ctx, index, kOp, name);
    if (!in.present) fail(std::string(kOp) + ": input '" + name + "' is required");
    if (in.onnx_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      fail(std::string(kOp) + ": input '" + name + "' must be float32; got " + dtype_name(in.onnx_type));
    }
    return in;
  }

  static void check_bias(const Input& x, const Input& bias) {
    const size_t rank = x.shape.size(), bias_rank = bias.shape.size();
    bool fits = bias_rank >= 1 && bias_rank <= rank && bias.shape.back() == x.shape.back();
    for (size_t k = 0; fits && k + 1 < bias_rank; ++k) {
      const int64_t b = bias.shape[k], d = x.shape[rank - bias_rank + k];
      fits = b == 1 || b == d;
    }
    if (!fits) {
      fail(std::string(kOp) + ": input 'bias' must have rank <= x's, x's last axis and every other axis 1 or x's (x " +
           shape_str(x.shape) + "); got " + shape_str(bias.shape));
    }
  }

  // The offset of each x row's bias row (x not empty): x's leading axes, the bias's aligned
  // from the last (NumPy's broadcasting), a bias axis of 1 repeating its row.
  static std::vector<size_t> bias_rows(const Input& x, const Input& bias) {
    const size_t rank = x.shape.size(), bias_rank = bias.shape.size();
    const size_t n = static_cast<size_t>(x.shape.back()), rows = x.size / n;
    std::vector<size_t> offsets(rows, 0);
    for (size_t i = 0; i < rows; ++i) {
      size_t rest = i, offset = 0, stride = n;
      for (size_t k = rank - 1; k-- > 0;) {  // x's leading axes, last first
        const size_t extent = static_cast<size_t>(x.shape[k]), index = rest % extent;
        rest /= extent;
        if (k + bias_rank < rank) break;  // axes the bias does not have
        const size_t b = static_cast<size_t>(bias.shape[k + bias_rank - rank]);
        if (b != 1) offset += index * stride;
        stride *= b;
      }
      offsets[i] = offset;
    }
    return offsets;
  }

  void compute(OrtKernelContext* ctx) override {
    const Input x = float_input(ctx, 0, "x");
    if (x.shape.empty()) fail(std::string(kOp) + ": input 'x' must have rank >= 1 (rows along the last axis); got a scalar");
    const Input bias = kWithBias ? float_input(ctx, 1, "bias") : Input{};
    if (kWithBias) check_bias(x, bias);
    float* const y = static_cast<float*>(get_output(ctx, 0, x.shape));
    const size_t n = static_cast<size_t>(x.shape.back());
    if (n == 0 || x.size == 0) return;
    const size_t rows = x.size / n;
    const std::vector<size_t> offsets = kWithBias ? bias_rows(x, bias) : std::vector<size_t>();
    const float* const x_data = static_cast<const float*>(x.data);
    const float* const bias_data = kWithBias ? static_cast<const float*>(bias.data) : nullptr;
    const bool avx2 = softmax_cross_entropy_avx2();
    auto task = [&](size_t t) {
      const size_t end = (t + 1) * kRowsPerTask < rows ? (t + 1) * kRowsPerTask : rows;
      for (size_t i = t * kRowsPerTask; i < end; ++i) {
        const float* row_bias = kWithBias ? bias_data + offsets[i] : nullptr;
        if (avx2) {
          safe_softmax_row_avx2(x_data + i * n, row_bias, y + i * n, n);
        } else {
          safe_softmax_row<PortableLanes>(x_data + i * n, row_bias, y + i * n, n);
        }
      }
    };
    parallel_for(ctx, (rows + kRowsPerTask - 1) / kRowsPerTask, task, x.size);
  }
};

}  // namespace

extern const OpDescriptor kSafeSoftmax = {
    "SafeSoftmax", 1, 1, "T", "0", "T", "0", 'd', 0, &create_kernel<SafeSoftmax<false>>,
};

extern const OpDescriptor kBiasSafeSoftmax = {
    "BiasSafeSoftmax", 2, 1, "TT", "00", "T", "0", 'd', 0, &create_kernel<SafeSoftmax<true>>,
};

}  // namespace normgrad
