// Checks and the work partition shared by BatchNormReduceBackward and BatchNormElemtBackward.
#pragma once

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "ops.h"

namespace normgrad {

// input/grad_out viewed as [N, C, S].
struct NCS {
  size_t n = 0, c = 0, s = 0;
};

// Checks grad_out and input (present, rank 2..8, same shape and dtype, C >= 1).
inline NCS check_batch_input(const char* op, const Input& dy, const Input& x) {
  if (!x.present) fail(std::string(op) + ": input 'input' is required");
  if (!dy.present) fail(std::string(op) + ": input 'grad_out' is required");
  if (x.shape.size() < 2 || x.shape.size() > 8) {
    fail(std::string(op) + ": input 'input' must have rank 2..8; got rank " + std::to_string(x.shape.size()) +
         " (shape " + shape_str(x.shape) + ")");
  }
  if (dy.shape != x.shape) {
    fail(std::string(op) + ": input 'grad_out' must have the shape of 'input' " + shape_str(x.shape) + "; got " +
         shape_str(dy.shape));
  }
  if (dy.dtype != x.dtype) {
    fail(std::string(op) + ": input 'grad_out' must have the dtype of 'input' (" + dtype_name(x.onnx_type) +
         "); got " + dtype_name(dy.onnx_type));
  }
  NCS d;
  d.n = static_cast<size_t>(x.shape[0]);
  d.c = static_cast<size_t>(x.shape[1]);
  if (d.c == 0) fail(std::string(op) + ": input 'input' must have C = shape[1] >= 1; got shape " + shape_str(x.shape));
  d.s = 1;
  for (size_t i = 2; i < x.shape.size(); ++i) d.s *= static_cast<size_t>(x.shape[i]);  // no overflow: x.size fits
  return d;
}

// Checks a per-channel vector: present (when required), shape [C], dtype of 'mean'.
inline void check_channel_vector(const char* op, const char* name, const Input& v, size_t c, const Input* mean) {
  if (!v.present) fail(std::string(op) + ": input '" + name + "' is required");
  if (v.shape.size() != 1 || static_cast<size_t>(v.shape[0]) != c) {
    fail(std::string(op) + ": input '" + name + "' must have shape [" + std::to_string(c) +
         "] (C = input.shape[1]); got " + shape_str(v.shape));
  }
  if (mean != nullptr && v.dtype != mean->dtype) {
    fail(std::string(op) + ": input '" + name + "' must have the dtype of 'mean' (" + dtype_name(mean->onnx_type) +
         "); got " + dtype_name(v.onnx_type));
  }
}

// A fixed partition of the N·C rows (of S contiguous elements each) into units of about
// kUnit elements, independent of the thread count: `rows_per_unit` consecutive rows per
// unit, or, for long rows, `pieces` pieces per row of `piece` elements (the last shorter).
// Units are contiguous in memory, so every thread streams.
struct RowPartition {
  static constexpr size_t kUnit = 1 << 15;
  size_t rows = 0;
  size_t rows_per_unit = 1;
  size_t pieces = 1;
  size_t piece = 0;
  size_t units = 0;

  explicit RowPartition(const NCS& d) : rows(d.n * d.c) {
    if (rows == 0 || d.s == 0) return;
    if (d.s >= 2 * kUnit) {
      pieces = (d.s + kUnit - 1) / kUnit;
      piece = (d.s + pieces - 1) / pieces;
      piece = (piece + 31) / 32 * 32;
      pieces = (d.s + piece - 1) / piece;
      units = rows * pieces;
    } else {
      rows_per_unit = std::max<size_t>(1, kUnit / d.s);
      units = (rows + rows_per_unit - 1) / rows_per_unit;
      piece = d.s;
    }
  }

  // Calls fn(slot, offset, length) for each contiguous run of unit `u`; slot = row·pieces + piece.
  template <class Fn>
  void for_runs(const NCS& d, size_t u, Fn&& fn) const {
    if (pieces > 1) {
      const size_t row = u / pieces, p = u % pieces;
      const size_t begin = p * piece, end = std::min(d.s, begin + piece);
      fn(u, row * d.s + begin, end - begin);
    } else {
      const size_t r0 = u * rows_per_unit, r1 = std::min(rows, r0 + rows_per_unit);
      for (size_t row = r0; row < r1; ++row) fn(row, row * d.s, d.s);
    }
  }
};

inline const char* byte_ptr(const void* p, size_t elem, DType t) {
  return static_cast<const char*>(p) + elem * dtype_size(t);
}
inline char* byte_ptr(void* p, size_t elem, DType t) { return static_cast<char*>(p) + elem * dtype_size(t); }

// The optional input relu_output (the fused ReLU backward; see relu_select in kernels.h):
// absent, of input's shape, or a scalar (one y for every element). A scalar y > 0 masks
// nothing, so it is treated as absent; any other scalar is repeated over a run.
class ReluMask {
 public:
  // Checks `y` against `x`; `longest_run` bounds the runs the kernels are handed.
  ReluMask(const char* op, const Input& y, const Input& x, size_t longest_run) : t_(x.dtype) {
    if (!y.present) return;
    const bool scalar = y.shape.empty();
    if (!scalar && y.shape != x.shape) {
      fail(std::string(op) + ": input 'relu_output' must have the shape of 'input' " + shape_str(x.shape) +
           " or be a scalar; got " + shape_str(y.shape));
    }
    if (y.dtype != x.dtype) {
      fail(std::string(op) + ": input 'relu_output' must have the dtype of 'input' (" + dtype_name(x.onnx_type) +
           "); got " + dtype_name(y.onnx_type));
    }
    if (!scalar) {
      data_ = y.data;
      return;
    }
    if (load_float(y.dtype, y.data, 0) > 0.0f) return;
    const size_t size = dtype_size(t_);
    repeated_.resize(std::max<size_t>(longest_run, 1) * size);
    for (size_t i = 0; i < repeated_.size(); i += size) std::memcpy(&repeated_[i], y.data, size);
    data_ = repeated_.data();
  }
  // y of the run that starts at element `offset` of input; null: no mask.
  const void* run(size_t offset) const {
    if (data_ == nullptr || !repeated_.empty()) return data_;
    return byte_ptr(data_, offset, t_);
  }

 private:
  DType t_;
  const void* data_ = nullptr;
  std::vector<char> repeated_;
};

}  // namespace normgrad
