"""docs/reference/runtimes.md's runtime table is what graphs/runtime_support.json (recorded by the
runtime tests) renders to."""

from __future__ import annotations

import pathlib

from normgrad.tools import runtime_table

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "reference" / "runtimes.md"


def test_runtime_table_is_current():
    text = PAGE.read_text()
    assert runtime_table.update_page(text) == text, "stale: run python -m normgrad.tools.runtime_table docs/reference/runtimes.md"


def test_every_recorded_row_is_in_a_group():
    for runtime, rows in runtime_table.load_results().items():
        assert runtime in dict(runtime_table.RUNTIME_COLUMNS), runtime
        for row, outcome in rows.items():
            assert runtime_table._group(row) is not None, row
            assert outcome == "pass" or outcome.startswith("lacks "), outcome


def test_render_counts_and_names_what_is_lacking():
    results = {"tract": {"corpus/train_a_inline/stored": "pass", "corpus/train_b_inline/stored": "lacks X (op)"}}
    table = runtime_table.render(results)
    assert "| training graph `--inline` (weights pure inputs) | not measured | not measured | 1/2 pass; lacks X (op) (1) |" in table


def test_render_counts_each_of_several_reasons():
    both = "lacks X (op)" + runtime_table.AND + "Y"
    results = {"tract": {"recurrent/a/inline": both, "recurrent/b/inline": "lacks Y", "recurrent/c/inline": "pass"}}
    table = runtime_table.render(results)
    assert "| recurrent node's training graph, `--inline` | not measured | not measured | 1/3 pass; lacks X (op) (1); Y (2) |" in table
