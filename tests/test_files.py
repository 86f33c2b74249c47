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
