"""The decomposed LayerNorm chain: one ``LayerNormalizationGrad``.

torch's TorchScript exporter before opset 17 writes ``nn.LayerNorm`` this way (and every
exporter writes hand-written LayerNorms, e.g. older transformers code, this way):

    mean = ReduceMean(x, axes)                 # axes a..r-1, keepdims
    d    = Sub(x, mean), or Cast of it         # float16 below opset 17: cast to double
    var  = ReduceMean(Pow(d, 2) | Mul(d, d), axes)
    std  = Sqrt(Add(var, eps))
    n    = Div(d, std) | Mul(d, Reciprocal(std)), or Cast of it (back to float16)
    y    = n | Mul(n, w) | Add(Mul(n, w), b)   # any operand order

Node by node, its gradient takes about ten passes over the data; here it is one
``LayerNormalizationGrad`` reading the chain's own statistics (``mean``, and the
Reciprocal's output or 1 / std: per-row values, no pass over the data).

Matched (onnxscript's rewriter, :mod:`normgrad.graphs.patterns._declarative`), then
checked strictly, else the per-node rules apply: both ReduceMeans over the same trailing
axes a..r-1 with keepdims; Casts to float types (axes as attribute, constant input, or a Reshape of constants);
eps one value that needs no gradient; w broadcasting to x along the axes >= a only; the
affine outputs of x's shape (b may then be anything: its gradient is dy summed to its
shape); each intermediate value read by the chain alone and not a graph output.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import onnx

from normgrad.graphs.context import GradientContext
from normgrad.graphs.patterns.registry import GraphView, Match, register
from normgrad.graphs.patterns._declarative import ChainPattern, or_value
from normgrad.graphs.patterns._row_norm import casts_to_float, float_input, keeps_shape, match_row_norm, normalised_axis
from normgrad.graphs.rules.layer_norm import row_norm_gradient

__all__ = ["PATTERN", "match_layer_norm_chain"]

PATTERN = "layer_norm_chain"


# tag_var on every OrValue that is not a choice between op types: onnxscript 0.7.2 cannot
# commute (clone) such an OrValue without one


def _centred(op, x):
    """x - mean(x), or that cast: TorchScript below opset 17 casts a float16 LayerNorm's
    centred values to double and the normalised result back."""
    centred = op.Sub(x, op.ReduceMean(x, _allow_other_inputs=True, _outputs=["mean"]), _outputs=["centred"])
    return or_value([op.Cast(centred, _outputs=["centred_cast"]), centred], tag_var="centred_cast_or_not")


def _std(op, centred, eps):
    squared = or_value([op.Pow(centred, 2.0), op.Mul(centred, centred)])
    variance = op.ReduceMean(squared, _allow_other_inputs=True, _outputs=["variance"])
    return op.Sqrt(op.Add(variance, eps), _outputs=["std"])


def _divided(op, x, eps):
    centred = _centred(op, x)
    return op.Div(centred, _std(op, centred, eps))


def _reciprocal(op, x, eps):
    centred = _centred(op, x)
    return op.Mul(centred, op.Reciprocal(_std(op, centred, eps), _outputs=["inv_std"]))


def _normalised(op, x, eps):
    """The normalised values, cast back or not."""
    normalised = or_value([_divided(op, x, eps), _reciprocal(op, x, eps)])
    return or_value([op.Cast(normalised, _outputs=["cast_out"]), normalised], tag_var="cast_out_or_not")


def _with_bias(op, x, eps, w, b):
    return op.Add(op.Mul(_normalised(op, x, eps), w, _outputs=["scaled"]), b)


def _with_scale(op, x, eps, w):
    return op.Mul(_normalised(op, x, eps), w, _outputs=["scaled"])


def _cast(op, x, eps):
    return op.Cast(or_value([_divided(op, x, eps), _reciprocal(op, x, eps)]), _outputs=["cast_out"])


_CHAIN = ChainPattern("the decomposed LayerNorm", _with_bias, _with_scale, _cast, _divided, _reciprocal, differentiable=("x", "w", "b"))


@register(PATTERN)
def match_layer_norm_chain(view: GraphView, ctx: GradientContext, anchor: onnx.NodeProto) -> Optional[Match]:
    """The chain ending at ``anchor``, or None."""
    chain = match_row_norm(view, ctx, anchor, _CHAIN, ("Add", "Mul", "Div", "Cast"), "variance")
    if chain is None or not (casts_to_float(view, chain.bound.get("centred_cast")) and casts_to_float(view, chain.bound.get("cast_out"))):
        return None
    bound, x, w, axis = chain.bound, chain.x, chain.w, chain.axis
    if normalised_axis(view, ctx, view.producer[bound["mean"]], len(ctx.shape(x))) != axis:
        return None
    b = bound.get("b")
    if b is not None and not (float_input(ctx, b) and keeps_shape(ctx, anchor.output[0], x)):
        return None
    mean, std, inv_std = bound["mean"], bound["std"], bound.get("inv_std")

    def gradient(ctx: GradientContext, dy: str) -> List[Tuple[str, str]]:
        inv_std_dev = inv_std or ctx.op("Reciprocal", std)
        dx, dscale, dbias = row_norm_gradient(
            ctx, "LayerNormalizationGrad", dy, anchor.output[0], x, w, [(mean, mean), (inv_std_dev, std)], axis, b
        )
        grads = [(x, dx), (w, dscale), (b, dbias)]
        return [(name, grad) for name, grad in grads if grad is not None and ctx.needs_grad(name)]

    return Match(PATTERN, anchor, chain.nodes, gradient)
