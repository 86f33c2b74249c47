"""Model families through normgrad.torch.export (both exporters) and build_training_graph:
gradients of the input and every parameter against torch autograd, to 1e-4 of the model's
largest gradient.

The expected outcome of each (model, exporter) is recorded in graphs/model_families.json,
from which `normgrad support-table` renders the model-family table of docs/reference/support.md: "pass" must match
torch; "blocked" must fail with UnsupportedOperatorError naming exactly the recorded
operators, and is an xfail(strict=True), so a merged rule flips it to a failure that says to
record again; "export fails" must fail in torch's exporter with the recorded error. Record
with ``NORMGRAD_RECORD_MODEL_FAMILIES=1 python -m pytest tests/test_model_families.py``
(then ``normgrad support-table docs/reference/support.md``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Dict, List, Tuple

import numpy as np
import onnx
import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

import _torch_models as zoo  # noqa: E402
from _graph_models import run_training  # noqa: E402

import normgrad.torch  # noqa: E402
from normgrad.graphs import UnsupportedOperatorError, build_training_graph  # noqa: E402
from normgrad.tools import support_table  # noqa: E402

RECORD = os.environ.get("NORMGRAD_RECORD_MODEL_FAMILIES") == "1"
EXPORTERS = ("torchscript", "dynamo")


@dataclasses.dataclass(frozen=True)
class Family:
    build: Callable[[], "torch.nn.Module"]
    inputs: Callable[[np.random.Generator], Dict[str, np.ndarray]]
    outputs: Tuple[str, ...] = ("y",)
    needs: str = ""  # an optional package the model comes from


def _image(size, channels=3):
    return lambda rng: {"x": rng.standard_normal((2, channels, size, size)).astype(np.float32)}


def _token_ids(rng, low=1, length=6):
    """Tokens of a vocabulary of 50 from ``low``, above the padding_idx of the tiny transformers
    models (0; Longformer's 1), which the export does not carry: docs/how-to/export-from-torch.md."""
    return {"input_ids": rng.integers(low, 50, (2, length)).astype(np.int64)}


FAMILIES: Dict[str, Family] = {
    "resnet18": Family(lambda: zoo.ResNet(width=8), _image(64)),
    "mobilenet_v3_small": Family(lambda: zoo.MobileNetV3(width_mult=0.5), _image(64)),
    "shufflenet_v2": Family(lambda: zoo.ShuffleNetV2(channels=(8, 16, 32, 64, 64)), _image(64)),
    "efficientnet_b0": Family(lambda: zoo.EfficientNet(width_mult=0.25, max_layers=1), _image(64)),
    "densenet121": Family(lambda: zoo.DenseNet(growth=8, blocks=(2, 2, 2, 2), init_features=16), _image(64)),
    "convnext_tiny": Family(lambda: zoo.ConvNeXt(dims=(8, 16, 32, 64), depths=(1, 1, 2, 1)), _image(64)),
    "vit": Family(zoo.VisionTransformer, _image(32)),
    "bert": Family(zoo.BertEncoder, lambda rng: {"input_ids": rng.integers(0, 100, (2, 8)).astype(np.int64)},
                   ("hidden", "pooled"), "transformers"),
    "unet2d": Family(zoo.UNet, lambda rng: {"sample": rng.standard_normal((2, 3, 32, 32)).astype(np.float32),
                                            "timestep": np.array([10, 500], np.int64)}, needs="diffusers"),
    "autoencoder_kl": Family(zoo.VAE, lambda rng: {"sample": rng.standard_normal((2, 3, 32, 32)).astype(np.float32)},
                             needs="diffusers"),
    "dropout_classifier": Family(zoo.DropoutClassifier, lambda rng: {"x": rng.standard_normal((8, 16)).astype(np.float32)}),
    "lstm_classifier": Family(lambda: zoo.RecurrentClassifier("LSTM"),
                              lambda rng: {"x": rng.standard_normal((3, 5, 6)).astype(np.float32)}),
    "gru_classifier": Family(lambda: zoo.RecurrentClassifier("GRU"),
                             lambda rng: {"x": rng.standard_normal((3, 5, 6)).astype(np.float32)}),
    "pixel_shuffle_sr": Family(zoo.PixelShuffleSR, _image(8)),
    "prelu_mish": Family(zoo.PReLUMish, lambda rng: {"x": rng.standard_normal((4, 16)).astype(np.float32)}),
    "cumsum_positions": Family(zoo.CumsumPositions, lambda rng: {
        "input_ids": np.array([[5, 7, 9, 0, 0], [3, 1, 4, 1, 5]], np.int64)}),
    "embedding_bag": Family(zoo.EmbeddingBagRecommender, lambda rng: {
        "user_ids": rng.integers(0, 30, 7).astype(np.int64), "user_offsets": np.array([0, 2, 5], np.int64),
        "item_ids": rng.integers(0, 40, 6).astype(np.int64), "item_offsets": np.array([0, 1, 4], np.int64)}),
    "mixtral": Family(zoo.mixtral, _token_ids, needs="transformers"),
    "qwen2_moe": Family(zoo.qwen2_moe, _token_ids, needs="transformers"),
    "fnet": Family(zoo.FNetEncoder, _token_ids, ("hidden", "pooled"), "transformers"),
    "longformer": Family(zoo.longformer, lambda rng: _token_ids(rng, low=2, length=8), needs="transformers"),
    "swinv2": Family(zoo.swinv2, lambda rng: {"pixel_values": rng.standard_normal((2, 3, 32, 32)).astype(np.float32)},
                     needs="transformers"),
    "rwkv": Family(zoo.rwkv, _token_ids, needs="transformers"),
    "funnel": Family(zoo.funnel, _token_ids, needs="transformers"),
}


def _distinct_parameters(module, seed=0):
    """Every parameter moved off its initial value by its own random amount, so that no two
    are equal (an exporter that merges equal initializers would show) and norm scales are
    not all ones."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            spread = float(param.std()) if param.numel() > 1 else 0.0
            param.add_(torch.randn(param.shape, generator=generator) * max(spread, 0.05) * 0.5)


def _expected(model: str, exporter: str) -> dict:
    return support_table.load_results()["models"].get(model, {}).get(exporter, {"status": "unrecorded"})


def _record(model: str, exporter: str, outcome: dict) -> None:
    results = support_table.load_results()
    results["models"].setdefault(model, {})[exporter] = outcome
    support_table.save_results(results)


def _cases():
    for model in FAMILIES:
        for exporter in EXPORTERS:
            expected = _expected(model, exporter)
            marks = []
            if expected["status"] == "blocked" and not RECORD:
                reason = (f"needs gradient rules for {', '.join(expected['operators'])}" if expected["operators"]
                          else expected["error"])
                marks.append(pytest.mark.xfail(strict=True, raises=UnsupportedOperatorError, reason=reason))
            yield pytest.param(model, exporter, marks=marks, id=f"{model}-{exporter}")


def _dropout_masks(forward: onnx.ModelProto) -> List[str]:
    """Adds the mask output of every Dropout node that can drop (ratio not a constant 0) to
    the graph outputs; returns their names in graph order."""
    constants = {t.name: onnx.numpy_helper.to_array(t) for t in forward.graph.initializer}
    for node in forward.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = onnx.numpy_helper.to_array(node.attribute[0].t)
    masks = []
    for node in forward.graph.node:
        if node.op_type != "Dropout":
            continue
        ratio = constants.get(node.input[1]) if len(node.input) > 1 and node.input[1] else np.float32(0.5)
        if ratio is not None and float(np.asarray(ratio)) == 0.0:
            continue
        while len(node.output) < 2:
            node.output.append("")
        node.output[1] = node.output[1] or f"{node.output[0]}_mask"
        masks.append(node.output[1])
    return masks


def _torch_with_masks(module, masks: List[np.ndarray]):
    """Hooks making each dropping nn.Dropout (in call order) apply the ONNX graph's mask."""
    dropouts = [m for m in module.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training]
    calls = iter(masks)

    def apply(dropout, inputs, output):
        mask = next(calls)
        return inputs[0] * torch.tensor(mask) / (1 - dropout.p)

    for dropout in dropouts:
        dropout.inplace = False  # the hook reads the input, which an in-place dropout would have changed
    return [d.register_forward_hook(apply) for d in dropouts], len(dropouts)


def _measure(model: str, exporter: str, tmp_path) -> dict:
    """Exports, builds the training graph, compares with torch; returns the outcome."""
    family = FAMILIES[model]
    if family.needs:
        pytest.importorskip(family.needs)
    torch.manual_seed(0)
    module = family.build().train()
    _distinct_parameters(module)
    rng = np.random.default_rng(0)
    data = family.inputs(rng)
    names = list(data)
    try:
        forward = normgrad.torch.export(module, tuple(torch.tensor(v) for v in data.values()), tmp_path / "forward.onnx",
                                        exporter=exporter, input_names=names, output_names=list(family.outputs))
    except normgrad.torch.TorchExportError as error:
        return {"status": "export fails", "error": str(error)}
    op_types = sorted({n.op_type for n in forward.graph.node})
    masks = _dropout_masks(forward)
    for mask in masks:
        forward.graph.output.append(onnx.helper.make_empty_tensor_value_info(mask))
    try:
        training = build_training_graph(forward)
    except UnsupportedOperatorError as error:
        return {"status": "blocked", "operators": _named_operators(str(error)), "error": str(error), "op_types": op_types}
    gradient_of = json.loads(next(p.value for p in training.model.metadata_props if p.key == "normgrad.gradients"))
    with torch.no_grad():  # the output shapes (an export may leave them symbolic)
        shapes = module(*(torch.tensor(v) for v in data.values()))
    shapes = [tuple(t.shape) for t in (shapes if isinstance(shapes, tuple) else (shapes,))]
    seeds = {output: rng.standard_normal(shape).astype(np.float32) for output, shape in zip(family.outputs, shapes)}
    results = run_training(training, dict(data, **{f"{k}_grad": v for k, v in seeds.items()}))

    handles, dropping = _torch_with_masks(module, [results[m] for m in masks])
    assert dropping == len(masks), f"{dropping} dropping nn.Dropout modules, {len(masks)} dropping Dropout nodes"
    tensors = {k: torch.tensor(v, requires_grad=np.issubdtype(v.dtype, np.floating)) for k, v in data.items()}
    outputs = module(*tensors.values())
    for handle in handles:
        handle.remove()
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    for name, value in zip(family.outputs, outputs):
        np.testing.assert_allclose(results[name], value.detach().numpy(), rtol=1e-4, atol=1e-4 * float(value.abs().max()),
                                   err_msg=f"forward output {name}")
    module.zero_grad()
    torch.autograd.backward(list(outputs), [torch.tensor(seeds[n]) for n in family.outputs])

    expected = {name: t.grad.numpy() for name, t in tensors.items() if t.requires_grad}
    parameters = {name: p for name, p in module.named_parameters()}
    expected.update({name: p.grad.numpy() for name, p in parameters.items() if p.grad is not None})
    trained = {source: grad for grad, source in gradient_of.items()}
    missing = sorted(set(expected) - set(trained))
    assert not missing, f"no gradient output for {missing[:5]}"
    extra = sorted(set(trained) - set(expected))
    assert not extra, f"gradient outputs for values that are no torch parameter or input: {extra[:5]}"
    largest = max(float(np.abs(g).max()) for g in expected.values())
    errors = {name: float(np.abs(results[trained[name]] - grad).max()) for name, grad in expected.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-4 * largest, f"{worst}: max |onnx - torch| {errors[worst]:.3g}, largest gradient {largest:.3g}"
    return {"status": "pass", "gradients": len(expected), "op_types": op_types}


def _named_operators(message: str) -> List[str]:
    """The operator names in an UnsupportedOperatorError's message (none if it is about
    something else, e.g. an unknown rank)."""
    import re

    if "no gradient rule for operator" not in message:
        return []
    listed = message.split("no gradient rule for operator", 1)[1].split("; a gradient", 1)[0]
    return re.findall(r"(?:^|, )s? ?([A-Za-z0-9]+)(?: of domain '[^']*')? \(", listed)


@pytest.mark.parametrize("model, exporter", list(_cases()))
def test_model_family_matches_torch(model, exporter, tmp_path):
    outcome = _measure(model, exporter, tmp_path)
    if RECORD:
        _record(model, exporter, outcome)
        return
    expected = _expected(model, exporter)
    if outcome["status"] == "blocked" and expected["status"] == "blocked":
        assert outcome["operators"] == expected["operators"], outcome["error"]
        raise UnsupportedOperatorError(outcome["error"])  # the recorded xfail
    if outcome["status"] == "export fails" and expected["status"] == "export fails":
        assert outcome["error"] == expected["error"]
        return
    assert outcome["status"] == expected["status"], (
        f"recorded {expected['status']!r}, measured {outcome['status']!r} ({outcome.get('error', '')}): record again with "
        "NORMGRAD_RECORD_MODEL_FAMILIES=1 python -m pytest tests/test_model_families.py, then normgrad support-table docs/reference/support.md"
    )
    assert outcome["op_types"] == expected["op_types"]

