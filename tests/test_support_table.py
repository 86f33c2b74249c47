"""`normgrad support-table`: the support page's model-family and operator tables rendered from the
results tests/test_model_families.py recorded (graphs/model_families.json)."""

from __future__ import annotations

import os

from normgrad.graphs import supported_op_types
from normgrad.tools import support_table

SUPPORT_PAGE = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "reference", "support.md")
SECTIONS = "<!-- support-table:models -->\nold\n<!-- /support-table:models -->\ntext\n" \
           "<!-- support-table:operators -->\n<!-- /support-table:operators -->\n"
RESULTS = {
    "models": {
        "resnet18": {"torchscript": {"status": "pass", "gradients": 63, "op_types": ["Conv", "Relu", "Shape"]},
                     "dynamo": {"status": "export fails", "error": "torch's dynamo exporter failed: X | Y"}},
        "unet2d": {"torchscript": {"status": "blocked", "operators": ["Resize", "Pad"], "error": "..."}},
    },
    "versions": {"torch": "2.13.0"},
}


def test_readme_tables_are_the_rendering_of_the_recorded_results():
    with open(SUPPORT_PAGE, encoding="utf-8") as file:
        text = file.read()
    assert support_table.update_readme(text) == text, "stale: run normgrad support-table docs/reference/support.md"


def test_rendering_says_each_outcome_and_which_model_uses_each_operator():
    text = support_table.update_readme(SECTIONS, RESULTS)
    models = text.split("<!-- support-table:models -->\n")[1].split("\n<!-- /support-table:models -->")[0]
    assert models.splitlines()[2:5] == [
        f"| {support_table.MODEL_TITLES['resnet18']} | matches torch (63 gradients) | "
        "export fails: torch's dynamo exporter failed: X \\| Y |",
        f"| {support_table.MODEL_TITLES['unet2d']} | blocked: no gradient rule for Resize, Pad | not measured |",
        "",
    ]
    assert "Measured with torch 2.13.0." in models and "\ntext\n" in text
    operators = text.split("<!-- support-table:operators -->\n")[1]
    assert "| Conv | resnet18 |" in operators and "| Relu | resnet18 |" in operators
    differentiated = [op for op, has_gradient in supported_op_types().items() if has_gradient]
    rewritten = [line for line in operators.splitlines() if line.endswith(f" | {support_table.REWRITTEN} |")]
    assert rewritten == [f"| com.microsoft.{op} | {support_table.REWRITTEN} |"
                         for op in ("Attention", "MultiHeadAttention", "RotaryEmbedding")]
    assert sum(line.startswith("| ") for line in operators.splitlines()) == len(differentiated) + len(rewritten) + 1
    assert "Shape" not in [line.split(" | ")[0][2:] for line in operators.splitlines()]  # no gradient: listed apart
    assert support_table.update_readme(text, RESULTS) == text


def test_cli_writes_checks_and_refuses_missing_markers(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(SECTIONS)
    assert support_table.main([str(readme), "--check"]) == 1
    assert capsys.readouterr().out == f"{readme}: support tables stale\n"
    assert support_table.main([str(readme)]) == 0
    assert support_table.main([str(readme), "--check"]) == 0
    assert readme.read_text() == support_table.update_readme(SECTIONS)
    assert sorted(os.listdir(tmp_path)) == ["README.md"]
    readme.write_text("no markers\n")
    capsys.readouterr()
    assert support_table.main([str(readme)]) == 1
    assert capsys.readouterr().err == (f"normgrad support-table: {readme}: no <!-- support-table:models --> ... "
                                       "<!-- /support-table:models --> markers\n")
    assert support_table.main([str(tmp_path / "missing.md")]) == 1
