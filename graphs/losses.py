"""The losses ``build_training_graph`` can append: their forward nodes and their gradient.

Each loss is a scalar mean, and its gradient with respect to the model output is written
in closed form (the loss nodes themselves are never differentiated).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext

__all__ = ["LOSSES", "LossNodes", "append_loss"]


@dataclasses.dataclass
class LossNodes:
    """What a loss adds to the training graph.

    Attributes:
        labels: the ``labels`` graph input.
        loss: name of the scalar loss value.
        grad: name of the gradient of the loss with respect to the model output.
    """

    labels: onnx.ValueInfoProto
    loss: str
    grad: str


def _mse(ctx: GradientContext, output: str, labels: str) -> tuple:
    """mean((y - labels)^2); d/dy = 2 (y - labels) / size(y)."""
    diff = ctx.op("Sub", output, labels)
    loss = ctx.reduce("ReduceMean", ctx.op("Mul", diff, diff), None, keepdims=False)
    scale = ctx.op("Div", ctx.scalar(2.0, output), ctx.op("CastLike", ctx.op("Size", output), output))
    return loss, ctx.op("Mul", diff, scale)


def _cross_entropy(ctx: GradientContext, output: str, labels: str) -> tuple:
    """mean over samples of -log_softmax(y, axis=1)[labels]; d/dy = (softmax(y) - onehot) / count."""
    log_probs = ctx.op("LogSoftmax", output, axis=1)
    picked = ctx.op("GatherElements", log_probs, ctx.unsqueeze(labels, [1]), axis=1)
    loss = ctx.op("Neg", ctx.reduce("ReduceMean", picked, None, keepdims=False))
    values = ctx.op("CastLike", ctx.op("Constant", value=onh.from_array(np.array([0.0, 1.0], np.float32))), output)
    # depth as a scalar: onnx's ReferenceEvaluator rejects the [1]-shaped form the spec allows.
    depth = ctx.op("Squeeze", ctx.shape_of(output, start=1, end=2), ctx.ints([0]))
    onehot = ctx.op("OneHot", labels, depth, values, axis=1)
    count = ctx.op("CastLike", ctx.op("Size", labels), output)
    return loss, ctx.op("Div", ctx.op("Sub", ctx.op("Softmax", output, axis=1), onehot), count)


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


def _smooth_l1(ctx: GradientContext, output: str, labels: str) -> tuple:
    """torch's smooth_l1_loss with beta 1: mean(0.5 d^2 where |d| < 1 else |d| - 0.5);
    d/dy = clip(d, -1, 1) / size(y)."""
    diff = ctx.op("Sub", output, labels)
    size = ctx.op("Abs", diff)
    values = ctx.op("Where", ctx.op("Less", size, ctx.scalar(1.0, output)),
                    ctx.op("Mul", ctx.op("Mul", diff, diff), ctx.scalar(0.5, output)),
                    ctx.op("Sub", size, ctx.scalar(0.5, output)))
    loss, scale = _mean_and_scale(ctx, values, output)
    clipped = ctx.op("Clip", diff, ctx.scalar(-1.0, output), ctx.scalar(1.0, output))
    return loss, ctx.op("Mul", clipped, scale)


LOSSES: Dict[str, Callable] = {
    "mse": _mse,
    "cross_entropy": _cross_entropy,
    "bce_with_logits": _bce_with_logits,
    "l1": _l1,
    "smooth_l1": _smooth_l1,
}
"""Loss name -> ``fn(ctx, output, labels) -> (loss, grad)``."""


def labels_info(kind: str, output: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    """The ``labels`` input a loss needs: y's type for the elementwise losses, int64 y.shape without axis 1 for cross_entropy."""
    tensor = output.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim]
    if kind != "cross_entropy":
        return oh.make_tensor_value_info("labels", tensor.elem_type, dims)
    if len(dims) < 2:
        raise ValueError(f"cross_entropy needs a model output of rank >= 2 ([N, classes, ...]); '{output.name}' has {dims}")
    return oh.make_tensor_value_info("labels", onnx.TensorProto.INT64, dims[:1] + dims[2:])


def append_loss(ctx: GradientContext, kind: str, output: onnx.ValueInfoProto) -> LossNodes:
    """Emits the ``kind`` loss of forward ``output`` through ``ctx``.

    Raises:
        ValueError: unknown loss.
    """
    if kind not in LOSSES:
        raise ValueError(f"unknown loss {kind!r}; choose one of {sorted(LOSSES)}")
    labels = labels_info(kind, output)
    loss, grad = LOSSES[kind](ctx, output.name, labels.name)
    return LossNodes(labels, loss, grad)
