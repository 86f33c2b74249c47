"""BatchNormalization (opsets 9-15 semantics after conversion; training_mode 0 and 1).

Training mode: the batch statistics are recomputed in the graph, normgrad
``BatchNormReduceBackward`` gives the per-channel sums and the scale/bias gradients, and
``BatchNormElemtBackward`` gives dx. Eval mode: the running statistics are constants, so
dx = dy * scale / sqrt(running_var + eps) and the reduce op gives the scale/bias
gradients. The running statistics (inputs 3 and 4, outputs 1 and 2) get no gradient.
"""

from __future__ import annotations

from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules import register
from normgrad.graphs.rules._norm import as_float32, float32_scalar, statistics
from normgrad.ops import DOMAIN

__all__ = ["batch_norm_gradient"]


@register("BatchNormalization", inputs=(0, 1, 2), outputs=(0,))
def batch_norm_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Gradients of X, scale and B."""
    x, scale, bias, running_mean, running_var = node.input[:5]
    epsilon = attr(node, "epsilon", 1e-5)
    training = bool(attr(node, "training_mode", 0))
    rank = ctx.rank(x, node)
    want_x, want_scale, want_bias = ctx.needs_grad(x), ctx.needs_grad(scale), ctx.needs_grad(bias)
    x32, dy32, scale32 = as_float32(ctx, x, x), as_float32(ctx, grads[0], x), as_float32(ctx, scale, scale)
    if training:
        mean, invstd = statistics(ctx, x32, [0] + list(range(2, rank)), epsilon)
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
            outputs=outputs,
            domain=DOMAIN,
            input_g=int(bool(outputs[0])),
            weight_g=int(want_scale),
            bias_g=int(want_bias),
        )
    result: List[Optional[str]] = [None] * len(node.input)
    if want_x:
        if training:
            dx = ctx.op("BatchNormElemtBackward", dy32, x32, mean, invstd, scale32, outputs[0], outputs[1], domain=DOMAIN)
        else:
            per_channel = ctx.ints([1, -1] + [1] * (rank - 2))
            dx = ctx.op("Mul", dy32, ctx.op("Reshape", ctx.op("Mul", scale32, invstd), per_channel))
        result[0] = ctx.op("CastLike", dx, x)
    if want_scale:
        result[1] = ctx.op("CastLike", outputs[2], scale)
    if want_bias:
        result[2] = ctx.op("CastLike", outputs[3], bias)
    return result
