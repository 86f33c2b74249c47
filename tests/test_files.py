"""Atomic writes: a failed write leaves the old file; in-place export is refused."""

import os

import pytest

from normgrad.util.files import PathAliasError, refuse_aliases, write_bytes_atomic


def test_write_replaces_whole_file(tmp_path):
    target = tmp_path / "a.bin"
    write_bytes_atomic(target, b"first")
    write_bytes_atomic(target, b"second")
    assert target.read_bytes() == b"second"
    assert os.listdir(tmp_path) == ["a.bin"]


def test_failed_write_keeps_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "a.bin"
    target.write_bytes(b"good")

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError):
        write_bytes_atomic(target, b"x" * 1000)
    assert target.read_bytes() == b"good"
    assert os.listdir(tmp_path) == ["a.bin"]


def test_same_file_refused(tmp_path):
    source = tmp_path / "net.onnx"
    source.write_bytes(b"model")
    with pytest.raises(PathAliasError, match="is the input"):
        refuse_aliases({"output": tmp_path / "." / "net.onnx"}, {"the input": source})
    refuse_aliases({"output": tmp_path / "other.onnx"}, {"the input": source})


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _mode(path) -> int:
    return os.stat(path).st_mode & 0o7777


def test_written_files_honour_the_umask_as_open_does(tmp_path, umask):
    """One file, a set of files (the journaled commit) and a folder replaced as one: each new
    file gets the mode open() gives a new file under the same umask (not mkstemp's 0600),
    each new folder os.mkdir's; a replaced file keeps its own mode."""
    from normgrad.util.files import StagedFile, commit_files, replace_folder_files

    with open(tmp_path / "by_open", "wb"):
        pass
    os.mkdir(tmp_path / "by_mkdir")
    expected, expected_folder = _mode(tmp_path / "by_open"), _mode(tmp_path / "by_mkdir")
    assert expected == 0o666 & ~umask

    write_bytes_atomic(tmp_path / "one.bin", b"1")
    commit_files([StagedFile(tmp_path / "a.onnx", [b"a"]), StagedFile(tmp_path / "a.ckpt", [b"b"])])
    assert replace_folder_files(tmp_path / "adapter", {"weights.bin": b"w", "config.json": b"{}"})
    for path in ("one.bin", "a.onnx", "a.ckpt", "adapter/weights.bin", "adapter/config.json"):
        assert _mode(tmp_path / path) == expected, path
    assert _mode(tmp_path / "adapter") == expected_folder

    os.chmod(tmp_path / "a.onnx", 0o640)
    commit_files([StagedFile(tmp_path / "a.onnx", [b"c"]), StagedFile(tmp_path / "a.ckpt", [b"d"])])
    assert _mode(tmp_path / "a.onnx") == 0o640 and _mode(tmp_path / "a.ckpt") == expected
