"""ReduceSum, ReduceMean and GlobalAveragePool: dy broadcast back over the reduced axes."""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules import register

__all__ = ["reduce_gradient", "global_average_pool_gradient"]


def _mean_scale(ctx: GradientContext, value: str, x: str, y: str) -> str:
    """``value`` times size(y) / size(x): the reciprocal of the number of averaged elements."""
    size_x = ctx.op("CastLike", ctx.op("Size", x), x)
    size_y = ctx.op("CastLike", ctx.op("Size", y), x)
    return ctx.op("Div", ctx.op("Mul", value, size_y), size_x)


@register("ReduceSum", "ReduceMean")
def reduce_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Expand(Unsqueeze(dy, axes), shape(x)), divided by the group size for ReduceMean.

    ``axes`` may be an attribute or an input (constant or computed at run time).
    """
    x, y, dy = node.input[0], node.output[0], grads[0]
    axes_input = node.input[1] if len(node.input) > 1 and node.input[1] else None
    axes_attr = attr(node, "axes", None)
    keepdims = attr(node, "keepdims", 1)
    noop = attr(node, "noop_with_empty_axes", 0)
    constant_axes = ctx.constant(axes_input) if axes_input else axes_attr
    no_axes = axes_input is None and not axes_attr or (constant_axes is not None and np.size(constant_axes) == 0)
    if no_axes and noop:
        return [dy]
    if not keepdims and not no_axes:
        axes = axes_input if constant_axes is None else ctx.ints(np.asarray(constant_axes).reshape(-1))
        dy = ctx.op("Unsqueeze", dy, axes)
    dx = ctx.op("Expand", dy, ctx.shape_of(x))
    if node.op_type == "ReduceMean":
        dx = _mean_scale(ctx, dx, x, y)
    return [dx]


@register("GlobalAveragePool")
def global_average_pool_gradient(
    ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]
) -> List[Optional[str]]:
    """dy expanded over the spatial dims, divided by their product."""
    x, y = node.input[0], node.output[0]
    return [_mean_scale(ctx, ctx.op("Expand", grads[0], ctx.shape_of(x)), x, y)]
