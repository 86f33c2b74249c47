// The operator descriptors that register.cc turns into OrtCustomOp variants.
#pragma once

#include "ort_glue.h"

namespace normgrad {

// Where an input or output takes its element type from.
// 'F' and 'I' are always float32 and int32 (DropoutMask's ratio and key limbs), 'L' int64
// (EmbeddingGrad's indices and shape, SoftmaxCrossEntropy's labels).
enum TypeClass : char {
  kClassT = 'T', kClassU = 'U', kClassBool = 'B', kClassFloat = 'F', kClassInt32 = 'I', kClassInt64 = 'L'
};

struct OpDescriptor {
  const char* name;
  int num_inputs;
  int num_outputs;
  const char* input_classes;    // one 'T', 'U', 'B' (bool), 'F' (float32), 'I' (int32) or 'L' (int64) per input
  const char* input_optional;   // one '0' or '1' per input
  const char* output_classes;   // one 'T', 'U', 'B' (bool) or 'F' (float32) per output
  const char* output_optional;  // one '0' or '1' per output
  // Which (T, U) pairs get a typed kernel: 'a' = all nine, 'f' = U in {T, float};
  // 'd' = T alone, over float, float16, bfloat16 and double.
  char type_pairs;
  // The input whose element type the outputs have (for the catch-all variants).
  int anchor;
  struct KernelBase* (*create)(const OrtKernelInfo* info);  // may throw Failure
  // Set where an output may take an input's buffer (onnxruntime's MayInplace, API 18): fills
  // one (input, output) pair, see may_reuse below.
  size_t (*may_inplace)(int** input_index, int** output_index) = nullptr;
};

// OrtCustomOp::GetMayInplace for one pair: output kOutput may be written over input kInput
// (the kernel reads each element before it writes the same one). onnxruntime frees the
// arrays with release_in_place_pair.
template <int kInput, int kOutput>
size_t may_reuse(int** input_index, int** output_index) {
  *input_index = new int[1]{kInput};
  *output_index = new int[1]{kOutput};
  return 1;
}

// Every kernel: compute() may throw Failure; register.cc turns it into an OrtStatus.
struct KernelBase {
  virtual ~KernelBase() = default;
  virtual void compute(OrtKernelContext* ctx) = 0;
  virtual const char* name() const = 0;
};

extern const OpDescriptor kBatchNormReduceBackward;
extern const OpDescriptor kBatchNormElemtBackward;
extern const OpDescriptor kGroupNormalizationGrad;
extern const OpDescriptor kLayerNormalizationGrad;
extern const OpDescriptor kRMSNormalizationGrad;
extern const OpDescriptor kAllReduce;
extern const OpDescriptor kAdamUpdate;
extern const OpDescriptor kSGDUpdate;
extern const OpDescriptor kGatedUpdate;
extern const OpDescriptor kDropoutMask;
extern const OpDescriptor kEmbeddingGrad;
extern const OpDescriptor kSoftmaxCrossEntropy;
extern const OpDescriptor kMatrixTranspose;
extern const OpDescriptor kOuterProductSum;
extern const OpDescriptor kDepthwiseConv;
extern const OpDescriptor kDepthwiseConvGrad;
extern const OpDescriptor kMaxPoolGrad;
extern const OpDescriptor kLSTMBackwardFactors;
extern const OpDescriptor kSiLUGrad;
extern const OpDescriptor kGeluGrad;
extern const OpDescriptor kGeluTanhGrad;
extern const OpDescriptor kSwiGLUGrad;
extern const OpDescriptor kSoftmaxGrad;
extern const OpDescriptor kSafeSoftmax;
extern const OpDescriptor kBiasSafeSoftmax;
extern const OpDescriptor kBiasSoftmaxCrossEntropy;
extern const OpDescriptor kSiLUMul;
extern const OpDescriptor kGeluWithSlope;
extern const OpDescriptor kRotateHalfEmbedding;

// Reads which inputs/outputs the node names ("" and trailing omissions are absent).
struct NodeArgs {
  bool input[8] = {};
  bool output[8] = {};
  NodeArgs(const OrtKernelInfo* info, int num_inputs, int num_outputs);
};

template <class Kernel>
KernelBase* create_kernel(const OrtKernelInfo* info) {
  return new Kernel(info);
}

// Float view of a per-channel / per-group vector input.
inline float vec_at(const Input& in, size_t i) { return load_float(in.dtype, in.data, i); }

}  // namespace normgrad
