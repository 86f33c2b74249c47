"""BiasSafeSoftmax: :mod:`~normgrad.ops.safe_softmax` of ``x + bias`` (the bias broadcast over
x's leading axes) in one node.

Attention adds its mask (or a position bias) to the scores just before the softmax:
Add(scores [B, H, S, S], mask [B, 1, S, S]) then torch's safe softmax. The graph builder
writes this operator in place of the Add and the SafeSoftmax it would write
(``normgrad.graphs.rewrites.safe_softmaxes``): the kernel adds each row's bias while the row
is in cache, so the sum over x's size is not written and read back.

    z = x + bias             (float32, as the Add rounds it)
    y = SafeSoftmax(z)

so ``y`` is bitwise what Add then SafeSoftmax give. The function body is that, node for node:
Add, Softmax, IsNaN, Where. The gradient is SafeSoftmax's for x, and its sum over the axes the
bias was broadcast along for the bias.

Inputs:
    x (float32): the scores, rank >= 1, rows along the last axis.
    bias (float32): rank <= x's, the last axis x's, every other axis 1 or x's (aligned from the
        last, as NumPy broadcasts): added to every row of x it lines up with.

Output (float32, x's shape): y.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx

import normgrad.ops._common as _common
import normgrad.ops.safe_softmax as safe_softmax
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_SHAPE_FROM", "Result", "validate", "reference",
           "broadcasts_over_rows", "schema", "function_body"]

OP_TYPE = "BiasSafeSoftmax"
INPUTS = ("x", "bias")
OUTPUTS = ("y",)
ATTRIBUTES: dict = {}
OUTPUT_SHAPE_FROM = {"y": ("x", None)}
"""(The Python kernel's output when it rejects its input: NaN shaped like x.)"""


class Result(NamedTuple):
    """The output."""

    y: np.ndarray


def broadcasts_over_rows(bias_shape, x_shape) -> bool:
    """Whether a bias of ``bias_shape`` fits an x of ``x_shape`` (ints): rank at most x's, the
    last axis x's, every other axis 1 or x's."""
    bias_shape, x_shape = list(bias_shape), list(x_shape)
    if not bias_shape or len(bias_shape) > len(x_shape) or bias_shape[-1] != x_shape[-1]:
        return False
    return all(b in (1, x) for b, x in zip(bias_shape[:-1], x_shape[len(x_shape) - len(bias_shape):-1]))


def validate(x, bias) -> dict:
    """Checks the inputs against the contract (float64 is accepted for float64 checks):
    {input name: array}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    x = safe_softmax.validate(x)["x"]
    bias = np.asarray(bias)
    if bias.dtype != x.dtype:
        raise NormgradInputError(f"{OP_TYPE}: input 'bias' must have the type of 'x' ({x.dtype}); got {bias.dtype}")
    if not broadcasts_over_rows(bias.shape, x.shape):
        raise NormgradInputError(
            f"{OP_TYPE}: input 'bias' must have rank <= x's, x's last axis and every other axis 1 or x's "
            f"(x {list(x.shape)}); got {list(bias.shape)}")
    return {"x": x, "bias": bias}


def reference(x, bias) -> Result:
    """SafeSoftmax's reference of x + bias (added in their dtype, as the Add)."""
    arrays = validate(x, bias)
    return Result(safe_softmax.reference(arrays["x"] + arrays["bias"]).y)


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    inputs = [param("x", "T", "The scores, rank >= 1, rows along the last axis."),
              param("bias", "T", "Added to x: rank <= x's, x's last axis, every other axis 1 or x's.")]
    outputs = [param("y", "T", "softmax(x + bias) over the last axis, rows that would be NaN 0; x's shape.")]
    return _common.make_schema(OP_TYPE, __doc__, inputs, outputs, {"T": "float32."},
                               _common.rows_output_infer(OP_TYPE, 0, "x"), types=("tensor(float)",))


def function_body(opset: int = _common.ONNX_OPSET) -> onnx.FunctionProto:
    """Add, then SafeSoftmax's standard form (Softmax, IsNaN, Where)."""
    import onnx.numpy_helper as onh

    def write(op):
        zero = op("Constant", value=onh.from_array(np.zeros((), np.float32)))
        return [safe_softmax.standard_form(op, zero, op("Add", "x", "bias"))]

    return _common.function_of_standard_form(OP_TYPE, INPUTS, OUTPUTS, opset, write)
