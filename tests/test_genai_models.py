"""onnxruntime-genai's int4 Llama trains: its KV cache dropped (input_ids, attention_mask and
labels are the data), MatMulNBits / GroupQueryAttention / SimplifiedLayerNormalization
differentiated; the step-0 loss is onnxruntime's inference loss, the gradients a directional
finite difference's, and ``normgrad export`` + ``normgrad train`` run it; with LoRA adapters,
onnxruntime-genai generates with the trained adapter file what onnxruntime's logits give."""

from __future__ import annotations

import csv
import json
import os
import re
from typing import NamedTuple

import numpy as np
import onnx
import pytest

from normgrad.graphs import build_training_graph
from normgrad import lora
from normgrad.tools import cli

from _quantized_models import dequantize_matmul_nbits
from _genai_models import ARCHITECTURES, VOCABULARY, build_tiny_genai, causal_lm_loss

pytestmark = pytest.mark.slow
pytest.importorskip("onnxruntime_genai")
pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def genai_builds(tmp_path_factory):
    """``build(architecture)``: the int4 genai build of that tiny model, built once per module."""
    built = {}

    def build(architecture):
        if architecture not in built:
            built[architecture] = build_tiny_genai(tmp_path_factory.mktemp(f"genai_{architecture}"), architecture)
        return built[architecture]

    return build


@pytest.fixture(scope="module")
def genai_llama(genai_builds):
    return genai_builds("llama")


def _batch(seed=0, batch=2, length=12):
    ids = np.random.default_rng(seed).integers(0, VOCABULARY, (batch, length)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, -3:] = 0  # right padding, as onnxruntime-genai pads a prompt batch
    labels = np.where(mask == 1, ids, -100)
    return {"input_ids": ids, "attention_mask": mask}, labels


def _logits(model_path, model, data, options=None):
    """The logits of onnxruntime running the model as genai does (an empty past)."""
    session = ort.InferenceSession(model.SerializeToString() if model is not None else str(model_path),
                                   providers=["CPUExecutionProvider"])
    feeds = dict(data)
    for info in session.get_inputs():
        if info.name.startswith("past_key_values."):
            feeds[info.name] = np.zeros((len(data["input_ids"]), 2, 0, 16), np.float32)
    return session.run(["logits"], feeds, options)[0]


def _inference_loss(model_path, model, data, labels):
    """The loss of onnxruntime running the model as genai does: an empty past, the logits."""
    return causal_lm_loss(_logits(model_path, model, data), labels)


def _float_math(model):
    """``model`` with onnxruntime's float MatMulNBits (accuracy_level 0: the default level 4 rounds
    the activations to int8)."""
    for node in model.graph.node:
        for attribute in node.attribute:
            if node.op_type == "MatMulNBits" and attribute.name == "accuracy_level":
                attribute.i = 0
    return model


def test_step_zero_loss_is_onnxruntimes_and_the_cache_is_gone(genai_llama):
    model = onnx.load(genai_llama)
    training = build_training_graph(model, loss="causal_lm")
    data_inputs = [i.name for i in training.model.graph.input if i.name not in training.weights]
    assert data_inputs == ["input_ids", "attention_mask", "labels"]
    assert not any(o.name.startswith("present.") for o in training.model.graph.output)
    assert not any(name.startswith(("cos_cache", "sin_cache")) or "Q4" in name for name in training.weights)
    data, labels = _batch()
    session = ort.InferenceSession(training.model.SerializeToString(), providers=["CPUExecutionProvider"])
    loss = session.run(["loss"], {**data, "labels": labels, **training.weights})[0]
    assert float(loss) == pytest.approx(_inference_loss(genai_llama, None, data, labels), rel=1e-5, abs=1e-5)


def test_gradients_match_a_directional_finite_difference(genai_llama):
    """With onnxruntime's float MatMulNBits (accuracy_level 0: the default level 4 rounds the
    activations to int8, which a finite difference would see as steps)."""
    model = _float_math(onnx.load(genai_llama))
    training = build_training_graph(model, loss="causal_lm")
    data, labels = _batch(1)
    session = ort.InferenceSession(training.model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(None, {**data, "labels": labels, **training.weights})))
    rng = np.random.default_rng(2)
    directions = {n: rng.standard_normal(w.shape) * np.sqrt(np.mean(w.astype(np.float64) ** 2))
                  for n, w in training.weights.items()}
    h = 1e-3

    def loss(sign):
        shifted = onnx.ModelProto.FromString(model.SerializeToString())
        for tensor in shifted.graph.initializer:
            if tensor.name in directions:
                value = training.weights[tensor.name] + sign * h * directions[tensor.name]
                tensor.CopyFrom(onnx.numpy_helper.from_array(value.astype(np.float32), tensor.name))
        return _inference_loss(None, shifted, data, labels)

    slope = (loss(1) - loss(-1)) / (2 * h)
    predicted = sum(float((outputs[f"{n}_grad"].astype(np.float64) * d).sum()) for n, d in directions.items())
    assert slope == pytest.approx(predicted, rel=2e-3)


def test_export_and_train_from_the_command_line(genai_llama, tmp_path, capsys):
    step = tmp_path / "step.onnx"
    assert cli.main(["export", os.fspath(genai_llama), "-o", os.fspath(step), "--loss", "causal_lm",
                     "--optimizer", "adamw"]) == 0
    data, labels = _batch(3, batch=4)
    np.savez(tmp_path / "tokens.npz", **data, labels=labels)
    assert cli.main(["train", os.fspath(step), "--data", os.fspath(tmp_path / "tokens.npz"), "--epochs", "3",
                     "--batch-size", "2", "--out", os.fspath(tmp_path / "run"), "--no-progress", "--lr", "0.01"]) == 0
    with open(tmp_path / "run" / "metrics.csv") as metrics:
        losses = [float(row["train_loss"]) for row in csv.DictReader(metrics) if row["train_loss"]]
    assert len(losses) == 3 and losses[-1] < losses[0], losses


def test_nothing_to_train_is_one_line(genai_llama, tmp_path, capsys):
    assert cli.main(["export", os.fspath(genai_llama), "-o", os.fspath(tmp_path / "step.onnx"), "--loss", "causal_lm",
                     "--optimizer", "adamw", "--freeze", "*"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "no trainable tensor" in error and "MatMulNBits" in error, error
    assert not os.listdir(tmp_path)


RANK, ALPHA = 4, 8
_NODE = re.compile(r"/model/layers\.(\d+)/(attn|mlp)/(\w+)/MatMul_Q4|/lm_head/MatMul_Q4")


class _Part(NamedTuple):
    """Where part of an adapted genai layer is in the transformers model: rows ``rows`` of the
    genai layer's output are rows ``module_rows`` of ``module``'s, through its ranks ``ranks``."""

    module: str
    rows: slice
    module_rows: slice
    ranks: slice


def _hf_parts(architecture, node_name, q_size=64, kv_size=32, intermediate=96):
    """The transformers modules an adapted genai layer stands for, written out per architecture:
    the builder fuses Llama's and Qwen2's q/k/v into one qkv_proj (peft: q/k/v_proj, each with
    the fused A and its rows of B) and splits Phi-3's gate_up_proj into gate_proj and up_proj
    (peft: gate_up_proj of rank 2r, A stacked, B block-diagonal)."""
    match = _NODE.fullmatch(node_name)
    assert match, f"adapter of {node_name!r} has no transformers module"
    everything, first, second = slice(None), slice(0, RANK), slice(RANK, 2 * RANK)
    if match.group(1) is None:
        return [_Part("lm_head", everything, everything, everything)]
    layer, block, projection = match.groups()
    prefix = f"model.layers.{layer}.{'self_attn' if block == 'attn' else 'mlp'}"
    if projection == "qkv_proj" and architecture != "phi3":
        ends = np.cumsum([0, q_size, kv_size, kv_size])
        return [_Part(f"{prefix}.{name}", slice(ends[i], ends[i + 1]), everything, everything)
                for i, name in enumerate(["q_proj", "k_proj", "v_proj"])]
    if projection in ("gate_proj", "up_proj") and architecture == "phi3":
        up = projection == "up_proj"
        return [_Part(f"{prefix}.gate_up_proj", everything, slice(intermediate * up, intermediate * (up + 1)),
                      second if up else first)]
    return [_Part(f"{prefix}.{projection}", everything, everything, everything)]


def _dequantized_hf_model(hf_folder, architecture, model):
    """The transformers model of ``hf_folder`` in float64 with each weight the genai build
    ``model`` quantized replaced by its dequantized int4 one; and {node: its parts}."""
    import torch
    import transformers

    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float64,
                                                                 attn_implementation="eager")
    parts = {}
    with torch.no_grad():
        for node in model.graph.node:
            if node.op_type == "MatMulNBits":
                weight = dequantize_matmul_nbits(node, initializers)
                parts[node.name] = _hf_parts(architecture, node.name)
                for part in parts[node.name]:
                    hf_model.get_submodule(part.module).weight[part.module_rows] = torch.from_numpy(weight[part.rows])
    return hf_model, parts


def _torch_peft_model(hf_model, parts, layers, adapters):
    """peft's LoRA on the modules of ``hf_model`` the adapted ``layers`` stand for, holding ``adapters``."""
    import torch
    from peft import LoraConfig, get_peft_model

    modules = sorted({part.module for layer in layers for part in parts[layer.node]})
    ranks = {part.module: 2 * RANK for layer in layers for part in parts[layer.node] if part.ranks.start == RANK}
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=modules, lora_dropout=0.0, rank_pattern=ranks,
                        alpha_pattern={m: ALPHA * r // RANK for m, r in ranks.items()})
    peft_model = get_peft_model(hf_model, config)
    with torch.no_grad():
        for name in modules:
            module = peft_model.base_model.model.get_submodule(name)
            module.lora_A["default"].weight.zero_()
            module.lora_B["default"].weight.zero_()
        for layer in layers:
            for part in parts[layer.node]:
                module = peft_model.base_model.model.get_submodule(part.module)
                module.lora_A["default"].weight[part.ranks] = torch.from_numpy(adapters[layer.A].astype(np.float64))
                module.lora_B["default"].weight[part.module_rows, part.ranks] = torch.from_numpy(
                    adapters[layer.B][part.rows].astype(np.float64))
    return peft_model


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_lora_gradients_match_torch_and_peft(genai_builds, architecture):
    """LoRA (rank 4, alpha 8) on every MatMulNBits of a genai int4 build: the loss and every
    adapter's A and B gradient within 1e-4 of its scale of torch float64 + peft on the
    transformers model whose linear weights are the dequantized int4 ones."""
    pytest.importorskip("peft")
    import torch
    from _torch_models import run_training_graph

    path = genai_builds(architecture)
    model = _float_math(onnx.load(path))
    hf_model, parts = _dequantized_hf_model(path.parent.parent / "hf", architecture, model)
    training = build_training_graph(lora.add_adapters(model, targets="*", rank=RANK, alpha=ALPHA), loss="causal_lm")
    layers = lora.lora_layers(training.model)["layers"]
    assert sorted(layer.node for layer in layers) == sorted(parts)
    rng = np.random.default_rng(5)
    adapters = {name: (value if ".lora_A" in name else rng.standard_normal(value.shape).astype(np.float32) * 0.05)
                for name, value in training.weights.items()}
    data, labels = _batch(4)
    outputs = run_training_graph(training._replace(weights=adapters), {**data, "labels": labels})
    peft_model = _torch_peft_model(hf_model, parts, layers, adapters)
    loss = peft_model(**{k: torch.from_numpy(v) for k, v in data.items()}, labels=torch.from_numpy(labels)).loss
    loss.backward()
    assert float(outputs["loss"]) == pytest.approx(loss.item(), rel=1e-5)
    lora_modules = peft_model.base_model.model
    for layer in layers:
        grad_a = sum(lora_modules.get_submodule(part.module).lora_A["default"].weight.grad[part.ranks].numpy()
                     for part in parts[layer.node])
        grad_b = np.concatenate([lora_modules.get_submodule(part.module).lora_B["default"].weight.grad[
            part.module_rows, part.ranks].numpy() for part in parts[layer.node]])
        for name, expected in ((layer.A, grad_a), (layer.B, grad_b)):
            error = np.abs(outputs[f"{name}_grad"] - expected).max()
            assert error <= 1e-4 * np.abs(expected).max(), (name, error, np.abs(expected).max())


def _export_and_train(model_path, folder, *lora_options):
    """``normgrad export --lora-*`` then ``normgrad train`` (2 epochs of 2 batches); the checkpoint folder."""
    step = folder / "step.onnx"
    assert cli.main(["export", os.fspath(model_path), "-o", os.fspath(step), "--loss", "causal_lm", "--optimizer",
                     "adamw", "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), *lora_options]) == 0
    data, labels = _batch(6, batch=4)
    np.savez(folder / "tokens.npz", **data, labels=labels)
    assert cli.main(["train", os.fspath(step), "--data", os.fspath(folder / "tokens.npz"), "--epochs", "2",
                     "--batch-size", "2", "--out", os.fspath(folder / "run"), "--no-progress", "--lr", "0.01"]) == 0
    return folder / "run" / "checkpoints"


def test_train_writes_peft_files_that_peft_loads(genai_llama, tmp_path, capsys):
    """The peft pair ``normgrad train`` writes for a genai Llama (its fused qkv_proj adapter as
    peft's q/k/v_proj): the PeftModel on the dequantized base gives onnxruntime's logits of the
    deployable model with the trained adapter file active (1e-4 of their scale)."""
    peft = pytest.importorskip("peft")
    import torch

    folder = _export_and_train(genai_llama, tmp_path, "--lora-targets", "*")
    assert "no peft adapter" not in capsys.readouterr().err
    written = json.loads((folder / "peft_adapter" / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"]) == (RANK, ALPHA)
    assert {"model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"} <= set(written["target_modules"])
    deployable = _float_math(onnx.load(folder / "adapter_model.onnx"))
    hf_model, _ = _dequantized_hf_model(genai_llama.parent.parent / "hf", "llama", deployable)
    peft_model = peft.PeftModel.from_pretrained(hf_model, folder / "peft_adapter")
    data, _ = _batch(7)
    with torch.no_grad():
        expected = peft_model(**{k: torch.from_numpy(v) for k, v in data.items()}).logits.numpy()
    options = ort.RunOptions()
    adapter = ort.LoraAdapter()
    adapter.Load(str(folder / "adapter.onnx_adapter"))
    options.add_active_adapter(adapter)
    tuned, base = _logits(None, deployable, data, options), _logits(None, deployable, data)
    kept = data["attention_mask"] == 1  # the padded positions' logits differ (genai masks them as padding)
    scale = np.abs(expected[kept]).max()
    assert np.abs(tuned[kept] - expected[kept]).max() <= 1e-4 * scale
    assert np.abs(base[kept] - expected[kept]).max() > 1e-2 * scale  # the adapter is in the comparison


def test_train_writes_no_peft_files_where_the_names_do_not_map(genai_builds, tmp_path, capsys):
    """Phi-3's gate_up_proj, which the genai builder splits into gate_proj and up_proj, has no
    peft adapter for two: one line says so and no peft file is written."""
    folder = _export_and_train(genai_builds("phi3"), tmp_path, "--lora-targets", "*mlp/*")
    lines = [line for line in capsys.readouterr().err.splitlines() if "peft" in line]
    assert len(lines) == 1 and "no peft adapter written" in lines[0] and "gate_up_proj" in lines[0], lines
    assert (folder / "adapter.onnx_adapter").exists() and not (folder / "peft_adapter").exists()


def test_lora_from_the_command_line_starts_at_onnxruntimes_loss(genai_llama, tmp_path):
    """``--lora-*`` on the builder's files (packed weights left in its external data), trained by
    ``normgrad train`` with the Trainer's default session options: the first step's loss is
    onnxruntime's inference loss (MatMulNBits computing as in inference, int8 activations
    included), and the adapter file on the adapter model gives the trained model's logits."""
    step = tmp_path / "step" / "step.onnx"
    step.parent.mkdir()
    assert cli.main(["export", os.fspath(genai_llama), "-o", os.fspath(step), "--loss", "causal_lm", "--optimizer",
                     "adamw", "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "*"]) == 0
    data, labels = _batch(4, batch=2)
    np.savez(tmp_path / "tokens.npz", **data, labels=labels)
    run = tmp_path / "run"
    assert cli.main(["train", os.fspath(step), "--data", os.fspath(tmp_path / "tokens.npz"), "--epochs", "2",
                     "--batch-size", "2", "--out", os.fspath(run), "--no-progress", "--lr", "0.01"]) == 0
    with open(run / "metrics.csv") as metrics:
        losses = [float(row["train_loss"]) for row in csv.DictReader(metrics) if row["train_loss"]]
    assert losses[0] == pytest.approx(_inference_loss(genai_llama, None, data, labels), rel=1e-6, abs=1e-6)
    trained = ort.InferenceSession(os.fspath(run / "inference.onnx"), providers=["CPUExecutionProvider"])
    adapted = ort.InferenceSession(os.fspath(run / "checkpoints" / "adapter_model.onnx"),
                                   providers=["CPUExecutionProvider"])
    adapter = ort.LoraAdapter()
    adapter.Load(os.fspath(run / "checkpoints" / "adapter.onnx_adapter"))
    options = ort.RunOptions()
    options.add_active_adapter(adapter)
    feeds = dict(data)
    for info in adapted.get_inputs():
        if info.name.startswith("past_key_values."):
            feeds[info.name] = np.zeros((labels.shape[0], 2, 0, 16), np.float32)
    expected = trained.run(["logits"], data)[0]
    np.testing.assert_allclose(adapted.run(["logits"], feeds, options)[0], expected, rtol=0, atol=1e-5)
    assert np.abs(adapted.run(["logits"], feeds)[0] - expected).max() > 1e-3  # the adapters moved the logits


EOS = 2  # build_tiny_llama's eos token: onnxruntime-genai stops there


def _with_adapter(path):
    """onnxruntime RunOptions with the adapter file at ``path`` active, and the adapter: the
    options do not keep it alive (a run after it is freed fails with std::bad_alloc)."""
    options = ort.RunOptions()
    adapter = ort.LoraAdapter()
    adapter.Load(str(path))
    options.add_active_adapter(adapter)
    return options, adapter


def _greedy_onnxruntime(model_path, prompt, new_tokens, options=None):
    """Greedy decoding by hand in onnxruntime: the whole sequence each step (an empty past),
    the argmax of the last position's logits, up to and including EOS."""
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    pasts = {i.name: np.zeros((1, 2, 0, 16), np.float32) for i in session.get_inputs()
             if i.name.startswith("past_key_values.")}
    tokens = list(prompt)
    for _ in range(new_tokens):
        ids = np.array([tokens], np.int64)
        logits = session.run(["logits"], {"input_ids": ids, "attention_mask": np.ones_like(ids), **pasts}, options)[0]
        tokens.append(int(logits[0, -1].argmax()))
        if tokens[-1] == EOS:
            break
    return tokens


def _greedy_genai(folder, prompt, new_tokens, adapter_file=None):
    """onnxruntime-genai's greedy search (its KV cache), with the adapter file active if given."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + new_tokens)
    generator = og.Generator(model, params)
    if adapter_file is not None:
        adapters = og.Adapters(model)
        adapters.load(str(adapter_file), "trained")
        generator.set_active_adapter(adapters, "trained")
    generator.append_tokens(np.array(prompt, np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)]


def test_genai_generates_with_the_trained_adapter_as_onnxruntime_does(genai_llama, tmp_path):
    """LoRA on every layer of the int4 Llama, trained 3 AdamW steps; the deployable model
    written as the genai folder's model.onnx (a copy). onnxruntime-genai with the adapter file
    active generates, greedy, the tokens of argmax over onnxruntime's logits of that model with
    the adapter (LoraAdapter + RunOptions); with none active, the base model's."""
    import shutil

    from normgrad import lora
    from normgrad.graphs import build_step_graph
    from normgrad.train import Trainer

    adapted = lora.add_adapters(onnx.load(genai_llama), ["*"], rank=8, alpha=16)
    step, initial = build_step_graph(build_training_graph(adapted, loss="causal_lm"), "adamw")
    trainer = Trainer(step, initial, lr=2e-2)
    data, labels = _batch(4, batch=4)
    for _ in range(3):
        trainer.step(**data, labels=labels)
    adapter_file = lora.save_onnx_adapter(tmp_path / "trained.onnx_adapter", step, trainer.state_dict())
    folder = tmp_path / "genai_lora"
    shutil.copytree(genai_llama.parent, folder, ignore=shutil.ignore_patterns("model.onnx*"))
    onnx.save_model(lora.adapter_model(step, genai_llama), folder / "model.onnx", save_as_external_data=True,
                    location="model.onnx.data")
    options, _adapter = _with_adapter(adapter_file)
    prompt, new_tokens = [int(t) for t in data["input_ids"][0, :5]], 6
    tuned = _greedy_onnxruntime(folder / "model.onnx", prompt, new_tokens, options)
    base = _greedy_onnxruntime(genai_llama, prompt, new_tokens)
    assert tuned != base  # the adapter changes what is generated
    assert _greedy_genai(folder, prompt, new_tokens, adapter_file) == tuned
    assert _greedy_genai(folder, prompt, new_tokens) == base
