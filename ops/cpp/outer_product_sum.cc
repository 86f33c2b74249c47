// OuterProductSum (ops/outer_product_sum.py): y [M, N] = a^T b for a [T, M], b [T, N], the
// weight gradient of a product summed over its rows, without a transposed GEMM operand. b is
// packed into column panels [depth][tile columns] and a into row panels [depth][tile rows], a
// depth block at a time, and the register tile runs over both; groups of column panels go to
// the intra-op threads, or, when y is too large to stay in cache between depth blocks, row
// blocks of y, over b packed at its whole depth (outer_product_sum.h: the same bits on every
// path and at any thread count).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ops.h"
#include "outer_product_sum.h"
#include "outer_product_sum_tile.h"

namespace normgrad {
namespace {

constexpr const char* kOp = "OuterProductSum";
constexpr size_t kDepthBlock = 128;     // rows of a and b per pass over a tile of y
constexpr size_t kRowBlockTiles = 40;   // tile rows per row block of y: its a panels stay in L2
constexpr size_t kColumnBlock = 2048;   // columns of y per pass (a multiple of every tile's columns)
constexpr size_t kPanelsPerTask = 2;    // column panels per task where the threads share a row block
constexpr size_t kCachedOutputFloats = 1 << 19;  // y up to 2 MiB stays in cache between depth blocks
constexpr size_t kWholeDepthFloats = 1 << 18;    // b's packed columns up to 1 MiB: all of its depth at once

// The portable tile: std::fma, one rounding per step as the vector tiles.
struct Scalar {
  using Vector = float;
  static constexpr size_t kWidth = 1;
  static float zero() { return 0.0f; }
  static float load(const float* p) { return *p; }
  static float broadcast(const float* p) { return *p; }
  static float fma(float a, float b, float c) { return std::fma(a, b, c); }
  static void store(float* p, float v) { *p = v; }
};
const OuterTile kOuterTilePortable = {4, 8, &outer_tile<Scalar, 4, 8>};

const OuterTile& choose_tile() {
#if defined(__x86_64__) || defined(__i386__)
  const char* force = std::getenv("NORMGRAD_KERNELS");
  if (force != nullptr && std::strcmp(force, "generic") == 0) return kOuterTilePortable;
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool no_avx512 = force != nullptr && std::strcmp(force, "avx2") == 0;
  if (avx2 && !no_avx512 && __builtin_cpu_supports("avx512f")) return kOuterTileAvx512;
  if (avx2) return kOuterTileAvx2;
#endif
  return kOuterTilePortable;
}

const OuterTile& tile() {
  static const OuterTile& chosen = choose_tile();
  return chosen;
}

// Rows [k0, k0 + depth) of x [*, ld]'s columns [c0, c0 + count) as panels [depth][width],
// zero past the count: a's row panels (width the tile's rows) and b's column panels (its columns).
void pack_panels(const float* x, size_t ld, size_t k0, size_t depth, size_t c0, size_t count, size_t width,
                 float* packed) {
  const size_t panels = (count + width - 1) / width;
  for (size_t k = 0; k < depth; ++k) {
    const float* row = x + (k0 + k) * ld + c0;
    for (size_t p = 0; p < panels; ++p) {
      const size_t taken = std::min(width, count - p * width);
      float* to = packed + (p * depth + k) * width;
      std::memcpy(to, row + p * width, taken * sizeof(float));
      if (taken < width) std::memset(to + taken, 0, (width - taken) * sizeof(float));
    }
  }
}

// One depth block of y's rows [r0, r1) and columns j0 + [c0, c1): the tile over a's row panels
// (packed_a) and b's column panels (panel c / columns at packed_b + c / columns * panel_stride).
// first: the depth block is the first (y starts from +0).
void tiles(const OuterTile& tile, const float* packed_a, const float* packed_b, size_t panel_stride, float* y,
           size_t n, size_t depth, bool first, size_t j0, size_t c0, size_t c1, size_t r0, size_t r1) {
  const size_t rows = tile.rows, columns = tile.columns, height = r1 - r0;
  const size_t panels = (height + rows - 1) / rows;
  float edge[16 * 32] = {};  // a tile at y's edges (rows x columns <= 16 x 32)
  for (size_t c = c0; c < c1; c += columns) {
    const float* b_panel = packed_b + (c / columns) * panel_stride;
    const size_t width = std::min(columns, c1 - c);
    for (size_t p = 0; p < panels; ++p) {
      const float* a_panel = packed_a + p * depth * rows;
      const size_t count = std::min(rows, height - p * rows);
      float* target = y + (r0 + p * rows) * n + j0 + c;
      if (count == rows && width == columns) {
        tile.micro(depth, a_panel, b_panel, target, n, first);
        continue;
      }
      for (size_t i = 0; i < count && !first; ++i) {
        std::memcpy(edge + i * columns, target + i * n, width * sizeof(float));
      }
      tile.micro(depth, a_panel, b_panel, edge, columns, first);
      for (size_t i = 0; i < count; ++i) std::memcpy(target + i * n, edge + i * columns, width * sizeof(float));
    }
  }
}

// float64: each y element the same chain of fused multiply-adds over t, row by row.
void sum_double(const double* a, const double* b, double* y, size_t t, size_t m, size_t n) {
  std::fill(y, y + m * n, 0.0);
  for (size_t k = 0; k < t; ++k) {
    for (size_t i = 0; i < m; ++i) {
      const double scale = a[k * m + i];
      for (size_t j = 0; j < n; ++j) y[i * n + j] = std::fma(scale, b[k * n + j], y[i * n + j]);
    }
  }
}

struct OuterProductSum final : KernelBase {
  explicit OuterProductSum(const OrtKernelInfo*) {}
  const char* name() const override { return kOp; }

  void compute(OrtKernelContext* ctx) override {
    const Input a = get_input_any_type(ctx, 0, kOp, "a");
    const Input b = get_input_any_type(ctx, 1, kOp, "b");
    for (const Input* x : {&a, &b}) {
      const char* which = x == &a ? "a" : "b";
      if (x->onnx_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && x->onnx_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE) {
        fail(std::string(kOp) + ": input '" + which + "' must be float32 or float64; got " + dtype_name(x->onnx_type));
      }
      if (x->shape.size() != 2) {
        fail(std::string(kOp) + ": input '" + which + "' must have rank 2 (" + (x == &a ? "[T, M]" : "[T, N]") +
             "); got shape " + shape_str(x->shape));
      }
    }
    if (b.onnx_type != a.onnx_type) {
      fail(std::string(kOp) + ": input 'b' must have a's type " + dtype_name(a.onnx_type) + "; got " +
           dtype_name(b.onnx_type));
    }
    if (a.shape[0] != b.shape[0]) {
      fail(std::string(kOp) + ": inputs 'a' [T, M] and 'b' [T, N] must have the same number of rows T; got shapes " +
           shape_str(a.shape) + " and " + shape_str(b.shape));
    }
    const size_t t = static_cast<size_t>(a.shape[0]), m = static_cast<size_t>(a.shape[1]),
                 n = static_cast<size_t>(b.shape[1]);
    void* out = get_output(ctx, 0, {a.shape[1], b.shape[1]});
    if (m == 0 || n == 0) return;
    if (a.onnx_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE) {  // float64 graphs (gradient checks): plain loops
      sum_double(static_cast<const double*>(a.data), static_cast<const double*>(b.data), static_cast<double*>(out),
                 t, m, n);
      return;
    }
    float* y = static_cast<float*>(out);
    const OuterTile& chosen = tile();
    const float* a_data = static_cast<const float*>(a.data);
    const float* b_data = static_cast<const float*>(b.data);
    if (t == 0) std::fill(y, y + m * n, 0.0f);
    const size_t block = kRowBlockTiles * chosen.rows, blocks = (m + block - 1) / block;
    thread_local std::vector<float> packed_a, packed_b;  // kept between calls: no fresh pages per step
    for (size_t j0 = 0; j0 < n; j0 += kColumnBlock) {
      const size_t width = std::min(kColumnBlock, n - j0);
      const size_t padded = (width + chosen.columns - 1) / chosen.columns * chosen.columns;
      const size_t work = checked_mul(checked_mul(m, width, kOp, "y"), std::max<size_t>(t, 1), kOp, "a^T b");
      const bool whole_depth = checked_mul(m, padded, kOp, "y") > kCachedOutputFloats &&
                               checked_mul(padded, t, kOp, "packed b") <= kWholeDepthFloats;
      if (whole_depth) {
        // y too large to stay in cache over the depth blocks, b's columns small: b packed at its
        // whole depth, a row block of y per thread, in cache over all of it
        packed_b.resize(padded * t);
        pack_panels(b_data, n, 0, t, j0, width, chosen.columns, packed_b.data());
        const float* b_packed = packed_b.data();
        auto run = [&](size_t index) {
          const size_t r0 = index * block, r1 = std::min(m, r0 + block);
          thread_local std::vector<float> rows_a;
          rows_a.resize(block * kDepthBlock);
          for (size_t k0 = 0; k0 < t; k0 += kDepthBlock) {
            const size_t depth = std::min(kDepthBlock, t - k0);
            pack_panels(a_data, m, k0, depth, r0, r1 - r0, chosen.rows, rows_a.data());
            tiles(chosen, rows_a.data(), b_packed + k0 * chosen.columns, t * chosen.columns, y, n, depth, k0 == 0,
                  j0, 0, width, r0, r1);
          }
        };
        parallel_for(ctx, blocks, run, work);
        continue;
      }
      // else b's columns a depth block at a time, y's row blocks in turn, groups of column
      // panels to the threads
      const size_t group = kPanelsPerTask * chosen.columns, groups = (width + group - 1) / group;
      packed_a.resize(block * kDepthBlock);
      for (size_t k0 = 0; k0 < t; k0 += kDepthBlock) {
        const size_t depth = std::min(kDepthBlock, t - k0);
        packed_b.resize(padded * depth);
        pack_panels(b_data, n, k0, depth, j0, width, chosen.columns, packed_b.data());
        for (size_t r0 = 0; r0 < m; r0 += block) {
          const size_t r1 = std::min(m, r0 + block);
          pack_panels(a_data, m, k0, depth, r0, r1 - r0, chosen.rows, packed_a.data());
          const float *a_packed = packed_a.data(), *b_packed = packed_b.data();
          auto run = [&](size_t index) {
            const size_t c0 = index * group;
            tiles(chosen, a_packed, b_packed, depth * chosen.columns, y, n, depth, k0 == 0, j0, c0,
                  std::min(width, c0 + group), r0, r1);
          };
          parallel_for(ctx, groups, run, (r1 - r0) * width * depth);
        }
      }
    }
  }
};

}  // namespace

extern const OpDescriptor kOuterProductSum = {
    kOp, 2, 1, "TT", "00", "T", "0", 'd', 0, &create_kernel<OuterProductSum>,
};

}  // namespace normgrad
