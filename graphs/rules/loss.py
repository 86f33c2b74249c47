"""SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss: the losses a model computes itself
(torch's ``cross_entropy`` and ``nll_loss`` as the exporters write them), for ``loss_output``.

Both read, per sample (every position of labels [N, d1, ...]), the class its label names in
x [N, C, d1, ...]: loss_i = -w[t_i] x[i, t_i] (x the log-probabilities: NegativeLogLikelihoodLoss's
input, LogSoftmax of SoftmaxCrossEntropyLoss's scores), 0 where t_i is ``ignore_index``;
w is the optional class weights (1 without). The reduction is none, sum, or mean: the sum
divided by the sum of w[t_i] over the samples not ignored. So each sample's loss has the
gradient factor c_i = dy_i w[t_i] (dy_i / sum w for mean), and
d/dx = -c_i at the label (NegativeLogLikelihoodLoss: one ScatterElements);
d/dscores = c_i softmax(scores) - c_i at the label
(:func:`~normgrad.ops.softmax_cross_entropy.softmax_cross_entropy_gradient`), plus, when the
log-probabilities output is read, its gradient g through LogSoftmax: g - softmax sum_c g.
The labels and weights get no gradient.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.ops.softmax_cross_entropy import softmax_cross_entropy_gradient
from normgrad.graphs.rules.registry import UnsupportedOperatorError, register

__all__ = ["softmax_cross_entropy_loss_gradient"]


def _int64(ctx: GradientContext, value: int) -> str:
    return ctx.op("Constant", value=onh.from_array(np.asarray(value, np.int64)))


def _sample_factor(ctx: GradientContext, node: onnx.NodeProto, dy: str, x: str) -> tuple:
    """(c, index): each sample's gradient factor c (a scalar, or shaped [N, 1, d1, ...]) and
    the labels as int64 [N, 1, d1, ...] with ignored ones replaced by class 0."""
    labels = ctx.op("Cast", node.input[1], to=onnx.TensorProto.INT64)
    weights = node.input[2] if len(node.input) > 2 and node.input[2] else None
    reduction = attr(node, "reduction", "mean")
    if reduction not in ("none", "sum", "mean"):
        raise UnsupportedOperatorError(f"{describe(node)}: unknown reduction {reduction!r}")
    ignore_index = attr(node, "ignore_index", None)
    per_sample = None  # w[t_i] (0 where ignored); None: 1 everywhere
    if ignore_index is not None:
        ignored = ctx.op("Equal", labels, _int64(ctx, ignore_index))
        labels = ctx.op("Where", ignored, _int64(ctx, 0), labels)
        per_sample = ctx.op("CastLike", ctx.op("Not", ignored), x)
    if weights is not None:
        picked = ctx.op("Gather", weights, labels, axis=0)
        per_sample = picked if per_sample is None else ctx.op("Mul", picked, per_sample)
    factor = dy
    if reduction == "mean":
        total = (ctx.op("CastLike", ctx.op("Size", labels), x) if per_sample is None
                 else ctx.reduce("ReduceSum", per_sample, None, keepdims=False))
        factor = ctx.op("Div", dy, total)
    if per_sample is not None:
        factor = ctx.op("Mul", factor, per_sample)
    if reduction == "none" or per_sample is not None:
        factor = ctx.unsqueeze(factor, [1])
    return factor, ctx.unsqueeze(labels, [1])


@register("SoftmaxCrossEntropyLoss", outputs=(0, 1), min_opset=16)
def softmax_cross_entropy_loss_gradient(
    ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]
) -> List[Optional[str]]:
    """c softmax(scores) - c at the label, plus the log-probabilities' gradient through LogSoftmax."""
    scores = node.input[0]
    dy, dlog_prob = grads[0], (grads[1] if len(grads) > 1 else None)
    probs = ctx.op("Softmax", scores, axis=1)
    grad = None
    if dy is not None:
        factor, index = _sample_factor(ctx, node, dy, scores)
        grad = softmax_cross_entropy_gradient(ctx, probs, index, factor)
    if dlog_prob is not None:
        through = ctx.op("Sub", dlog_prob, ctx.op("Mul", probs, ctx.reduce("ReduceSum", dlog_prob, [1], keepdims=True)))
        grad = through if grad is None else ctx.op("Add", grad, through)
    return [grad]


@register("NegativeLogLikelihoodLoss", min_opset=16)
def negative_log_likelihood_loss_gradient(
    ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]
) -> List[Optional[str]]:
    """-c written at each sample's label into zeros shaped like x."""
    x = node.input[0]
    factor, index = _sample_factor(ctx, node, grads[0], x)
    updates = ctx.op("Expand", ctx.op("Neg", factor), ctx.shape_of(index))
    return [ctx.op("ScatterElements", ctx.zeros_like(x), index, updates, axis=1)]
