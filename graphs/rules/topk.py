"""TopK: the gradient flows to X through the values output; the indices carry none.

Values = GatherElements(X, Indices, axis), so dX is dValues scattered into zeros at the
indices along the axis: ScatterElements with ``reduction="add"`` (opset 16), as Gather's
gradient is written. The indices of one slice are distinct, so each element of X receives at
most one value, the one onnxruntime's forward picked (ties included).
"""

from __future__ import annotations

from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules import register

__all__ = ["topk_gradient"]


@register("TopK", outputs=(0,), min_opset=16)
def topk_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """ScatterElements(zeros like X, Indices, dValues, axis, reduction="add")."""
    x, dy = node.input[0], grads[0]
    axis = attr(node, "axis", -1) % ctx.rank(x, node)
    indices = ctx.ensure_output(node, 1, "indices")
    return [ctx.op("ScatterElements", ctx.zeros_like(x), indices, dy, axis=axis, reduction="add")]
