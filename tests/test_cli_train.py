"""`normgrad train STEP.onnx --data ...` end to end: `normgrad export` a model, train it on
.npz arrays from the command line, get bitwise the state of a hand-written Trainer loop with
the same batches and schedule, resume it for one more epoch; bad data refused by name in one
line; `normgrad --version`."""

from __future__ import annotations

import csv
import io
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
    (dict(x=np.zeros((4, 1, 8, 8), np.complex64), labels=np.zeros(4, np.int64)),
     "--data: array 'x' is complex64; the step graph takes float32"),
    (dict(x=np.full((4, 1, 8, 8), 1e39), labels=np.zeros(4, np.int64)),
     "--data: array 'x' is float64 with values beyond float32's range (e.g. 1e+39); the step graph takes float32"),
    (dict(x=np.full((4, 1, 8, 8), 2 ** 24 + 1), labels=np.zeros(4, np.int64)),
     "--data: array 'x' is int64 with values float32 cannot hold exactly (e.g. 16777217); the step graph takes float32"),
    (dict(x=np.zeros((4, 1, 8, 8), np.float32), labels=np.array([0.0, 1.0, 2.5, 3.0])),
     "--data: array 'labels' is float64 with non-integral values (e.g. 2.5); the step graph takes int64"),
    (dict(x=np.zeros((4, 1, 8, 8), np.float32), labels=np.array([0, 1, 2 ** 63, 3], np.uint64)),
     "--data: array 'labels' is uint64 with values int64 cannot hold exactly (e.g. 9223372036854775808); the step "
     "graph takes int64"),
    (dict(x=np.zeros((4, 8, 8), np.float32), labels=np.zeros(4, np.int64)),
     "--data: array 'x' has shape [4, 8, 8]; the step graph takes ['N', 1, 8, 8] (N samples along axis 0)"),
    (dict(x=np.zeros((4, 1, 8, 8), np.float32), labels=np.zeros(5, np.int64)),
     "--data: the arrays differ in length along axis 0: x 4, labels 5"),
], ids=["missing", "unknown", "dtype", "float-range", "inexact-int", "fractional-label", "label-range", "shape",
        "length"])
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
    assert _train(exported, tmp_path / "o", "--seed", "-5") == 2  # numpy's shuffling takes no negative seed
    assert "argument --seed: must be an integer >= 0; got '-5'" in capsys.readouterr().err


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


def _run(exported, out, *extra):
    """`normgrad train` of the exported digits CNN: 300 samples, batches of 40 (8 steps an epoch)."""
    return cli.main(["train", os.fspath(exported / "step.onnx"), "--batch-size", "40", "--out", os.fspath(out),
                     "--no-progress", "--seed", "3", *extra])


def _reference(exported, epochs, hyperparameters_by_epoch, data="train.npz", **trainer_options):
    """A hand-written Trainer loop over the batches `normgrad train --seed 3 --batch-size 40` takes."""
    trainer = Trainer(os.fspath(exported / "step.onnx"), os.fspath(exported / "step.ckpt"), **trainer_options)
    with np.load(exported / data) as archive:
        batches = loop.array_batches({"x": archive["x"], "labels": archive["labels"]}, 40, shuffle=True, seed=3)
    for epoch in range(1, epochs + 1):
        trainer.hyperparameters.update(hyperparameters_by_epoch[epoch])
        for batch in batches(epoch):
            trainer.step(batch)
    return trainer


def _same_state(exported, checkpoint, reference) -> bool:
    trained = Trainer(os.fspath(exported / "step.onnx"), os.fspath(checkpoint))
    return trained.step_count == reference.step_count and all(
        trained.state_dict()[k].tobytes() == v.tobytes() for k, v in reference.state_dict().items())


def test_resume_applies_the_hyperparameters_given_and_says_so(exported, tmp_path, capsys):
    """`--resume --lr 0.5 --weight-decay 0.2` after a run at 0.01 / 0: the steps after the
    resume use 0.5 / 0.2 (the state is a hand-written loop's that switches at epoch 2,
    bitwise; metrics.csv logs them), and the first line says what changed."""
    out = tmp_path / "run"
    data = ["--data", os.fspath(exported / "train.npz")]
    assert _run(exported, out, *data, "--epochs", "1", "--lr", "0.01", "--weight-decay", "0") == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == ("training: lr 0.01 (given), weight_decay 0 (given), beta1 0.9 (the step graph's), beta2 0.999 "
                     "(the step graph's), eps 1e-08 (the step graph's), max_grad_norm inf (the step graph's); "
                     "batch size 40, 1 epoch")
    assert _run(exported, out, *data, "--epochs", "2", "--resume", "--lr", "0.5", "--weight-decay", "0.2") == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("resuming at step 8: lr 0.5 (given; the checkpoint had 0.01), weight_decay 0.2 (given; "
                            "the checkpoint had 0), beta1 0.9 (the checkpoint's)")
    reference = _reference(exported, 2, {1: dict(lr=0.01, weight_decay=0.0), 2: dict(lr=0.5, weight_decay=0.2)})
    assert _same_state(exported, out / "checkpoints" / "step-00000016.ckpt", reference)
    rows = [r for r in csv.DictReader((out / "metrics.csv").read_text().splitlines()) if r["loss"]]
    assert [(float(r["lr"]), float(r["weight_decay"])) for r in rows] == [(0.01, 0.0)] * 8 + [(0.5, 0.2)] * 8


def test_resume_refuses_a_new_start_of_a_scheduled_hyperparameter(exported, tmp_path, capsys):
    """The scheduler's lr is its own: resuming with the --lr the run started from goes on;
    another is refused before any step (the scheduler's state would overrule it)."""
    out = tmp_path / "run"
    data = ["--data", os.fspath(exported / "train.npz"), "--scheduler", "StepLR(step_size=1, gamma=0.5)"]
    assert _run(exported, out, *data, "--epochs", "1", "--lr", "0.01") == 0
    assert "lr 0.01 (scheduled by StepLR from 0.01)" in capsys.readouterr().out
    now = Trainer(os.fspath(exported / "step.onnx"), os.fspath(out / "checkpoints" / "step-00000008.ckpt"))
    now = now.hyperparameters["lr"]  # the checkpoint's lr, where its StepLR left it
    assert _run(exported, out, *data, "--epochs", "2", "--resume", "--lr", "0.5") == 1
    assert capsys.readouterr().err == (
        f"normgrad train: --lr 0.5 with --resume: the checkpoint's StepLR schedules lr from 0.01 (now {now:g}); resume "
        "with --lr 0.01 or without --lr, or start a new run (another --out)\n")
    assert sorted(os.listdir(out / "checkpoints"))[-1] == "step-00000008.json"  # no step taken
    assert _run(exported, out, *data, "--epochs", "2", "--resume", "--lr", "0.01") == 0  # the same command, resumed
    assert capsys.readouterr().out.startswith(f"resuming at step 8: lr {now:g} (scheduled by StepLR from 0.01)")


@pytest.mark.parametrize("first, then", [((), ("--eval", "val.npz")), (("--eval", "val.npz"), ()),
                                         (("--eval", "val.npz"), ("--eval", "val.npz", "--metrics", "accuracy"))])
def test_resume_with_other_evaluation_or_metrics_is_one_line(exported, tmp_path, capsys, first, then):
    """The checkpoint's history has the columns of its run: resuming with evaluation added,
    dropped or other metrics is refused in one line, no step taken (was a KeyError or the
    CSV writer's ValueError)."""
    out = tmp_path / "run"
    data = ["--data", os.fspath(exported / "train.npz")]
    def named(args):
        return [os.fspath(exported / a) if a.endswith(".npz") else a for a in args]
    assert _run(exported, out, *data, "--epochs", "1", *named(first)) == 0
    capsys.readouterr()
    assert _run(exported, out, *data, "--epochs", "2", "--resume", *named(then)) == 1
    err = capsys.readouterr().err
    assert err.startswith("normgrad train: cannot resume from ") and "give fit the same evaluation batches and metrics" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert sorted(os.listdir(out / "checkpoints"))[-1] == "step-00000008.json"  # no step taken


def test_start_line_shows_the_step_graphs_own_lr(exported, tmp_path, capsys):
    """No --lr: the line says the lr the step graph trains at (export's 0.001 for AdamW, not
    the digits demo's 0.003 that --help once showed as the default)."""
    assert _run(exported, tmp_path / "run", "--data", os.fspath(exported / "train.npz"), "--epochs", "1") == 0
    line = capsys.readouterr().out.splitlines()[0]
    own = Trainer(os.fspath(exported / "step.onnx"), os.fspath(exported / "step.ckpt")).hyperparameters["lr"]
    assert line.startswith(f"training: lr {own:g} (the step graph's), weight_decay 0.001 (the step graph's)")


def test_lossless_casts_train_as_the_step_graphs_dtypes(exported, tmp_path, capsys):
    """float64 features (every value fits float32) and int32 labels: cast, said once, and
    trained bitwise as the float32 / int64 arrays."""
    with np.load(exported / "train.npz") as archive:
        np.savez(tmp_path / "wide.npz", x=archive["x"].astype(np.float64), labels=archive["labels"].astype(np.int32))
    assert _run(exported, tmp_path / "run", "--data", os.fspath(tmp_path / "wide.npz"), "--epochs", "1") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("--data: cast x float64 -> float32, labels int32 -> int64 (the step graph's dtypes; no value "
                        "changes beyond float rounding)")
    reference = _reference(exported, 1, {1: {}})
    assert _same_state(exported, tmp_path / "run" / "checkpoints" / "step-00000008.ckpt", reference)


def test_accumulation_evaluate_every_threads_and_f1(exported, tmp_path, capsys):
    """--accumulation 2 is Trainer(accumulation=2) (bitwise); --evaluate-every 3 evaluates at
    steps 3 and 6 besides the epoch's end; --threads 1 runs; --metrics f1_macro f1_micro are
    logged (their values: tests/test_metrics.py)."""
    out = tmp_path / "run"
    assert _run(exported, out, "--data", os.fspath(exported / "train.npz"), "--eval", os.fspath(exported / "val.npz"),
                "--epochs", "1", "--accumulation", "2", "--evaluate-every", "3", "--threads", "1",
                "--metrics", "f1_macro", "f1_micro") == 0
    assert "batch size 40 in 2 micro-batches, 1 epoch" in capsys.readouterr().out.splitlines()[0]
    assert _same_state(exported, out / "checkpoints" / "step-00000008.ckpt", _reference(exported, 1, {1: {}},
                                                                                         accumulation=2))
    evaluations = [r for r in csv.DictReader((out / "metrics.csv").read_text().splitlines()) if r["val_loss"]]
    assert [int(r["step"]) for r in evaluations] == [3, 6, 8]
    assert all(0 <= float(r["val_f1_macro"]) <= float(r["val_f1_micro"]) + 1 for r in evaluations)


def test_accumulation_that_does_not_divide_the_batch_is_refused(exported, tmp_path, capsys):
    assert _run(exported, tmp_path / "run", "--data", os.fspath(exported / "train.npz"), "--accumulation", "3") == 1
    assert capsys.readouterr().err == ("normgrad train: --accumulation 3: the batch size 40 is not a multiple of it "
                                       "(each batch is split into equal micro-batches)\n")


def test_config_file_sets_every_flag_by_name_and_the_command_line_overrides(exported, tmp_path, capsys):
    """A TOML file of flag names (dashes or underscores, the STEP too) runs as the flags
    would; a flag given on the command line wins; the run is a hand-written loop's."""
    config = tmp_path / "train.toml"
    config.write_text(f'step = "{exported / "step.onnx"}"\ndata = ["{exported / "train.npz"}"]\nepochs = 1\n'
                      f'batch_size = 40\nseed = 3\nlr = 0.02\nbetas = [0.8, 0.99]\nno-progress = true\n'
                      f'out = "{tmp_path / "run"}"\n')
    assert cli.main(["train", "--config", os.fspath(config), "--lr", "0.004"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(
        "training: lr 0.004 (given), weight_decay 0.001 (the step graph's), beta1 0.8 (given), beta2 0.99 (given)")
    reference = _reference(exported, 1, {1: dict(lr=0.004, beta1=0.8, beta2=0.99)})
    assert _same_state(exported, tmp_path / "run" / "checkpoints" / "step-00000008.ckpt", reference)


@pytest.mark.parametrize("name,text,message", [
    ("a.toml", "learning_rate = 0.1\n", "unknown key 'learning_rate'; the keys are the flags' names: step, epochs, "),
    ("a.toml", 'epochs = "many"\n', "epochs: must be a positive integer; got 'many'"),
    ("a.toml", "betas = [0.9]\n", "betas: takes 2 values; got [0.9]"),
    ("a.toml", "resume = 1\n", "resume: must be true or false; got 1"),
    ("a.toml", 'metrics = ["f2"]\n', "metrics: 'f2' is not one of accuracy, perplexity, top5, f1_macro, f1_micro"),
    ("a.toml", "epochs = \n", "Invalid value (at line 1, column 10)"),
    ("a.json", '{"config": "b.json"}', "unknown key 'config'"),
    ("a.json", "[1, 2]", "holds list, not a mapping of flag names to values"),
    ("a.ini", "", "not a .toml, .yaml, .yml or .json file"),
], ids=["unknown", "type", "count", "switch", "choice", "syntax", "nested", "list", "suffix"])
def test_bad_config_is_one_line(tmp_path, capsys, name, text, message):
    (tmp_path / name).write_text(text)
    assert cli.main(["train", "--config", os.fspath(tmp_path / name)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"normgrad train: --config {tmp_path / name}: {message}") and err.count("\n") == 1


def test_yaml_config(exported, tmp_path, capsys):
    pytest.importorskip("yaml")
    config = tmp_path / "train.yaml"
    config.write_text(f"data: [{exported / 'train.npz'}]\nepochs: 1\nbatch-size: 40\nseed: 3\nno_progress: true\n"
                      f"out: {tmp_path / 'run'}\nmetrics: [accuracy]\n")
    assert cli.main(["train", os.fspath(exported / "step.onnx"), "--config", os.fspath(config)]) == 1
    assert capsys.readouterr().err == "normgrad train: --metrics needs validation arrays: --eval FILE\n"


def test_train_output_into_a_closed_pipe_ends_quietly(exported, tmp_path, monkeypatch, capsys):
    """`normgrad train ... | head -1`: the first line goes out, the next raises BrokenPipeError:
    exit 141 with nothing on stderr."""
    lines = []

    class HeadOne(io.StringIO):
        def write(self, text):
            if lines:
                raise BrokenPipeError(32, "Broken pipe")
            lines.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stdout", HeadOne())
    assert _run(exported, tmp_path / "run", "--data", os.fspath(exported / "train.npz"), "--epochs", "1") == cli.SIGPIPE_EXIT
    assert lines[0].startswith("training: lr") and capsys.readouterr().err == ""


@pytest.mark.parametrize("step,flag", [(True, "--out"), (True, "--checkpoint-dir"), (False, "--out")],
                         ids=["step-out", "step-checkpoint-dir", "demo-out"])
def test_a_file_as_output_folder_is_refused_before_training(exported, tmp_path, capsys, step, flag):
    (tmp_path / "taken").write_text("a file")
    head = ["train", os.fspath(exported / "step.onnx"), "--data", os.fspath(exported / "train.npz")] if step else ["train"]
    assert cli.main([*head, flag, os.fspath(tmp_path / "taken")]) == 1
    captured = capsys.readouterr()
    assert captured.err == f"normgrad train: {flag} {tmp_path / 'taken'} is a file, not a folder\n" and captured.out == ""
