"""The exact (erf) GELU as torch's exporters write it before opset 20: one short backward.

    a = Div(x, sqrt(2)); b = Add(Erf(a), 1)
    y = Mul(x, Mul(b, 0.5))        # the dynamo exporter (BERT's intermediate activation)
    y = Mul(Mul(x, b), 0.5)        # TorchScript
    (any operand order)

Node by node its gradient takes ten passes over x's size (the two Mul gradients, the Erf
gradient's square, Neg, Exp and two Muls, the Div's, and the Sum of x's two paths). Here it
is one ``GeluGrad`` for a float32 x (dy (Phi(x) + x phi(x)) in one pass); other float types
take six passes (:func:`normgrad.ops.activation_grad.standard_form`): Phi(x) = b / 2 (the
forward's, or one Mul), x phi(x) = x exp(log(1 / sqrt(2 pi)) - a^2) (Mul, Sub, Exp, Mul,
Add, Mul).

Matched with onnxscript's rewriter (:mod:`normgrad.graphs.patterns._declarative`), then
checked strictly, else the per-node rules apply: x of a float type, the constants fixed
scalars (sqrt(2) to float precision, 1, 0.5), each intermediate value read by the chain
alone and not a graph output.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import onnx

from normgrad.graphs.context import GradientContext
from normgrad.graphs.patterns.registry import GraphView, Match, register
from normgrad.graphs.patterns._declarative import Binding, ChainPattern
from normgrad.graphs.patterns._row_norm import float_input
from normgrad.graphs.rules.activations import activation_gradient

__all__ = ["PATTERN", "match_chain", "match_gelu_erf_chain"]

PATTERN = "gelu_erf_chain"


def _erf_plus_one(op, x, root2, one):
    return op.Add(op.Erf(op.Div(x, root2, _outputs=["scaled"])), one, _outputs=["twice_cdf"])


def _dynamo(op, x, root2, one, half):
    return op.Mul(x, op.Mul(_erf_plus_one(op, x, root2, one), half, _outputs=["cdf"]))


def _torchscript(op, x, root2, one, half):
    return op.Mul(op.Mul(x, _erf_plus_one(op, x, root2, one)), half)


_CHAIN = ChainPattern("the written-out GELU", _dynamo, _torchscript, differentiable=("x",))

_CONSTANTS = {"root2": math.sqrt(2.0), "one": 1.0, "half": 0.5}


def match_chain(view: GraphView, ctx: GradientContext, anchor: onnx.NodeProto
                ) -> Optional[Tuple[Dict[str, Binding], List[onnx.NodeProto]]]:
    """(the chain's variables: x, scaled, twice_cdf, cdf (dynamo's order), root2, one, half;
    its nodes) if the strictly checked chain ends at ``anchor``, else None. Also the forward
    rewrite ``normgrad.graphs.rewrites.gelu_erf_slopes``'s matcher."""
    found = _CHAIN.match_scalars(view, ctx, anchor, "Erf", _CONSTANTS)
    if found is None or not float_input(ctx, found[0]["x"]):
        return None
    return found


@register(PATTERN)
def match_gelu_erf_chain(view: GraphView, ctx: GradientContext, anchor: onnx.NodeProto) -> Optional[Match]:
    """The chain ending at ``anchor``, or None."""
    found = match_chain(view, ctx, anchor)
    if found is None:
        return None
    bound, nodes = found
    x = bound["x"]
    scaled, twice_cdf, cdf = bound["scaled"], bound["twice_cdf"], bound.get("cdf")

    def gradient(ctx: GradientContext, dy: str) -> List[Tuple[str, str]]:
        known = {"scaled": scaled, "twice_cdf": twice_cdf, "cdf": cdf, "root2": bound["root2"]}
        return [(x, activation_gradient(ctx, "gelu_erf", dy, x, {k: v for k, v in known.items() if v}))]

    return Match(PATTERN, anchor, nodes, gradient)
