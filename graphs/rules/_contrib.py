"""Output types of onnxruntime's own operators (onnx's shape inference does not know them),
shared by the ``com.microsoft`` rule modules: see :attr:`registry.Rule.output_types`."""

from __future__ import annotations

from typing import Callable, List, Optional

import onnx

__all__ = ["TypeOf", "input_type", "rows_type", "like_input", "with_last_dim"]

TypeOf = Callable[[str], Optional[onnx.TypeProto]]


def input_type(node: onnx.NodeProto, type_of: TypeOf, index: int) -> Optional[onnx.TypeProto]:
    """The type of ``node``'s input ``index`` (None when absent or unknown)."""
    if len(node.input) <= index or not node.input[index]:
        return None
    return type_of(node.input[index])


def rows_type(type_proto: Optional[onnx.TypeProto], axis: int, elem_type: int) -> Optional[onnx.TypeProto]:
    """Per-row statistics of a tensor of ``type_proto`` normalised over the axes >= ``axis``:
    its shape with those dims 1, of ``elem_type`` (None when the rank is unknown)."""
    if type_proto is None or not type_proto.tensor_type.HasField("shape"):
        return None
    result = onnx.TypeProto()
    result.CopyFrom(type_proto)
    result.tensor_type.elem_type = elem_type
    dims = result.tensor_type.shape.dim
    for dim in dims[axis % len(dims):] if dims else []:
        dim.Clear()
        dim.dim_value = 1
    return result


def like_input(index: int = 0) -> Callable[[onnx.NodeProto, TypeOf], List[Optional[onnx.TypeProto]]]:
    """Output types for an op whose every output is shaped and typed like input ``index``."""
    def output_types(node: onnx.NodeProto, type_of: TypeOf) -> List[Optional[onnx.TypeProto]]:
        return [input_type(node, type_of, index)] * len(node.output)

    return output_types


def with_last_dim(type_proto: Optional[onnx.TypeProto], size: int) -> Optional[onnx.TypeProto]:
    """``type_proto`` with its last dim ``size`` (None when its rank is unknown or 0)."""
    if type_proto is None or not type_proto.tensor_type.HasField("shape") or not type_proto.tensor_type.shape.dim:
        return None
    result = onnx.TypeProto()
    result.CopyFrom(type_proto)
    last = result.tensor_type.shape.dim[-1]
    last.Clear()
    last.dim_value = size
    return result
