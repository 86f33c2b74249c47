"""Pad (modes constant, reflect, edge, wrap; pads as input or, converted from opsets < 11,
attribute; negative pads crop; the ``axes`` input of opset 18).

constant: dx = Pad(dy, -pads), which crops what was added and zero-fills what was cropped.
reflect/edge with constant non-negative pads: per padded axis, dy's middle plus each
padded border folded back onto the elements it copies (reversed for reflect, summed for
edge), with Slice, Add and Concat. Otherwise (wrap, negative or run-time pads) an input
element can appear several times in y, so dy is scatter-added to the flat positions that
the same Pad moves an index tensor to (right at any size, but onnxruntime's ScatterElements
is some hundred times slower than the folds).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules.registry import register
from normgrad.graphs.rules._scatter import flat_positions, scatter_to_positions

__all__ = ["pad_gradient"]

_TO_THE_END = np.iinfo(np.int64).max
_FROM_THE_END = np.iinfo(np.int64).min  # a reversed slice's end: past the first element


def _static_pads(ctx: GradientContext, node: onnx.NodeProto) -> Optional[List[Tuple[int, int, int]]]:
    """(axis, begin, end) of each padded axis when the pads (and axes) are constant and non-negative."""
    pads = ctx.constant(node.input[1])
    rank = ctx.rank(node.input[0], node)
    axes = ctx.constant(node.input[3]) if len(node.input) > 3 and node.input[3] else np.arange(rank)
    if pads is None or axes is None or np.any(pads < 0):
        return None
    pads, axes = np.reshape(pads, -1), [int(a) % rank for a in np.reshape(axes, -1)]
    return [(axis, int(pads[i]), int(pads[len(axes) + i])) for i, axis in enumerate(axes) if pads[i] or pads[len(axes) + i]]


def _slice(ctx: GradientContext, value: str, axis: int, start: int, end: Optional[int] = None, step: int = 1) -> str:
    end = _TO_THE_END if end is None else end
    return ctx.op("Slice", value, ctx.ints([start]), ctx.ints([end]), ctx.ints([axis]), ctx.ints([step]))


def _add_at(ctx: GradientContext, value: str, part: str, axis: int, start: int, stop: Optional[int]) -> str:
    """``value`` with ``part`` added to ``value[start:stop]`` along ``axis`` (stop None: to the end)."""
    pieces = [_slice(ctx, value, axis, 0, start)] if start != 0 else []
    pieces.append(ctx.op("Add", _slice(ctx, value, axis, start, stop), part))
    if stop is not None:
        pieces.append(_slice(ctx, value, axis, stop))
    return ctx.op("Concat", *pieces, axis=axis) if len(pieces) > 1 else pieces[0]


def _fold(ctx: GradientContext, grad: str, axis: int, begin: int, end: int, mode: str) -> str:
    """The gradient of one axis's reflect/edge padding: the middle of ``grad`` plus the borders
    added back where they were copied from."""
    middle = _slice(ctx, grad, axis, begin, -end if end else None)
    if begin:
        border = _slice(ctx, grad, axis, 0, begin)
        if mode == "reflect":  # y[begin - 1 - i] = x[1 + i]
            middle = _add_at(ctx, middle, _slice(ctx, border, axis, -1, _FROM_THE_END, -1), axis, 1, begin + 1)
        else:  # edge: y[i] = x[0]
            middle = _add_at(ctx, middle, ctx.reduce("ReduceSum", border, [axis], keepdims=True), axis, 0, 1)
    if end:
        border = _slice(ctx, grad, axis, -end)
        if mode == "reflect":  # y[begin + d + i] = x[d - 2 - i]
            middle = _add_at(ctx, middle, _slice(ctx, border, axis, -1, _FROM_THE_END, -1), axis, -(end + 1), -1)
        else:  # edge: y[begin + d + i] = x[d - 1]
            middle = _add_at(ctx, middle, ctx.reduce("ReduceSum", border, [axis], keepdims=True), axis, -1, None)
    return middle


@register("Pad", min_opset=16)
def pad_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Gradient of the data only (the padding value gets none, as in torch's F.pad)."""
    x, pads, dy = node.input[0], node.input[1], grads[0]
    axes = ["", node.input[3]] if len(node.input) > 3 and node.input[3] else []
    mode = attr(node, "mode", "constant")
    if mode == "constant":
        constant = ctx.constant(pads)
        negated = ctx.ints(-constant.reshape(-1)) if constant is not None else ctx.op("Neg", pads)
        return [ctx.op("Pad", dy, negated, *axes)]
    static = _static_pads(ctx, node) if mode in ("reflect", "edge") else None
    if static is not None:
        for axis, begin, end in static:
            dy = _fold(ctx, dy, axis, begin, end, mode)
        return [dy]
    positions = ctx.op("Pad", flat_positions(ctx, x), pads, *axes, mode=mode)
    return [scatter_to_positions(ctx, dy, positions, x, "add")]
