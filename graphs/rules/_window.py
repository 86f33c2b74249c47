"""Shared geometry of sliding-window ops (Conv, ConvTranspose, AveragePool): pads and sizes,
static or known only at run time, and the transposed window that gives dy back the input's size."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.graphs.rules import UnsupportedOperatorError

__all__ = ["Window", "window_of", "transposed_window"]


@dataclasses.dataclass
class Window:
    """The explicit geometry of one sliding-window node.

    Attributes:
        kernel: kernel size per spatial dim.
        strides, dilations: per spatial dim.
        pads: begin pads followed by end pads (auto_pad resolved).
        in_sizes: spatial input sizes; None when only the run time knows them.
        out_sizes: spatial output sizes; None likewise.
        ceil_pads: the part of each end pad that ceil_mode adds (the last window's reach past
            the padded input), included in ``pads``; empty without it.
        output_padding: what ConvTranspose must add at the end to give back ``in_sizes``.
    """

    kernel: List[int]
    strides: List[int]
    dilations: List[int]
    pads: List[int]
    in_sizes: Optional[List[int]]
    out_sizes: Optional[List[int]]
    ceil_pads: List[int] = dataclasses.field(default_factory=list)

    @property
    def output_padding(self) -> List[int]:
        r = len(self.kernel)
        return [
            self.in_sizes[i]
            - ((self.out_sizes[i] - 1) * self.strides[i] + (self.kernel[i] - 1) * self.dilations[i] + 1
               - self.pads[i] - self.pads[r + i])
            for i in range(r)
        ]


def window_of(ctx: GradientContext, node: onnx.NodeProto, kernel: Optional[List[int]] = None) -> Window:
    """The geometry of ``node``; its input's spatial dims may be symbolic.

    Args:
        kernel: the kernel size when the node has no ``kernel_shape`` attribute (Conv).

    Raises:
        UnsupportedOperatorError: the input's rank is unknown, or ceil_mode or auto_pad
            SAME_* at sizes only the run time knows.
    """
    shape = ctx.shape(node.input[0])
    if shape is None:
        raise UnsupportedOperatorError(f"{describe(node)}: the rank of input '{node.input[0]}' is unknown")
    r = len(shape) - 2
    static = all(isinstance(d, int) for d in shape[2:])
    in_sizes = list(shape[2:]) if static else None
    kernel = list(attr(node, "kernel_shape", kernel or []))
    if len(kernel) != r:
        raise UnsupportedOperatorError(f"{describe(node)}: kernel shape unknown")
    strides = list(attr(node, "strides", [1] * r))
    dilations = list(attr(node, "dilations", [1] * r))
    auto_pad = attr(node, "auto_pad", "NOTSET")
    if not static and (auto_pad in ("SAME_UPPER", "SAME_LOWER") or attr(node, "ceil_mode", 0)):
        what = f"auto_pad={auto_pad}" if auto_pad.startswith("SAME") else "ceil_mode=1"
        raise UnsupportedOperatorError(
            f"{describe(node)}: {what} needs static spatial dims of input '{node.input[0]}' for the gradient; "
            f"got {shape} (export with explicit pads, or a fixed image size)"
        )
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pads = [0] * (2 * r)
        for i in range(r):
            out = -(-in_sizes[i] // strides[i])
            total = max((out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - in_sizes[i], 0)
            small, large = total // 2, total - total // 2
            pads[i], pads[r + i] = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
    elif auto_pad == "VALID":
        pads = [0] * (2 * r)
    else:
        pads = list(attr(node, "pads", [0] * (2 * r)))
    if not static:
        return Window(kernel, strides, dilations, pads, None, None)
    out_sizes = []
    for i in range(r):
        span = in_sizes[i] + pads[i] + pads[r + i] - (kernel[i] - 1) * dilations[i] - 1
        out_sizes.append(span // strides[i] + 1)
    out_shape = ctx.shape(node.output[0])
    declared = list(out_shape[2:]) if out_shape is not None and all(isinstance(d, int) for d in out_shape[2:]) else None
    if attr(node, "ceil_mode", 0):
        window = _ceil_mode_window(Window(kernel, strides, dilations, pads, in_sizes, out_sizes))
        if declared is not None and declared != window.out_sizes:
            raise UnsupportedOperatorError(
                f"{describe(node)}: ceil_mode=1 whose last window would start in the end padding: onnxruntime and "
                f"torch drop it (output {window.out_sizes}) but onnx's shape inference keeps it ({declared}), so the "
                "model's declared shapes are wrong; export without ceil_mode or with smaller pads")
        return window
    return Window(kernel, strides, dilations, pads, in_sizes, declared or out_sizes)


def _ceil_mode_window(window: Window) -> Window:
    """``window`` (floor sizes) with ceil_mode's output sizes, as torch and onnxruntime count
    them: one more window where the stride does not divide the span, dropped again where it
    would start in the end padding; its reach past the padded input added to the end pads."""
    r, pads, out_sizes, ceil_pads = len(window.kernel), list(window.pads), [], []
    for i, size in enumerate(window.in_sizes):
        stride, reach = window.strides[i], (window.kernel[i] - 1) * window.dilations[i] + 1
        span = size + pads[i] + pads[r + i] - reach
        out = -(-span // stride) + 1
        if (out - 1) * stride >= size + pads[i]:
            out -= 1
        extra = max((out - 1) * stride + reach - (size + pads[i] + pads[r + i]), 0)
        pads[r + i] += extra
        out_sizes.append(out)
        ceil_pads.append(extra)
    return Window(window.kernel, window.strides, window.dilations, pads, window.in_sizes, out_sizes, ceil_pads)


def transposed_window(ctx: GradientContext, dy: str, weights: str, x: str, window: Window, group: int = 1) -> str:
    """ConvTranspose of ``dy`` with ``weights`` over ``window``, sized like ``x`` (Conv's dx).

    With static sizes, output_padding restores x's size. Otherwise the end pads are left
    uncropped and one Pad with run-time amounts crops or zero-fills the end to x's size
    (zero-filling with output_padding alone would be wrong: with end pads, the elements
    past the cropped size are not zero).
    """
    geometry = dict(strides=window.strides, dilations=window.dilations, kernel_shape=window.kernel, group=group)
    if window.in_sizes is not None:
        return ctx.op("ConvTranspose", dy, weights, pads=window.pads, output_padding=window.output_padding, **geometry)
    r = len(window.kernel)
    full = ctx.op("ConvTranspose", dy, weights, pads=window.pads[:r] + [0] * r, **geometry)
    missing = ctx.op("Sub", ctx.shape_of(x, start=2), ctx.shape_of(full, start=2))
    return ctx.op("Pad", full, ctx.op("Concat", ctx.ints([0] * (r + 4)), missing, axis=0))
