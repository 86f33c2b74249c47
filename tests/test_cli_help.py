"""What `normgrad --help` and `normgrad train --help` tell a user, and how a command ends
when its reader has gone."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest

from normgrad.tools import cli, demo

NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7}


def test_demo_summary_counts_the_operators_the_demo_runs(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(demo.harness, "run", lambda backend, op_type, inputs: ran.append(op_type) or {})
    monkeypatch.setattr(demo, "_relative_error", lambda actual, expected: 0.0)
    demo.accuracy_rows(["reference"])
    assert cli.main(["--help"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("demo "))
    count = re.search(r"\brun (?:the )?(\w+)\b", line)
    assert count and NUMBERS.get(count.group(1)) == len(set(ran)), line


def test_train_help_shows_every_default(capsys):
    assert cli.main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for option, default in (("--epochs", "12"), ("--batch-size", "32"), ("--seed", "0"), ("--out", "normgrad-train"),
                            # a STEP graph trains at its own lr (the digits demo's 0.003 would not be true for it)
                            ("--lr", "the step graph's; for the digits demo 0.003, the peak of its cosine schedule")):
        assert re.search(rf"{option} \S+ [^-]*\(default: {re.escape(default)}\)", text), (option, text)



class ClosedPipe(io.StringIO):
    """A stdout whose reader has gone: every write raises BrokenPipeError, as to a pipe
    after ``head -1`` exited."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")


def test_output_into_a_closed_pipe_ends_quietly():
    """`normgrad --help | head -1` in a process: exit 141 (a shell's status for SIGPIPE),
    nothing on stderr (it was a BrokenPipeError traceback, or "Exception ignored ...
    BrokenPipeError" when Python flushed stdout at exit)."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        process = subprocess.run([sys.executable, "-m", "normgrad.tools.cli", "--help"], stdout=writer,
                                 stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(writer)
    assert (process.returncode, process.stderr) == (cli.SIGPIPE_EXIT, "")


def test_commands_output_into_a_closed_pipe_end_quietly(tmp_path, monkeypatch, capsys):
    """export and check print their results into a closed pipe: exit 141, nothing on stderr
    (the train command's case: tests/test_cli_train.py)."""
    import onnx

    from _graph_models import mlp

    onnx.save(mlp(), tmp_path / "mlp.onnx")
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert cli.main(["export", str(tmp_path / "mlp.onnx"), "-o", str(tmp_path / "train.onnx")]) == cli.SIGPIPE_EXIT
    assert cli.main(["check", str(tmp_path / "train.onnx"), "--directions", "1"]) == cli.SIGPIPE_EXIT
    assert capsys.readouterr().err == ""
