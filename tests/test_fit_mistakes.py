"""User mistakes around fit, the schedulers and `normgrad train`, each refused in one line
naming the input and the rule before anything is trained or written (found by probing the
loop as a user would)."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from normgrad import loop, schedules
from normgrad.tools import cli
from normgrad.train import Trainer, TrainerError

pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The digits CNN exported twice: with a dynamic batch (step.onnx) and a fixed batch of 16
    (fixed.onnx), each with its checkpoint and evaluation graph; 100 training samples."""
    from normgrad.graphs import examples
    from normgrad.tools.train import load_digits

    folder = tmp_path_factory.mktemp("fit_mistakes")
    forward = examples.digits_cnn(seed=1)
    onnx.save(forward, os.fspath(folder / "digits.onnx"))
    forward.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 16
    onnx.save(forward, os.fspath(folder / "digits16.onnx"))
    for source, target in (("digits.onnx", "step.onnx"), ("digits16.onnx", "fixed.onnx")):
        assert cli.main(["export", os.fspath(folder / source), "-o", os.fspath(folder / target),
                         "--loss", "cross_entropy", "--optimizer", "adamw"]) == 0
    images, labels, _, _ = load_digits(1)
    np.savez(folder / "train.npz", x=images[:100], labels=labels[:100])
    return folder


def _trainer(folder, name="step"):
    return Trainer(os.fspath(folder / f"{name}.onnx"), os.fspath(folder / f"{name}.ckpt"))


@pytest.mark.parametrize("make", [
    lambda t: schedules.StepLR(t, step_size=1, gamma="x"),
    lambda t: schedules.MultiStepLR(t, milestones=[2], gamma=None),
    lambda t: schedules.ExponentialLR(t, gamma=-0.5),
    lambda t: schedules.CosineAnnealingLR(t, T_max=5, eta_min=float("nan")),
    lambda t: schedules.LinearLR(t, start_factor="0.5"),
    lambda t: schedules.OneCycleLR(t, max_lr=0.1, total_steps=10, div_factor=0),
    lambda t: schedules.ReduceLROnPlateau(t, min_lr=-1.0),
], ids=["steplr-gamma", "multistep-gamma", "exponential-gamma", "cosine-eta_min", "linear-start", "onecycle-div",
        "plateau-min_lr"])
def test_a_scheduler_refuses_a_bad_argument_when_made(exported, make):
    trainer = _trainer(exported)
    lr = trainer.hyperparameters["lr"]
    with pytest.raises(TrainerError, match=r"must be (a finite number|> 0|between)"):
        make(trainer)
    assert trainer.hyperparameters["lr"] == lr


def test_cli_refuses_a_bad_scheduler_argument_before_training(exported, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", os.fspath(exported / "step.onnx"), "--data", os.fspath(exported / "train.npz"),
                     "--scheduler", "StepLR(step_size=1, gamma='x')", "--out", os.fspath(out), "--no-progress"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "StepLR gamma must be a finite number" in error
    assert not (out / "checkpoints").exists()


def test_fit_refuses_a_metric_that_is_no_function_before_a_step(exported):
    trainer = _trainer(exported)
    with np.load(exported / "train.npz") as archive:
        arrays = {"x": archive["x"], "labels": archive["labels"]}
    with pytest.raises(TrainerError, match=r"metrics\['acc'\] must be a function"):
        trainer.fit(loop.array_batches(arrays, 20), evaluation=loop.array_batches(arrays, 50),
                    metrics={"acc": "accuracy"}, progress=False)
    assert trainer.step_count == 0


def test_save_into_a_missing_folder_is_one_error_naming_the_path(exported, tmp_path):
    trainer = _trainer(exported)
    target = os.fspath(tmp_path / "no_such_folder" / "run.ckpt")
    with pytest.raises(FileNotFoundError, match=r"cannot write the checkpoint '.*no_such_folder/run\.ckpt': No such file"):
        trainer.save(target)
    with pytest.raises(FileNotFoundError, match="cannot write the inference model"):
        trainer.export_inference_model(os.fspath(tmp_path / "no_such_folder" / "model.onnx"))


def test_save_over_the_exported_evaluation_graph_is_refused(exported):
    trainer = _trainer(exported)
    before = (exported / "step.eval.onnx").read_bytes()
    with pytest.raises(TrainerError, match="is the evaluation graph exported with the step graph"):
        trainer.save(os.fspath(exported / "step.eval.onnx"))
    assert (exported / "step.eval.onnx").read_bytes() == before


def test_cli_takes_a_fixed_batch_graphs_batch_and_refuses_another(exported, tmp_path, capsys):
    arguments = ["train", os.fspath(exported / "fixed.onnx"), "--data", os.fspath(exported / "train.npz"),
                 "--epochs", "1", "--no-progress"]
    assert cli.main(arguments + ["--batch-size", "32", "--out", os.fspath(tmp_path / "a")]) == 1
    assert "--batch-size 32: the step graph takes batches of exactly 16" in capsys.readouterr().err
    assert cli.main(arguments + ["--out", os.fspath(tmp_path / "b")]) == 0
    assert "6 steps" in capsys.readouterr().out  # 100 samples: 6 batches of 16, the 4 left over left out
    assert (tmp_path / "b" / "checkpoints" / "step-00000006.ckpt").is_file()


def test_resume_from_another_models_folder_names_the_mismatch(exported, tmp_path):
    with np.load(exported / "train.npz") as archive:
        arrays = {"x": archive["x"][:32], "labels": archive["labels"][:32]}
    other = _trainer(exported)
    other.fit(loop.array_batches(arrays, 16), epochs=1, checkpoint_dir=os.fspath(tmp_path / "ck"),
              scheduler=schedules.StepLR(other, step_size=1), progress=False)
    from normgrad.graphs import build_step_graph, build_training_graph, examples

    step, state = build_step_graph(build_training_graph(examples.digits_cnn(seed=1), loss="cross_entropy"), "sgd",
                                   momentum=0.9)
    trainer = Trainer(step, state)
    with pytest.raises(TrainerError, match=r"cannot resume from .*step-00000002\.ckpt: .*momentum_buffer"):
        trainer.fit(loop.array_batches(arrays, 16), epochs=2, checkpoint_dir=os.fspath(tmp_path / "ck"), resume=True,
                    progress=False)
    assert trainer.step_count == 0


def test_cli_train_into_a_used_out_without_resume_is_one_line(exported, tmp_path, capsys):
    """`normgrad train` rerun with fewer epochs into the same --out: refused in one line naming
    the checkpoint folder and the remedies, the first run's checkpoints kept byte for byte."""
    arguments = ["train", os.fspath(exported / "step.onnx"), "--data", os.fspath(exported / "train.npz"),
                 "--batch-size", "50", "--no-progress", "--out", os.fspath(tmp_path / "run")]
    assert cli.main(arguments + ["--epochs", "2"]) == 0
    capsys.readouterr()
    folder = tmp_path / "run" / "checkpoints"
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    assert "step-00000004.ckpt" in before
    assert cli.main(arguments + ["--epochs", "1"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith(f"normgrad train: checkpoint folder {folder} holds an earlier "
                                                       "run's checkpoints"), error
    assert "--resume" in error and "--out" in error
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before
    assert cli.main(arguments + ["--epochs", "3", "--resume"]) == 0
    assert "6 steps" in capsys.readouterr().out
