"""What `normgrad --help` and `normgrad train --help` tell a user."""

from __future__ import annotations

import re

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
    for option, default in (("--epochs", 12), ("--batch-size", 32), ("--lr", 0.003), ("--seed", 0),
                            ("--out", "normgrad-train")):
        assert re.search(rf"{option} \S+ [^-]*\(default: {re.escape(str(default))}\)", text), (option, text)
