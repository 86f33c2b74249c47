"""Every code block of README.md and docs/ runs, so an example cannot rot.

The Python and shell blocks of one page run top to bottom, in order, in a fresh process
whose working directory is a temporary folder (pages build on their earlier blocks: a page
can export with the CLI, then train in Python). Shell blocks (``bash``, ``sh``, ``shell``;
of a ``console`` block, the ``$ `` lines and their ``\\`` continuations, the rest being
output) run with ``bash -euo pipefail`` in that folder, with ``normgrad`` and ``python``
meaning the Python that runs the tests. ``text`` blocks are output and not run.

An HTML comment just above a block marks it (the comment line, then the fence):

* ``<!-- docs-test: requires torch mpi sklearn -->``: the page needs these (torch with
  onnxscript, mpi4py with mpirun, scikit-learn, transformers, peft with safetensors,
  tensorboard, onnxruntime-genai); the
  page is skipped where one is missing,
  as the tests skip.
* ``<!-- docs-test: skip "reason" -->``: this block cannot run here (a pip install, a server,
  a benchmark of minutes, another venv); it is left out of the page's script and reported as
  a skipped test ``PAGE:skip@LINE`` with the reason. A skip without a reason fails.
* ``<!-- docs-test: ort-training -->``: code for onnxruntime-training, which needs its own
  Python (onnxruntime-training 1.19.2 wants onnx<=1.16): these blocks run, as one script,
  in the page's temporary folder after the page's own blocks, in the Python
  NORMGRAD_ORT_TRAINING_PYTHON names, and are skipped with that reason otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
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
    "peft": lambda: _installed("peft") and _installed("safetensors"),
    "tensorboard": lambda: _installed("tensorboard"),
    "genai": lambda: _installed("onnxruntime_genai"),
}
TIMEOUT = 3600  # a hang guard only: a page takes seconds to minutes, several on a loaded machine


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def pages() -> List[str]:
    found = [os.path.join(ROOT, "README.md")]
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        found += [os.path.join(folder, name) for name in files if name.endswith(".md")]
    return sorted(found)


def blocks(path: str) -> List[Tuple[str, str, List[str], int]]:
    """(language, code, marks, line of the fence) of each fenced block of the page, in order."""
    with open(path, encoding="utf-8") as file:
        text = file.read()
    found = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        language = (match.group("info").strip().split() or [""])[0]
        indent = len(match.group("indent"))
        code = "\n".join(line[indent:] for line in match.group("code").split("\n"))
        found.append((language, code, shlex.split(mark.group("mark")) if mark else [],
                      text.count("\n", 0, match.start()) + 1))
    return found


PYTHON = ("python", "py")
SHELL = ("bash", "sh", "shell", "console")
NOT_RUN = ("text",)   # output


def console_commands(code: str) -> str:
    """The commands of a ``console`` block: ``$ `` lines and the lines continuing them."""
    commands, continuing = [], False
    for line in code.split("\n"):
        if line.startswith("$ ") or continuing:
            commands.append(line[2:] if line.startswith("$ ") and not continuing else line)
            continuing = line.rstrip().endswith("\\")
    return "\n".join(commands) + "\n"


SHELL_RUNNER = '''
def _docs_shell(code, line):
    """A shell block of the page (docs-test): bash in this folder, `normgrad` and `python`
    being the Python that runs this script."""
    import os, subprocess, sys, tempfile
    global _docs_bin
    if "_docs_bin" not in globals():
        _docs_bin = tempfile.mkdtemp(prefix="docs-bin-")
        for name, command in [("python", ""), ("python3", ""),
                              ("normgrad", " -c 'import sys; from normgrad.tools.cli import main; sys.exit(main())'")]:
            with open(os.path.join(_docs_bin, name), "w") as file:
                file.write(f'#!/bin/sh\\nexec "{sys.executable}"{command} "$@"\\n')
            os.chmod(os.path.join(_docs_bin, name), 0o755)
    env = dict(os.environ, PATH=_docs_bin + os.pathsep + os.environ.get("PATH", ""))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], env=env, capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        sys.exit(f"shell block at line {line} exited with {done.returncode}:\\n{code}")
'''


def scripts(path: str) -> Dict[str, Tuple[str, List[str]]]:
    """The page's scripts: "page" (its Python and shell blocks, one Python script),
    "ort-training" (blocks for onnxruntime-training's own Python) and "skip@LINE" (a block
    marked skip: the reason, no code), each (code, requirements)."""
    result: Dict[str, Tuple[List[str], List[str]]] = {}
    skipped: Dict[str, Tuple[str, List[str]]] = {}
    for language, code, marks, line in blocks(path):
        if marks[:1] == ["skip"]:
            skipped[f"skip@{line}"] = (" ".join(marks[1:]), [])
            continue
        if language in PYTHON:
            kind = "ort-training" if "ort-training" in marks else "page"
        elif language in SHELL:
            kind = "page"
            command = console_commands(code) if language == "console" else code
            code = f"_docs_shell({command!r}, {line})\n"
        else:
            continue
        codes, requirements = result.setdefault(kind, ([], []))
        codes.append(code)
        if marks[:1] == ["requires"]:
            requirements += [name for name in marks[1:] if name not in requirements]
    found = {kind: ("\n".join(codes), requirements) for kind, (codes, requirements) in result.items()}
    if "_docs_shell(" in found.get("page", ("", []))[0]:
        found["page"] = (SHELL_RUNNER + "\n" + found["page"][0], found["page"][1])
    return {**found, **skipped}


CASES = [(os.path.relpath(path, ROOT), kind) for path in pages() for kind in scripts(path)]


def _run(python: str, code: str, tmp_path, name: str, quiet: bool = True) -> None:
    """Runs ``code``; ``quiet``: onnxruntime must log no warning or error at its default level
    (the sessions a page creates on normgrad's graphs, tests/test_quiet.py)."""
    script = tmp_path / "docs_page.py"
    script.write_text(code, encoding="utf-8")
    environment = dict(os.environ, PYTHONWARNINGS="default", NORMGRAD_REPO=ROOT)
    done = subprocess.run([python, str(script)], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    logged = [line for line in (done.stdout + done.stderr).splitlines()
              if "[W:onnxruntime" in line or "[E:onnxruntime" in line]
    assert not (quiet and logged), f"{name}: onnxruntime warned:\n" + "\n".join(logged[:10])


# Docs pages that train or run whole models, or MPI (each a fresh process; 10-25 CPU-s, errors.md more).
SLOW_PAGES = ("docs/reference/errors.md", "docs/how-to/fine-tuning.md", "docs/how-to/build-training-graph.md",
              "docs/tutorials/train-a-cnn.md", "docs/tutorials/fine-tune-a-transformer.md",
              "docs/tutorials/data-parallel-mpi.md", "docs/tutorials/fine-tune-genai.md",
              "docs/how-to/train-optimizer-fused.md")


@pytest.mark.parametrize("page,kind", [
    pytest.param(page, kind, id=f"{page}:{kind}",
                 marks=[pytest.mark.slow] if kind == "page" and page in SLOW_PAGES else [])
    for page, kind in CASES])
def test_code_blocks_run(page, kind, tmp_path):
    code, requirements = scripts(os.path.join(ROOT, page))[kind]
    if kind.startswith("skip@"):
        assert code, f"{page}: the block at line {kind[5:]} is skipped without a reason (skip \"reason\")"
        pytest.skip(f"{page}, block at line {kind[5:]}: {code}")
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
        if "page" in scripts(os.path.join(ROOT, page)):
            page_code, page_requirements = scripts(os.path.join(ROOT, page))["page"]
            missing = [name for name in page_requirements if not REQUIREMENTS[name]()]
            if missing:  # its blocks read what the page's own blocks write
                pytest.skip(f"{page}: the onnxruntime-training blocks need the page's own, which need "
                            f"{', '.join(missing)}")
            _run(sys.executable, page_code, tmp_path, page)
        _run(python, code, tmp_path, f"{page} (onnxruntime-training blocks)", quiet=False)
    else:
        _run(sys.executable, code, tmp_path, page)


def test_the_pages_are_found_and_have_examples():
    """The collection above cannot silently be empty: README's example is among the cases."""
    assert ("README.md", "page") in CASES
    assert len(pages()) > 10


def test_readme_stays_one_screen():
    """The README shows the path (what it is, Quickstart, one example, what was measured, links);
    the rest is in docs/."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as file:
        lines = file.read().splitlines()
    assert len(lines) <= 80, f"README.md has {len(lines)} lines; move detail to docs/ (at most 80)"


def test_every_block_runs_or_is_output():
    """A block in another language (or none) would be neither run nor skipped by name."""
    unknown = [(os.path.relpath(path, ROOT), line, language) for path in pages()
               for language, _, marks, line in blocks(path)
               if language not in PYTHON + SHELL + NOT_RUN and marks[:1] != ["skip"]]
    assert unknown == [], f"fence these as python, bash, console or text, or mark them skip \"reason\": {unknown}"


def test_marks_are_read(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- docs-test: requires torch -->\n```python\nimport torch\n```\n\n"
                    "```bash\nls\n```\n<!-- docs-test: ort-training -->\n```python\nimport onnxruntime\n```\n"
                    "- item\n\n  ```python\n  x = 1\n  ```\n"
                    "<!-- docs-test: skip \"a pip install\" -->\n```bash\npip install x\n```\n"
                    "```console\n$ normgrad a \\\n    --b\noutput line\n$ ls\n```\n```text\nnot run\n```\n")
    assert [(language, marks, line) for language, _, marks, line in blocks(str(page))] == [
        ("python", ["requires", "torch"], 4), ("bash", [], 8), ("python", ["ort-training"], 12), ("python", [], 17),
        ("bash", ["skip", "a pip install"], 21), ("console", [], 24), ("text", [], 30)]
    found = scripts(str(page))
    assert sorted(found) == ["ort-training", "page", "skip@21"]
    assert found["ort-training"] == ("import onnxruntime\n", [])
    assert found["skip@21"] == ("a pip install", [])
    code, requirements = found["page"]
    assert requirements == ["torch"]
    assert code.endswith("import torch\n\n_docs_shell('ls\\n', 8)\n\nx = 1\n\n"
                         "_docs_shell('normgrad a \\\\\\n    --b\\nls\\n', 24)\n")


def test_shell_blocks_run_in_the_page_folder_in_order(tmp_path):
    """A shell block sees the files of the Python blocks before it and the CLI; a failing
    command fails the page."""
    page = tmp_path / "page.md"
    page.write_text("```python\nopen('a.txt', 'w').write('1')\n```\n"
                    "```bash\ntest -f a.txt && normgrad --help > help.txt && python -c 'print(2)' > b.txt\n```\n"
                    "```python\nassert 'export' in open('help.txt').read() and open('b.txt').read() == '2\\n'\n```\n")
    folder = tmp_path / "run"
    folder.mkdir()
    _run(sys.executable, scripts(str(page))["page"][0], folder, "page")
    page.write_text("```python\nx = 1\n```\n```bash\nfalse\necho not reached\n```\n")
    with pytest.raises(AssertionError, match="shell block at line 4 exited with 1"):
        _run(sys.executable, scripts(str(page))["page"][0], folder, "page")


def test_a_page_whose_sessions_warn_fails(tmp_path):
    page = tmp_path / "page.md"
    # weights both inputs and initializers: onnxruntime warns at session creation
    page.write_text("```python\nimport onnxruntime\nfrom normgrad.graphs import examples\n"
                    "from normgrad.graphs.builder import training_graph_with_stored_weights\n"
                    "onnxruntime.InferenceSession(training_graph_with_stored_weights(examples.mlp(), loss='cross_entropy')"
                    ".SerializeToString())\n```\n")
    folder = tmp_path / "run"
    folder.mkdir()
    with pytest.raises(AssertionError, match="onnxruntime warned"):
        _run(sys.executable, scripts(str(page))["page"][0], folder, "page")


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
        from normgrad.util.files import write_bytes_atomic

        write_bytes_atomic(CLI_PAGE, updated.encode("utf-8"))
        text = updated
    assert updated == text, "stale: NORMGRAD_WRITE_CLI_REFERENCE=1 python -m pytest tests/test_docs.py -k cli_reference"
