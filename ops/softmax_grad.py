"""SoftmaxGrad: the gradient of a softmax over the last axis, in one pass per row.

With y = softmax(x) along the last axis and dy the gradient of y:

    dx = y * (dy - s),  s = sum_c dy[..., c] * y[..., c]  (per row, the last axis)

The standard-op form (:func:`standard_form`: Mul, ReduceSum, Sub, Mul) makes four passes
over [rows, n] and writes three intermediates; the kernel reads each row of dy and y once
for the sum and again, from cache, for dx. The Softmax gradient rule
(``normgrad.graphs.rules.activations``) writes it for a float32 Softmax over the last axis;
other types and axes keep the standard-op form, which is also the function body (so
``--inline`` graphs and runtimes without the kernels compute what they did). The C++
kernel sums each row's float32 products in a fixed order (fixed blocks of float32 lanes
added into a float64 sum), rows never split between threads: the same bits at any thread
count and on its AVX2 and portable loops. A NaN entry makes its row's dx NaN, an infinite
one gives the formula's infinities and NaN (as the standard-op form).

Inputs:
    dy (float32): the gradient of y; y's shape.
    y (float32): the softmax's output, rank >= 1, rows along the last axis.

Output (float32, y's shape): dx.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import onnx
import onnx.numpy_helper as onh

import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_SHAPE_FROM", "Result", "validate", "reference",
           "standard_form", "schema", "function_body"]

OP_TYPE = "SoftmaxGrad"
INPUTS = ("dy", "y")
OUTPUTS = ("dx",)
ATTRIBUTES: dict = {}
OUTPUT_SHAPE_FROM = {"dx": ("y", None)}
"""(The Python kernel's output when it rejects its input: NaN shaped like y.)"""


class Result(NamedTuple):
    """The output."""

    dx: np.ndarray


def validate(dy, y) -> dict:
    """Checks the inputs against the contract (float64 is accepted for float64 checks):
    {input name: array}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    y, dy = np.asarray(y), np.asarray(dy)
    for name, value in (("dy", dy), ("y", y)):
        if value.dtype not in (np.float32, np.float64):
            raise NormgradInputError(f"{OP_TYPE}: input '{name}' must be float32; got {value.dtype}")
    if y.ndim == 0:
        raise NormgradInputError(f"{OP_TYPE}: input 'y' must have rank >= 1 (rows along the last axis); got a scalar")
    _common.check_same_shape(OP_TYPE, "dy", dy, "y", y)
    return {"dy": dy, "y": y}


def reference(dy, y) -> Result:
    """y * (dy - sum(dy * y, last axis)) in float64, returned in y's dtype."""
    arrays = validate(dy, y)
    dy64, y64 = arrays["dy"].astype(np.float64), arrays["y"].astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        dx = y64 * (dy64 - np.sum(dy64 * y64, axis=-1, keepdims=True))
    return Result(dx.astype(arrays["y"].dtype))


def standard_form(op: Callable, row_sum: Callable, dy: str, y: str) -> str:
    """dx in standard ONNX ops, as the graph builder writes it without the operator.

    Args:
        op: ``op(op_type, *inputs) -> output name`` appends a default-domain node.
        row_sum: ``row_sum(value) -> name`` of the sum over the softmax's axis, dims kept.
    """
    return op("Mul", y, op("Sub", dy, row_sum(op("Mul", dy, y))))


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    inputs = [param("dy", "T", "The gradient of the softmax's output; y's shape."),
              param("y", "T", "The softmax's output (over the last axis), rank >= 1.")]
    outputs = [param("dx", "T", "y * (dy - sum(dy * y, last axis)); y's shape.")]
    return _common.make_schema(OP_TYPE, __doc__, inputs, outputs, {"T": "float32."}, _common.rows_output_infer(OP_TYPE, 1, "y"), types=("tensor(float)",))


def function_body(opset: int = _common.ONNX_OPSET) -> onnx.FunctionProto:
    """:func:`standard_form` as an ONNX function, the sum over axis -1."""

    def write(op):
        def row_sum(value: str) -> str:
            if opset < 13:
                return op("ReduceSum", value, axes=[-1], keepdims=1)
            return op("ReduceSum", value, op("Constant", value=onh.from_array(np.array([-1], np.int64))), keepdims=1)

        return [standard_form(op, row_sum, "dy", "y")]

    return _common.function_of_standard_form(OP_TYPE, INPUTS, OUTPUTS, opset, write)
