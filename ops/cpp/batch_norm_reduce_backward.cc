// BatchNormReduceBackward: per-channel Σg and Σg·(x − mean) in one streaming pass, where g is
// dy, or with the optional relu_output y the ReLU-masked dy (relu_select, on the fly).
//
// Work is split into fixed units (blocks of contiguous [n, c] rows, or pieces of long rows)
// that do not depend on the thread count; each row sums in float32 lanes, and the rows of
// a channel are added in a fixed order in float64. The results are therefore bitwise identical
// for any number of intra-op threads.
#include <vector>

#include "batch_norm_common.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "BatchNormReduceBackward";
// Rows at least this long are streamed by the vector kernels; shorter ones take the
// per-sample path (scalar, about 7 ns an element: a CNN's 4x4 maps, [32, 1024, 4, 4], took
// 4.1 ms there against 0.32 streamed).
constexpr size_t kLongRow = 8;
const char* const kOutputs[4] = {"sum_dy", "sum_dy_xmu", "grad_weight", "grad_bias"};

struct BatchNormReduceBackward final : KernelBase {
  NodeArgs args;
  int64_t flags[3];  // input_g, weight_g, bias_g

  explicit BatchNormReduceBackward(const OrtKernelInfo* info) : args(info, 6, 4) {
    flags[0] = attribute_int(info, kOp, "input_g", 1);
    flags[1] = attribute_int(info, kOp, "weight_g", 1);
    flags[2] = attribute_int(info, kOp, "bias_g", 1);
  }
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    const char* flag_names[3] = {"input_g", "weight_g", "bias_g"};
    for (int i = 0; i < 3; ++i) {
      if (flags[i] != 0 && flags[i] != 1) {
        fail(std::string(kOp) + ": attribute '" + flag_names[i] + "' must be 0 or 1; got " + std::to_string(flags[i]));
      }
    }
    const int output_flag[4] = {0, 0, 1, 2};
    for (int i = 0; i < 4; ++i) {
      if (args.output[i] && !flags[output_flag[i]]) {
        fail(std::string(kOp) + ": output '" + kOutputs[i] + "' is named but attribute '" +
             flag_names[output_flag[i]] + "' is 0");
      }
    }
    const Input dy = get_input(ctx, 0, kOp, "grad_out");
    const Input x = get_input(ctx, 1, kOp, "input");
    const NCS d = check_batch_input(kOp, dy, x);
    const Input mean = get_input(ctx, 2, kOp, "mean");
    const Input invstd = get_input(ctx, 3, kOp, "invstd");
    check_channel_vector(kOp, "mean", mean, d.c, nullptr);
    check_channel_vector(kOp, "invstd", invstd, d.c, &mean);
    if (args.input[4]) {
      const Input weight = get_input(ctx, 4, kOp, "weight");
      if (weight.present) check_channel_vector(kOp, "weight", weight, d.c, &mean);
    }
    const DType u = mean.dtype, t = x.dtype;

    void* out[4] = {};
    const std::vector<int64_t> cshape{static_cast<int64_t>(d.c)};
    for (int i = 0; i < 4; ++i) {
      if (args.output[i]) out[i] = get_output(ctx, i, cshape);
    }
    if (!out[0] && !out[1] && !out[2] && !out[3]) return;

    // Per-channel sums, each added in a fixed order.
    std::vector<double> sums(d.c * 2, 0.0);
    const KernelTable& k = kernels();
    const RowPartition part(d);
    const ReluMask relu(kOp, get_input(ctx, 5, kOp, "relu_output"), x, part.pieces > 1 ? part.piece : d.s);
    if (d.s >= kLongRow) {
      // Stream contiguous rows; one partial (Σg, Σg·(x − μ)) per (row, piece).
      std::vector<double> partial(part.rows * part.pieces * 2, 0.0);
      auto unit = [&](size_t u) {
        part.for_runs(d, u, [&](size_t slot, size_t offset, size_t len) {
          const size_t c = (offset / d.s) % d.c;
          k.sum_dy_dyxmu[t](byte_ptr(dy.data, offset, t), byte_ptr(x.data, offset, t), relu.run(offset), len,
                            vec_at(mean, c), &partial[slot * 2]);
        });
      };
      parallel_for(ctx, part.units, unit, x.size);
      for (size_t n = 0; n < d.n; ++n) {
        for (size_t c = 0; c < d.c; ++c) {
          const double* p = &partial[(n * d.c + c) * part.pieces * 2];
          for (size_t i = 0; i < part.pieces; ++i) {
            sums[c * 2] += p[i * 2];
            sums[c * 2 + 1] += p[i * 2 + 1];
          }
        }
      }
    } else if (d.n * d.s > 0) {
      // Short rows (e.g. [N, C] inputs): units of nb samples × cb channels, one partial per
      // (sample block, channel). A sample block has at least kMinSamples samples, so the
      // partials stay a small fraction of the input (16·C·⌈N/nb⌉ bytes against at least
      // 4·N·C·S bytes read) even when C·S alone exceeds a unit.
      constexpr size_t kMinSamples = 64;
      const size_t nb = std::min(d.n, std::max(kMinSamples, RowPartition::kUnit / (d.c * d.s)));
      const size_t cb = std::min(d.c, std::max<size_t>(1, RowPartition::kUnit / (nb * d.s)));
      const size_t nblocks = (d.n + nb - 1) / nb, cblocks = (d.c + cb - 1) / cb;
      std::vector<float> means(d.c);
      for (size_t c = 0; c < d.c; ++c) means[c] = vec_at(mean, c);
      std::vector<double> partial(nblocks * d.c * 2, 0.0);
      auto unit = [&](size_t u) {
        const size_t sb = u / cblocks, cbk = u % cblocks;
        double* acc = &partial[sb * d.c * 2];
        const size_t n0 = sb * nb, n1 = std::min(d.n, n0 + nb);
        const size_t c0 = cbk * cb, c1 = std::min(d.c, c0 + cb);
        for (size_t n = n0; n < n1; ++n) {
          for (size_t c = c0; c < c1; ++c) {
            const size_t offset = (n * d.c + c) * d.s;
            const void* y = relu.run(offset);
            float a = 0.0f, b = 0.0f;
            for (size_t i = 0; i < d.s; ++i) {
              const float dyi = load_float(t, dy.data, offset + i);
              const float g = y != nullptr ? relu_select(dyi, load_float(t, y, i)) : dyi;
              a += g;
              b += g * (load_float(t, x.data, offset + i) - means[c]);
            }
            acc[c * 2] += a;
            acc[c * 2 + 1] += b;
          }
        }
      };
      parallel_for(ctx, nblocks * cblocks, unit, x.size);
      for (size_t sb = 0; sb < nblocks; ++sb) {
        for (size_t i = 0; i < d.c * 2; ++i) sums[i] += partial[sb * d.c * 2 + i];
      }
    }
    for (size_t c = 0; c < d.c; ++c) {
      const double sdy = sums[c * 2], sdyxmu = sums[c * 2 + 1];
      if (out[0]) store_float(u, out[0], c, static_cast<float>(sdy));
      if (out[1]) store_float(u, out[1], c, static_cast<float>(sdyxmu));
      if (out[2]) store_float(u, out[2], c, static_cast<float>(sdyxmu * static_cast<double>(vec_at(invstd, c))));
      if (out[3]) store_float(u, out[3], c, static_cast<float>(sdy));
    }
  }
};

}  // namespace

extern const OpDescriptor kBatchNormReduceBackward = {
    kOp, 6, 4, "TTUUUT", "000011", "UUUU", "1111", 'a', 2, &create_kernel<BatchNormReduceBackward>,
};

}  // namespace normgrad
