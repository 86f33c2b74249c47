// OuterProductSum (ops/outer_product_sum.py): y [m, n] = sum over t of a[t, :]^T b[t, :].
//
// Every path computes each y element as the same chain of fused multiply-adds over t in order,
// starting from +0 (a partial sum stored in y between depth blocks and loaded back is exact):
// the bits do not depend on the blocking, the thread count or the instruction set.
#pragma once

#include <cstddef>

namespace normgrad {

// The register tile of one instruction set: rows x columns of y kept in registers while the
// depth runs; micro(depth, a_panel [depth][rows], b_panel [depth][columns], y, ldy, first)
// adds the panels' product to the tile at y (or starts from +0 when first).
struct OuterTile {
  size_t rows, columns;
  void (*micro)(size_t depth, const float* a_panel, const float* b_panel, float* y, size_t ldy, bool first);
};

// The AVX-512 tile (outer_product_sum_avx512.cc) and the AVX2 tile (outer_product_sum_avx2.cc),
// both FMA; run only where the CPU has them.
extern const OuterTile kOuterTileAvx512;
extern const OuterTile kOuterTileAvx2;

}  // namespace normgrad
