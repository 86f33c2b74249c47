"""The losses ``build_training_graph`` can append: their forward nodes and their gradient.

Each loss is a scalar mean, and its gradient with respect to the model output is written
in closed form (the loss nodes themselves are never differentiated).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Mapping, Optional

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext
from normgrad.ops import DOMAIN, bias_softmax_cross_entropy, softmax_cross_entropy
from normgrad.ops.softmax_cross_entropy import cross_entropy_standard_ops

__all__ = ["LOSSES", "LOSS_OPTIONS", "LossNodes", "BiasAdd", "append_loss", "bias_add_before"]


@dataclasses.dataclass
class LossNodes:
    """What a loss adds to the training graph.

    Attributes:
        labels: the ``labels`` graph input.
        loss: name of the scalar loss value.
        seeds: {value: the loss's gradient with respect to it}: the model output's, or, when
            the loss absorbed the output's bias Add (:func:`bias_add_before`), the Add's
            other input's and the bias's (those that need one).
        elem_type: the loss's element type (the output's, float32 for causal_lm).
    """

    labels: onnx.ValueInfoProto
    loss: str
    seeds: Dict[str, str]
    elem_type: int


@dataclasses.dataclass
class BiasAdd:
    """The Add of a float32 [C] ``bias`` over the last axis of float32 ``x`` (last axis C),
    whose result reaches the loss's model output through Reshapes alone."""

    x: str
    bias: str
    classes: int
    add: onnx.NodeProto


def bias_add_before(graph: onnx.GraphProto, ctx: GradientContext, output: str) -> Optional[BiasAdd]:
    """The bias Add ``output`` comes from, when the loss may read its inputs instead: ``output``
    is Add(x, bias) or Reshapes of it, the Add's result and the Reshapes' read by nothing else
    and (but ``output``) no graph outputs, ``bias`` float32 of static shape [C], ``x`` float32
    with last axis C, ``output``'s last axis C (so every Reshape keeps each element's column).
    None otherwise (the loss then reads ``output``)."""
    readers: Dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    graph_outputs = {o.name for o in graph.output}
    shape = ctx.shape(output)
    value, node = output, ctx.producer(output)
    while node is not None and node.op_type == "Reshape" and node.domain in ("", "ai.onnx"):
        value, node = node.input[0], ctx.producer(node.input[0])
        if readers.get(value, 0) != 1 or value in graph_outputs:
            return None
    if node is None or node.op_type != "Add" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    for x, bias in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
        bias_shape, x_shape = ctx.static_shape(bias), ctx.shape(x)
        if (x != bias and bias_shape is not None and len(bias_shape) == 1 and x_shape
                and x_shape[-1] == bias_shape[0] and shape and shape[-1] == bias_shape[0]
                and ctx.elem_type(x) == ctx.elem_type(bias) == onnx.TensorProto.FLOAT):
            return BiasAdd(x, bias, bias_shape[0], node)
    return None


def _mse(ctx: GradientContext, output: str, labels: str) -> tuple:
    """mean((y - labels)^2); d/dy = 2 (y - labels) / size(y)."""
    diff = ctx.op("Sub", output, labels)
    loss = ctx.reduce("ReduceMean", ctx.op("Mul", diff, diff), None, keepdims=False)
    scale = ctx.op("Div", ctx.scalar(2.0, output), ctx.op("CastLike", ctx.op("Size", output), output))
    return loss, ctx.op("Mul", diff, scale)


def _cross_entropy(ctx: GradientContext, output: str, labels: str, label_smoothing: float = 0.0,
                   ignore_index: Optional[int] = None, matrix: Optional[bool] = None,
                   bias_add: Optional[BiasAdd] = None) -> tuple:
    """torch's ``cross_entropy`` with class-index labels, ``reduction="mean"``: over the
    samples whose label is not ``ignore_index`` (all when None), the mean of
    (1 - ls)(-log_softmax(y)[label]) + ls/C (-sum_c log_softmax(y)_c);
    d/dy = (softmax(y) - (1 - ls) onehot - ls/C) / count on those samples, 0 on the others.

    Float32 [N, C] logits (``matrix``; None: y's known type and rank say) without label
    smoothing: one ``normgrad:SoftmaxCrossEntropy`` node, whose function body is
    :func:`cross_entropy_standard_ops`; the other cases are written in standard ops. With
    ``bias_add`` (y = x + bias, through Reshapes): one ``normgrad:BiasSoftmaxCrossEntropy``
    of x as [N, C] and the bias instead, so that y and its bias's gradient are never passes
    of their own; the returned gradient is then {x: ..., bias: ...}, else y's."""
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if matrix is None:
        matrix = ctx.elem_type(output) == onnx.TensorProto.FLOAT and ctx.known_rank(output) == 2
    if matrix and not label_smoothing:
        ignored = {} if ignore_index is None else {"ignore_index": ignore_index}
        if bias_add is not None:
            rows = ctx.op("Reshape", bias_add.x, ctx.ints([-1, bias_add.classes]))
            loss, grad, bias_grad = ctx.op(bias_softmax_cross_entropy.OP_TYPE, rows, labels, bias_add.bias, outputs=3,
                                           domain=DOMAIN, **ignored)
            grads = {bias_add.bias: bias_grad} if ctx.needs_grad(bias_add.bias) else {}
            if ctx.needs_grad(bias_add.x):
                grads[bias_add.x] = ctx.reshape_like(grad, bias_add.x)
            return loss, grads
        loss, grad = ctx.op(softmax_cross_entropy.OP_TYPE, output, labels, outputs=2, domain=DOMAIN, **ignored)
        shape = ctx.shape(output)
        if shape is not None and all(d is not None for d in shape):  # the gradient may then take y's buffer
            ctx.declare_shape(grad, onnx.TensorProto.FLOAT, shape)
        return loss, grad
    return cross_entropy_standard_ops(ctx, output, labels, label_smoothing, ignore_index)


CAUSAL_LM_TOKENS = "causal_lm_tokens"
"""The dim_param of the causal-LM loss's [tokens, vocabulary] logits and their gradient."""


def _causal_lm(ctx: GradientContext, output: str, labels: str, ignore_index: int = -100) -> tuple:
    """transformers' causal-LM loss of logits y [batch, sequence, vocabulary] and token labels
    [batch, sequence]: position t predicts label t + 1 (the last position predicts nothing),
    then :func:`_cross_entropy` over every position whose shifted label is not
    ``ignore_index``, in float32 whatever y's type (transformers upcasts the logits); the
    gradient is reshaped back to y's shape and type."""
    logits = output
    if ctx.elem_type(output) != onnx.TensorProto.FLOAT:
        logits = ctx.op("Cast", output, to=onnx.TensorProto.FLOAT)
    beyond = ctx.op("Constant", value=onh.from_array(np.array(ignore_index, np.int64)))
    following = ctx.op("Slice", labels, ctx.ints([1]), ctx.ints([np.iinfo(np.int64).max]), ctx.ints([1]))
    shifted = ctx.op("Pad", following, ctx.ints([0, 0, 0, 1]), beyond)
    rows = ctx.op("Concat", ctx.ints([-1]), ctx.shape_of(output, start=-1), axis=0)
    matrix = ctx.op("Reshape", logits, rows)
    vocabulary = (ctx.shape(output) or [None])[-1]
    if isinstance(vocabulary, int):  # [tokens, vocabulary], a shape the gradient's declaration repeats
        ctx.declare_shape(matrix, onnx.TensorProto.FLOAT, [CAUSAL_LM_TOKENS, vocabulary])
    loss, grad = _cross_entropy(ctx, matrix, ctx.op("Reshape", shifted, ctx.ints([-1])),
                                ignore_index=ignore_index, matrix=True)
    grad = ctx.reshape_like(grad, output)
    return loss, grad if logits == output else ctx.op("CastLike", grad, output)


def _mean_and_scale(ctx: GradientContext, values: str, output: str) -> tuple:
    """mean(values) and the gradient factor 1 / size(y)."""
    loss = ctx.reduce("ReduceMean", values, None, keepdims=False)
    return loss, ctx.op("Div", ctx.scalar(1.0, output), ctx.op("CastLike", ctx.op("Size", output), output))


def _bce_with_logits(ctx: GradientContext, output: str, labels: str) -> tuple:
    """mean(max(y, 0) - y t + log(1 + exp(-|y|))) (stable softplus); d/dy = (sigmoid(y) - t) / size(y)."""
    softplus_tail = ctx.op("Log", ctx.op("Add", ctx.scalar(1.0, output), ctx.op("Exp", ctx.op("Neg", ctx.op("Abs", output)))))
    values = ctx.op("Add", ctx.op("Sub", ctx.op("Relu", output), ctx.op("Mul", output, labels)), softplus_tail)
    loss, scale = _mean_and_scale(ctx, values, output)
    return loss, ctx.op("Mul", ctx.op("Sub", ctx.op("Sigmoid", output), labels), scale)


def _l1(ctx: GradientContext, output: str, labels: str) -> tuple:
    """mean|y - t|; d/dy = sign(y - t) / size(y) (0 where y = t, as torch)."""
    diff = ctx.op("Sub", output, labels)
    loss, scale = _mean_and_scale(ctx, ctx.op("Abs", diff), output)
    return loss, ctx.op("Mul", ctx.op("Sign", diff), scale)


def _smooth_l1(ctx: GradientContext, output: str, labels: str, beta: float = 1.0) -> tuple:
    """torch's smooth_l1_loss: mean(0.5 d^2 / beta where |d| < beta else |d| - 0.5 beta)
    (l1 at beta 0); d/dy = clip(d / beta, -1, 1) / size(y)."""
    if not beta >= 0:
        raise ValueError(f"smooth_l1 beta must be >= 0, got {beta!r}")
    if beta == 0:
        return _l1(ctx, output, labels)
    diff = ctx.op("Sub", output, labels)
    size = ctx.op("Abs", diff)
    beta_value = ctx.scalar(beta, output)
    values = ctx.op("Where", ctx.op("Less", size, beta_value),
                    ctx.op("Div", ctx.op("Mul", ctx.op("Mul", diff, diff), ctx.scalar(0.5, output)), beta_value),
                    ctx.op("Sub", size, ctx.scalar(0.5 * beta, output)))
    loss, scale = _mean_and_scale(ctx, values, output)
    clipped = ctx.op("Clip", ctx.op("Div", diff, beta_value), ctx.scalar(-1.0, output), ctx.scalar(1.0, output))
    return loss, ctx.op("Mul", clipped, scale)


LOSSES: Dict[str, Callable] = {
    "mse": _mse,
    "cross_entropy": _cross_entropy,
    "causal_lm": _causal_lm,
    "bce_with_logits": _bce_with_logits,
    "l1": _l1,
    "smooth_l1": _smooth_l1,
}
"""Loss name -> ``fn(ctx, output, labels, **options) -> (loss, grad)``."""

LOSS_OPTIONS: Dict[str, tuple] = {"cross_entropy": ("label_smoothing", "ignore_index"), "smooth_l1": ("beta",),
                                   "causal_lm": ("ignore_index",)}
"""The keyword options each loss takes (torch's names)."""


def labels_info(kind: str, output: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    """The ``labels`` input a loss needs: y's type for the elementwise losses, int64 y.shape
    without axis 1 for cross_entropy, int64 [batch, sequence] for causal_lm."""
    tensor = output.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim]
    if kind == "causal_lm":
        if len(dims) != 3:
            raise ValueError(f"causal_lm needs logits of rank 3 ([batch, sequence, vocabulary]); '{output.name}' has {dims}")
        return oh.make_tensor_value_info("labels", onnx.TensorProto.INT64, dims[:2])
    if kind != "cross_entropy":
        return oh.make_tensor_value_info("labels", tensor.elem_type, dims)
    if len(dims) < 2:
        raise ValueError(f"cross_entropy needs a model output of rank >= 2 ([N, classes, ...]); '{output.name}' has {dims}")
    return oh.make_tensor_value_info("labels", onnx.TensorProto.INT64, dims[:1] + dims[2:])


def append_loss(ctx: GradientContext, kind: str, output: onnx.ValueInfoProto,
                options: Optional[Mapping[str, object]] = None, bias_add: Optional[BiasAdd] = None) -> LossNodes:
    """Emits the ``kind`` loss of forward ``output`` through ``ctx``, with ``options`` (see :data:`LOSS_OPTIONS`);
    ``bias_add``: the bias Add ``output`` comes from (:func:`bias_add_before`), which a float32
    [N, C] cross_entropy without label smoothing absorbs.

    Raises:
        ValueError: unknown loss, an option the loss does not take, or a value torch would refuse.
    """
    if kind not in LOSSES:
        raise ValueError(f"unknown loss {kind!r}; choose one of {sorted(LOSSES)}")
    options = dict(options or {})
    for name in options:
        if name not in LOSS_OPTIONS.get(kind, ()):
            takes = ", ".join(LOSS_OPTIONS.get(kind, ())) or "no options"
            raise ValueError(f"loss {kind} has no option {name!r} (it takes {takes})")
    labels = labels_info(kind, output)
    if kind == "cross_entropy" and bias_add is not None:
        options["bias_add"] = bias_add
    loss, grad = LOSSES[kind](ctx, output.name, labels.name, **options)
    seeds = grad if isinstance(grad, dict) else {output.name: grad}
    elem_type = onnx.TensorProto.FLOAT if kind == "causal_lm" else output.type.tensor_type.elem_type
    return LossNodes(labels, loss, seeds, elem_type)
