"""External data: tensors kept out of a model's protobuf in a data file beside it.

:func:`stage_models_external` and :func:`save_models_external` write models with their large
tensors (or those already external) in one content-addressed ``PATH.HASH.data`` file, put in
place with the model as one set (:func:`normgrad.util.files.commit_files`);
:func:`external_data_extent` is the one check of an external tensor's location, offset and
length before a byte is read; :func:`check_model` runs onnx's checker on a model whose
data is external. The atomic writes, the multi-file commit and the path rules they use
live in :mod:`normgrad.util.files`."""

from __future__ import annotations

import os
import pathlib
from typing import Callable, Iterable, List, Mapping, Optional, Sequence

import onnx

from normgrad.util.files import (PathLike, PathOutsideFolderError, StagedFile, commit_files, path_inside,
                             refuse_irregular_file, stage_data_file, staging)

__all__ = ["INLINE_MODEL_BYTES", "EXTERNAL_TENSOR_MIN_BYTES", "uses_external_data", "check_model",
           "external_data_chunks", "save_models_external", "stage_models_external", "external_data_files",
           "ExternalDataError", "external_data_extent"]


INLINE_MODEL_BYTES = 1 << 30
"""Inline tensor bytes above which :func:`save_models_external` moves a model's tensors to
external data (protobuf refuses to serialize a message of 2 GiB or more)."""

EXTERNAL_TENSOR_MIN_BYTES = 1024
"""Tensors moved to external data are those of at least this many bytes."""


def uses_external_data(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def check_model(model: onnx.ModelProto, full_check: bool = True) -> None:
    """``onnx.checker.check_model(model, full_check)`` for a model whose initializers
    may keep their data in external files, from any current folder: onnx's checker looks for
    an in-memory model's external data in the current folder, so the check runs on a copy
    in which each external initializer is a graph input of its type and shape (its data is
    not read; :func:`save_models_external` and the sessions resolve it against the model's
    folder)."""
    external = [t for t in model.graph.initializer if uses_external_data(t)]
    if not external:
        onnx.checker.check_model(model, full_check=full_check)
        return
    names = {t.name for t in external}
    checked = onnx.ModelProto()
    checked.CopyFrom(model)
    kept = [t for t in checked.graph.initializer if t.name not in names]
    del checked.graph.initializer[:]
    checked.graph.initializer.extend(kept)
    declared = {i.name for i in checked.graph.input}
    checked.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                               for t in external if t.name not in declared)
    onnx.checker.check_model(checked, full_check=full_check)


_PIECE_BYTES = 64 << 20


def _external_pieces(tensor: onnx.TensorProto, base_dir: str) -> Iterable[bytes]:
    """The bytes of an external tensor read from its file in pieces of at most 64 MiB (a
    tensor of a GiB is not held whole)."""
    info = {entry.key: entry.value for entry in tensor.external_data}
    location = path_inside(base_dir, info.get("location", ""), f"external data of tensor {tensor.name!r}")
    offset, length = int(info.get("offset", 0)), info.get("length")
    left = None if length is None else int(length)
    with open(location, "rb") as file:
        file.seek(offset)
        while left is None or left > 0:
            piece = file.read(_PIECE_BYTES if left is None else min(left, _PIECE_BYTES))
            if not piece:
                break
            if left is not None:
                left -= len(piece)
            yield piece
    if left:
        raise OSError(f"the external data of tensor {tensor.name!r} in {location} is cut short "
                      f"({int(length) - left} of {length} bytes)")


TensorContents = Mapping[str, Callable[[], "bytes | memoryview"]]
"""``{tensor name: a function returning its bytes}``: tensors whose data is in memory outside
the model (a torch parameter), each read when it is written."""


def external_data_chunks(tensors: Iterable[onnx.TensorProto], location: str,
                         base_dir: Optional[str] = None, contents: TensorContents = {}) -> Iterable[bytes]:
    """The bytes of one data file named ``location`` holding ``tensors``, one tensor at a time
    (a base of several GiB is never held twice); as each is yielded, the tensor is changed in
    place to reference its place there. A tensor named in ``contents`` takes its bytes from
    there; another whose data is already external is read from ``base_dir``; tensors with the
    same source are written once."""
    def source(tensor):
        if tensor.name in contents:
            return ("contents", tensor.name)
        if not uses_external_data(tensor):
            return ("inline", id(tensor))
        info = {entry.key: entry.value for entry in tensor.external_data}
        return (tensor.name, info.get("location"), info.get("offset"), info.get("length"))

    written, offset = {}, 0
    for tensor in tensors:
        key = source(tensor)
        if key not in written:
            if key[0] == "contents":
                pieces = iter([contents[tensor.name]()])
            elif key[0] == "inline":
                pieces = iter([tensor.raw_data])
            else:
                pieces = _external_pieces(tensor, base_dir or os.getcwd())
            length = 0
            for piece in pieces:
                length += len(piece)
                yield piece
            pieces = piece = None
            written[key] = (offset, length)
            offset += length
        start, length = written[key]
        tensor.ClearField("external_data")
        tensor.ClearField("raw_data")
        for name, value in (("location", location), ("offset", str(start)), ("length", str(length))):
            tensor.external_data.add(key=name, value=value)
        tensor.data_location = onnx.TensorProto.EXTERNAL


def save_models_external(models: Mapping[str, onnx.ModelProto], base_dir: Optional[PathLike] = None,
                         share: bool = False, move: Sequence[onnx.TensorProto] = (),
                         contents: TensorContents = {}) -> None:
    """Writes each model of ``{path: model}`` as one set (:func:`stage_models_external`, then
    :func:`commit_files`: the data file under its new content-addressed name first, then
    the models; the replaced models' old data files are removed last)."""
    commit_files(stage_models_external(models, base_dir, share, move, contents))


def stage_models_external(models: Mapping[str, onnx.ModelProto], base_dir: Optional[PathLike] = None,
                          share: bool = False, move: Sequence[onnx.TensorProto] = (),
                          contents: TensorContents = {}) -> List[StagedFile]:
    """Each model of ``{path: model}`` as a :class:`StagedFile`, keeping large tensors out of its
    protobuf: the tensors whose data are in external files (locations relative to
    ``base_dir``, default the current folder) and then, or when a model's inline tensors
    pass :data:`INLINE_MODEL_BYTES`, its inline tensors of :data:`EXTERNAL_TENSOR_MIN_BYTES`
    or more too go to one data file, ``FIRST.HASH.data`` beside the first path
    (:func:`stage_data_file`), each tensor once (the models, in one folder, may share tensors:
    by name and source); with ``share`` and the models in ``base_dir``, external tensors stay
    in the files they reference; the inline tensors in ``move`` go to the data file too.
    The tensors named in ``contents`` count as inline ones that go there, their bytes from
    ``contents`` (:func:`external_data_chunks`; whatever their location says). The data file, if any, is staged first (streamed, one
    tensor at a time), then the models; the models' tensors are changed in place to
    reference it. Nothing is in place until :func:`commit_files`.

    Raises:
        PathOutsideFolderError: an external location outside ``base_dir``.
        OSError: a file cannot be read or written; the targets are then unchanged.
    """
    paths = [os.fspath(p) for p in models]
    folder = os.path.dirname(os.path.abspath(paths[0]))
    if any(os.path.dirname(os.path.abspath(p)) != folder for p in paths):
        raise ValueError(f"models written with one data file must be in one folder; got {paths}")
    base = os.fspath(base_dir) if base_dir is not None else os.getcwd()
    same_folder = os.path.realpath(base) == os.path.realpath(folder)
    moving = []
    for model in models.values():
        external = [t for t in model.graph.initializer if uses_external_data(t) and t.name not in contents]
        copied = [] if share and same_folder else external
        inline = [t for t in model.graph.initializer if not uses_external_data(t) or t.name in contents]
        if copied or sum(len(t.raw_data) for t in inline) > INLINE_MODEL_BYTES:
            copied += [t for t in inline if t.name in contents or len(t.raw_data) >= EXTERNAL_TENSOR_MIN_BYTES]
        moving += copied
    chosen = {id(t) for t in moving}
    moving += [t for t in move if id(t) not in chosen]
    moving += [t for model in models.values() for t in model.graph.initializer
               if t.name in contents and id(t) not in chosen]

    with staging() as staged:
        if moving:
            placeholder = os.path.basename(paths[0]) + ".data"
            staged.append(stage_data_file(paths[0], external_data_chunks(moving, placeholder, base, contents)))
            location = os.path.basename(staged[0].path)
            for tensor in moving:
                for entry in tensor.external_data:
                    if entry.key == "location":
                        entry.value = location
        for path, model in models.items():
            staged.append(StagedFile(path, [model.SerializeToString()]))
    return staged


def external_data_files(model: onnx.ModelProto, folder: PathLike) -> List[str]:
    """The files the external initializers of ``model`` read, resolved against ``folder``
    (locations that leave it are skipped: loading refuses them)."""
    files = set()
    for tensor in model.graph.initializer:
        if uses_external_data(tensor):
            location = {entry.key: entry.value for entry in tensor.external_data}.get("location", "")
            try:
                files.add(os.fspath(path_inside(folder, location)))
            except PathOutsideFolderError:
                pass
    return sorted(files)


_PACKED_4BIT = {getattr(onnx.TensorProto, name) for name in ("INT4", "UINT4", "FLOAT4E2M1") if hasattr(onnx.TensorProto, name)}
"""Types whose elements are stored two to a byte."""


class ExternalDataError(ValueError):
    """An external tensor whose location, offset, length or file cannot be used."""


def external_data_extent(tensor: onnx.TensorProto, folder: PathLike) -> "tuple[pathlib.Path, int, int]":
    """``(file, offset, length)`` of an external tensor, checked before a byte is read: the
    location stays inside ``folder`` (:func:`path_inside`), offset and length are integers
    >= 0, the length is what the tensor's type and shape need, and the file is a regular
    file holding at least offset + length bytes. The one check of every external tensor
    normgrad loads (checkpoints, step, evaluation and data-parallel graphs).

    Raises:
        ExternalDataError: naming the tensor, the file and the rule.
    """
    import numpy as np

    what = f"the external data of tensor {tensor.name!r}"
    info = {entry.key: entry.value for entry in tensor.external_data}
    try:
        location = path_inside(folder, info.get("location", ""), what)
    except PathOutsideFolderError as error:
        raise ExternalDataError(str(error)) from None
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except Exception:
        raise ExternalDataError(f"tensor {tensor.name!r} has unknown data type {tensor.data_type}") from None
    count = int(np.prod(list(tensor.dims), dtype=object))
    expected = (count + 1) // 2 if tensor.data_type in _PACKED_4BIT else count * itemsize
    try:
        offset, length = int(info.get("offset", "0")), int(info.get("length", str(expected)))
    except ValueError:
        raise ExternalDataError(f"{what} has no valid offset and length (got offset {info.get('offset')!r}, "
                                f"length {info.get('length')!r})") from None
    if offset < 0 or length != expected:
        raise ExternalDataError(f"tensor {tensor.name!r} of shape {list(tensor.dims)} needs {expected} bytes; {what} "
                                f"says offset {offset}, length {length}")
    try:
        refuse_irregular_file(location, "external data file")
        size = os.path.getsize(location)
    except FileNotFoundError:
        raise ExternalDataError(f"{what} is missing: no file {location} (the folder is {os.fspath(folder)})") from None
    except OSError as error:
        raise ExternalDataError(f"{what} is unreadable: {location}: {error.strerror or error}") from None
    if offset + length > size:
        raise ExternalDataError(f"external data file {location} holds {size} bytes; tensor {tensor.name!r} needs bytes "
                                f"{offset}..{offset + length} (the file is cut short)")
    return location, offset, length
