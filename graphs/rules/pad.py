"""Pad (modes constant, reflect, edge, wrap; pads as input or, converted from opsets < 11,
attribute; negative pads crop; the ``axes`` input of opset 18).

constant: dx = Pad(dy, -pads), which crops what was added and zero-fills what was cropped.
reflect/edge/wrap: an input element can appear several times in y, so dy is scatter-added
to the flat positions that the same Pad moves an index tensor to.
"""

from __future__ import annotations

from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules import register
from normgrad.graphs.rules._scatter import flat_positions, scatter_to_positions

__all__ = ["pad_gradient"]


@register("Pad", min_opset=16)
def pad_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Gradient of the data only (the padding value gets none, as in torch's F.pad)."""
    x, pads, dy = node.input[0], node.input[1], grads[0]
    axes = ["", node.input[3]] if len(node.input) > 3 and node.input[3] else []
    if attr(node, "mode", "constant") == "constant":
        constant = ctx.constant(pads)
        negated = ctx.ints(-constant.reshape(-1)) if constant is not None else ctx.op("Neg", pads)
        return [ctx.op("Pad", dy, negated, *axes)]
    positions = ctx.op("Pad", flat_positions(ctx, x), pads, *axes, mode=attr(node, "mode", None))
    return [scatter_to_positions(ctx, dy, positions, x, "add")]
