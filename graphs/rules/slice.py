"""Slice, Split and Tile: ops that pick or repeat pieces of their input.

Slice: the flat index of every input element is sliced like the input, and dy is
scattered to those indices (no index repeats, so any order gives the same sum); this
covers negative and oversized starts/ends, negative steps, omitted axes and values only
known at run time with one form. Split: the output gradients concatenated back (zeros
for outputs without one). Tile: dy viewed as [r0, d0, r1, d1, ...] summed over the r axes.
"""

from __future__ import annotations

from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules import register
from normgrad.graphs.rules._scatter import flat_positions, scatter_to_positions

__all__ = ["slice_gradient", "split_gradient", "tile_gradient"]


@register("Slice", min_opset=16)
def slice_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dy scattered to the flat positions the same Slice picks from an index tensor."""
    x = node.input[0]
    picked = ctx.op("Slice", flat_positions(ctx, x), *node.input[1:])
    return [scatter_to_positions(ctx, grads[0], picked, x, "none")]


@register("Split")
def split_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Concat of the output gradients along ``axis``; an output without one contributes zeros."""
    axis = attr(node, "axis", 0)
    pieces = [grad if grad else ctx.zeros_like(output) for output, grad in zip(node.output, grads)]
    return [ctx.op("Concat", *pieces, axis=axis) if len(pieces) > 1 else pieces[0]]


@register("Tile")
def tile_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dy reshaped to [r0, d0, r1, d1, ...] (r: repeats, d: input dims), summed over the r axes."""
    x, repeats = node.input[0], node.input[1]
    rank = ctx.rank(x, node)
    column = ctx.ints([-1, 1])
    pairs = ctx.op("Concat", ctx.op("Reshape", repeats, column), ctx.op("Reshape", ctx.shape_of(x), column), axis=1)
    tiled = ctx.op("Reshape", grads[0], ctx.op("Reshape", pairs, ctx.ints([-1])))
    return [ctx.reduce("ReduceSum", tiled, list(range(0, 2 * rank, 2)), keepdims=False)]
