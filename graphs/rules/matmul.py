"""MatMul with NumPy semantics: batched, broadcast, 1-D operands."""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx

from normgrad.graphs.context import GradientContext
from normgrad.graphs.rules.registry import register

__all__ = ["matmul_gradient", "GEMM_ELEM_TYPES"]

GEMM_ELEM_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE})
"""Element types onnxruntime's CPU Gemm kernel has (1.19.2 to 1.32)."""


@register("MatMul", inputs=(0, 1))
def matmul_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dA = dY @ B^T, dB = A^T @ dY, each summed over broadcast batch axes.

    1-D operands are promoted to matrices (as MatMul does), and dY gets the axis MatMul
    removed; the gradients are reshaped back to the operand shapes. A 2-D B (a weight) under
    a batched A has its gradients as single 2-D Gemms over the flattened leading axes.
    """
    a, b, y, dy = node.input[0], node.input[1], node.output[0], grads[0]
    rank_a, rank_b = ctx.rank(a, node), ctx.rank(b, node)
    if rank_b == 2 and rank_a > 2 and ctx.elem_type(b) in GEMM_ELEM_TYPES:
        return _flattened_gradients(ctx, a, b, dy)
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


def _flattened_gradients(ctx: GradientContext, a: str, b: str, dy: str) -> List[Optional[str]]:
    """Gradients of A [..., k] @ B [k, n] with A's leading axes flattened: dB = A2^T dY2
    (:meth:`GradientContext.weight_gradient`) sums over them inside one GEMM (no batched
    [..., k, n] product, no ReduceSum) and dA = Gemm(dY2, B, transB=1) reads B as it is (no
    transposed copy)."""
    dy2 = ctx.op("Flatten", dy, axis=-1)
    result: List[Optional[str]] = [None, None]
    if ctx.needs_grad(a):
        result[0] = ctx.reshape_like(ctx.op("Gemm", dy2, b, transB=1), a)
    if ctx.needs_grad(b):
        a_shape, b_shape = ctx.static_shape(a), ctx.static_shape(b)
        dims = (int(np.prod(a_shape[:-1])), *b_shape) if a_shape and b_shape else None
        result[1] = ctx.weight_gradient(ctx.op("Flatten", a, axis=-1), dy2, dims, b)
    return result
