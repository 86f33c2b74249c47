"""Shared geometry of sliding-window ops (Conv, AveragePool, MaxPool): pads and sizes."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.graphs.rules import UnsupportedOperatorError

__all__ = ["Window", "window_of"]


@dataclasses.dataclass
class Window:
    """The explicit geometry of one sliding-window node.

    Attributes:
        kernel: kernel size per spatial dim.
        strides, dilations: per spatial dim.
        pads: begin pads followed by end pads (auto_pad resolved).
        in_sizes: spatial input sizes (static).
        out_sizes: spatial output sizes.
        output_padding: what ConvTranspose must add at the end to give back ``in_sizes``.
    """

    kernel: List[int]
    strides: List[int]
    dilations: List[int]
    pads: List[int]
    in_sizes: List[int]
    out_sizes: List[int]

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
    """The geometry of ``node``, whose input 0 must have static spatial dims.

    Args:
        kernel: the kernel size when the node has no ``kernel_shape`` attribute (Conv).

    Raises:
        UnsupportedOperatorError: spatial dims unknown, or ceil_mode changes the output size.
    """
    shape = ctx.shape(node.input[0])
    if shape is None or not all(isinstance(d, int) for d in shape[2:]):
        raise UnsupportedOperatorError(
            f"{describe(node)}: the gradient needs static spatial dims of input '{node.input[0]}'; got {shape}"
        )
    in_sizes = list(shape[2:])
    r = len(in_sizes)
    kernel = list(attr(node, "kernel_shape", kernel or []))
    if len(kernel) != r:
        raise UnsupportedOperatorError(f"{describe(node)}: kernel shape unknown")
    strides = list(attr(node, "strides", [1] * r))
    dilations = list(attr(node, "dilations", [1] * r))
    auto_pad = attr(node, "auto_pad", "NOTSET")
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
    out_sizes = []
    for i in range(r):
        span = in_sizes[i] + pads[i] + pads[r + i] - (kernel[i] - 1) * dilations[i] - 1
        floor_size = span // strides[i] + 1
        if attr(node, "ceil_mode", 0) and -(-span // strides[i]) + 1 != floor_size:
            raise UnsupportedOperatorError(f"{describe(node)}: ceil_mode=1 that changes the output size is not supported")
        out_sizes.append(floor_size)
    out_shape = ctx.shape(node.output[0])
    if out_shape is not None and all(isinstance(d, int) for d in out_shape[2:]):
        out_sizes = list(out_shape[2:])
    return Window(kernel, strides, dilations, pads, in_sizes, out_sizes)
