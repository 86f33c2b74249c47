// BatchNormElemtBackward: dx = (dy − sum_dy/M − (x − mean)·invstd²·sum_dy_xmu/M)·invstd·weight,
// one fused pass: per channel dx = a·g + b·(x − mean) + d with coefficients in float64, where
// g is dy, or with the optional relu_output y the ReLU-masked dy (relu_select, on the fly).
#include <vector>

#include "batch_norm_common.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "BatchNormElemtBackward";

struct BatchNormElemtBackward final : KernelBase {
  explicit BatchNormElemtBackward(const OrtKernelInfo*) {}
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    const Input dy = get_input(ctx, 0, kOp, "grad_out");
    const Input x = get_input(ctx, 1, kOp, "input");
    const NCS d = check_batch_input(kOp, dy, x);
    const char* names[5] = {"mean", "invstd", "weight", "sum_dy", "sum_dy_xmu"};
    Input v[5];
    for (int i = 0; i < 5; ++i) {
      v[i] = get_input(ctx, 2 + i, kOp, names[i]);
      check_channel_vector(kOp, names[i], v[i], d.c, i ? &v[0] : nullptr);
    }
    const RowPartition part(d);
    const ReluMask relu(kOp, get_input(ctx, 7, kOp, "relu_output"), x, part.pieces > 1 ? part.piece : d.s);
    void* out = get_output(ctx, 0, x.shape);
    if (part.units == 0) return;
    const DType t = x.dtype;
    const double count = static_cast<double>(d.n) * static_cast<double>(d.s);
    struct Coef {
      float mean, a, b, d;
    };
    std::vector<Coef> coef(d.c);
    for (size_t c = 0; c < d.c; ++c) {
      const double invstd = vec_at(v[1], c), w = vec_at(v[2], c);
      const double sdy = vec_at(v[3], c), sdyxmu = vec_at(v[4], c);
      const double k = invstd * w;
      coef[c] = Coef{vec_at(v[0], c), static_cast<float>(k), static_cast<float>(-k * invstd * invstd * sdyxmu / count),
                     static_cast<float>(-k * sdy / count)};
    }
    const KernelTable& k = kernels();
    auto unit = [&](size_t u) {
      part.for_runs(d, u, [&](size_t, size_t offset, size_t len) {
        const Coef& q = coef[(offset / d.s) % d.c];
        k.affine[t](byte_ptr(dy.data, offset, t), byte_ptr(x.data, offset, t), relu.run(offset), byte_ptr(out, offset, t),
                    len, q.mean, q.a, q.b, q.d);
      });
    };
    parallel_for(ctx, part.units, unit, x.size);
  }
};

}  // namespace

extern const OpDescriptor kBatchNormElemtBackward = {
    kOp, 8, 1, "TTUUUUUT", "00000001", "T", "0", 'a', 1, &create_kernel<BatchNormElemtBackward>,
};

}  // namespace normgrad
