"""LoRA fine-tuning through the documented route: a transformers causal LM wrapped by peft,
exported with normgrad.torch.export, trained by the Trainer with the causal_lm loss, against
torch + peft (torch.optim.AdamW over the adapter parameters); the saved adapter loaded by
peft and the merged inference model against torch's logits. Random tiny models, nothing
downloaded."""

from __future__ import annotations

import copy
import json
import os
import re

import numpy as np
import onnx
import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("safetensors")
pytest.importorskip("onnxscript")

import onnxruntime as ort  # noqa: E402

import normgrad.torch  # noqa: E402
from normgrad import lora  # noqa: E402
from normgrad.graphs import build_step_graph, build_training_graph  # noqa: E402
from normgrad.train import Trainer  # noqa: E402
from _lora_models import FAMILIES, _fresh_base, _llama, _peft_model, _torch_name

STEPS, LR, WEIGHT_DECAY = 20, 1e-3, 0.01
LEVELS = {"disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "default": None}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def exported(request, tmp_path_factory):
    """(family, peft model, base state, step graph, initial state, batch, torch's adapters after STEPS steps)."""
    family = request.param
    model, base_state = _peft_model(family)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 64, (2, 8), generator=generator)
    labels = input_ids.clone()
    labels[0, :3] = -100  # a masked prompt
    forward = normgrad.torch.export(normgrad.torch.causal_lm_logits(model), (input_ids,), tmp_path_factory.mktemp(family) / "forward.onnx",
                                    exporter="dynamo", input_names=["input_ids"], output_names=["logits"])
    step, initial = build_step_graph(build_training_graph(forward, loss="causal_lm"), "adamw", weight_decay=WEIGHT_DECAY)
    float64 = copy.deepcopy(model).double()
    losses, trained = _torch_steps(model, input_ids, labels)
    _, trained_float64 = _torch_steps(float64, input_ids, labels)
    return dict(family=family, model=model, base_state=base_state, step=step, initial=initial,
                batch={"input_ids": input_ids.numpy(), "labels": labels.numpy()}, trained=trained, losses=losses,
                trained_float64=trained_float64)


def _torch_steps(model, input_ids, labels):
    """STEPS AdamW steps of torch + peft: (losses, the adapters after them); the model's
    adapters are then back at their initial values (for the tests that compare logits)."""
    adapters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(adapters, lr=LR, weight_decay=WEIGHT_DECAY)
    initial_adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(input_ids=input_ids, labels=labels, use_cache=False).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    trained = {n: p.detach().numpy().copy() for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in initial_adapters:
                param.copy_(initial_adapters[name])
    return losses, trained


def _train(exported, level):
    options = ort.SessionOptions()
    if LEVELS[level] is not None:
        options.graph_optimization_level = LEVELS[level]
    trainer = Trainer(exported["step"], exported["initial"], lr=LR, session_options=options)
    losses = [trainer.step(**exported["batch"]) for _ in range(STEPS)]
    return trainer, losses


def test_only_adapters_train(exported):
    """The state is the adapters and their AdamW moments; no base weight has a gradient node."""
    step = exported["step"]
    adapters = {n for n, p in normgrad.torch.causal_lm_logits(exported["model"]).named_parameters() if p.requires_grad}
    parameters = json.loads({p.key: p.value for p in step.metadata_props}["normgrad.parameters"])
    assert set(parameters) == adapters and all(".lora_" in n for n in parameters)
    assert set(exported["initial"]) == {f"{p}{s}" for p in parameters for s in ("", ".exp_avg", ".exp_avg_sq")}
    produced = {o for node in step.graph.node for o in node.output}
    assert not [name for name in produced if "base_layer" in name or name.endswith("embed_tokens.weight_grad")]
    assert not any(o.name.endswith("_grad") for o in step.graph.output)


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_lora_steps_match_torch_and_peft(exported, level):
    """STEPS AdamW steps: every adapter within 1e-5 of its scale of torch + peft's, or no
    farther from torch's float64 trajectory than 4 times torch's own float32 run is (AdamW
    divides by the gradients' root mean square: float32 rounding that differs by CPU, as
    MLAS's and torch's GEMMs on AVX-512, moves an adapter by that much); the frozen base
    (initializers of the step graph) bitwise the torch base's."""
    trainer, losses = _train(exported, level)
    np.testing.assert_allclose(losses, exported["losses"], rtol=1e-5)
    state = trainer.state_dict()
    for name, expected in exported["trained"].items():
        got = state["model." + name]
        truth = exported["trained_float64"][name]
        scale = float(np.abs(expected).max())
        error, torch_error = float(np.abs(got - expected).max()), float(np.abs(expected - truth).max())
        assert error <= 1e-5 * scale or float(np.abs(got - truth).max()) <= 4 * torch_error, \
            f"{name}: max |normgrad - torch| {error:.3g}, scale {scale:.3g}, torch's own float32 error {torch_error:.3g}"
    base = {t.name: onnx.numpy_helper.to_array(t) for t in exported["step"].graph.initializer}
    checked = 0
    for name, value in exported["base_state"].items():
        stem = f"model.base_model.model.{name}"
        for onnx_name in (stem, stem[: -len(".weight")] + ".base_layer.weight"):
            if onnx_name in base:
                assert np.array_equal(base[onnx_name], value.numpy()), onnx_name
                checked += "base_layer" in onnx_name
    assert checked == len(exported["trained"]) // 2  # every adapted layer's base weight

def test_saved_adapter_loads_into_peft_and_merged_model_matches(exported, tmp_path):
    """The adapters trained by normgrad (graph optimizations off, so that this checks the
    saving and merging alone), saved as peft's files: PeftModel.from_pretrained on the same
    base gives the logits of torch with those adapters, and so does the merged ONNX model."""
    trainer, _ = _train(exported, "disabled")
    state = trainer.state_dict()
    trainer.save_adapter(tmp_path / "adapter")
    assert sorted(os.listdir(tmp_path / "adapter")) == [lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS]
    model = exported["model"]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(torch.from_numpy(state["model." + name]))
        input_ids = torch.from_numpy(exported["batch"]["input_ids"])
        expected = model(input_ids=input_ids, use_cache=False).logits.numpy()
        loaded = peft.PeftModel.from_pretrained(_fresh_base(exported["family"], exported["base_state"]), tmp_path / "adapter")
        got = loaded(input_ids=input_ids, use_cache=False).logits.numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    assert np.abs(expected).max() > 0.1
    trainer.export_merged_model(tmp_path / "merged.onnx")
    merged = onnx.load(tmp_path / "merged.onnx")
    assert not [t.name for t in merged.graph.initializer if ".lora_" in t.name]
    assert not [i for node in merged.graph.node for i in node.input if ".lora_" in i]
    session = ort.InferenceSession(merged.SerializeToString(), providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], {"input_ids": exported["batch"]["input_ids"]})[0]
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5)


def test_adapter_of_a_model_without_peft(tmp_path):
    from normgrad.graphs import examples

    step, initial = build_step_graph(build_training_graph(examples.mlp(), loss="mse"), "adamw")
    trainer = Trainer(step, initial)
    with pytest.raises(lora.LoraError, match="no LoRA adapters"):
        trainer.save_adapter(tmp_path / "adapter")
    with pytest.raises(lora.LoraError, match="no LoRA adapters"):
        trainer.export_merged_model(tmp_path / "merged.onnx")
    assert not os.path.exists(tmp_path / "adapter") and not os.path.exists(tmp_path / "merged.onnx")


@pytest.fixture(scope="module")
def half_exported(tmp_path_factory):
    """A Llama base cast to float16 under float32 adapters (random B, so that every adapter
    has a gradient): (peft model, training graph, batch)."""
    torch.manual_seed(0)
    base, _ = _llama()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base.to(torch.float16), config)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 64, (2, 8), generator=generator)
    labels = input_ids.clone()
    labels[0, :3] = -100
    forward = normgrad.torch.export(normgrad.torch.causal_lm_logits(model), (input_ids,), tmp_path_factory.mktemp("half") / "forward.onnx",
                                    exporter="dynamo", input_names=["input_ids"], output_names=["logits"])
    return dict(model=model, config=config, training=build_training_graph(forward, loss="causal_lm"),
                batch={"input_ids": input_ids.numpy(), "labels": labels.numpy()})


def test_float16_base_gradients(half_exported):
    """The adapter gradients over a float16 base are as close to float64 autograd (the same
    weights upcast) as torch's own float16 ones."""
    model, training, batch = half_exported["model"], half_exported["training"], half_exported["batch"]
    gradient_of = json.loads({p.key: p.value for p in training.model.metadata_props}["normgrad.gradients"])
    session = ort.InferenceSession(training.model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip(gradient_of, session.run(list(gradient_of), training.feeds(batch))))
    tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
    model.zero_grad()
    model(**tensors, use_cache=False).loss.backward()
    reference, _ = _llama()
    model64 = peft.get_peft_model(reference, half_exported["config"]).double()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    model64(**tensors, use_cache=False).loss.backward()
    half, exact = dict(model.named_parameters()), dict(model64.named_parameters())
    for grad_name, name in gradient_of.items():
        truth = exact[_torch_name(name)].grad.numpy()
        scale = float(np.abs(truth).max())
        torch_error = float(np.abs(half[_torch_name(name)].grad.numpy() - truth).max())
        error = float(np.abs(got[grad_name] - truth).max())
        assert error <= max(2 * torch_error, 2e-3 * scale), f"{name}: {error:.3g} vs torch float16's {torch_error:.3g}"


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_float16_base_steps_match_torch(half_exported, level):
    """The base stays float16 in the step graph, the state (adapters, momentum) is float32,
    and 5 SGD-with-momentum steps through the Trainer move the adapters as torch + peft does
    in the same dtypes (within 1e-2 of the update: float16 matmuls round differently)."""
    model, batch = half_exported["model"], half_exported["batch"]
    step, initial = build_step_graph(half_exported["training"], "sgd", momentum=0.9)
    kept = {t.name: t.data_type for t in step.graph.initializer}
    assert kept["model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == onnx.TensorProto.FLOAT16
    assert {v.dtype for v in initial.values()} == {np.dtype(np.float32)}
    start = {name: value.copy() for name, value in initial.items() if ".lora_" in name and "momentum" not in name}
    options = ort.SessionOptions()
    if LEVELS[level] is not None:
        options.graph_optimization_level = LEVELS[level]
    trainer = Trainer(step, initial, lr=0.05, session_options=options)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in start.items():
            named[_torch_name(name)].copy_(torch.from_numpy(value))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
    for _ in range(5):
        trainer.step(**batch)
        optimizer.zero_grad()
        model(**tensors, use_cache=False).loss.backward()
        optimizer.step()
    state = trainer.state_dict()
    for name, before in start.items():
        expected = named[_torch_name(name)].detach().numpy() - before
        error = float(np.abs((state[name] - before) - expected).max())
        assert error <= 1e-2 * float(np.abs(expected).max()), f"{name}: update off by {error:.3g}"


def test_frozen_base_in_external_data(tmp_path, monkeypatch):
    """export(external_data=True) moves the frozen base to PATH.data (the path models past
    2 GiB take); the training and step graphs keep referring to it instead of copying it,
    and the Trainer's steps on them are bitwise those of the same model with the base inline."""
    model, _ = _peft_model("gpt2")
    input_ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    forward = normgrad.torch.export(normgrad.torch.causal_lm_logits(model), (input_ids,), tmp_path / "forward.onnx", exporter="dynamo",
                                    input_names=["input_ids"], output_names=["logits"], external_data=True)
    external = [t.name for t in forward.graph.initializer if onnx.external_data_helper.uses_external_data(t)]
    assert external and not [n for n in external if ".lora_" in n]
    lengths = [int({e.key: e.value for e in t.external_data}["length"]) for t in forward.graph.initializer if t.name in external]
    locations = {e.value for t in forward.graph.initializer for e in t.external_data if e.key == "location"}
    assert len(locations) == 1 and re.fullmatch(r"forward\.onnx\.[0-9a-f]{16}\.data", next(iter(locations)))
    assert os.path.getsize(tmp_path / next(iter(locations))) == sum(lengths)
    inline = onnx.load(tmp_path / "forward.onnx")  # the external data loaded into the proto
    batch = {"input_ids": input_ids.numpy(), "labels": input_ids.numpy()}
    states, sizes = [], []
    monkeypatch.chdir(tmp_path)  # where onnx's checker looks for the external data of an in-memory model
    for source in (forward, inline):
        step, initial = build_step_graph(build_training_graph(source, loss="causal_lm"), "adamw")
        kept = [t.name for t in step.graph.initializer if onnx.external_data_helper.uses_external_data(t)]
        assert sorted(kept) == (sorted(external) if source is forward else [])
        sizes.append(step.ByteSize())
        options = ort.SessionOptions()  # one per Trainer: a second registration of the kernels fails
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        trainer = Trainer(step, initial, lr=1e-3, session_options=options)
        for _ in range(3):
            trainer.step(**batch)
        states.append(trainer.state_dict())
    assert sizes[1] - sizes[0] > 0.9 * sum(lengths)  # the frozen base is not in the step graph's protobuf
    assert states[0].keys() == states[1].keys()
    for name in states[0]:
        assert np.array_equal(states[0][name], states[1][name]), name


_PEFT_METADATA_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import _lora_models
from normgrad import lora
model, _ = _lora_models._peft_model("llama")
print(json.dumps(json.loads(lora.peft_metadata(model, set(model.state_dict())))["adapter_config"]))
"""


def test_peft_metadata_is_the_same_in_every_process():
    """peft writes target_modules in the order of a Python set, which follows the string hash
    seed: the normgrad.peft metadata (and the adapter_config.json saved from it) must not."""
    import subprocess
    import sys

    script = _PEFT_METADATA_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)))
    configs = []
    for seed in ("1", "2", "3"):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900,
                                env={**os.environ, "PYTHONHASHSEED": seed})
        assert result.returncode == 0, result.stderr
        configs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    assert configs[0] == configs[1] == configs[2], configs
    assert json.loads(configs[0])["target_modules"] == sorted(FAMILIES["llama"]()[1])
