"""Conv and ConvTranspose (any spatial rank, groups, strides, pads incl. auto_pad, dilations;
ConvTranspose also output_padding and output_shape), at static or symbolic image sizes.

Conv: dx = ConvTranspose(dy, W) sized like x (:func:`input_gradient`); dW = Conv of the input
(batch as channels) with dy (batch as input channels), strides and dilations swapped,
cropped to the kernel (:func:`weight_gradient`); db = sum of dy over all axes but 1.

ConvTranspose(x, W) is the adjoint of Conv(., W) with the same geometry, so dx = Conv(dy, W)
and dW is Conv's weight gradient with dy as the input and x as the output gradient.
The two gradient forms are one function each, so that faster forms can replace them.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import onnx

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.graphs.rules import UnsupportedOperatorError, register
from normgrad.graphs.rules._window import Window, transposed_window, window_of

__all__ = ["conv_gradient", "conv_transpose_gradient", "input_gradient", "weight_gradient"]


def input_gradient(ctx: GradientContext, dy: str, w: str, x: str, window: Window, groups: int) -> str:
    """dx of Conv(x, w) over ``window``: ConvTranspose(dy, w) sized like ``x``."""
    return transposed_window(ctx, dy, w, x, window, groups)


def weight_gradient(ctx: GradientContext, x: str, w: str, dy: str, window: Window, groups: int) -> str:
    """dW of Conv(x, w) over ``window``, shaped like ``w``."""
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
    full_sizes = None
    if window.in_sizes is not None:
        full_sizes = [
            (window.in_sizes[i] + window.pads[i] + window.pads[r + i] - (window.out_sizes[i] - 1) * window.strides[i] - 1)
            // window.dilations[i]
            + 1
            for i in range(r)
        ]
    if full_sizes != window.kernel:
        full = ctx.op("Slice", full, ctx.ints([0] * r), ctx.ints(window.kernel), ctx.ints(spatial))
    return ctx.op("Transpose", full, perm=[1, 0] + spatial)


def _bias_gradient(ctx: GradientContext, dy: str, rank: int) -> str:
    return ctx.reduce("ReduceSum", dy, [0] + list(range(2, rank)), keepdims=False)


def _kernel(ctx: GradientContext, node: onnx.NodeProto) -> Optional[List[int]]:
    w_shape = ctx.shape(node.input[1])
    if w_shape is not None and all(isinstance(d, int) for d in w_shape[2:]):
        return list(w_shape[2:])
    return attr(node, "kernel_shape", None)


@register("Conv", inputs=(0, 1, 2))
def conv_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Gradients of X, W and B."""
    dy = grads[0]
    x, w = node.input[0], node.input[1]
    window = window_of(ctx, node, _kernel(ctx, node))
    groups = attr(node, "group", 1)
    result: List[Optional[str]] = [None] * len(node.input)
    if ctx.needs_grad(x):
        result[0] = input_gradient(ctx, dy, w, x, window, groups)
    if ctx.needs_grad(w):
        result[1] = weight_gradient(ctx, x, w, dy, window, groups)
    if len(node.input) > 2 and ctx.needs_grad(node.input[2]):
        result[2] = _bias_gradient(ctx, dy, len(window.kernel) + 2)
    return result


def _transpose_geometry(ctx: GradientContext, node: onnx.NodeProto) -> Tuple[Window, bool]:
    """The geometry of the Conv that ConvTranspose ``node`` is the adjoint of (its input is
    y-sized, its output x-sized), and whether that Conv's output must be cropped to x
    (output_padding or output_shape reaching a whole stride past x's last element).

    Pads from output_shape or SAME_* as the onnx spec and onnxruntime 1.32 split the total:
    the odd one at the tail for SAME_UPPER, at the head otherwise."""
    x = node.input[0]
    kernel = _kernel(ctx, node)
    shape = ctx.shape(x)
    if kernel is None or shape is None:
        raise UnsupportedOperatorError(f"{describe(node)}: the kernel shape or the rank of '{x}' is unknown")
    r = len(kernel)
    strides = list(attr(node, "strides", [1] * r))
    dilations = list(attr(node, "dilations", [1] * r))
    output_padding = list(attr(node, "output_padding", [0] * r))
    output_shape = list(attr(node, "output_shape", []))[-r:] if attr(node, "output_shape", None) else None
    auto_pad = attr(node, "auto_pad", "NOTSET")
    in_sizes = list(shape[2:]) if all(isinstance(d, int) for d in shape[2:]) else None
    natural = lambda i, n: (n - 1) * strides[i] + output_padding[i] + (kernel[i] - 1) * dilations[i] + 1  # noqa: E731
    if output_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if output_shape is not None and in_sizes is None:
            raise UnsupportedOperatorError(
                f"{describe(node)}: output_shape needs static spatial dims of input '{x}' for the gradient; got {shape}")
        pads = [0] * (2 * r)
        for i in range(r):
            if output_shape is not None:
                total = max(0, natural(i, in_sizes[i]) - output_shape[i])
            else:  # the output is in * stride: the total does not depend on in
                total = max(0, natural(i, 1) - strides[i])
            head = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            pads[i], pads[r + i] = head, total - head
    elif auto_pad == "VALID":
        pads = [0] * (2 * r)
    else:
        pads = list(attr(node, "pads", [0] * (2 * r)))
    out_sizes, extra = None, list(output_padding)
    if in_sizes is not None:
        out_sizes = [natural(i, in_sizes[i]) - pads[i] - pads[r + i] for i in range(r)]
        if output_shape is not None:
            extra = [e + max(0, s - o) for e, o, s in zip(extra, out_sizes, output_shape)]
            out_sizes = [max(o, s) for o, s in zip(out_sizes, output_shape)]
    crop = any(e >= s for e, s in zip(extra, strides))
    return Window(kernel, strides, dilations, pads, out_sizes, in_sizes), crop


@register("ConvTranspose", inputs=(0, 1, 2))
def conv_transpose_gradient(
    ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]
) -> List[Optional[str]]:
    """dx = Conv(dy, W) (cropped to x where output_padding or output_shape reach a stride
    past the input); dW = Conv's weight gradient with dy as input and x as output gradient."""
    dy = grads[0]
    x, w = node.input[0], node.input[1]
    window, crop = _transpose_geometry(ctx, node)
    groups = attr(node, "group", 1)
    r = len(window.kernel)
    result: List[Optional[str]] = [None] * len(node.input)
    if ctx.needs_grad(x):
        dx = ctx.op("Conv", dy, w, group=groups, strides=window.strides, dilations=window.dilations,
                    pads=window.pads, kernel_shape=window.kernel)
        if crop:
            spatial = list(range(2, 2 + r))
            dx = ctx.op("Slice", dx, ctx.ints([0] * r), ctx.shape_of(x, start=2), ctx.ints(spatial))
        result[0] = dx
    if ctx.needs_grad(w):
        result[1] = weight_gradient(ctx, dy, w, x, window, groups)
    if len(node.input) > 2 and ctx.needs_grad(node.input[2]):
        result[2] = _bias_gradient(ctx, dy, r + 2)
    return result
