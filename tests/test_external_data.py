"""A frozen base in external data (the route for models past protobuf's 2 GiB limit), end to
end at a small size: a tiny peft LoRA Llama exported with ``external_data=True``, its step
graph written by ``normgrad export``, trained by the Trainer, its adapter saved and its
merged model written, all from a current folder that is not the model's. The graph files
keep the base out of their protobuf; the steps are bitwise those of the same model with
the base inline; the merged model gives peft's merged logits. The same without torch for a
plain ONNX model saved with external data (every onnxruntime)."""

from __future__ import annotations

import os
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import normgrad.util.external_data
from normgrad.util.external_data import EXTERNAL_TENSOR_MIN_BYTES, save_models_external, uses_external_data
from normgrad.train import Trainer, TrainerError

from _graph_models import two_layer_model
from _external_data_models import _torch, _write_step_graph

pytestmark = pytest.mark.slow

STEPS, LR = 3, 1e-3


def _data_file(folder, model_name: str) -> str:
    """The one external-data file of ``model_name`` in ``folder``: MODEL.HASH.data (named by
    its content, normgrad.util.files.stage_data_file)."""
    names = [n for n in os.listdir(folder) if re.fullmatch(re.escape(model_name) + r"\.[0-9a-f]{16}\.data", n)]
    assert len(names) == 1, (model_name, sorted(os.listdir(folder)))
    return names[0]


def _train(step_path, batch):
    trainer = Trainer(step_path, str(step_path).replace(".onnx", ".ckpt"), lr=LR)  # default session options
    return trainer, [trainer.step(**batch) for _ in range(STEPS)]


def _external(model: onnx.ModelProto):
    """{initializer name: (location, offset, length)} of the tensors in external data."""
    return {t.name: tuple({e.key: e.value for e in t.external_data}.get(k) for k in ("location", "offset", "length"))
            for t in model.graph.initializer if uses_external_data(t)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The peft model, its base state, the export with its base in external data, and the
    Trainer's losses and state on the same model exported with its base inline."""
    torch, lora_models = _torch()
    import normgrad.torch

    input_ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": input_ids.numpy(), "labels": input_ids.numpy()}
    model, base_state = lora_models._peft_model("llama")
    folder = tmp_path_factory.mktemp("model")
    forward = normgrad.torch.export(normgrad.torch.causal_lm_logits(model), (input_ids,), folder / "forward.onnx", exporter="dynamo",
                                    input_names=["input_ids"], output_names=["logits"], external_data=True)
    external = _external(forward)
    assert external and not [n for n in external if ".lora_" in n]
    inline = tmp_path_factory.mktemp("inline")
    onnx.save(onnx.load(folder / "forward.onnx"), inline / "forward.onnx")
    _write_step_graph(inline / "forward.onnx", inline / "step.onnx")
    trainer, losses = _train(inline / "step.onnx", batch)
    return dict(model=model, base_state=base_state, folder=folder, external=external, losses=losses, batch=batch,
                state=trainer.state_dict(), inline_size=os.path.getsize(inline / "step.onnx"))


@pytest.mark.parametrize("where", ["beside", "elsewhere"])
def test_step_graph_keeps_the_base_external(exported, tmp_path, monkeypatch, where):
    """normgrad export from another current folder: beside the forward model the step and
    evaluation graphs refer to its .data file; elsewhere both refer to one STEP.onnx.data
    copy (each tensor once). No base tensor is in the graphs' protobuf, and the Trainer's
    steps on the step graph (by path, from yet another folder) are bitwise those of the
    inline base."""
    monkeypatch.chdir(tmp_path)
    folder = exported["folder"] if where == "beside" else tmp_path / "out"
    folder.mkdir(exist_ok=True)
    step_path = folder / f"step_{where}.onnx"
    _write_step_graph(exported["folder"] / "forward.onnx", step_path)
    lengths = {name: int(length) for name, (_, _, length) in exported["external"].items()}
    for path in (step_path, folder / f"step_{where}.eval.onnx"):
        model = onnx.load(path, load_external_data=False)
        external = _external(model)
        assert sorted(external) == sorted(exported["external"]), path
        locations = {location for location, _, _ in external.values()}
        assert locations == {_data_file(folder, "forward.onnx" if where == "beside" else f"step_{where}.onnx")}
        big_inline = [t.name for t in model.graph.initializer
                      if not uses_external_data(t) and len(t.raw_data) >= EXTERNAL_TENSOR_MIN_BYTES and ".lora_" not in t.name]
        assert not big_inline, path
    if where == "elsewhere":
        assert os.path.getsize(folder / _data_file(folder, f"step_{where}.onnx")) == sum(lengths.values())
    assert os.path.getsize(step_path) < exported["inline_size"] - 0.9 * sum(lengths.values())
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    trainer, losses = _train(step_path, exported["batch"])
    assert losses == exported["losses"]
    state = trainer.state_dict()
    assert state.keys() == exported["state"].keys()
    for name in state:
        assert np.array_equal(state[name], exported["state"][name]), name


def test_adapter_and_merged_model(exported, tmp_path, monkeypatch):
    """save_adapter and export_merged_model of a step graph whose base is in external data,
    from another current folder: the merged model keeps its weights in merged.onnx.data and
    gives the logits of peft's merge_and_unload of the saved adapter within 1e-5."""
    torch, lora_models = _torch()
    import peft

    monkeypatch.chdir(tmp_path)
    step_path = tmp_path / "step.onnx"
    _write_step_graph(exported["folder"] / "forward.onnx", step_path)
    trainer, _ = _train(step_path, exported["batch"])
    trainer.save_adapter(tmp_path / "adapter")
    (tmp_path / "merged").mkdir()
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    trainer.export_merged_model(tmp_path / "merged" / "merged.onnx")
    assert sorted(os.listdir(tmp_path / "merged")) == ["merged.onnx", _data_file(tmp_path / "merged", "merged.onnx")]
    merged = onnx.load(tmp_path / "merged" / "merged.onnx", load_external_data=False)
    assert not [t.name for t in merged.graph.initializer
                if not uses_external_data(t) and len(t.raw_data) >= EXTERNAL_TENSOR_MIN_BYTES]
    assert {location for location, _, _ in _external(merged).values()} == {_data_file(tmp_path / "merged", "merged.onnx")}
    assert not [t.name for t in merged.graph.initializer if ".lora_" in t.name]
    session = ort.InferenceSession(str(tmp_path / "merged" / "merged.onnx"), providers=["CPUExecutionProvider"])
    input_ids = exported["batch"]["input_ids"]
    logits = session.run(["logits"], {"input_ids": input_ids})[0]
    tuned = peft.PeftModel.from_pretrained(lora_models._fresh_base("llama", exported["base_state"]), tmp_path / "adapter")
    with torch.no_grad():
        expected = tuned.merge_and_unload()(input_ids=torch.from_numpy(input_ids), use_cache=False).logits.numpy()
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5)
    base = lora_models._fresh_base("llama", exported["base_state"])
    with torch.no_grad():
        untuned = base(input_ids=torch.from_numpy(input_ids), use_cache=False).logits.numpy()
    assert np.abs(expected - untuned).max() > 1e-4  # the adapters changed the logits


def test_python_api_from_another_folder(exported, tmp_path, monkeypatch):
    """The in-memory route from a current folder without the base: build_step_graph on the
    export loaded without its external data, Trainer(ModelProto, external_data_folder=),
    and lora.merged_model(..., base_dir): losses within 1e-6 of normgrad export's step graph."""
    from normgrad import lora
    from normgrad.graphs import build_step_graph, build_training_graph

    monkeypatch.chdir(tmp_path)
    forward = onnx.load(exported["folder"] / "forward.onnx", load_external_data=False)
    step, initial = build_step_graph(build_training_graph(forward, loss="causal_lm"), "adamw")
    assert sorted(_external(step)) == sorted(exported["external"])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    trainer = Trainer(step, initial, lr=LR, session_options=options, external_data_folder=exported["folder"])
    losses = [trainer.step(**exported["batch"]) for _ in range(STEPS)]
    # normgrad export's step graph also has its portable rewrites (as_exported): close, not bitwise
    np.testing.assert_allclose(losses, exported["losses"], rtol=1e-6, atol=0)
    merged = lora.merged_model(step, trainer.state_dict(), exported["folder"])
    save_models_external({tmp_path / "merged.onnx": merged}, exported["folder"])
    session = ort.InferenceSession(str(tmp_path / "merged.onnx"), providers=["CPUExecutionProvider"])
    assert session.run(["logits"], {"input_ids": exported["batch"]["input_ids"]})[0].shape == (2, 8, 64)


_two_layer_model = two_layer_model


def test_plain_model_with_external_data(tmp_path, monkeypatch):
    """An ONNX model saved with all its weights in external data (no torch): normgrad export
    --freeze w1, from another folder, loads the trained w2 (its initial value goes to the
    checkpoint) and leaves the frozen w1 in one STEP.onnx.data copy; the Trainer's losses are
    bitwise those of the model with inline weights."""
    (tmp_path / "model").mkdir()
    (tmp_path / "inline").mkdir()
    (tmp_path / "out").mkdir()
    model = _two_layer_model()
    onnx.save(model, tmp_path / "inline" / "model.onnx")
    onnx.save(model, tmp_path / "model" / "model.onnx", save_as_external_data=True, location="weights.bin",
              size_threshold=0)
    options = ("--loss", "mse", "--optimizer", "sgd", "--freeze", "w1")
    rng = np.random.default_rng(1)
    batch = {"x": rng.standard_normal((4, 32)).astype(np.float32), "labels": rng.standard_normal((4, 8)).astype(np.float32)}
    monkeypatch.chdir(tmp_path)
    _write_step_graph(tmp_path / "inline" / "model.onnx", tmp_path / "inline" / "step.onnx", *options)
    _, expected = _train(tmp_path / "inline" / "step.onnx", batch)
    _write_step_graph(tmp_path / "model" / "model.onnx", tmp_path / "out" / "step.onnx", *options)
    step = onnx.load(tmp_path / "out" / "step.onnx", load_external_data=False)
    data = _data_file(tmp_path / "out", "step.onnx")
    assert {name: location for name, (location, _, _) in _external(step).items()} == {"w1": data}
    assert os.path.getsize(tmp_path / "out" / data) == 32 * 32 * 4
    monkeypatch.chdir(tmp_path / "model")
    trainer, losses = _train(tmp_path / "out" / "step.onnx", batch)
    assert losses == expected
    trainer.export_inference_model(tmp_path / "out" / "inference.onnx")
    session = ort.InferenceSession(str(tmp_path / "out" / "inference.onnx"), providers=["CPUExecutionProvider"])
    inference = onnx.load(tmp_path / "out" / "inference.onnx", load_external_data=False)
    assert sorted(_external(inference)) == ["w1", "w2"]
    w2 = trainer.state_dict()["w2"]
    w1 = numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_allclose(session.run(["y"], {"x": batch["x"]})[0], np.maximum(batch["x"] @ w1, 0) @ w2,
                               rtol=1e-5, atol=1e-5)


def test_missing_external_data_is_a_trainer_error(tmp_path):
    """A step graph whose data file is not where it says: one TrainerError naming the tensor
    and the file, not onnxruntime's failure at session creation."""
    onnx.save(_two_layer_model(), tmp_path / "model.onnx", save_as_external_data=True, location="weights.bin",
              size_threshold=0)
    _write_step_graph(tmp_path / "model.onnx", tmp_path / "step.onnx", "--loss", "mse", "--optimizer", "sgd",
                      "--freeze", "w1")
    os.rename(tmp_path / "weights.bin", tmp_path / "moved.bin")
    with pytest.raises(TrainerError, match=r"external data of tensor 'w1' is missing: no file .*weights\.bin"):
        Trainer(tmp_path / "step.onnx", tmp_path / "step.ckpt", lr=LR)


def test_large_inline_weights_go_to_external_data(tmp_path, monkeypatch):
    """save_models_external moves a model's inline tensors of 1 KiB or more to PATH.data when
    they pass INLINE_MODEL_BYTES (lowered here), and the model it writes runs the same."""
    monkeypatch.setattr(normgrad.util.external_data, "INLINE_MODEL_BYTES", 1024)
    model = _two_layer_model()
    x = np.random.default_rng(2).standard_normal((4, 32)).astype(np.float32)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    save_models_external({tmp_path / "m.onnx": model})
    written = onnx.load(tmp_path / "m.onnx", load_external_data=False)
    data = _data_file(tmp_path, "m.onnx")
    assert {name: location for name, (location, _, _) in _external(written).items()} == {"w1": data, "w2": data}
    assert os.path.getsize(tmp_path / data) == (32 * 32 + 32 * 8) * 4
    got = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.array_equal(got, expected)
