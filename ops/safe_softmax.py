"""SafeSoftmax: a softmax over the last axis whose rows that would be NaN are 0, in one pass per row.

    y = softmax(x) along the last axis; every element that is NaN there is 0

torch's exporters write scaled-dot-product attention's softmax (``_safe_softmax``) as
Softmax(axis=-1), IsNaN, Where(isnan, 0, softmax): three passes over [rows, n] and two
intermediates. A row's softmax is NaN whole or not at all: it is NaN exactly when the row
holds a NaN or a +inf, or all its entries are -inf (a fully masked attention row), and
such a row is 0. The graph builder writes this operator in place of that chain for a
float32 x (``normgrad.graphs.rewrites.safe_softmaxes``); the function body is those three
nodes (so ``--inline`` graphs and runtimes without the kernels compute what they did).

The kernel computes the softmax itself (the max, exp(x - max) and its float64 sum, the
scaling of SoftmaxCrossEntropy's row code): its results differ from onnxruntime's Softmax
(MLAS's exp) by float32 rounding, each within a few ulps of the float64 softmax, so a step
graph's forward activations differ from the exported inference model's by rounding only.
Rows are never split between threads and the sum's order is fixed: the same bits at any
thread count and on the AVX2 and portable loops.

Its gradient (the SafeSoftmax rule) is ``SoftmaxGrad(dy, y)``: 0 on a zeroed row, as torch's
``_safe_softmax`` backward (``_softmax_backward_data(grad, result)``).

Input:
    x (float32): the scores, rank >= 1, rows along the last axis.

Output (float32, x's shape): y.
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

OP_TYPE = "SafeSoftmax"
INPUTS = ("x",)
OUTPUTS = ("y",)
ATTRIBUTES: dict = {}
OUTPUT_SHAPE_FROM = {"y": ("x", None)}
"""(The Python kernel's output when it rejects its input: NaN shaped like x.)"""


class Result(NamedTuple):
    """The output."""

    y: np.ndarray


def validate(x) -> dict:
    """Checks the input against the contract (float64 is accepted for float64 checks):
    {input name: array}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float64):
        raise NormgradInputError(f"{OP_TYPE}: input 'x' must be float32; got {x.dtype}")
    if x.ndim == 0:
        raise NormgradInputError(f"{OP_TYPE}: input 'x' must have rank >= 1 (rows along the last axis); got a scalar")
    return {"x": x}


def reference(x) -> Result:
    """softmax(x) over the last axis in float64, NaN elements 0, returned in x's dtype."""
    x = validate(x)["x"]
    x64 = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(x64 - np.max(x64, axis=-1, keepdims=True, initial=-np.inf))
        y = e / np.sum(e, axis=-1, keepdims=True)
    return Result(np.where(np.isnan(y), 0.0, y).astype(x.dtype))


def standard_form(op: Callable, zero: str, x: str, axis: int = -1) -> str:
    """y in standard ONNX ops, as torch's exporters write it: Softmax, IsNaN, Where.

    Args:
        op: ``op(op_type, *inputs, **attributes) -> output name`` appends a default-domain node.
        zero: the name of a float32 scalar 0.
    """
    softmax = op("Softmax", x, axis=axis)
    return op("Where", op("IsNaN", softmax), zero, softmax)


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    inputs = [param("x", "T", "The scores, rank >= 1, rows along the last axis.")]
    outputs = [param("y", "T", "softmax(x) over the last axis, rows that would be NaN 0; x's shape.")]
    return _common.make_schema(OP_TYPE, __doc__, inputs, outputs, {"T": "float32."}, _common.rows_output_infer(OP_TYPE, 0, "x"), types=("tensor(float)",))


def function_body(opset: int = _common.ONNX_OPSET) -> onnx.FunctionProto:
    """:func:`standard_form` as an ONNX function (the 0 a Constant node)."""
    return _common.function_of_standard_form(
        OP_TYPE, INPUTS, OUTPUTS, opset,
        lambda op: [standard_form(op, op("Constant", value=onh.from_array(np.zeros((), np.float32))), "x")])
