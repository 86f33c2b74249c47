"""Every file normgrad writes or removes goes through here.

Writes go to a temporary file in the same folder (``.NAME.PID.XXXX.tmp``), flushed to disk,
then renamed over the target, so a crash or a full disk never leaves a truncated file where
a good one was; the temporary files of a killed writer are removed by the next write to the
same target. Paths inside a named folder (the corpus, a checkpoint's external data) go
through :func:`path_inside`, which refuses any path that leaves the folder, through ``..``,
an absolute path or a symbolic link."""

from __future__ import annotations

import os
import pathlib
import re
import tempfile
from typing import Iterable, List, Mapping, Optional, Union

import onnx

__all__ = ["write_bytes_atomic", "write_chunks_atomic", "StagedFile", "save_model_atomic", "save_models_external", "external_data_chunks",
           "stage_models_external",
           "check_model", "uses_external_data", "refuse_same_file", "PathOutsideFolderError",
           "path_inside", "write_inside", "remove_inside", "remove_stale_temporaries"]

PathLike = Union[str, "os.PathLike[str]"]


def write_bytes_atomic(path: PathLike, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically (temporary file in the same folder, then rename).

    Raises:
        OSError: the folder is not writable or the write failed; ``path`` is then unchanged.
    """
    write_chunks_atomic(path, [data])


def _temporary_pattern(name: str) -> "re.Pattern[str]":
    return re.compile(rf"\.{re.escape(name)}\.(\d+)\.[A-Za-z0-9_]+\.tmp")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def remove_stale_temporaries(path: PathLike) -> None:
    """Removes the temporary files that writers of ``path`` killed before their rename left
    (those of processes that no longer run; a live writer's file is kept)."""
    folder, name = os.path.split(os.path.abspath(os.fspath(path)))
    pattern = _temporary_pattern(name)
    try:
        entries = os.listdir(folder)
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry)
        if match and int(match.group(1)) != os.getpid() and not _process_alive(int(match.group(1))):
            try:
                os.unlink(os.path.join(folder, entry))
            except OSError:
                pass


def write_chunks_atomic(path: PathLike, chunks: Iterable[bytes]) -> None:
    """Writes the concatenation of ``chunks`` to ``path`` atomically (a large file without
    joining it in memory first); removes stale temporary files of ``path`` first.

    Raises:
        OSError: the folder is not writable or the write failed; ``path`` is then unchanged.
    """
    staged = StagedFile(path, chunks)
    try:
        staged.commit()
    except BaseException:
        staged.discard()
        raise


class StagedFile:
    """A file written and flushed under a temporary name beside its target, not yet in
    place: :meth:`commit` renames it over the target, :meth:`discard` removes it. For
    writing several files only once all of them are built."""

    def __init__(self, path: PathLike, chunks: Iterable[bytes]) -> None:
        self.path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(self.path))
        remove_stale_temporaries(self.path)
        handle, self.temporary = tempfile.mkstemp(prefix=f".{os.path.basename(self.path)}.{os.getpid()}.",
                                                  suffix=".tmp", dir=folder)
        try:
            with os.fdopen(handle, "wb") as file:
                for chunk in chunks:
                    file.write(chunk)
                file.flush()
                os.fsync(file.fileno())
        except BaseException:
            self.discard()
            raise

    def commit(self) -> None:
        if os.path.exists(self.path):
            os.chmod(self.temporary, os.stat(self.path).st_mode & 0o7777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(self.temporary, 0o666 & ~umask)
        os.replace(self.temporary, self.path)

    def discard(self) -> None:
        try:
            os.unlink(self.temporary)
        except FileNotFoundError:
            pass


def save_model_atomic(model: onnx.ModelProto, path: PathLike) -> None:
    """``onnx.save`` through :func:`write_bytes_atomic` (models under protobuf's 2 GiB limit)."""
    write_bytes_atomic(path, model.SerializeToString())


INLINE_MODEL_BYTES = 1 << 30
"""Inline tensor bytes above which :func:`save_models_external` moves a model's tensors to
external data (protobuf refuses to serialize a message of 2 GiB or more)."""

EXTERNAL_TENSOR_MIN_BYTES = 1024
"""Tensors moved to external data are those of at least this many bytes."""


def uses_external_data(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def check_model(model: onnx.ModelProto) -> None:
    """``onnx.checker.check_model(model, full_check=True)`` for a model whose initializers
    may keep their data in external files, from any current folder: onnx's checker looks for
    an in-memory model's external data in the current folder, so the check runs on a copy
    in which each external initializer is a graph input of its type and shape (its data is
    not read; :func:`save_models_external` and the sessions resolve it against the model's
    folder)."""
    external = [t for t in model.graph.initializer if uses_external_data(t)]
    if not external:
        onnx.checker.check_model(model, full_check=True)
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
    onnx.checker.check_model(checked, full_check=True)


def _external_bytes(tensor: onnx.TensorProto, base_dir: str) -> bytes:
    info = {entry.key: entry.value for entry in tensor.external_data}
    location = path_inside(base_dir, info.get("location", ""), f"external data of tensor {tensor.name!r}")
    offset, length = int(info.get("offset", 0)), info.get("length")
    with open(location, "rb") as file:
        file.seek(offset)
        data = file.read(-1 if length is None else int(length))
    if length is not None and len(data) != int(length):
        raise OSError(f"the external data of tensor {tensor.name!r} in {location} is cut short "
                      f"({len(data)} of {length} bytes)")
    return data


def external_data_chunks(tensors: Iterable[onnx.TensorProto], location: str,
                         base_dir: Optional[str] = None) -> Iterable[bytes]:
    """The bytes of one data file named ``location`` holding ``tensors``, one tensor at a time
    (a base of several GiB is never held twice); as each is yielded, the tensor is changed in
    place to reference its place there. A tensor whose data is already external is read from
    ``base_dir``; tensors with the same source are written once."""
    def source(tensor):
        if not uses_external_data(tensor):
            return ("inline", id(tensor))
        info = {entry.key: entry.value for entry in tensor.external_data}
        return (tensor.name, info.get("location"), info.get("offset"), info.get("length"))

    written, offset = {}, 0
    for tensor in tensors:
        key = source(tensor)
        if key not in written:
            data = tensor.raw_data if key[0] == "inline" else _external_bytes(tensor, base_dir or os.getcwd())
            written[key] = (offset, len(data))
            offset += len(data)
            yield data
            del data
        start, length = written[key]
        tensor.ClearField("external_data")
        tensor.ClearField("raw_data")
        for name, value in (("location", location), ("offset", str(start)), ("length", str(length))):
            tensor.external_data.add(key=name, value=value)
        tensor.data_location = onnx.TensorProto.EXTERNAL


def save_models_external(models: Mapping[str, onnx.ModelProto], base_dir: Optional[PathLike] = None,
                         share: bool = False) -> None:
    """Writes each model of ``{path: model}`` atomically (:func:`stage_models_external`, then
    the data file and the models renamed into place, in that order)."""
    staged = stage_models_external(models, base_dir, share)
    try:
        for file in staged:
            file.commit()
    finally:
        for file in staged:
            file.discard()


def stage_models_external(models: Mapping[str, onnx.ModelProto], base_dir: Optional[PathLike] = None,
                          share: bool = False) -> List[StagedFile]:
    """Each model of ``{path: model}`` as a :class:`StagedFile`, keeping large tensors out of its
    protobuf: the tensors whose data are in external files (locations relative to
    ``base_dir``, default the current folder) and then, or when a model's inline tensors
    pass :data:`INLINE_MODEL_BYTES`, its inline tensors of :data:`EXTERNAL_TENSOR_MIN_BYTES`
    or more too go to one data file, the first path + ``.data``, each tensor once (the models,
    in one folder, may share tensors: by name and source); with ``share`` and the models in
    ``base_dir``, external tensors stay in the files they reference. The data file, if any,
    is staged first (streamed, one tensor at a time), then the models; the models' tensors
    are changed in place to reference it. Nothing is in place until each file is committed.

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
    data_path = paths[0] + ".data"
    location = os.path.basename(data_path)
    moving = []
    for model in models.values():
        external = [t for t in model.graph.initializer if uses_external_data(t)]
        copied = [] if share and same_folder else external
        inline = [t for t in model.graph.initializer if not uses_external_data(t)]
        if copied or sum(len(t.raw_data) for t in inline) > INLINE_MODEL_BYTES:
            copied += [t for t in inline if len(t.raw_data) >= EXTERNAL_TENSOR_MIN_BYTES]
        moving += copied

    staged = []
    try:
        if moving:
            staged.append(StagedFile(data_path, external_data_chunks(moving, location, base)))
        for path, model in models.items():
            staged.append(StagedFile(path, [model.SerializeToString()]))
    except BaseException:
        for file in staged:
            file.discard()
        raise
    return staged


def refuse_same_file(source: PathLike, target: PathLike, what: str = "output") -> None:
    """Raises ValueError when ``target`` names the same file as ``source`` (in-place writes
    would destroy the input)."""
    if os.path.exists(target) and os.path.exists(source) and os.path.samefile(source, target):
        raise ValueError(f"the {what} {os.fspath(target)!r} is the input file itself; write to another path")


class PathOutsideFolderError(ValueError):
    """A path that would leave the folder it must stay in."""


def path_inside(folder: PathLike, relative: str, what: str = "path", follow_last: bool = True) -> pathlib.Path:
    """``folder``/``relative``, when it stays inside ``folder``: ``relative`` is a non-empty
    relative path without ``..``, and following the symbolic links that exist along it
    does not lead out of ``folder`` (with ``follow_last=False`` the last component is not
    followed: for removing a link itself). The one check every file normgrad writes or
    removes inside a named folder goes through.

    Raises:
        PathOutsideFolderError: naming ``what``, ``relative`` and the rule it breaks.
    """
    text = os.fspath(relative)
    parts = pathlib.PurePosixPath(text.replace(os.sep, "/")).parts
    if not text or os.path.isabs(text) or pathlib.PurePosixPath(text).is_absolute() or ".." in parts or not parts:
        raise PathOutsideFolderError(f"{what} {text!r} is not a plain relative path inside {os.fspath(folder)}")
    root = os.path.realpath(os.fspath(folder))
    target = os.path.join(os.fspath(folder), *parts)
    followed = target if follow_last else os.path.dirname(target)
    resolved = os.path.realpath(followed)
    if os.path.commonpath([root, resolved]) != root:
        raise PathOutsideFolderError(f"{what} {text!r} leads outside {os.fspath(folder)} (through a symbolic link, to "
                                     f"{resolved}); refusing to touch it")
    return pathlib.Path(target)


def write_inside(folder: PathLike, relative: str, data: bytes, what: str = "file") -> pathlib.Path:
    """Writes ``data`` to ``folder``/``relative`` atomically, creating its folders, after
    :func:`path_inside` (checked again once the folders exist).

    Raises:
        PathOutsideFolderError: the path leaves ``folder``; nothing is written.
        OSError: the write failed; the file is then unchanged.
    """
    path = path_inside(folder, relative, what)
    path.parent.mkdir(parents=True, exist_ok=True)
    path = path_inside(folder, relative, what)
    write_bytes_atomic(path, data)
    return path


def remove_inside(folder: PathLike, relative: str, what: str = "file") -> bool:
    """Removes the file ``folder``/``relative`` (a symbolic link is removed itself, never
    what it points to) after :func:`path_inside` with ``follow_last=False``, then the folders
    the removal emptied, up to ``folder``. Returns whether something was removed.

    Raises:
        PathOutsideFolderError: the path leaves ``folder``; nothing is removed.
    """
    path = path_inside(folder, relative, what, follow_last=False)
    if not (path.is_symlink() or path.is_file()):
        return False
    path.unlink()
    root = pathlib.Path(folder)
    for parent in path.parents:
        if parent == root or not parent.is_relative_to(root) or parent.is_symlink() or any(parent.iterdir()):
            break
        parent.rmdir()
    return True
