// MatrixTranspose (ops/matrix_transpose.py): y [N, M] = x [M, N] transposed, as a copy. Row
// blocks of x go to the intra-op threads.
#include <string>

#include "matrix_transpose.h"
#include "ops.h"
#include "update_math.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "MatrixTranspose";
constexpr size_t kRowsPerBlock = 64;

struct MatrixTranspose final : KernelBase {
  explicit MatrixTranspose(const OrtKernelInfo*) {}
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    const Input x = get_input_any_type(ctx, 0, kOp, "x");
    if (x.onnx_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && x.onnx_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE) {
      fail(std::string(kOp) + ": input 'x' must be float32 or float64; got " + dtype_name(x.onnx_type));
    }
    if (x.shape.size() != 2) fail(std::string(kOp) + ": input 'x' must have rank 2 ([M, N]); got shape " + shape_str(x.shape));
    const size_t m = static_cast<size_t>(x.shape[0]), n = static_cast<size_t>(x.shape[1]);
    void* out = get_output(ctx, 0, {x.shape[1], x.shape[0]});
    if (m == 0 || n == 0) return;
    const size_t blocks = (m + kRowsPerBlock - 1) / kRowsPerBlock;
    if (x.onnx_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      const float* source = static_cast<const float*>(x.data);
      float* target = static_cast<float*>(out);
      const bool avx2 = update_avx2();
      auto block = [&](size_t b) {
        const size_t begin = b * kRowsPerBlock, end = begin + kRowsPerBlock < m ? begin + kRowsPerBlock : m;
        if (avx2) {
          transpose_rows_avx2(source, target, m, n, begin, end);
        } else {
          transpose_rows(source, target, m, n, begin, end);
        }
      };
      parallel_for(ctx, blocks, block, m * n);
    } else {
      const double* source = static_cast<const double*>(x.data);
      double* target = static_cast<double*>(out);
      auto block = [&](size_t b) {
        const size_t begin = b * kRowsPerBlock, end = begin + kRowsPerBlock < m ? begin + kRowsPerBlock : m;
        transpose_rows(source, target, m, n, begin, end);
      };
      parallel_for(ctx, blocks, block, m * n);
    }
  }
};

}  // namespace

extern const OpDescriptor kMatrixTranspose = {
    kOp, 1, 1, "T", "0", "T", "0", 'd', 0, &create_kernel<MatrixTranspose>,
};

}  // namespace normgrad
