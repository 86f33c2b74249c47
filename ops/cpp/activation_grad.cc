// SiLUGrad, GeluGrad, GeluTanhGrad: dx = dy * f'(x) in one pass (ops/activation_grad.py), one
// kernel class for the three, SwiGLUGrad (ops/swiglu_grad.py), and the forward SiLUMul
// (ops/silu_mul.py) and GeluWithSlope (ops/gelu_with_slope.py): activation_grad_math.h's loops
// over fixed chunks (elementwise: the same bits for any thread count), on 8 AVX lanes where
// update_avx2().
#include <algorithm>
#include <string>

#include "activation_grad_math.h"
#include "ops.h"
#include "update_math.h"

namespace normgrad {
namespace {

constexpr size_t kChunk = 1 << 14;

template <Activation kKind>
struct ActivationGrad final : KernelBase {
  explicit ActivationGrad(const OrtKernelInfo*) {}
  const char* name() const override { return op_name(); }
  static const char* op_name() {
    return kKind == Activation::kSilu ? "SiLUGrad" : kKind == Activation::kGeluErf ? "GeluGrad" : "GeluTanhGrad";
  }

  void compute(OrtKernelContext* ctx) override {
    const char* op = op_name();
    const std::vector<Input> in = float32_inputs_alike(ctx, op, {"dy", "x"}, 1);
    const Input &dy = in[0], &x = in[1];
    const float* const dy_data = static_cast<const float*>(dy.data);
    const float* const x_data = static_cast<const float*>(x.data);
    float* const dx = static_cast<float*>(get_output(ctx, 0, x.shape));
    const size_t n = x.size;
    const bool avx2 = update_avx2();
    auto chunk = [&](size_t c) {
      const size_t begin = c * kChunk, end = std::min(n, (c + 1) * kChunk);
      if (avx2) {
        activation_grad_avx2(kKind, dy_data, x_data, dx, begin, end);
      } else {
        activation_grad_loop(kKind, dy_data, x_data, dx, begin, end);
      }
    };
    parallel_for(ctx, (n + kChunk - 1) / kChunk, chunk, n);
  }
};

struct SwiGLUGrad final : KernelBase {
  explicit SwiGLUGrad(const OrtKernelInfo*) {}
  const char* name() const override { return "SwiGLUGrad"; }

  void compute(OrtKernelContext* ctx) override {
    const char* op = name();
    const std::vector<Input> in = float32_inputs_alike(ctx, op, {"dy", "gate", "up"}, 1);
    const float* const dy = static_cast<const float*>(in[0].data);
    const float* const gate = static_cast<const float*>(in[1].data);
    const float* const up = static_cast<const float*>(in[2].data);
    float* const dgate = static_cast<float*>(get_output(ctx, 0, in[1].shape));
    float* const dup = static_cast<float*>(get_output(ctx, 1, in[1].shape));
    const size_t n = in[1].size;
    const bool avx2 = update_avx2();
    auto chunk = [&](size_t c) {
      const size_t begin = c * kChunk, end = std::min(n, (c + 1) * kChunk);
      if (avx2) {
        swiglu_grad_avx2(dy, gate, up, dgate, dup, begin, end);
      } else {
        swiglu_grad_loop(dy, gate, up, dgate, dup, begin, end);
      }
    };
    parallel_for(ctx, (n + kChunk - 1) / kChunk, chunk, n);
  }
};

struct SiLUMul final : KernelBase {
  explicit SiLUMul(const OrtKernelInfo*) {}
  const char* name() const override { return "SiLUMul"; }

  void compute(OrtKernelContext* ctx) override {
    const std::vector<Input> in = float32_inputs_alike(ctx, name(), {"gate", "up"}, 0);
    const float* const gate = static_cast<const float*>(in[0].data);
    const float* const up = static_cast<const float*>(in[1].data);
    float* const y = static_cast<float*>(get_output(ctx, 0, in[0].shape));
    const size_t n = in[0].size;
    const bool avx2 = update_avx2();
    auto chunk = [&](size_t c) {
      const size_t begin = c * kChunk, end = std::min(n, (c + 1) * kChunk);
      if (avx2) {
        silu_mul_avx2(gate, up, y, begin, end);
      } else {
        silu_mul_loop(gate, up, y, begin, end);
      }
    };
    parallel_for(ctx, (n + kChunk - 1) / kChunk, chunk, n);
  }
};

struct GeluWithSlope final : KernelBase {
  explicit GeluWithSlope(const OrtKernelInfo*) {}
  const char* name() const override { return "GeluWithSlope"; }

  void compute(OrtKernelContext* ctx) override {
    const std::vector<Input> in = float32_inputs_alike(ctx, name(), {"x"}, 0);
    const float* const x = static_cast<const float*>(in[0].data);
    float* const y = static_cast<float*>(get_output(ctx, 0, in[0].shape));
    float* const slope = static_cast<float*>(get_output(ctx, 1, in[0].shape));
    const size_t n = in[0].size;
    const bool avx2 = update_avx2();
    auto chunk = [&](size_t c) {
      const size_t begin = c * kChunk, end = std::min(n, (c + 1) * kChunk);
      if (avx2) {
        gelu_with_slope_avx2(x, y, slope, begin, end);
      } else {
        gelu_with_slope_loop(x, y, slope, begin, end);
      }
    };
    parallel_for(ctx, (n + kChunk - 1) / kChunk, chunk, n);
  }
};

}  // namespace

extern const OpDescriptor kSiLUMul = {
    "SiLUMul", 2, 1, "TT", "00", "T", "0", 'd', 0, &create_kernel<SiLUMul>,
};
extern const OpDescriptor kSwiGLUGrad = {
    "SwiGLUGrad", 3, 2, "TTT", "000", "TT", "00", 'd', 1, &create_kernel<SwiGLUGrad>,
};
extern const OpDescriptor kGeluWithSlope = {
    "GeluWithSlope", 1, 2, "T", "0", "TT", "00", 'd', 0, &create_kernel<GeluWithSlope>,
};
extern const OpDescriptor kSiLUGrad = {
    "SiLUGrad", 2, 1, "TT", "00", "T", "0", 'd', 1, &create_kernel<ActivationGrad<Activation::kSilu>>,
};
extern const OpDescriptor kGeluGrad = {
    "GeluGrad", 2, 1, "TT", "00", "T", "0", 'd', 1, &create_kernel<ActivationGrad<Activation::kGeluErf>>,
};
extern const OpDescriptor kGeluTanhGrad = {
    "GeluTanhGrad", 2, 1, "TT", "00", "T", "0", 'd', 1, &create_kernel<ActivationGrad<Activation::kGeluTanh>>,
};

}  // namespace normgrad
