"""The tanh GELU as torch's exporters write transformers' ``NewGELUActivation`` (GPT-2's
``gelu_new``) and hand-written ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))``:

    inner = Mul(Add(x, Mul(Pow(x, 3), 0.044715)), sqrt(2/pi));  b = Add(Tanh(inner), 1)
    y = Mul(Mul(x, 0.5), b)      # 0.5 * x first (NewGELUActivation)
    y = Mul(Mul(x, b), 0.5)      # x * (1 + tanh) first, then the half
    (any operand order)

Node by node its gradient takes about a dozen passes over x's size (the Mul, Add, Pow and
Tanh rules and the Sum of x's three paths); for a float32 x it is one ``GeluTanhGrad``.
Other float types keep the per-node rules (the match is refused).

Matched with onnxscript's rewriter (:mod:`normgrad.graphs.patterns._declarative`), then
checked strictly, else the per-node rules apply: x float32, the constants fixed scalars
(3, 0.044715, sqrt(2/pi) to float precision, 1, 0.5), each intermediate value read by the
chain alone and not a graph output.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import onnx

from normgrad.graphs.context import GradientContext
from normgrad.graphs.patterns.registry import GraphView, Match, register
from normgrad.graphs.patterns._declarative import ChainPattern
from normgrad.graphs.rules.activations import activation_gradient
from normgrad.ops.activation_grad import TANH_GELU_CUBIC

__all__ = ["PATTERN", "match_gelu_tanh_chain"]

PATTERN = "gelu_tanh_chain"


def _one_plus_tanh(op, x, three, cubic, root, one):
    inner = op.Mul(op.Add(x, op.Mul(op.Pow(x, three), cubic)), root)
    return op.Add(op.Tanh(inner), one)


def _half_first(op, x, three, cubic, root, one, half):
    return op.Mul(op.Mul(x, half), _one_plus_tanh(op, x, three, cubic, root, one))


def _half_last(op, x, three, cubic, root, one, half):
    return op.Mul(op.Mul(x, _one_plus_tanh(op, x, three, cubic, root, one)), half)


_CHAIN = ChainPattern("the written-out tanh GELU", _half_first, _half_last, differentiable=("x",))

_CONSTANTS = {"three": 3.0, "cubic": TANH_GELU_CUBIC, "root": math.sqrt(2 / math.pi), "one": 1.0, "half": 0.5}


@register(PATTERN)
def match_gelu_tanh_chain(view: GraphView, ctx: GradientContext, anchor: onnx.NodeProto) -> Optional[Match]:
    """The chain ending at ``anchor``, or None."""
    found = _CHAIN.match_scalars(view, ctx, anchor, "Tanh", _CONSTANTS)
    if found is None:
        return None
    bound, nodes = found
    x = bound["x"]
    if ctx.elem_type(x) != onnx.TensorProto.FLOAT:
        return None

    def gradient(ctx: GradientContext, dy: str) -> List[Tuple[str, str]]:
        return [(x, activation_gradient(ctx, "gelu_tanh", dy, x))]

    return Match(PATTERN, anchor, nodes, gradient)
