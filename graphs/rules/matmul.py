"""MatMul with NumPy semantics: batched, broadcast, 1-D operands."""

from __future__ import annotations

from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext
from normgrad.graphs.rules import register

__all__ = ["matmul_gradient"]


@register("MatMul", inputs=(0, 1))
def matmul_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dA = dY @ B^T, dB = A^T @ dY, each summed over broadcast batch axes.

    1-D operands are promoted to matrices (as MatMul does), and dY gets the axis MatMul
    removed; the gradients are reshaped back to the operand shapes.
    """
    a, b, y, dy = node.input[0], node.input[1], node.output[0], grads[0]
    rank_a, rank_b = ctx.rank(a, node), ctx.rank(b, node)
    a2, b2, dy2 = a, b, dy
    if rank_b == 1:
        b2, dy2 = ctx.unsqueeze(b, [1]), ctx.unsqueeze(dy2, [-1])
    if rank_a == 1:
        a2, dy2 = ctx.unsqueeze(a, [0]), ctx.unsqueeze(dy2, [-2])
    out_rank = max(rank_a, rank_b, 2)
    result: List[Optional[str]] = [None, None]
    for index, operand in enumerate((a, b)):
        if not ctx.needs_grad(operand):
            continue
        if index == 0:
            grad = ctx.op("MatMul", dy2, ctx.transpose_last_two(b2, max(rank_b, 2)))
        else:
            grad = ctx.op("MatMul", ctx.transpose_last_two(a2, max(rank_a, 2)), dy2)
        if rank_a > 1 and rank_b > 1:
            grad = ctx.sum_to(grad, y, operand)
        elif ctx.rank(operand, node) == 1:  # [batch..., 1, k] or [batch..., k, 1] -> [k]
            if out_rank > 2:
                grad = ctx.reduce("ReduceSum", grad, list(range(out_rank - 2)), keepdims=False)
            grad = ctx.reshape_like(grad, operand)
        result[index] = grad
    return result
