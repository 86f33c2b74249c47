"""CumSum: the gradient is the cumulative sum of dy in the other direction.

y_j = sum_{i <= j} x_i gives dx_i = sum_{j >= i} dy_j, a reverse CumSum of dy; the
exclusive form (i < j) gives the exclusive reverse one. ``reverse`` flips both. The axis
input (constant or computed) is reused as is.
"""

from __future__ import annotations

from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules.registry import register

__all__ = ["cumsum_gradient"]


@register("CumSum")
def cumsum_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """CumSum(dy, axis) with ``reverse`` flipped and ``exclusive`` kept."""
    reverse = 1 - int(attr(node, "reverse", 0))
    return [ctx.op("CumSum", grads[0], node.input[1], exclusive=int(attr(node, "exclusive", 0)), reverse=reverse)]
