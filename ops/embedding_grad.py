"""EmbeddingGrad: the gradient of a Gather along axis 0 (an embedding lookup) with respect
to its table.

Row k of ``dy`` is added to row ``indices[k]`` of a zero table shaped ``shape``; rows that
no index names stay zero, and a row named several times is the sum of its dy rows in
increasing k (each element a left-to-right float sum, so every backend gives the same bits
at any thread count). It is what the Gather gradient rule
(``normgrad.graphs.rules.gather``) writes for a float32 table of more than ``ONE_HOT_ROWS``
rows; its function body is the standard-op form the rule wrote before the operator existed,
a ``ScatterElements(reduction="add")`` into an ``Expand``-ed zero table of dy and of the
indices broadcast to dy's shape, which the C++ kernel replaces by one zero fill and N row
additions.

Inputs:
    dy (float or double): [N, D1, ..., Dm], the gradient of the gathered rows (m >= 0).
    indices (int64): [N, 1, ..., 1], dy's rank: the table row each dy row was read from, in
        [0, rows). The trailing unit axes are what ScatterElements in the function body
        needs (indices of dy's rank, broadcast along its trailing axes); negative indices
        are an error here (the gradient rule counts them from the end beforehand).
    shape (int64): [m + 1], the table's shape [rows, D1, ..., Dm]; rows >= 0.

Output (dy's type, shape ``shape``): ddata, the gradient of the table.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_SHAPE_FROM", "INPUT_DTYPES", "Result", "validate",
           "reference", "schema", "function_body"]

OP_TYPE = "EmbeddingGrad"
INPUTS = ("dy", "indices", "shape")
OUTPUTS = ("ddata",)
ATTRIBUTES: dict = {}
OUTPUT_SHAPE_FROM = {"ddata": ("dy", None)}
"""(The Python kernel's output when it rejects its inputs: NaN shaped like dy, since
``shape`` may be what is wrong.)"""
INPUT_DTYPES = {"indices": np.dtype(np.int64), "shape": np.dtype(np.int64)}
"""The element types of the inputs that are not float data (the Python kernels declare them)."""
_DY_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class Result(NamedTuple):
    """The output."""

    ddata: np.ndarray


def _int64(name: str, value) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype != np.int64:
        raise NormgradInputError(f"{OP_TYPE}: input '{name}' must be int64; got {array.dtype}")
    return array


def validate(dy, indices, shape) -> dict:
    """Checks the inputs against the contract: {input name: array}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    dy = np.asarray(dy)
    if dy.dtype not in _DY_DTYPES:
        raise NormgradInputError(f"{OP_TYPE}: input 'dy' must be float32 or float64; got {dy.dtype}")
    if dy.ndim < 1:
        raise NormgradInputError(f"{OP_TYPE}: input 'dy' must have rank >= 1 ([N, ...]); got a scalar")
    shape, indices = _int64("shape", shape), _int64("indices", indices)
    wanted = [dy.ndim]
    if list(shape.shape) != wanted:
        raise NormgradInputError(f"{OP_TYPE}: input 'shape' must have shape {wanted} (dy's rank); "
                                 f"got {list(shape.shape)}")
    if shape[0] < 0:
        raise NormgradInputError(f"{OP_TYPE}: input 'shape' must have rows = shape[0] >= 0; got {int(shape[0])}")
    if list(shape[1:]) != list(dy.shape[1:]):
        raise NormgradInputError(f"{OP_TYPE}: input 'shape' must end with dy's dims {list(dy.shape[1:])}; "
                                 f"got {shape.tolist()}")
    wanted = [dy.shape[0]] + [1] * (dy.ndim - 1)
    if list(indices.shape) != wanted:
        raise NormgradInputError(f"{OP_TYPE}: input 'indices' must have shape {wanted} (dy's first dim, then ones "
                                 f"to dy's rank); got {list(indices.shape)}")
    rows = int(shape[0])
    outside = np.flatnonzero((indices < 0) | (indices >= rows))
    if outside.size:
        raise NormgradInputError(f"{OP_TYPE}: input 'indices' must hold row numbers in [0, rows) = [0, {rows}); "
                                 f"got {int(indices.reshape(-1)[outside[0]])} at position {int(outside[0])}")
    return {"dy": dy, "indices": indices.reshape(-1), "shape": shape}


def reference(dy, indices, shape) -> Result:
    """The operator in NumPy, in dy's dtype (float64 for a float64 check): ``np.add.at``
    adds the rows in increasing k, as the kernels do."""
    arrays = validate(dy, indices, shape)
    ddata = np.zeros(tuple(arrays["shape"]), arrays["dy"].dtype)
    np.add.at(ddata, arrays["indices"], arrays["dy"])
    return Result(ddata)


def _infer(ctx) -> None:
    dy_type = _common.input_tensor_type(ctx, 0)
    elem_type = dy_type.elem_type if dy_type is not None and dy_type.elem_type else onnx.TensorProto.FLOAT
    dy_dims = _common.known_dims(dy_type)
    dims = None if dy_dims is None else [None] + dy_dims[1:]
    known = ctx.get_input_data(2) if ctx.get_num_inputs() > 2 and ctx.has_input(2) else None
    if known is not None:
        dims = [int(d) for d in onh.to_array(known).reshape(-1)]
    ctx.set_output_type(0, _common.make_output_type(elem_type, dims))


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    inputs = [param("dy", "T", "[N, D1, ..., Dm]: the gradient of the gathered rows."),
              param("indices", "I", "[N, 1, ..., 1] (dy's rank): each dy row's table row, in [0, rows)."),
              param("shape", "I", "[m + 1]: the table's shape [rows, D1, ..., Dm].")]
    outputs = [param("ddata", "T", "The table's gradient, shaped `shape`.")]
    return _common.make_schema(OP_TYPE, __doc__, inputs, outputs,
                               {"T": (("tensor(float)", "tensor(double)"), "dy's type."),
                                "I": (("tensor(int64)",), "int64.")}, _infer)


def function_body(opset: int = _common.ONNX_OPSET) -> onnx.FunctionProto:
    """The Gather gradient rule's standard-op form: a zero table of dy's type, the indices
    broadcast to dy's shape, one ScatterElements adding dy's rows (in increasing k)."""
    nodes = [
        oh.make_node("Constant", [], ["zero"], value=onh.from_array(np.asarray(0.0, np.float32))),
        oh.make_node("CastLike", ["zero", "dy"], ["zero_like_dy"]),
        oh.make_node("Expand", ["zero_like_dy", "shape"], ["zeros"]),
        oh.make_node("Shape", ["dy"], ["dy_shape"]),
        oh.make_node("Expand", ["indices", "dy_shape"], ["indices_like_dy"]),
        oh.make_node("ScatterElements", ["zeros", "indices_like_dy", "dy"], ["ddata"], axis=0, reduction="add"),
    ]
    return oh.make_function(_common.DOMAIN, OP_TYPE, list(INPUTS), list(OUTPUTS), nodes,
                            [oh.make_opsetid("", opset)])
