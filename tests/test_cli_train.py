"""`normgrad train STEP.onnx --data ...` end to end: `normgrad export` a model, train it on
.npz arrays from the command line, get bitwise the state of a hand-written Trainer loop with
the same batches and schedule, resume it for one more epoch; bad data refused by name in one
line; `normgrad --version`."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest

from normgrad import loop
from normgrad.tools import cli
from normgrad.train import Trainer

pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from normgrad.graphs import examples
    from normgrad.tools.train import load_digits

    folder = tmp_path_factory.mktemp("cli_train")
    onnx.save(examples.digits_cnn(seed=1), os.fspath(folder / "digits.onnx"))
    assert cli.main(["export", os.fspath(folder / "digits.onnx"), "-o", os.fspath(folder / "step.onnx"),
                     "--loss", "cross_entropy", "--optimizer", "adamw", "--weight-decay", "0.001"]) == 0
    images, labels, test_images, test_labels = load_digits(1)
    np.savez(folder / "train.npz", x=images[:300], labels=labels[:300])
    np.savez(folder / "val.npz", x=test_images[:100], labels=test_labels[:100])
    return folder


def _train(folder, out, *extra):
    return cli.main(["train", os.fspath(folder / "step.onnx"), "--data", os.fspath(folder / "train.npz"),
                     "--eval", os.fspath(folder / "val.npz"), "--batch-size", "40", "--lr", "0.004",
                     "--scheduler", "StepLR(step_size=1, gamma=0.5)", "--metrics", "accuracy", "top5",
                     "--weight-decay", "0.002", "--betas", "0.85", "0.995",
                     "--out", os.fspath(out), "--no-progress", "--seed", "7", *extra])


@pytest.mark.slow
def test_train_an_exported_step_graph_on_npz(exported, tmp_path, capsys):
    pytest.importorskip("matplotlib")  # the plot it checks
    out = tmp_path / "run"
    assert _train(exported, out, "--epochs", "2") == 0
    assert "wrote" in capsys.readouterr().out

    reference = Trainer(os.fspath(exported / "step.onnx"), os.fspath(exported / "step.ckpt"), lr=0.004,
                        weight_decay=0.002, betas=(0.85, 0.995))
    with np.load(exported / "train.npz") as archive:
        batches = loop.array_batches({"x": archive["x"], "labels": archive["labels"]}, 40, shuffle=True, seed=7)
    for epoch in (1, 2, 3):
        for batch in batches(epoch):
            reference.step(batch)
        reference.hyperparameters["lr"] = 0.004 * 0.5 ** epoch
        if epoch == 2:
            last = Trainer(os.fspath(exported / "step.onnx"), os.fspath(out / "checkpoints" / "step-00000016.ckpt"))
            assert last.step_count == reference.step_count == 16  # 8 batches (the last of 20) per epoch
            assert all(last.state_dict()[k].tobytes() == v.tobytes() for k, v in reference.state_dict().items())
            assert dict(last.hyperparameters) == dict(reference.hyperparameters)
            assert last.hyperparameters["beta1"] == 0.85 and last.hyperparameters["weight_decay"] == 0.002
    rows = list(csv.DictReader((out / "metrics.csv").read_text().splitlines()))
    evaluations = [r for r in rows if r["val_loss"]]
    assert len(evaluations) == 2 and all(0 <= float(r["val_top5"]) <= 1 for r in evaluations)
    assert [float(r["lr"]) for r in rows if r["loss"]] == [0.004] * 8 + [0.002] * 8
    assert {float(r["beta1"]) for r in rows if r["loss"]} == {0.85}
    assert (out / "training.png").stat().st_size > 0 and (out / "inference.onnx").is_file()
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(out))

    # --resume --epochs 3: one more epoch from the latest checkpoint, as the hand-written loop's third
    assert _train(exported, out, "--epochs", "3", "--resume") == 0
    final = Trainer(os.fspath(exported / "step.onnx"), os.fspath(out / "checkpoints" / "step-00000024.ckpt"))
    assert all(final.state_dict()[k].tobytes() == v.tobytes() for k, v in reference.state_dict().items())


@pytest.mark.parametrize("arrays,message", [
    (dict(x=np.zeros((4, 1, 8, 8), np.float32), label=np.zeros(4, np.int64)),
     "--data: no array 'labels'; the step graph's data inputs are x, labels"),
    (dict(x=np.zeros((4, 1, 8, 8), np.float32), labels=np.zeros(4, np.int64), mask=np.zeros(4)),
     "--data: array 'mask' is not a data input of the step graph (x, labels)"),
    (dict(x=np.zeros((4, 1, 8, 8), np.int32), labels=np.zeros(4, np.int64)),
     "--data: array 'x' is int32; the step graph takes float32"),
    (dict(x=np.zeros((4, 8, 8), np.float32), labels=np.zeros(4, np.int64)),
     "--data: array 'x' has shape [4, 8, 8]; the step graph takes ['N', 1, 8, 8] (N samples along axis 0)"),
    (dict(x=np.zeros((4, 1, 8, 8), np.float32), labels=np.zeros(5, np.int64)),
     "--data: the arrays differ in length along axis 0: x 4, labels 5"),
], ids=["missing", "unknown", "dtype", "shape", "length"])
def test_bad_data_is_refused_by_name(exported, tmp_path, arrays, message, capsys):
    np.savez(tmp_path / "bad.npz", **arrays)
    assert cli.main(["train", os.fspath(exported / "step.onnx"), "--data", os.fspath(tmp_path / "bad.npz"),
                     "--out", os.fspath(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == f"normgrad train: {message}\n"


@pytest.mark.slow
def test_bad_data_in_a_process_is_one_line_and_exit_1(exported, tmp_path):
    np.savez(tmp_path / "bad.npz", x=np.zeros((4, 1, 8, 8), np.float32))
    process = subprocess.run([sys.executable, "-m", "normgrad.tools.cli", "train", os.fspath(exported / "step.onnx"),
                              "--data", os.fspath(tmp_path / "bad.npz"), "--out", os.fspath(tmp_path / "out")],
                             capture_output=True, text=True, timeout=300)
    assert (process.returncode, process.stderr) == (
        1, "normgrad train: --data: no array 'labels'; the step graph's data inputs are x, labels\n")


def test_bad_options_are_one_line(exported, tmp_path, capsys):
    assert _train(exported, tmp_path / "o", "--scheduler", "Warmup(steps=3)") == 1
    assert "--scheduler: 'Warmup' is not one of StepLR" in capsys.readouterr().err
    assert cli.main(["train", os.fspath(exported / "step.onnx"), "--data", os.fspath(exported / "train.npz"),
                     "--momentum", "0.9", "--out", os.fspath(tmp_path / "o")]) == 1
    assert "takes no hyperparameter 'momentum'" in capsys.readouterr().err
    assert cli.main(["train", "--data", "x.npz"]) == 2  # the digits demo takes no --data
    assert "--data needs a STEP graph" in capsys.readouterr().err


def test_version(capsys):
    from importlib.metadata import PackageNotFoundError, version

    try:
        expected = version("normgrad")
    except PackageNotFoundError:  # the package copied without its metadata (.ci/run's other onnxruntimes)
        expected = "unknown (not installed)"
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"normgrad {expected}\n"


def test_demo_train_is_the_digits_demo_of_train(capsys):
    assert cli.main(["demo", "train", "--help"]) == 0
    demo_help = capsys.readouterr().out
    assert cli.main(["train", "--help"]) == 0
    assert demo_help == capsys.readouterr().out and demo_help.startswith("usage: normgrad train")


def _damaged(path, damage: str) -> bytes:
    data = path.read_bytes()
    if damage == "truncated":
        return data[:len(data) // 2]
    if damage == "empty":
        return b""
    # a .npz: inside the first array's data (a bad CRC, a bad deflate stream); a .npy: its header
    at = 12 if path.suffix == ".npy" else len(data) // 2
    return data[:at] + bytes(b ^ 0xFF for b in data[at:at + 16]) + data[at + 16:]


@pytest.mark.parametrize("kind", ["npz", "npz_compressed", "npy"])
@pytest.mark.parametrize("damage", ["truncated", "empty", "flipped"])
def test_truncated_or_corrupted_array_file_is_one_line(exported, tmp_path, kind, damage, capsys):
    """Every way np.load fails on a damaged file (BadZipFile, zlib.error, EOFError, a bad
    header, a short read) is one line naming the file, exit 1."""
    arrays = dict(x=np.random.default_rng(0).random((64, 1, 8, 8), np.float32), labels=np.arange(64) % 10)
    if kind == "npy":
        good, bad = tmp_path / "good.npy", tmp_path / "x.npy"
        np.save(good, arrays["x"])
        np.save(tmp_path / "labels.npy", arrays["labels"])
        data = [os.fspath(tmp_path / "labels.npy"), os.fspath(bad)]
    else:
        good = tmp_path / "good.npz"
        (np.savez_compressed if kind == "npz_compressed" else np.savez)(good, **arrays)
        bad = tmp_path / "bad.npz"
        data = [os.fspath(bad)]
    bad.write_bytes(_damaged(good, damage))
    assert cli.main(["train", os.fspath(exported / "step.onnx"), "--data", *data, "--out", os.fspath(tmp_path / "out"),
                     "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"normgrad train: --data: {bad} is not a readable NumPy .{kind[:3]} file") and err.count("\n") == 1


@pytest.mark.parametrize("scheduler,message", [
    ("MultiStepLR(milestones=['a'])", r"MultiStepLR milestones\[0\] must be an integer >= 0, got 'a'"),
    ("ReduceLROnPlateau(patience='2')", "ReduceLROnPlateau patience must be an integer >= 0, got '2'"),
    ("ConstantLR(factor=0, total_iters=1)", r"ConstantLR factor must be in \(0, 1\]"),
    ("OneCycleLR(max_lr=0.01, total_steps=2, pct_start=0.5)", "its warm-up phase has no steps"),
    ("StepLR(step_size=2, gama=0.5)", "unexpected keyword argument 'gama'"),
])
def test_bad_scheduler_values_are_one_line_before_training(exported, tmp_path, scheduler, message, capsys):
    out = tmp_path / "o"
    assert _train(exported, out, "--scheduler", scheduler, "--epochs", "1") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"normgrad train: --scheduler {scheduler.split('(')[0]}: ")
    assert re.search(message, err), err
    assert not (out / "checkpoints").exists()  # refused before any training
