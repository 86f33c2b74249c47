// SoftmaxCrossEntropy: torch's mean cross-entropy of [N, C] logits and its gradient
// (ops/softmax_cross_entropy.py). Rows are independent: softmax_cross_entropy_math.h's row
// pass writes exp(x - max) into the gradient row and sums it, a second pass scales the row in
// place. Each row's loss term goes to a buffer summed in row order, so any thread count gives
// the same bits. Each row's label logit is read before the row pass, so the gradient may be
// written over the logits: onnxruntime does so when nothing else reads them (a [tokens,
// vocabulary] buffer less at a language model's peak).
// BiasSoftmaxCrossEntropy (ops/bias_softmax_cross_entropy.py) is the same kernel with a bias:
// the max and exp passes both add it (float32, as the Add; storing the sum and reading it back
// cost more); the rows go in fixed blocks of kBiasBlockRows, the scale pass adding
// each gradient row into its block's float32 column sums in row order, the blocks then summed
// in block order in float64: the same bits at any thread count.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "ops.h"
#include "softmax_cross_entropy_math.h"

namespace normgrad {
namespace {

constexpr const char* kPlainOp = "SoftmaxCrossEntropy";
constexpr const char* kBiasOp = "BiasSoftmaxCrossEntropy";
constexpr int64_t kNoIgnoreIndex = std::numeric_limits<int64_t>::min();
constexpr size_t kBiasBlockRows = 32;

template <bool kWithBias>
struct SoftmaxCrossEntropy final : KernelBase {
  static constexpr const char* kOp = kWithBias ? kBiasOp : kPlainOp;
  int64_t ignore_index;
  explicit SoftmaxCrossEntropy(const OrtKernelInfo* info)
      : ignore_index(attribute_int(info, kOp, "ignore_index", kNoIgnoreIndex)) {}
  const char* name() const override { return kOp; }

  static Input typed_input(OrtKernelContext* ctx, size_t index, const char* name, ONNXTensorElementDataType wanted,
                           const char* type, size_t rank, const char* shape) {
    const Input in = get_input_any_type(ctx, index, kOp, name);
    if (!in.present) fail(std::string(kOp) + ": input '" + name + "' is required");
    if (in.onnx_type != wanted) {
      fail(std::string(kOp) + ": input '" + name + "' must be " + type + "; got " + dtype_name(in.onnx_type));
    }
    if (in.shape.size() != rank) {
      fail(std::string(kOp) + ": input '" + name + "' must have rank " + std::to_string(rank) + " (" + shape +
           "); got shape " + shape_str(in.shape));
    }
    return in;
  }

  void compute(OrtKernelContext* ctx) override {
    const Input logits =
        typed_input(ctx, 0, "logits", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, "float32", 2, "[samples, classes]");
    const Input labels = typed_input(ctx, 1, "labels", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, "int64", 1, "[samples]");
    const size_t rows = static_cast<size_t>(logits.shape[0]), classes = static_cast<size_t>(logits.shape[1]);
    const float* bias = nullptr;
    if (kWithBias) {
      const Input b = typed_input(ctx, 2, "bias", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, "float32", 1, "[classes]");
      if (b.shape[0] != logits.shape[1]) {
        fail(std::string(kOp) + ": input 'bias' must have shape [" + std::to_string(classes) +
             "] (one value per column of 'logits'); got " + shape_str(b.shape));
      }
      bias = static_cast<const float*>(b.data);
    }
    if (labels.shape[0] != logits.shape[0]) {
      fail(std::string(kOp) + ": input 'labels' must have shape [" + std::to_string(rows) +
           "] (one label per row of 'logits'); got " + shape_str(labels.shape));
    }
    const int64_t* label = static_cast<const int64_t*>(labels.data);
    size_t count = 0;
    for (size_t i = 0; i < rows; ++i) {
      const bool ignored = ignore_index != kNoIgnoreIndex && label[i] == ignore_index;
      if (!ignored && (label[i] < 0 || static_cast<uint64_t>(label[i]) >= classes)) {
        fail(std::string(kOp) + ": input 'labels' must hold class indices in [0, " + std::to_string(classes) + ")" +
             (ignore_index == kNoIgnoreIndex ? std::string() : " or ignore_index " + std::to_string(ignore_index)) +
             "; got " + std::to_string(label[i]) + " at row " + std::to_string(i));
      }
      count += ignored ? 0 : 1;
    }
    float* const loss = static_cast<float*>(get_output(ctx, 0, {}));
    float* const grad = static_cast<float*>(get_output(ctx, 1, logits.shape));
    const float* const x = static_cast<const float*>(logits.data);
    // the standard-op form's weights: 1 / count where counted, 0 / count where ignored (NaN when count is 0)
    const float counted_weight = 1.0f / static_cast<float>(count);
    const float ignored_weight = 0.0f / static_cast<float>(count);
    std::vector<double> picked(rows);
    const bool avx2 = softmax_cross_entropy_avx2();
    // Row i's loss term and gradient; with a bias, the gradient row also goes into column_sums.
    auto row = [&](size_t i, float* column_sums) {
      const float* xi = x + i * classes;
      float* gi = grad + i * classes;
      const bool counted = ignore_index == kNoIgnoreIndex || label[i] != ignore_index;
      const size_t t = counted ? static_cast<size_t>(label[i]) : 0;
      // read before the row pass: the gradient may be written over the logits (may_reuse)
      const float label_logit = classes == 0 ? 0.0f : bias != nullptr ? xi[t] + bias[t] : xi[t];
      const SoftmaxRow r =
          avx2 ? softmax_row_avx2(xi, bias, gi, classes) : softmax_row<PortableLanes>(xi, bias, gi, classes);
      const float weight = counted ? counted_weight : ignored_weight;
      const float scale = static_cast<float>(static_cast<double>(weight) / r.sum);
      if (avx2) {
        scale_row_avx2(gi, classes, scale, column_sums);
      } else {
        scale_row<PortableLanes>(gi, classes, scale, column_sums);
      }
      if (counted) {
        gi[t] -= weight;
        if (column_sums != nullptr) column_sums[t] -= weight;  // (the sum took the entry before this)
      }
      // the label's log-probability, times 0 where ignored (NaN stays NaN, as the standard-op form)
      const double log_probability =
          classes == 0 ? std::nan("") : (static_cast<double>(label_logit) - r.max) - std::log(r.sum);
      picked[i] = counted ? log_probability : log_probability * 0.0;
    };
    if (kWithBias) {
      const size_t blocks = (rows + kBiasBlockRows - 1) / kBiasBlockRows;
      std::vector<float> partial(blocks * classes, 0.0f);
      auto block = [&](size_t b) {
        for (size_t i = b * kBiasBlockRows; i < rows && i < (b + 1) * kBiasBlockRows; ++i) {
          row(i, partial.data() + b * classes);
        }
      };
      parallel_for(ctx, blocks, block, rows * classes);
      std::vector<double> column_totals(classes, 0.0);
      for (size_t b = 0; b < blocks; ++b) {
        for (size_t c = 0; c < classes; ++c) column_totals[c] += partial[b * classes + c];
      }
      float* const dbias = static_cast<float*>(get_output(ctx, 2, {logits.shape[1]}));
      for (size_t c = 0; c < classes; ++c) dbias[c] = static_cast<float>(column_totals[c]);
    } else {
      auto plain_row = [&](size_t i) { row(i, nullptr); };
      parallel_for(ctx, rows, plain_row, rows * classes);
    }
    double total = 0.0;
    for (double value : picked) total += value;
    *loss = static_cast<float>(-total / static_cast<double>(count));
  }
};

}  // namespace

extern const OpDescriptor kSoftmaxCrossEntropy = {
    kPlainOp, 2, 2, "TL", "00", "FF", "00", 'd', 0, &create_kernel<SoftmaxCrossEntropy<false>>, &may_reuse<0, 1>,
};

extern const OpDescriptor kBiasSoftmaxCrossEntropy = {
    kBiasOp, 3, 3, "TLT", "000", "FFF", "000", 'd', 0, &create_kernel<SoftmaxCrossEntropy<true>>, &may_reuse<0, 1>,
};

}  // namespace normgrad
