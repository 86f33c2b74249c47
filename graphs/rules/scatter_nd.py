"""ScatterND: gradients to the data and the updates for every reduction (none, add, mul, max, min).

A ScatterND whose indices are k-tuples is a ScatterElements along axis 0 of the data viewed as
[d0 * ... * d(k-1), rest...], with each tuple's flat row number (read from a table of row
numbers by GatherND, which takes negative indices as ScatterND does) broadcast over the rest:
its gradients are that ScatterElements's (:mod:`normgrad.graphs.rules.scatter_elements`:
repeated positions summed in index order, whatever the thread count; with reduction ``none``
the last update written to a position is the one the forward kept, in onnxruntime at any
thread count as in ONNX's reference), reshaped back. (Not ScatterND itself: onnxruntime's
ScatterND sums repeated indices in an order that depends on the thread count.)
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.graphs.rules import UnsupportedOperatorError, register
from normgrad.graphs.rules.scatter_elements import Scatter, distinct_keys, reads, scatter_gradients

__all__ = ["scatter_nd_gradient"]


def _constant_distinct(ctx: GradientContext, indices: str, data: str, k: int) -> bool:
    """Whether ``indices`` is constant and no two of its k-tuples name the same row of ``data``."""
    value, shape = ctx.constant(indices), ctx.shape(data)
    if value is None or shape is None:
        return False
    keys = value.astype(np.int64).reshape(-1, k)
    if np.any(keys < 0):
        dims = shape[:k]
        if not all(isinstance(d, int) for d in dims):
            return False
        keys = keys % np.asarray(dims, np.int64)
    return distinct_keys(keys)


@register("ScatterND", inputs=(0, 2), min_opset=18)
def scatter_nd_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """The gradients of the equivalent ScatterElements over the data's rows (module docstring)."""
    data, indices, updates = node.input[:3]
    index_shape = ctx.shape(indices)
    if index_shape is None or not isinstance(index_shape[-1], int) or index_shape[-1] < 1:
        raise UnsupportedOperatorError(
            f"{describe(node)}: ScatterND needs a static, positive last dim of its indices for the gradient")
    reduction, wants_updates = attr(node, "reduction", "none"), ctx.needs_grad(updates)
    if reduction == "add" and not wants_updates:
        return [grads[0], None, None]
    k, rank = index_shape[-1], ctx.rank(data, node)
    leading = ctx.shape_of(data, end=k)
    count = ctx.op("ReduceProd", leading, keepdims=0)
    zero, one = (ctx.op("Constant", value=onnx.numpy_helper.from_array(np.asarray(v, np.int64))) for v in (0, 1))
    row_numbers = ctx.op("Reshape", ctx.op("Range", zero, count, one), leading)
    rows_shape = ctx.op("Concat", ctx.ints([-1]), ctx.shape_of(data, start=k), axis=0)
    as_rows = ctx.op("Reshape", updates, rows_shape)
    flat = ctx.op("Reshape", ctx.op("GatherND", row_numbers, indices), ctx.ints([-1] + [1] * (rank - k)))
    distinct = reduction == "none" and _constant_distinct(ctx, indices, data, k)
    reads_data, reads_output = reads(reduction, distinct, wants_updates)
    scatter = Scatter(
        data=ctx.op("Reshape", data, rows_shape) if reads_data else "",
        indices=ctx.op("Expand", flat, ctx.shape_of(as_rows)), updates=as_rows,
        output=ctx.op("Reshape", node.output[0], rows_shape) if reads_output else "", axis=0, reduction=reduction,
        like=data, distinct=distinct, wants_data=ctx.needs_grad(data), wants_updates=wants_updates)
    d_data, d_updates = scatter_gradients(ctx, node, scatter, ctx.op("Reshape", grads[0], rows_shape))
    return [None if d_data is None else ctx.reshape_like(d_data, data), None,
            None if d_updates is None else ctx.reshape_like(d_updates, updates)]
