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
