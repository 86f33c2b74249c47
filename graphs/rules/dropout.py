"""Dropout: the identity in inference mode; in training mode dy through the very mask the
forward drew, scaled by 1 / (1 - ratio).

The mask is the forward node's second output, added to the node when the model omits it.
``ratio`` (default 0.5) and ``training_mode`` may be constants or computed at run time.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx

from normgrad.graphs.context import GradientContext
from normgrad.graphs.rules.registry import register

__all__ = ["dropout_gradient"]


def _input(node: onnx.NodeProto, index: int) -> Optional[str]:
    return node.input[index] if len(node.input) > index and node.input[index] else None


@register("Dropout", outputs=(0,))
def dropout_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Where(mask, dy / (1 - ratio), 0) in training mode, dy otherwise."""
    x, dy = node.input[0], grads[0]
    training = _input(node, 2)
    constant = ctx.constant(training) if training else np.asarray(False)
    if constant is not None and not bool(np.asarray(constant).reshape(-1)[0]):
        return [dy]
    mask = ctx.ensure_output(node, 1, "mask")
    ratio = _input(node, 1)
    ratio = ctx.op("CastLike", ratio, x) if ratio else ctx.scalar(0.5, x)
    kept = ctx.op("Div", dy, ctx.op("Sub", ctx.scalar(1.0, x), ratio))
    dx = ctx.op("Where", mask, kept, ctx.scalar(0.0, x))
    if constant is None:  # training mode decided at run time
        dx = ctx.op("Where", training, dx, dy)
    return [dx]
