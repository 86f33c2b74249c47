"""onnxruntime-genai's int4 Llama trains: its KV cache dropped (input_ids, attention_mask and
labels are the data), MatMulNBits / GroupQueryAttention / SimplifiedLayerNormalization
differentiated; the step-0 loss is onnxruntime's inference loss, the gradients a directional
finite difference's, and ``normgrad export`` + ``normgrad train`` run it; with LoRA adapters,
onnxruntime-genai generates with the trained adapter file what onnxruntime's logits give."""

from __future__ import annotations

import csv
import os

import numpy as np
import onnx
import pytest

from normgrad.graphs import build_training_graph
from normgrad.tools import cli

from _genai_models import VOCABULARY, build_tiny_llama, causal_lm_loss

pytestmark = pytest.mark.slow
pytest.importorskip("onnxruntime_genai")
pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def genai_llama(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("genai_llama"))


def _batch(seed=0, batch=2, length=12):
    ids = np.random.default_rng(seed).integers(0, VOCABULARY, (batch, length)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, -3:] = 0  # right padding, as onnxruntime-genai pads a prompt batch
    labels = np.where(mask == 1, ids, -100)
    return {"input_ids": ids, "attention_mask": mask}, labels


def _inference_loss(model_path, model, data, labels):
    """The loss of onnxruntime running the model as genai does: an empty past, the logits."""
    session = ort.InferenceSession(model.SerializeToString() if model is not None else str(model_path),
                                   providers=["CPUExecutionProvider"])
    feeds = dict(data)
    for info in session.get_inputs():
        if info.name.startswith("past_key_values."):
            feeds[info.name] = np.zeros((labels.shape[0], 2, 0, 16), np.float32)
    return causal_lm_loss(session.run(["logits"], feeds)[0], labels)


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
    model = onnx.load(genai_llama)
    for node in model.graph.node:
        for attribute in node.attribute:
            if node.op_type == "MatMulNBits" and attribute.name == "accuracy_level":
                attribute.i = 0
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
