// LayerNormalizationGrad and RMSNormalizationGrad: x as R rows of D values at `axis`.
//
// Rows are cut into blocks of kRowsPerBlock consecutive rows (a layout fixed by the shape,
// never by the thread count); one task per block. Per group of rows (1 for float32, 4 for
// 16-bit types), while the rows are in cache: a reduction pass s1 = Σ w·dy,
// s2 = Σ w·dy·(x − μ) (μ = 0 for RMSNorm) per row, then the output pass
// dx = rstd·w·dy − rstd³·s2/D·(x − μ) − rstd·s1/D, which also adds dy·x̂ and dy into the
// block's float32 partial sums of dscale and dbias and prefetches the next group. The
// blocks' partials are then summed per column in block order, in double, by column ranges
// (again fixed). So x and dy are read from memory once and dx written once, and every
// output is the same for any number of threads.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "ops.h"

namespace normgrad {
namespace {

constexpr size_t kRowsPerBlock = 32;
constexpr size_t kColumnsPerTask = 1024;

inline const char* at(const void* p, size_t elem, DType t) { return static_cast<const char*>(p) + elem * dtype_size(t); }
inline char* at(void* p, size_t elem, DType t) { return static_cast<char*>(p) + elem * dtype_size(t); }

struct RowNormalizationGrad : KernelBase {
  const char* op;
  bool layer_norm;  // LayerNorm (mean input, dbias output) or RMSNorm
  int64_t axis_attr;
  NodeArgs args;

  RowNormalizationGrad(const OrtKernelInfo* info, const char* op_, bool layer_norm_)
      : op(op_), layer_norm(layer_norm_), axis_attr(attribute_int(info, op_, "axis", -1)),
        args(info, layer_norm_ ? 5 : 4, layer_norm_ ? 3 : 2) {}
  const char* name() const override { return op; }

  [[noreturn]] void bad(const std::string& what) const { fail(std::string(op) + ": " + what); }

  void compute(OrtKernelContext* ctx) override {
    const Input x = get_input(ctx, 1, op, "x");
    const Input dy = get_input(ctx, 0, op, "dy");
    const Input scale = get_input(ctx, 2, op, "scale");
    for (const auto& [in, nm] : {std::pair{&x, "x"}, {&dy, "dy"}, {&scale, "scale"}}) {
      if (!in->present) bad(std::string("input '") + nm + "' is required");
    }
    const size_t r = x.shape.size();
    if (r == 0) bad("input 'x' must have rank >= 1; got a scalar");
    if (axis_attr < -static_cast<int64_t>(r) || axis_attr >= static_cast<int64_t>(r)) {
      bad("attribute 'axis' must be in [-r, r) for 'x' of rank r = " + std::to_string(r) + "; got " +
          std::to_string(axis_attr));
    }
    const size_t axis = static_cast<size_t>(axis_attr < 0 ? axis_attr + static_cast<int64_t>(r) : axis_attr);
    if (dy.shape != x.shape) {
      bad("input 'dy' must have the shape of 'x' " + shape_str(x.shape) + "; got " + shape_str(dy.shape));
    }
    if (dy.dtype != x.dtype) {
      bad(std::string("input 'dy' must have the dtype of 'x' (") + dtype_name(x.onnx_type) + "); got " +
          dtype_name(dy.onnx_type));
    }
    if (scale.dtype != x.dtype) {
      bad(std::string("input 'scale' must have the dtype of 'x' (") + dtype_name(x.onnx_type) + "); got " +
          dtype_name(scale.onnx_type));
    }
    // scale's stride along each normalised dim of x (0 where scale is broadcast).
    const size_t q = scale.shape.size();
    const std::string scale_rule = "input 'scale' " + shape_str(scale.shape) + " must broadcast to 'x' " +
                                   shape_str(x.shape) + " along the normalised axes >= " + std::to_string(axis) +
                                   " only: ";
    if (q > r) bad(scale_rule + "rank " + std::to_string(q) + " exceeds the rank of 'x' (" + std::to_string(r) + ")");
    std::vector<size_t> scale_stride(r, 0);
    for (size_t i = r, stride = 1; i-- > r - q;) {
      const size_t sd = static_cast<size_t>(scale.shape[i + q - r]), xd = static_cast<size_t>(x.shape[i]);
      if (sd != 1 && sd != xd) {
        bad(scale_rule + "dim " + std::to_string(sd) + " is neither 1 nor the matching dim " + std::to_string(xd) +
            " of 'x'");
      }
      if (i < axis && sd != 1) {
        bad(scale_rule + "dim " + std::to_string(i + q - r) + " (" + std::to_string(sd) + ") lies on axis " +
            std::to_string(i) + " < axis " + std::to_string(axis) + ", where the scale must be 1");
      }
      if (sd != 1) scale_stride[i] = stride;
      stride *= sd;
    }
    std::vector<int64_t> stats_shape(x.shape.begin(), x.shape.begin() + axis);
    stats_shape.resize(r, 1);
    const char* stat_names[2] = {"mean", "inv_std_dev"};
    if (!layer_norm) stat_names[0] = "inv_rms";
    const int num_stats = layer_norm ? 2 : 1;
    Input stats[2];
    for (int s = 0; s < num_stats; ++s) {
      const std::string nm = stat_names[s];
      stats[s] = get_input(ctx, 3 + s, op, nm.c_str());
      if (!stats[s].present) bad("input '" + nm + "' is required");
      if (stats[s].shape != stats_shape) {
        bad("input '" + nm + "' must have shape " + shape_str(stats_shape) +
            " (x's shape with the dims >= axis set to 1); got " + shape_str(stats[s].shape));
      }
      if (stats[s].dtype != x.dtype && stats[s].dtype != kF32) {
        bad("input '" + nm + "' must be float32 or the dtype of 'x' (" + dtype_name(x.onnx_type) + "); got " +
            dtype_name(stats[s].onnx_type));
      }
      if (s > 0 && stats[s].dtype != stats[0].dtype) {
        bad("input '" + nm + "' must have the dtype of '" + stat_names[0] + "' (" + dtype_name(stats[0].onnx_type) +
            "); got " + dtype_name(stats[s].onnx_type));
      }
    }
    const Input& mean = stats[0];
    const Input& rstd = stats[num_stats - 1];

    const DType t = x.dtype;
    void* dx = get_output(ctx, 0, x.shape);
    void* dscale = args.output[1] ? get_output(ctx, 1, scale.shape) : nullptr;
    void* dbias = layer_norm && args.output[2] ? get_output(ctx, 2, scale.shape) : nullptr;
    size_t rows = 1, d = 1;
    for (size_t i = 0; i < r; ++i) (i < axis ? rows : d) *= static_cast<size_t>(x.shape[i]);
    if (x.size == 0) {
      for (size_t j = 0; j < scale.size; ++j) {
        if (dscale) store_float(t, dscale, j, 0.0f);
        if (dbias) store_float(t, dbias, j, 0.0f);
      }
      return;
    }

    // The scale as a row of D values in T: itself, or its broadcast copy.
    std::vector<char> expanded;
    const void* w = scale.data;
    std::vector<size_t> scale_index;  // row position -> scale element, when broadcast
    if (scale.size != d) {
      scale_index.resize(d);
      expanded.resize(d * dtype_size(t));
      for (size_t j = 0; j < d; ++j) {
        size_t rest = j, index = 0;
        for (size_t i = r; i-- > axis;) {
          const size_t xd = static_cast<size_t>(x.shape[i]);
          index += (rest % xd) * scale_stride[i];
          rest /= xd;
        }
        scale_index[j] = index;
        std::memcpy(expanded.data() + j * dtype_size(t), at(scale.data, index, t), dtype_size(t));
      }
      w = expanded.data();
    }

    const size_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
    const size_t sums = (dscale ? 1 : 0) + (dbias ? 1 : 0);
    std::vector<float> partials(sums ? checked_mul(blocks, checked_mul(sums, d, op, "x"), op, "x") : 0, 0.0f);
    const KernelTable& k = kernels();
    const double inv_d = 1.0 / static_cast<double>(d);
    // Rows per output pass: several for 16-bit types (the scale's conversion and the
    // partials' loads and stores are shared), one for float32 (measured faster: the rows
    // being read and the next ones being fetched then fit in L1).
    const size_t group = t == kF32 ? 1 : kMaxRows;
    auto block_task = [&](size_t block) {
      float* acc = sums ? &partials[block * sums * d] : nullptr;
      float* acc_xhat = dscale ? acc : nullptr;
      float* acc_dy = dbias ? acc + (dscale ? d : 0) : nullptr;
      const size_t end = std::min(rows, (block + 1) * kRowsPerBlock);
      RowCoef q[kMaxRows];
      for (size_t first = block * kRowsPerBlock; first < end; first += group) {
        const size_t count = std::min(group, end - first);
        for (size_t r = 0; r < count; ++r) {
          const size_t offset = (first + r) * d;
          const float mu = layer_norm ? vec_at(mean, first + r) : 0.0f, rs = vec_at(rstd, first + r);
          double part[2] = {0.0, 0.0};
          k.sum_gdy_gdyxmu[t](at(dy.data, offset, t), at(x.data, offset, t), w, d, mu, part);
          const double rsd = rs;
          q[r] = RowCoef{mu, rs, static_cast<float>(-rsd * rsd * rsd * part[1] * inv_d),
                         layer_norm ? static_cast<float>(-rsd * part[0] * inv_d) : 0.0f, rs};
        }
        const size_t offset = first * d;
        k.rows_affine_acc[t](at(dy.data, offset, t), at(x.data, offset, t), w, at(dx, offset, t), d, count, q,
                             acc_xhat, acc_dy);
      }
    };
    parallel_for(ctx, blocks, block_task, x.size);
    if (!sums) return;

    // Column sums over the blocks, in block order, in double; by ranges of columns.
    std::vector<double> totals(sums * d, 0.0);
    auto column_task = [&](size_t task) {
      const size_t j0 = task * kColumnsPerTask, j1 = std::min(sums * d, j0 + kColumnsPerTask);
      for (size_t block = 0; block < blocks; ++block) {
        const float* part = &partials[block * sums * d];
        for (size_t j = j0; j < j1; ++j) totals[j] += part[j];
      }
    };
    parallel_for(ctx, (sums * d + kColumnsPerTask - 1) / kColumnsPerTask, column_task, partials.size());
    void* outs[2] = {dscale, dbias};
    for (size_t s = 0, slot = 0; s < 2; ++s) {
      if (outs[s] == nullptr) continue;
      const double* row_totals = &totals[slot++ * d];
      if (scale_index.empty()) {
        for (size_t j = 0; j < d; ++j) store_float(t, outs[s], j, static_cast<float>(row_totals[j]));
        continue;
      }
      std::vector<double> reduced(scale.size, 0.0);  // the broadcast axes summed, in row order
      for (size_t j = 0; j < d; ++j) reduced[scale_index[j]] += row_totals[j];
      for (size_t j = 0; j < scale.size; ++j) store_float(t, outs[s], j, static_cast<float>(reduced[j]));
    }
  }
};

struct LayerNormalizationGrad final : RowNormalizationGrad {
  explicit LayerNormalizationGrad(const OrtKernelInfo* info)
      : RowNormalizationGrad(info, "LayerNormalizationGrad", true) {}
};

struct RMSNormalizationGrad final : RowNormalizationGrad {
  explicit RMSNormalizationGrad(const OrtKernelInfo* info) : RowNormalizationGrad(info, "RMSNormalizationGrad", false) {}
};

}  // namespace

extern const OpDescriptor kLayerNormalizationGrad = {
    "LayerNormalizationGrad", 5, 3, "TTTUU", "00000", "TTT", "011", 'f', 1, &create_kernel<LayerNormalizationGrad>,
};
extern const OpDescriptor kRMSNormalizationGrad = {
    "RMSNormalizationGrad", 4, 2, "TTTU", "0000", "TT", "01", 'f', 1, &create_kernel<RMSNormalizationGrad>,
};

}  // namespace normgrad
