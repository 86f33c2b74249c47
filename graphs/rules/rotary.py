"""normgrad:RotateHalfEmbedding, the rotary position embedding the builder writes in place of
the exporters' Split, Neg, Concat, Mul, Mul, Add (``normgrad.graphs.rewrites.rotate_half_embeddings``).

x's gradient is the same operator in its transposed mode applied to dy: ``dy * cos +
r^T(dy * sin)``, bitwise the node-by-node gradient. cos and sin get theirs (``dy * x`` and
``dy * r(x)``, summed over their broadcast axes, the Mul rule's) only where they need one:
every exporter's Llama computes them from position ids and constants.
"""

from __future__ import annotations

from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules.registry import register
from normgrad.ops import DOMAIN, rotate_half_embedding

__all__ = ["rotate_half_embedding_gradient"]


@register(rotate_half_embedding.OP_TYPE, inputs=(0, 1, 2), normgrad_domain=True)
def rotate_half_embedding_gradient(ctx: GradientContext, node: onnx.NodeProto,
                                   grads: List[Optional[str]]) -> List[Optional[str]]:
    """dx = RotateHalfEmbedding(dy, cos, sin) in the other mode; dcos, dsin by the Mul rule's
    products (transposed mode: y = x cos + r^T(x sin), so dsin = x r(dy))."""
    dy, (x, cos, sin), y = grads[0], node.input, node.output[0]
    transposed = attr(node, "transposed", 0)
    result: List[Optional[str]] = [None, None, None]
    if ctx.needs_grad(x):
        result[0] = ctx.op(rotate_half_embedding.OP_TYPE, dy, cos, sin, domain=DOMAIN, transposed=1 - transposed)
    if ctx.needs_grad(cos):
        result[1] = ctx.sum_to(ctx.op("Mul", dy, x), y, cos)
    if ctx.needs_grad(sin):
        rotated, other = (dy, x) if transposed else (x, dy)
        rotation = rotate_half_embedding.rotate_half(ctx.op, rotated, ctx.opset)
        result[2] = ctx.sum_to(ctx.op("Mul", other, rotation), y, sin)
    return result
