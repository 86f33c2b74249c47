"""SiLU (Swish) as the exporters write it, ``Mul(x, Sigmoid(x))`` in either operand order
(torch's dynamo and TorchScript exporters for ``F.silu`` / ``nn.SiLU``: Llama's and Mistral's
gated MLP, EfficientNet's MBConv): one ``SiLUGrad`` for a float32 x. The gated unit
``Mul(SiLU(gate), up)`` (Llama's MLP) with gate and up of one static float32 shape never
reaches the patterns: the builder writes it as one ``SiLUMul`` beforehand
(``normgrad.graphs.rewrites.silu_products``, with :func:`match_gated_silu`), whose rule is
one ``SwiGLUGrad`` for both factors. With dims named (dim_params) the chain stays as it is
and is differentiated as a whole (``gated_silu``): the same ``SwiGLUGrad``.

Node by node its gradient takes six passes over x's size (the Mul's two products, the
Sigmoid's 1 - s, s (1 - s) and its product with the incoming gradient, and the Sum of x's
two paths); ``SiLUGrad`` reads dy and x once. Other float types keep that node-by-node form
(:func:`normgrad.ops.activation_grad.standard_form`, reading the forward's sigmoid).

Matched strictly by hand (no onnxscript needed), else the per-node rules apply: a
default-domain Mul of x and Sigmoid(x), x of a float type, the Sigmoid's output read by that
Mul alone and not a graph output.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple, Union

import onnx

from normgrad.graphs.context import GradientContext
from normgrad.graphs.patterns.registry import GraphView, Match, is_op, register
from normgrad.graphs.patterns._row_norm import float_input
from normgrad.graphs.rules.activations import activation_gradient
from normgrad.ops import DOMAIN, swiglu_grad

__all__ = ["PATTERN", "GATED_PATTERN", "GatedSiLU", "match_silu", "match_gated_silu", "match_gated_silu_nodes"]

PATTERN = "silu"
GATED_PATTERN = "gated_silu"


def _silu_parts(view: GraphView, mul: Optional[onnx.NodeProto]):
    """(x, the Sigmoid's output, the Sigmoid) of ``mul`` = Mul(x, Sigmoid(x)) with the Sigmoid
    read by it alone, or None."""
    if not is_op(mul, "Mul") or len(mul.input) != 2 or "Sigmoid" not in view.op_types:
        return None
    for x, gate in (tuple(mul.input), tuple(reversed(mul.input))):
        sigmoid = view.producer.get(gate)
        if x != gate and is_op(sigmoid, "Sigmoid") and sigmoid.input[0] == x:
            break
    else:
        return None
    if not view.only_consumer(gate, mul):
        return None
    return x, gate, sigmoid


class GatedSiLU(NamedTuple):
    """One ``product`` = Mul(Mul(gate, Sigmoid(gate)), up) (:func:`match_gated_silu`)."""

    gate: str
    up: str
    product: onnx.NodeProto
    silu: onnx.NodeProto
    sigmoid: onnx.NodeProto


def _float32_shape(type_proto: Optional[onnx.TypeProto], named: bool = False) -> Optional[List[Union[int, str]]]:
    """The shape of a float32 tensor type if every dim is a known int (or, ``named``, a
    dim_param), else None."""
    if type_proto is None or not type_proto.HasField("tensor_type"):
        return None
    tensor = type_proto.tensor_type
    if tensor.elem_type != onnx.TensorProto.FLOAT or not tensor.HasField("shape") \
            or not all(d.HasField("dim_value") or (named and d.dim_param) for d in tensor.shape.dim):
        return None
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor.shape.dim]


def match_gated_silu(view: GraphView, type_of: Callable[[str], Optional[onnx.TypeProto]],
                     product: onnx.NodeProto, named: bool = False) -> Optional[GatedSiLU]:
    """``product`` = Mul(SiLU(gate), up), either operand order in both Muls, with the SiLU
    and its Sigmoid read by the chain alone (neither a graph output), gate and up two values
    of one static float32 shape (``named``: of one shape of ints and dim_params) (``type_of(name)``:
    a value's inferred type), or None."""
    if not is_op(product, "Mul") or len(product.input) != 2:
        return None
    for activated, up in (tuple(product.input), tuple(reversed(product.input))):
        silu = view.producer.get(activated)
        parts = _silu_parts(view, silu) if activated != up else None
        if parts is not None:
            break
    else:
        return None
    gate, _, sigmoid = parts
    shape = _float32_shape(type_of(gate), named)
    if up == gate or not view.only_consumer(activated, product) or shape is None \
            or _float32_shape(type_of(up), named) != shape:
        return None
    return GatedSiLU(gate, up, product, silu, sigmoid)


@register(PATTERN)
def match_silu(view: GraphView, ctx: GradientContext, mul: onnx.NodeProto) -> Optional[Match]:
    """``mul`` = Mul(x, Sigmoid(x)), or None."""
    parts = _silu_parts(view, mul)
    if parts is None or not float_input(ctx, parts[0]):
        return None
    x, gate, sigmoid = parts

    def gradient(ctx: GradientContext, dy: str) -> List[Tuple[str, str]]:
        if not ctx.needs_grad(x):
            return []
        return [(x, activation_gradient(ctx, "silu", dy, x, {"sigmoid": gate}))]

    return Match(PATTERN, mul, [mul, sigmoid], gradient)


@register(GATED_PATTERN)
def match_gated_silu_nodes(view: GraphView, ctx: GradientContext, product: onnx.NodeProto) -> Optional[Match]:
    """The gated unit the builder left as nodes, gate and up of one shape with dim_params
    (onnxruntime-genai's [batch_size, sequence_length, F]; a static one is a SiLUMul already):
    its forward stays onnxruntime's own (QuickGelu, then the Mul: an int4 model's next
    MatMulNBits quantizes its input to int8, which would turn another kernel's last bits into
    a visible change of the loss), its gradient one ``SwiGLUGrad(dy, gate, up)``, which
    recomputes the sigmoid: silu(gate) need not stay alive for the backward (one [tokens, F]
    float32 tensor per layer). None otherwise."""
    chain = match_gated_silu(view, ctx.type_of, product, named=True)
    if chain is None:
        return None

    def gradient(ctx: GradientContext, dy: str) -> List[Tuple[str, str]]:
        dgate, dup = ctx.op(swiglu_grad.OP_TYPE, dy, chain.gate, chain.up, outputs=2, domain=DOMAIN)
        return [(name, grad) for name, grad in ((chain.gate, dgate), (chain.up, dup)) if ctx.needs_grad(name)]

    return Match(GATED_PATTERN, product, [product, chain.silu, chain.sigmoid], gradient)
