"""Every Python code block of README.md and docs/ runs, so an example cannot rot.

The Python blocks of one page run top to bottom as one script, in a fresh process whose
working directory is a temporary folder (pages build on their earlier blocks). An HTML
comment just above a block marks it (the comment line, then the fence):

* ``<!-- docs-test: requires torch mpi sklearn -->``: the page needs these (torch with
  onnxscript, mpi4py with mpirun, scikit-learn); the page is skipped where one is missing,
  as the tests skip.
* ``<!-- docs-test: ort-training -->``: code for onnxruntime-training, which needs its own
  Python (onnxruntime-training 1.19.2 wants onnx<=1.16): these blocks run, as one script in
  their own temporary folder, in the Python NORMGRAD_ORT_TRAINING_PYTHON names, and are
  skipped with that reason otherwise.

Blocks fenced as ``bash``, ``console`` or ``text`` are shell commands and output, not run
here (CI runs the Quickstart's two commands itself).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Tuple

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir))
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^\n`]*)\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
MARK = re.compile(r"<!--\s*docs-test:\s*(?P<mark>[^>]*?)\s*-->\s*$")
REQUIREMENTS = {
    "torch": lambda: _installed("torch") and _installed("onnxscript"),
    "mpi": lambda: _installed("mpi4py") and shutil.which("mpirun") is not None,
    "sklearn": lambda: _installed("sklearn"),
    "transformers": lambda: _installed("transformers"),
}
TIMEOUT = 600


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def pages() -> List[str]:
    found = [os.path.join(ROOT, "README.md")]
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        found += [os.path.join(folder, name) for name in files if name.endswith(".md")]
    return sorted(found)


def blocks(path: str) -> List[Tuple[str, str, List[str]]]:
    """(language, code, marks) of each fenced block of the page, in order."""
    with open(path, encoding="utf-8") as file:
        text = file.read()
    found = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        language = (match.group("info").strip().split() or [""])[0]
        indent = len(match.group("indent"))
        code = "\n".join(line[indent:] for line in match.group("code").split("\n"))
        found.append((language, code, mark.group("mark").split() if mark else []))
    return found


def scripts(path: str) -> Dict[str, Tuple[str, List[str]]]:
    """The page's scripts: "page" (its plain Python blocks) and "ort-training" (blocks for
    onnxruntime-training's own Python), each (code, requirements)."""
    result: Dict[str, Tuple[List[str], List[str]]] = {}
    for language, code, marks in blocks(path):
        if language not in ("python", "py"):
            continue
        kind = "ort-training" if "ort-training" in marks else "page"
        codes, requirements = result.setdefault(kind, ([], []))
        codes.append(code)
        if marks[:1] == ["requires"]:
            requirements += [name for name in marks[1:] if name not in requirements]
    return {kind: ("\n".join(codes), requirements) for kind, (codes, requirements) in result.items()}


CASES = [(os.path.relpath(path, ROOT), kind) for path in pages() for kind in scripts(path)]


def _run(python: str, code: str, tmp_path, name: str) -> None:
    script = tmp_path / "docs_page.py"
    script.write_text(code, encoding="utf-8")
    environment = dict(os.environ, PYTHONWARNINGS="default", NORMGRAD_REPO=ROOT)
    done = subprocess.run([python, str(script)], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"


@pytest.mark.parametrize("page,kind", CASES, ids=[f"{page}:{kind}" for page, kind in CASES])
def test_code_blocks_run(page, kind, tmp_path):
    code, requirements = scripts(os.path.join(ROOT, page))[kind]
    for name in requirements:
        if name not in REQUIREMENTS:
            pytest.fail(f"{page}: unknown docs-test requirement {name!r} (known: {sorted(REQUIREMENTS)})")
        if not REQUIREMENTS[name]():
            pytest.skip(f"{page} needs {name}, which is not installed")
    if kind == "ort-training":
        python = os.environ.get("NORMGRAD_ORT_TRAINING_PYTHON")
        if not python:
            pytest.skip("onnxruntime-training code: set NORMGRAD_ORT_TRAINING_PYTHON to a Python with "
                        "onnxruntime-training 1.19.2 (and onnx<=1.16) to run it")
        _run(python, code, tmp_path, f"{page} (onnxruntime-training blocks)")
    else:
        _run(sys.executable, code, tmp_path, page)


def test_the_pages_are_found_and_have_examples():
    """The collection above cannot silently be empty: README's example is among the cases."""
    assert ("README.md", "page") in CASES
    assert len(pages()) > 10


def test_marks_are_read(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- docs-test: requires torch -->\n```python\nimport torch\n```\n\n"
                    "```bash\nls\n```\n<!-- docs-test: ort-training -->\n```python\nimport onnxruntime\n```\n"
                    "- item\n\n  ```python\n  x = 1\n  ```\n")
    assert [(language, marks) for language, _, marks in blocks(str(page))] == [
        ("python", ["requires", "torch"]), ("bash", []), ("python", ["ort-training"]), ("python", [])]
    assert scripts(str(page)) == {"page": ("import torch\n\nx = 1\n", ["torch"]),
                                  "ort-training": ("import onnxruntime\n", [])}


CLI_PAGE = os.path.join(ROOT, "docs", "reference", "cli.md")
CLI_SECTION = re.compile(r"(<!-- cli-reference -->\n).*?(<!-- /cli-reference -->)", re.S)


def render_cli_reference() -> str:
    """`normgrad --help` and every command's `--help`, as Markdown (argparse at 100 columns)."""
    import contextlib
    import io

    from normgrad.tools import cli

    parts = []
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        for command in [None, *cli.COMMANDS]:
            output = io.StringIO()
            with contextlib.redirect_stdout(output):
                status = cli.main(["--help"] if command is None else [command, "--help"])
            assert status == 0, command
            title = "normgrad" if command is None else f"normgrad {command}"
            parts.append(f"## `{title}`\n\n```text\n{output.getvalue().rstrip()}\n```\n")
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    return "\n".join(parts)


def test_cli_reference_is_current():
    """docs/reference/cli.md shows what the commands print for --help today;
    NORMGRAD_WRITE_CLI_REFERENCE=1 rewrites it."""
    with open(CLI_PAGE, encoding="utf-8") as file:
        text = file.read()
    assert CLI_SECTION.search(text), "docs/reference/cli.md lost its cli-reference markers"
    updated = CLI_SECTION.sub(lambda match: match.group(1) + render_cli_reference() + match.group(2), text)
    if os.environ.get("NORMGRAD_WRITE_CLI_REFERENCE") == "1" and updated != text:
        from normgrad._files import write_bytes_atomic

        write_bytes_atomic(CLI_PAGE, updated.encode("utf-8"))
        text = updated
    assert updated == text, "stale: NORMGRAD_WRITE_CLI_REFERENCE=1 python -m pytest tests/test_docs.py -k cli_reference"
