"""Add, Sub, Mul, Div and Pow, with NumPy broadcasting.

Each input's gradient is summed back over the axes along which that input was broadcast.
"""

from __future__ import annotations

from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext
from normgrad.graphs.rules.registry import register

__all__ = ["binary_gradient", "pow_gradient"]


@register("Add", "Sub", "Mul", "Div", inputs=(0, 1))
def binary_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Gradients of the four arithmetic operators."""
    dy, (a, b), y = grads[0], node.input, node.output[0]
    op = node.op_type
    result: List[Optional[str]] = [None, None]
    if ctx.needs_grad(a):
        grad_a = {"Add": lambda: dy, "Sub": lambda: dy, "Mul": lambda: ctx.op("Mul", dy, b), "Div": lambda: ctx.op("Div", dy, b)}[op]()
        result[0] = ctx.sum_to(grad_a, y, a)
    if ctx.needs_grad(b):
        grad_b = {
            "Add": lambda: dy,
            "Sub": lambda: ctx.op("Neg", dy),
            "Mul": lambda: ctx.op("Mul", dy, a),
            "Div": lambda: ctx.op("Neg", ctx.op("Div", ctx.op("Mul", dy, y), b)),
        }[op]()
        result[1] = ctx.sum_to(grad_b, y, b)
    return result


@register("Pow", inputs=(0, 1))
def pow_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """y = a ** b: da = dy * b * a ** (b - 1); db = dy * y * log(a)."""
    dy, (a, b), y = grads[0], node.input, node.output[0]
    result: List[Optional[str]] = [None, None]
    if ctx.needs_grad(a):
        exponent = ctx.op("CastLike", b, a)
        lowered = ctx.op("Pow", a, ctx.op("Sub", exponent, ctx.scalar(1.0, a)))
        result[0] = ctx.sum_to(ctx.op("Mul", dy, ctx.op("Mul", exponent, lowered)), y, a)
    if ctx.needs_grad(b):
        grad_b = ctx.op("CastLike", ctx.op("Mul", ctx.op("Mul", dy, y), ctx.op("Log", a)), b)  # b may be of another float type
        result[1] = ctx.sum_to(grad_b, y, b)
    return result
