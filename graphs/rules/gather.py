"""Gather and GatherElements: the gradient is a scatter-add of dy into zeros of the data's shape.

Indices may be negative (normalized first) and repeat (repeats accumulate: ``reduction="add"``,
opset 16, in an order independent of the thread count); Gather's indices may be scalars.
The indices get no gradient.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules import register

__all__ = ["gather_gradient", "gather_elements_gradient"]


def _non_negative(ctx: GradientContext, indices: str, data: str, axis: int) -> str:
    """``indices`` as int64 with negative entries counted from the end of ``data``'s ``axis``."""
    indices = ctx.op("Cast", indices, to=onnx.TensorProto.INT64)
    size = ctx.op("Reshape", ctx.shape_of(data, start=axis, end=axis + 1), ctx.ints([]))  # a scalar
    zero = ctx.op("Constant", value=onnx.numpy_helper.from_array(np.asarray(0, np.int64)))
    return ctx.op("Where", ctx.op("Less", indices, zero), ctx.op("Add", indices, size), indices)


def _zeros(ctx: GradientContext, like: str, shape: str) -> str:
    return ctx.op("Expand", ctx.scalar(0.0, like), shape)


@register("Gather", min_opset=16)
def gather_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """ScatterElements(zeros, indices, dy, axis, reduction="add") with the indices flattened.

    dy has the data's axes before ``axis``, then the indices' axes, then the data's axes
    after ``axis``; it is reshaped to one axis for all index axes, and the flat indices are
    broadcast to its shape. (ScatterND would do without the broadcast, but onnxruntime's
    ScatterND sums repeated indices in an order that depends on the thread count.)
    """
    data, dy = node.input[0], grads[0]
    rank = ctx.rank(data, node)
    axis = attr(node, "axis", 0) % rank
    flat = ctx.op("Reshape", _non_negative(ctx, node.input[1], data, axis), ctx.ints([-1]))
    dy_shape = ctx.op("Concat", ctx.shape_of(data, end=axis), ctx.ints([-1]), ctx.shape_of(data, start=axis + 1), axis=0)
    dy = ctx.op("Reshape", dy, dy_shape)
    along_axis = [1] * axis + [-1] + [1] * (rank - axis - 1)
    indices = ctx.op("Expand", ctx.op("Reshape", flat, ctx.ints(along_axis)), ctx.shape_of(dy))
    zeros = _zeros(ctx, data, ctx.shape_of(data))
    return [ctx.op("ScatterElements", zeros, indices, dy, axis=axis, reduction="add")]


@register("GatherElements", min_opset=16)
def gather_elements_gradient(
    ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]
) -> List[Optional[str]]:
    """ScatterElements(zeros, indices, dy, axis, reduction="add")."""
    data, indices, dy = node.input[0], node.input[1], grads[0]
    axis = attr(node, "axis", 0) % ctx.rank(data, node)
    indices = _non_negative(ctx, indices, data, axis)
    zeros = _zeros(ctx, data, ctx.shape_of(data))
    return [ctx.op("ScatterElements", zeros, indices, dy, axis=axis, reduction="add")]
