// LSTMBackwardFactors (ops/lstm_backward_factors.py): an LSTM backward's per-step factors from
// the gates the forward kept, every step in one pass, written last step first. Each value is the
// standard form's IEEE operations in its order (lstm_backward_factors_math.h), so the bits are the
// function body's, on AVX2 lanes or not, at any thread count (each step is one task).
#include <string>
#include <vector>

#include "lstm_backward_factors_math.h"
#include "ops.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "LSTMBackwardFactors";
constexpr const char* kNames[] = {"i", "o", "f", "g", "cells", "act_c", "c0"};

struct LSTMBackwardFactors final : KernelBase {
  explicit LSTMBackwardFactors(const OrtKernelInfo*) {}
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    std::vector<Input> in;
    for (size_t k = 0; k < 7; ++k) in.push_back(get_input_any_type(ctx, k, kOp, kNames[k]));
    const Input& gates = in[0];
    if (gates.onnx_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && gates.onnx_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE) {
      fail(std::string(kOp) + ": input 'i' must be float32 or float64; got " + dtype_name(gates.onnx_type));
    }
    if (gates.shape.size() < 2) {
      fail(std::string(kOp) + ": input 'i' must have rank >= 2 ([T, H, ...]); got shape " + shape_str(gates.shape));
    }
    const std::vector<int64_t> step_shape(gates.shape.begin() + 1, gates.shape.end());
    for (size_t k = 1; k < 7; ++k) {
      const std::vector<int64_t>& expected = k == 6 ? step_shape : gates.shape;
      if (in[k].shape != expected) {
        fail(std::string(kOp) + ": input '" + kNames[k] + "' must have the shape " + shape_str(expected) +
             (k == 6 ? " (one step of 'i')" : " of 'i'") + "; got " + shape_str(in[k].shape));
      }
      if (in[k].onnx_type != gates.onnx_type) {
        fail(std::string(kOp) + ": input '" + kNames[k] + "' must have the dtype of 'i' (" +
             dtype_name(gates.onnx_type) + "); got " + dtype_name(in[k].onnx_type));
      }
    }
    std::vector<int64_t> factors_shape = gates.shape;
    factors_shape[1] *= 4;
    void* factors = get_output(ctx, 0, factors_shape);
    void* a_c = get_output(ctx, 1, gates.shape);
    void* keep = get_output(ctx, 2, gates.shape);
    if (gates.onnx_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE) {
      run<double>(ctx, in, factors, a_c, keep);
    } else {
      run<float>(ctx, in, factors, a_c, keep);
    }
  }

  template <class T>
  static void run(OrtKernelContext* ctx, const std::vector<Input>& in, void* factors, void* a_c, void* keep) {
    const size_t steps = static_cast<size_t>(in[0].shape[0]);
    if (steps == 0) return;
    const size_t block = in[0].size / steps;
    auto at = [&](size_t k, size_t t) { return static_cast<const T*>(in[k].data) + t * block; };
    const bool avx2 = update_avx2();
    auto step = [&](size_t t) {
      const T* inputs[6];
      for (size_t k = 0; k < 6; ++k) inputs[k] = at(k, t);
      const T* c_prev = t == 0 ? static_cast<const T*>(in[6].data) : at(4, t - 1);
      const size_t r = steps - 1 - t;  // last step first
      T* const outputs[3] = {static_cast<T*>(factors) + 4 * r * block, static_cast<T*>(a_c) + r * block,
                             static_cast<T*>(keep) + r * block};
      if (avx2) {
        lstm_step_factors_avx2(inputs, c_prev, block, outputs[0], outputs[1], outputs[2]);
      } else {
        lstm_step_factors(inputs, c_prev, block, outputs[0], outputs[1], outputs[2]);
      }
    };
    parallel_for(ctx, steps, step, 6 * in[0].size);
  }
};

}  // namespace

extern const OpDescriptor kLSTMBackwardFactors = {
    kOp, 7, 3, "TTTTTTT", "0000000", "TTT", "000", 'd', 0, &create_kernel<LSTMBackwardFactors>,
};

}  // namespace normgrad
