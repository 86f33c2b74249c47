"""GroupNormalization (opset 18: scale/bias per group; opset 21: per channel) and
InstanceNormalization (GroupNorm with one group per channel), through normgrad
``GroupNormalizationGrad`` on a grouped view of the input.

The statistics are recomputed in the graph. The scale is passed reshaped so that it
broadcasts against the view ([1, G, 1] against [N, G, M], or [1, G, C/G, 1] against
[N, G, C/G, spatial]); no broadcast copy of it is made.
"""

from __future__ import annotations

from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules.registry import register
from normgrad.graphs.rules._norm import as_float32, statistics
from normgrad.ops import DOMAIN

__all__ = ["group_norm_gradient"]


@register("GroupNormalization", "InstanceNormalization", inputs=(0, 1, 2))
def group_norm_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Gradients of X, scale and bias."""
    x, scale, bias = node.input[:3]
    epsilon = attr(node, "epsilon", 1e-5)
    x32, dy32, scale32 = as_float32(ctx, x, x), as_float32(ctx, grads[0], x), as_float32(ctx, scale, scale)
    if node.op_type == "InstanceNormalization":
        view_shape, gamma_shape, axes = ctx.ints([0, 0, -1]), ctx.ints([1, -1, 1]), [2]
    else:
        groups = attr(node, "num_groups", None)
        if ctx.opset >= 21:  # scale per channel: view [N, G, C/G, spatial]
            per_group = ctx.op("Div", ctx.shape_of(scale), ctx.ints([groups]))
            view_shape = ctx.op("Concat", ctx.ints([0, groups]), per_group, ctx.ints([-1]), axis=0)
            gamma_shape = ctx.op("Concat", ctx.ints([1, groups]), per_group, ctx.ints([1]), axis=0)
            axes = [2, 3]
        else:  # scale per group: view [N, G, C/G * spatial]
            view_shape, gamma_shape, axes = ctx.ints([0, groups, -1]), ctx.ints([1, groups, 1]), [2]
    view = ctx.op("Reshape", x32, view_shape)
    mean, rstd = statistics(ctx, view, axes, epsilon)
    want_scale, want_bias = ctx.needs_grad(scale), ctx.needs_grad(bias)
    outputs = [ctx.fresh("dx"), ctx.fresh("dgamma") if want_scale else "", ctx.fresh("dbeta") if want_bias else ""]
    ctx.op(
        "GroupNormalizationGrad",
        view,
        ctx.op("Reshape", dy32, view_shape),
        ctx.op("Reshape", scale32, gamma_shape),
        mean,
        rstd,
        outputs=outputs,
        domain=DOMAIN,
    )
    result: List[Optional[str]] = [None] * len(node.input)
    if ctx.needs_grad(x):
        result[0] = ctx.op("CastLike", ctx.reshape_like(outputs[0], x), x)
    for index, (name, grad) in enumerate(((scale, outputs[1]), (bias, outputs[2])), start=1):
        if grad:
            result[index] = ctx.op("CastLike", ctx.reshape_like(grad, name), name)
    return result
