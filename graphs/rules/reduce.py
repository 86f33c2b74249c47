"""Reductions: dy broadcast back over the reduced axes, times the local derivative.

ReduceSum, ReduceMean, ReduceSumSquare, ReduceL2, ReduceLogSumExp, ReduceMax and ReduceMin
(the gradient split equally between the elements tying for the extreme, as torch's
amax/amin), and GlobalAveragePool.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import numpy as np
import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules.registry import register

__all__ = ["reduce_gradient", "global_average_pool_gradient"]


def _mean_scale(ctx: GradientContext, value: str, x: str, y: str) -> str:
    """``value`` times size(y) / size(x): the reciprocal of the number of averaged elements."""
    size_x = ctx.op("CastLike", ctx.op("Size", x), x)
    size_y = ctx.op("CastLike", ctx.op("Size", y), x)
    return ctx.op("Div", ctx.op("Mul", value, size_y), size_x)


@dataclasses.dataclass
class _Reduction:
    """The axes a Reduce* node reduces: ``axes`` (an int64 value name) or all of them."""

    node: onnx.NodeProto
    axes: Optional[str]  # None: every axis
    identity: bool  # empty axes with noop_with_empty_axes: nothing is reduced
    keepdims: bool

    @classmethod
    def of(cls, ctx: GradientContext, node: onnx.NodeProto) -> "_Reduction":
        """``axes`` may be an attribute or an input (constant or computed at run time)."""
        axes_input = node.input[1] if len(node.input) > 1 and node.input[1] else None
        axes_attr = attr(node, "axes", None)
        constant_axes = ctx.constant(axes_input) if axes_input else axes_attr
        no_axes = axes_input is None and not axes_attr or (constant_axes is not None and np.size(constant_axes) == 0)
        axes = None
        if not no_axes:
            axes = axes_input if constant_axes is None else ctx.ints(np.asarray(constant_axes).reshape(-1))
        return cls(node, axes, no_axes and bool(attr(node, "noop_with_empty_axes", 0)), bool(attr(node, "keepdims", 1)))

    def back(self, ctx: GradientContext, value: str) -> str:
        """``value`` (shaped like the node's output) broadcast to the input's shape."""
        if self.identity:
            return value
        if not self.keepdims and self.axes is not None:
            value = ctx.op("Unsqueeze", value, self.axes)
        return ctx.op("Expand", value, ctx.shape_of(self.node.input[0]))

    def sum_back(self, ctx: GradientContext, value: str) -> str:
        """``value`` (shaped like the input) summed over the reduced axes, broadcast back."""
        if self.identity:
            return value
        summed = ctx.op("ReduceSum", value, self.axes, keepdims=1)
        return ctx.op("Expand", summed, ctx.shape_of(self.node.input[0]))


@register("ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp", "ReduceMax", "ReduceMin")
def reduce_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dy broadcast back (``back``), then per op: Sum: back(dy); Mean: / group size;
    SumSquare: 2 x back(dy); L2: x back(dy / y) (0 where y = 0, as torch); LogSumExp:
    back(dy) exp(x - back(y)); Max/Min: back(dy) [x = back(y)] / (number of such x in the group).
    """
    x, y, dy = node.input[0], node.output[0], grads[0]
    reduction = _Reduction.of(ctx, node)
    op = node.op_type
    if reduction.identity and op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceLogSumExp"):
        return [dy]
    if op == "ReduceL2":
        zero = ctx.scalar(0.0, x)
        dy = ctx.op("Where", ctx.op("Equal", y, zero), zero, ctx.op("Div", dy, y))
    if op == "ReduceMean":  # scaled before the broadcast: the same products, on fewer elements
        dy = _mean_scale(ctx, dy, x, y)
    dx = reduction.back(ctx, dy)
    if op == "ReduceSumSquare":
        dx = ctx.op("Mul", dx, ctx.op("Add", x, x))
    elif op == "ReduceL2":
        dx = ctx.op("Mul", dx, x)
    elif op == "ReduceLogSumExp":
        dx = ctx.op("Mul", dx, ctx.op("Exp", ctx.op("Sub", x, reduction.back(ctx, y))))
    elif op in ("ReduceMax", "ReduceMin"):
        ties = ctx.op("Equal", x, reduction.back(ctx, y))
        count = reduction.sum_back(ctx, ctx.op("CastLike", ties, x))
        dx = ctx.op("Where", ties, ctx.op("Div", dx, count), ctx.scalar(0.0, x))
    return [dx]


@register("GlobalAveragePool")
def global_average_pool_gradient(
    ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]
) -> List[Optional[str]]:
    """dy divided by the product of the spatial dims, expanded over them."""
    x, y = node.input[0], node.output[0]
    return [ctx.op("Expand", _mean_scale(ctx, grads[0], x, y), ctx.shape_of(x))]
