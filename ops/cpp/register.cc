// RegisterCustomOps: the library's entry point, and the OrtCustomOp plumbing.
//
// Each operator is registered once per supported (T, U) element-type pair with concrete
// input and output types, so that onnxruntime's type inference knows every output type.
// Catch-all variants after the typed ones let the kernel itself report wrong element types.
// The library asks for API version 17 (KernelContext_ParallelFor, onnxruntime 1.17) and
// declares its ops with that version (18 for an op whose output may reuse an input's buffer),
// so the same binary loads on every onnxruntime from 1.18 on, whatever header version it was
// compiled against.
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "ops.h"

namespace normgrad {

const OrtApi* g_api = nullptr;

const char* dtype_name(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return "uint8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return "int8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16: return "uint16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16: return "int16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_STRING: return "string";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return "bool";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "float64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32: return "uint32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64: return "uint64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    default: return "an unsupported element type";
  }
}

Input get_input_any_type(OrtKernelContext* ctx, size_t index, const char* op, const char* name) {
  Input in;
  size_t count = 0;
  check(g_api->KernelContext_GetInputCount(ctx, &count));
  if (index >= count) return in;
  const OrtValue* value = nullptr;
  check(g_api->KernelContext_GetInput(ctx, index, &value));
  if (value == nullptr) return in;
  int is_tensor = 0;
  check(g_api->IsTensor(value, &is_tensor));
  if (!is_tensor) fail(std::string(op) + ": input '" + name + "' must be a tensor");
  OrtTensorTypeAndShapeInfo* info = nullptr;
  check(g_api->GetTensorTypeAndShape(value, &info));
  size_t rank = 0;
  OrtStatus* st = g_api->GetTensorElementType(info, &in.onnx_type);
  if (st == nullptr) st = g_api->GetDimensionsCount(info, &rank);
  if (st == nullptr) {
    in.shape.resize(rank);
    if (rank > 0) st = g_api->GetDimensions(info, in.shape.data(), rank);
  }
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  check(st);
  size_t size = 1;
  for (int64_t d : in.shape) {
    if (d < 0) fail(std::string(op) + ": input '" + name + "' has a negative dimension " + shape_str(in.shape));
    size = checked_mul(size, static_cast<size_t>(d), op, name);
  }
  checked_mul(size, 8, op, name);
  in.size = size;
  void* data = nullptr;
  check(g_api->GetTensorMutableData(const_cast<OrtValue*>(value), &data));
  if (data == nullptr && size != 0) fail(std::string(op) + ": input '" + name + "' has no data");
  in.data = data;
  in.present = true;
  return in;
}

std::vector<Input> float32_inputs_alike(OrtKernelContext* ctx, const char* op, const std::vector<const char*>& names,
                                        size_t like) {
  std::vector<Input> inputs;
  for (size_t k = 0; k < names.size(); ++k) {
    inputs.push_back(get_input_any_type(ctx, k, op, names[k]));
    if (!inputs[k].present) fail(std::string(op) + ": input '" + names[k] + "' is required");
    if (inputs[k].onnx_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      fail(std::string(op) + ": input '" + names[k] + "' must be float32; got " + dtype_name(inputs[k].onnx_type));
    }
  }
  for (size_t k = 0; k < names.size(); ++k) {
    if (inputs[k].shape != inputs[like].shape) {
      fail(std::string(op) + ": input '" + names[k] + "' must have the shape of '" + names[like] + "' " +
           shape_str(inputs[like].shape) + "; got " + shape_str(inputs[k].shape));
    }
  }
  return inputs;
}

Input get_input(OrtKernelContext* ctx, size_t index, const char* op, const char* name) {
  Input in = get_input_any_type(ctx, index, op, name);
  if (in.present && !to_dtype(in.onnx_type, &in.dtype)) {
    fail(std::string(op) + ": input '" + name + "' must be float32, float16 or bfloat16; got " +
         dtype_name(in.onnx_type));
  }
  return in;
}

void* get_output(OrtKernelContext* ctx, size_t index, const std::vector<int64_t>& shape) {
  OrtValue* value = nullptr;
  check(g_api->KernelContext_GetOutput(ctx, index, shape.data(), shape.size(), &value));
  if (value == nullptr) fail("cannot allocate an output", ORT_FAIL);
  void* data = nullptr;
  check(g_api->GetTensorMutableData(value, &data));
  return data;
}

namespace {
// Whether a C API call succeeded; its status is released either way.
bool succeeded(OrtStatus* st) {
  if (st == nullptr) return true;
  g_api->ReleaseStatus(st);
  return false;
}
}  // namespace

const char* attribute_type(const OrtKernelInfo* info, const char* name) {
  int64_t i = 0;
  float f = 0.0f;
  size_t size = 0;
  if (succeeded(g_api->KernelInfoGetAttribute_int64(info, name, &i))) return "INT";
  if (succeeded(g_api->KernelInfoGetAttribute_float(info, name, &f))) return "FLOAT";
  if (succeeded(g_api->KernelInfoGetAttribute_string(info, name, nullptr, &size))) return "STRING";
  if (succeeded(g_api->KernelInfoGetAttributeArray_int64(info, name, nullptr, &size))) return "INTS";
  if (succeeded(g_api->KernelInfoGetAttributeArray_float(info, name, nullptr, &size))) return "FLOATS";
  OrtAllocator* allocator = nullptr;
  if (succeeded(g_api->GetAllocatorWithDefaultOptions(&allocator))) {
    OrtValue* tensor = nullptr;
    if (succeeded(g_api->KernelInfoGetAttribute_tensor(info, name, allocator, &tensor))) {
      g_api->ReleaseValue(tensor);
      return "TENSOR";
    }
  }
  return "";
}

namespace {
// "<op>: attribute '<name>' must be of type <wanted>; got <type>", naming the node when op is null.
[[noreturn]] void fail_attribute_type(const OrtKernelInfo* info, const char* op, const char* name, const char* wanted,
                                      const std::string& type) {
  std::string where;
  if (op != nullptr) {
    where = op;
  } else {
    size_t size = 0;
    if (succeeded(g_api->KernelInfo_GetNodeName(info, nullptr, &size)) && size > 1) {
      std::string node(size, '\0');
      if (succeeded(g_api->KernelInfo_GetNodeName(info, &node[0], &size))) where = "node '" + std::string(node.c_str()) + "'";
    }
    if (where.empty()) where = "normgrad";
  }
  fail(where + ": attribute '" + name + "' must be of type " + wanted + "; got " + type);
}
}  // namespace

// The attribute through the C API's typed getter; `fallback` when unset; an error for another type.
template <class T, class Getter>
T read_attribute(const OrtKernelInfo* info, const char* op, const char* name, T fallback, Getter get,
                 const char* wanted) {
  T value{};
  if (succeeded(get(info, name, &value))) return value;
  const std::string type = attribute_type(info, name);
  if (type.empty()) return fallback;
  fail_attribute_type(info, op, name, wanted, type);
}

int64_t attribute_int(const OrtKernelInfo* info, const char* op, const char* name, int64_t fallback) {
  return read_attribute(info, op, name, fallback, g_api->KernelInfoGetAttribute_int64, "INT");
}

float attribute_float(const OrtKernelInfo* info, const char* op, const char* name, float fallback) {
  return read_attribute(info, op, name, fallback, g_api->KernelInfoGetAttribute_float, "FLOAT");
}

std::vector<int64_t> attribute_ints(const OrtKernelInfo* info, const char* op, const char* name,
                                    std::vector<int64_t> fallback) {
  size_t size = 0;
  if (succeeded(g_api->KernelInfoGetAttributeArray_int64(info, name, nullptr, &size))) {
    std::vector<int64_t> values(size);
    if (size > 0) check(g_api->KernelInfoGetAttributeArray_int64(info, name, values.data(), &size));
    return values;
  }
  const std::string type = attribute_type(info, name);
  if (type.empty()) return fallback;
  fail_attribute_type(info, op, name, "INTS", type);
}

void check_float_images(const char* op, const Input* const* inputs, const char* const* names,
                        const char* const* dims, size_t count) {
  const Input& first = *inputs[0];
  for (size_t i = 0; i < count; ++i) {
    const Input& in = *inputs[i];
    if (in.onnx_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && in.onnx_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE) {
      fail(std::string(op) + ": input '" + names[i] + "' must be float32 or float64; got " + dtype_name(in.onnx_type));
    }
    if (in.shape.size() != 4) {
      fail(std::string(op) + ": input '" + names[i] + "' must have rank 4 (" + dims[i] + "); got shape " +
           shape_str(in.shape));
    }
    if (in.onnx_type != first.onnx_type) {
      fail(std::string(op) + ": input '" + names[i] + "' must have " + names[0] + "'s type " +
           dtype_name(first.onnx_type) + "; got " + dtype_name(in.onnx_type));
    }
  }
}

std::vector<int64_t> geometry_attribute(const OrtKernelInfo* info, const char* op, const char* name, size_t length,
                                        int64_t low) {
  const std::vector<int64_t> values = attribute_ints(info, op, name, std::vector<int64_t>(length, low));
  bool valid = values.size() == length;
  for (int64_t v : values) valid = valid && v >= low;
  if (!valid) {
    fail(std::string(op) + ": attribute '" + name + "' must be " + std::to_string(length) + " integers >= " +
         std::to_string(low) + "; got " + shape_str(values));
  }
  return values;
}

NodeArgs::NodeArgs(const OrtKernelInfo* info, int num_inputs, int num_outputs) {
  size_t count = 0;
  check(g_api->KernelInfo_GetInputCount(info, &count));
  for (size_t i = 0; i < count && i < static_cast<size_t>(num_inputs) && i < 8; ++i) {
    size_t len = 0;
    check(g_api->KernelInfo_GetInputName(info, i, nullptr, &len));
    input[i] = len > 1;  // len counts the terminating zero
  }
  check(g_api->KernelInfo_GetOutputCount(info, &count));
  for (size_t i = 0; i < count && i < static_cast<size_t>(num_outputs) && i < 8; ++i) {
    size_t len = 0;
    check(g_api->KernelInfo_GetOutputName(info, i, nullptr, &len));
    output[i] = len > 1;
  }
}

namespace {

const ONNXTensorElementDataType kOnnxTypes[kNumDTypes] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
                                                          ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
                                                          ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16};

// "<op>: <what>" as an ORT_FAIL status without allocating (no std::string: a handler of
// std::bad_alloc that allocates could throw again, out of a noexcept callback).
OrtStatus* error_status(const char* op, const char* what) noexcept {
  char message[512];
  std::snprintf(message, sizeof message, "%s: %s", op, what);
  return g_api->CreateStatus(ORT_FAIL, message);
}

// The element type of a class that has one (bool, float32, int32, int64); UNDEFINED (0) for T and U.
ONNXTensorElementDataType fixed_type(char type_class) {
  switch (type_class) {
    case kClassBool: return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
    case kClassFloat: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    case kClassInt32: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    case kClassInt64: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
}

// One typed registration of an operator.
struct OpVariant : OrtCustomOp {
  const OpDescriptor* desc;
  ONNXTensorElementDataType t, u;
  // Set for the catch-all variants: each input's declared type (UNDEFINED = any), and
  // every output UNDEFINED.
  bool any = false;
  ONNXTensorElementDataType input_types[16] = {};

  static const OpVariant& self(const OrtCustomOp* op) { return *static_cast<const OpVariant*>(op); }

  OpVariant(const OpDescriptor* d, ONNXTensorElementDataType t_, ONNXTensorElementDataType u_)
      : OrtCustomOp(), desc(d), t(t_), u(u_) {
    std::memset(static_cast<OrtCustomOp*>(this), 0, sizeof(OrtCustomOp));
    version = kApiVersion;
    CreateKernel = nullptr;
    GetName = [](const OrtCustomOp* op) { return self(op).desc->name; };
    GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return "CPUExecutionProvider"; };
    GetInputType = [](const OrtCustomOp* op, size_t i) {
      const OpVariant& v = self(op);
      if (v.any) return v.input_types[i];
      if (const auto fixed = fixed_type(v.desc->input_classes[i])) return fixed;
      return v.desc->input_classes[i] == kClassT ? v.t : v.u;
    };
    GetInputTypeCount = [](const OrtCustomOp* op) { return static_cast<size_t>(self(op).desc->num_inputs); };
    GetOutputType = [](const OrtCustomOp* op, size_t i) {
      const OpVariant& v = self(op);
      if (const auto fixed = fixed_type(v.desc->output_classes[i])) return fixed;
      if (v.any) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
      return v.desc->output_classes[i] == kClassT ? v.t : v.u;
    };
    GetOutputTypeCount = [](const OrtCustomOp* op) { return static_cast<size_t>(self(op).desc->num_outputs); };
    KernelCompute = [](void*, OrtKernelContext*) {};  // unused: KernelComputeV2 is set
    KernelDestroy = [](void* kernel) { delete static_cast<KernelBase*>(kernel); };
    GetInputCharacteristic = [](const OrtCustomOp* op, size_t i) {
      return self(op).desc->input_optional[i] == '1' ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
    };
    GetOutputCharacteristic = [](const OrtCustomOp* op, size_t i) {
      return self(op).desc->output_optional[i] == '1' ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
    };
    GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
    GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
    CreateKernelV2 = [](const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo* info,
                        void** kernel) noexcept -> OrtStatusPtr {
      *kernel = nullptr;
      try {
        *kernel = static_cast<void*>(self(op).desc->create(info));
        return nullptr;
      } catch (const Failure& f) {
        return g_api->CreateStatus(f.code, f.message.c_str());
      } catch (const std::bad_alloc&) {
        return g_api->CreateStatus(ORT_FAIL, "normgrad: out of memory");
      } catch (...) {
        return g_api->CreateStatus(ORT_FAIL, "normgrad: kernel creation failed");
      }
    };
    KernelComputeV2 = [](void* kernel, OrtKernelContext* ctx) noexcept -> OrtStatusPtr {
      KernelBase* k = static_cast<KernelBase*>(kernel);
      try {
        k->compute(ctx);
        return nullptr;
      } catch (const Failure& f) {
        return g_api->CreateStatus(f.code, f.message.c_str());
      } catch (const std::bad_alloc&) {
        return error_status(k->name(), "out of memory");
      } catch (const std::exception& e) {
        return error_status(k->name(), e.what());
      } catch (...) {
        return error_status(k->name(), "unknown error");
      }
    };
    // version 17 fields: no shape inference callback (onnxruntime's wrapper of it cannot
    // handle omitted optional inputs); opset range 1.. by default.
    InferOutputShapeFn = nullptr;
    GetStartVersion = [](const OrtCustomOp*) { return 1; };
    GetEndVersion = [](const OrtCustomOp*) { return 2147483647; };
    if (d->may_inplace != nullptr) {  // version 18 fields (onnxruntime 1.18 on)
      version = kApiVersionInPlace;
      GetMayInplace = d->may_inplace;
      ReleaseMayInplace = [](int* input_index, int* output_index) {
        delete[] input_index;
        delete[] output_index;
      };
    }
  }
};

std::vector<OpVariant*>* build_ops() {
  auto* ops = new std::vector<OpVariant*>();
  for (const OpDescriptor* d : {&kBatchNormReduceBackward, &kBatchNormElemtBackward, &kGroupNormalizationGrad,
                                &kLayerNormalizationGrad, &kRMSNormalizationGrad, &kAllReduce, &kAdamUpdate,
                                &kSGDUpdate, &kGatedUpdate, &kDropoutMask, &kEmbeddingGrad,
                                &kSoftmaxCrossEntropy, &kMatrixTranspose, &kOuterProductSum, &kDepthwiseConv, &kDepthwiseConvGrad, &kMaxPoolGrad, &kSiLUGrad, &kGeluGrad,
                                &kGeluTanhGrad, &kSwiGLUGrad, &kSoftmaxGrad, &kSafeSoftmax, &kBiasSafeSoftmax,
                                &kBiasSoftmaxCrossEntropy, &kSiLUMul, &kGeluWithSlope, &kRotateHalfEmbedding,
                                &kLSTMBackwardFactors}) {
    if (d->type_pairs == 'd') {  // T only, double included, then one catch-all variant
      for (auto t : {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
                     ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16, ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE}) {
        ops->push_back(new OpVariant(d, t, t));
      }
      auto* v = new OpVariant(d, ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED);
      v->any = true;
      // a bool input stays bool: onnxruntime types the outputs after the last untyped input (a
      // float32 or int32 class is left untyped, so that the kernel names a mistyped one)
      for (int i = 0; i < d->num_inputs; ++i) {
        if (d->input_classes[i] == kClassBool) v->input_types[i] = ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
      }
      ops->push_back(v);
      continue;
    }
    for (int t = 0; t < kNumDTypes; ++t) {
      for (int u = 0; u < kNumDTypes; ++u) {
        if (d->type_pairs == 'f' && u != t && u != kF32) continue;
        ops->push_back(new OpVariant(d, kOnnxTypes[t], kOnnxTypes[u]));
      }
    }
    // Then catch-all variants, for type combinations no typed variant serves, so that the
    // kernel (not onnxruntime's generic "no kernel def matches") names the input with the
    // wrong element type. onnxruntime infers an untyped output's type from the LAST input
    // that accepts any type, so the input the outputs follow (d->anchor) is the last
    // untyped one: the inputs after it get concrete float types, all combinations when
    // there are at most four of them, else one shared type; a fully untyped variant comes
    // last. (Catch-alls must not come first: onnxruntime builds the schema from the first
    // variant.)
    const int after = d->num_inputs - d->anchor - 1;
    std::vector<std::vector<int>> combos;
    if (after <= 4) {
      int total = 1;
      for (int i = 0; i < after; ++i) total *= kNumDTypes;
      for (int c = 0; c < total; ++c) {
        std::vector<int> combo;
        for (int i = 0, rest = c; i < after; ++i, rest /= kNumDTypes) combo.push_back(rest % kNumDTypes);
        combos.push_back(combo);
      }
    } else {
      for (int t = 0; t < kNumDTypes; ++t) combos.push_back(std::vector<int>(after, t));
    }
    combos.push_back(std::vector<int>(after, -1));
    for (const auto& combo : combos) {
      auto* v = new OpVariant(d, ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED);
      v->any = true;
      for (int i = 0; i < d->num_inputs; ++i) {
        const int c = i > d->anchor ? combo[i - d->anchor - 1] : -1;
        v->input_types[i] = c < 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : kOnnxTypes[c];
      }
      ops->push_back(v);
    }
  }
  return ops;
}

}  // namespace
}  // namespace normgrad

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  using namespace normgrad;
  if (api_base == nullptr) return nullptr;
  const OrtApi* api = api_base->GetApi(kApiVersion);
  if (api == nullptr) {
    // Any onnxruntime serves API version 1, and CreateStatus is part of it.
    const OrtApi* old = api_base->GetApi(1);
    std::string msg = std::string("normgrad_ops needs onnxruntime C API version ") + std::to_string(kApiVersion) +
                      " (onnxruntime >= 1.17); this process runs onnxruntime " +
                      (api_base->GetVersionString ? api_base->GetVersionString() : "(unknown version)") +
                      ". Upgrade onnxruntime, or use normgrad's Python kernels or function bodies.";
    return old != nullptr ? old->CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
  }
  // Written once (a thread-safe static initialiser), never again: a second registration,
  // possibly concurrent with kernels of an earlier session reading g_api on other threads,
  // must not store to it (a data race even when the value is the same).
  static const bool api_set = (g_api = api, true);
  (void)api_set;
  try {
    static std::vector<OpVariant*>* ops = build_ops();
    kernels();  // choose the CPU kernels once, before any session runs
    OrtCustomOpDomain* domain = nullptr;
    if (OrtStatus* st = api->CreateCustomOpDomain("normgrad", &domain)) return st;
    for (OpVariant* op : *ops) {
      if (OrtStatus* st = api->CustomOpDomain_Add(domain, op)) {
        api->ReleaseCustomOpDomain(domain);
        return st;
      }
    }
    // The domain must outlive every session made from these options; onnxruntime does not
    // take ownership, so it is deliberately never released (a few bytes per registration).
    if (OrtStatus* st = api->AddCustomOpDomain(options, domain)) {
      api->ReleaseCustomOpDomain(domain);
      return st;
    }
    return nullptr;
  } catch (const std::bad_alloc&) {
    return api->CreateStatus(ORT_FAIL, "normgrad_ops: out of memory while registering operators");
  } catch (...) {
    return api->CreateStatus(ORT_FAIL, "normgrad_ops: registration failed");
  }
}
