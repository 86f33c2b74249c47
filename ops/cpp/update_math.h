// The per-element arithmetic of AdamUpdate and SGDUpdate (ops/adam_update.py,
// ops/sgd_update.py), written once for a lane type V: float (the portable loop,
// update_common.h's blocks) or 8 AVX lanes (update_avx2.cc). Every operation is one IEEE
// float32 operation per lane in the contract's order (the function body's), and the files
// that use it are compiled with -ffp-contract=off and without -mfma, so both lane types give
// the roundings of the body's separate ONNX ops, bitwise.
//
// V provides +, -, *, / and a constructor from float; lane_sqrt(V) and
// lane_max_nan(V, V) are found for it by overloading (for float: below).
#pragma once

#include <cmath>
#include <cstddef>

namespace normgrad {

struct AdamScalars {
  float step_size, correction2_sqrt, one_minus_beta1, beta2, one_minus_beta2, epsilon;
  float param_scale, grad_scale, weight_decay;
  bool decay, clip, l2;  // param_scale, grad_scale given; weight_decay != 0 (torch's test)
};

struct SGDScalars {
  float lr, momentum, one_minus_dampening, weight_decay, grad_scale;
  bool clip, damp, l2, with_momentum, first, nesterov;
};

static inline float lane_sqrt(float x) { return std::sqrt(x); }
// NaN if either is (as ONNX Max and torch.maximum)
static inline float lane_max_nan(float a, float b) { return a > b || a != a ? a : b; }

// x: param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq (kMax: amsgrad);
// y: param_next, exp_avg_next, exp_avg_sq_next, max_exp_avg_sq_next.
template <bool kMax, class V>
inline void adam_lanes(const AdamScalars& s, const V (&x)[5], V (&y)[4]) {
  const V p = x[0], m = x[2], v = x[3];
  const V scaled = s.clip ? x[1] * V(s.grad_scale) : x[1];
  const V g = s.l2 ? scaled + p * V(s.weight_decay) : scaled;
  const V avg_next = m + (g - m) * V(s.one_minus_beta1);
  const V sq_next = v * V(s.beta2) + (g * g) * V(s.one_minus_beta2);
  V most = sq_next;
  if constexpr (kMax) most = lane_max_nan(sq_next, x[4]);
  const V denominator = lane_sqrt(most) / V(s.correction2_sqrt) + V(s.epsilon);
  y[0] = (s.decay ? p * V(s.param_scale) : p) - avg_next / denominator * V(s.step_size);
  y[1] = avg_next;
  y[2] = sq_next;
  y[3] = most;
}

// x: param, grad, momentum_buffer; y: param_next, momentum_buffer_next (with momentum only).
template <class V>
inline void sgd_lanes(const SGDScalars& s, const V (&x)[3], V (&y)[2]) {
  const V p = x[0];
  const V scaled = s.clip ? x[1] * V(s.grad_scale) : x[1];
  V g = s.l2 ? scaled + p * V(s.weight_decay) : scaled;
  if (s.with_momentum) {
    const V buffer = s.first ? g : x[2] * V(s.momentum) + (s.damp ? g * V(s.one_minus_dampening) : g);
    g = s.nesterov ? g + buffer * V(s.momentum) : buffer;
    y[1] = buffer;
  } else {
    y[1] = x[2];  // torch: no momentum, no buffer update
  }
  y[0] = p - g * V(s.lr);
}

// The AVX2 loops (update_avx2.cc) over elements [begin, end): in[k] null is a tensor of
// zeros, out[j] null is not written; an output may be its input's buffer. Call only when
// update_avx2() (kernels_generic.cc: the CPU has AVX2 and NORMGRAD_KERNELS is not "generic").
void adam_update_avx2(const AdamScalars& s, bool amsgrad, size_t begin, size_t end, const float* const (&in)[5],
                      float* const (&out)[4]);
void sgd_update_avx2(const SGDScalars& s, size_t begin, size_t end, const float* const (&in)[3],
                     float* const (&out)[2]);
bool update_avx2();

}  // namespace normgrad
