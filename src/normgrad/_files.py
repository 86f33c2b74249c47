"""Every file normgrad writes goes through here: to a temporary file in the same folder,
flushed to disk, then renamed over the target, so a crash or a full disk never leaves a
truncated file where a good one was."""

from __future__ import annotations

import os
import tempfile
from typing import Union

import onnx

__all__ = ["write_bytes_atomic", "save_model_atomic", "refuse_same_file"]

PathLike = Union[str, "os.PathLike[str]"]


def write_bytes_atomic(path: PathLike, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically (temporary file in the same folder, then rename).

    Raises:
        OSError: the folder is not writable or the write failed; ``path`` is then unchanged.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        if os.path.exists(path):
            os.chmod(temporary, os.stat(path).st_mode & 0o7777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise


def save_model_atomic(model: onnx.ModelProto, path: PathLike) -> None:
    """``onnx.save`` through :func:`write_bytes_atomic` (models under protobuf's 2 GiB limit)."""
    write_bytes_atomic(path, model.SerializeToString())


def refuse_same_file(source: PathLike, target: PathLike, what: str = "output") -> None:
    """Raises ValueError when ``target`` names the same file as ``source`` (in-place writes
    would destroy the input)."""
    if os.path.exists(target) and os.path.exists(source) and os.path.samefile(source, target):
        raise ValueError(f"the {what} {os.fspath(target)!r} is the input file itself; write to another path")
