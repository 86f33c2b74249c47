"""The ``normgrad`` command: ``normgrad {demo,bench,export,check,corpus} ...``."""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

__all__ = ["main", "CommandError", "load_model"]

COMMANDS = {
    "demo": ("normgrad.tools.demo", "run both operators on every backend and check them against the reference"),
    "bench": ("normgrad.tools.bench", "time the kernels against each other and a memory-streaming floor"),
    "export": ("normgrad.tools.export", "turn a forward ONNX model into a training graph"),
    "check": ("normgrad.tools.check", "compare a training graph's gradients with finite differences"),
    "corpus": ("normgrad.tools.corpus", "write the interoperability corpus (graphs/corpus) or --check it"),
}


class CommandError(Exception):
    """A user error (unreadable file, wrong kind of model) that a command reports in one
    line, without a traceback, and exits 1."""


def load_model(path: str):
    """``onnx.load(path)``.

    Raises:
        CommandError: the file cannot be read or is not an ONNX model.
    """
    import onnx
    from google.protobuf.message import DecodeError

    try:
        return onnx.load(path)
    except OSError as error:
        raise CommandError(f"cannot read {path}: {error.strerror or error}") from error
    except DecodeError as error:
        raise CommandError(f"{path} is not an ONNX model: {error}") from error


def _usage() -> str:
    lines = ["usage: normgrad COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "`normgrad COMMAND --help` describes a command's arguments."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatches to the command's module; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"normgrad: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
