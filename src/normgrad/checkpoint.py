"""Checkpoints: named tensors plus string metadata in one ONNX ModelProto.

The file is an ONNX model (IR version 10) whose graph holds nothing but initializers, one
``TensorProto`` per tensor with raw data (any ONNX dtype; bfloat16 and the float8 types as
onnx's ``ml_dtypes`` arrays), and whose ``metadata_props`` hold the metadata. Any ONNX tool
reads it (``onnx.load``); values round-trip bitwise. Writes are atomic
(:func:`normgrad._files.write_bytes_atomic`): a crash while saving leaves the old file.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Tuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

from normgrad._files import PathLike, write_bytes_atomic
from normgrad.ops._common import IR_VERSION

__all__ = ["Checkpoint", "CheckpointError", "save", "load", "from_proto", "check_matches"]

_GRAPH_NAME = "normgrad_checkpoint"


class CheckpointError(ValueError):
    """A file that is not a readable checkpoint, or one that does not match what is expected."""


@dataclasses.dataclass
class Checkpoint:
    tensors: Dict[str, np.ndarray]
    metadata: Dict[str, str]


def save(path: PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] = {}) -> None:
    """Writes ``tensors`` and ``metadata`` to ``path`` atomically.

    Raises:
        CheckpointError: a tensor that is not a NumPy array of an ONNX dtype, or metadata
            that is not str -> str.
        OSError: the write failed; ``path`` is then unchanged.
    """
    initializers = []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"checkpoint tensor names must be non-empty strings, got {name!r}")
        if not isinstance(value, np.ndarray):
            raise CheckpointError(f"checkpoint tensor {name!r} must be a numpy.ndarray, got {type(value).__name__}")
        try:
            tensor = numpy_helper.from_array(np.require(value, requirements="C"), name)  # keeps 0-d shapes
        except Exception as error:  # onnx raises several types for unsupported dtypes
            raise CheckpointError(f"checkpoint tensor {name!r}: dtype {value.dtype} has no ONNX type ({error})") from None
        initializers.append(tensor)
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise CheckpointError(f"checkpoint metadata must map str to str, got {key!r}: {type(value).__name__}")
    graph = helper.make_graph([], _GRAPH_NAME, [], [], initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = IR_VERSION
    helper.set_model_props(model, dict(metadata))
    write_bytes_atomic(path, model.SerializeToString())


def load(path: PathLike) -> Checkpoint:
    """Reads a checkpoint written by :func:`save`.

    Raises:
        CheckpointError: the file is missing, unreadable, or not a normgrad checkpoint.
    """
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as error:
        raise CheckpointError(f"cannot read checkpoint {str(path)!r}: {error.strerror or error}") from None
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception:
        raise CheckpointError(f"{str(path)!r} is not a checkpoint: not an ONNX model") from None
    return from_proto(model, repr(str(path)))


def from_proto(model: onnx.ModelProto, where: str = "the model") -> Checkpoint:
    """The checkpoint a ModelProto holds (what :func:`load` reads from a file).

    Raises:
        CheckpointError: ``model`` is not a normgrad checkpoint (``where`` names it in the message).
    """
    if model.graph.name != _GRAPH_NAME or model.graph.node or model.graph.input or model.graph.output:
        raise CheckpointError(f"{where} is not a checkpoint: a checkpoint's graph holds only initializers")
    tensors: Dict[str, np.ndarray] = {}
    for tensor in model.graph.initializer:
        if tensor.name in tensors:
            raise CheckpointError(f"checkpoint {where} holds tensor {tensor.name!r} twice")
        try:
            tensors[tensor.name] = numpy_helper.to_array(tensor)
        except Exception as error:
            raise CheckpointError(f"checkpoint {where}: tensor {tensor.name!r} is unreadable ({error})") from None
    metadata = {entry.key: entry.value for entry in model.metadata_props}
    return Checkpoint(tensors=tensors, metadata=metadata)


def check_matches(checkpoint: Checkpoint, expected: Mapping[str, Tuple[np.dtype, tuple]]) -> None:
    """Raises :class:`CheckpointError` naming the first tensor (in sorted order) that is
    missing, extra, or of another dtype or shape than ``expected`` says."""
    missing = sorted(set(expected) - set(checkpoint.tensors))
    if missing:
        raise CheckpointError(f"checkpoint has no tensor {missing[0]!r} (missing: {', '.join(missing)})")
    extra = sorted(set(checkpoint.tensors) - set(expected))
    if extra:
        raise CheckpointError(f"checkpoint has tensor {extra[0]!r}, which is not expected (extra: {', '.join(extra)})")
    for name in sorted(expected):
        dtype, shape = expected[name]
        value = checkpoint.tensors[name]
        if value.dtype != np.dtype(dtype):
            raise CheckpointError(f"checkpoint tensor {name!r} has dtype {value.dtype}, expected {np.dtype(dtype)}")
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(f"checkpoint tensor {name!r} has shape {list(value.shape)}, expected {list(shape)}")
