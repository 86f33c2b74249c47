"""Every file normgrad writes or removes goes through here.

Writes go to a temporary file in the same folder (``.NAME.PID.XXXX.tmp``), flushed to disk,
then renamed over the target, so a crash or a full disk never leaves a truncated file where
a good one was; the temporary files of a killed writer are removed by the next write to the
same target. Paths inside a named folder (the corpus, a checkpoint's external data) go
through :func:`path_inside`, which refuses any path that leaves the folder, through ``..``,
an absolute path or a symbolic link.

Sets of files (a model and its external data, a step graph with its evaluation graph and
checkpoint, an adapter folder) are put in place by :func:`commit_files`, whose docstring
says where each set's commit point is; :func:`refuse_aliases` is the one check that a
write's targets are none of its inputs, of each other, or of the files a loaded graph reads.
Models whose tensors live in external data files (writing them, checking their extents)
are :mod:`normgrad._external_data`'s."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile
from typing import Iterable, Iterator, List, Mapping, Sequence, Union

import onnx

__all__ = ["write_bytes_atomic", "write_chunks_atomic", "StagedFile", "save_model_atomic", "stage_data_file",
           "staging", "commit_files", "complete_interrupted_commits", "owned_data_files", "refuse_aliases",
           "PathAliasError", "refuse_irregular_file", "PathOutsideFolderError", "path_inside", "write_inside",
           "remove_inside", "remove_stale_temporaries"]

PathLike = Union[str, "os.PathLike[str]"]


def write_bytes_atomic(path: PathLike, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically (temporary file in the same folder, then rename).

    Raises:
        OSError: the folder is not writable or the write failed; ``path`` is then unchanged.
    """
    write_chunks_atomic(path, [data])


def current_umask() -> int:
    """The process's umask (read by setting it and back: no call only reads it)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


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
    (those of processes that no longer run; a live writer's file is kept), after finishing
    the interrupted commits of its folder (:func:`complete_interrupted_commits`), whose
    temporaries are the new set."""
    folder, name = os.path.split(os.path.abspath(os.fspath(path)))
    complete_interrupted_commits(folder)
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
    commit_files([StagedFile(path, chunks)])


class StagedFile:
    """A file written and flushed under a temporary name beside its target, not yet in
    place: :func:`commit_files` (or :meth:`commit`) renames it over the target,
    :meth:`discard` removes it. For writing several files only once all of them are built.

    ``fresh``: the target is a name no live file references yet (external data under a
    content-addressed name), so it may be put in place before the set's commit point.
    ``digest``: the SHA-256 (hex) of the bytes written."""

    def __init__(self, path: PathLike, chunks: Iterable[bytes], fresh: bool = False) -> None:
        self.path = os.fspath(path)
        self.fresh = fresh
        folder = os.path.dirname(os.path.abspath(self.path))
        remove_stale_temporaries(self.path)
        handle, self.temporary = tempfile.mkstemp(prefix=f".{os.path.basename(self.path)}.{os.getpid()}.",
                                                  suffix=".tmp", dir=folder)
        digest = hashlib.sha256()
        try:
            os.fchmod(handle, 0o666 & ~current_umask())  # mkstemp's 0600 -> open()'s mode, whatever path commits it
            with os.fdopen(handle, "wb") as file:
                for chunk in chunks:
                    file.write(chunk)
                    digest.update(chunk)
                file.flush()
                os.fsync(file.fileno())
        except BaseException:
            self.discard()
            raise
        self.digest = digest.hexdigest()

    def commit(self) -> None:
        if os.path.exists(self.path):  # a replaced file keeps its mode, as open(path, "w") keeps it
            os.chmod(self.temporary, os.stat(self.path).st_mode & 0o7777)
        os.replace(self.temporary, self.path)

    def discard(self) -> None:
        try:
            os.unlink(self.temporary)
        except FileNotFoundError:
            pass


@contextlib.contextmanager
def staging() -> Iterator[List[StagedFile]]:
    """A list to append :class:`StagedFile` objects to; on an error inside the block every
    one of them is discarded."""
    staged: List[StagedFile] = []
    try:
        yield staged
    except BaseException:
        for file in staged:
            file.discard()
        raise


def stage_data_file(path: PathLike, chunks: Iterable[bytes]) -> StagedFile:
    """The external data of the model at ``path`` as a fresh :class:`StagedFile` named by its
    content, ``PATH.HASH.data`` (HASH: 16 hex digits of its SHA-256): a new data file never
    takes the name of one a live model reads, and the same bytes get the same name."""
    staged = StagedFile(os.fspath(path) + ".data", chunks, fresh=True)
    staged.path = data_file_name(path, staged.digest)
    return staged


def data_file_name(path: PathLike, digest: str) -> str:
    """``PATH.HASH.data``: the content-addressed name of the external data of ``path``."""
    return f"{os.fspath(path)}.{digest[:16]}.data"


def owned_data_files(path: PathLike) -> List[str]:
    """The external-data files beside ``path`` that belong to it (``PATH.data`` and
    ``PATH.HASH.data``, the names normgrad and onnx give them): what replacing ``path``
    makes obsolete."""
    folder, name = os.path.split(os.path.abspath(os.fspath(path)))
    pattern = re.compile(rf"{re.escape(name)}(\.[0-9a-f]{{16}})?\.data")
    try:
        entries = os.listdir(folder)
    except OSError:
        return []
    return sorted(os.path.join(folder, entry) for entry in entries if pattern.fullmatch(entry))


JOURNAL_SUFFIX = ".normgrad-commit"
"""Suffix of the journal of a set of files being committed (see :func:`commit_files`)."""


def _journal_path(target: str) -> str:
    folder, name = os.path.split(os.path.abspath(target))
    return os.path.join(folder, f".{name}{JOURNAL_SUFFIX}")


def refuse_irregular_file(path: PathLike, what: str = "file") -> None:
    """OSError (EISDIR/EINVAL) when ``path`` exists and is not a regular file (a folder, a
    FIFO, a device): normgrad neither replaces one nor blocks reading it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    import stat

    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, socket or device)"
        raise OSError(21 if stat.S_ISDIR(mode) else 22, f"the {what} is {kind}", os.fspath(path))


def commit_files(files: Sequence[StagedFile]) -> None:
    """Puts the staged ``files`` in place as one set, so that a failure or a kill at any
    instant leaves either the old set or the new one:

    1. every target is checked (a folder, FIFO or device in its place is refused: nothing
       is changed);
    2. the fresh files (external data under content-addressed names, which no live file
       references) are renamed into place;
    3. the commit point: for one other file, its rename; for several, the rename of a journal
       ``.FIRST.normgrad-commit`` beside the first, listing every (temporary, target) pair,
       after a copy of it in the folder of each other target (``--checkpoint`` elsewhere). The targets are then renamed
       in order and the journals removed. A kill before the commit point leaves the old
       set (the temporaries are removed by the next write there); after it, the new set is
       completed by :func:`complete_interrupted_commits`, which every normgrad reader and
       writer of that folder runs first (``checkpoint.load``, the Trainer, the next write);
    4. the data files the replaced targets owned (:func:`owned_data_files`) that the new set
       does not use are removed.

    On an error the temporaries of the files not in place are removed.

    Raises:
        OSError: a target cannot be replaced; with several targets, nothing was then changed
            unless the journal was in place (the set is then completed on the next read).
    """
    try:
        for file in files:
            refuse_irregular_file(file.path, "target")
        fresh = [f for f in files if f.fresh]
        rest = [f for f in files if not f.fresh]
        for file in fresh:
            file.commit()
        kept = {os.path.abspath(f.path) for f in fresh}
        obsolete = sorted({d for f in rest for d in owned_data_files(f.path)} - kept)
        if len(rest) == 1:
            rest[0].commit()
        elif rest:
            _commit_journaled([(f.temporary, f.path) for f in rest], obsolete)
            return
    finally:
        for file in files:
            file.discard()
    _remove_obsolete(obsolete)


def _remove_obsolete(paths: Iterable[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def _commit_journaled(renames: Sequence[tuple], obsolete: Sequence[str]) -> None:
    """Writes the journal beside the first target (the commit point) after a copy in the
    folder of each other target, then makes the renames."""
    by_folder = {}
    for _, target in renames:
        by_folder.setdefault(os.path.dirname(os.path.abspath(target)), _journal_path(target))
    primary = _journal_path(renames[0][1])
    others = [journal for journal in by_folder.values() if journal != primary]
    text = json.dumps({"primary": primary, "others": others, "pid": os.getpid(),
                       "renames": [[os.path.abspath(t), os.path.abspath(p)] for t, p in renames],
                       "remove": list(obsolete)}).encode()
    for journal in others + [primary]:
        StagedFile(journal, [text]).commit()
    _apply_journal(json.loads(text))


def _apply_journal(journal: dict) -> None:
    for temporary, target in journal["renames"]:
        if os.path.exists(temporary):
            if os.path.exists(target):
                os.chmod(temporary, os.stat(target).st_mode & 0o7777)
            os.replace(temporary, target)
    _remove_obsolete(journal["remove"])
    for path in journal["others"] + [journal["primary"]]:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def complete_interrupted_commits(folder: PathLike) -> None:
    """Finishes the commits of sets of files (:func:`commit_files`) that a killed writer left
    in ``folder``: a journal whose first (primary) copy exists was committed, so its
    remaining renames are made; a copy without its primary is of a set killed before its
    commit point, and is removed. Journals of writers still running are left to them."""
    try:
        entries = [e for e in os.listdir(folder) if e.startswith(".") and e.endswith(JOURNAL_SUFFIX)]
    except OSError:
        return
    for entry in entries:
        path = os.path.join(os.fspath(folder), entry)
        try:
            with open(path, "rb") as file:
                journal = json.loads(file.read())
            pid = int(journal["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid != os.getpid() and _process_alive(pid):
            continue
        try:
            if os.path.exists(journal["primary"]):
                _apply_journal(journal)
            else:
                _remove_obsolete([path])
        except (OSError, KeyError, TypeError, ValueError):
            continue  # left for the next reader; what it names stays as it is


def save_model_atomic(model: onnx.ModelProto, path: PathLike) -> None:
    """``onnx.save`` through :func:`write_bytes_atomic` (models under protobuf's 2 GiB limit)."""
    write_bytes_atomic(path, model.SerializeToString())


class PathAliasError(ValueError):
    """An output path that names an input, another output, or a file a loaded graph reads."""


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links
    except OSError:
        return False


def refuse_aliases(outputs: Mapping[str, PathLike],
                   inputs: Union[Mapping[str, PathLike], Iterable["tuple[str, PathLike]"]] = ()) -> None:
    """Raises :class:`PathAliasError` naming both when a write's output (``{what: path}``), or a
    data file it owns (:func:`owned_data_files`: replacing the output removes it), is one
    of ``inputs`` (``{what: path}`` or pairs: the operation's inputs, the files a loaded graph reads)
    or when two outputs are one file. Paths are compared resolved: symbolic links, hard
    links and ``..`` included. The one aliasing check of every writer."""
    named = [(what, os.fspath(path)) for what, path in outputs.items()]
    sources = list(inputs.items() if isinstance(inputs, Mapping) else inputs)
    for index, (what, path) in enumerate(named):
        for other_what, other in named[index + 1:]:
            if _same_file(path, other):
                raise PathAliasError(f"the {what} {path!r} and the {other_what} {other!r} are one file; "
                                     "give them different paths")
        for input_what, source in sources:
            for written in [path] + owned_data_files(path):
                if _same_file(written, os.fspath(source)):
                    via = "" if written == path else f" (whose data file {written!r} it replaces)"
                    raise PathAliasError(f"the {what} {path!r}{via} is {input_what} {os.fspath(source)!r}; "
                                         "write to another path")


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


def beside_step_graph(step_path: str, suffix: str) -> str:
    """Where ``normgrad export --optimizer`` writes a file of the step graph ``step_path``'s
    set: ``NAME`` + ``suffix`` beside ``NAME.onnx`` (``.ckpt``: its checkpoint)."""
    return (step_path[: -len(".onnx")] if step_path.endswith(".onnx") else step_path) + suffix


def eval_graph_path(step_path: str) -> str:
    """The evaluation graph written with the step graph ``step_path``: ``NAME.eval.onnx``."""
    return beside_step_graph(step_path, ".eval.onnx")


_RENAME_EXCHANGE = 2  # renameat2 flag (Linux 3.15+)
_AT_FDCWD = -100


def _exchange(first: str, second: str) -> bool:
    """Swaps two existing paths in one step (Linux's renameat2 with RENAME_EXCHANGE); False,
    with nothing changed, where the system or the file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), second)


def replace_folder_files(folder: PathLike, contents: Mapping[str, bytes]) -> bool:
    """Writes ``contents`` ({file name: bytes}) into ``folder`` (created if missing) as one set
    for any reader, peft's included, not only normgrad's: a copy of the folder (its other
    files hard-linked) gets the new files, then replaces the folder in one step (a rename, or
    renameat2's exchange); a kill at any instant leaves the old folder or the new one. A copy
    a killed writer left is removed by the next write. Returns False, with nothing changed,
    where that cannot be done (a folder that is a link or holds subfolders or links, no exchange on this
    system): the caller then commits the files with :func:`commit_files`."""
    folder = os.path.abspath(os.fspath(folder))
    parent, name = os.path.split(folder)
    os.makedirs(parent, exist_ok=True)
    prefix = f".{name}.normgrad-swap-"
    for entry in os.scandir(parent):
        pid = entry.name[len(prefix):].split("-")[0] if entry.name.startswith(prefix) else ""
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(entry.path, ignore_errors=True)
    if os.path.islink(folder):  # the exchange would replace the link, not the folder it names
        return False
    existing = list(os.scandir(folder)) if os.path.isdir(folder) else None
    if existing is not None and any(not e.is_file(follow_symlinks=False) for e in existing):
        return False
    staged = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)
    try:  # mkdtemp's 0700 -> the replaced folder's mode, or os.makedirs's for a new one
        os.chmod(staged, os.stat(folder).st_mode & 0o7777 if existing is not None else 0o777 & ~current_umask())
        for entry in existing or []:
            if entry.name not in contents:
                os.link(entry.path, os.path.join(staged, entry.name))
        for file_name, data in contents.items():
            with open(os.path.join(staged, file_name), "wb") as file:  # open(): the umask's mode
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
        if existing is None:
            os.rename(staged, folder)
        elif not _exchange(staged, folder):
            return False
        return True
    finally:
        shutil.rmtree(staged, ignore_errors=True)  # the old folder after an exchange; the new one where none was made
