// Thin helpers over the onnxruntime C API for the normgrad kernels: inputs and outputs
// with their shapes, errors as C++ exceptions inside the library (turned into OrtStatus
// at the C boundary), attributes, ParallelFor.
#pragma once

#ifndef ORT_API_MANUAL_INIT
#define ORT_API_MANUAL_INIT
#endif
#include <onnxruntime_c_api.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "kernels.h"

#if ORT_API_VERSION < 18
#error "normgrad_ops needs onnxruntime C API headers of version 1.18 or newer (ORT_API_VERSION >= 18)"
#endif

namespace normgrad {

// The API version the library asks for: KernelContext_ParallelFor is the newest function
// it uses (onnxruntime 1.17). The custom ops declare the same version.
constexpr uint32_t kApiVersion = 17;
// The version an op that lets an output reuse an input's buffer declares: GetMayInplace is a
// version 18 field, which onnxruntime reads from 1.18 on (the project supports 1.19.2 on).
constexpr uint32_t kApiVersionInPlace = 18;

extern const OrtApi* g_api;

// An error raised inside a kernel; Compute wrappers turn it into an OrtStatus.
struct Failure {
  OrtErrorCode code;
  std::string message;
};

[[noreturn]] inline void fail(const std::string& message, OrtErrorCode code = ORT_INVALID_ARGUMENT) {
  throw Failure{code, message};
}

// Throws a Failure carrying an onnxruntime error.
inline void check(OrtStatus* status) {
  if (status == nullptr) return;
  Failure f{g_api->GetErrorCode(status), g_api->GetErrorMessage(status)};
  g_api->ReleaseStatus(status);
  throw f;
}

inline std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream s;
  s << '[';
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << ']';
  return s.str();
}

const char* dtype_name(ONNXTensorElementDataType t);

// Maps the onnx element type to ours; false for anything else.
inline bool to_dtype(ONNXTensorElementDataType t, DType* out) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: *out = kF32; return true;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: *out = kF16; return true;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: *out = kBF16; return true;
    default: return false;
  }
}

struct Input {
  bool present = false;
  DType dtype = kF32;
  ONNXTensorElementDataType onnx_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<int64_t> shape;
  size_t size = 0;  // element count
  const void* data = nullptr;
};

// Each of the `count` inputs float32 or float64, of rank 4 and of inputs[0]'s type; else an
// error naming the operator, the input (`names`) and the rule (its `dims`, "[N, C, H, W]").
void check_float_images(const char* op, const Input* const* inputs, const char* const* names,
                        const char* const* dims, size_t count);

// Reads input `index` (absent when the node omits it or names it ""). Checks the element
// type is float/float16/bfloat16 and the size fits in memory arithmetic.
Input get_input(OrtKernelContext* ctx, size_t index, const char* op, const char* name);
// The same without the element-type check (`dtype` is then meaningless; read `onnx_type`).
Input get_input_any_type(OrtKernelContext* ctx, size_t index, const char* op, const char* name);

// Inputs 0, 1, ... of `op`, one per name in `names`: each required, float32 and of the shape
// of input `like` (an index into `names`); fails naming the input and the rule.
std::vector<Input> float32_inputs_alike(OrtKernelContext* ctx, const char* op, const std::vector<const char*>& names,
                                        size_t like);

// Whether the node names output `index`.
bool has_output(OrtKernelContext* ctx, size_t index);

// Allocates output `index` with `shape`; returns its data pointer (null for an empty tensor
// is fine: nothing is written).
void* get_output(OrtKernelContext* ctx, size_t index, const std::vector<int64_t>& shape);

// The type of attribute `name` as the C API can read it; "" when the node does not set it
// (or sets it to a type the C API cannot read: graphs, sparse tensors, type protos).
const char* attribute_type(const OrtKernelInfo* info, const char* name);

// Reads an INT attribute, `fallback` when the node does not set it. An attribute of another
// type (FLOAT 0.0, STRING, INTS, ...) is an error naming the operator, the attribute and the
// type, as onnx.checker gives, never read as the default. `op` null: the node's name is used.
int64_t attribute_int(const OrtKernelInfo* info, const char* op, const char* name, int64_t fallback);
inline int64_t attribute_int(const OrtKernelInfo* info, const char* name, int64_t fallback) {
  return attribute_int(info, nullptr, name, fallback);
}
// Reads a FLOAT attribute the same way: `fallback` when unset, an error for another type.
float attribute_float(const OrtKernelInfo* info, const char* op, const char* name, float fallback);
// Reads an INTS attribute the same way.
std::vector<int64_t> attribute_ints(const OrtKernelInfo* info, const char* op, const char* name,
                                    std::vector<int64_t> fallback);
// An INTS attribute of `length` values, each >= `low` (`length` times `low` when unset): a
// window geometry (strides, pads, dilations). Anything else is an error naming it.
std::vector<int64_t> geometry_attribute(const OrtKernelInfo* info, const char* op, const char* name, size_t length,
                                        int64_t low);

// Runs fn(i) for i in [0, total) on the session's intra-op thread pool, or inline when
// the whole job (`elements` elements) is too small to pay for waking threads. The caller's
// partition of the work must not depend on the number of threads, so both give the same
// bits.
constexpr size_t kParallelMinElements = 1 << 16;
template <class Fn>
void parallel_for(OrtKernelContext* ctx, size_t total, Fn& fn, size_t elements) {
  if (total == 0) return;
  if (total == 1 || elements < kParallelMinElements) {
    for (size_t i = 0; i < total; ++i) fn(i);
    return;
  }
  struct Call {
    static void run(void* data, size_t i) noexcept { (*static_cast<Fn*>(data))(i); }
  };
  check(g_api->KernelContext_ParallelFor(ctx, &Call::run, total, 0, &fn));
}

// Multiplies sizes, failing on overflow.
inline size_t checked_mul(size_t a, size_t b, const char* op, const char* what) {
  size_t r;
  if (__builtin_mul_overflow(a, b, &r)) {
    std::ostringstream s;
    s << op << ": " << what << " is too large (element count overflows)";
    fail(s.str());
  }
  return r;
}

}  // namespace normgrad
