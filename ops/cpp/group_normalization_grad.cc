// GroupNormalizationGrad: dx (the true gradient), optional dgamma and dbeta.
//
// Per group (n, g), on one thread: a reduction pass for s1 = Σ γ·dy and
// s2 = Σ γ·dy·(x − μ), then the output pass dx = a·γ·dy + b·(x − μ) + d while the group
// is still in cache. gamma is never broadcast into a temporary: the group is walked as
// "runs" (the innermost merged dims of x) along which gamma is either constant or
// contiguous like x. dgamma/dbeta come from the per-run sums (gamma constant along runs
// of >= 8 elements, e.g. per-channel gamma) or, for other broadcast patterns, from a
// separate pass that owns disjoint blocks of gamma elements. Every sum has a fixed order,
// so results do not depend on the number of threads.
#include <algorithm>
#include <string>
#include <vector>

#include "ops.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "GroupNormalizationGrad";

inline const char* bptr(const void* p, size_t elem, DType t) {
  return static_cast<const char*>(p) + elem * dtype_size(t);
}
inline char* bptr(void* p, size_t elem, DType t) { return static_cast<char*>(p) + elem * dtype_size(t); }

// The walk of one group: outer dims (sizes, gamma strides) around an innermost run of
// `run` elements whose gamma stride is `run_stride` (0: constant, 1: contiguous).
struct GroupWalk {
  std::vector<size_t> outer_size, outer_gstride;
  size_t run = 1, run_stride = 0, runs = 1;

  // Calls fn(run_index, x_offset_in_group, gamma_offset_in_group) for every run, in order.
  template <class Fn>
  void for_runs(Fn&& fn) const {
    const size_t k = outer_size.size();
    size_t idx[8] = {};
    size_t goff = 0;
    for (size_t r = 0; r < runs; ++r) {
      fn(r, r * run, goff);
      for (size_t j = k; j-- > 0;) {  // odometer over the outer dims
        if (++idx[j] < outer_size[j]) {
          goff += outer_gstride[j];
          break;
        }
        goff -= outer_gstride[j] * (outer_size[j] - 1);
        idx[j] = 0;
      }
    }
  }
};

struct GroupNormalizationGrad final : KernelBase {
  NodeArgs args;
  explicit GroupNormalizationGrad(const OrtKernelInfo* info) : args(info, 5, 3) {}
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    const Input x = get_input(ctx, 0, kOp, "x");
    if (!x.present) fail(std::string(kOp) + ": input 'x' is required");
    const size_t r = x.shape.size();
    if (r < 3 || r > 8) {
      fail(std::string(kOp) + ": input 'x' must have rank 3..8; got rank " + std::to_string(r) + " (shape " +
           shape_str(x.shape) + ")");
    }
    const Input dy = get_input(ctx, 1, kOp, "dy");
    if (!dy.present) fail(std::string(kOp) + ": input 'dy' is required");
    if (dy.shape != x.shape) {
      fail(std::string(kOp) + ": input 'dy' must have the shape of 'x' " + shape_str(x.shape) + "; got " +
           shape_str(dy.shape));
    }
    if (dy.dtype != x.dtype) {
      fail(std::string(kOp) + ": input 'dy' must have the dtype of 'x' (" + dtype_name(x.onnx_type) + "); got " +
           dtype_name(dy.onnx_type));
    }
    const Input gamma = get_input(ctx, 2, kOp, "gamma");
    if (!gamma.present) fail(std::string(kOp) + ": input 'gamma' is required");
    if (gamma.dtype != x.dtype) {
      fail(std::string(kOp) + ": input 'gamma' must have the dtype of 'x' (" + dtype_name(x.onnx_type) + "); got " +
           dtype_name(gamma.onnx_type));
    }
    const size_t q = gamma.shape.size();
    if (q > r) {
      fail(std::string(kOp) + ": input 'gamma' " + shape_str(gamma.shape) + " must broadcast to the shape of 'x' " +
           shape_str(x.shape) + ": rank " + std::to_string(q) + " exceeds the rank of 'x' (" + std::to_string(r) + ")");
    }
    // gamma's stride along each dim of x (0 where gamma is broadcast).
    size_t D[8], bs[8];
    {
      size_t stride = 1;
      for (size_t i = r; i-- > 0;) {
        D[i] = static_cast<size_t>(x.shape[i]);
        bs[i] = 0;
        if (i + q >= r) {
          const size_t gd = static_cast<size_t>(gamma.shape[i + q - r]);
          if (gd != 1 && gd != D[i]) {
            fail(std::string(kOp) + ": input 'gamma' " + shape_str(gamma.shape) +
                 " must broadcast to the shape of 'x' " + shape_str(x.shape) + ": dim " + std::to_string(gd) +
                 " is neither 1 nor the matching dim " + std::to_string(D[i]) + " of 'x'");
          }
          if (gd != 1) bs[i] = stride;
          stride *= gd;
        }
      }
    }
    const size_t N = D[0], G = D[1];
    const std::vector<int64_t> ng_shape{x.shape[0], x.shape[1]};
    const Input mean = get_input(ctx, 3, kOp, "mean");
    const Input rstd = get_input(ctx, 4, kOp, "rstd");
    for (const Input* v : {&mean, &rstd}) {
      const char* nm = v == &mean ? "mean" : "rstd";
      if (!v->present) fail(std::string(kOp) + ": input '" + nm + "' is required");
      if (v->shape != ng_shape) {
        fail(std::string(kOp) + ": input '" + nm + "' must have shape " + shape_str(ng_shape) +
             " ([N, G] = x.shape[:2]); got " + shape_str(v->shape));
      }
      if (v->dtype != x.dtype && v->dtype != kF32) {
        fail(std::string(kOp) + ": input '" + nm + "' must be float32 or the dtype of 'x' (" +
             dtype_name(x.onnx_type) + "); got " + dtype_name(v->onnx_type));
      }
    }
    if (rstd.dtype != mean.dtype) {
      fail(std::string(kOp) + ": input 'rstd' must have the dtype of 'mean' (" + dtype_name(mean.onnx_type) +
           "); got " + dtype_name(rstd.onnx_type));
    }

    const DType t = x.dtype;
    void* dx = get_output(ctx, 0, x.shape);
    void* dgamma = args.output[1] ? get_output(ctx, 1, gamma.shape) : nullptr;
    void* dbeta = args.output[2] ? get_output(ctx, 2, gamma.shape) : nullptr;
    const bool want_dgb = dgamma != nullptr || dbeta != nullptr;
    const size_t M = x.size / std::max<size_t>(1, N * G);
    const size_t groups = N * G;
    if (x.size == 0) {
      for (size_t j = 0; j < gamma.size; ++j) {
        if (dgamma) store_float(t, dgamma, j, 0.0f);
        if (dbeta) store_float(t, dbeta, j, 0.0f);
      }
      return;
    }

    // The group walk: drop size-1 dims, merge dims whose gamma strides chain.
    GroupWalk walk;
    {
      std::vector<size_t> sz, st;
      for (size_t i = 2; i < r; ++i) {
        if (D[i] == 1) continue;
        if (!sz.empty() && st.back() == bs[i] * D[i]) {
          sz.back() *= D[i];
          st.back() = bs[i];
        } else {
          sz.push_back(D[i]);
          st.push_back(bs[i]);
        }
      }
      if (sz.empty()) {
        sz.push_back(1);
        st.push_back(0);
      }
      walk.run = sz.back();
      walk.run_stride = st.back();
      sz.pop_back();
      st.pop_back();
      walk.outer_size = sz;
      walk.outer_gstride = st;
      walk.runs = M / walk.run;
    }
    const bool const_runs = walk.run_stride == 0;
    const bool dgb_from_runs = want_dgb && const_runs && walk.run >= 8;
    std::vector<double> run_sums(dgb_from_runs ? groups * walk.runs * 2 : 0);

    const KernelTable& k = kernels();
    auto group_task = [&](size_t task) {
      const size_t n = task / G, g = task % G;
      const float mu = vec_at(mean, task), rs = vec_at(rstd, task);
      const size_t xbase = task * M;
      const size_t gbase = n * bs[0] + g * bs[1];
      const char* xg = bptr(x.data, xbase, t);
      const char* dyg = bptr(dy.data, xbase, t);
      char* dxg = bptr(dx, xbase, t);
      double s1 = 0.0, s2 = 0.0;  // Σ γ·dy, Σ γ·dy·(x − μ)
      if (const_runs) {
        double* rs_out = dgb_from_runs ? &run_sums[task * walk.runs * 2] : nullptr;
        walk.for_runs([&](size_t ri, size_t xo, size_t go) {
          double part[2] = {0.0, 0.0};
          k.sum_dy_dyxmu[t](dyg + xo * dtype_size(t), xg + xo * dtype_size(t), nullptr, walk.run, mu, part);
          const double gm = load_float(t, gamma.data, gbase + go);
          s1 += gm * part[0];
          s2 += gm * part[1];
          if (rs_out) {
            rs_out[ri * 2] = part[0];
            rs_out[ri * 2 + 1] = part[1];
          }
        });
      } else {
        walk.for_runs([&](size_t, size_t xo, size_t go) {
          double part[2] = {0.0, 0.0};
          k.sum_gdy_gdyxmu[t](dyg + xo * dtype_size(t), xg + xo * dtype_size(t), bptr(gamma.data, gbase + go, t),
                              walk.run, mu, part);
          s1 += part[0];
          s2 += part[1];
        });
      }
      const double rsd = rs, inv_m = 1.0 / static_cast<double>(M);
      const float a = rs;
      const float b = static_cast<float>(-rsd * rsd * rsd * s2 * inv_m);
      const float d = static_cast<float>(-rsd * s1 * inv_m);
      if (const_runs) {
        walk.for_runs([&](size_t, size_t xo, size_t go) {
          const float ag = a * load_float(t, gamma.data, gbase + go);
          k.affine[t](dyg + xo * dtype_size(t), xg + xo * dtype_size(t), nullptr, dxg + xo * dtype_size(t), walk.run, mu, ag, b,
                      d);
        });
      } else {
        walk.for_runs([&](size_t, size_t xo, size_t go) {
          k.affine_g[t](dyg + xo * dtype_size(t), xg + xo * dtype_size(t), bptr(gamma.data, gbase + go, t),
                        dxg + xo * dtype_size(t), walk.run, mu, a, b, d);
        });
      }
    };
    parallel_for(ctx, groups, group_task, x.size);
    if (!want_dgb) return;

    if (dgb_from_runs) {
      // Fixed order: groups, then runs; one thread (N·G·runs additions).
      std::vector<double> dg(gamma.size, 0.0), db(gamma.size, 0.0);
      for (size_t task = 0; task < groups; ++task) {
        const size_t gbase = (task / G) * bs[0] + (task % G) * bs[1];
        const double rs = vec_at(rstd, task);
        const double* sums = &run_sums[task * walk.runs * 2];
        walk.for_runs([&](size_t ri, size_t, size_t go) {
          db[gbase + go] += sums[ri * 2];
          dg[gbase + go] += sums[ri * 2 + 1] * rs;
        });
      }
      for (size_t j = 0; j < gamma.size; ++j) {
        if (dgamma) store_float(t, dgamma, j, static_cast<float>(dg[j]));
        if (dbeta) store_float(t, dbeta, j, static_cast<float>(db[j]));
      }
      return;
    }

    // General broadcast: each task owns a block of gamma elements and walks, for each,
    // the x positions that map to it (the dims where gamma is broadcast) in a fixed order.
    size_t xs[8];
    {
      size_t s = 1;
      for (size_t i = r; i-- > 0;) {
        xs[i] = s;
        s *= D[i];
      }
    }
    std::vector<size_t> red_dims, keep_dims;
    for (size_t i = 0; i < r; ++i) {
      if (D[i] == 1) continue;
      (bs[i] == 0 ? red_dims : keep_dims).push_back(i);
    }
    const size_t gm_n = gamma.size;
    constexpr size_t kBlock = 256;
    const size_t blocks = (gm_n + kBlock - 1) / kBlock;
    // gamma's own shape, aligned to x: the coordinate along dim i of gamma element j.
    auto block_task = [&](size_t blk) {
      const size_t j0 = blk * kBlock, j1 = std::min(gm_n, j0 + kBlock);
      for (size_t j = j0; j < j1; ++j) {
        // Decompose j into coordinates along x's kept dims (gamma's row-major order).
        size_t base = 0, rem = j;
        for (size_t kk = keep_dims.size(); kk-- > 0;) {
          const size_t i = keep_dims[kk];
          const size_t coord = rem % D[i];
          rem /= D[i];
          base += coord * xs[i];
        }
        double sg = 0.0, sb = 0.0;
        size_t idx[8] = {};
        size_t off = base;
        while (true) {
          const size_t grp = off / M;
          const float mu = vec_at(mean, grp), rs = vec_at(rstd, grp);
          const float dv = load_float(t, dy.data, off);
          sb += dv;
          sg += static_cast<double>(dv) * static_cast<double>((load_float(t, x.data, off) - mu) * rs);
          size_t kk = red_dims.size();
          while (kk-- > 0) {
            const size_t i = red_dims[kk];
            if (++idx[kk] < D[i]) {
              off += xs[i];
              break;
            }
            off -= xs[i] * (D[i] - 1);
            idx[kk] = 0;
          }
          if (kk == static_cast<size_t>(-1)) break;
        }
        if (dgamma) store_float(t, dgamma, j, static_cast<float>(sg));
        if (dbeta) store_float(t, dbeta, j, static_cast<float>(sb));
      }
    };
    parallel_for(ctx, blocks, block_task, x.size);
  }
};

}  // namespace

extern const OpDescriptor kGroupNormalizationGrad = {
    kOp, 5, 3, "TTTUU", "00000", "TTT", "011", 'f', 0, &create_kernel<GroupNormalizationGrad>,
};

}  // namespace normgrad
