"""Slice, Split and Tile: ops that pick or repeat pieces of their input.

Slice with unit steps: dy zero-padded back, by the starts and ends clamped as Slice clamps
them (computed in the graph, so they may be known only at run time). Other steps: the flat
index of every input element is sliced like the input, and dy is scattered to those
indices (no index repeats, so any order gives the same sum; but onnxruntime's
ScatterElements is some hundred times slower than a Pad). Split: the output gradients concatenated back (zeros
for outputs without one). Tile: dy viewed as [r0, d0, r1, d1, ...] summed over the r axes.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules.registry import register
from normgrad.graphs.rules._scatter import flat_positions, scatter_to_positions

__all__ = ["slice_gradient", "split_gradient", "tile_gradient"]


def _unit_step_axes(ctx: GradientContext, node: onnx.NodeProto) -> Optional[List[int]]:
    """The (non-negative) axes of a Slice whose steps are all 1 and whose axes are constant; else None."""
    inputs = list(node.input) + [""] * (5 - len(node.input))
    steps = ctx.constant(inputs[4]) if inputs[4] else np.ones(1, np.int64)
    if steps is None or np.any(steps != 1):
        return None
    rank = ctx.rank(node.input[0], node)
    if inputs[3]:
        axes = ctx.constant(inputs[3])
        return None if axes is None else [int(a) % rank for a in np.reshape(axes, -1)]
    starts = ctx.shape(inputs[1])
    return list(range(starts[0])) if starts and isinstance(starts[0], int) else None


def _clamped(ctx: GradientContext, index: str, dims: str) -> str:
    """Slice's reading of ``index`` on axes of sizes ``dims``: negative counts from the end, then clamped to [0, dims]."""
    index = ctx.op("Cast", index, to=onnx.TensorProto.INT64)
    zero = ctx.op("Constant", value=onh.from_array(np.zeros(1, np.int64)))
    from_end = ctx.op("Where", ctx.op("Less", index, zero), ctx.op("Add", index, dims), index)
    return ctx.op("Min", ctx.op("Max", from_end, zero), dims)


def _static_pads(ctx: GradientContext, node: onnx.NodeProto, axes: List[int], rank: int) -> Optional[List[int]]:
    """The Pad amounts of :func:`slice_gradient` when the starts, the ends and the sliced
    dims are known before run time (clamped as Slice clamps them); else None."""
    starts, ends, shape = ctx.constant(node.input[1]), ctx.constant(node.input[2]), ctx.shape(node.input[0])
    if starts is None or ends is None or shape is None:
        return None
    dims = [shape[a] for a in axes]
    if not all(isinstance(d, int) and d > 0 for d in dims):
        return None
    pads = [0] * (2 * rank)
    for axis, dim, start, end in zip(axes, dims, np.reshape(starts, -1).tolist(), np.reshape(ends, -1).tolist()):
        begin = min(max(start + dim if start < 0 else start, 0), dim)
        stop = max(min(max(end + dim if end < 0 else end, 0), dim), begin)
        pads[axis], pads[rank + axis] = begin, dim - stop
    return pads


@register("Slice", min_opset=16)
def slice_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Unit steps: Pad(dy) by the clamped starts and the room after the clamped ends.
    Other steps: dy scattered to the flat positions the same Slice picks from an index tensor."""
    x = node.input[0]
    axes = _unit_step_axes(ctx, node)
    if axes is not None:
        rank = ctx.rank(x, node)
        pads = _static_pads(ctx, node, axes, rank)
        if pads is not None:
            return [ctx.op("Pad", grads[0], ctx.ints(pads))]
        dims = ctx.op("Gather", ctx.shape_of(x), ctx.ints(axes), axis=0)
        begin = _clamped(ctx, node.input[1], dims)
        end = ctx.op("Max", _clamped(ctx, node.input[2], dims), begin)
        zero = ctx.ints([0])
        pads = [
            ctx.op("Slice", amount, ctx.ints([axes.index(a)]), ctx.ints([axes.index(a) + 1])) if a in axes else zero
            for amount in (begin, ctx.op("Sub", dims, end))
            for a in range(rank)
        ]
        return [ctx.op("Pad", grads[0], ctx.op("Concat", *pads, axis=0))]
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
