"""DepthwiseConvGrad: both gradients of a 2-D depthwise Conv (one output channel per input channel).

For y = Conv(x, w, group=C) with x [N, C, H, W], w [C, 1, kh, kw] and the geometry of the
attributes (as Conv's: strides, pads [top, left, bottom, right], dilations), given dy [N, C,
Ho, Wo]:

    dx[n, c, i, j] = Σ_{a, b} w[c, 0, a, b] dy[n, c, oh, ow]  over i = oh sh - pt + a dh, j = ow sw - pl + b dw
    dw[c, 0, a, b] = Σ_{n, oh, ow} dy[n, c, oh, ow] x[n, c, oh sh - pt + a dh, ow sw - pl + b dw]

(taps falling in the padding contribute nothing). onnxruntime has no depthwise backward: the
graph form (the function body, what ``--inline`` and ``--portable`` write) is a ConvTranspose
for dx and, for dw, a grouped Conv of x with dy as its kernel, which MLAS runs as a large-kernel
im2col GEMM per channel: together 36% of a MobileNetV2 step's node time (batch 16, 128x128,
1 thread). The C++ kernel takes each channel's planes in turn, the channels shared among the
intra-op threads; each plane of x is first laid out zero-padded as DepthwiseConv's kernel reads
it. Every element of dw is eight chains of fused multiply-adds (dy's columns dealt to eight
lanes by their index mod 8, over n and the rows in order, up to twelve taps' lanes kept in
registers per pass over dy) added as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). At
stride 1 dx is DepthwiseConv's kernel over dy with the kernel flipped (each element one chain
over the taps); at larger strides each element is one chain over the taps in the order dy's
rows reach it. The same bits on the AVX2 and the portable path and at any thread count; kh is
at most 64 (:data:`MAX_KERNEL_ROWS`). At 1 thread against the previous kernel, which
computed dx and dw in one loop of row primitives: 7x7 on [16, 48, 32, 32] 11 -> 4.9 ms, 5x5
on [16, 240, 16, 16] 10.8 -> 6.4, 3x3 on [16, 96, 32, 32] 4.6 -> 4.0; a 7x7 on 4x4 maps and
stride 2 are 5-25% slower (the padded copy per plane).

Inputs:
    x (float or double): the Conv's input, [N, C, H, W].
    w (x's type): its weight, [C, 1, kh, kw].
    dy (x's type): the gradient of its output, [N, C, Ho, Wo] (Conv's output size).

Outputs (x's type): dx, shaped like x; dw, shaped like w.

Attributes: group (must equal C: the function body's ConvTranspose and Conv take it), strides,
pads, dilations (as Conv's; explicit: no auto_pad).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
import onnx.helper as oh

import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_SHAPE_FROM", "MAX_KERNEL_ROWS", "Result", "validate", "reference",
           "output_size", "check_geometry", "geometry_attributes", "schema", "function_body"]

OP_TYPE = "DepthwiseConvGrad"
INPUTS = ("x", "w", "dy")
OUTPUTS = ("dx", "dw")
ATTRIBUTES: dict = {"group": 1, "strides": [1, 1], "pads": [0, 0, 0, 0], "dilations": [1, 1]}
"""(strides, pads and dilations are INTS, which onnxruntime-extensions' Python kernels cannot
read: the operator has no Python kernel, onnxruntime runs its function body there.)"""
OUTPUT_SHAPE_FROM = {"dx": ("x", None), "dw": ("w", None)}
MAX_KERNEL_ROWS = 64
"""The C++ kernels' limit on kh (a table of row pointers on their stack); DepthwiseConv's too."""
_DIMS = {"x": "[N, C, H, W]", "w": "[C, 1, kh, kw]", "dy": "[N, C, Ho, Wo]"}


class Result(NamedTuple):
    """The outputs."""

    dx: np.ndarray
    dw: np.ndarray


def output_size(size: int, kernel: int, stride: int, head: int, tail: int, dilation: int) -> int:
    """Conv's output size along one axis (at least 1 only where the padded input holds the dilated kernel)."""
    return (size + head + tail - (kernel - 1) * dilation - 1) // stride + 1


def check_geometry(op_type: str, arrays: dict, group, strides, pads, dilations) -> list:
    """[Ho, Wo] of the depthwise Conv of ``arrays["x"]`` [N, C, H, W] and ``arrays["w"]`` [C,
    1, kh, kw] with these attributes.

    Raises:
        NormgradInputError: naming ``op_type``, the offending input or attribute and the rule.
    """
    for name, values, length, low in (("strides", strides, 2, 1), ("pads", pads, 4, 0), ("dilations", dilations, 2, 1)):
        if len(values) != length or any(int(v) < low for v in values):
            raise NormgradInputError(f"{op_type}: attribute '{name}' must be {length} integers >= {low}; "
                                     f"got {list(values)}")
    n, c, h, width = arrays["x"].shape
    if arrays["w"].shape[:2] != (c, 1):
        raise NormgradInputError(f"{op_type}: input 'w' must be [C, 1, kh, kw] with x's C = {c}; "
                                 f"got shape {list(arrays['w'].shape)}")
    if int(group) != c:
        raise NormgradInputError(f"{op_type}: attribute 'group' must equal x's channels {c}; got {group}")
    kh, kw = arrays["w"].shape[2:]
    out = [output_size(h, kh, strides[0], pads[0], pads[2], dilations[0]),
           output_size(width, kw, strides[1], pads[1], pads[3], dilations[1])]
    if min(out) < 1 or min(kh, kw) < 1:
        raise NormgradInputError(f"{op_type}: the padded input {[h + pads[0] + pads[2], width + pads[1] + pads[3]]} "
                                 f"must hold the dilated kernel of 'w' {list(arrays['w'].shape)}")
    if kh > MAX_KERNEL_ROWS:
        raise NormgradInputError(f"{op_type}: input 'w' must have at most {MAX_KERNEL_ROWS} kernel rows; "
                                 f"got shape {list(arrays['w'].shape)}")
    return out


def validate(x, w, dy, group=1, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1)) -> dict:
    """Checks the inputs and attributes against the contract: {input name: array}.

    Raises:
        NormgradInputError: naming the offending input or attribute and the rule it broke.
    """
    arrays = _common.float32_or_float64_arrays(OP_TYPE, _DIMS, (x, w, dy))
    out = check_geometry(OP_TYPE, arrays, group, strides, pads, dilations)
    n, c = arrays["x"].shape[:2]
    if list(arrays["dy"].shape) != [n, c] + out:
        raise NormgradInputError(f"{OP_TYPE}: input 'dy' must have the Conv's output shape {[n, c] + out}; "
                                 f"got {list(arrays['dy'].shape)}")
    return arrays


def reference(x, w, dy, group=1, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1)) -> Result:
    """The operator in NumPy: float64 sums tap by tap, in x's type (rounded once for float32)."""
    arrays = validate(x, w, dy, group, strides, pads, dilations)
    x64, w64, dy64 = (arrays[name].astype(np.float64) for name in INPUTS)
    (sh, sw), (pt, pl, pb, pr), (dh, dw_) = strides, pads, dilations
    padded = np.pad(x64, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    dx_padded = np.zeros_like(padded)
    dw = np.zeros_like(w64)
    ho, wo = dy64.shape[2:]
    for a in range(w64.shape[2]):
        for b in range(w64.shape[3]):
            rows = slice(a * dh, a * dh + (ho - 1) * sh + 1, sh)
            columns = slice(b * dw_, b * dw_ + (wo - 1) * sw + 1, sw)
            dw[:, 0, a, b] = np.einsum("nchw,nchw->c", padded[:, :, rows, columns], dy64)
            dx_padded[:, :, rows, columns] += w64[None, :, 0, a, b, None, None] * dy64
    dx = dx_padded[:, :, pt:pt + x64.shape[2], pl:pl + x64.shape[3]]
    dtype = arrays["x"].dtype
    return Result(dx.astype(dtype), dw.astype(dtype))


def geometry_attributes() -> list:
    """The schema's attributes (DepthwiseConv's too): a depthwise Conv's geometry."""
    from onnx.defs import OpSchema

    return [OpSchema.Attribute(name, oh.make_attribute(name, default), text) for name, default, text in (
        ("group", ATTRIBUTES["group"], "The Conv's group: x's channel count C."),
        ("strides", ATTRIBUTES["strides"], "The Conv's strides [sh, sw]."),
        ("pads", ATTRIBUTES["pads"], "The Conv's pads [top, left, bottom, right]."),
        ("dilations", ATTRIBUTES["dilations"], "The Conv's dilations [dh, dw]."))]


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    return _common.make_schema(
        OP_TYPE, __doc__,
        [param("x", "T", "[N, C, H, W]."), param("w", "T", "[C, 1, kh, kw]."), param("dy", "T", "[N, C, Ho, Wo].")],
        [param("dx", "T", "Gradient of x."), param("dw", "T", "Gradient of w.")],
        {"T": (("tensor(float)", "tensor(double)"), "x's, w's and dy's type.")},
        _common.image_gradients_infer(OP_TYPE, _DIMS), geometry_attributes())


def _ref(name: str, ref: str, kind: int) -> onnx.AttributeProto:
    """Attribute ``name`` of a body node set to the node's attribute ``ref``."""
    return onnx.AttributeProto(name=name, ref_attr_name=ref, type=kind)


def function_body(opset: int = _common.ONNX_OPSET) -> onnx.FunctionProto:
    """The graph form ``normgrad.graphs.rules.conv`` writes without the operator: dx a
    ConvTranspose (its output's head pads cut off, its tail cropped or zero-filled to x's size),
    dw a Conv of x (channels then batch as [1, C N, H, W]) with dy ([C, N, Ho, Wo]) as its
    kernel, strides and dilations swapped, cut to w's size."""
    ints, one = onnx.AttributeProto.INTS, onnx.AttributeProto.INT

    def node(op, inputs, outputs, refs=(), **attributes):
        made = oh.make_node(op, inputs, outputs, **attributes)
        made.attribute.extend(_ref(name, ref, kind) for name, ref, kind in refs)
        return made

    def constant(name, values):
        return oh.make_node("Constant", [], [name], value_ints=values)

    nodes = [
        node("Constant", [], ["pads_all"], [("value_ints", "pads", ints)]),
        constant("zero", [0]), constant("two", [2]), constant("two_zeros", [0, 0]), constant("spatial", [2, 3]),
        constant("six_zeros", [0] * 6), constant("first", [1, -1]),
        node("Slice", ["pads_all", "zero", "two"], ["head"]),
        node("ConvTranspose", ["dy", "w"], ["full"], [("group", "group", one), ("strides", "strides", ints),
                                                      ("dilations", "dilations", ints)]),
        node("Shape", ["x"], ["x_hw"], start=2),
        node("Shape", ["full"], ["full_hw"], start=2),
        node("Add", ["head", "x_hw"], ["end"]),
        node("Sub", ["end", "full_hw"], ["short_signed"]),
        node("Max", ["zero", "short_signed"], ["short"]),
        node("Concat", ["six_zeros", "short"], ["fill"], axis=0),
        node("Pad", ["full", "fill"], ["filled"]),
        node("Slice", ["filled", "head", "end", "spatial"], ["dx"]),
        node("Transpose", ["x"], ["x_cn"], perm=[1, 0, 2, 3]),
        node("Concat", ["first", "x_hw"], ["stacked_shape"], axis=0),
        node("Reshape", ["x_cn", "stacked_shape"], ["x_stacked"]),
        node("Transpose", ["dy"], ["dy_cn"], perm=[1, 0, 2, 3]),
        node("Conv", ["x_stacked", "dy_cn"], ["dw_full"], [("group", "group", one), ("strides", "dilations", ints),
                                                          ("dilations", "strides", ints), ("pads", "pads", ints)]),
        node("Shape", ["w"], ["kernel"], start=2),
        node("Slice", ["dw_full", "two_zeros", "kernel", "spatial"], ["dw_cut"]),
        node("Transpose", ["dw_cut"], ["dw"], perm=[1, 0, 2, 3]),
    ]
    return oh.make_function(_common.DOMAIN, OP_TYPE, list(INPUTS), list(OUTPUTS), nodes,
                            [oh.make_opsetid("", opset)], attributes=list(ATTRIBUTES))
