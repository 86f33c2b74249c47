"""The ``normgrad`` command: ``normgrad {demo,bench,export,check,corpus,train,support-table} ...``."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from typing import Optional, Sequence

from normgrad.errors import one_line

__all__ = ["main", "CommandError", "load_model", "ArgumentParser", "positive_int", "non_negative_int", "positive_float",
           "one_line",
           "update_page_command", "apply_config", "read_config"]

COMMANDS = {
    "demo": ("normgrad.tools.demo", "run the five normalization-gradient operators on every backend against the float64 reference"),
    "bench": ("normgrad.tools.bench", "time the kernels against each other and a memory-streaming floor"),
    "export": ("normgrad.tools.export", "turn a forward ONNX model into a training graph"),
    "check": ("normgrad.tools.check", "compare a training graph's gradients with finite differences"),
    "corpus": ("normgrad.tools.corpus", "write the interoperability corpus (graphs/corpus) or --check it"),
    "train": ("normgrad.tools.train", "train a step graph on .npz/.npy arrays (fit: evaluation, checkpoints, logs); "
                                      "no arguments: a small CNN on scikit-learn's digits (the train extra)"),
    "support-table": ("normgrad.tools.support_table", "render the model-family and operator tables of docs/reference/support.md from the tests' results"),
}


class CommandError(Exception):
    """A user error (unreadable file, wrong kind of model) that a command reports in one
    line, without a traceback, and exits 1."""


def _tensors(graph):
    """Every TensorProto of ``graph``: initializers and attribute tensors, in subgraphs too."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from _tensors(sub)


def load_model(path: str, keep_external=None):
    """``onnx.load(path)``, with its external data (``keep_external(model)``: the names of
    the initializers whose data stay in their files instead, checked present; their
    locations stay relative to the model's folder).

    Raises:
        CommandError: the file cannot be read, is empty or not an ONNX model, or its
            external data is missing, unreadable or outside the model's folder.
    """
    import onnx
    import onnx.external_data_helper
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(path, load_external_data=False)
    except OSError as error:
        raise CommandError(f"cannot read {path}: {error.strerror or error}") from error
    except DecodeError as error:
        raise CommandError(f"{path} is not an ONNX model: {one_line(error)}") from error
    if not model.HasField("graph"):
        what = "is empty" if os.path.getsize(path) == 0 else "holds no graph"
        raise CommandError(f"{path} {what}: not an ONNX model")
    folder = os.path.dirname(os.path.abspath(path))
    for tensor in _tensors(model.graph):
        if not onnx.external_data_helper.uses_external_data(tensor):
            continue
        location = {entry.key: entry.value for entry in tensor.external_data}.get("location", "")
        target = os.path.realpath(os.path.join(folder, location))
        inside = os.path.commonpath([target, os.path.realpath(folder)]) == os.path.realpath(folder)
        if not location or os.path.isabs(location) or not inside:
            raise CommandError(f"{path}: external data of tensor '{tensor.name}' at {location!r} is outside the model's folder")
        if not os.path.isfile(target):
            raise CommandError(f"{path}: external data of tensor '{tensor.name}' is missing: no file {target}")
    kept = keep_external(model) if keep_external is not None else set()
    try:
        for tensor in _tensors(model.graph):
            if onnx.external_data_helper.uses_external_data(tensor) and tensor.name not in kept:
                onnx.external_data_helper.load_external_data_for_tensor(tensor, folder)
                tensor.data_location = onnx.TensorProto.DEFAULT
                del tensor.external_data[:]
    except (OSError, ValueError, onnx.checker.ValidationError) as error:
        raise CommandError(f"{path}: cannot read its external data: {one_line(error)}") from error
    return model


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line (and exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0 (a seed)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0; got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number; got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0; got {text!r}")
    return value


def read_config(path: str) -> dict:
    """The mapping a ``--config`` file holds: ``.toml`` (tomllib, Python 3.11+, else the
    tomli package), ``.yaml`` / ``.yml`` (PyYAML) or ``.json``.

    Raises:
        CommandError: the file cannot be read or parsed, its reader is not installed, or it
            holds something other than a mapping.
    """
    suffix = os.path.splitext(path)[1].lower()
    loaders = {".toml": _toml_loads, ".yaml": _yaml_loads, ".yml": _yaml_loads, ".json": _json_loads}
    if suffix not in loaders:
        raise CommandError(f"--config {path}: not a .toml, .yaml, .yml or .json file")
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as error:
        raise CommandError(f"--config: cannot read {path}: {error.strerror or error}") from None
    loads, errors = loaders[suffix](path)
    try:
        values = loads(data.decode("utf-8"))
    except (UnicodeDecodeError, *errors) as error:
        raise CommandError(f"--config {path}: {one_line(error)}") from None
    if not isinstance(values, dict):
        raise CommandError(f"--config {path}: holds {type(values).__name__}, not a mapping of flag names to values")
    return values


def _toml_loads(path: str):
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ImportError:
            raise CommandError(f"--config {path}: reading TOML needs Python 3.11+ or the tomli package "
                               "(pip install tomli)") from None
    return tomllib.loads, (tomllib.TOMLDecodeError,)


def _yaml_loads(path: str):
    try:
        import yaml
    except ImportError:
        raise CommandError(f"--config {path}: reading YAML needs PyYAML (pip install pyyaml)") from None
    return yaml.safe_load, (yaml.YAMLError,)


def _json_loads(path: str):
    import json

    return json.loads, (ValueError,)


def apply_config(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> None:
    """``--config FILE`` in ``argv``: the file's values (:func:`read_config`) become the
    parser's defaults, so that flags on the command line override them. A key is a flag's
    name (``batch-size`` or ``batch_size``) or a positional argument's; each value is
    checked as the flag's own (its type, choices, number of values; a bool for a switch).

    Raises:
        CommandError: an unreadable file, an unknown key (named), a bad value.
    """
    finder = argparse.ArgumentParser(add_help=False)
    finder.add_argument("--config")
    path = finder.parse_known_args(list(sys.argv[1:] if argv is None else argv))[0].config
    if path is None:
        return
    by_name = {}
    for action in parser._actions:
        if action.dest in ("help", "config"):
            continue
        for name in [option.lstrip("-") for option in action.option_strings] or [action.dest]:
            by_name[name.replace("_", "-")] = action
    defaults = {}
    for key, value in read_config(path).items():
        action = by_name.get(str(key).replace("_", "-"))
        if action is None:
            raise CommandError(f"--config {path}: unknown key {key!r}; the keys are the flags' names: "
                               f"{', '.join(by_name)}")
        defaults[action.dest] = _config_value(action, value, f"--config {path}: {key}")
    parser.set_defaults(**defaults)


def _config_value(action: argparse.Action, value, where: str):
    """A config file's ``value`` for ``action``, checked and converted as argparse would the flag's."""
    if action.nargs == 0:  # a switch (store_true)
        if not isinstance(value, bool):
            raise CommandError(f"{where}: must be true or false; got {value!r}")
        return value
    many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
    values = value if many and isinstance(value, list) else [value]
    if not many and isinstance(value, list) or isinstance(action.nargs, int) and len(values) != action.nargs:
        count = "one value" if not many else f"{action.nargs} values"
        raise CommandError(f"{where}: takes {count}; got {value!r}")
    converted = []
    for item in values:
        if isinstance(item, (bool, dict, list)) or item is None:
            raise CommandError(f"{where}: takes {'numbers or strings' if many else 'a number or a string'}; got {item!r}")
        try:
            item = action.type(str(item)) if action.type is not None else str(item)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as error:
            raise CommandError(f"{where}: {one_line(error)}") from None
        if action.choices is not None and item not in action.choices:
            raise CommandError(f"{where}: {item!r} is not one of {', '.join(map(str, action.choices))}")
        converted.append(item)
    return converted if many else converted[0]


def update_page_command(argv: Optional[Sequence[str]], prog: str, description: str, page_help: str, what: str,
                        update) -> int:
    """The command behind the generated tables (``normgrad support-table``, the runtime
    table): ``PAGE [--check]``; ``update(text) -> text`` renders ``what`` into the page's text
    (ValueError when it cannot). Writes atomically, only a changed page. 0 written or current,
    1 stale (``--check``) or unreadable, 2 usage."""
    from normgrad.util.files import write_bytes_atomic

    parser = ArgumentParser(prog=prog, description=description)
    parser.add_argument("page", help=page_help)
    parser.add_argument("--check", action="store_true", help=f"write nothing; exit 1 if the {what} are stale")
    args = parser.parse_args(argv)
    try:
        with open(args.page, encoding="utf-8") as file:
            text = file.read()
        updated = update(text)
    except OSError as error:
        print(f"{prog}: {args.page}: {error.strerror or error}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"{prog}: {args.page}: {one_line(error)}", file=sys.stderr)
        return 1
    if args.check:
        print(f"{args.page}: {what} {'current' if updated == text else 'stale'}")
        return 0 if updated == text else 1
    if updated != text:
        write_bytes_atomic(args.page, updated.encode("utf-8"))
    print(f"{args.page}: {what} {'written' if updated != text else 'already current'}")
    return 0


def _usage() -> str:
    lines = ["usage: normgrad COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "`normgrad COMMAND --help` describes a command's arguments; `normgrad --version` the version."]
    return "\n".join(lines)


def _version() -> str:
    """The installed distribution's version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("normgrad")
    except PackageNotFoundError:
        return "unknown (not installed)"


SIGPIPE_EXIT = 128 + 13
"""The exit status of a command whose reader went away (``normgrad train | head -1``): a
shell's for a process SIGPIPE ended, as other command-line tools end."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatches to the command's module; returns the process exit code. Output to a pipe
    whose reader has gone ends the command quietly (Python's SIGPIPE note): stdout is pointed
    at os.devnull, so that nothing more is written to it, not even at exit."""
    try:
        code = _dispatch(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout without a descriptor (a test's)
            pass
        os.close(devnull)
        return SIGPIPE_EXIT


def _dispatch(args: list) -> int:
    """Runs ``normgrad ARGS...``: the usage, the version, or the command's module."""
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        print(f"normgrad {_version()}")
        return 0
    command, rest = args[0], args[1:]
    if command == "demo" and rest[:1] == ["train"]:  # `normgrad demo train`: the digits demo of `normgrad train`
        command, rest = "train", rest[1:]
    if command not in COMMANDS:
        print(f"normgrad: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    try:
        return int(module.main(rest) or 0)
    except SystemExit as exit:  # argparse: --help (0) or a usage error (2)
        return exit.code if isinstance(exit.code, int) else 2


if __name__ == "__main__":
    sys.exit(main())
