"""LoRA over a frozen bfloat16 base (peft keeps the adapters float32) on onnxruntime's CPU
provider, which has no bfloat16 arithmetic kernels: the training graph computes in float32
from the base weights stored as bfloat16 (normgrad.graphs.rewrites.bfloat16_in_float32), and
the Trainer keeps onnxruntime from folding them into float32 copies. Against float64 NumPy
(a small hand-written graph, without torch), torch autograd in float64 and torch + peft in
the same dtypes. Random tiny models, nothing downloaded."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest

from normgrad import _session, train
from normgrad.graphs import build_step_graph, build_training_graph, optimizers, step_graph
from normgrad.graphs.rewrites import bfloat16_values

HAVE_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft", "safetensors", "onnxscript"))
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="needs torch, transformers, peft, safetensors and onnxscript")
if HAVE_TORCH:
    import peft
    import torch
    from _lora_models import FAMILIES, _torch_name

    import normgrad.torch
else:
    FAMILIES = {"llama": None, "gpt2": None}
LEVELS = {"disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "default": None}
BF16 = onnx.TensorProto.BFLOAT16


def _bfloat16(values: np.ndarray, name: str) -> onnx.TensorProto:
    """A bfloat16 initializer of float32 values that bfloat16 holds exactly."""
    bits = np.asarray(values, np.float32).reshape(-1).view(np.uint32) >> 16
    assert np.array_equal((bits << 16).view(np.float32), np.reshape(values, -1))
    return oh.make_tensor(name, BF16, values.shape, bits.astype(np.uint16).tobytes(), raw=True)


def _small_model():
    """out = (Cast(x, bfloat16) + E[ids]) @ W * 0.5 -> float32 @ A, everything before A
    computed in bfloat16 as exported; E and W frozen bfloat16, A trainable float32."""
    rng = np.random.default_rng(0)
    weights = {name: (rng.standard_normal(shape) * 4).round() / 8 for name, shape in (("E", (5, 3)), ("W", (3, 4)))}
    weights["A"] = rng.standard_normal((4, 2))
    nodes = [
        oh.make_node("Gather", ["E", "ids"], ["rows"]),
        oh.make_node("Cast", ["x"], ["x16"], to=BF16),
        oh.make_node("Add", ["x16", "rows"], ["s"]),
        oh.make_node("MatMul", ["s", "W"], ["y"]),
        oh.make_node("Constant", [], ["half"], value=_bfloat16(np.array(0.5, np.float32), "half")),
        oh.make_node("Mul", ["y", "half"], ["y2"]),
        oh.make_node("Cast", ["y2"], ["z"], to=onnx.TensorProto.FLOAT),
        oh.make_node("MatMul", ["z", "A"], ["out"]),
    ]
    graph = oh.make_graph(
        nodes, "bf16", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3]),
                        oh.make_tensor_value_info("ids", onnx.TensorProto.INT64, [2])],
        [oh.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [2, 2])],
        [_bfloat16(weights["E"].astype(np.float32), "E"), _bfloat16(weights["W"].astype(np.float32), "W"),
         onh.from_array(weights["A"].astype(np.float32), "A")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    return model, weights


def _gradients(training, feeds: dict) -> tuple:
    """(loss, {parameter: gradient}, step graph, its initial state) of one batch, from the gradient half of the
    step graph of ``training`` (what build_training_graph returned)."""
    step, initial = build_step_graph(training, "sgd")
    gradient = step_graph.build_gradient_graph(step)
    parameters = json.loads({p.key: p.value for p in gradient.metadata_props}["normgrad.parameters"])
    sums = [p + step_graph.ACCUMULATOR_SUFFIX for p in parameters]
    feeds = {**feeds, **initial, "grad_scale": np.array(1, np.float32), **{s: np.zeros_like(initial[p]) for s, p in zip(sums, parameters)}}
    session = ort.InferenceSession(gradient.SerializeToString(), providers=["CPUExecutionProvider"])
    read = {i.name for i in gradient.graph.input}
    loss, *values = session.run(["loss"] + [optimizers.next_name(s) for s in sums], {k: v for k, v in feeds.items() if k in read})
    return loss, dict(zip(parameters, values)), step, initial


def test_bfloat16_graph_gradients_in_float32():
    """Frozen bfloat16 initializers stay bfloat16 in the step graph, which onnxruntime's CPU
    provider runs; the loss and the gradient of A are float64 NumPy's (with x not rounded to
    bfloat16: the arithmetic is float32) within float32 rounding."""
    model, weights = _small_model()
    x = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    ids, labels = np.array([3, 1]), np.random.default_rng(2).standard_normal((2, 2)).astype(np.float32)
    loss, gradients, step, _ = _gradients(build_training_graph(model, loss="mse", frozen=["E", "W"]),
                                       {"x": x, "ids": ids, "labels": labels})
    assert {t.name: t.data_type for t in step.graph.initializer if t.name in "EW"} == {"E": BF16, "W": BF16}
    z = (x.astype(np.float64) + weights["E"][ids]) @ weights["W"] * 0.5
    out = z @ weights["A"].astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(loss, np.mean((out - labels) ** 2), rtol=1e-5)
    np.testing.assert_allclose(gradients["A"], z.T @ (2 * (out - labels) / out.size), rtol=1e-5, atol=1e-6)


def _running_weights(step: onnx.ModelProto, options) -> dict:
    """{element type: elements} of the float initializers of the graph onnxruntime runs."""
    _, running = _session._session_and_running_graph(ort, step, options, ["CPUExecutionProvider"])
    counted = {onnx.TensorProto.FLOAT: 0, BF16: 0}
    for tensor in running.graph.initializer:
        if tensor.data_type in counted:
            counted[tensor.data_type] += int(np.prod(tensor.dims))
    return counted


def _check_trainer_keeps_bfloat16(step: onnx.ModelProto, initial: dict, base: int) -> None:
    """By default onnxruntime folds each Cast of a bfloat16 initializer into a float32 one
    (but a table a Gather reads); with the options the Trainer sets, the graph it runs holds
    the ``base`` elements as bfloat16 and no float32 weight but the adapters (state)."""
    adapters = sum(v.size for name, v in initial.items() if name in json.loads(
        {p.key: p.value for p in step.metadata_props}["normgrad.parameters"]))
    folded = _running_weights(step, ort.SessionOptions())
    assert folded[onnx.TensorProto.FLOAT] >= base - folded[BF16]
    options = ort.SessionOptions()
    train.Trainer(step, initial, session_options=options)  # sets the options it creates its sessions with
    kept = _running_weights(step, options)
    assert kept[BF16] == base and kept[onnx.TensorProto.FLOAT] <= adapters, (kept, base, adapters)


def test_trainer_keeps_a_small_graph_bfloat16():
    model, _ = _small_model()
    step, initial = build_step_graph(build_training_graph(model, loss="mse", frozen=["E", "W"]), "adamw")
    _check_trainer_keeps_bfloat16(step, initial, base=5 * 3 + 3 * 4)


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
    """(family, peft model with a bfloat16 base, build_training_graph's result, batch)."""
    family = request.param
    model = _peft(family, torch.bfloat16)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 64, (2, 8), generator=generator)
    labels = input_ids.clone()
    labels[0, :3] = -100
    forward = normgrad.torch.export(normgrad.torch.causal_lm_logits(model), (input_ids,), tmp_path_factory.mktemp(family) / "forward.onnx",
                                    exporter="dynamo", input_names=["input_ids"], output_names=["logits"])
    return dict(family=family, model=model, training=build_training_graph(forward, loss="causal_lm"),
                batch={"input_ids": input_ids.numpy(), "labels": labels.numpy()})


def _base_weights(model: onnx.ModelProto) -> dict:
    return {t.name: t for t in model.graph.initializer if ".lora_" not in t.name and t.data_type == onnx.TensorProto.BFLOAT16}


@needs_torch
def test_bfloat16_base_gradients(exported):
    """The adapter gradients are as close to float64 autograd (the same weights upcast) as
    torch's own, computed through the bfloat16 base; the base weights stay bfloat16
    initializers. The logits, bfloat16 in torch, are float32 (onnxruntime's Python API
    returns no bfloat16 arrays)."""
    model, batch = exported["model"], exported["batch"]
    _, got, step, initial = _gradients(exported["training"], batch)
    inference = step_graph.build_inference_model(step, initial)
    assert {o.name: o.type.tensor_type.elem_type for o in inference.graph.output}["logits"] == onnx.TensorProto.FLOAT
    assert len(_base_weights(step)) >= 2 * len(TARGETS[exported["family"]])
    tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
    model.zero_grad()
    model(**tensors, use_cache=False).loss.backward()
    model64 = _peft(exported["family"], torch.float64)
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    model64(**tensors, use_cache=False).loss.backward()
    bf16, exact = dict(model.named_parameters()), dict(model64.named_parameters())
    assert got and all(".lora_" in name for name in got)
    for name, value in got.items():
        truth = exact[_torch_name(name)].grad.numpy()
        torch_error = float(np.abs(bf16[_torch_name(name)].grad.numpy() - truth).max())
        error = float(np.abs(value - truth).max())
        assert error <= torch_error, f"{name}: {error:.3g} vs torch bfloat16's {torch_error:.3g}"


def _adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY)


@pytest.mark.slow
@needs_torch
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
    values = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    named = {f"model.{n}": p.detach() for n, p in values}  # GPT-2's tied lm_head and Llama's inv_freq too
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


@needs_torch
def test_trainer_keeps_the_base_bfloat16(exported):
    """onnxruntime's constant folding turns each Cast of a bfloat16 initializer into a float32
    initializer (twice the base's memory in the session); the Trainer turns it off for such
    models, so that the graph onnxruntime runs holds the base as bfloat16."""
    step, initial = build_step_graph(exported["training"], "adamw")
    _check_trainer_keeps_bfloat16(step, initial, sum(int(np.prod(t.dims)) for t in _base_weights(step).values()))
