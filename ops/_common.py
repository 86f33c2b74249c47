"""Definitions shared by every normgrad operator: the domain, dtypes, errors, checks."""

from __future__ import annotations

from typing import Sequence

import ml_dtypes
import numpy as np
import onnx

__all__ = [
    "DOMAIN",
    "OPSET_VERSION",
    "IR_VERSION",
    "ONNX_OPSET",
    "FLOAT_TYPES",
    "NormgradInputError",
    "as_float_array",
    "check_attribute_flag",
    "check_rank",
    "check_same_shape",
    "check_vector",
    "is_float_dtype",
    "make_schema",
]

DOMAIN = "normgrad"
"""The ONNX domain of every normgrad operator."""

OPSET_VERSION = 1
"""The opset version of :data:`DOMAIN` that this release defines."""

IR_VERSION = 10
"""IR version of every model normgrad writes: onnxruntime 1.19.2 loads IR <= 10."""

ONNX_OPSET = 18
"""Default-domain opset used by the function bodies and the models normgrad writes."""

FLOAT_TYPES = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)")
"""Element types both operators accept, as ONNX type strings."""

# float64 is not an operator type; the NumPy references accept it for float64 checks.
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64))


class NormgradInputError(ValueError):
    """An operator input breaks the operator's contract.

    The message names the operator, the offending input and the rule it broke.
    """


def is_float_dtype(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is an element type the operators (or, for float64, the references) accept."""
    return np.dtype(dtype) in _FLOAT_DTYPES


def as_float_array(op: str, name: str, value) -> np.ndarray:
    """Returns ``value`` as an array after checking it has an accepted dtype."""
    array = np.asarray(value)
    if not is_float_dtype(array.dtype):
        raise NormgradInputError(
            f"{op}: input '{name}' must be float32, float16 or bfloat16; got {array.dtype}"
        )
    return array


def check_rank(op: str, name: str, array: np.ndarray, low: int, high: int) -> None:
    """Raises unless ``low <= array.ndim <= high``."""
    if not low <= array.ndim <= high:
        raise NormgradInputError(
            f"{op}: input '{name}' must have rank {low}..{high}; got rank {array.ndim} "
            f"(shape {list(array.shape)})"
        )


def check_same_shape(op: str, name: str, array: np.ndarray, ref_name: str, ref: np.ndarray) -> None:
    """Raises unless ``array`` has the shape and dtype of ``ref``."""
    if array.shape != ref.shape:
        raise NormgradInputError(
            f"{op}: input '{name}' must have the shape of '{ref_name}' {list(ref.shape)}; "
            f"got {list(array.shape)}"
        )
    if array.dtype != ref.dtype:
        raise NormgradInputError(
            f"{op}: input '{name}' must have the dtype of '{ref_name}' ({ref.dtype}); got {array.dtype}"
        )


def check_vector(op: str, name: str, array: np.ndarray, shape: Sequence[int], rule: str) -> None:
    """Raises unless ``array.shape == shape``; ``rule`` says where ``shape`` comes from."""
    if tuple(array.shape) != tuple(shape):
        raise NormgradInputError(
            f"{op}: input '{name}' must have shape {list(shape)} ({rule}); got {list(array.shape)}"
        )


def check_attribute_flag(op: str, name: str, value: int) -> int:
    """Returns ``value`` as an int after checking it is 0 or 1."""
    if value not in (0, 1):
        raise NormgradInputError(f"{op}: attribute '{name}' must be 0 or 1; got {value}")
    return int(value)


def tensor_type(dtype: np.dtype) -> int:
    """The ``onnx.TensorProto`` element type of a NumPy dtype."""
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def input_tensor_type(ctx, index: int):
    """The ``TypeProto.Tensor`` of input ``index`` during shape inference, or None."""
    if index >= ctx.get_num_inputs() or not ctx.has_input(index):
        return None
    type_proto = ctx.get_input_type(index)
    if type_proto is None or not type_proto.HasField("tensor_type"):
        return None
    return type_proto.tensor_type


def known_dims(tensor_type) -> list | None:
    """The dims of a ``TypeProto.Tensor``: ints, dim_param strings or None; None if rank unknown."""
    if tensor_type is None or not tensor_type.HasField("shape"):
        return None
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim
    ]


def make_output_type(elem_type: int, dims) -> onnx.TypeProto:
    """A tensor ``TypeProto``; ``dims`` may hold None (unknown) or symbolic strings."""
    if dims is None:
        return onnx.helper.make_tensor_type_proto(elem_type, None)
    return onnx.helper.make_tensor_type_proto(elem_type, list(dims))


def attribute_int(ctx, name: str, default: int) -> int:
    """An int attribute of the node being inferred, or ``default`` when absent."""
    attr = ctx.get_attribute(name)
    if attr is None:
        return default
    if attr.type != onnx.AttributeProto.INT:
        raise NormgradInputError(f"attribute '{name}' must be an int")
    return attr.i


def make_schema(op_type: str, doc: str, inputs, outputs, type_docs, infer, attributes=(), types=FLOAT_TYPES):
    """An ``OpSchema`` of the normgrad domain: deterministic, with type constraints T and U
    over ``types`` (default :data:`FLOAT_TYPES`; ``type_docs`` says what each covers) and
    ``infer`` as its type and shape inference."""
    from onnx.defs import OpSchema

    op_schema = OpSchema(
        op_type,
        DOMAIN,
        OPSET_VERSION,
        doc,
        inputs=list(inputs),
        outputs=list(outputs),
        type_constraints=[(name, list(types), text) for name, text in type_docs.items()],
        attributes=list(attributes),
        node_determinism=OpSchema.NodeDeterminism.Deterministic,
    )
    op_schema.set_type_and_shape_inference_function(infer)
    return op_schema


def dims_compatible(a, b) -> bool:
    """Whether two dim lists can be equal (unknown and symbolic dims match anything)."""
    if len(a) != len(b):
        return False
    return all(not isinstance(p, int) or not isinstance(q, int) or p == q for p, q in zip(a, b))
