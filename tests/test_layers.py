"""The package's layers point down and its modules import no cycle.

Layers, lowest first: helpers (``normgrad.errors``, ``normgrad.util``) <- ``normgrad.ops`` <-
``normgrad.graphs`` <- training (every other ``normgrad.*`` module) <- ``normgrad.tools``.
Every import statement of every module counts, at module level or inside a function;
``from P import x`` reads package ``P`` (its ``__init__`` runs) and module ``P.x`` when there
is one. No module imports the package root ``normgrad`` (a façade over the layers); they
import the defining module instead.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from typing import Dict, List, Mapping, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"normgrad": "src/normgrad", "normgrad.ops": "ops", "normgrad.graphs": "graphs", "normgrad.tools": "tools"}
"""The installed namespace (pyproject.toml): package -> its folder in the repository."""

HELPERS = ("normgrad.errors", "normgrad.util")
LAYER_NAMES = ("helpers", "ops", "graphs", "training", "tools")


def find_modules(root: pathlib.Path, packages: Mapping[str, str] = PACKAGES) -> Dict[str, pathlib.Path]:
    """{module name: its file} of every Python module of ``packages`` under ``root`` (the C++
    sources' folders and the corpus left out)."""
    modules = {}
    for package, folder in packages.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if "cpp" in parts or "corpus" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package,) + parts)
            if package == "normgrad" and parts and f"normgrad.{parts[0]}" in packages:
                continue  # another folder holds that package
            modules[name] = path
    return modules


def imported_modules(name: str, path: pathlib.Path, modules: Mapping[str, pathlib.Path]) -> Set[str]:
    """The modules among ``modules`` that module ``name`` (file ``path``) imports, in any
    import statement."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def layer(name: str) -> int:
    """The layer of module ``name``: 0 helpers, 1 ops, 2 graphs, 3 training, 4 tools."""
    if any(name == helper or name.startswith(helper + ".") for helper in HELPERS):
        return 0
    for index, package in ((1, "normgrad.ops"), (2, "normgrad.graphs"), (4, "normgrad.tools")):
        if name == package or name.startswith(package + "."):
            return index
    return 3


def import_graph(root: pathlib.Path, packages: Mapping[str, str] = PACKAGES) -> Dict[str, Set[str]]:
    """{module: the modules it imports} of the package under ``root``."""
    modules = find_modules(root, packages)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def wrong_imports(graph: Mapping[str, Set[str]]) -> List[str]:
    """Each import of the package root or of a higher layer, as "A -> B (why)"."""
    problems = []
    for name in sorted(graph):
        for target in sorted(graph[name]):
            if target == "normgrad":
                problems.append(f"{name} -> normgrad (the package root: import the defining module)")
            elif name != "normgrad" and layer(target) > layer(name):
                problems.append(f"{name} -> {target} (upward: {LAYER_NAMES[layer(name)]} imports "
                                f"{LAYER_NAMES[layer(target)]})")
    return problems


def cycles(graph: Mapping[str, Set[str]]) -> List[List[str]]:
    """The import cycles: each strongly connected set of two or more modules, sorted (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for module in sorted(graph):
            if module not in index:
                visit(module)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def check(root: pathlib.Path, packages: Mapping[str, str] = PACKAGES) -> Tuple[List[str], List[List[str]]]:
    """(wrong imports, cycles) of the package under ``root``."""
    graph = import_graph(root, packages)
    return wrong_imports(graph), cycles(graph)


def checked_layout() -> Tuple[pathlib.Path, Dict[str, str]]:
    """The repository's folders; where the tests run beside an installed wheel and no source
    tree (CI's wheel stage), the folders the installed packages are imported from."""
    if (ROOT / PACKAGES["normgrad"]).is_dir():
        return ROOT, dict(PACKAGES)
    import importlib.util

    return pathlib.Path("/"), {package: str(pathlib.Path(importlib.util.find_spec(package).origin).parent)
                               for package in PACKAGES}


def test_layers_point_down_and_no_module_imports_a_cycle():
    graph = import_graph(*checked_layout())
    assert len(graph) > 100 and {"normgrad.ops", "normgrad.graphs", "normgrad.tools", "normgrad.util"} <= set(graph)
    problems, loops = wrong_imports(graph), cycles(graph)
    assert not problems, "imports that do not point down:\n" + "\n".join(problems)
    assert not loops, "import cycles:\n" + "\n".join(" <-> ".join(loop) for loop in loops)


def _write(root: pathlib.Path, files: Mapping[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_check_names_upward_imports_root_imports_and_cycles(tmp_path):
    _write(tmp_path, {
        "src/normgrad/__init__.py": "from normgrad.ops import api\n",  # the façade may import any layer
        "src/normgrad/util/__init__.py": "",
        "src/normgrad/util/files.py": "def f():\n    from normgrad.ops.api import g\n",  # upward, in a function
        "src/normgrad/train.py": "import normgrad.loop as loop\n",
        "src/normgrad/loop.py": "def fit():\n    from normgrad import train\n",  # the root, and a cycle
        "ops/__init__.py": "",
        "ops/api.py": "from . import _common\n",
        "ops/_common.py": "import numpy\n",
        "graphs/__init__.py": "",
        "tools/__init__.py": "",
        "tools/cli.py": "import normgrad.train\nfrom normgrad.graphs import x\n",
    })
    problems, loops = check(tmp_path)
    assert problems == [
        "normgrad.loop -> normgrad (the package root: import the defining module)",
        "normgrad.util.files -> normgrad.ops.api (upward: helpers imports ops)",
    ]
    assert loops == [["normgrad.loop", "normgrad.train"]]


def test_the_check_passes_a_package_whose_layers_point_down(tmp_path):
    _write(tmp_path, {
        "src/normgrad/__init__.py": "from normgrad.ops import api\n",
        "src/normgrad/errors.py": "",
        "src/normgrad/train.py": "from normgrad.graphs.builder import build\nimport normgrad.errors\n",
        "ops/__init__.py": "",
        "ops/api.py": "from normgrad.errors import E\n",
        "graphs/__init__.py": "",
        "graphs/builder.py": "import normgrad.ops.api as api\n",
        "tools/__init__.py": "",
        "tools/cli.py": "import normgrad.train\n",
    })
    assert check(tmp_path) == ([], [])
