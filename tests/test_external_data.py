"""A frozen base in external data (the route for models past protobuf's 2 GiB limit), end to
end at a small size: a tiny peft LoRA Llama exported with ``external_data=True``, its step
graph written by ``normgrad export``, trained by the Trainer, its adapter saved and its
merged model written, all from a current folder that is not the model's. The graph files
keep the base out of their protobuf; the steps are bitwise those of the same model with
the base inline; the merged model gives peft's merged logits."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("safetensors")
pytest.importorskip("onnxscript")

import onnxruntime as ort  # noqa: E402

import normgrad.torch  # noqa: E402
from normgrad._files import EXTERNAL_TENSOR_MIN_BYTES, uses_external_data  # noqa: E402
from normgrad.tools.export import main as export_main  # noqa: E402
from normgrad.train import Trainer  # noqa: E402
from test_lora import Logits, _fresh_base, _peft_model  # noqa: E402

STEPS, LR = 3, 1e-3


def _write_step_graph(source, output):
    assert export_main([str(source), "-o", str(output), "--loss", "causal_lm", "--optimizer", "adamw"]) == 0


def _train(step_path):
    options = ort.SessionOptions()  # one per Trainer: a second registration of the kernels fails
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    trainer = Trainer(step_path, str(step_path).replace(".onnx", ".ckpt"), lr=LR, session_options=options)
    return trainer, [trainer.step(**BATCH) for _ in range(STEPS)]


def _external(model: onnx.ModelProto):
    """{initializer name: (location, offset, length)} of the tensors in external data."""
    return {t.name: tuple({e.key: e.value for e in t.external_data}.get(k) for k in ("location", "offset", "length"))
            for t in model.graph.initializer if uses_external_data(t)}


INPUT_IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
BATCH = {"input_ids": INPUT_IDS.numpy(), "labels": INPUT_IDS.numpy()}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The peft model, its base state, the export with its base in external data, and the
    Trainer's losses and state on the same model exported with its base inline."""
    model, base_state = _peft_model("llama")
    folder = tmp_path_factory.mktemp("model")
    forward = normgrad.torch.export(Logits(model), (INPUT_IDS,), folder / "forward.onnx", exporter="dynamo",
                                    input_names=["input_ids"], output_names=["logits"], external_data=True)
    external = _external(forward)
    assert external and not [n for n in external if ".lora_" in n]
    inline = tmp_path_factory.mktemp("inline")
    onnx.save(onnx.load(folder / "forward.onnx"), inline / "forward.onnx")
    _write_step_graph(inline / "forward.onnx", inline / "step.onnx")
    trainer, losses = _train(inline / "step.onnx")
    return dict(model=model, base_state=base_state, folder=folder, external=external, losses=losses,
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
        assert locations == {"forward.onnx.data" if where == "beside" else f"step_{where}.onnx.data"}
        big_inline = [t.name for t in model.graph.initializer
                      if not uses_external_data(t) and len(t.raw_data) >= EXTERNAL_TENSOR_MIN_BYTES and ".lora_" not in t.name]
        assert not big_inline, path
    if where == "elsewhere":
        assert os.path.getsize(folder / f"step_{where}.onnx.data") == sum(lengths.values())
    assert os.path.getsize(step_path) < exported["inline_size"] - 0.9 * sum(lengths.values())
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    trainer, losses = _train(step_path)
    assert losses == exported["losses"]
    state = trainer.state_dict()
    assert state.keys() == exported["state"].keys()
    for name in state:
        assert np.array_equal(state[name], exported["state"][name]), name


def test_adapter_and_merged_model(exported, tmp_path, monkeypatch):
    """save_adapter and export_merged_model of a step graph whose base is in external data,
    from another current folder: the merged model keeps its weights in merged.onnx.data and
    gives the logits of peft's merge_and_unload of the saved adapter within 1e-5."""
    monkeypatch.chdir(tmp_path)
    step_path = tmp_path / "step.onnx"
    _write_step_graph(exported["folder"] / "forward.onnx", step_path)
    trainer, _ = _train(step_path)
    trainer.save_adapter(tmp_path / "adapter")
    (tmp_path / "merged").mkdir()
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    trainer.export_merged_model(tmp_path / "merged" / "merged.onnx")
    assert sorted(os.listdir(tmp_path / "merged")) == ["merged.onnx", "merged.onnx.data"]
    merged = onnx.load(tmp_path / "merged" / "merged.onnx", load_external_data=False)
    assert not [t.name for t in merged.graph.initializer
                if not uses_external_data(t) and len(t.raw_data) >= EXTERNAL_TENSOR_MIN_BYTES]
    assert {location for location, _, _ in _external(merged).values()} == {"merged.onnx.data"}
    assert not [t.name for t in merged.graph.initializer if ".lora_" in t.name]
    session = ort.InferenceSession(str(tmp_path / "merged" / "merged.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], {"input_ids": BATCH["input_ids"]})[0]
    tuned = peft.PeftModel.from_pretrained(_fresh_base("llama", exported["base_state"]), tmp_path / "adapter")
    with torch.no_grad():
        expected = tuned.merge_and_unload()(input_ids=INPUT_IDS, use_cache=False).logits.numpy()
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5)
    base = _fresh_base("llama", exported["base_state"])
    with torch.no_grad():
        untuned = base(input_ids=INPUT_IDS, use_cache=False).logits.numpy()
    assert np.abs(expected - untuned).max() > 1e-4  # the adapters changed the logits
