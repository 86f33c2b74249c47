"""``normgrad bench --train``'s transformer rows at ``--quick`` sizes: every row is printed
with a timing and numeric ratios for normgrad (cpp) and torch (+ peft for LoRA), and the
losses of the first two steps agree with cpp's (exit status 0). Timings are not asserted."""

from __future__ import annotations

import os
import re

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("onnxscript")

from normgrad.tools import bench_train, cli  # noqa: E402

NUMBER = r"\d+\.\d+"


def test_transformer_rows_quick(capsys):
    names = [name for name in bench_train.TRANSFORMERS if name not in bench_train.OPTION_ROWS]
    assert names == ["bert", "bert_lora", "gpt2", "gpt2_lora", "llama", "llama_lora"]
    assert cli.main(["bench", "--train", "--quick", "--repeat", "1", "--models", *names]) == 0
    out = capsys.readouterr().out
    groups = out.split("\n\n")[1:]
    assert len(groups) == len(names), out
    for name, group in zip(names, groups):
        lora = name.endswith("_lora")
        loss = "causal-LM loss" if name.startswith(("gpt2", "llama")) else "cross-entropy"
        heading = group.splitlines()[0]
        what = "LoRA r 8" if lora else "full fine-tuning"
        assert heading.startswith(f"{name} x [2, 16] (2 layers, hidden 32, vocabulary 128, {what}): "
                                  f"training step (forward, {loss},"), group
        for variant in ("cpp", "torch+peft" if lora else "torch"):
            rows = [line for line in group.splitlines() if line.split()[:1] == [variant] and "ms " in line]
            assert len(rows) == 1, group
            # median, range, ratio to torch, CPU time and its ratio to torch's, peak and step RSS,
            # the two losses and their agreement with cpp
            pattern = (rf"  {re.escape(variant)} +{NUMBER}ms +{NUMBER}- +{NUMBER}ms +{NUMBER}x +- +{NUMBER}ms +{NUMBER}x"
                       rf" +\d+MB +-?\d+MB"
                       rf"  {NUMBER} {NUMBER} \(vs cpp {NUMBER}e[-+]\d+\)$")
            assert re.fullmatch(pattern, rows[0]), rows[0]
        assert "functions" not in group and "failed" not in group and "MISMATCH" not in group
        assert "cpp profile (op types by share of node time): " in group


@pytest.mark.skipif(not os.environ.get("NORMGRAD_ORT_TRAINING_PYTHON"),
                    reason="NORMGRAD_ORT_TRAINING_PYTHON (a Python with onnxruntime-training 1.19.2) is not set")
def test_ort_training_column_on_gpt2(capsys):
    """GPT-2 needs every adaptation the onnxruntime-training side makes (the shifted logits,
    LayerNormalization's statistics outputs, Split for SplitToSequence): its losses agree with cpp's."""
    python = os.environ["NORMGRAD_ORT_TRAINING_PYTHON"]
    assert cli.main(["bench", "--train", "--quick", "--repeat", "1", "--models", "gpt2",
                     "--ort-training-python", python]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("  ort-training ") and "ms " in line]
    assert len(rows) == 1 and re.search(rf" {NUMBER}x +1\.00x .*\(vs cpp {NUMBER}e[-+]\d+\)$", rows[0]), rows


def test_memory_row_quick(capsys):
    """``--memory``: a LoRA Llama trained from the step graph file ``normgrad export`` writes
    (its base in external data) against torch + peft, with the peak RSS and CPU ratios."""
    assert cli.main(["bench", "--train", "--quick", "--repeat", "1", "--memory"]) == 0
    out = capsys.readouterr().out
    groups = out.split("\n\n")[1:]
    assert len(groups) == 1 and groups[0].startswith(
        f"{bench_train.MEMORY_ROW} x [1, 16] (2 layers, hidden 64, vocabulary 512, LoRA r 8): "), out
    rows = {line.split()[0]: line for line in groups[0].splitlines() if "ms " in line}
    assert set(rows) == {"cpp", "torch+peft"}, out
    assert "(vs cpp" in rows["torch+peft"] and "MISMATCH" not in out and "failed" not in out
    peaks = [int(re.search(r" (\d+)MB ", rows[v]).group(1)) for v in ("cpp", "torch+peft")]
    ratio = re.search(rf"  cpp / torch\+peft: peak RSS ({NUMBER})x \((\d+) / (\d+) MB\), CPU time per step {NUMBER}x", out)
    assert ratio, out
    assert [int(ratio.group(2)), int(ratio.group(3))] == peaks
    assert float(ratio.group(1)) == pytest.approx(peaks[0] / peaks[1], abs=0.01)


def _ratio_line(out, group, variants=("cpp", "torch+peft")):
    """The peak RSS of each variant's row and the ratio line under them: the ratio is theirs."""
    rows = {line.split()[0]: line for line in group.splitlines() if "ms " in line}
    assert set(rows) == set(variants), out
    peaks = [int(re.search(r" (\d+)MB ", rows[v]).group(1)) for v in variants]
    ratio = re.search(rf"  cpp / torch\+peft: peak RSS ({NUMBER})x \((\d+) / (\d+) MB\), CPU time per step {NUMBER}x", group)
    assert ratio, out
    assert [int(ratio.group(2)), int(ratio.group(3))] == peaks
    assert float(ratio.group(1)) == pytest.approx(peaks[0] / peaks[1], abs=0.01)
    return rows


def test_genai_row_quick(capsys):
    """A ``--genai`` row: LoRA on onnxruntime-genai's int4 build of a Qwen2 (tied embeddings: the
    embedding is a GatherBlockQuantized of the int4 lm_head) trained from ``normgrad export
    --lora-*``'s step graph, against torch + peft on the dequantized weights: the losses agree
    (the check would print MISMATCH and exit 1 otherwise). The Llama row differs only in its
    untied head; one row keeps the test short (two builder runs, two workers)."""
    pytest.importorskip("onnxruntime_genai")
    assert cli.main(["bench", "--train", "--quick", "--repeat", "1", "--models", "qwen2_int4_lora"]) == 0
    out = capsys.readouterr().out
    groups = out.split("\n\n")[1:]
    assert [g.split()[0] for g in groups] == ["qwen2_int4_lora"], out
    for group in groups:
        assert " x [" in group and "(2 layers, hidden 64, vocabulary 512, LoRA r 8 of the genai builder's int4 model" in group
        rows = _ratio_line(out, group)
        assert re.search(rf"\(vs cpp {NUMBER}e[-+]\d+\)$", rows["torch+peft"]), group
    assert "MISMATCH" not in out and "failed" not in out
