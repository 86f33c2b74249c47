"""Concat: dy split back into the pieces, along the concatenation axis."""

from __future__ import annotations

from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules.registry import register

__all__ = ["concat_gradient"]


@register("Concat", inputs=None)
def concat_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Split(dy) with the runtime sizes of the inputs along ``axis``."""
    axis = attr(node, "axis", None)
    if axis < 0:
        axis += ctx.rank(node.output[0], node)
    sizes = [ctx.shape_of(name, start=axis, end=axis + 1) for name in node.input]
    split = ctx.op("Concat", *sizes, axis=0)
    pieces = ctx.op("Split", grads[0], split, outputs=len(node.input), axis=axis)
    return list(pieces) if len(node.input) > 1 else [pieces]
