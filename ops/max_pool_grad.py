"""MaxPoolGrad: the input gradient of a 2-D MaxPool, the maxima found again in x.

For y = MaxPool(x) with x [N, C, H, W] and the geometry of the attributes (as MaxPool's:
kernel_shape, strides, pads [top, left, bottom, right], dilations, ceil_mode), given dy [N, C,
Ho, Wo]: each dy[n, c, oh, ow] is added to dx at the position of its window's maximum, the
first in row-major order within the window (a NaN counts as the maximum); positions in the
padding are never taken. The windows are visited in dy's row-major order, so overlapping
windows add into dx in that order, as ScatterElements with ``reduction="add"`` does.

onnxruntime's MaxPool writes its Indices output, which the graph form needs, on a slow
element-by-element path (92 ms for ShuffleNetV2's [32, 24, 64, 64] 3x3 stride 2 pool at 1
thread, against about 2 ms without it), and the ScatterElements took another 36 ms. With this
operator the forward MaxPool has no Indices output; the C++ kernel scans each plane's windows
once, the planes shared among the intra-op threads (each whole: the same bits at any thread
count). The function body is the graph form: MaxPool's Indices and a ScatterElements.

Inputs:
    x (float or double): the MaxPool's input, [N, C, H, W].
    dy (x's type): the gradient of its output, [N, C, Ho, Wo] (MaxPool's output size; with
        ceil_mode, a last window that starts past the input's head pad may be left out, as
        onnxruntime since 1.20 and torch do).

Outputs (x's type): dx, shaped like x.

Attributes: kernel_shape, strides, pads, dilations, ceil_mode (as MaxPool's; explicit pads:
no auto_pad, no storage_order).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import onnx
import onnx.helper as oh

import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_SHAPE_FROM", "Result", "validate", "reference",
           "output_sizes", "schema", "function_body"]

OP_TYPE = "MaxPoolGrad"
INPUTS = ("x", "dy")
OUTPUTS = ("dx",)
ATTRIBUTES: dict = {"kernel_shape": [1, 1], "strides": [1, 1], "pads": [0, 0, 0, 0], "dilations": [1, 1],
                    "ceil_mode": 0}
"""(INTS attributes, which onnxruntime-extensions' Python kernels cannot read: the operator has
no Python kernel, onnxruntime runs its function body there.)"""
OUTPUT_SHAPE_FROM = {"dx": ("x", None)}
_DIMS = {"x": "[N, C, H, W]", "dy": "[N, C, Ho, Wo]"}


class Result(NamedTuple):
    """The output."""

    dx: np.ndarray


def output_sizes(size: int, kernel: int, stride: int, head: int, tail: int, dilation: int, ceil_mode: int) -> list:
    """MaxPool's possible output sizes along one axis: the floor size; with ceil_mode the ceil
    size and, where its last window would start past the input's head pad, one less."""
    room = size + head + tail - (kernel - 1) * dilation - 1
    if room < 0:
        return []
    if not ceil_mode:
        return [room // stride + 1]
    ceil = math.ceil(room / stride) + 1
    return sorted({ceil, ceil - 1 if (ceil - 1) * stride >= size + head else ceil})


def _check_geometry(kernel_shape, strides, pads, dilations, ceil_mode) -> None:
    for name, values, length, low in (("kernel_shape", kernel_shape, 2, 1), ("strides", strides, 2, 1),
                                      ("pads", pads, 4, 0), ("dilations", dilations, 2, 1)):
        if len(values) != length or any(int(v) < low for v in values):
            raise NormgradInputError(f"{OP_TYPE}: attribute '{name}' must be {length} integers >= {low}; "
                                     f"got {list(values)}")
    if ceil_mode not in (0, 1):
        raise NormgradInputError(f"{OP_TYPE}: attribute 'ceil_mode' must be 0 or 1; got {ceil_mode}")


def validate(x, dy, kernel_shape=(1, 1), strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), ceil_mode=0) -> dict:
    """Checks the inputs and attributes against the contract: {input name: array}.

    Raises:
        NormgradInputError: naming the offending input or attribute and the rule it broke.
    """
    arrays = _common.float32_or_float64_arrays(OP_TYPE, _DIMS, (x, dy))
    _check_geometry(kernel_shape, strides, pads, dilations, ceil_mode)
    n, c, h, w = arrays["x"].shape
    sizes = [output_sizes(size, kernel_shape[i], strides[i], pads[i], pads[i + 2], dilations[i], ceil_mode)
             for i, size in enumerate((h, w))]
    if not all(sizes):
        raise NormgradInputError(f"{OP_TYPE}: the padded input {[h + pads[0] + pads[2], w + pads[1] + pads[3]]} "
                                 f"must hold the dilated kernel {list(kernel_shape)}")
    if list(arrays["dy"].shape[:2]) != [n, c] or any(d not in s for d, s in zip(arrays["dy"].shape[2:], sizes)):
        expected = [n, c] + [s[-1] for s in sizes]
        raise NormgradInputError(f"{OP_TYPE}: input 'dy' must have the MaxPool's output shape {expected}; "
                                 f"got {list(arrays['dy'].shape)}")
    return arrays


def _window(start: int, kernel: int, dilation: int, size: int) -> np.ndarray:
    """The input positions of one window along one axis, the padding left out."""
    positions = start + dilation * np.arange(kernel)
    return positions[(positions >= 0) & (positions < size)]


def reference(x, dy, kernel_shape=(1, 1), strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), ceil_mode=0):
    """The operator in NumPy: window by window, float64 sums, in x's type (rounded once for float32)."""
    arrays = validate(x, dy, kernel_shape, strides, pads, dilations, ceil_mode)
    x64, dy64 = arrays["x"].astype(np.float64), arrays["dy"].astype(np.float64)
    h, w = x64.shape[2:]
    dx = np.zeros_like(x64)
    for oh_ in range(dy64.shape[2]):
        rows = _window(oh_ * strides[0] - pads[0], kernel_shape[0], dilations[0], h)
        for ow in range(dy64.shape[3]):
            columns = _window(ow * strides[1] - pads[1], kernel_shape[1], dilations[1], w)
            if not (rows.size and columns.size):
                continue
            window = x64[:, :, rows][:, :, :, columns].reshape(x64.shape[:2] + (-1,))
            first = np.where(np.isnan(window).any(-1), np.isnan(window).argmax(-1), window.argmax(-1))
            n, c = np.indices(x64.shape[:2])
            np.add.at(dx, (n, c, rows[first // columns.size], columns[first % columns.size]), dy64[:, :, oh_, ow])
    return Result(dx.astype(arrays["x"].dtype))


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    attributes = [OpSchema.Attribute(name, oh.make_attribute(name, default), text) for name, default, text in (
        ("kernel_shape", ATTRIBUTES["kernel_shape"], "The MaxPool's kernel [kh, kw]."),
        ("strides", ATTRIBUTES["strides"], "The MaxPool's strides [sh, sw]."),
        ("pads", ATTRIBUTES["pads"], "The MaxPool's pads [top, left, bottom, right]."),
        ("dilations", ATTRIBUTES["dilations"], "The MaxPool's dilations [dh, dw]."),
        ("ceil_mode", ATTRIBUTES["ceil_mode"], "The MaxPool's ceil_mode."))]
    return _common.make_schema(
        OP_TYPE, __doc__, [param("x", "T", "[N, C, H, W]."), param("dy", "T", "[N, C, Ho, Wo].")],
        [param("dx", "T", "Gradient of x.")],
        {"T": (("tensor(float)", "tensor(double)"), "x's and dy's type.")},
        _common.image_gradients_infer(OP_TYPE, _DIMS), attributes)


def function_body(opset: int = _common.ONNX_OPSET) -> onnx.FunctionProto:
    """The graph form ``normgrad.graphs.rules.pool`` writes without the operator: the MaxPool
    again with its Indices output (flat positions in x), and dy added there by a
    ScatterElements into zeros shaped like x."""
    ints, one = onnx.AttributeProto.INTS, onnx.AttributeProto.INT
    pool = oh.make_node("MaxPool", ["x"], ["y", "indices"])
    pool.attribute.extend(onnx.AttributeProto(name=name, ref_attr_name=name, type=one if name == "ceil_mode" else ints)
                          for name in ATTRIBUTES)
    nodes = [
        pool,
        oh.make_node("Constant", [], ["flat"], value_ints=[-1]),
        oh.make_node("Shape", ["x"], ["x_shape"]),
        oh.make_node("Constant", [], ["zero"], value_floats=[0.0]),
        oh.make_node("CastLike", ["zero", "x"], ["zero_like"]),
        oh.make_node("Expand", ["zero_like", "x_shape"], ["zeros"]),
        oh.make_node("Reshape", ["zeros", "flat"], ["zeros_flat"]),
        oh.make_node("Reshape", ["indices", "flat"], ["indices_flat"]),
        oh.make_node("Reshape", ["dy", "flat"], ["dy_flat"]),
        oh.make_node("ScatterElements", ["zeros_flat", "indices_flat", "dy_flat"], ["dx_flat"], axis=0,
                     reduction="add"),
        oh.make_node("Reshape", ["dx_flat", "x_shape"], ["dx"]),
    ]
    return oh.make_function(_common.DOMAIN, OP_TYPE, list(INPUTS), list(OUTPUTS), nodes,
                            [oh.make_opsetid("", opset)], attributes=list(ATTRIBUTES))
