"""BatchNormalization (opsets 9-15 semantics after conversion; training_mode 0 and 1).

Training mode is rewritten before differentiation (:func:`make_batch_statistics_explicit`):
the batch statistics are computed once, in the forward, and the layer becomes a
BatchNormalization in inference mode fed with them. So

* the backward reuses the forward's mean and 1/std instead of recomputing them;
* every execution provider can run the forward (several refuse ``training_mode=1``);
* the running statistics are updated as torch's train mode does (momentum, unbiased
  variance for ``running_var``), whereas ONNX's ``training_mode=1`` outputs use the biased one;
* synchronized BatchNorm only needs an all-reduce at three points (``all_reduce``).

Backward, training mode: normgrad ``BatchNormReduceBackward`` gives the per-channel sums and
the scale/bias gradients, ``BatchNormElemtBackward`` gives dx. Eval mode: the running
statistics are constants, so dx = dy * scale / sqrt(running_var + eps) and the reduce op
gives the scale/bias gradients. The running statistics get no gradient.

Training-mode BatchNormalization → Relu (the Relu the only reader of Y) is differentiated by
:mod:`normgrad.graphs.patterns.batch_norm_relu` through :func:`batch_norm_backward` with the
Relu's output as the ops' ``relu_output``: the ReLU's gradient is masked inside the two ops
instead of written (step time -1.3% in-process on the ResNet block and ResNet-18, peak RSS
-43 and -24 MB; numbers in that module).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules.registry import register
from normgrad.graphs.rules._norm import as_float32, float32_scalar
from normgrad.ops import DOMAIN

__all__ = ["AllReduce", "BatchStatistics", "batch_norm_backward", "batch_norm_gradient", "make_batch_statistics_explicit"]

AllReduce = Callable[[GradientContext, str], str]
"""``all_reduce(ctx, value) -> name``: emits nodes summing float32 ``value`` over the ranks."""


@dataclasses.dataclass(frozen=True)
class BatchStatistics:
    """What the forward of one training-mode BatchNormalization computed, for its backward.

    Attributes:
        mean: float32 [C] batch mean.
        invstd: float32 [C] 1 / sqrt(batch variance + epsilon).
        x32: the layer's input as float32 (cast once, in the forward, when it is not).
        all_reduce: the all-reduce the statistics went through (None: this process's batch).
        count_ratio: float32 scalar, local count / global count (None without all-reduce).
        running_outputs: the updated running statistics it outputs; no gradient flows
            through them (they are state, not functions of the parameters to optimize).
    """

    mean: str
    invstd: str
    x32: str
    all_reduce: Optional[AllReduce] = None
    count_ratio: Optional[str] = None
    running_outputs: Tuple[str, ...] = ()


def _is_training(node: onnx.NodeProto) -> bool:
    return node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and bool(attr(node, "training_mode", 0))


def make_batch_statistics_explicit(
    graph: onnx.GraphProto, opset: int, all_reduce: Optional[AllReduce] = None
) -> Dict[str, BatchStatistics]:
    """Rewrites every training-mode BatchNormalization of ``graph`` (in place) as batch
    statistics plus a BatchNormalization in inference mode.

    Per channel, over the batch and spatial axes: sum(x) and the count (all-reduced
    together when ``all_reduce`` is given), mean, sum((x - mean)^2) (all-reduced), the
    biased variance. The node's running-statistics outputs, where named, become torch's
    train-mode update: momentum * running + (1 - momentum) * batch, with the unbiased
    variance (count / (count - 1)) for ``running_var``.

    Returns:
        {the layer's output Y: its :class:`BatchStatistics`}, for the gradient rule.
    """
    if not any(_is_training(node) for node in graph.node):
        return {}  # rewriting would copy every node of the graph
    writer = GradientContext(graph, opset, set())
    rewritten: List[onnx.NodeProto] = []
    found: Dict[str, BatchStatistics] = {}
    for node in graph.node:
        if not _is_training(node):
            rewritten.append(node)
            continue
        writer.nodes = []
        writer.scope(f"batch_norm/{node.name or node.output[0]}")
        found[node.output[0]] = _explicit_statistics(writer, node, all_reduce)
        rewritten.extend(writer.nodes)
    del graph.node[:]
    graph.node.extend(rewritten)
    return found


def _explicit_statistics(ctx: GradientContext, node: onnx.NodeProto, all_reduce: Optional[AllReduce]) -> BatchStatistics:
    x, scale, bias, running_mean, running_var = node.input[:5]
    epsilon = attr(node, "epsilon", 1e-5)
    momentum = attr(node, "momentum", 0.9)
    axes = [0] + list(range(2, ctx.rank(x, node)))
    x32 = as_float32(ctx, x, x)
    shape = ctx.shape_of(x)
    channels = ctx.op("Gather", shape, ctx.op("Constant", value=onh.from_array(np.asarray(1, np.int64))))
    count = ctx.op("Cast", ctx.op("Div", ctx.op("ReduceProd", shape, keepdims=0), channels), to=onnx.TensorProto.FLOAT)
    total = ctx.reduce("ReduceSum", x32, axes, keepdims=False)
    ratio = None
    if all_reduce is None:
        global_count = count
    else:
        packed = all_reduce(ctx, ctx.op("Concat", total, ctx.unsqueeze(count, [0]), axis=0))
        total = ctx.op("Slice", packed, ctx.ints([0]), ctx.ints([-1]))
        global_count = ctx.op("Squeeze", ctx.op("Slice", packed, ctx.ints([-1]), ctx.ints([np.iinfo(np.int64).max])))
        ratio = ctx.op("Div", count, global_count)
    mean = ctx.op("Div", total, global_count)
    per_channel = ctx.ints([1, -1] + [1] * (len(axes) - 1))
    centred = ctx.op("Sub", x32, ctx.op("Reshape", mean, per_channel))
    # BatchNormReduceBackward's sum_dy_xmu with dy = x - mean: the squared deviations summed in one
    # streamed pass (onnxruntime's ReduceSumSquare over (0, 2, 3) adds one element at a time,
    # 2-3x slower and about 100x further from the float64 sum on [16, 96, 64, 64]); invstd is
    # read only for grad_weight, not asked for
    squares = ctx.op("BatchNormReduceBackward", centred, x32, mean, mean, outputs=["", ctx.fresh("squares")],
                     domain=DOMAIN, input_g=1, weight_g=0, bias_g=0)[1]
    if all_reduce is not None:
        squares = all_reduce(ctx, squares)
    var = ctx.op("Div", squares, global_count)
    invstd = ctx.op("Reciprocal", ctx.op("Sqrt", ctx.op("Add", var, float32_scalar(ctx, epsilon))))
    ctx.op(
        "BatchNormalization",
        x,
        scale,
        bias,
        ctx.op("CastLike", mean, running_mean),
        ctx.op("CastLike", var, running_var),
        outputs=[node.output[0]],
        epsilon=epsilon,
        training_mode=0,
    )
    outputs = list(node.output) + ["", ""]
    if outputs[1]:
        _running_update(ctx, running_mean, mean, momentum, outputs[1])
    if outputs[2]:
        unbiased = ctx.op("Mul", var, ctx.op("Div", global_count, ctx.op("Max", ctx.op("Sub", global_count, float32_scalar(ctx, 1.0)), float32_scalar(ctx, 1.0))))
        _running_update(ctx, running_var, unbiased, momentum, outputs[2])
    return BatchStatistics(mean, invstd, x32, all_reduce, ratio, tuple(name for name in outputs[1:3] if name))


def _running_update(ctx: GradientContext, running: str, batch: str, momentum: float, output: str) -> None:
    """``output`` = momentum * running + (1 - momentum) * batch, in the running value's type."""
    kept = ctx.op("Mul", running, ctx.scalar(momentum, running))
    new = ctx.op("Mul", ctx.op("CastLike", batch, running), ctx.scalar(1.0 - momentum, running))
    ctx.op("Add", kept, new, outputs=[output])


@register("BatchNormalization", inputs=(0, 1, 2), outputs=(0,))
def batch_norm_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Gradients of X, scale and B."""
    return batch_norm_backward(ctx, node, grads[0])


def batch_norm_backward(
    ctx: GradientContext, node: onnx.NodeProto, dy: str, relu_output: Optional[str] = None
) -> List[Optional[str]]:
    """Gradients of X, scale and B (None where not needed), by input index.

    Args:
        dy: the gradient of the node's output Y; with ``relu_output``, the gradient of the
            output of the Relu that alone reads Y (training mode only).
        relu_output: that Relu's output: the BatchNorm backward ops mask ``dy`` with it on
            the fly (their input ``relu_output``), the Relu's own gradient is never written
            (:mod:`normgrad.graphs.patterns.batch_norm_relu`).
    """
    x, scale, bias, running_mean, running_var = node.input[:5]
    epsilon = attr(node, "epsilon", 1e-5)
    stats = ctx.batch_statistics.get(node.output[0])
    training = stats is not None
    if not training and attr(node, "training_mode", 0):
        raise AssertionError(f"training-mode BatchNormalization '{node.name}' was not rewritten before differentiation")
    if relu_output is not None and not training:
        raise AssertionError(f"the Relu mask is fused into training-mode BatchNormalization only ('{node.name}')")
    rank = ctx.rank(x, node)
    want_x, want_scale, want_bias = ctx.needs_grad(x), ctx.needs_grad(scale), ctx.needs_grad(bias)
    result: List[Optional[str]] = [None] * len(node.input)
    if not (want_x or want_scale or want_bias):
        return result
    x32 = stats.x32 if training else as_float32(ctx, x, x)
    dy32, scale32 = as_float32(ctx, dy, x), as_float32(ctx, scale, scale)
    mask = [as_float32(ctx, relu_output, relu_output)] if relu_output is not None else []
    if training:
        mean, invstd = stats.mean, stats.invstd
    else:
        mean = as_float32(ctx, running_mean, running_mean)
        var = as_float32(ctx, running_var, running_var)
        invstd = ctx.op("Reciprocal", ctx.op("Sqrt", ctx.op("Add", var, float32_scalar(ctx, epsilon))))
    outputs = [
        ctx.fresh("sum_dy") if training and want_x else "",
        ctx.fresh("sum_dy_xmu") if training and want_x else "",
        ctx.fresh("grad_scale") if want_scale else "",
        ctx.fresh("grad_bias") if want_bias else "",
    ]
    if any(outputs):
        ctx.op(
            "BatchNormReduceBackward",
            dy32,
            x32,
            mean,
            invstd,
            scale32,
            *mask,
            outputs=outputs,
            domain=DOMAIN,
            input_g=int(bool(outputs[0])),
            weight_g=int(want_scale),
            bias_g=int(want_bias),
        )
    if want_x:
        if training:
            sum_dy, sum_dy_xmu = outputs[0], outputs[1]
            if stats.all_reduce is not None:
                # scale and bias gradients stay local (data parallelism averages them);
                # dx needs the sums over the global batch, divided by the global count,
                # and BatchNormElemtBackward divides by the local one
                packed = stats.all_reduce(ctx, ctx.op("Concat", sum_dy, sum_dy_xmu, axis=0))
                pair = ctx.op("Reshape", ctx.op("Mul", packed, stats.count_ratio), ctx.ints([2, -1]))
                zero, one = (ctx.op("Constant", value=onh.from_array(np.asarray(i, np.int64))) for i in (0, 1))
                sum_dy, sum_dy_xmu = ctx.op("Gather", pair, zero), ctx.op("Gather", pair, one)
            dx = ctx.op(
                "BatchNormElemtBackward", dy32, x32, mean, invstd, scale32, sum_dy, sum_dy_xmu, *mask, domain=DOMAIN
            )
        else:
            per_channel = ctx.ints([1, -1] + [1] * (rank - 2))
            dx = ctx.op("Mul", dy32, ctx.op("Reshape", ctx.op("Mul", scale32, invstd), per_channel))
        result[0] = ctx.op("CastLike", dx, x)
    if want_scale:
        result[1] = ctx.op("CastLike", outputs[2], scale)
    if want_bias:
        result[2] = ctx.op("CastLike", outputs[3], bias)
    return result
