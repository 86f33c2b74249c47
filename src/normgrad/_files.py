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
from typing import Iterable, Union

import onnx

__all__ = ["write_bytes_atomic", "write_chunks_atomic", "StagedFile", "save_model_atomic", "refuse_same_file", "PathOutsideFolderError",
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
