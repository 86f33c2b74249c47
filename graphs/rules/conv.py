"""Conv (any spatial rank, groups, strides, pads incl. auto_pad, dilations).

dx = ConvTranspose(dy, W) with the output_padding that restores the input size;
dW = Conv of the input (batch as channels) with dy (batch as input channels), strides and
dilations swapped, cropped to the kernel; db = sum of dy over all axes but 1.
"""

from __future__ import annotations

from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules import register
from normgrad.graphs.rules._window import window_of

__all__ = ["conv_gradient"]


def _weight_gradient(ctx: GradientContext, node: onnx.NodeProto, dy: str, window, groups: int) -> str:
    x, w = node.input[0], node.input[1]
    r = len(window.kernel)
    spatial = list(range(2, 2 + r))
    if groups == 1:
        x_arranged = ctx.op("Transpose", x, perm=[1, 0] + spatial)  # [C, N, ...]
    else:
        # [N, C, ...] -> [N, g, C/g, ...] -> [C/g, g, N, ...] -> [C/g, g*N, ...]
        c_per_group = ctx.shape_of(w, start=1, end=2)
        spatial_shape = ctx.shape_of(x, start=2)
        split = ctx.op("Concat", ctx.ints([-1, groups]), c_per_group, spatial_shape, axis=0)
        grouped = ctx.op("Transpose", ctx.op("Reshape", x, split), perm=[2, 1, 0] + [s + 1 for s in spatial])
        x_arranged = ctx.op("Reshape", grouped, ctx.op("Concat", c_per_group, ctx.ints([-1]), spatial_shape, axis=0))
    dy_arranged = ctx.op("Transpose", dy, perm=[1, 0] + spatial)  # [M, N, ...]
    full = ctx.op(
        "Conv",
        x_arranged,
        dy_arranged,
        group=groups,
        strides=window.dilations,
        dilations=window.strides,
        pads=window.pads,
    )  # [C/g, M, k'...], k' >= k
    full_sizes = [
        (window.in_sizes[i] + window.pads[i] + window.pads[r + i] - (window.out_sizes[i] - 1) * window.strides[i] - 1)
        // window.dilations[i]
        + 1
        for i in range(r)
    ]
    if full_sizes != window.kernel:
        full = ctx.op("Slice", full, ctx.ints([0] * r), ctx.ints(window.kernel), ctx.ints(spatial))
    return ctx.op("Transpose", full, perm=[1, 0] + spatial)


@register("Conv", inputs=(0, 1, 2))
def conv_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Gradients of X, W and B."""
    dy = grads[0]
    x, w = node.input[0], node.input[1]
    w_shape = ctx.shape(w)
    kernel = w_shape[2:] if w_shape is not None and all(isinstance(d, int) for d in w_shape[2:]) else None
    window = window_of(ctx, node, kernel)
    groups = attr(node, "group", 1)
    result: List[Optional[str]] = [None] * len(node.input)
    if ctx.needs_grad(x):
        result[0] = ctx.op(
            "ConvTranspose",
            dy,
            w,
            group=groups,
            strides=window.strides,
            dilations=window.dilations,
            pads=window.pads,
            kernel_shape=window.kernel,
            output_padding=window.output_padding,
        )
    if ctx.needs_grad(w):
        result[1] = _weight_gradient(ctx, node, dy, window, groups)
    if len(node.input) > 2 and ctx.needs_grad(node.input[2]):
        rank = len(window.kernel) + 2
        result[2] = ctx.reduce("ReduceSum", dy, [0] + list(range(2, rank)), keepdims=False)
    return result
