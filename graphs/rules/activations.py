"""Elementwise activations and unary math: dx as a function of x, y and dy.

Relu, LeakyRelu, Elu, Sigmoid, HardSigmoid, HardSwish, Softplus, Tanh, Exp, Log, Sqrt,
Reciprocal, Neg, Abs, Erf, Sin, Cos, Gelu (opset 20; approximate "none" and "tanh"), Mish
(opset 18), Clip (to the data, and to min and max as torch.clamp gives them), Softmax and LogSoftmax; PRelu (to the data and
the slope, which broadcasts to the data unidirectionally).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

import numpy as np
import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules.registry import register
from normgrad.ops import (DOMAIN, activation_grad, bias_safe_softmax, gelu_with_slope, safe_softmax, silu_mul,
                          softmax_grad, swiglu_grad)

__all__ = ["UNARY_GRADIENTS", "unary_gradient", "clip_gradient", "softmax_gradient", "safe_softmax_gradient", "bias_safe_softmax_gradient", "silu_mul_gradient",
           "prelu_gradient", "activation_gradient", "gelu_with_slope_gradient"]

UnaryFn = Callable[[GradientContext, onnx.NodeProto, str, str, str], str]


def _where_positive(ctx: GradientContext, x: str, then: str, otherwise: str) -> str:
    return ctx.op("Where", ctx.op("Greater", x, ctx.scalar(0.0, x)), then, otherwise)


def _relu_gradient(ctx: GradientContext, x: str, dy: str) -> str:
    return _masked(ctx, dy, ctx.op("Greater", x, ctx.scalar(0.0, x)), x)


def _masked(ctx: GradientContext, dy: str, mask: str, like: str) -> str:
    """dy where ``mask``, else 0, as a Mul by the mask cast to ``like``'s type: onnxruntime's
    CPU Where with a scalar branch is single-threaded and slow (Greater + Where 14.0 ms,
    Greater + Cast + Mul 2.3 ms on [16, 64, 56, 56] float32, 2 threads; ReLU's Where was 10-17%
    of a ResNet training step, ReLU6's 24% of a MobileNetV2 one). Unlike Where it turns an
    inf or NaN dy outside the mask into NaN, not 0."""
    elem_type = ctx.elem_type(like)
    if elem_type is None:
        return ctx.op("Where", mask, dy, ctx.scalar(0.0, like))
    return ctx.op("Mul", dy, ctx.op("Cast", mask, to=elem_type))


def _hard_sigmoid_slope(ctx: GradientContext, x: str, alpha: float, beta: float) -> str:
    """alpha where 0 < alpha * x + beta < 1, else 0 (the derivative of HardSigmoid)."""
    z = ctx.op("Add", ctx.op("Mul", x, ctx.scalar(alpha, x)), ctx.scalar(beta, x))
    inside = ctx.op("And", ctx.op("Greater", z, ctx.scalar(0.0, x)), ctx.op("Less", z, ctx.scalar(1.0, x)))
    return ctx.op("Where", inside, ctx.scalar(alpha, x), ctx.scalar(0.0, x))


def _one_minus(ctx: GradientContext, value: str, like: str) -> str:
    return ctx.op("Sub", ctx.scalar(1.0, like), value)


def activation_gradient(ctx: GradientContext, activation: str, dy: str, x: str, known=None,
                        like: Optional[str] = None) -> str:
    """dx of an activation of :mod:`normgrad.ops.activation_grad`: its operator (one pass) for
    a float32 x, else the standard-op form (``known``: the forward values it reads; ``like``:
    a forward value of x's element type, when x is a backward value)."""
    like = like or x
    if ctx.elem_type(like) == onnx.TensorProto.FLOAT:
        return ctx.op(activation_grad.ACTIVATIONS[activation], dy, x, domain=DOMAIN)
    return activation_grad.standard_form(activation, ctx.op, lambda value: ctx.scalar(value, like), dy, x, known)


def _gelu(ctx: GradientContext, node: onnx.NodeProto, x: str, y: str, dy: str) -> str:
    """none: Phi(x) + x phi(x); tanh: ``GeluTanhGrad`` (float32) or its standard form, with
    t = tanh(sqrt(2/pi) (x + c x^3)), 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 c x^2)."""
    if attr(node, "approximate", "none") == "tanh":
        return activation_gradient(ctx, "gelu_tanh", dy, x)
    half = ctx.scalar(0.5, x)
    square = ctx.op("Mul", x, x)
    cdf = ctx.op("Mul", half, ctx.op("Add", ctx.scalar(1.0, x), ctx.op("Erf", ctx.op("Mul", x, ctx.scalar(math.sqrt(0.5), x)))))
    pdf = ctx.op("Mul", ctx.scalar(1 / math.sqrt(2 * math.pi), x), ctx.op("Exp", ctx.op("Mul", ctx.scalar(-0.5, x), square)))
    local = ctx.op("Add", cdf, ctx.op("Mul", x, pdf))
    return ctx.op("Mul", dy, local)


def _mish(ctx: GradientContext, node: onnx.NodeProto, x: str, y: str, dy: str) -> str:
    """y = x tanh(softplus(x)): t + x (1 - t^2) sigmoid(x) with t = tanh(softplus(x))."""
    t = ctx.op("Tanh", ctx.op("Softplus", x))
    slope = ctx.op("Mul", ctx.op("Mul", x, _one_minus(ctx, ctx.op("Mul", t, t), x)), ctx.op("Sigmoid", x))
    return ctx.op("Mul", dy, ctx.op("Add", t, slope))


UNARY_GRADIENTS: Dict[str, UnaryFn] = {
    "Relu": lambda ctx, node, x, y, dy: _relu_gradient(ctx, x, dy),
    "LeakyRelu": lambda ctx, node, x, y, dy: _where_positive(
        ctx, x, dy, ctx.op("Mul", dy, ctx.scalar(attr(node, "alpha", 0.01), x))
    ),
    "Elu": lambda ctx, node, x, y, dy: _where_positive(
        ctx, x, dy, ctx.op("Mul", dy, ctx.op("Add", y, ctx.scalar(attr(node, "alpha", 1.0), x)))
    ),
    "Sigmoid": lambda ctx, node, x, y, dy: ctx.op("Mul", dy, ctx.op("Mul", y, _one_minus(ctx, y, x))),
    "HardSigmoid": lambda ctx, node, x, y, dy: ctx.op(
        "Mul", dy, _hard_sigmoid_slope(ctx, x, attr(node, "alpha", 0.2), attr(node, "beta", 0.5))
    ),
    "HardSwish": lambda ctx, node, x, y, dy: ctx.op(
        "Mul",
        dy,
        ctx.op(
            "Add",
            ctx.op("HardSigmoid", x, alpha=1 / 6, beta=0.5),
            ctx.op("Mul", x, _hard_sigmoid_slope(ctx, x, 1 / 6, 0.5)),
        ),
    ),
    "Softplus": lambda ctx, node, x, y, dy: ctx.op("Mul", dy, ctx.op("Sigmoid", x)),
    "Tanh": lambda ctx, node, x, y, dy: ctx.op("Mul", dy, _one_minus(ctx, ctx.op("Mul", y, y), x)),
    "Exp": lambda ctx, node, x, y, dy: ctx.op("Mul", dy, y),
    "Log": lambda ctx, node, x, y, dy: ctx.op("Div", dy, x),
    "Sqrt": lambda ctx, node, x, y, dy: ctx.op("Div", dy, ctx.op("Add", y, y)),
    "Reciprocal": lambda ctx, node, x, y, dy: ctx.op("Neg", ctx.op("Mul", dy, ctx.op("Mul", y, y))),
    "Neg": lambda ctx, node, x, y, dy: ctx.op("Neg", dy),
    "Abs": lambda ctx, node, x, y, dy: ctx.op("Mul", dy, ctx.op("Sign", x)),
    "Erf": lambda ctx, node, x, y, dy: ctx.op(
        "Mul",
        dy,
        ctx.op("Mul", ctx.scalar(2 / math.sqrt(math.pi), x), ctx.op("Exp", ctx.op("Neg", ctx.op("Mul", x, x)))),
    ),
    "Sin": lambda ctx, node, x, y, dy: ctx.op("Mul", dy, ctx.op("Cos", x)),
    "Cos": lambda ctx, node, x, y, dy: ctx.op("Neg", ctx.op("Mul", dy, ctx.op("Sin", x))),
    "Gelu": _gelu,
    "Mish": _mish,
}


@register(*UNARY_GRADIENTS)
def unary_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dx of an elementwise activation from the table :data:`UNARY_GRADIENTS`."""
    return [UNARY_GRADIENTS[node.op_type](ctx, node, node.input[0], node.output[0], grads[0])]


@register("Clip", inputs=(0, 1, 2))
def clip_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """torch.clamp's gradients: x's where min <= x <= max (a tie goes to x); min's where x < min
    and min < max; max's where x > max or max < min (ONNX and torch give max where min > max);
    each bound's summed to its shape."""
    x, dy = node.input[0], grads[0]
    low = node.input[1] if len(node.input) > 1 and node.input[1] else None
    high = node.input[2] if len(node.input) > 2 and node.input[2] else None
    result: List[Optional[str]] = [None, None, None]
    if ctx.needs_grad(x):
        if low and high and _ordered_constants(ctx, low, high):
            # min <= x <= max exactly where Clip returned x itself (ReLU6): one comparison with
            # the output the forward already holds, where two and an And read x three times
            inside = ctx.op("Equal", node.output[0], x)
        elif low and high:
            inside = ctx.op("And", ctx.op("GreaterOrEqual", x, low), ctx.op("LessOrEqual", x, high))
        else:
            inside = ctx.op("GreaterOrEqual", x, low) if low else ctx.op("LessOrEqual", x, high) if high else None
        result[0] = dy if inside is None else _masked(ctx, dy, inside, x)
    if low and ctx.needs_grad(low):
        below = [ctx.op("Less", x, low)] + ([ctx.op("Less", low, high)] if high else [])
        result[1] = ctx.sum_to(ctx.op("Where", _all(ctx, below), dy, ctx.scalar(0.0, x)), node.output[0], low)
    if high and ctx.needs_grad(high):
        above = ctx.op("Greater", x, high)
        if low:
            above = ctx.op("Or", above, ctx.op("Less", high, low))
        result[2] = ctx.sum_to(ctx.op("Where", above, dy, ctx.scalar(0.0, x)), node.output[0], high)
    return result


def _ordered_constants(ctx: GradientContext, low: str, high: str) -> bool:
    """Whether both bounds are constants (none trained) with min <= max: then Clip's output
    equals x exactly where min <= x <= max."""
    if ctx.needs_grad(low) or ctx.needs_grad(high):
        return False
    low_value, high_value = ctx.constant(low), ctx.constant(high)
    return low_value is not None and high_value is not None and bool(np.all(low_value <= high_value))


def _all(ctx: GradientContext, tests: List[str]) -> str:
    return tests[0] if len(tests) == 1 else ctx.op("And", *tests)


@register("PRelu", inputs=(0, 1))
def prelu_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """y = x where x >= 0, slope * x elsewhere: dx = dy or dy * slope; dslope = dy * x where
    x < 0, summed to the slope's shape."""
    x, slope, dy = node.input[0], node.input[1], grads[0]
    negative = ctx.op("Less", x, ctx.scalar(0.0, x))
    result: List[Optional[str]] = [None, None]
    if ctx.needs_grad(x):
        result[0] = ctx.op("Where", negative, ctx.op("Mul", dy, slope), dy)
    if ctx.needs_grad(slope):
        dslope = ctx.op("Where", negative, ctx.op("Mul", dy, x), ctx.scalar(0.0, x))
        result[1] = ctx.sum_to(dslope, node.output[0], slope)
    return result


@register("Softmax", "LogSoftmax")
def softmax_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Softmax: y * (dy - sum(dy * y)); LogSoftmax: dy - exp(y) * sum(dy), sums along ``axis``.

    A float32 Softmax over the last axis (attention's) differentiates as one
    ``normgrad:SoftmaxGrad`` (one pass per row instead of four over the tensor)."""
    y, dy = node.output[0], grads[0]
    axis = attr(node, "axis", -1)
    rank = ctx.rank(y, node)
    if node.op_type == "Softmax":
        if ctx.elem_type(y) == onnx.TensorProto.FLOAT and (axis == -1 or (rank is not None and axis == rank - 1)):
            return [ctx.op(softmax_grad.OP_TYPE, dy, y, domain=DOMAIN)]
        return [softmax_grad.standard_form(
            ctx.op, lambda value: ctx.reduce("ReduceSum", value, [axis], keepdims=True, rank=rank), dy, y)]
    total = ctx.reduce("ReduceSum", dy, [axis], keepdims=True, rank=rank)
    return [ctx.op("Sub", dy, ctx.op("Mul", ctx.op("Exp", y), total))]


@register(safe_softmax.OP_TYPE, normgrad_domain=True)
def safe_softmax_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """normgrad:SafeSoftmax (float32, last axis): ``SoftmaxGrad(dy, y)``, 0 on the rows it zeroed
    (torch's ``_safe_softmax`` backward), where the standard ops' Where/Softmax gradients give NaN."""
    return [ctx.op(softmax_grad.OP_TYPE, grads[0], node.output[0], domain=DOMAIN)]


@register(bias_safe_softmax.OP_TYPE, inputs=(0, 1), normgrad_domain=True)
def bias_safe_softmax_gradient(ctx: GradientContext, node: onnx.NodeProto,
                               grads: List[Optional[str]]) -> List[Optional[str]]:
    """normgrad:BiasSafeSoftmax: SafeSoftmax's ``SoftmaxGrad(dy, y)`` for x, and for the bias
    (a learned position bias; an attention mask has none) that summed over the axes it was
    broadcast along."""
    x, bias = node.input
    dx = ctx.op(softmax_grad.OP_TYPE, grads[0], node.output[0], domain=DOMAIN)
    return [dx if ctx.needs_grad(x) else None, ctx.sum_to(dx, node.output[0], bias) if ctx.needs_grad(bias) else None]


@register(silu_mul.OP_TYPE, inputs=(0, 1), normgrad_domain=True)
def silu_mul_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """normgrad:SiLUMul, y = silu(gate) * up: both gradients from one ``SwiGLUGrad(dy, gate, up)``,
    which recomputes the sigmoid."""
    gate, up = node.input
    dgate, dup = ctx.op(swiglu_grad.OP_TYPE, grads[0], gate, up, outputs=2, domain=DOMAIN)
    return [dgate if ctx.needs_grad(gate) else None, dup if ctx.needs_grad(up) else None]


@register(gelu_with_slope.OP_TYPE, outputs=(0,), normgrad_domain=True)
def gelu_with_slope_gradient(ctx: GradientContext, node: onnx.NodeProto,
                             grads: List[Optional[str]]) -> List[Optional[str]]:
    """normgrad:GeluWithSlope (float32): ``Mul(dy, slope)``, the forward's slope output (bitwise
    GeluGrad(dy, x) with the C++ kernels)."""
    return [ctx.op("Mul", grads[0], node.output[1])]
