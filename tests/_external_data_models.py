"""The helpers of the frozen-base-in-external-data tests: torch and the LoRA models (skipping without
them), and a step graph written by `normgrad export`."""

from __future__ import annotations

import pytest

from normgrad.tools.export import main as export_main


def _torch():
    """torch, peft and the LoRA models (_lora_models); the test skips without them."""
    torch = pytest.importorskip("torch")
    for name in ("transformers", "peft", "safetensors", "onnxscript"):
        pytest.importorskip(name)
    import _lora_models

    return torch, _lora_models


def _write_step_graph(source, output, *options):
    options = options or ("--loss", "causal_lm", "--optimizer", "adamw")
    assert export_main([str(source), "-o", str(output), *options]) == 0
