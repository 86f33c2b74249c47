// What the optimizer-update kernels (AdamUpdate, SGDUpdate) share (ops/_update.py): reading
// and checking their inputs from a table, the skip rule, and the blocked elementwise loop
// that lets an output share its input's buffer.
//
// Every output element reads only the same element of the parameter-shaped inputs, before
// it is written, so an output may be its input's buffer (the trainer updates the state in
// place). Fixed chunks: the same bits for any thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>

#include "ops.h"

namespace normgrad {

// One input of an update operator: a parameter-shaped float tensor, a float scalar or a
// bool scalar; optional ones are omitted as `omitted` (a tensor: that value everywhere).
struct UpdateInput {
  const char* name;
  char kind;  // 't' tensor, 's' float scalar, 'b' bool scalar
  bool optional;
  bool nonnegative;  // a scalar that must be >= 0 for the update to run
  float omitted;
};

constexpr int kMaxUpdateInputs = 16;
constexpr int kMaxUpdateTensors = 8;

struct UpdateArgs {
  Input in[kMaxUpdateInputs];
  const UpdateInput* table = nullptr;
  bool run = true;  // applied, and every scalar keeps the rule
  size_t n = 0;     // elements of the parameter

  float scalar(int i) const { return in[i].present ? *static_cast<const float*>(in[i].data) : table[i].omitted; }
  bool flag(int i) const { return in[i].present ? *static_cast<const bool*>(in[i].data) : table[i].omitted != 0.0f; }
  const float* tensor(int i) const { return in[i].present ? static_cast<const float*>(in[i].data) : nullptr; }
};

// Reads and checks every input (input 0 is the parameter); `applied`: the index of the bool
// input that gates the update, or -1.
inline UpdateArgs read_update_args(OrtKernelContext* ctx, const char* op, const UpdateInput* table, int count,
                                   int applied) {
  UpdateArgs a;
  a.table = table;
  for (int i = 0; i < count; ++i) {
    const UpdateInput& spec = table[i];
    a.in[i] = get_input_any_type(ctx, i, op, spec.name);
    if (!a.in[i].present) {
      if (spec.optional) continue;
      fail(std::string(op) + ": input '" + spec.name + "' is required");
    }
    const auto wanted = spec.kind == 'b' ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    if (a.in[i].onnx_type != wanted) {
      fail(std::string(op) + ": input '" + spec.name + "' must be " + (spec.kind == 'b' ? "bool" : "float32") +
           "; got " + dtype_name(a.in[i].onnx_type));
    }
    if (spec.kind == 't' && i > 0 && a.in[i].shape != a.in[0].shape) {
      fail(std::string(op) + ": input '" + spec.name + "' must have the shape of '" + table[0].name + "' " +
           shape_str(a.in[0].shape) + "; got " + shape_str(a.in[i].shape));
    }
    if (spec.kind != 't' && a.in[i].size != 1) {
      fail(std::string(op) + ": input '" + spec.name + "' must be a scalar; got shape " + shape_str(a.in[i].shape));
    }
  }
  a.n = a.in[0].size;
  a.run = applied < 0 || a.flag(applied);
  for (int i = 0; i < count; ++i) {  // ops/_update.py skip_reason
    if (table[i].kind != 's' || !a.in[i].present) continue;
    const float value = a.scalar(i);
    a.run = a.run && std::isfinite(value) && (!table[i].nonnegative || value >= 0.0f);
  }
  return a;
}

// Which outputs the node names (an omitted optional output is not allocated).
struct NamedOutputs {
  bool named[kMaxUpdateTensors] = {};
  NamedOutputs(const OrtKernelInfo* info, int count) {
    const NodeArgs args(info, 0, count);
    for (int i = 0; i < count; ++i) named[i] = args.output[i];
  }
};

// Runs `body(x, y)` over blocks of kUpdateBlock elements: x[k][i] is element i of the
// block of tensor input k (its `omitted` value for an absent one), y[j][i] what output j
// gets. Blocks go through local arrays: the arithmetic loop then has a fixed trip count and
// no possible aliasing, so it vectorizes even when the outputs are the inputs' buffers (the
// compiler's overlap check would send the in-place case down a scalar loop).
constexpr size_t kUpdateChunk = size_t(1) << 14;  // a multiple of kUpdateBlock
constexpr size_t kUpdateBlock = 64;

// Runs range(begin, end) over the fixed chunks of n elements, on onnxruntime's threads.
template <class Range>
void update_chunks(OrtKernelContext* ctx, size_t n, Range range) {
  auto chunk = [&](size_t c) { range(c * kUpdateChunk, std::min(n, (c + 1) * kUpdateChunk)); };
  parallel_for(ctx, (n + kUpdateChunk - 1) / kUpdateChunk, chunk, n);
}

template <int NIn, int NOut, class Body>
void update_blocks(OrtKernelContext* ctx, size_t n, const float* const (&in)[NIn], const float (&omitted)[NIn],
                   float* const (&out)[NOut], Body body) {
  update_chunks(ctx, n, [&](size_t chunk_begin, size_t end) {
    float x[NIn][kUpdateBlock];
    float y[NOut][kUpdateBlock];
    for (int k = 0; k < NIn; ++k) std::fill(x[k], x[k] + kUpdateBlock, in[k] ? 0.0f : omitted[k]);
    for (size_t begin = chunk_begin; begin < end; begin += kUpdateBlock) {
      const size_t len = std::min(kUpdateBlock, end - begin);
      for (int k = 0; k < NIn; ++k) {
        if (in[k]) std::copy(in[k] + begin, in[k] + begin + len, x[k]);
      }
      body(x, y);
      for (int j = 0; j < NOut; ++j) {
        if (out[j]) std::copy(y[j], y[j] + len, out[j] + begin);
      }
    }
  });
}

// A skipped update: each output gets its kept input (`omitted` everywhere for an absent
// one); in place, nothing is written.
inline void keep_inputs(size_t n, const float* kept, float omitted, float* out) {
  if (out == nullptr || out == kept) return;
  if (kept == nullptr) {
    std::fill(out, out + n, omitted);
  } else {
    std::copy(kept, kept + n, out);
  }
}

// Allocates output `index` shaped like the parameter, or null when the node omits it.
inline float* update_output(OrtKernelContext* ctx, const NamedOutputs& outputs, int index, const UpdateArgs& a) {
  return outputs.named[index] ? static_cast<float*>(get_output(ctx, index, a.in[0].shape)) : nullptr;
}

}  // namespace normgrad
