// RotateHalfEmbedding (ops/rotate_half_embedding.py): y = x cos + r(x) sin, or its transpose,
// one pass over x, cos and sin broadcast by NumPy rules (the last axis never). Rows of x's
// last axis go to the intra-op threads in fixed groups; elementwise: any thread count gives
// the same bits.
#include <string>
#include <vector>

#include "ops.h"
#include "rotate_half_embedding_math.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "RotateHalfEmbedding";
constexpr size_t kRowsPerTask = 64;

// The offset of each row's cos (or sin) row: per leading axis of x, the stride of the
// broadcast input along it (0 where its dim is 1 or absent).
struct RowOffsets {
  std::vector<int64_t> dims, strides;  // x's leading dims, the input's strides along them
  size_t at(size_t row) const {
    size_t offset = 0;
    for (size_t k = dims.size(); k-- > 0;) {
      const size_t index = row % static_cast<size_t>(dims[k]);
      row /= static_cast<size_t>(dims[k]);
      offset += index * static_cast<size_t>(strides[k]);
    }
    return offset;
  }
};

RowOffsets broadcast_rows(const Input& in, const char* name, const std::vector<int64_t>& x_shape) {
  const std::string prefix = std::string(kOp) + ": input '" + name + "' ";
  if (in.shape.empty() || in.shape.back() != x_shape.back()) {
    fail(prefix + "must have x's last axis " + std::to_string(x_shape.back()) + " as its last axis; got shape " +
         shape_str(in.shape));
  }
  if (in.shape.size() > x_shape.size()) {
    fail(prefix + "must broadcast to x's shape " + shape_str(x_shape) + ": rank " + std::to_string(in.shape.size()) +
         " exceeds the rank of 'x' (" + std::to_string(x_shape.size()) + ")");
  }
  const size_t lead = x_shape.size() - in.shape.size();
  RowOffsets rows;
  rows.dims.assign(x_shape.begin(), x_shape.end() - 1);
  rows.strides.assign(rows.dims.size(), 0);
  int64_t stride = in.shape.back();
  for (size_t k = x_shape.size() - 1; k-- > lead;) {
    const int64_t dim = in.shape[k - lead];
    if (dim != 1 && dim != x_shape[k]) {
      fail(prefix + "must broadcast to x's shape " + shape_str(x_shape) + ": dim " + std::to_string(dim) +
           " is neither 1 nor the matching dim " + std::to_string(x_shape[k]) + " of 'x'");
    }
    rows.strides[k] = dim == 1 ? 0 : stride;
    stride *= dim;
  }
  return rows;
}

struct RotateHalfEmbedding final : KernelBase {
  explicit RotateHalfEmbedding(const OrtKernelInfo* info) : transposed(attribute_int(info, kOp, "transposed", 0)) {
    if (transposed != 0 && transposed != 1) {
      fail(std::string(kOp) + ": attribute 'transposed' must be 0 or 1; got " + std::to_string(transposed));
    }
  }
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    const char* names[3] = {"x", "cos", "sin"};
    Input in[3];
    for (size_t k = 0; k < 3; ++k) {
      in[k] = get_input_any_type(ctx, k, kOp, names[k]);
      if (!in[k].present) fail(std::string(kOp) + ": input '" + names[k] + "' is required");
      if (in[k].onnx_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
        fail(std::string(kOp) + ": input '" + names[k] + "' must be float32; got " + dtype_name(in[k].onnx_type));
      }
    }
    const std::vector<int64_t>& shape = in[0].shape;
    if (shape.empty()) {
      fail(std::string(kOp) + ": input 'x' must have rank >= 1 (the rotated pairs along the last axis); got a scalar");
    }
    if (shape.back() % 2) {
      fail(std::string(kOp) + ": input 'x' must have an even last axis (its two halves are rotated); got shape " +
           shape_str(shape));
    }
    const RowOffsets cos_rows = broadcast_rows(in[1], "cos", shape);
    const RowOffsets sin_rows = broadcast_rows(in[2], "sin", shape);
    float* const y = static_cast<float*>(get_output(ctx, 0, shape));
    const size_t n = static_cast<size_t>(shape.back());
    if (n == 0 || in[0].size == 0) return;
    const size_t rows = in[0].size / n;
    const float* const x = static_cast<const float*>(in[0].data);
    const float* const c = static_cast<const float*>(in[1].data);
    const float* const s = static_cast<const float*>(in[2].data);
    const bool avx2 = update_avx2(), flip = transposed == 1;
    auto task = [&](size_t t) {
      const size_t end = (t + 1) * kRowsPerTask < rows ? (t + 1) * kRowsPerTask : rows;
      for (size_t i = t * kRowsPerTask; i < end; ++i) {
        const float* ci = c + cos_rows.at(i);
        const float* si = s + sin_rows.at(i);
        if (avx2) {
          rotate_half_row_avx2(x + i * n, ci, si, y + i * n, n / 2, flip);
        } else {
          rotate_half_row(x + i * n, ci, si, y + i * n, n / 2, flip);
        }
      }
    };
    parallel_for(ctx, (rows + kRowsPerTask - 1) / kRowsPerTask, task, in[0].size);
  }

  const int64_t transposed;
};

}  // namespace

extern const OpDescriptor kRotateHalfEmbedding = {
    kOp, 3, 1, "TTT", "000", "T", "0", 'd', 0, &create_kernel<RotateHalfEmbedding>,
};

}  // namespace normgrad
