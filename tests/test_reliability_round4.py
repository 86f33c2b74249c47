"""Issue 30 (reliability, round 4): multi-file artifacts commit as one, no writer aliases a
file it reads, one validation path for every graph the Trainer loads, clear errors.

Each test names the issue's item it covers. The kill tests run the writer in a subprocess
that a ``sys.addaudithook`` hook SIGKILLs at a chosen ``os.rename``/``os.replace`` (the
audit event ``os.rename``) or ``os.remove``, then check that the files left are the old
set or the new one, against NumPy float64 references of what each set computes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from normgrad import checkpoint
from normgrad.util.external_data import save_models_external, uses_external_data
from normgrad.tools.export import main as export_main
from normgrad.train import Trainer, TrainerError

from _graph_models import two_layer_model

RNG = np.random.default_rng(30)
X = RNG.standard_normal((4, 32)).astype(np.float32)
LABELS = RNG.standard_normal((4, 8)).astype(np.float32)


_two_layer_model = two_layer_model


def _reference(model: onnx.ModelProto, folder=None) -> np.ndarray:
    """float64 NumPy forward of a _two_layer_model (its weights read from ``folder``)."""
    weights = {t.name: numpy_helper.to_array(t, folder or "").astype(np.float64) for t in model.graph.initializer}
    return np.maximum(X.astype(np.float64) @ weights["w1"], 0) @ weights["w2"]


def _run(path) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["y"], {"x": X})[0]


def _export(source, output, *options) -> int:
    return export_main([str(source), "-o", str(output), "--loss", "mse", "--optimizer", "sgd", *options])


def _frozen_base_step(folder):
    """forward.onnx with its weights in forward.onnx.data, and step.onnx (w1 frozen) beside
    it, whose frozen base is that data file."""
    onnx.save(_two_layer_model(), folder / "forward.onnx", save_as_external_data=True, location="forward.onnx.data",
              size_threshold=0)
    assert _export(folder / "forward.onnx", folder / "step.onnx", "--freeze", "w1") == 0
    step = onnx.load(folder / "step.onnx", load_external_data=False)
    assert [t.name for t in step.graph.initializer if uses_external_data(t)] == ["w1"]
    return folder / "step.onnx", folder / "step.ckpt"


def _killed(script: str, *arguments) -> None:
    """Runs ``script`` (after the kill hook) in a subprocess and checks it died by SIGKILL."""
    process = subprocess.run([sys.executable, "-c", KILL_HOOK + textwrap.dedent(script), *map(str, arguments)],
                             capture_output=True, timeout=300)
    assert process.returncode == -signal.SIGKILL, process.stderr.decode()[-2000:]


KILL_HOOK = """
import os, signal, sys
KILL_EVENT, KILL_AT = sys.argv[1], int(sys.argv[2])
seen = [0]
def hook(event, arguments):
    if event == KILL_EVENT:
        seen[0] += 1
        if seen[0] == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
sys.addaudithook(hook)
"""


# ------------------------------------------------------------------ 3: a model and its data file


SAVE_MODEL = """
import onnx
import normgrad.util.external_data
from normgrad.util.external_data import save_models_external
normgrad.util.external_data.INLINE_MODEL_BYTES = 1024
save_models_external({sys.argv[3]: onnx.load(sys.argv[4])})
"""


@pytest.mark.parametrize("kill", [("os.rename", 1), ("os.rename", 2), ("os.remove", 1)])
def test_item3_a_killed_model_save_leaves_the_old_model_or_the_new_one(tmp_path, monkeypatch, kill):
    """The data file goes under a new content-addressed name, the model's rename commits, the
    old data file is removed after: a kill before the model's rename leaves the old model
    reading its own old data (it computed 33 off before); after it, the new model."""
    import normgrad.util.external_data

    monkeypatch.setattr(normgrad.util.external_data, "INLINE_MODEL_BYTES", 1024)
    path = tmp_path / "m.onnx"
    old, new = _two_layer_model(1.0), _two_layer_model(2.0)
    save_models_external({path: old})
    onnx.save(new, tmp_path / "new-source.onnx")
    _killed(SAVE_MODEL, *kill, path, tmp_path / "new-source.onnx")
    expected = _reference(_two_layer_model(1.0) if kill == ("os.rename", 1) or kill == ("os.rename", 2)
                          else _two_layer_model(2.0))
    np.testing.assert_allclose(_run(path), expected, rtol=1e-5, atol=1e-4)
    save_models_external({path: _two_layer_model(3.0)})  # the next save removes what the kill left
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("m.onnx")) == ["m.onnx", _only_data(tmp_path)]
    np.testing.assert_allclose(_run(path), _reference(_two_layer_model(3.0)), rtol=1e-5, atol=1e-4)


def _only_data(folder) -> str:
    names = [n for n in os.listdir(folder) if n.startswith("m.onnx.") and n.endswith(".data")]
    assert len(names) == 1, names
    return names[0]


# ------------------------------------------------------------------ 1, 4: export's set of files


def _trained_checkpoint(step_path, ckpt_path):
    trainer = Trainer(step_path, ckpt_path, lr=0.1, kernels=None)
    for _ in range(3):
        trainer.step(X, LABELS)
    trainer.save(ckpt_path)
    return ckpt_path.read_bytes()


def test_item1_an_export_failing_at_its_graph_keeps_the_trained_checkpoint(tmp_path, capsys):
    """-o names a folder: exit 1 naming it, and the trained t.ckpt is byte for byte the same
    (main replaced it with fresh initial weights first)."""
    onnx.save(_two_layer_model(), tmp_path / "forward.onnx")
    assert _export(tmp_path / "forward.onnx", tmp_path / "t.onnx") == 0
    trained = _trained_checkpoint(tmp_path / "t.onnx", tmp_path / "t.ckpt")
    os.remove(tmp_path / "t.onnx")
    (tmp_path / "t.onnx").mkdir()
    capsys.readouterr()
    assert _export(tmp_path / "forward.onnx", tmp_path / "t.onnx") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "t.onnx" in err and "folder" in err
    assert (tmp_path / "t.ckpt").read_bytes() == trained


@pytest.mark.parametrize("kill_at", [1, 2, 3, 4])
def test_item1_a_killed_export_leaves_the_old_set_or_the_new_one(tmp_path, kill_at):
    """export --optimizer killed at each rename (journal, step graph, evaluation graph,
    checkpoint): after normgrad's recovery (what the Trainer runs when it loads) the step
    graph, evaluation graph and checkpoint are bytewise the old set (with the trained
    checkpoint) or the new one (as an export into a fresh folder writes it)."""
    onnx.save(_two_layer_model(1.0), tmp_path / "forward.onnx")
    onnx.save(_two_layer_model(2.0), tmp_path / "forward2.onnx")
    new_options = ("--momentum", "0.9")
    (tmp_path / "fresh").mkdir()
    assert _export(tmp_path / "forward2.onnx", tmp_path / "fresh" / "t.onnx", *new_options) == 0
    assert _export(tmp_path / "forward.onnx", tmp_path / "t.onnx") == 0
    trained = _trained_checkpoint(tmp_path / "t.onnx", tmp_path / "t.ckpt")
    names = ("t.onnx", "t.eval.onnx", "t.ckpt")
    old = {name: (tmp_path / name).read_bytes() for name in names}
    new = {name: (tmp_path / "fresh" / name).read_bytes() for name in names}
    assert old["t.onnx"] != new["t.onnx"] and old["t.ckpt"] != new["t.ckpt"]
    _killed("""
        from normgrad.tools.export import main
        main([sys.argv[3], "-o", sys.argv[4], "--loss", "mse", "--optimizer", "sgd", "--momentum", "0.9"])
    """, "os.rename", kill_at, tmp_path / "forward2.onnx", tmp_path / "t.onnx")
    trainer = Trainer(tmp_path / "t.onnx", tmp_path / "t.ckpt", lr=0.1, kernels=None)  # recovers first
    files = {name: (tmp_path / name).read_bytes() for name in names}
    assert files in (old, new)
    assert trainer.step_count == (3 if files == old else 0)
    assert files == (old if kill_at == 1 else new)  # the journal's rename is the commit point
    assert not [n for n in os.listdir(tmp_path) if n.endswith("normgrad-commit")]
    trainer.step(X, LABELS)
    assert _export(tmp_path / "forward.onnx", tmp_path / "t.onnx") == 0  # the next write clears the leftovers
    assert sorted(os.listdir(tmp_path)) == ["forward.onnx", "forward2.onnx", "fresh", "t.ckpt", "t.eval.onnx",
                                            "t.onnx"]
    assert trained != (tmp_path / "t.ckpt").read_bytes()


def test_item4_export_refuses_the_checkpoint_over_its_evaluation_graph(tmp_path, capsys):
    """--checkpoint s.eval.onnx is the evaluation graph export writes: exit 2, nothing written."""
    onnx.save(_two_layer_model(), tmp_path / "forward.onnx")
    code = _export(tmp_path / "forward.onnx", tmp_path / "s.onnx", "--checkpoint", str(tmp_path / "s.eval.onnx"))
    assert code == 2
    assert "evaluation graph" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["forward.onnx"]


def test_item4_export_refuses_an_output_hard_linked_to_the_input(tmp_path, capsys):
    onnx.save(_two_layer_model(), tmp_path / "forward.onnx")
    os.link(tmp_path / "forward.onnx", tmp_path / "alias.onnx")
    before = (tmp_path / "forward.onnx").read_bytes()
    assert _export(tmp_path / "forward.onnx", tmp_path / "alias.onnx") == 2
    assert "input model" in capsys.readouterr().err
    assert (tmp_path / "forward.onnx").read_bytes() == before


def test_item4_export_refuses_an_output_that_is_the_input_data_file(tmp_path, capsys):
    onnx.save(_two_layer_model(), tmp_path / "forward.onnx", save_as_external_data=True, location="w.bin",
              size_threshold=0)
    before = (tmp_path / "w.bin").read_bytes()
    assert _export(tmp_path / "forward.onnx", tmp_path / "w.bin") == 2
    assert "data file of the input model" in capsys.readouterr().err
    assert (tmp_path / "w.bin").read_bytes() == before


# ------------------------------------------------------------------ 2, 18: the Trainer's writers


def test_item2_export_over_the_forward_model_whose_data_the_step_graph_reads_is_refused(tmp_path):
    """The step graph from export --freeze reads its frozen base from forward.onnx.data:
    exporting the inference (or merged) model to forward.onnx is refused, and the step graph
    computes what it did (main silently rewrote the base: 38.69 instead of 58.27)."""
    step, ckpt = _frozen_base_step(tmp_path)
    trainer = Trainer(step, ckpt, lr=0.1, kernels=None)
    expected = trainer.evaluate(X, LABELS).loss
    data = (tmp_path / "forward.onnx.data").read_bytes()
    for target in (tmp_path / "forward.onnx", tmp_path / "forward.onnx.data"):
        with pytest.raises(TrainerError, match="data file of the trainer's step graph"):
            trainer.export_inference_model(target)
    os.symlink(tmp_path / "forward.onnx.data", tmp_path / "link.data")
    with pytest.raises(TrainerError, match="data file of the trainer's step graph"):
        trainer.export_inference_model(tmp_path / "link.data")
    assert (tmp_path / "forward.onnx.data").read_bytes() == data
    assert Trainer(step, ckpt, lr=0.1, kernels=None).evaluate(X, LABELS).loss == expected


def test_item18_save_and_export_never_overwrite_the_trainers_own_files(tmp_path):
    onnx.save(_two_layer_model(), tmp_path / "forward.onnx")
    assert _export(tmp_path / "forward.onnx", tmp_path / "s.onnx") == 0
    trainer = Trainer(tmp_path / "s.onnx", tmp_path / "s.ckpt", lr=0.1, kernels=None)
    graph, state = (tmp_path / "s.onnx").read_bytes(), (tmp_path / "s.ckpt").read_bytes()
    os.link(tmp_path / "s.onnx", tmp_path / "hard.onnx")
    os.symlink(tmp_path / "s.ckpt", tmp_path / "soft.ckpt")
    for path in (tmp_path / "s.onnx", tmp_path / "hard.onnx", tmp_path / "sub" / ".." / "s.onnx"):
        with pytest.raises(TrainerError, match="the trainer's step graph"):
            trainer.save(path)
    for path in (tmp_path / "s.ckpt", tmp_path / "soft.ckpt", tmp_path / "s.onnx"):
        with pytest.raises(TrainerError, match="the trainer's"):
            trainer.export_inference_model(path)
    trainer.step(X, LABELS)
    trainer.save(tmp_path / "s.ckpt")  # saving the state over the checkpoint it came from is what save is for
    with pytest.raises(TrainerError, match="checkpoint"):
        trainer.export_inference_model(tmp_path / "s.ckpt")
    assert (tmp_path / "s.onnx").read_bytes() == graph
    assert (tmp_path / "s.ckpt").read_bytes() != state and Trainer(tmp_path / "s.onnx", tmp_path / "s.ckpt",
                                                                    kernels=None).step_count == 1


# ------------------------------------------------------------------ 9: an adapter folder


PEFT_CONFIG = '{"peft_type": "LORA", "r": 2, "lora_alpha": %d, "target_modules": ["fc"]}'


def _adapter_step_model(alpha: int) -> onnx.ModelProto:
    layer = {"A": "fc.lora_A.weight", "B": "fc.lora_B.weight", "base": "fc.weight", "A_key": "base.fc.lora_A.weight",
             "B_key": "base.fc.lora_B.weight", "scaling": alpha / 2, "fan_in_fan_out": False}
    model = helper.make_model(helper.make_graph([], "g", [], []))
    helper.set_model_props(model, {"normgrad.peft": json.dumps(
        {"adapter_name": "default", "adapter_config": PEFT_CONFIG % alpha, "layers": [layer], "unsupported": None})})
    return model


SAVE_ADAPTER = """
import json
import numpy as np
import onnx
from normgrad import lora
model = onnx.load(sys.argv[4])
alpha = json.loads(json.loads(model.metadata_props[0].value)["adapter_config"])["lora_alpha"]
lora.save_adapter(sys.argv[3], model, {"fc.lora_A.weight": np.full((2, 4), alpha, np.float32),
                                       "fc.lora_B.weight": np.full((4, 2), alpha, np.float32)})
"""


@pytest.mark.parametrize("kill", [("os.link", 1), ("ctypes.dlsym", 1), ("shutil.rmtree", 1), ("os.remove", 2)])
def test_item9_a_killed_save_adapter_leaves_the_old_pair_or_the_new_one(tmp_path, kill):
    """Run A (lora_alpha 4) saved, run B (16) killed at each step of its write: the folder as
    any reader (peft) finds it, with no recovery by normgrad, holds the weights and
    adapter_config.json both of run A or both of run B (a weight's value is its run's
    lora_alpha here), and the user's own file beside them."""
    pytest.importorskip("safetensors")
    from safetensors.numpy import load_file

    from normgrad import lora

    folder = tmp_path / "adapter"
    lora.save_adapter(folder, _adapter_step_model(4), {"fc.lora_A.weight": np.full((2, 4), 4, np.float32),
                                                        "fc.lora_B.weight": np.full((4, 2), 4, np.float32)})
    (folder / "README.md").write_text("the user's notes")
    onnx.save(_adapter_step_model(16), tmp_path / "b.onnx")
    _killed(SAVE_ADAPTER, *kill, folder, tmp_path / "b.onnx")
    alpha = json.loads((folder / lora.ADAPTER_CONFIG).read_text())["lora_alpha"]
    weights = load_file(folder / lora.ADAPTER_WEIGHTS)
    assert all(np.all(value == alpha) for value in weights.values()), (alpha, weights)
    assert alpha == (4 if kill[0] in ("os.link", "ctypes.dlsym") else 16)  # the folder exchange is the commit point
    assert (folder / "README.md").read_text() == "the user's notes"
    lora.save_adapter(folder, _adapter_step_model(4), {"fc.lora_A.weight": np.zeros((2, 4), np.float32),
                                                        "fc.lora_B.weight": np.zeros((4, 2), np.float32)})
    assert sorted(os.listdir(folder)) == sorted([lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG, "README.md"])
    assert sorted(os.listdir(tmp_path)) == ["adapter", "b.onnx"]  # the killed writer's copy removed


def test_item9_an_adapter_folder_with_a_subfolder_commits_through_the_journal(tmp_path):
    """A folder the exchange cannot copy (a subfolder in it), or reached through a link: the
    pair is committed with the journal instead, and reads back as written."""
    pytest.importorskip("safetensors")
    from safetensors.numpy import load_file

    from normgrad import lora

    folder = tmp_path / "adapter"
    (folder / "checkpoint-1").mkdir(parents=True)
    lora.save_adapter(folder, _adapter_step_model(16), {"fc.lora_A.weight": np.full((2, 4), 16, np.float32),
                                                         "fc.lora_B.weight": np.full((4, 2), 16, np.float32)})
    assert json.loads((folder / lora.ADAPTER_CONFIG).read_text())["lora_alpha"] == 16
    assert all(np.all(v == 16) for v in load_file(folder / lora.ADAPTER_WEIGHTS).values())
    assert sorted(os.listdir(folder)) == sorted([lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG, "checkpoint-1"])
    flat, linked = tmp_path / "flat", tmp_path / "linked"
    flat.mkdir()
    linked.symlink_to(flat)  # a link to a folder stays a link; the folder it names gets the pair
    lora.save_adapter(linked, _adapter_step_model(4), {"fc.lora_A.weight": np.full((2, 4), 4, np.float32),
                                                       "fc.lora_B.weight": np.full((4, 2), 4, np.float32)})
    assert linked.is_symlink() and json.loads((flat / lora.ADAPTER_CONFIG).read_text())["lora_alpha"] == 4


# ------------------------------------------------------------------ 10, 11, 12, 13, 15: the Trainer's inputs


def test_item10_eval_model_external_data_outside_its_folder_is_refused(tmp_path):
    step, ckpt = _frozen_base_step(tmp_path / "run" if (tmp_path / "run").mkdir() is None else None)
    (tmp_path / "secret.bin").write_bytes(b"\0" * 4096)
    evaluation = onnx.load(tmp_path / "run" / "step.eval.onnx", load_external_data=False)
    for tensor in evaluation.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../secret.bin"
    onnx.save(evaluation, tmp_path / "run" / "bad.eval.onnx")
    with pytest.raises(TrainerError, match=r"evaluation graph: .*'\.\./secret\.bin' is not a plain relative path"):
        Trainer(step, ckpt, kernels=None, eval_model=tmp_path / "run" / "bad.eval.onnx")


def test_item11_a_cut_short_frozen_base_is_one_trainer_error(tmp_path, capfd):
    step, ckpt = _frozen_base_step(tmp_path)
    data = tmp_path / "forward.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(TrainerError, match=r"forward\.onnx\.data holds 1000 bytes; tensor 'w1' needs .*cut short"):
        Trainer(step, ckpt, kernels=None)
    assert capfd.readouterr().err == ""  # no onnxruntime log


@pytest.mark.parametrize("key, value, rule", [
    ("normgrad.dropout", '{"seed": "abc"}', "int64 'seed'"),
    ("normgrad.loss", '{"kind": "mse"}', "string 'kind' and 'output'"),
    ("normgrad.forward_outputs", "5", "a list of names"),
    ("normgrad.parameters", "[1, 2]", "a list of names"),
    ("normgrad.state", "{not json", "not JSON"),
])
def test_item12_malformed_step_graph_metadata_is_one_trainer_error(tmp_path, key, value, rule):
    onnx.save(_two_layer_model(), tmp_path / "forward.onnx")
    assert _export(tmp_path / "forward.onnx", tmp_path / "s.onnx") == 0
    model = onnx.load(tmp_path / "s.onnx")
    helper.set_model_props(model, {**{e.key: e.value for e in model.metadata_props}, key: value})
    with pytest.raises(TrainerError, match=f"corrupt step graph: metadata {key} .*{rule}"):
        Trainer(model, tmp_path / "s.ckpt", kernels=None)
    with pytest.raises(TrainerError, match=f"corrupt evaluation graph: metadata {key}"):
        onnx.save(model, tmp_path / "bad.eval.onnx")
        Trainer(tmp_path / "s.onnx", tmp_path / "s.ckpt", kernels=None, eval_model=tmp_path / "bad.eval.onnx")


@pytest.mark.parametrize("lr", [True, "0.1", float("nan"), -1.0])
def test_item13_a_learning_rate_that_is_no_number_is_refused_at_construction(tmp_path, lr):
    onnx.save(_two_layer_model(), tmp_path / "forward.onnx")
    assert _export(tmp_path / "forward.onnx", tmp_path / "s.onnx") == 0
    with pytest.raises(TrainerError, match=r"lr.*a learning rate must be a finite number >= 0"):
        Trainer(tmp_path / "s.onnx", tmp_path / "s.ckpt", lr=lr, kernels=None)


def test_item13_lr_none_is_the_step_graphs_own_learning_rate(tmp_path):
    onnx.save(_two_layer_model(), tmp_path / "forward.onnx")
    assert _export(tmp_path / "forward.onnx", tmp_path / "s.onnx") == 0
    default = Trainer(tmp_path / "s.onnx", tmp_path / "s.ckpt", lr=None, kernels=None)
    stored = default.hyperparameters["lr"]
    explicit = Trainer(tmp_path / "s.onnx", tmp_path / "s.ckpt", lr=stored, kernels=None)
    assert default.step(X, LABELS) == explicit.step(X, LABELS)
    for name, value in default.state_dict().items():
        np.testing.assert_array_equal(value, explicit.state_dict()[name], err_msg=name)


@pytest.mark.parametrize("seed", [str(2**63), str(-2**63 - 1), "1e3"])
def test_item15_a_checkpoint_seed_outside_int64_is_refused(tmp_path, seed):
    onnx.save(_two_layer_model(), tmp_path / "forward.onnx")
    assert _export(tmp_path / "forward.onnx", tmp_path / "s.onnx") == 0
    state = checkpoint.load(tmp_path / "s.ckpt").tensors
    checkpoint.save(tmp_path / "bad.ckpt", state, {"normgrad.dropout_seed": seed})
    with pytest.raises(TrainerError, match="normgrad.dropout_seed must be an integer in the int64 range"):
        Trainer(tmp_path / "s.onnx", tmp_path / "bad.ckpt", kernels=None)
    trainer = Trainer(tmp_path / "s.onnx", tmp_path / "s.ckpt", kernels=None)
    with pytest.raises(TrainerError, match="int64 range"):
        trainer.load(tmp_path / "bad.ckpt")
    trainer.step(X, LABELS)  # the process and the trainer go on


# ------------------------------------------------------------------ 6, 7: the data-parallel trainer


DATA_PARALLEL = """
import sys
from normgrad import mpi
from normgrad.util.external_data import uses_external_data
from normgrad.train import TrainerError
mpi.init(abort=False, library=False)
try:
    trainer = mpi.DataParallelTrainer(sys.argv[1], sys.argv[2], lr=0.1, kernels=None)
except TrainerError as error:
    print("TrainerError:", error)
    sys.exit(3)
print(sorted(t.name for t in trainer.step_model.graph.initializer if uses_external_data(t)))
"""


@pytest.mark.slow
def test_item6_7_the_data_parallel_trainer_keeps_the_frozen_base_in_its_file(tmp_path):
    """mpi.DataParallelTrainer loads the step graph as the Trainer does: the frozen base stays
    external (no 2 GiB protobuf limit), and a missing base is one TrainerError naming it."""
    pytest.importorskip("mpi4py")
    from normgrad import mpi

    mpirun = mpi.mpirun_command(1)
    if mpirun is None:
        pytest.skip("mpirun not found")
    step, ckpt = _frozen_base_step(tmp_path)
    run = mpirun + [sys.executable, "-c", DATA_PARALLEL, str(step), str(ckpt)]
    done = subprocess.run(run, capture_output=True, text=True, timeout=300, env=mpi.mpirun_environment())
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "['w1']", done.stderr[-2000:]
    os.rename(tmp_path / "forward.onnx.data", tmp_path / "moved.data")
    done = subprocess.run(run, capture_output=True, text=True, timeout=300, env=mpi.mpirun_environment())
    assert done.returncode != 0, done.stderr[-2000:]
    assert "external data of tensor 'w1' is missing" in done.stdout and "forward.onnx.data" in done.stdout


# ------------------------------------------------------------------ 8, 14: names and weights of the graphs built


def _model_with_weights(names, shapes=((32, 32), (32, 8))) -> onnx.ModelProto:
    """_two_layer_model with its weights named ``names``."""
    model = _two_layer_model()
    renames = dict(zip(("w1", "w2"), names))
    for tensor in model.graph.initializer:
        tensor.name = renames[tensor.name]
    for node in model.graph.node:
        node.input[:] = [renames.get(name, name) for name in node.input]
    return model


def test_item8_a_weight_missing_from_training_graph_weights_is_refused():
    from normgrad.graphs import build_step_graph, build_training_graph
    from normgrad.graphs.builder import TrainingGraph

    training = build_training_graph(_two_layer_model(), loss="mse")
    weights = dict(training.weights)
    del weights["w1"]
    with pytest.raises(ValueError, match="no value for the trainable weight 'w1'"):
        build_step_graph(TrainingGraph(training.model, weights), "sgd")
    weights = {**training.weights, "w1": np.ones((32, 31), np.float32)}
    with pytest.raises(ValueError, match=r"weights\['w1'\] has shape \[32, 31\]; the training graph's input 'w1' is \[32, 32\]"):
        build_step_graph(TrainingGraph(training.model, weights), "sgd")
    step, state = build_step_graph(training, "sgd")  # the intact pair builds, with both weights trained
    assert sorted(state) == ["w1", "w2"]


@pytest.mark.parametrize("names, kind", [(("W1", "W1.exp_avg"), "adam"), (("W1", "W1.next"), "sgd"),
                                         (("W1", "W1.momentum_buffer"), "sgd-momentum")])
def test_item14_a_weight_named_like_an_optimizer_state_is_refused(names, kind):
    from normgrad.graphs import build_step_graph, build_training_graph

    options = {"momentum": 0.9} if kind == "sgd-momentum" else {}
    training = build_training_graph(_model_with_weights(names), loss="mse")
    with pytest.raises(ValueError, match=f"value named '{names[1]}', the name the .* step gives a state tensor of "
                                         "weight 'W1'"):
        build_step_graph(training, kind.split("-")[0], **options)


@pytest.mark.parametrize("name", ["grad_scale", "normgrad.applied", "normgrad.loss", "dropout_micro_batch"])
def test_item14_a_weight_named_like_a_trainer_value_is_one_trainer_error(tmp_path, name):
    onnx.save(_model_with_weights(("w1", name)), tmp_path / "forward.onnx")
    assert _export(tmp_path / "forward.onnx", tmp_path / "s.onnx") == 0
    with pytest.raises(TrainerError, match=f"value named '{name}', a name the trainer gives"):
        Trainer(tmp_path / "s.onnx", tmp_path / "s.ckpt", kernels=None, accumulation=2)


# ------------------------------------------------------------------ 16, 17, 19: normgrad check


def _check(*arguments):
    from normgrad.tools import cli

    return cli.main(["check", *map(str, arguments)])


def test_item16_check_refuses_an_input_beyond_memory_in_one_line(tmp_path, capsys):
    from normgrad.graphs import build_training_graph

    model = _two_layer_model()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2**40
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 2**40
    onnx.save(build_training_graph(model, loss="mse").model, tmp_path / "t.onnx")
    assert _check(tmp_path / "t.onnx") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "input 'x'" in err and "memory" in err


def test_item17_check_refuses_another_models_checkpoint(tmp_path, capsys):
    onnx.save(_two_layer_model(), tmp_path / "a.onnx")
    onnx.save(_model_with_weights(("w1", "v2")), tmp_path / "b.onnx")
    for name in ("a", "b"):
        assert export_main([str(tmp_path / f"{name}.onnx"), "-o", str(tmp_path / f"{name}_train.onnx"), "--loss",
                            "mse"]) == 0
    assert _check(tmp_path / "a_train.onnx") == 0
    capsys.readouterr()
    assert _check(tmp_path / "a_train.onnx", "--checkpoint", tmp_path / "b_train.ckpt") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'v2' is no input" in err
    state = checkpoint.load(tmp_path / "a_train.ckpt").tensors
    checkpoint.save(tmp_path / "partial.ckpt", {"w1": state["w1"]})
    assert _check(tmp_path / "a_train.onnx", "--checkpoint", tmp_path / "partial.ckpt") == 1
    assert "no tensor for weight 'w2'" in capsys.readouterr().err


def test_item19_a_zero_size_weight_passes_the_gradient_check(tmp_path, capsys):
    """y = Concat(x @ v, w) with w of shape [4, 0]: its gradient is empty, trivially right
    (main reported FAIL rel.err nan and exit 1); v's is still checked."""
    rng = np.random.default_rng(19)
    v = numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32), "v")
    w = numpy_helper.from_array(np.zeros((4, 0), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "v"], ["h"]), helper.make_node("Concat", ["h", "w"], ["y"], axis=1)]
    graph = helper.make_graph(nodes, "empty_weight", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], [v, w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, tmp_path / "m.onnx")
    assert export_main([str(tmp_path / "m.onnx"), "-o", str(tmp_path / "t.onnx"), "--loss", "mse"]) == 0
    assert _check(tmp_path / "t.onnx") == 0
    out = capsys.readouterr().out
    assert "OK   w_grad" in out and "OK   v_grad" in out and "nan" not in out
    # a zero-size weight whose output is empty: the loss (a mean over no element) is NaN, so
    # no finite difference means anything, but the empty gradients are still trivially right
    w = numpy_helper.from_array(np.zeros((32, 0), np.float32), "w")
    b = numpy_helper.from_array(np.zeros((0,), np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    graph = helper.make_graph(nodes, "empty_output", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 0])], [w, b])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), tmp_path / "e.onnx")
    assert export_main([str(tmp_path / "e.onnx"), "-o", str(tmp_path / "e_train.onnx"), "--loss", "mse"]) == 0
    _check(tmp_path / "e_train.onnx")
    out = capsys.readouterr().out
    assert "OK   w_grad" in out and "OK   b_grad" in out


# ------------------------------------------------------------------ FIFOs


@pytest.mark.parametrize("command", ["check", "export"])
def test_check_and_export_refuse_a_fifo_instead_of_blocking(tmp_path, command):
    os.mkfifo(tmp_path / "model.onnx")
    arguments = [str(tmp_path / "model.onnx")] + (["-o", str(tmp_path / "out.onnx")] if command == "export" else [])
    done = subprocess.run([sys.executable, "-m", "normgrad.tools.cli", command, *arguments], capture_output=True,
                          text=True, timeout=120)  # a hang guard: main blocked forever
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "not a regular file" in done.stderr
