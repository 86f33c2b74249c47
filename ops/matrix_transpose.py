"""MatrixTranspose: a matrix's transpose as a new contiguous tensor.

y[j, i] = x[i, j]: a copy, so every backend gives the same bits. It is what the weight
gradients of large products (``normgrad.graphs.context.GradientContext.weight_gradient``)
read instead of a transposed GEMM operand: MLAS (onnxruntime's CPU GEMM) multiplies a
transposed A panel by panel at 70-75 GFLOP/s where the same product of contiguous
operands runs at 85-90 (1 thread, AVX2), and onnxruntime folds a standard ``Transpose``
that feeds a Gemm back into the Gemm's ``transA``/``transB`` (GemmTransposeFusion). The
C++ kernel transposes 8 x 8 blocks in registers; onnxruntime's own Transpose takes about
twice as long on [1024, 1024]. Its function body is that ``Transpose``, which ``--inline``
and the portable form write instead (there onnxruntime folds it into the Gemm as before).

Input:
    x (float or double): [M, N].

Output (x's type): y, [N, M].
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
import onnx.helper as oh

import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_SHAPE_FROM", "Result", "validate", "reference",
           "schema", "function_body"]

OP_TYPE = "MatrixTranspose"
INPUTS = ("x",)
OUTPUTS = ("y",)
ATTRIBUTES: dict = {}
OUTPUT_SHAPE_FROM = {"y": ("x", None)}
"""(The Python kernel's output when it rejects its input: NaN shaped like x.)"""
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class Result(NamedTuple):
    """The output."""

    y: np.ndarray


def validate(x) -> dict:
    """Checks the input against the contract: {input name: array}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    x = np.asarray(x)
    if x.dtype not in _DTYPES:
        raise NormgradInputError(f"{OP_TYPE}: input 'x' must be float32 or float64; got {x.dtype}")
    if x.ndim != 2:
        raise NormgradInputError(f"{OP_TYPE}: input 'x' must have rank 2 ([M, N]); got shape {list(x.shape)}")
    return {"x": x}


def reference(x) -> Result:
    """The operator in NumPy, in x's dtype."""
    return Result(np.ascontiguousarray(validate(x)["x"].T))


def _infer(ctx) -> None:
    x_type = _common.input_tensor_type(ctx, 0)
    elem_type = x_type.elem_type if x_type is not None and x_type.elem_type else onnx.TensorProto.FLOAT
    dims = _common.known_dims(x_type)
    if dims is not None and len(dims) != 2:
        raise NormgradInputError(f"{OP_TYPE}: input 'x' must have rank 2 ([M, N]); got rank {len(dims)}")
    ctx.set_output_type(0, _common.make_output_type(elem_type, None if dims is None else dims[::-1]))


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    return _common.make_schema(OP_TYPE, __doc__, [param("x", "T", "[M, N].")],
                               [param("y", "T", "[N, M]: x's transpose.")],
                               {"T": (("tensor(float)", "tensor(double)"), "x's type.")}, _infer)


def function_body(opset: int = _common.ONNX_OPSET) -> onnx.FunctionProto:
    """One standard Transpose."""
    nodes = [oh.make_node("Transpose", ["x"], ["y"], perm=[1, 0])]
    return oh.make_function(_common.DOMAIN, OP_TYPE, list(INPUTS), list(OUTPUTS), nodes,
                            [oh.make_opsetid("", opset)])
