// DropoutMask: the keep-mask of a seeded Dropout node from its key (ops/dropout_mask.py),
// dropout_mask_math.h's integer loop over fixed chunks (the same bits for any thread count).
#include <algorithm>
#include <string>

#include "dropout_mask_math.h"
#include "ops.h"
#include "update_math.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "DropoutMask";
constexpr size_t kChunk = 1 << 16;

// A one-element input of `wanted` type.
const void* one_element(OrtKernelContext* ctx, size_t index, const char* name, ONNXTensorElementDataType wanted,
                        const char* type) {
  const Input in = get_input_any_type(ctx, index, kOp, name);
  if (!in.present) fail(std::string(kOp) + ": input '" + name + "' is required");
  if (in.onnx_type != wanted) {
    fail(std::string(kOp) + ": input '" + name + "' must be " + type + "; got " + dtype_name(in.onnx_type));
  }
  if (in.size != 1) {
    fail(std::string(kOp) + ": input '" + name + "' must have one element; got shape " + shape_str(in.shape));
  }
  return in.data;
}

uint32_t limb(OrtKernelContext* ctx, size_t index, const char* name) {
  const int32_t value = *static_cast<const int32_t*>(one_element(ctx, index, name, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32,
                                                                 "int32"));
  if (value < 0 || value >= (1 << 15)) {
    fail(std::string(kOp) + ": input '" + name + "' must be a 15-bit limb in [0, 2**15); got " +
         std::to_string(value));
  }
  return static_cast<uint32_t>(value);
}

struct DropoutMask final : KernelBase {
  explicit DropoutMask(const OrtKernelInfo*) {}
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    const Input data = get_input_any_type(ctx, 0, kOp, "data");
    switch (data.onnx_type) {
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
        break;
      default:
        fail(std::string(kOp) + ": input 'data' must be float32, float16, bfloat16 or double; got " +
             dtype_name(data.onnx_type));
    }
    if (data.size > 0x7fffffffu) fail(std::string(kOp) + ": input 'data' must have fewer than 2**31 elements");
    const float ratio =
        *static_cast<const float*>(one_element(ctx, 1, "ratio", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, "float32"));
    const uint32_t key = (limb(ctx, 2, "key_high") << 15) | limb(ctx, 3, "key_low");
    bool* const mask = static_cast<bool*>(get_output(ctx, 0, data.shape));
    const uint32_t n = static_cast<uint32_t>(data.size);
    const bool avx2 = update_avx2();
    auto chunk = [&](size_t c) {
      const uint32_t begin = static_cast<uint32_t>(c * kChunk);
      const uint32_t end = static_cast<uint32_t>(std::min<size_t>(n, (c + 1) * kChunk));
      if (avx2) {
        dropout_mask_avx2(key, ratio, begin, end, mask);
      } else {
        dropout_mask_loop(key, ratio, begin, end, mask);
      }
    };
    parallel_for(ctx, (n + kChunk - 1) / kChunk, chunk, n);
  }
};

}  // namespace

extern const OpDescriptor kDropoutMask = {
    kOp, 4, 1, "TFII", "0000", "B", "0", 'd', 0, &create_kernel<DropoutMask>,
};

}  // namespace normgrad
