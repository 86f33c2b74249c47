"""MkDocs hook: nav entries whose title ends in "(optional)" name pages that other branches
add; an entry is kept (with the marker removed from its title) when its page exists and
dropped otherwise, so ``mkdocs build --strict`` passes with and without those pages."""

from __future__ import annotations

import os

MARKER = " (optional)"


def _filter(entries, docs_dir):
    kept = []
    for entry in entries:
        if isinstance(entry, dict):
            (title, target), = entry.items()
            if isinstance(target, list):
                target = _filter(target, docs_dir)
            elif title.endswith(MARKER):
                if not os.path.exists(os.path.join(docs_dir, target)):
                    continue
                title = title[: -len(MARKER)]
            kept.append({title: target})
        else:
            kept.append(entry)
    return kept


def on_config(config):
    config["nav"] = _filter(config["nav"] or [], config["docs_dir"])
    return config


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
