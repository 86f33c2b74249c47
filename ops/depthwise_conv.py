"""DepthwiseConv: a 2-D depthwise Conv's output (one output channel per input channel).

For x [N, C, H, W], w [C, 1, kh, kw], an optional bias b [C] and the geometry of the
attributes (as Conv's: strides, pads [top, left, bottom, right], dilations):

    y[n, c, oh, ow] = b[c] + Σ_{a, b'} w[c, 0, a, b'] x[n, c, oh sh - pt + a dh, ow sw - pl + b' dw]

(taps falling in the padding contribute nothing): Conv(x, w, b, group=C). onnxruntime runs a
depthwise Conv fast only in its NCHWc layout, which it applies to constant weights alone; a
training graph's weights are inputs, so its depthwise Convs took the generic path, 5-17x
torch's time per conv at 1 thread (a 7x7 on [16, 48, 32, 32]: 8.2 against 1.35 ms). The
training graph builder writes this operator in place of each depthwise Conv whose gradient is
a ``DepthwiseConvGrad`` (``normgrad.graphs.rewrites.depthwise_forward``). The C++ kernel takes
one (sample, channel) plane per task: the plane copied once into a zero-padded scratch (split
by column phase when strided), every y element one chain of fused multiply-adds over the taps
in order from b (or 0), the same bits on the AVX2 and the portable path and at any thread
count. The function body is the Conv itself.

Inputs:
    x (float or double): [N, C, H, W].
    w (x's type): [C, 1, kh, kw].
    b (x's type, optional): [C].

Output (x's type): y, [N, C, Ho, Wo] (Conv's output size).

kh is at most 64 (:data:`MAX_KERNEL_ROWS`).

Attributes: group (must equal C), strides, pads, dilations (as Conv's; explicit: no auto_pad).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
import onnx.helper as oh

import normgrad.ops._common as _common
import normgrad.ops.depthwise_conv_grad as depthwise_conv_grad
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "MAX_KERNEL_ROWS", "Result", "validate", "reference", "schema",
           "function_body"]

OP_TYPE = "DepthwiseConv"
INPUTS = ("x", "w", "b")
OUTPUTS = ("y",)
ATTRIBUTES: dict = dict(depthwise_conv_grad.ATTRIBUTES)
"""(INTS geometry: no Python kernel, as DepthwiseConvGrad; onnxruntime runs the function body there.)"""
_DIMS = {"x": "[N, C, H, W]", "w": "[C, 1, kh, kw]"}
MAX_KERNEL_ROWS = depthwise_conv_grad.MAX_KERNEL_ROWS


class Result(NamedTuple):
    """The output."""

    y: np.ndarray


def validate(x, w, b=None, group=1, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1)) -> dict:
    """Checks the inputs and attributes against the contract: {input name: array} (b only when given).

    Raises:
        NormgradInputError: naming the offending input or attribute and the rule it broke.
    """
    arrays = _common.float32_or_float64_arrays(OP_TYPE, _DIMS, (x, w))
    depthwise_conv_grad.check_geometry(OP_TYPE, arrays, group, strides, pads, dilations)
    if b is not None:
        b = np.asarray(b)
        channels = arrays["x"].shape[1]
        if b.dtype != arrays["x"].dtype or b.shape != (channels,):
            raise NormgradInputError(f"{OP_TYPE}: input 'b' must be [C] = [{channels}] of x's type {arrays['x'].dtype}; "
                                     f"got {b.dtype} {list(b.shape)}")
        arrays["b"] = b
    return arrays


def reference(x, w, b=None, group=1, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1)) -> Result:
    """The operator in NumPy: float64 sums tap by tap, in x's type (rounded once for float32)."""
    arrays = validate(x, w, b, group, strides, pads, dilations)
    x64, w64 = arrays["x"].astype(np.float64), arrays["w"].astype(np.float64)
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = strides, pads, dilations
    padded = np.pad(x64, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    ho, wo = depthwise_conv_grad.check_geometry(OP_TYPE, arrays, group, strides, pads, dilations)
    y = np.zeros(x64.shape[:2] + (ho, wo))
    if "b" in arrays:
        y += arrays["b"].astype(np.float64)[None, :, None, None]
    for a in range(w64.shape[2]):
        for column in range(w64.shape[3]):
            rows = slice(a * dh, a * dh + (ho - 1) * sh + 1, sh)
            columns = slice(column * dw, column * dw + (wo - 1) * sw + 1, sw)
            y += w64[None, :, 0, a, column, None, None] * padded[:, :, rows, columns]
    return Result(y.astype(arrays["x"].dtype))


def _attribute_ints(ctx, name: str) -> list:
    attribute = ctx.get_attribute(name)
    return list(attribute.ints) if attribute is not None else list(ATTRIBUTES[name])


def _infer(ctx) -> None:
    x_type, w_type = _common.input_tensor_type(ctx, 0), _common.input_tensor_type(ctx, 1)
    elem_type = x_type.elem_type if x_type is not None and x_type.elem_type else onnx.TensorProto.FLOAT
    x_dims, w_dims = _common.known_dims(x_type), _common.known_dims(w_type)
    for name, dims in (("x", x_dims), ("w", w_dims)):
        if dims is not None and len(dims) != 4:
            raise NormgradInputError(f"{OP_TYPE}: input '{name}' must have rank 4 ({_DIMS[name]}); got rank {len(dims)}")
    out = None
    if x_dims is not None:
        out = [x_dims[0], x_dims[1], None, None]
        strides, pads, dilations = (_attribute_ints(ctx, name) for name in ("strides", "pads", "dilations"))
        if w_dims is not None and len(strides) == 2 and len(pads) == 4 and len(dilations) == 2:
            for axis in range(2):
                size, kernel = x_dims[2 + axis], w_dims[2 + axis]
                if isinstance(size, int) and isinstance(kernel, int):
                    out[2 + axis] = depthwise_conv_grad.output_size(size, kernel, strides[axis], pads[axis],
                                                                    pads[axis + 2], dilations[axis])
    ctx.set_output_type(0, _common.make_output_type(elem_type, out))


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    return _common.make_schema(
        OP_TYPE, __doc__,
        [param("x", "T", "[N, C, H, W]."), param("w", "T", "[C, 1, kh, kw]."),
         param("b", "T", "[C] (optional).", param_option=OpSchema.FormalParameterOption.Optional)],
        [param("y", "T", "[N, C, Ho, Wo].")],
        {"T": (("tensor(float)", "tensor(double)"), "x's, w's and b's type.")}, _infer,
        depthwise_conv_grad.geometry_attributes())


def function_body(opset: int = _common.ONNX_OPSET) -> onnx.FunctionProto:
    """The Conv itself (an omitted b is an omitted Conv bias)."""
    conv = oh.make_node("Conv", list(INPUTS), list(OUTPUTS))
    conv.attribute.extend(onnx.AttributeProto(name=name, ref_attr_name=name, type=kind) for name, kind in (
        ("group", onnx.AttributeProto.INT), ("strides", onnx.AttributeProto.INTS),
        ("pads", onnx.AttributeProto.INTS), ("dilations", onnx.AttributeProto.INTS)))
    return oh.make_function(_common.DOMAIN, OP_TYPE, list(INPUTS), list(OUTPUTS), [conv],
                            [oh.make_opsetid("", opset)], attributes=list(ATTRIBUTES))
