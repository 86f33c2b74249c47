"""The RMSNorm chains torch's exporters write: one ``RMSNormalizationGrad``.

transformers' LlamaRMSNorm (and its many copies), ``w * (x.float() * rsqrt(mean(x², -1) +
eps)).to(dtype)``, and the dynamo exporter's ``nn.RMSNorm`` decomposition:

    ms   = ReduceMean(Pow(x, 2) | Mul(x, x), axes)      # axes a..r-1, keepdims
    rms  = Sqrt(Add(ms, eps))
    n    = Mul(x, Reciprocal(rms)) | Mul(x, Div(1, rms)) | Div(x, rms)
    y    = Mul(Cast(n) | n, w) | Cast(n) | n             # any operand order

(TorchScript writes Div(1, Sqrt) and Casts even to the same type, dynamo Reciprocal(Sqrt);
TorchScript cannot export ``nn.RMSNorm`` itself: ``aten::rms_norm`` has no ONNX symbolic
below opset 23.) Node by node, its gradient takes about eight passes over the data; here it
is one ``RMSNormalizationGrad``, reading the chain's own 1 / rms (or 1 / rms of its Sqrt,
per row). x is the value the chain normalises, i.e. the output of the Cast to float32 where
there is one: TorchScript lets the residual Add read that same Cast, so the Cast cannot be
part of the chain (its gradient goes through the Cast rule).

Matched with onnxscript's rewriter (:mod:`normgrad.graphs.patterns._declarative`), then
checked strictly, else the per-node rules apply: the ReduceMean over trailing axes a..r-1
with keepdims; the Cast after the normalisation to a float type; eps one value that needs no gradient; w
broadcasting to x along the axes >= a only, the product of x's shape; each intermediate
value read by the chain alone and not a graph output.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import onnx

from normgrad.graphs.context import GradientContext
from normgrad.graphs.patterns.registry import GraphView, Match, register
from normgrad.graphs.patterns._declarative import ChainPattern, or_value
from normgrad.graphs.patterns._row_norm import casts_to_float, match_row_norm
from normgrad.graphs.rules.layer_norm import row_norm_gradient

__all__ = ["PATTERN", "match_rms_norm_chain"]

PATTERN = "rms_norm_chain"


# tag_var on every OrValue that is not a choice between op types: onnxscript 0.7.2 cannot
# commute (clone) such an OrValue without one


def _rms(op, x, eps):
    squared = or_value([op.Pow(x, 2.0), op.Mul(x, x)])
    mean_square = op.ReduceMean(squared, _allow_other_inputs=True, _outputs=["mean_square"])
    return op.Sqrt(op.Add(mean_square, eps), _outputs=["rms"])


def _times_inverse(op, x, eps):
    rms = _rms(op, x, eps)
    inverse = or_value([op.Reciprocal(rms, _outputs=["inv_rms"]), op.Div(1.0, rms, _outputs=["one_over_rms"])])
    return op.Mul(x, inverse)


def _divided(op, x, eps):
    return op.Div(x, _rms(op, x, eps))


def _normalised(op, x, eps):
    return or_value([_times_inverse(op, x, eps), _divided(op, x, eps)], tag_var="times_or_divided")


def _scaled(op, x, eps, w):
    normalised = _normalised(op, x, eps)
    cast_or_not = or_value([op.Cast(normalised, _outputs=["cast_out"]), normalised], tag_var="cast_out_or_not")
    return op.Mul(cast_or_not, w, _outputs=["scaled"])


def _cast(op, x, eps):
    return op.Cast(_normalised(op, x, eps), _outputs=["cast_out"])


_CHAIN = ChainPattern("the written-out RMSNorm", _scaled, _cast, _times_inverse, _divided, differentiable=("x", "w"))


@register(PATTERN)
def match_rms_norm_chain(view: GraphView, ctx: GradientContext, anchor: onnx.NodeProto) -> Optional[Match]:
    """The chain ending at ``anchor``, or None."""
    chain = match_row_norm(view, ctx, anchor, _CHAIN, ("Mul", "Cast", "Div"), "mean_square")
    if chain is None or not casts_to_float(view, chain.bound.get("cast_out")):
        return None
    x, w, axis = chain.x, chain.w, chain.axis
    rms, inv_rms = chain.bound["rms"], chain.bound.get("inv_rms") or chain.bound.get("one_over_rms")

    def gradient(ctx: GradientContext, dy: str) -> List[Tuple[str, str]]:
        dx, dscale, _ = row_norm_gradient(
            ctx, "RMSNormalizationGrad", dy, anchor.output[0], x, w, [(inv_rms or ctx.op("Reciprocal", rms), rms)], axis
        )
        return [(name, grad) for name, grad in ((x, dx), (w, dscale)) if grad is not None and ctx.needs_grad(name)]

    return Match(PATTERN, anchor, chain.nodes, gradient)
