// MaxPoolGrad (ops/max_pool_grad.py): the argmax of one output row's windows, shared by the
// portable loop (max_pool_grad.cc) and the AVX2 one (max_pool_grad_avx2.cc). Both take the
// first maximum in row-major window order, a NaN counting as the maximum: the same choice, so
// the same bits on every path.
#pragma once

#include <cstddef>
#include <cstdint>

namespace normgrad {

// One output row's windows, all of whose taps lie inside the input: tap (a, b) of output
// column ow reads x[first_row + a dh][ow sw + first_column + b dw], for a < kh, b < kw.
struct PoolRow {
  const float* x;  // the plane
  size_t w;        // its width
  size_t first_row, kh, dh, kw, dw, sw;
  int64_t first_column;  // of output column 0 (may be negative: only interior columns are asked)
};

// best[i] = the flat plane index of the first maximum of output column ow0 + i, for i below
// the count returned: all `count` from 8 on, else none (the caller does the rest).
// Needs every index below 2^31 (the caller checks).
size_t max_pool_row_argmax_avx2(const PoolRow& row, size_t ow0, size_t count, int64_t* best);

}  // namespace normgrad
