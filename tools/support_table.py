"""``normgrad support-table docs/reference/support.md [--check]``: render the docs' model-family
support table
and supported-operator list from what the model-family tests measured.

``tests/test_model_families.py`` records each (model, exporter) outcome in
``graphs/model_families.json`` (``NORMGRAD_RECORD_MODEL_FAMILIES=1``) and checks it on every
run; this command writes the tables between the page's ``<!-- support-table:NAME -->`` and
``<!-- /support-table:NAME -->`` markers. ``--check`` only says whether they are current.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Dict, List, Optional, Sequence

from normgrad.util.files import write_bytes_atomic
from normgrad.tools.cli import update_page_command

__all__ = ["RESULTS_PATH", "load_results", "save_results", "render", "update_readme", "main"]

RESULTS_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "graphs", "model_families.json")
"""Beside the graphs package (normgrad/tools and normgrad/graphs are siblings, installed or not)."""
EXPORTER_COLUMNS = (("torchscript", "TorchScript exporter"), ("dynamo", "dynamo exporter"))
MODEL_TITLES = {
    "resnet18": "ResNet-18 (torchvision structure, width 8)",
    "mobilenet_v3_small": "MobileNetV3-small (width 0.5)",
    "shufflenet_v2": "ShuffleNetV2 structure (channels 8-64, channel split and shuffle)",
    "efficientnet_b0": "EfficientNet-B0 (width 0.25, 1 block per stage)",
    "densenet121": "DenseNet-121 structure (growth 8, 2 layers per block)",
    "convnext_tiny": "ConvNeXt-tiny structure (dims 8-64, depths 1,1,2,1)",
    "vit": "VisionTransformer (image 32, patch 8, 2 layers)",
    "bert": "transformers BertModel (tiny config)",
    "unet2d": "diffusers UNet2DModel (tiny config)",
    "autoencoder_kl": "diffusers AutoencoderKL (tiny config)",
    "dropout_classifier": "MLP classifier with nn.Dropout(0.3) in training mode",
    "lstm_classifier": "nn.LSTM sequence classifier (2 layers, bidirectional, batch first)",
    "gru_classifier": "nn.GRU sequence classifier (2 layers, bidirectional, batch first)",
    "pixel_shuffle_sr": "super-resolution net with nn.PixelShuffle (ESPCN structure)",
    "prelu_mish": "MLP/Conv1d net with nn.PReLU (per channel and shared) and nn.Mish",
    "cumsum_positions": "position ids from torch.cumsum of the padding mask, causal running mean",
    "embedding_bag": "recommender with nn.EmbeddingBag (sum and mean bags)",
    "mixtral": "transformers MixtralForCausalLM (tiny config, 4 experts, top-2 router)",
    "qwen2_moe": "transformers Qwen2MoeForCausalLM (tiny config, 4 experts + shared expert)",
    "fnet": "transformers FNetModel (tiny config, torch.fft.fftn token mixing)",
    "longformer": "transformers LongformerModel (tiny config, sliding-window attention by slice assignment)",
    "swinv2": "transformers Swinv2Model (tiny config, shifted-window mask by slice assignment)",
    "rwkv": "transformers RwkvModel (tiny config, time mixing writing out[:, t])",
    "funnel": "transformers FunnelBaseModel (tiny config, pooling between blocks)",
}
REWRITTEN = "rewritten to standard ONNX before differentiation (no rule of its own)"
"""The operator table's cell of a com.microsoft operator a rewrite pass expands."""


def load_results() -> dict:
    """The recorded outcomes: {"models": {model: {exporter: outcome}}, "versions": {...}}."""
    path = RESULTS_PATH
    if not os.path.exists(path):
        return {"models": {}, "versions": {}}
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def save_results(results: dict) -> None:
    """Writes the outcomes (with the torch and onnxscript versions that measured them)."""
    try:
        import onnxscript
        import torch

        results["versions"] = {"torch": torch.__version__.split("+")[0], "onnxscript": onnxscript.__version__}
    except ImportError:
        pass
    text = json.dumps(results, indent=1, sort_keys=True) + "\n"
    write_bytes_atomic(RESULTS_PATH, text.encode("utf-8"))


def _cell(outcome: Optional[dict]) -> str:
    if not outcome:
        return "not measured"
    status = outcome["status"]
    if status == "pass":
        return f"matches torch ({outcome['gradients']} gradients)"
    if status == "blocked" and outcome["operators"]:
        return "blocked: no gradient rule for " + ", ".join(outcome["operators"])
    if status == "blocked":
        return f"blocked: {_short(outcome['error'])}"
    return f"export fails: {_short(outcome['error'])}"


def _short(error: str) -> str:
    error = error.replace("|", "\\|")
    return f"{error[:200]}{'...' if len(error) > 200 else ''}"


def render_models(results: dict) -> str:
    header = "| model | " + " | ".join(title for _, title in EXPORTER_COLUMNS) + " |"
    lines = [header, "|---" * (len(EXPORTER_COLUMNS) + 1) + "|"]
    ordered = [m for m in MODEL_TITLES if m in results["models"]] + sorted(set(results["models"]) - set(MODEL_TITLES))
    for model in ordered:
        outcomes = results["models"][model]
        cells = [_cell(outcomes.get(exporter)) for exporter, _ in EXPORTER_COLUMNS]
        lines.append(f"| {MODEL_TITLES.get(model, model)} | " + " | ".join(cells) + " |")
    versions = results.get("versions") or {}
    if versions:
        lines += ["", "Measured with " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) + "."]
    return "\n".join(lines)


def render_operators(results: dict) -> str:
    from normgrad.graphs import supported_op_types
    from normgrad.graphs.rewrites import REWRITTEN_CONTRIB_OP_TYPES

    used: Dict[str, List[str]] = {}
    for model, outcomes in sorted(results["models"].items()):
        for outcome in outcomes.values():
            if outcome.get("status") == "pass":
                for op_type in outcome.get("op_types", ()):
                    if model not in used.setdefault(op_type, []):
                        used[op_type].append(model)
    supported = supported_op_types()
    differentiated = [op for op, has_gradient in supported.items() if has_gradient]
    lines = ["| operator | in the exports of the model families that match torch |", "|---|---|"]
    for op_type in sorted(differentiated + list(REWRITTEN_CONTRIB_OP_TYPES)):
        cell = (REWRITTEN if op_type in REWRITTEN_CONTRIB_OP_TYPES
                else ', '.join(used.get(op_type, [])) or '(rule tests only)')
        lines.append(f"| {op_type} | {cell} |")
    no_gradient = [op for op, has_gradient in supported.items() if not has_gradient]
    lines += ["", f"No gradient flows through ({len(no_gradient)}): {', '.join(no_gradient)}."]
    return "\n".join(lines)


def render(results: Optional[dict] = None) -> Dict[str, str]:
    """The markdown of each README section, by marker name."""
    results = load_results() if results is None else results
    return {"models": render_models(results), "operators": render_operators(results)}


def update_readme(text: str, results: Optional[dict] = None) -> str:
    """``text`` with every ``support-table`` section replaced by its rendering.

    Raises:
        ValueError: a section's markers are missing.
    """
    for name, body in render(results).items():
        pattern = re.compile(rf"(<!-- support-table:{name} -->\n)(?:.*?\n)?(<!-- /support-table:{name} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"no <!-- support-table:{name} --> ... <!-- /support-table:{name} --> markers")
        text = pattern.sub(lambda match: match.group(1) + body + "\n" + match.group(2), text)
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``normgrad support-table``; 0 written or current, 1 stale (``--check``)
    or unreadable, 2 usage."""
    return update_page_command(argv, "normgrad support-table", __doc__.split("\n\n")[0],
                               "the Markdown page to update in place (atomically), e.g. docs/reference/support.md",
                               "support tables", update_readme)


if __name__ == "__main__":
    sys.exit(main())
