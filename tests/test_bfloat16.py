"""LoRA over a frozen bfloat16 base (peft keeps the adapters float32) on onnxruntime's CPU
provider, which has no bfloat16 arithmetic kernels: the training graph computes in float32
from the base weights stored as bfloat16 (normgrad.graphs.rewrites.bfloat16_in_float32), and
the Trainer keeps onnxruntime from folding them into float32 copies. Against torch autograd
in float64 and torch + peft in the same dtypes. Random tiny models, nothing downloaded."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("safetensors")
pytest.importorskip("onnxscript")

import onnxruntime as ort  # noqa: E402
from test_lora import FAMILIES, LEVELS, Logits, _torch_name  # noqa: E402

import normgrad.torch  # noqa: E402
from normgrad import train  # noqa: E402
from normgrad.graphs import build_step_graph, build_training_graph  # noqa: E402
from normgrad.graphs.rewrites import bfloat16_values  # noqa: E402

TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_proj", "c_fc"]}
STEPS, LR, WEIGHT_DECAY = 10, 1e-3, 0.01


def _peft(family, dtype):
    """The same random peft model each call (random B, so that every adapter has a gradient),
    the base in ``dtype``, the adapters float32 (peft's choice) or float64 with the base."""
    torch.manual_seed(0)
    base, _ = FAMILIES[family]()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[family], init_lora_weights=False,
                             fan_in_fan_out=family == "gpt2")
    model = peft.get_peft_model(base.to(dtype), config)
    return model.double() if dtype == torch.float64 else model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def exported(request, tmp_path_factory):
    """(family, peft model with a bfloat16 base, its training graph, batch)."""
    family = request.param
    model = _peft(family, torch.bfloat16)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 64, (2, 8), generator=generator)
    labels = input_ids.clone()
    labels[0, :3] = -100
    forward = normgrad.torch.export(Logits(model), (input_ids,), tmp_path_factory.mktemp(family) / "forward.onnx",
                                    exporter="dynamo", input_names=["input_ids"], output_names=["logits"])
    return dict(family=family, model=model, training=build_training_graph(forward, loss="causal_lm"),
                batch={"input_ids": input_ids.numpy(), "labels": labels.numpy()})


def _base_weights(model: onnx.ModelProto) -> dict:
    return {t.name: t for t in model.graph.initializer if ".lora_" not in t.name and t.data_type == onnx.TensorProto.BFLOAT16}


def test_bfloat16_base_gradients(exported):
    """The adapter gradients are as close to float64 autograd (the same weights upcast) as
    torch's own, computed through the bfloat16 base; the base weights stay bfloat16
    initializers. The logits, bfloat16 in torch, are float32 (onnxruntime's Python API
    returns no bfloat16 arrays)."""
    model, training, batch = exported["model"], exported["training"], exported["batch"]
    assert {o.name: o.type.tensor_type.elem_type for o in training.graph.output}["logits"] == onnx.TensorProto.FLOAT
    assert len(_base_weights(training)) >= 2 * len(TARGETS[exported["family"]])
    gradient_of = json.loads({p.key: p.value for p in training.metadata_props}["normgrad.gradients"])
    session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip(gradient_of, session.run(list(gradient_of), batch)))
    tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
    model.zero_grad()
    model(**tensors, use_cache=False).loss.backward()
    model64 = _peft(exported["family"], torch.float64)
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    model64(**tensors, use_cache=False).loss.backward()
    bf16, exact = dict(model.named_parameters()), dict(model64.named_parameters())
    for grad_name, name in gradient_of.items():
        truth = exact[_torch_name(name)].grad.numpy()
        torch_error = float(np.abs(bf16[_torch_name(name)].grad.numpy() - truth).max())
        error = float(np.abs(got[grad_name] - truth).max())
        assert error <= torch_error, f"{name}: {error:.3g} vs torch bfloat16's {torch_error:.3g}"


def _adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY)


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_bfloat16_base_steps_match_torch(exported, level):
    """STEPS AdamW steps through the Trainer against torch + peft in the same dtypes and in
    float64. normgrad computes the bfloat16 layers in float32, torch rounds each result to
    bfloat16, so the two differ by about torch's own distance from the exact (float64)
    trajectory: each adapter's update must be at least as close to float64's as torch's
    bfloat16 one is (with 1e-3 of the update for float32 rounding), which bounds its distance
    from torch's by twice that. The base stays bitwise the torch base, in bfloat16."""
    model, batch = _peft(exported["family"], torch.bfloat16), exported["batch"]  # untrained by the other tests
    step, initial = build_step_graph(exported["training"], "adamw", weight_decay=WEIGHT_DECAY)
    base = _base_weights(step)
    named = {f"model.{n}": p.detach() for n, p in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]}
    for name, tensor in base.items():
        assert np.array_equal(bfloat16_values(tensor), named[name].float().numpy()), name
    assert {v.dtype for v in initial.values()} == {np.dtype(np.float32)}
    start = {name: value.copy() for name, value in initial.items() if name in named}
    assert start and all(".lora_" in name and np.array_equal(named[name].numpy(), value) for name, value in start.items())
    options = ort.SessionOptions()
    if LEVELS[level] is not None:
        options.graph_optimization_level = LEVELS[level]
    trainer = train.Trainer(step, initial, lr=LR, session_options=options)
    model64 = _peft(exported["family"], torch.float64)
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    models = {"bfloat16": model, "float64": model64}
    optimizers = {key: _adamw(m) for key, m in models.items()}
    tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
    for _ in range(STEPS):
        trainer.step(**batch)
        for key, m in models.items():
            optimizers[key].zero_grad()
            m(**tensors, use_cache=False).loss.backward()
            optimizers[key].step()
    state = trainer.state_dict()
    for name, before in start.items():
        torch_update = named[name].float().numpy() - before
        exact_update = dict(model64.named_parameters())[_torch_name(name)].detach().numpy() - before
        torch_error = float(np.abs(torch_update - exact_update).max())
        error = float(np.abs((state[name] - before) - exact_update).max())
        assert error <= torch_error + 1e-3 * float(np.abs(exact_update).max()), \
            f"{name}: update off float64's by {error:.3g}, torch bfloat16's by {torch_error:.3g}"
        assert np.abs(torch_update).max() > 0.5 * STEPS * LR  # the adapters moved
    for name, tensor in _base_weights(step).items():
        assert np.array_equal(bfloat16_values(tensor), named[name].float().numpy()), name


def test_trainer_keeps_the_base_bfloat16(exported):
    """onnxruntime's constant folding turns each Cast of a bfloat16 initializer into a float32
    initializer (twice the base's memory in the session); the Trainer turns it off for such
    models, so that the graph onnxruntime runs holds the base as bfloat16 and no float32
    weight but the adapters'."""
    step, initial = build_step_graph(exported["training"], "adamw")
    base = sum(int(np.prod(t.dims)) for t in _base_weights(step).values())
    adapters = sum(v.size for name, v in initial.items() if ".lora_" in name and not name.endswith(("exp_avg", "exp_avg_sq")))

    def running_elements(options):
        _, running = train._session_and_running_graph(ort, step, options, ["CPUExecutionProvider"])
        counted = {}
        for tensor in running.graph.initializer:
            if tensor.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.BFLOAT16):
                counted[tensor.data_type] = counted.get(tensor.data_type, 0) + int(np.prod(tensor.dims))
        return counted.get(onnx.TensorProto.BFLOAT16, 0), counted.get(onnx.TensorProto.FLOAT, 0)

    folded_bf16, folded_f32 = running_elements(ort.SessionOptions())
    assert folded_f32 >= base - folded_bf16  # by default: a float32 copy of every base weight a Gather does not read
    options = ort.SessionOptions()
    train.Trainer(step, initial, session_options=options)  # sets the options it creates its sessions with
    kept_bf16, kept_f32 = running_elements(options)
    assert kept_bf16 == base and kept_f32 <= adapters, (kept_bf16, base, kept_f32, adapters)
