"""Gradients of ops that move elements to positions an index tensor names: dy scattered
back with ScatterElements (``reduction="add"`` sums in an order independent of the thread count)."""

from __future__ import annotations

import numpy as np
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext

__all__ = ["flat_positions", "scatter_to_positions"]


def flat_positions(ctx: GradientContext, x: str) -> str:
    """An int64 tensor shaped like ``x`` (at run time) holding each element's flat index."""
    zero = ctx.op("Constant", value=onh.from_array(np.asarray(0, np.int64)))
    one = ctx.op("Constant", value=onh.from_array(np.asarray(1, np.int64)))
    return ctx.op("Reshape", ctx.op("Range", zero, ctx.op("Size", x), one), ctx.shape_of(x))


def scatter_to_positions(ctx: GradientContext, dy: str, positions: str, x: str, reduction: str) -> str:
    """dx shaped like ``x``: each element of ``dy`` added (``reduction="add"``) or written
    (``"none"``, positions distinct) at the flat position of ``x`` that ``positions`` holds."""
    flat = ctx.ints([-1])
    zeros = ctx.op("Reshape", ctx.zeros_like(x), flat)
    scattered = ctx.op(
        "ScatterElements",
        zeros,
        ctx.op("Reshape", positions, flat),
        ctx.op("Reshape", dy, flat),
        axis=0,
        reduction=reduction,
    )
    return ctx.reshape_like(scattered, x)
