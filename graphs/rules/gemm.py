"""Gemm: Y = alpha * A' @ B' + beta * C with A' = A or A^T, B' = B or B^T."""

from __future__ import annotations

from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules.registry import register

__all__ = ["gemm_gradient"]


@register("Gemm", inputs=(0, 1, 2))
def gemm_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dA, dB as Gemms with the transposition flags arranged; dC = beta * dY summed to C's shape."""
    alpha, beta = attr(node, "alpha", 1.0), attr(node, "beta", 1.0)
    trans_a, trans_b = attr(node, "transA", 0), attr(node, "transB", 0)
    dy, a, b, y = grads[0], node.input[0], node.input[1], node.output[0]
    result: List[Optional[str]] = [None] * len(node.input)
    if ctx.needs_grad(a):
        if trans_a:  # dA = B' dY^T
            result[0] = ctx.op("Gemm", b, dy, alpha=alpha, transA=trans_b, transB=1)
        else:  # dA = dY B'^T
            result[0] = ctx.op("Gemm", dy, b, alpha=alpha, transB=1 - trans_b)
    if ctx.needs_grad(b):
        if trans_a:  # dB = dY^T A^T, or A dY
            result[1] = ctx.op("Gemm", dy, a, alpha=alpha, transA=1, transB=1) if trans_b else \
                ctx.op("Gemm", a, dy, alpha=alpha)
        else:
            rows, k = ctx.static_shape(a) or (None, None)
            n = (ctx.static_shape(y) or (None, None))[1]
            if trans_b:  # dB = dY^T A
                result[1] = ctx.weight_gradient(dy, a, (rows, n, k), a, alpha)
            else:  # dB = A^T dY
                result[1] = ctx.weight_gradient(a, dy, (rows, k, n), a, alpha)
    if len(node.input) > 2 and ctx.needs_grad(node.input[2]):
        c = node.input[2]
        scaled = dy if beta == 1.0 else ctx.op("Mul", dy, ctx.scalar(beta, c))
        result[2] = ctx.sum_to(scaled, y, c)
    return result
