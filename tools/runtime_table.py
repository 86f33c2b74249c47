"""``python -m normgrad.tools.runtime_table docs/reference/runtimes.md [--check]``: render the table
runtime x graph form of docs/reference/runtimes.md from what the runtime tests measured.

``tests/test_runtimes.py`` (and ``tests/test_openvino.py`` for the onnxruntime-openvino EP)
check each outcome against ``graphs/runtime_support.json`` and, with
``NORMGRAD_RECORD_RUNTIMES=1``, record it there; this command writes the table between the
page's ``<!-- runtime-table -->`` and ``<!-- /runtime-table -->`` markers. ``--check`` only
says whether it is current.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Dict, List, Optional, Sequence

from normgrad.util.files import write_bytes_atomic

__all__ = ["RESULTS_PATH", "AND", "recording", "load_results", "save_results", "render", "update_page", "main"]

RESULTS_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "graphs", "runtime_support.json")
RUNTIME_COLUMNS = (
    ("openvino-ep", "onnxruntime-openvino EP (device CPU)"),
    ("openvino", "OpenVINO runtime (`openvino`, CPU)"),
    ("tract", "tract (`tract`)"),
    ("evaluator", "onnx ReferenceEvaluator"),
)
GROUPS = (
    (r"^corpus/node_.*_float32(_[a-z_]+)?/(stored|portable)$", "single-node float32, as stored (normgrad node + local function)"),
    (r"^corpus/node_.*_float16(_[a-z_]+)?/(stored|portable)$", "single-node float16, as stored"),
    (r"^corpus/node_.*_bfloat16(_[a-z_]+)?/(stored|portable)$", "single-node bfloat16, as stored"),
    (r"^corpus/node_.*_float32(_[a-z_]+)?/inlined$", "single-node float32, inlined (static axes)"),
    (r"^corpus/node_.*_float16(_[a-z_]+)?/inlined$", "single-node float16, inlined"),
    (r"^corpus/node_.*_bfloat16(_[a-z_]+)?/inlined$", "single-node bfloat16, inlined"),
    (r"^corpus/train_.*_stored_weights/stored$", "training graph, weights initializers + inputs, fed other values"),
    (r"^corpus/train_.*/portable$", "training graph through `make_portable` (`--portable`)"),
    (r"^corpus/train_.*_inline/", "training graph `--inline` (weights pure inputs)"),
    (r"^corpus/train_.*/", "training graph as exported (weights pure inputs, normgrad nodes + local functions)"),
    *((rf"^{kind}/(dropout_mlp|embedding_classifier|gru_tagger)/(.*/)?{form}$",
       f"{what} of a training-mode Dropout MLP, an EmbeddingBag + Embedding classifier, a GRU tagger, {title}")
      for kind, what in (("grad", "grad-only training graph"), ("training", "5-step loop, step graph"))
      for form, title in (("default", "as exported"), ("inline", "`--inline`"), ("portable", "`--portable`"),
                          ("inline-portable", "`--inline --portable`"))),
    (r"^recurrent/.*/default$", "recurrent node's training graph (LSTM, GRU, RNN; directions, sequence_lens), as exported"),
    (r"^recurrent/.*/inline$", "recurrent node's training graph, `--inline`"),
    (r"^training/(torch_)?(lstm|gru)(_block)?/.*/default$", "5-step loop, recurrent step graph as exported (LSTM, GRU)"),
    (r"^training/(torch_)?(lstm|gru)(_block)?/.*/inline$", "5-step loop, recurrent step graph `--inline` (LSTM, GRU)"),
    (r"^training/.*/default$", "5-step loop, step graph as exported (SGD, AdamW)"),
    (r"^training/.*/inline$", "5-step loop, step graph `--inline` (SGD, AdamW)"),
    (r"^training/.*/portable$", "5-step loop, step graph `--portable` (SGD, AdamW)"),
)
"""(row regex, title): each recorded row counts in the first group it matches."""
AND = "; and "
"""Joins the reasons of an outcome that lacks several things (each counts in the table)."""


def recording() -> bool:
    return os.environ.get("NORMGRAD_RECORD_RUNTIMES") == "1"


def load_results() -> dict:
    """{runtime: {row: outcome}}: outcome "pass" or "lacks WHAT"."""
    if not os.path.exists(RESULTS_PATH):
        return {}
    with open(RESULTS_PATH, encoding="utf-8") as file:
        return json.load(file)


def save_results(results: dict) -> None:
    text = json.dumps(results, indent=1, sort_keys=True) + "\n"
    write_bytes_atomic(RESULTS_PATH, text.encode("utf-8"))


def _group(row: str) -> Optional[str]:
    return next((pattern for pattern, _ in GROUPS if re.match(pattern, row)), None)


def _cell(outcomes: List[str]) -> str:
    if not outcomes:
        return "not measured"
    passed = sum(1 for o in outcomes if o == "pass")
    lacking: Dict[str, int] = {}
    for outcome in outcomes:
        if outcome != "pass":
            for reason in re.sub(r" \([^)]*normgrad:[^)]*\)", "", outcome.removeprefix("lacks ")).split(AND):
                lacking[reason] = lacking.get(reason, 0) + 1
    text = f"{passed}/{len(outcomes)} pass"
    if lacking:
        text += "; lacks " + "; ".join(f"{reason} ({count})" for reason, count in sorted(lacking.items()))
    return text.replace("|", "\\|")


def render(results: dict) -> str:
    header = "| graph form | " + " | ".join(title for _, title in RUNTIME_COLUMNS) + " |"
    lines = [header, "|---" * (len(RUNTIME_COLUMNS) + 1) + "|"]
    for pattern, title in GROUPS:
        cells = []
        for runtime, _ in RUNTIME_COLUMNS:
            rows = results.get(runtime, {})
            cells.append(_cell([outcome for row, outcome in sorted(rows.items()) if _group(row) == pattern]))
        if all(cell == "not measured" for cell in cells):
            continue
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


_MARKERS = re.compile(r"(<!-- runtime-table -->\n)(.*?)(<!-- /runtime-table -->)", re.S)


def update_page(text: str, results: Optional[dict] = None) -> str:
    """``text`` with the table between the markers rendered from ``results`` (default: recorded)."""
    results = load_results() if results is None else results
    if not _MARKERS.search(text):
        raise ValueError("the page has no <!-- runtime-table --> ... <!-- /runtime-table --> markers")
    return _MARKERS.sub(lambda m: m.group(1) + render(results) + m.group(3), text)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from normgrad.tools.cli import update_page_command

    return update_page_command(argv, "python -m normgrad.tools.runtime_table", __doc__.split("\n\n")[0],
                               "the Markdown page with the markers (docs/reference/runtimes.md)", "runtime table", update_page)


if __name__ == "__main__":
    sys.exit(main())
