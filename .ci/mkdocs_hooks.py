"""MkDocs hook: lays out the package's sources for mkdocstrings (see ``_package_layout``)."""

from __future__ import annotations

import os


def _package_layout(root: str) -> str:
    """The installed package's layout (``wheel.packages`` in pyproject.toml: src/normgrad with
    graphs/, ops/ and tools/ as its subpackages) as a tree of symlinks under
    build/docs-src, for mkdocstrings to read the sources statically, without an install."""
    target = os.path.join(root, "build", "docs-src")
    package = os.path.join(target, "normgrad")
    os.makedirs(package, exist_ok=True)
    links = {name: os.path.join(root, "src", "normgrad", name) for name in os.listdir(os.path.join(root, "src", "normgrad"))
             if name != "__pycache__"}
    links.update({name: os.path.join(root, name) for name in ("graphs", "ops", "tools")})
    for name, source in links.items():
        link = os.path.join(package, name)
        if os.path.islink(link) and os.readlink(link) == source:
            continue
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(source, link)
    return target


def on_startup(command, dirty):
    # before mkdocstrings reads its search paths, which must exist then
    _package_layout(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
