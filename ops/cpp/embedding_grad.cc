// EmbeddingGrad: the gradient of a Gather along axis 0 (ops/embedding_grad.py). The table
// is cut into fixed blocks of rows; each block is zeroed and then gets its dy rows added in
// increasing k (a stable bucketing of k by block, made once), so every element is the same
// left-to-right sum at any thread count, and the same as ScatterElements(reduction="add").
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "ops.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "EmbeddingGrad";
constexpr size_t kBlockElements = 1 << 16;  // table elements per block (rows of several blocks: one row)

Input int64_input(OrtKernelContext* ctx, size_t index, const char* name) {
  const Input in = get_input_any_type(ctx, index, kOp, name);
  if (!in.present) fail(std::string(kOp) + ": input '" + name + "' is required");
  if (in.onnx_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64) {
    fail(std::string(kOp) + ": input '" + name + "' must be int64; got " + dtype_name(in.onnx_type));
  }
  return in;
}

template <class T>
void scatter_add_rows(OrtKernelContext* ctx, const T* dy, const int64_t* indices, size_t n, size_t rows,
                      size_t width, T* out) {
  const size_t rows_per_block = std::max<size_t>(1, kBlockElements / std::max<size_t>(1, width));
  const size_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  // order[starts[b] .. starts[b + 1]): the k whose row lies in block b, increasing
  std::vector<size_t> starts(blocks + 1, 0), order(n);
  for (size_t k = 0; k < n; ++k) ++starts[static_cast<size_t>(indices[k]) / rows_per_block + 1];
  for (size_t b = 0; b < blocks; ++b) starts[b + 1] += starts[b];
  {
    std::vector<size_t> next(starts.begin(), starts.end() - 1);
    for (size_t k = 0; k < n; ++k) order[next[static_cast<size_t>(indices[k]) / rows_per_block]++] = k;
  }
  auto block = [&](size_t b) {
    const size_t first = b * rows_per_block, count = std::min(rows, first + rows_per_block) - first;
    std::memset(out + first * width, 0, count * width * sizeof(T));
    for (size_t i = starts[b]; i < starts[b + 1]; ++i) {
      const size_t k = order[i];
      T* row = out + static_cast<size_t>(indices[k]) * width;
      const T* add = dy + k * width;
      for (size_t j = 0; j < width; ++j) row[j] += add[j];
    }
  };
  parallel_for(ctx, blocks, block, rows * width + n * width);
}

struct EmbeddingGrad final : KernelBase {
  explicit EmbeddingGrad(const OrtKernelInfo*) {}
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    const Input dy = get_input_any_type(ctx, 0, kOp, "dy");
    if (dy.onnx_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && dy.onnx_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE) {
      fail(std::string(kOp) + ": input 'dy' must be float32 or float64; got " + dtype_name(dy.onnx_type));
    }
    if (dy.shape.empty()) fail(std::string(kOp) + ": input 'dy' must have rank >= 1 ([N, ...]); got a scalar");
    const Input indices = int64_input(ctx, 1, "indices");
    const Input shape_in = int64_input(ctx, 2, "shape");
    const size_t rank = dy.shape.size();
    if (shape_in.shape != std::vector<int64_t>{static_cast<int64_t>(rank)}) {
      fail(std::string(kOp) + ": input 'shape' must have shape [" + std::to_string(rank) + "] (dy's rank); got " +
           shape_str(shape_in.shape));
    }
    const int64_t* shape_values = static_cast<const int64_t*>(shape_in.data);
    const std::vector<int64_t> shape(shape_values, shape_values + rank);
    if (shape[0] < 0) {
      fail(std::string(kOp) + ": input 'shape' must have rows = shape[0] >= 0; got " + std::to_string(shape[0]));
    }
    if (!std::equal(shape.begin() + 1, shape.end(), dy.shape.begin() + 1)) {
      fail(std::string(kOp) + ": input 'shape' must end with dy's dims " +
           shape_str(std::vector<int64_t>(dy.shape.begin() + 1, dy.shape.end())) + "; got " + shape_str(shape));
    }
    std::vector<int64_t> wanted(rank, 1);
    wanted[0] = dy.shape[0];
    if (indices.shape != wanted) {
      fail(std::string(kOp) + ": input 'indices' must have shape " + shape_str(wanted) +
           " (dy's first dim, then ones to dy's rank); got " + shape_str(indices.shape));
    }
    const size_t n = static_cast<size_t>(dy.shape[0]), rows = static_cast<size_t>(shape[0]);
    const int64_t* index = static_cast<const int64_t*>(indices.data);
    for (size_t k = 0; k < n; ++k) {
      if (index[k] < 0 || index[k] >= shape[0]) {
        fail(std::string(kOp) + ": input 'indices' must hold row numbers in [0, rows) = [0, " +
             std::to_string(shape[0]) + "); got " + std::to_string(index[k]) + " at position " + std::to_string(k));
      }
    }
    size_t width = 1;  // D1 * ... * Dm
    for (size_t i = 1; i < rank; ++i) width = checked_mul(width, static_cast<size_t>(shape[i]), kOp, "shape");
    checked_mul(checked_mul(rows, width, kOp, "shape"), 8, kOp, "shape");
    void* out = get_output(ctx, 0, shape);
    if (rows == 0 || width == 0) return;
    if (dy.onnx_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      scatter_add_rows(ctx, static_cast<const float*>(dy.data), index, n, rows, width, static_cast<float*>(out));
    } else {
      scatter_add_rows(ctx, static_cast<const double*>(dy.data), index, n, rows, width, static_cast<double*>(out));
    }
  }
};

}  // namespace

extern const OpDescriptor kEmbeddingGrad = {
    kOp, 3, 1, "TLL", "000", "T", "0", 'd', 0, &create_kernel<EmbeddingGrad>,
};

}  // namespace normgrad
