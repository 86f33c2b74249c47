"""SiLU (Swish) as the exporters write it, ``Mul(x, Sigmoid(x))`` in either operand order
(torch's dynamo and TorchScript exporters for ``F.silu`` / ``nn.SiLU``: Llama's and Mistral's
gated MLP, EfficientNet's MBConv): one ``SiLUGrad`` for a float32 x; and the gated unit
``Mul(SiLU(gate), up)`` (Llama's MLP) with gate and up of one static float32 shape: one
``SwiGLUGrad`` for both factors.

Node by node its gradient takes six passes over x's size (the Mul's two products, the
Sigmoid's 1 - s, s (1 - s) and its product with the incoming gradient, and the Sum of x's
two paths); ``SiLUGrad`` reads dy and x once. Other float types keep that node-by-node form
(:func:`normgrad.ops.activation_grad.standard_form`, reading the forward's sigmoid).

Matched strictly by hand (no onnxscript needed), else the per-node rules apply: a
default-domain Mul of x and Sigmoid(x), x of a float type, the Sigmoid's output read by that
Mul alone and not a graph output.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import onnx

from normgrad.graphs.context import GradientContext
from normgrad.graphs.patterns import GraphView, Match, is_op, register
from normgrad.graphs.patterns._row_norm import float_input
from normgrad.graphs.rules.activations import activation_gradient
from normgrad.ops import DOMAIN, swiglu_grad

__all__ = ["PATTERN", "GATED_PATTERN", "match_silu", "match_swiglu"]

PATTERN = "silu"
GATED_PATTERN = "swiglu"


def _silu_parts(view: GraphView, ctx: GradientContext, mul: Optional[onnx.NodeProto]):
    """(x, the Sigmoid's output, the Sigmoid) of ``mul`` = Mul(x, Sigmoid(x)), or None."""
    if not is_op(mul, "Mul") or len(mul.input) != 2 or "Sigmoid" not in view.op_types:
        return None
    for x, gate in (tuple(mul.input), tuple(reversed(mul.input))):
        sigmoid = view.producer.get(gate)
        if x != gate and is_op(sigmoid, "Sigmoid") and sigmoid.input[0] == x:
            break
    else:
        return None
    if not float_input(ctx, x) or not view.only_consumer(gate, mul):
        return None
    return x, gate, sigmoid


@register(GATED_PATTERN)
def match_swiglu(view: GraphView, ctx: GradientContext, product: onnx.NodeProto) -> Optional[Match]:
    """``product`` = Mul(SiLU(gate), up) with the SiLU read by it alone, gate and up float32
    of one static shape, or None."""
    if not is_op(product, "Mul") or len(product.input) != 2:
        return None
    for activated, up in (tuple(product.input), tuple(reversed(product.input))):
        mul = view.producer.get(activated)
        parts = _silu_parts(view, ctx, mul) if activated != up else None
        if parts is not None:
            break
    else:
        return None
    gate, _, sigmoid = parts
    shape = ctx.static_shape(gate)
    if up == gate or not view.only_consumer(activated, product) or ctx.elem_type(gate) != onnx.TensorProto.FLOAT \
            or ctx.elem_type(up) != onnx.TensorProto.FLOAT or shape is None or ctx.static_shape(up) != shape:
        return None

    def gradient(ctx: GradientContext, dy: str) -> List[Tuple[str, str]]:
        wanted = [name for name in (gate, up) if ctx.needs_grad(name)]
        if not wanted:
            return []
        dgate, dup = ctx.op(swiglu_grad.OP_TYPE, dy, gate, up, outputs=2, domain=DOMAIN)
        return [(name, grad) for name, grad in ((gate, dgate), (up, dup)) if name in wanted]

    return Match(GATED_PATTERN, product, [product, mul, sigmoid], gradient)


@register(PATTERN)
def match_silu(view: GraphView, ctx: GradientContext, mul: onnx.NodeProto) -> Optional[Match]:
    """``mul`` = Mul(x, Sigmoid(x)), or None."""
    parts = _silu_parts(view, ctx, mul)
    if parts is None:
        return None
    x, gate, sigmoid = parts

    def gradient(ctx: GradientContext, dy: str) -> List[Tuple[str, str]]:
        if not ctx.needs_grad(x):
            return []
        return [(x, activation_gradient(ctx, "silu", dy, x, {"sigmoid": gate}))]

    return Match(PATTERN, mul, [mul, sigmoid], gradient)
