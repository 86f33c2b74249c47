"""The decomposed LayerNorm chain: one ``LayerNormalizationGrad``.

torch's TorchScript exporter before opset 17 writes ``nn.LayerNorm`` this way (and every
exporter writes hand-written LayerNorms, e.g. older transformers code, this way):

    mean = ReduceMean(x, axes)                 # axes a..r-1, keepdims
    d    = Sub(x, mean)
    var  = ReduceMean(Pow(d, 2) | Mul(d, d), axes)
    std  = Sqrt(Add(var, eps))
    n    = Div(d, std) | Mul(d, Reciprocal(std))
    y    = n | Mul(n, w) | Add(Mul(n, w), b)   # any operand order

Node by node, its gradient takes about ten passes over the data; here it is one
``LayerNormalizationGrad`` reading the chain's own statistics (``mean``, and the
Reciprocal's output or 1 / std: per-row values, no pass over the data).

Matched (onnxscript's rewriter, :mod:`normgrad.graphs.patterns._declarative`), then
checked strictly, else the per-node rules apply: both ReduceMeans over the same trailing
axes a..r-1 with keepdims (axes as attribute, constant input, or a Reshape of constants);
eps one value that needs no gradient; w broadcasting to x along the axes >= a only; the
affine outputs of x's shape (b may then be anything: its gradient is dy summed to its
shape); each intermediate value read by the chain alone and not a graph output.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import onnx

from normgrad.graphs.context import GradientContext
from normgrad.graphs.patterns import GraphView, Match, register
from normgrad.graphs.patterns._declarative import ChainPattern, _pattern
from normgrad.graphs.patterns._row_norm import float_input, keeps_shape, match_row_norm, normalised_axis
from normgrad.graphs.rules.layer_norm import row_norm_gradient

__all__ = ["PATTERN", "match_layer_norm_chain"]

PATTERN = "layer_norm_chain"


def _centred(op, x):
    return op.Sub(x, op.ReduceMean(x, _allow_other_inputs=True, _outputs=["mean"]), _outputs=["centred"])


def _std(op, centred, eps):
    squared = _pattern.OrValue([op.Pow(centred, 2.0), op.Mul(centred, centred)])
    variance = op.ReduceMean(squared, _allow_other_inputs=True, _outputs=["variance"])
    return op.Sqrt(op.Add(variance, eps), _outputs=["std"])


def _normalised(op, x, eps):
    centred = _centred(op, x)
    std = _std(op, centred, eps)
    return _pattern.OrValue([op.Div(centred, std), op.Mul(centred, op.Reciprocal(std, _outputs=["inv_std"]))])


def _with_bias(op, x, eps, w, b):
    return op.Add(op.Mul(_normalised(op, x, eps), w, _outputs=["scaled"]), b)


def _with_scale(op, x, eps, w):
    return op.Mul(_normalised(op, x, eps), w, _outputs=["scaled"])


def _divided(op, x, eps):
    centred = _centred(op, x)
    return op.Div(centred, _std(op, centred, eps))


def _reciprocal(op, x, eps):
    centred = _centred(op, x)
    return op.Mul(centred, op.Reciprocal(_std(op, centred, eps), _outputs=["inv_std"]))


_CHAIN = ChainPattern("the decomposed LayerNorm", _with_bias, _with_scale, _divided, _reciprocal, differentiable=("x", "w", "b"))


@register(PATTERN)
def match_layer_norm_chain(view: GraphView, ctx: GradientContext, anchor: onnx.NodeProto) -> Optional[Match]:
    """The chain ending at ``anchor``, or None."""
    chain = match_row_norm(view, ctx, anchor, _CHAIN, ("Add", "Mul", "Div"), "variance")
    if chain is None:
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
            ctx, "LayerNormalizationGrad", dy, anchor.output[0], x, w, [mean, inv_std_dev], axis, b
        )
        grads = [(x, dx), (w, dscale), (b, dbias)]
        return [(name, grad) for name, grad in grads if grad is not None and ctx.needs_grad(name)]

    return Match(PATTERN, anchor, chain.nodes, gradient)
