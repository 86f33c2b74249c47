"""The training loop above :meth:`Trainer.step`: :func:`fit` (``trainer.fit``) runs epochs
over training batches, evaluates over a whole validation set (:func:`normgrad.metrics.evaluate`),
calls :class:`Callback` hooks, stops early (:class:`EarlyStopping`), steps a scheduler
(:mod:`normgrad.schedules`), keeps the best and the last checkpoints in a folder and resumes
from the latest of them bitwise, shows a tqdm progress bar, and logs to CSV, TensorBoard and
a PNG (:mod:`normgrad.logs`). Everything is optional.

What the loop records: a *step record* per optimizer step, ``{"epoch", "step", "loss"}``
with the hyperparameters the step used (``lr``, and those of ``trainer.hyperparameters``:
``weight_decay``, ``beta1``, ...; the values a scheduler set, as torch's), and an *evaluation record* at each epoch's end (and every ``evaluate_every``
steps), ``{"epoch", "step", "train_loss"}`` (the mean training loss since the previous
evaluation) with, given validation batches, ``val_loss`` and ``val_<metric>``. Early
stopping, the best checkpoint and ReduceLROnPlateau judge evaluation records.

Checkpoints (``checkpoint_dir``): ``step-00000120.ckpt`` (the trainer's state,
:meth:`Trainer.save`, with its hyperparameters) and ``step-00000120.json`` (the loop's
position, history, scheduler and callback states) after each evaluation, at each epoch's end
and every ``checkpoint_every`` steps, the last ``keep_last`` kept; ``best-00000120.ckpt``
and ``.json`` at the best evaluation so far of ``monitor``. Each file is written atomically,
the ``.json`` after its ``.ckpt``: a crash leaves complete pairs. ``resume=True`` continues
from the latest pair: with the same training batches in the same order (a list, a
DataLoader without shuffling, or a function ``epoch -> batches`` such as
:func:`array_batches`), the run goes on bitwise as if it had not stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import numpy as np

from normgrad import checkpoint as checkpoints
from normgrad._files import PathLike, write_bytes_atomic
from normgrad._session import TrainerError
from normgrad.metrics import Metric, evaluate

__all__ = ["fit", "FitResult", "Callback", "EarlyStopping", "array_batches"]

_CHECKPOINT = re.compile(r"^(step|best)-(\d{8,})\.json$")


class Callback:
    """Hooks :func:`fit` calls; override those you need. ``loop`` is the running loop: its
    ``trainer``, ``epoch``, ``history`` (step records), ``evaluations`` (evaluation
    records); set ``loop.should_stop = True`` to end the run after the current step.
    A callback with state to carry over a resume returns it from :meth:`state_dict` (JSON
    values) and takes it back in :meth:`load_state_dict` (matched by its class and its rank
    among the callbacks of that class)."""

    def on_fit_start(self, loop) -> None:
        """Before the first step (after a resume's state is restored)."""

    def on_step_end(self, loop, record: Dict[str, float]) -> None:
        """After each optimizer step, with its step record."""

    def on_evaluation_end(self, loop, record: Dict[str, float]) -> None:
        """After each evaluation, with its evaluation record."""

    def on_epoch_end(self, loop, record: Dict[str, float]) -> None:
        """After each epoch (after its evaluation), with the epoch's evaluation record."""

    def on_fit_end(self, loop) -> None:
        """When the run ends, finished, stopped or failed."""

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


def _improved(value: float, best: Optional[float], mode: str, min_delta: float = 0.0) -> bool:
    if best is None:
        return not math.isnan(value)
    return value < best - min_delta if mode == "min" else value > best + min_delta


def _check_mode(mode: str) -> None:
    if mode not in ("min", "max"):
        raise TrainerError(f"mode must be 'min' or 'max', got {mode!r}")


class EarlyStopping(Callback):
    """Stops the run when ``monitor`` (a name of the evaluation records, e.g. ``val_loss``,
    ``val_accuracy``) has not improved by more than ``min_delta`` for ``patience``
    evaluations in a row (``mode``: ``"min"`` or ``"max"`` is better)."""

    def __init__(self, monitor: str = "val_loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0):
        _check_mode(mode)
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise TrainerError(f"patience must be an integer >= 1, got {patience!r}")
        if not min_delta >= 0:
            raise TrainerError(f"min_delta must be >= 0, got {min_delta!r}")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, float(min_delta)
        self.best: Optional[float] = None
        self.wait = 0
        self.stopped_at: Optional[int] = None

    def on_fit_start(self, loop) -> None:
        if self.stopped_at is not None:  # a resumed run that had stopped stays stopped
            loop.should_stop = True

    def on_evaluation_end(self, loop, record: Dict[str, float]) -> None:
        value = _monitored(record, self.monitor)
        if _improved(value, self.best, self.mode, self.min_delta):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_at = int(record["step"])
            loop.should_stop = True

    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "stopped_at": self.stopped_at}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best, self.wait, self.stopped_at = state["best"], state["wait"], state["stopped_at"]


def _monitored(record: Mapping[str, float], name: str) -> float:
    if name not in record:
        raise TrainerError(f"monitor {name!r} is not among the evaluation's values: "
                           f"{', '.join(n for n in record if n not in ('epoch', 'step'))}")
    return float(record[name])


def array_batches(arrays: Mapping[str, np.ndarray], batch_size: int, *, shuffle: bool = False, seed: int = 0,
                  drop_last: bool = False) -> Callable[[int], List[Dict[str, np.ndarray]]]:
    """Training or validation batches of ``{input name: array}`` (same length along axis 0)
    as a function of the 1-based epoch, which :func:`fit` takes: slices of ``batch_size``
    (the last one shorter unless ``drop_last``), in order or, with ``shuffle``, in an order
    drawn from ``seed`` and the epoch (so a resumed run sees the same order)."""
    lengths = {name: len(value) for name, value in arrays.items()}
    if not lengths or len(set(lengths.values())) != 1:
        raise TrainerError("array_batches takes arrays of one length along axis 0; got "
                           + (", ".join(f"{n} {k}" for n, k in lengths.items()) or "none"))
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise TrainerError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    count = next(iter(lengths.values()))
    stops = range(batch_size, count + 1, batch_size) if drop_last else range(batch_size, count + batch_size, batch_size)
    if not len(stops):
        raise TrainerError(f"batch_size {batch_size} exceeds the {count} samples" + (" (drop_last=True)" if drop_last else ""))

    def batches(epoch: int) -> List[Dict[str, np.ndarray]]:
        order = np.random.default_rng([seed, epoch]).permutation(count) if shuffle else np.arange(count)
        return [{name: value[order[stop - batch_size:stop]] for name, value in arrays.items()} for stop in stops]

    return batches


@dataclasses.dataclass
class FitResult:
    """What :func:`fit` returns.

    Attributes:
        history: the step records (``epoch, step, loss, lr``) of the whole run (a resumed
            run's from its start).
        evaluations: the evaluation records.
        stopped_early: whether a callback (e.g. :class:`EarlyStopping`) ended the run.
        best: the evaluation record of the best ``monitor`` value (None without evaluations).
        best_checkpoint: the path of the best checkpoint (None without ``checkpoint_dir``).
        last_checkpoint: the path of the latest checkpoint (None without ``checkpoint_dir``).
    """

    history: List[Dict[str, float]]
    evaluations: List[Dict[str, float]]
    stopped_early: bool
    best: Optional[Dict[str, float]]
    best_checkpoint: Optional[str]
    last_checkpoint: Optional[str]


class _Loop:
    """The running loop's state (what the callbacks see and the checkpoints' ``.json`` holds)."""

    def __init__(self, trainer, columns: List[str]):
        self.trainer = trainer
        self.columns = columns
        self.epoch, self.batch = 1, 0  # the epoch running, and how many of its batches are done
        self.history: List[Dict[str, float]] = []
        self.evaluations: List[Dict[str, float]] = []
        self.since_evaluation: List[float] = []
        self.best: Optional[Dict[str, float]] = None
        self.should_stop = False

    def records(self) -> List[Dict[str, float]]:
        """Step and evaluation records in the order they were made."""
        return sorted(self.history + self.evaluations, key=lambda r: (r["step"], "train_loss" in r))


def fit(trainer, train: Union[Iterable, Callable[[int], Iterable]], *, epochs: int = 1,
        evaluation: Union[Iterable, Callable[[int], Iterable], None] = None,
        metrics: Optional[Mapping[str, Metric]] = None, output: Optional[str] = None, labels: str = "labels",
        evaluate_every: Optional[int] = None, callbacks: Sequence[Callback] = (), scheduler=None,
        scheduler_interval: str = "epoch", monitor: Optional[str] = None, mode: str = "min",
        checkpoint_dir: Optional[PathLike] = None, keep_last: int = 1, checkpoint_every: Optional[int] = None,
        resume: bool = False, log_dir: Optional[PathLike] = None, progress: bool = True) -> FitResult:
    """Trains ``trainer`` for ``epochs`` epochs over ``train`` (an iterable of batches, as
    :meth:`Trainer.steps` takes them, iterated again each epoch, or a function ``epoch ->
    batches``).

    Args:
        evaluation: validation batches (or ``epoch -> batches``), evaluated whole after each
            epoch (and every ``evaluate_every`` steps): ``val_loss`` and ``val_<name>`` for
            each of ``metrics`` (``{name: f(outputs, labels)}``, :mod:`normgrad.metrics`),
            taken on the forward ``output`` (default: the loss's) and the batch input ``labels``.
        callbacks: :class:`Callback` objects (e.g. :class:`EarlyStopping`), called in order.
        scheduler: a :mod:`normgrad.schedules` scheduler on this trainer: ``step()`` after
            each optimizer step (``scheduler_interval="step"``, e.g. OneCycleLR) or after each
            epoch (``"epoch"``); a ReduceLROnPlateau gets ``step(monitor's value)`` after each
            evaluation.
        monitor: the evaluation value that picks the best checkpoint and that
            ReduceLROnPlateau watches (default ``val_loss`` given ``evaluation``, else
            ``train_loss``).
        mode: ``"min"`` (a lower ``monitor`` is better) or ``"max"`` (a higher one is).
        checkpoint_dir: where checkpoints go (see the module's description).
        keep_last: how many of the latest checkpoints are kept.
        checkpoint_every: a checkpoint every this many steps too (besides those after each
            evaluation and at each epoch's end).
        resume: continue from the latest checkpoint in ``checkpoint_dir`` (from the start
            when it holds none).
        log_dir: writes ``metrics.csv``, TensorBoard events (when the tensorboard package
            is installed) and ``training.png`` (when matplotlib is) there. A data-parallel
            trainer (:mod:`normgrad.mpi`) logs, shows progress and writes files on rank 0 only.
        progress: a tqdm progress bar per epoch (when tqdm is installed).

    Raises:
        TrainerError: a bad option, a monitor no evaluation record holds, a folder to resume
            from whose checkpoint does not fit, and whatever :meth:`Trainer.step` raises.
    """
    from normgrad import schedules

    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise TrainerError(f"epochs must be an integer >= 1, got {epochs!r}")
    for name, value in (("evaluate_every", evaluate_every), ("checkpoint_every", checkpoint_every)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise TrainerError(f"{name} must be None or an integer >= 1, got {value!r}")
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise TrainerError(f"keep_last must be an integer >= 1, got {keep_last!r}")
    if scheduler_interval not in ("step", "epoch"):
        raise TrainerError(f"scheduler_interval must be 'step' or 'epoch', got {scheduler_interval!r}")
    if scheduler is not None and getattr(scheduler, "trainer", None) is not trainer:
        raise TrainerError("the scheduler drives another trainer (make it with this one: StepLR(trainer, ...))")
    if resume and checkpoint_dir is None:
        raise TrainerError("resume=True needs the checkpoint_dir to resume from")
    _check_mode(mode)
    monitor = monitor or ("val_loss" if evaluation is not None else "train_loss")
    metrics = dict(metrics or {})
    for name, metric in metrics.items():
        if not isinstance(name, str) or not callable(metric):
            raise TrainerError(f"metrics[{name!r}] must be a function f(outputs, labels) -> number under a string name "
                               f"(normgrad.metrics.accuracy, ...); got {metric!r}")
    if metrics and evaluation is None:
        raise TrainerError("metrics need validation batches (evaluation=...)")
    plateau = isinstance(scheduler, schedules.ReduceLROnPlateau)
    evaluation_columns = ["train_loss"] + (["val_loss"] + [f"val_{m}" for m in metrics] if evaluation is not None else [])
    loop = _Loop(trainer, ["epoch", "step", "loss"] + _hyperparameter_names(trainer) + evaluation_columns)
    folder = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
    saving = getattr(trainer, "is_saving_rank", True)
    callbacks = list(callbacks) + (_loggers(log_dir) if saving else [])
    progress = progress and saving
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
        if resume:
            _resume(loop, folder, scheduler, callbacks)

    def save(prefix: str) -> None:
        state = {"epoch": loop.epoch, "batch": loop.batch, "history": loop.history, "evaluations": loop.evaluations,
                 "since_evaluation": loop.since_evaluation, "best": loop.best,
                 "scheduler": scheduler.state_dict() if scheduler is not None else None,
                 "callbacks": {key: c.state_dict() for key, c in _keyed(callbacks).items() if c.state_dict()}}
        name = f"{prefix}-{trainer.step_count:08d}"
        trainer.save(os.path.join(folder, name + ".ckpt"))
        if trainer.is_saving_rank:  # (a data-parallel trainer: rank 0 writes)
            write_bytes_atomic(os.path.join(folder, name + ".json"), json.dumps(state).encode("utf-8"))
            _prune(folder, prefix, 1 if prefix == "best" else keep_last)

    def evaluate_now() -> Dict[str, float]:
        record = {"epoch": loop.epoch, "step": trainer.step_count,
                  "train_loss": float(np.mean(loop.since_evaluation)) if loop.since_evaluation else float("nan")}
        if evaluation is not None:
            batches = evaluation(loop.epoch) if callable(evaluation) else evaluation
            record.update(evaluate(trainer, batches, metrics, output=output, labels=labels))
        loop.since_evaluation = []
        loop.evaluations.append(record)
        value = _monitored(record, monitor)
        for callback in callbacks:
            callback.on_evaluation_end(loop, record)
        if plateau:
            scheduler.step(value)
        if loop.best is None or _improved(value, loop.best[monitor], mode):
            loop.best = record
            if folder is not None:
                save("best")
        return record

    bar = None
    try:
        for callback in callbacks:
            callback.on_fit_start(loop)
        while loop.epoch <= epochs and not loop.should_stop:
            batches = train(loop.epoch) if callable(train) else train
            bar = _progress(progress, batches, loop.epoch, epochs, loop.batch)
            position, finished = 0, False
            for batch in batches:
                position += 1
                if position <= loop.batch:  # done before the checkpoint this run resumed from
                    continue
                used = {name: float(trainer.hyperparameters[name]) for name in _hyperparameter_names(trainer)}
                result = (trainer.step(*batch, outputs=[]) if isinstance(batch, (tuple, list))
                          else trainer.step(batch, outputs=[]))
                loop.batch = position
                record = {"epoch": loop.epoch, "step": trainer.step_count, "loss": result.loss, **used}
                loop.history.append(record)
                loop.since_evaluation.append(result.loss)
                for callback in callbacks:
                    callback.on_step_end(loop, record)
                if scheduler is not None and not plateau and scheduler_interval == "step":
                    scheduler.step()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{used['lr']:.3g}", refresh=False)
                if evaluate_every is not None and trainer.step_count % evaluate_every == 0:
                    evaluate_now()
                    if folder is not None:
                        save("step")
                elif folder is not None and checkpoint_every is not None and trainer.step_count % checkpoint_every == 0:
                    save("step")
                if loop.should_stop:
                    break
            else:
                finished = True
            if position == 0:
                raise TrainerError(f"the training batches yielded no batch in epoch {loop.epoch}"
                                   + (" (a generator runs out after one epoch: pass a list or a function of "
                                      "the epoch)" if loop.epoch > 1 else ""))
            if not finished:  # stopped mid-epoch
                if folder is not None:
                    save("step")
                break
            record = (loop.evaluations[-1] if loop.evaluations and loop.evaluations[-1]["step"] == trainer.step_count
                      else evaluate_now())
            if bar is not None:
                bar.set_postfix({k: f"{v:.4g}" for k, v in record.items() if k not in ("epoch", "step")})
                bar.close()
                bar = None
            for callback in callbacks:
                callback.on_epoch_end(loop, record)
            if scheduler is not None and not plateau and scheduler_interval == "epoch":
                scheduler.step()
            loop.epoch, loop.batch = loop.epoch + 1, 0
            if folder is not None:
                save("step")
    finally:
        if bar is not None:
            bar.close()
        for callback in callbacks:
            callback.on_fit_end(loop)
    return FitResult(history=loop.history, evaluations=loop.evaluations, stopped_early=loop.should_stop,
                     best=loop.best, best_checkpoint=_latest(folder, "best", ".ckpt"),
                     last_checkpoint=_latest(folder, "step", ".ckpt"))


def _hyperparameter_names(trainer) -> List[str]:
    """lr first, then the trainer's other hyperparameters (a trainer without the mapping: lr)."""
    names = list(getattr(trainer, "hyperparameters", None) or ["lr"])
    return ["lr"] + [name for name in names if name != "lr"]


def _loggers(log_dir: Optional[PathLike]) -> List[Callback]:
    if log_dir is None:
        return []
    from normgrad import logs

    os.makedirs(log_dir, exist_ok=True)
    loggers: List[Callback] = [logs.CSVLogger(os.path.join(log_dir, "metrics.csv"))]
    for kind, path in ((logs.TensorBoardLogger, log_dir), (logs.PlotLogger, os.path.join(log_dir, "training.png"))):
        try:
            loggers.append(kind(path))
        except (ImportError, TrainerError):  # the optional package is not installed
            pass
    return loggers


def _progress(enabled: bool, batches, epoch: int, epochs: int, done: int):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    total = len(batches) if hasattr(batches, "__len__") else None
    return tqdm(total=total, initial=done, desc=f"epoch {epoch}/{epochs}", unit="step", leave=True)


def _checkpoints(folder: Optional[str], prefix: str) -> List[str]:
    """The checkpoint names (``prefix-STEP``) in ``folder`` with both files, oldest first."""
    if folder is None or not os.path.isdir(folder):
        return []
    names = [m.group(0)[:-5] for m in map(_CHECKPOINT.match, os.listdir(folder)) if m and m.group(1) == prefix]
    return sorted(n for n in names if os.path.isfile(os.path.join(folder, n + ".ckpt")))


def _latest(folder: Optional[str], prefix: str, suffix: str) -> Optional[str]:
    names = _checkpoints(folder, prefix)
    return os.path.join(folder, names[-1] + suffix) if names else None


def _prune(folder: str, prefix: str, keep: int) -> None:
    """Removes all but the newest ``keep`` checkpoints of ``prefix`` (the ``.json`` first)."""
    for name in _checkpoints(folder, prefix)[:-keep]:
        for suffix in (".json", ".ckpt"):
            try:
                os.remove(os.path.join(folder, name + suffix))
            except FileNotFoundError:
                pass


def _resume(loop: _Loop, folder: str, scheduler, callbacks: Sequence[Callback]) -> None:
    """The loop, trainer, scheduler and callbacks as the latest checkpoint in ``folder`` left them."""
    path = _latest(folder, "step", ".json")
    if path is None:
        return
    try:
        with open(path, encoding="utf-8") as file:
            state = json.load(file)
        loop.epoch, loop.batch = int(state["epoch"]), int(state["batch"])
        loop.history, loop.evaluations = state["history"], state["evaluations"]
        loop.since_evaluation, loop.best = state["since_evaluation"], state["best"]
        saved_scheduler, saved_callbacks = state["scheduler"], state["callbacks"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise TrainerError(f"cannot resume from {path}: {error}") from None
    checkpoint = path[:-5] + ".ckpt"
    try:  # another model's folder says so first, before what the run was given
        saved_state = checkpoints.load(checkpoint)
        checkpoints.check_matches(saved_state, loop.trainer._expected)
    except checkpoints.CheckpointError as error:
        raise TrainerError(f"cannot resume from {checkpoint}: {error} (checked against the step graph's state)") from None
    if (saved_scheduler is None) != (scheduler is None):
        raise TrainerError(f"cannot resume from {path}: it was written by a run {'with' if saved_scheduler else 'without'} "
                           "a scheduler; give fit the same scheduler (normgrad train: --scheduler)")
    keyed = _keyed(callbacks)
    missing = sorted(set(saved_callbacks) - set(keyed))
    if missing:
        raise TrainerError(f"cannot resume from {path}: it holds the state of callback {missing[0]}, which this run "
                           "lacks: give fit the same callbacks")
    loop.trainer.load(saved_state)
    if scheduler is not None:
        scheduler.load_state_dict(saved_scheduler)
    for key, saved in saved_callbacks.items():
        keyed[key].load_state_dict(saved)


def _keyed(callbacks: Sequence[Callback]) -> Dict[str, Callback]:
    """``{"EarlyStopping#0": callback, ...}``: each callback by its class and its rank among those of its class."""
    keyed: Dict[str, Callback] = {}
    for callback in callbacks:
        name = type(callback).__name__
        keyed[f"{name}#{sum(key.startswith(name + '#') for key in keyed)}"] = callback
    return keyed
