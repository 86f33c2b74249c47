"""Checkpoints: named tensors plus string metadata in one ONNX ModelProto.

The file is an ONNX model (IR version 10) whose graph holds nothing but initializers, one
``TensorProto`` per tensor with raw data (any ONNX dtype; bfloat16 and the float8 types as
onnx's ``ml_dtypes`` arrays), and whose ``metadata_props`` hold the metadata. Any ONNX tool
reads it (``onnx.load``); values round-trip bitwise. Writes are atomic
(:func:`normgrad._files.commit_files`): a crash while saving leaves the old file.

Integrity: the metadata ``normgrad.checksum`` is the SHA-256 of every tensor's name, type,
shape and bytes and of the other metadata; :func:`load` recomputes it and refuses a file
whose checksum is missing (a file cut short loses its metadata first) or differs.

Checkpoints whose tensors exceed protobuf's 2 GiB message limit (or any, with
``save(..., external_data=True)``) keep the tensor bytes in one file beside the checkpoint,
``NAME.HASH.data``, as ONNX external data; :func:`load` resolves it against the checkpoint's
folder, refuses a location outside that folder, and checks every size before reading.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

from normgrad._files import PathLike, StagedFile, commit_files, complete_interrupted_commits, staging
from normgrad._external_data import ExternalDataError, external_data_extent
from normgrad.errors import CheckpointError
from normgrad.ops._common import IR_VERSION

__all__ = ["Checkpoint", "CheckpointError", "save", "stage", "load", "from_proto", "check_matches", "CHECKSUM_METADATA"]

_GRAPH_NAME = "normgrad_checkpoint"
CHECKSUM_METADATA = "normgrad.checksum"
"""Metadata key of the checkpoint's SHA-256 (``sha256:HEX``), written by :func:`save`."""
EXTERNAL_DATA_BYTES = 2**31 - 2**26
"""Tensor bytes above which :func:`save` writes external data (protobuf refuses messages of 2 GiB)."""
_ALIGNMENT = 64


@dataclasses.dataclass
class Checkpoint:
    tensors: Dict[str, np.ndarray]
    metadata: Dict[str, str]


def save(path: PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] = {},
         external_data: Optional[bool] = None) -> None:
    """Writes ``tensors`` and ``metadata`` to ``path`` atomically, with a checksum.

    ``external_data``: keep the tensor bytes in ``NAME.HASH.data`` beside ``path`` (default:
    when they exceed :data:`EXTERNAL_DATA_BYTES`). The data file is written first, under a
    name of its own, then the checkpoint; the data file of the previous checkpoint at
    ``path`` is removed only after that, so a crash at any point leaves a loadable checkpoint.

    Raises:
        CheckpointError: a tensor that is not a NumPy array of an ONNX dtype, or metadata
            that is not str -> str (or uses the reserved key ``normgrad.checksum``).
        OSError: the write failed; ``path`` is then unchanged.
    """
    commit_files(stage(path, tensors, metadata, external_data))


def stage(path: PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] = {},
          external_data: Optional[bool] = None) -> List[StagedFile]:
    """What :func:`save` writes, staged (:class:`normgrad._files.StagedFile`: the data file,
    if any, then the checkpoint), for :func:`normgrad._files.commit_files` to put in place,
    alone or with other files as one set."""
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise CheckpointError(f"checkpoint metadata must map str to str, got {key!r}: {type(value).__name__}")
    if CHECKSUM_METADATA in metadata:
        raise CheckpointError(f"checkpoint metadata key {CHECKSUM_METADATA!r} is reserved: save() writes it")
    model = helper.make_model(helper.make_graph([], _GRAPH_NAME, [], []), opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = IR_VERSION
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"checkpoint tensor names must be non-empty strings, got {name!r}")
        if not isinstance(value, np.ndarray):
            raise CheckpointError(f"checkpoint tensor {name!r} must be a numpy.ndarray, got {type(value).__name__}")
        try:
            tensor = numpy_helper.from_array(np.require(value, requirements="C"), name)  # keeps 0-d shapes
        except Exception as error:  # onnx raises several types for unsupported dtypes
            raise CheckpointError(f"checkpoint tensor {name!r}: dtype {value.dtype} has no ONNX type ({error})") from None
        model.graph.initializer.append(tensor)  # into the model directly: one copy of the tensors at a time
        del tensor
    initializers = model.graph.initializer
    # one tensor's bytes at a time: a copy of every tensor at once would double the memory
    checksum = _checksum(((tensor, _inline_payload(tensor)) for tensor in initializers), metadata)
    if external_data is None:
        external_data = sum(value.nbytes for value in tensors.values()) > EXTERNAL_DATA_BYTES
    folder, name = os.path.split(os.path.abspath(os.fspath(path)))
    with staging() as staged:
        if external_data:
            data_name = f"{name}.{checksum.split(':')[1][:16]}.data"
            staged.append(StagedFile(os.path.join(folder, data_name), _external_chunks(initializers, data_name),
                                     fresh=True))
        helper.set_model_props(model, {**metadata, CHECKSUM_METADATA: checksum})
        staged.append(StagedFile(path, [model.SerializeToString()]))
    return staged


def _external_chunks(initializers: Sequence[onnx.TensorProto], data_name: str):
    """The bytes of the external data file, one tensor at a time, each tensor turned into a
    reference to its place in the file as its bytes are written (string tensors stay inline)."""
    offset = 0
    for tensor in initializers:
        if not tensor.HasField("raw_data"):
            continue
        padding = -offset % _ALIGNMENT
        payload = tensor.raw_data
        yield bytes(padding)
        yield payload
        offset += padding
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(len(payload)))):
            tensor.external_data.add(key=key, value=value)
        offset += len(payload)


def _inline_payload(tensor: onnx.TensorProto) -> bytes:
    """The bytes the checksum covers: the raw data, or the typed fields of a tensor without."""
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    typed = onnx.TensorProto()
    typed.CopyFrom(tensor)
    typed.ClearField("name")
    return typed.SerializeToString(deterministic=True)


def _checksum(tensors_and_payloads: Iterable[Tuple[onnx.TensorProto, bytes]], metadata: Mapping[str, str]) -> str:
    digest = hashlib.sha256()
    for tensor, payload in tensors_and_payloads:
        header = json.dumps([tensor.name, tensor.data_type, list(tensor.dims), len(payload)])
        digest.update(header.encode("utf-8") + b"\0")
        digest.update(payload)
    rest = sorted((k, v) for k, v in metadata.items() if k != CHECKSUM_METADATA)
    digest.update(json.dumps(rest).encode("utf-8"))
    return f"sha256:{digest.hexdigest()}"


def load(path: PathLike, verify: bool = True) -> Checkpoint:
    """Reads a checkpoint written by :func:`save`, its external data from the checkpoint's
    folder. ``verify=False`` skips the checksum (for checkpoints written before normgrad
    wrote one; a truncated file may then load as a valid one).

    Raises:
        CheckpointError: the file is missing, unreadable, not a normgrad checkpoint, cut
            short or altered (checksum), or its external data is outside its folder,
            missing, shorter than its tensors or larger than this machine's memory.
    """
    complete_interrupted_commits(os.path.dirname(os.path.abspath(os.fspath(path))))
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as error:
        raise CheckpointError(f"cannot read checkpoint {str(path)!r}: {error.strerror or error}") from None
    if not data:
        raise CheckpointError(f"{str(path)!r} is not a checkpoint: the file is empty")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception:
        raise CheckpointError(f"{str(path)!r} is not a checkpoint: not an ONNX model (or a checkpoint cut short)") from None
    del data
    return from_proto(model, repr(str(path)), folder=os.path.dirname(os.path.abspath(os.fspath(path))), verify=verify)


def _memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _size_text(count: int) -> str:
    return f"{count / 2**30:.1f} GiB" if count >= 2**30 else f"{count} bytes"


def _external_payloads(tensors: Sequence[onnx.TensorProto], folder: Optional[str], where: str) -> List[Optional[bytes]]:
    """Every external tensor's bytes (None for inline ones), every location and size checked
    before the first byte is read."""
    plans = []
    for tensor in tensors:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            plans.append(None)
            continue
        if folder is None:
            raise CheckpointError(f"checkpoint {where}: tensor {tensor.name!r} keeps its data in an external file; "
                                  "load the checkpoint from its path (normgrad.checkpoint.load)")
        try:
            location, offset, length = external_data_extent(tensor, folder)
        except ExternalDataError as error:
            raise CheckpointError(f"checkpoint {where}: {error}") from None
        plans.append((location, offset, length))
    needed = sum(plan[2] for plan in plans if plan)
    memory = _memory_bytes()
    if memory is not None and needed > memory:
        raise CheckpointError(f"checkpoint {where}: its external data needs {_size_text(needed)}, more than this "
                              f"machine's memory ({_size_text(memory)})")
    payloads: List[Optional[bytes]] = []
    for tensor, plan in zip(tensors, plans):
        if plan is None:
            payloads.append(None)
            continue
        location, offset, length = plan
        try:
            with open(location, "rb") as file:
                file.seek(offset)
                payload = file.read(length)
        except OSError as error:
            raise CheckpointError(f"checkpoint {where}: cannot read the external data of tensor {tensor.name!r}: "
                                  f"{error.strerror or error}") from None
        if len(payload) != length:
            raise CheckpointError(f"checkpoint {where}: the external data of tensor {tensor.name!r} is cut short")
        payloads.append(payload)
    return payloads


def from_proto(model: onnx.ModelProto, where: str = "the model", folder: Optional[PathLike] = None,
               verify: bool = True) -> Checkpoint:
    """The checkpoint a ModelProto holds (what :func:`load` reads from a file). ``folder``:
    where its external data is (the checkpoint file's folder); without it, a checkpoint
    with external data is refused. ``verify``: check ``normgrad.checksum``.

    Raises:
        CheckpointError: ``model`` is not a normgrad checkpoint (``where`` names it in the
            message), lacks its checksum or does not match it, or its external data cannot
            be used (see :func:`load`).
    """
    if model.graph.name != _GRAPH_NAME or model.graph.node or model.graph.input or model.graph.output:
        raise CheckpointError(f"{where} is not a checkpoint: a checkpoint's graph holds only initializers")
    metadata = {entry.key: entry.value for entry in model.metadata_props}
    initializers = list(model.graph.initializer)
    names = set()
    for tensor in initializers:
        if tensor.name in names:
            raise CheckpointError(f"checkpoint {where} holds tensor {tensor.name!r} twice")
        names.add(tensor.name)
    if verify and CHECKSUM_METADATA not in metadata:
        raise CheckpointError(f"checkpoint {where} has no {CHECKSUM_METADATA} metadata: the file is cut short, or was "
                              "written before normgrad checksummed checkpoints (normgrad.checkpoint.load(path, "
                              "verify=False) reads it; save it again)")
    external = _external_payloads(initializers, None if folder is None else os.fspath(folder), where)
    payloads = ((t, _inline_payload(t) if e is None else e) for t, e in zip(initializers, external))
    if verify and _checksum(payloads, metadata) != metadata[CHECKSUM_METADATA]:
        raise CheckpointError(f"checkpoint {where} does not match its {CHECKSUM_METADATA}: the file (or its external "
                              "data) was altered or damaged after it was written")
    tensors: Dict[str, np.ndarray] = {}
    for tensor, payload in zip(initializers, external):
        if payload is not None:
            inline = onnx.TensorProto()
            inline.CopyFrom(tensor)
            inline.ClearField("external_data")
            inline.data_location = onnx.TensorProto.DEFAULT
            inline.raw_data = payload
            tensor = inline
        try:
            tensors[tensor.name] = numpy_helper.to_array(tensor)
        except Exception as error:
            raise CheckpointError(f"checkpoint {where}: tensor {tensor.name!r} is unreadable ({_one_line(error)})") from None
    metadata.pop(CHECKSUM_METADATA, None)
    return Checkpoint(tensors=tensors, metadata=metadata)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


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
