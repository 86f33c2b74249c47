"""Trainer.fit (normgrad.loop): early stopping where a hand-written loop stops, the best
checkpoint is the best evaluation, a crashed run resumed from its checkpoint folder goes on
bitwise as the uninterrupted run, and the CSV, TensorBoard and PNG logs hold the logged values;
the metrics against torch's. On scikit-learn's digits (a small CNN) and a tiny transformers BERT."""

from __future__ import annotations

import csv
import os
import re

import numpy as np
import pytest

from normgrad import loop, metrics, schedules
from normgrad.train import Trainer, TrainerError

pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def digits():
    from normgrad.graphs import build_step_graph, build_training_graph, examples
    from normgrad.tools.train import load_digits

    images, labels, test_images, test_labels = load_digits(0)
    step_graph, initial = build_step_graph(build_training_graph(examples.digits_cnn(seed=0), loss="cross_entropy"),
                                           "adamw", weight_decay=1e-4)
    train = loop.array_batches({"x": images[:400], "labels": labels[:400]}, 50, shuffle=True, seed=3)
    validation = loop.array_batches({"x": test_images[:150], "labels": test_labels[:150]}, 64)
    return step_graph, initial, train, validation


def _validation_loss(trainer, batches):
    """The size-weighted mean of the batch losses, by hand."""
    losses = [(trainer.evaluate(batch).loss, len(batch["labels"])) for batch in batches]
    return sum(loss * size for loss, size in losses) / sum(size for _, size in losses)


def _same_state(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name


@pytest.mark.slow
def test_early_stopping_stops_where_a_hand_written_loop_does(digits):
    step_graph, initial, train, validation = digits
    patience, min_delta, epochs = 2, 0.05, 12
    trainer = Trainer(step_graph, initial, lr=3e-3)
    stopper = loop.EarlyStopping(monitor="val_loss", patience=patience, min_delta=min_delta)
    result = trainer.fit(train, epochs=epochs, evaluation=validation, callbacks=[stopper], progress=False)

    reference = Trainer(step_graph, initial, lr=3e-3)
    best, wait, losses = None, 0, []
    for epoch in range(1, epochs + 1):
        for batch in train(epoch):
            reference.step(batch)
        losses.append(_validation_loss(reference, validation(epoch)))
        if best is None or losses[-1] < best - min_delta:
            best, wait = losses[-1], 0
        else:
            wait += 1
            if wait >= patience:
                break
    assert len(losses) < epochs  # it did stop early
    assert result.stopped_early and stopper.stopped_at == reference.step_count
    assert [r["val_loss"] for r in result.evaluations] == losses
    assert [r["epoch"] for r in result.evaluations] == list(range(1, len(losses) + 1))
    _same_state(trainer.state_dict(), reference.state_dict())


def test_best_checkpoint_is_the_best_evaluation(digits, tmp_path):
    """The learning rate grows 4x per epoch (ExponentialLR), so the validation loss turns
    up and the best checkpoint is not the last."""
    step_graph, initial, train, validation = digits
    trainer = Trainer(step_graph, initial, lr=1e-3, nonfinite="skip")
    scheduler = schedules.ExponentialLR(trainer, gamma=4.0)
    result = trainer.fit(train, epochs=6, evaluation=validation, metrics={"accuracy": metrics.accuracy},
                         scheduler=scheduler, checkpoint_dir=tmp_path, keep_last=2, progress=False)
    # the metric reads the evaluation's logits: the steps ask for none, their session exposes none
    assert "logits" in trainer.forward_outputs and "logits" not in trainer._step_part.outputs
    val_losses = [r["val_loss"] for r in result.evaluations]
    best = int(np.argmin(val_losses))
    assert best < len(val_losses) - 1
    assert result.best == result.evaluations[best]
    assert result.best_checkpoint == os.fspath(tmp_path / f"best-{result.best['step']:08d}.ckpt")
    reloaded = Trainer(step_graph, result.best_checkpoint)
    assert reloaded.step_count == result.best["step"]
    assert _validation_loss(reloaded, validation(1)) == min(val_losses)
    # saved at the evaluation, before the epoch's scheduler.step(): the lr of the epoch it ended
    assert reloaded.hyperparameters["lr"] == pytest.approx(1e-3 * 4.0 ** best, rel=1e-12)
    names = sorted(os.listdir(tmp_path))  # the best pair and the last two
    last = [r["step"] for r in result.evaluations[-2:]]
    assert names == sorted([f"best-{result.best['step']:08d}.{s}" for s in ("ckpt", "json")]
                           + [f"step-{k:08d}.{s}" for k in last for s in ("ckpt", "json")])


class _Crash(loop.Callback):
    def __init__(self, at_step):
        self.at_step = at_step

    def on_step_end(self, loop_, record):
        if record["step"] == self.at_step:
            raise RuntimeError("simulated crash")


def _run(step_graph, initial, train, validation, folder, logs, *, resume=False, crash=None):
    trainer = Trainer(step_graph, initial, lr=1e-3)
    scheduler = schedules.OneCycleLR(trainer, max_lr=1e-2, total_steps=40,
                                     cycle_momentum="beta1" in list(trainer.hyperparameters))
    callbacks = [loop.EarlyStopping(monitor="val_accuracy", mode="max", patience=10)]
    if crash is not None:
        callbacks.append(crash)
    result = trainer.fit(train, epochs=5, evaluation=validation,
                         metrics={"accuracy": metrics.accuracy, "top2": metrics.top_k_accuracy(2)},
                         scheduler=scheduler, scheduler_interval="step", checkpoint_dir=folder, checkpoint_every=5,
                         resume=resume, log_dir=logs, progress=False, callbacks=callbacks)
    return trainer, result


@pytest.mark.slow
def test_resume_from_a_folder_continues_bitwise_and_logs_read_back(digits, tmp_path):
    """A run that crashes at step 27 (its latest checkpoint: step 25, one batch into epoch 4),
    resumed from its folder, ends bitwise where the uninterrupted run ends, with the same
    history, CSV, and TensorBoard scalars (the crashed steps past the checkpoint purged)."""
    pytest.importorskip("tensorboard")
    step_graph, initial, train, validation = digits
    whole, whole_result = _run(step_graph, initial, train, validation, tmp_path / "a", tmp_path / "a_logs")
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(step_graph, initial, train, validation, tmp_path / "b", tmp_path / "b_logs", crash=_Crash(27))
    assert loop._latest(os.fspath(tmp_path / "b"), "step", ".ckpt").endswith("step-00000025.ckpt")
    resumed, result = _run(step_graph, initial, train, validation, tmp_path / "b", tmp_path / "b_logs", resume=True)
    assert resumed.step_count == whole.step_count == 40
    _same_state(resumed.state_dict(), whole.state_dict())
    assert dict(resumed.hyperparameters) == dict(whole.hyperparameters)
    assert result.history == whole_result.history and result.evaluations == whole_result.evaluations
    assert len(result.history) == 40 and len(result.evaluations) == 5

    # CSV: the resumed run's file is the uninterrupted one's, and holds the values
    text = (tmp_path / "b_logs" / "metrics.csv").read_text()
    assert text == (tmp_path / "a_logs" / "metrics.csv").read_text()
    rows = list(csv.DictReader(text.splitlines()))
    step_rows = [r for r in rows if r["loss"]]
    assert [float(r["loss"]) for r in step_rows] == [r["loss"] for r in whole_result.history]
    assert [float(r["lr"]) for r in step_rows] == [r["lr"] for r in whole_result.history]
    assert [float(r["beta1"]) for r in step_rows] == [r["beta1"] for r in whole_result.history]  # OneCycleLR's
    assert [float(r["val_top2"]) for r in rows if r["val_loss"]] == [r["val_top2"] for r in whole_result.evaluations]

    # TensorBoard, through the tensorboard package's reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for folder in ("a_logs", "b_logs"):
        events = EventAccumulator(os.fspath(tmp_path / folder))
        events.Reload()
        losses = events.Scalars("loss")
        assert [e.step for e in losses] == list(range(1, 41))
        assert [e.value for e in losses] == [np.float32(r["loss"]) for r in whole_result.history]
        for name in ("val_loss", "val_accuracy", "train_loss"):
            assert [(e.step, e.value) for e in events.Scalars(name)] == [
                (r["step"], np.float32(r[name])) for r in whole_result.evaluations]

    # the PNG: an image
    import matplotlib.image

    image = matplotlib.image.imread(os.fspath(tmp_path / "b_logs" / "training.png"))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_resume_with_another_setup_is_refused(digits, tmp_path):
    step_graph, initial, train, validation = digits
    Trainer(step_graph, initial).fit(train, epochs=1, checkpoint_dir=tmp_path, progress=False)
    trainer = Trainer(step_graph, initial)
    with pytest.raises(TrainerError, match="without a scheduler"):
        trainer.fit(train, epochs=2, checkpoint_dir=tmp_path, resume=True, progress=False,
                    scheduler=schedules.StepLR(trainer, step_size=1))
    with pytest.raises(TrainerError, match="monitor 'val_f1' is not among"):
        Trainer(step_graph, initial).fit(train, epochs=1, evaluation=validation, monitor="val_f1", progress=False)
    with pytest.raises(TrainerError, match="metrics need validation batches"):
        Trainer(step_graph, initial).fit(train, metrics={"accuracy": metrics.accuracy}, progress=False)
    with pytest.raises(TrainerError, match="no batch in epoch 2"):
        Trainer(step_graph, initial).fit(iter(train(1)), epochs=2, progress=False)


@pytest.mark.parametrize("shape", [(40, 7), (6, 7, 5), (4, 3, 7)])
def test_metrics_match_torch(shape):
    """accuracy, top-k and perplexity against torch, class axis 1 or last, -100 labels ignored."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(sum(shape))
    outputs = rng.standard_normal(shape).astype(np.float32)
    class_axis = 1 if shape != (4, 3, 7) else -1
    classes = shape[class_axis]
    label_shape = tuple(d for i, d in enumerate(shape) if i != class_axis % len(shape))
    labels = rng.integers(0, classes, label_shape)
    labels.flat[::5] = -100
    logits = torch.from_numpy(np.moveaxis(outputs, class_axis, -1).reshape(-1, classes)).double()
    target = torch.from_numpy(labels.reshape(-1))
    kept = target >= 0
    assert metrics.accuracy(outputs, labels) == pytest.approx(
        (logits[kept].argmax(1) == target[kept]).double().mean().item(), abs=1e-12)
    for k in (1, 3):
        top = logits[kept].topk(k, dim=1).indices
        expected = (top == target[kept, None]).any(1).double().mean().item()
        assert metrics.top_k_accuracy(k)(outputs, labels) == pytest.approx(expected, abs=1e-12)
    expected = torch.exp(torch.nn.functional.cross_entropy(logits, target, ignore_index=-100)).item()
    assert metrics.perplexity(outputs, labels) == pytest.approx(expected, rel=1e-12)


@pytest.mark.slow
def test_fit_on_a_tiny_bert(tmp_path):
    """A tiny transformers BERT classifier (random weights, Dropout on, seeded): fit with
    early stopping stops where a hand-written loop does with the same states; the best
    checkpoint evaluates to the best val_loss; a crashed run resumed from its folder ends bitwise."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import normgrad.torch
    from normgrad.graphs import build_step_graph, build_training_graph

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=2,
                                     attn_implementation="eager")
    forward = normgrad.torch.export(transformers.BertForSequenceClassification(config).train(),
                                    (torch.randint(1, 50, (8, 10)),), os.fspath(tmp_path / "bert.onnx"),
                                    input_names=["input_ids"], output_names=["logits"], dynamic_axes={"input_ids": [0]})
    step_graph, initial = build_step_graph(build_training_graph(forward, loss="cross_entropy"), "adamw")
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 50, (192, 10))
    labels = (ids == 7).any(axis=1).astype(np.int64)
    train = loop.array_batches({"input_ids": ids[:128], "labels": labels[:128]}, 16, shuffle=True)
    validation = loop.array_batches({"input_ids": ids[128:], "labels": labels[128:]}, 32)
    patience, epochs = 2, 10

    def run(folder, crash=None, resume=False):
        trainer = Trainer(step_graph, initial, lr=3e-2, seed=5)
        callbacks = [loop.EarlyStopping("val_loss", patience=patience)] + ([crash] if crash else [])
        result = trainer.fit(train, epochs=epochs, evaluation=validation, metrics={"accuracy": metrics.accuracy},
                             callbacks=callbacks, checkpoint_dir=folder, checkpoint_every=3, resume=resume,
                             progress=False)
        return trainer, result

    trainer, result = run(tmp_path / "a")
    reference = Trainer(step_graph, initial, lr=3e-2, seed=5)
    best, wait, losses = None, 0, []
    for epoch in range(1, epochs + 1):
        for batch in train(epoch):
            reference.step(batch)
        losses.append(_validation_loss(reference, validation(epoch)))
        if best is None or losses[-1] < best:
            best, wait = losses[-1], 0
        else:
            wait += 1
            if wait >= patience:
                break
    assert len(losses) < epochs and result.stopped_early
    assert [r["val_loss"] for r in result.evaluations] == losses
    _same_state(trainer.state_dict(), reference.state_dict())
    assert _validation_loss(Trainer(step_graph, result.best_checkpoint), validation(1)) == min(losses)

    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tmp_path / "b", crash=_Crash(20))
    resumed, resumed_result = run(tmp_path / "b", resume=True)
    _same_state(resumed.state_dict(), trainer.state_dict())
    assert resumed_result.history == result.history and resumed_result.evaluations == result.evaluations


def test_plateau_scheduler_and_evaluations_every_n_steps(digits):
    """evaluate_every=3 over two epochs of 8 steps: evaluations at steps 3, 6, 8 (the epoch's
    end), 9, 12, 15, 16; ReduceLROnPlateau stepped with each val_loss sets the lr of the
    steps after it as torch's ReduceLROnPlateau fed the same values."""
    torch = pytest.importorskip("torch")
    step_graph, initial, train, validation = digits
    trainer = Trainer(step_graph, initial, lr=2e-2)
    scheduler = schedules.ReduceLROnPlateau(trainer, patience=0, factor=0.5, threshold=0.05)
    result = trainer.fit(train, epochs=2, evaluation=validation, evaluate_every=3, scheduler=scheduler, progress=False)
    assert [r["step"] for r in result.evaluations] == [3, 6, 8, 9, 12, 15, 16]
    assert [r["epoch"] for r in result.evaluations] == [1, 1, 1, 2, 2, 2, 2]

    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=2e-2)
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5, threshold=0.05)
    expected = {}
    for record in result.evaluations:
        reference.step(record["val_loss"])
        expected[record["step"] + 1] = optimizer.param_groups[0]["lr"]
    lr = 2e-2
    for record in result.history:
        lr = expected.get(record["step"], lr)
        assert record["lr"] == lr, record
    assert len(set(r["lr"] for r in result.history)) > 1  # the plateau reduced it


@pytest.fixture(scope="module")
def small(digits):
    """The digits step graph on 200 training samples (4 steps an epoch) and 100 validation ones."""
    from normgrad.tools.train import load_digits

    step_graph, initial, _, _ = digits
    images, labels, test_images, test_labels = load_digits(0)
    train = loop.array_batches({"x": images[:200], "labels": labels[:200]}, 50, shuffle=True, seed=3)
    validation = loop.array_batches({"x": test_images[:100], "labels": test_labels[:100]}, 50)
    return step_graph, initial, train, validation


def _csv_rows(path):
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_model_checkpoint_keeps_the_top_k_of_the_logged_values(small, tmp_path):
    """ModelCheckpoint(save_top_k=2) keeps exactly the pairs of the two lowest val_loss values
    of metrics.csv (the lr grows 4x an epoch, so the loss turns up and the best are not the
    last), each checkpoint evaluating to its logged val_loss."""
    step_graph, initial, train, validation = small
    trainer = Trainer(step_graph, initial, lr=1e-3, nonfinite="skip")
    keeper = loop.ModelCheckpoint(dirpath=tmp_path / "ck", monitor="val_loss", mode="min", save_top_k=2)
    trainer.fit(train, epochs=6, evaluation=validation, scheduler=schedules.ExponentialLR(trainer, gamma=4.0),
                callbacks=[keeper], log_dir=tmp_path / "logs", progress=False)
    logged = {int(r["step"]): float(r["val_loss"]) for r in _csv_rows(tmp_path / "logs" / "metrics.csv") if r["val_loss"]}
    assert len(logged) == 6
    lowest = sorted(logged, key=logged.get)[:2]
    assert max(logged) not in lowest  # the best are not simply the latest
    expected = {os.fspath(tmp_path / "ck" / f"best-{step:08d}.ckpt"): logged[step] for step in lowest}
    assert keeper.best_k_models == expected
    assert keeper.best_model_path == os.fspath(tmp_path / "ck" / f"best-{lowest[0]:08d}.ckpt")
    assert keeper.best_model_score == logged[lowest[0]] and keeper.last_model_path is None
    assert sorted(os.listdir(tmp_path / "ck")) == sorted(f"best-{s:08d}.{x}" for s in lowest for x in ("ckpt", "json"))
    for path, value in expected.items():
        assert _validation_loss(Trainer(step_graph, path), validation(1)) == value


def test_a_nan_evaluation_is_never_the_best(small, tmp_path):
    """A metric that is NaN at the first evaluation (a 0/0) does not become the best forever:
    fit's best, its best checkpoint and a ModelCheckpoint's top-k skip it."""
    step_graph, initial, train, validation = small
    values = iter([float("nan"), 0.25, 0.5, float("nan"), 0.375])

    def odd(outputs, labels):
        return next(values)

    keeper = loop.ModelCheckpoint(tmp_path / "top", monitor="val_odd", mode="max", save_top_k=2)
    result = Trainer(step_graph, initial).fit(train, epochs=5, evaluation=validation, metrics={"odd": odd},
                                              monitor="val_odd", mode="max", checkpoint_dir=tmp_path / "ck",
                                              callbacks=[keeper], progress=False)
    assert [r["val_odd"] for r in result.evaluations][1:3] == [0.25, 0.5]
    assert result.best == result.evaluations[2] and result.best["step"] == 12
    assert result.best_checkpoint == os.fspath(tmp_path / "ck" / "best-00000012.ckpt")
    assert keeper.best_k_models == {os.fspath(tmp_path / "top" / "best-00000012.ckpt"): 0.5,
                                    os.fspath(tmp_path / "top" / "best-00000020.ckpt"): 0.375}


def test_checkpoint_json_is_standard_and_resumes_with_its_non_finite_values(small, tmp_path):
    """A NaN evaluation and an infinite value in a callback's state are written in the
    checkpoints' .json as strings a strict parser reads (standard JSON has no NaN or
    Infinity), and a resumed run reads them back as those floats."""
    import json
    import math

    step_graph, initial, train, validation = small
    values = iter([float("nan"), 0.25, float("inf"), 0.125])

    def odd(outputs, labels):
        return next(values)

    def fit(epochs, resume):
        return Trainer(step_graph, initial).fit(train, epochs=epochs, evaluation=validation, metrics={"odd": odd},
                                                checkpoint_dir=tmp_path / "ck", resume=resume, progress=False,
                                                callbacks=[loop.EarlyStopping(monitor="val_odd", patience=9)])

    def refuse(constant):
        raise ValueError(f"not standard JSON: {constant}")

    first = fit(3, False)
    for name in sorted(os.listdir(tmp_path / "ck")):
        if name.endswith(".json"):
            json.loads((tmp_path / "ck" / name).read_text(), parse_constant=refuse)
    resumed = fit(4, True)
    odds = [r["val_odd"] for r in resumed.evaluations]
    assert len(odds) == 4 and math.isnan(odds[0]) and odds[1:] == [0.25, math.inf, 0.125]
    assert resumed.evaluations[:3][1:] == first.evaluations[1:] and math.isnan(first.evaluations[0]["val_odd"])


def test_a_fresh_run_refuses_a_folder_holding_another_runs_checkpoints(small, tmp_path):
    """A run without resume into a folder an earlier (longer) run wrote: one TrainerError
    naming the folder and the remedies, and not a file of that run touched."""
    step_graph, initial, train, _ = small
    folder = tmp_path / "ck"
    Trainer(step_graph, initial).fit(train, epochs=3, checkpoint_dir=folder, keep_last=2, progress=False)
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    assert "step-00000012.ckpt" in before
    with pytest.raises(TrainerError, match=f"checkpoint folder {folder} holds an earlier run's checkpoints "
                                           r"\(best-00000012.ckpt, best-00000012.json and 4 more\): continue that run "
                                           r"with resume=True \(normgrad train: --resume\), or write to another folder"):
        Trainer(step_graph, initial).fit(train, epochs=1, checkpoint_dir=folder, progress=False)
    with pytest.raises(TrainerError, match="holds an earlier run's checkpoints"):
        Trainer(step_graph, initial).fit(train, epochs=1, callbacks=[loop.ModelCheckpoint(folder)], progress=False)
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before
    with pytest.raises(TrainerError, match="two ModelCheckpoint callbacks write to .*other: give each its own folder"):
        Trainer(step_graph, initial).fit(train, callbacks=[loop.ModelCheckpoint(tmp_path / "other"),
                                                           loop.ModelCheckpoint(tmp_path / "other")], progress=False)


@pytest.mark.parametrize("options,message", [
    ({"mode": "best"}, "mode must be 'min' or 'max', got 'best'"),
    ({"save_top_k": -2}, "save_top_k must be an integer >= -1, got -2"),
    ({"save_last": 1.5}, "save_last must be an integer >= 0, got 1.5"),
    ({"every_n_train_steps": 0}, "every_n_train_steps must be None or an integer >= 1, got 0"),
    ({"every_n_epochs": True}, "every_n_epochs must be None or an integer >= 1, got True"),
    ({"monitor": 3}, "monitor must be None or the name of an evaluation value, got 3"),
])
def test_model_checkpoint_refuses_a_bad_option_when_made(tmp_path, options, message):
    with pytest.raises(TrainerError, match=re.escape(message)):
        loop.ModelCheckpoint(tmp_path, **options)
    assert not os.listdir(tmp_path)


class _Killed(BaseException):
    """A kill: nothing of the run's own cleanup may count on it."""


def _kill_at_rename_of(monkeypatch, name, seen=None):
    """os.replace raising _Killed when it would put ``name`` in place (records every target in ``seen``)."""
    replace = os.replace

    def killing(source, target, *args, **kwargs):
        if seen is not None:
            seen.append(os.path.basename(target))
        if os.path.basename(target) == name:
            raise _Killed(name)
        return replace(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "replace", killing)


def _stepped_run(small, folder, logs=None, resume=False, callbacks=()):
    step_graph, initial, train, validation = small
    trainer = Trainer(step_graph, initial, lr=2e-3)
    result = trainer.fit(train, epochs=3, evaluation=validation, scheduler=schedules.StepLR(trainer, 1, gamma=0.5),
                         checkpoint_dir=folder, checkpoint_every=2, keep_last=2, resume=resume, log_dir=logs,
                         callbacks=list(callbacks), progress=False)
    return trainer, result


@pytest.mark.parametrize("killed_at", ["step-00000004.json", "step-00000006.ckpt"])
def test_a_step_checkpointed_twice_is_written_once_and_a_kill_resumes_bitwise(small, tmp_path, monkeypatch, killed_at):
    """checkpoint_every=2 with 4 steps an epoch: step 4 is both a checkpoint step and an epoch's
    end (whose StepLR step halves the lr). Its pair is written once, and a kill at its commit
    point or just after the epoch's boundary resumes bitwise as the uninterrupted run."""
    seen = []
    _kill_at_rename_of(monkeypatch, None, seen)
    whole, whole_result = _stepped_run(small, tmp_path / "a")
    pairs = [name for name in seen if name.startswith(("step-", "best-"))]
    assert "step-00000004.ckpt" in pairs and len(pairs) == len(set(pairs))  # no file written twice
    monkeypatch.undo()
    _kill_at_rename_of(monkeypatch, killed_at)
    with pytest.raises(_Killed):
        _stepped_run(small, tmp_path / "b")
    monkeypatch.undo()
    resumed, result = _stepped_run(small, tmp_path / "b", resume=True)
    assert resumed.step_count == whole.step_count == 12
    _same_state(resumed.state_dict(), whole.state_dict())
    assert dict(resumed.hyperparameters) == dict(whole.hyperparameters)
    assert result.history == whole_result.history and result.evaluations == whole_result.evaluations
    assert [r["lr"] for r in result.history] == [2e-3] * 4 + [1e-3] * 4 + [5e-4] * 4


def test_a_killed_runs_csv_reaches_its_checkpoint_and_resume_continues_it(small, tmp_path):
    """Killed at step 7 (its latest checkpoint: step 6, mid-epoch), the CSV on disk holds every
    row up to step 6 (flushed with the checkpoint); resumed, it equals the uninterrupted run's."""
    _stepped_run(small, tmp_path / "a", tmp_path / "a_logs")
    whole = (tmp_path / "a_logs" / "metrics.csv").read_text()

    class KillAtStep7(loop.Callback):  # the CSV as a kill at this instant leaves it
        def on_step_end(self, loop_, record):
            if record["step"] == 7:
                self.on_disk = (tmp_path / "b_logs" / "metrics.csv").read_text()
                raise _Killed()

    kill = KillAtStep7()
    with pytest.raises(_Killed):
        _stepped_run(small, tmp_path / "b", tmp_path / "b_logs", callbacks=[kill])
    lines = whole.splitlines(keepends=True)
    upto = 1 + sum(int(row["step"]) <= 6 for row in csv.DictReader(lines))
    assert kill.on_disk == "".join(lines[:upto])
    _stepped_run(small, tmp_path / "b", tmp_path / "b_logs", resume=True)
    assert (tmp_path / "b_logs" / "metrics.csv").read_text() == whole


def test_one_cycle_linear_stepped_each_step_finishes_the_run(small, tmp_path):
    """OneCycleLR(anneal_strategy="linear") stepped after each step, as torch documents it: the
    step after the last computes an lr just below 0 that no step uses; the run finishes with
    its last checkpoint, the lrs are torch's, and only a step that would use that lr is refused."""
    torch = pytest.importorskip("torch")
    step_graph, initial, train, validation = small
    trainer = Trainer(step_graph, initial)
    scheduler = schedules.OneCycleLR(trainer, max_lr=1e-2, total_steps=8, anneal_strategy="linear",
                                     cycle_momentum=False)
    result = trainer.fit(train, epochs=2, scheduler=scheduler, scheduler_interval="step", checkpoint_dir=tmp_path,
                         progress=False)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    reference = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=8, anneal_strategy="linear",
                                                    cycle_momentum=False)
    lrs = []
    for _ in range(8):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        reference.step()
    assert reference.get_last_lr()[0] < 0  # what torch leaves, unused
    assert [r["lr"] for r in result.history] == pytest.approx(lrs, rel=1e-12, abs=0)
    assert trainer.hyperparameters["lr"] == pytest.approx(reference.get_last_lr()[0], rel=1e-9)
    assert result.last_checkpoint == os.fspath(tmp_path / "step-00000008.ckpt")
    reloaded = Trainer(step_graph, result.last_checkpoint)
    assert reloaded.step_count == 8 and reloaded.hyperparameters["lr"] == trainer.hyperparameters["lr"]
    with pytest.raises(TrainerError, match=r"step 9 cannot use lr -.*a learning rate must be a finite number >= 0"):
        trainer.step(train(1)[0])


def test_hooks_run_in_order_and_a_value_set_before_the_step_is_used(small):
    step_graph, initial, train, _ = small
    calls = []

    class Recorder(loop.Callback):
        def on_fit_start(self, loop_):
            calls.append("fit_start")

        def on_epoch_start(self, loop_):
            calls.append(f"epoch_start {loop_.epoch}")

        def on_batch_start(self, loop_, batch):
            calls.append(f"batch_start {len(batch['labels'])}")

        def on_before_optimizer_step(self, loop_, batch):
            calls.append("before_optimizer_step")
            loop_.trainer.hyperparameters["lr"] = 1e-3 * (loop_.trainer.step_count + 1)

        def on_step_end(self, loop_, record):
            calls.append(f"step_end {record['step']} lr {record['lr']:.0e}")

        def on_evaluation_end(self, loop_, record):
            calls.append(f"evaluation_end {record['step']}")

        def on_epoch_end(self, loop_, record):
            calls.append(f"epoch_end {record['epoch']}")

        def on_fit_end(self, loop_):
            calls.append("fit_end")

    Trainer(step_graph, initial).fit(lambda epoch: train(epoch)[:2], epochs=1, callbacks=[Recorder()], progress=False)
    assert calls == ["fit_start", "epoch_start 1", "batch_start 50", "before_optimizer_step", "step_end 1 lr 1e-03",
                     "batch_start 50", "before_optimizer_step", "step_end 2 lr 2e-03", "evaluation_end 2",
                     "epoch_end 1", "fit_end"]
