"""Files written safely: atomic writes (a failed write leaves the old file), in-place export refused,
nothing written through a symbolic link or outside its folder, a writer killed at any rename or removal
leaves the old set of files or the new one (a model and its data file, the Trainer's save and export,
an adapter folder), a FIFO refused instead of blocking."""

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper

from normgrad.util.external_data import save_models_external
from normgrad.util.files import (PathAliasError, PathOutsideFolderError, path_inside, refuse_aliases, remove_inside,
                             write_bytes_atomic)
from normgrad.tools import corpus as corpus_tool
from normgrad.train import Trainer, TrainerError

from _artifacts import LABELS, X, export_sgd, frozen_base_step, killed_by_hook, run_two_layer, two_layer_reference
from _graph_models import two_layer_model


def test_write_replaces_whole_file(tmp_path):
    target = tmp_path / "a.bin"
    write_bytes_atomic(target, b"first")
    write_bytes_atomic(target, b"second")
    assert target.read_bytes() == b"second"
    assert os.listdir(tmp_path) == ["a.bin"]


def test_failed_write_keeps_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "a.bin"
    target.write_bytes(b"good")

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError):
        write_bytes_atomic(target, b"x" * 1000)
    assert target.read_bytes() == b"good"
    assert os.listdir(tmp_path) == ["a.bin"]


def test_same_file_refused(tmp_path):
    source = tmp_path / "net.onnx"
    source.write_bytes(b"model")
    with pytest.raises(PathAliasError, match="is the input"):
        refuse_aliases({"output": tmp_path / "." / "net.onnx"}, {"the input": source})
    refuse_aliases({"output": tmp_path / "other.onnx"}, {"the input": source})


def _listed_folder(out, files):
    out.mkdir()
    (out / corpus_tool.WRITTEN).write_text(
        '{"producer": "%s", "files": [%s]}' % (corpus_tool.PRODUCER_NAME, ", ".join(f'"{f}"' for f in files)))


def test_corpus_never_removes_a_file_behind_a_symlinked_folder(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "important.txt").write_text("keep me")
    out = tmp_path / "corpus"
    _listed_folder(out, ["link/important.txt"])
    (out / "link").symlink_to(outside)
    with pytest.raises(corpus_tool.CorpusFolderError, match="link/important.txt.*outside"):
        corpus_tool.write(out, corpus_tool.with_written_list({"a/model.onnx": b"new"}))
    assert (outside / "important.txt").read_text() == "keep me"
    assert not (out / "a").exists()  # refused before anything was written


def test_corpus_never_writes_through_a_symlinked_case_folder(tmp_path):
    outside = tmp_path / "OUTSIDE"
    outside.mkdir()
    (outside / "model.onnx").write_bytes(b"the user's model")
    out = tmp_path / "corpus"
    _listed_folder(out, ["train_mlp_cross_entropy/model.onnx"])
    (out / "train_mlp_cross_entropy").symlink_to(outside)
    with pytest.raises(corpus_tool.CorpusFolderError, match="outside"):
        corpus_tool.write(out, corpus_tool.with_written_list({"train_mlp_cross_entropy/model.onnx": b"generated"}))
    assert (outside / "model.onnx").read_bytes() == b"the user's model"


def test_corpus_removes_a_listed_link_itself_never_its_target(tmp_path):
    outside = tmp_path / "target.txt"
    outside.write_text("keep me")
    out = tmp_path / "corpus"
    _listed_folder(out, ["old/link.txt"])
    (out / "old").mkdir()
    (out / "old" / "link.txt").symlink_to(outside)
    corpus_tool.write(out, corpus_tool.with_written_list({"a.txt": b"new"}))
    assert outside.read_text() == "keep me"
    assert not (out / "old").exists()
    assert (out / "a.txt").read_bytes() == b"new"


def test_path_inside_refuses_every_way_out(tmp_path):
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "up").symlink_to(tmp_path)
    for relative in ("", "/etc/passwd", "../x", "a/../../x", "up/x", "up"):
        with pytest.raises(PathOutsideFolderError):
            path_inside(tmp_path / "inner", relative)
    assert path_inside(tmp_path / "inner", "a/b.txt") == tmp_path / "inner" / "a" / "b.txt"
    with pytest.raises(PathOutsideFolderError):
        remove_inside(tmp_path / "inner", "up/x")  # a file reached through a link out
    assert remove_inside(tmp_path / "inner", "up")  # the link itself
    assert tmp_path.is_dir()


SAVE_MODEL = """
import onnx
import normgrad.util.external_data
from normgrad.util.external_data import save_models_external
normgrad.util.external_data.INLINE_MODEL_BYTES = 1024
save_models_external({sys.argv[3]: onnx.load(sys.argv[4])})
"""


@pytest.mark.parametrize("kill", [("os.rename", 1), ("os.rename", 2), ("os.remove", 1)])
def test_a_killed_model_save_leaves_the_old_model_or_the_new_one(tmp_path, monkeypatch, kill):
    """The data file goes under a new content-addressed name, the model's rename commits, the
    old data file is removed after: a kill before the model's rename leaves the old model
    reading its own old data (it computed 33 off before); after it, the new model."""
    import normgrad.util.external_data

    monkeypatch.setattr(normgrad.util.external_data, "INLINE_MODEL_BYTES", 1024)
    path = tmp_path / "m.onnx"
    old, new = two_layer_model(1.0), two_layer_model(2.0)
    save_models_external({path: old})
    onnx.save(new, tmp_path / "new-source.onnx")
    killed_by_hook(SAVE_MODEL, *kill, path, tmp_path / "new-source.onnx")
    expected = two_layer_reference(two_layer_model(1.0) if kill == ("os.rename", 1) or kill == ("os.rename", 2)
                          else two_layer_model(2.0))
    np.testing.assert_allclose(run_two_layer(path), expected, rtol=1e-5, atol=1e-4)
    save_models_external({path: two_layer_model(3.0)})  # the next save removes what the kill left
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("m.onnx")) == ["m.onnx", _only_data(tmp_path)]
    np.testing.assert_allclose(run_two_layer(path), two_layer_reference(two_layer_model(3.0)), rtol=1e-5, atol=1e-4)


def _only_data(folder) -> str:
    names = [n for n in os.listdir(folder) if n.startswith("m.onnx.") and n.endswith(".data")]
    assert len(names) == 1, names
    return names[0]


def test_export_over_the_forward_model_whose_data_the_step_graph_reads_is_refused(tmp_path):
    """The step graph from export --freeze reads its frozen base from forward.onnx.data:
    exporting the inference (or merged) model to forward.onnx is refused, and the step graph
    computes what it did (main silently rewrote the base: 38.69 instead of 58.27)."""
    step, ckpt = frozen_base_step(tmp_path)
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


def test_save_and_export_never_overwrite_the_trainers_own_files(tmp_path):
    onnx.save(two_layer_model(), tmp_path / "forward.onnx")
    assert export_sgd(tmp_path / "forward.onnx", tmp_path / "s.onnx") == 0
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


# ------------------------------------------------------------------ an adapter folder


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
def test_a_killed_save_adapter_leaves_the_old_pair_or_the_new_one(tmp_path, kill):
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
    killed_by_hook(SAVE_ADAPTER, *kill, folder, tmp_path / "b.onnx")
    alpha = json.loads((folder / lora.ADAPTER_CONFIG).read_text())["lora_alpha"]
    weights = load_file(folder / lora.ADAPTER_WEIGHTS)
    assert all(np.all(value == alpha) for value in weights.values()), (alpha, weights)
    assert alpha == (4 if kill[0] in ("os.link", "ctypes.dlsym") else 16)  # the folder exchange is the commit point
    assert (folder / "README.md").read_text() == "the user's notes"
    lora.save_adapter(folder, _adapter_step_model(4), {"fc.lora_A.weight": np.zeros((2, 4), np.float32),
                                                        "fc.lora_B.weight": np.zeros((4, 2), np.float32)})
    assert sorted(os.listdir(folder)) == sorted([lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG, "README.md"])
    assert sorted(os.listdir(tmp_path)) == ["adapter", "b.onnx"]  # the killed writer's copy removed


def test_an_adapter_folder_with_a_subfolder_commits_through_the_journal(tmp_path):
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


@pytest.mark.parametrize("command", ["check", "export"])
def test_check_and_export_refuse_a_fifo_instead_of_blocking(tmp_path, command):
    os.mkfifo(tmp_path / "model.onnx")
    arguments = [str(tmp_path / "model.onnx")] + (["-o", str(tmp_path / "out.onnx")] if command == "export" else [])
    done = subprocess.run([sys.executable, "-m", "normgrad.tools.cli", command, *arguments], capture_output=True,
                          text=True, timeout=120)  # a hang guard: main blocked forever
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "not a regular file" in done.stderr


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _mode(path) -> int:
    return os.stat(path).st_mode & 0o7777


def test_written_files_honour_the_umask_as_open_does(tmp_path, umask):
    """One file, a set of files (the journaled commit) and a folder replaced as one: each new
    file gets the mode open() gives a new file under the same umask (not mkstemp's 0600),
    each new folder os.mkdir's; a replaced file keeps its own mode."""
    from normgrad.util.files import StagedFile, commit_files, replace_folder_files

    with open(tmp_path / "by_open", "wb"):
        pass
    os.mkdir(tmp_path / "by_mkdir")
    expected, expected_folder = _mode(tmp_path / "by_open"), _mode(tmp_path / "by_mkdir")
    assert expected == 0o666 & ~umask

    write_bytes_atomic(tmp_path / "one.bin", b"1")
    commit_files([StagedFile(tmp_path / "a.onnx", [b"a"]), StagedFile(tmp_path / "a.ckpt", [b"b"])])
    assert replace_folder_files(tmp_path / "adapter", {"weights.bin": b"w", "config.json": b"{}"})
    for path in ("one.bin", "a.onnx", "a.ckpt", "adapter/weights.bin", "adapter/config.json"):
        assert _mode(tmp_path / path) == expected, path
    assert _mode(tmp_path / "adapter") == expected_folder

    os.chmod(tmp_path / "a.onnx", 0o640)
    commit_files([StagedFile(tmp_path / "a.onnx", [b"c"]), StagedFile(tmp_path / "a.ckpt", [b"d"])])
    assert _mode(tmp_path / "a.onnx") == 0o640 and _mode(tmp_path / "a.ckpt") == expected
