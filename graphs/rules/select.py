"""Where, and the variadic Max, Min, Mean and Sum, with NumPy broadcasting.

Max/Min split the gradient equally between the inputs that tie for the result, as
torch.maximum/torch.minimum do; each input's gradient is summed back over its broadcast axes.
"""

from __future__ import annotations

from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext
from normgrad.graphs.rules.registry import register

__all__ = ["where_gradient", "variadic_gradient"]


@register("Where", inputs=(1, 2))
def where_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dy where the condition picked the input, zero elsewhere; the condition gets none.

    ``Where(IsNaN(p), c, p)`` with p a Softmax's output (torch's safe softmax, which the
    dynamo exporter writes in every attention) passes dy to p unmasked: a Softmax's output is
    NaN over a whole row or nowhere (any NaN or infinite input makes the row's sum NaN), and
    its gradient y * (dy - sum(dy * y)) is NaN over such a row whatever dy is, so the
    mask would change nothing but cost a pass over the attention weights. (The builder writes
    the float32 chain over the last axis as one ``normgrad:SafeSoftmax`` before differentiating,
    whose gradient is 0 over such a row: this serves the chains it does not match.)"""
    condition, y, dy = node.input[0], node.output[0], grads[0]
    result: List[Optional[str]] = [None, None, None]
    for index in (1, 2):
        value = node.input[index]
        if ctx.needs_grad(value) and index == 2 and _nan_of_softmax(ctx, condition, value):
            result[index] = ctx.sum_to(dy, y, value)
        elif ctx.needs_grad(value):
            zero = ctx.scalar(0.0, y)
            picked = (dy, zero) if index == 1 else (zero, dy)
            result[index] = ctx.sum_to(ctx.op("Where", condition, *picked), y, value)
    return result


def _nan_of_softmax(ctx: GradientContext, condition: str, value: str) -> bool:
    """Whether ``condition`` is IsNaN(value) and ``value`` a Softmax's output."""
    test, source = ctx.producer(condition), ctx.producer(value)
    return (test is not None and test.op_type == "IsNaN" and test.domain in ("", "ai.onnx")
            and test.input[0] == value and source is not None and source.op_type == "Softmax"
            and source.domain in ("", "ai.onnx"))


@register("Max", "Min", "Mean", "Sum", inputs=None)
def variadic_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Sum: dy; Mean: dy / n; Max/Min: dy * [x_i == y] / (number of inputs equal to y)."""
    y, dy = node.output[0], grads[0]
    share = dy
    if node.op_type == "Mean":
        share = ctx.op("Div", dy, ctx.scalar(float(len(node.input)), y))
    ties = None
    if node.op_type in ("Max", "Min") and len(node.input) > 1:
        ties = [ctx.op("CastLike", ctx.op("Equal", x, y), y) for x in node.input]
        share = ctx.op("Div", dy, ctx.op("Sum", *ties))
    result: List[Optional[str]] = []
    for index, x in enumerate(node.input):
        if not ctx.needs_grad(x):
            result.append(None)
            continue
        grad = share if ties is None else ctx.op("Mul", share, ties[index])
        result.append(ctx.sum_to(grad, y, x))
    return result
