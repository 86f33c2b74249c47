"""The training loop above :meth:`Trainer.step`: :func:`fit` (``trainer.fit``) runs epochs
over training batches, evaluates over a whole validation set (:func:`normgrad.metrics.evaluate`),
steps a scheduler (:mod:`normgrad.schedules`) and calls the callbacks
(:mod:`normgrad.callbacks`, as Lightning's) that do the rest: stop early
(:class:`EarlyStopping`), write checkpoints and resume from them bitwise
(:class:`ModelCheckpoint`), log to CSV, TensorBoard and a PNG, and show a tqdm progress bar.
``fit``'s options ``checkpoint_dir``, ``log_dir`` and ``progress`` build those callbacks.
Everything is optional.

What the loop records: a *step record* per optimizer step, ``{"epoch", "step", "loss"}``
with the hyperparameters the step used (``lr``, and those of ``trainer.hyperparameters``:
``weight_decay``, ``beta1``, ...; the values a scheduler set, as torch's), and an
*evaluation record* at each epoch's end (and every ``evaluate_every`` steps), ``{"epoch",
"step", "train_loss"}`` (the mean training loss since the previous evaluation) with, given
validation batches, ``val_loss`` and ``val_<metric>``. Early stopping, the checkpoints and
ReduceLROnPlateau judge evaluation records (a NaN value is never the best).

Checkpoints (``checkpoint_dir``: a :class:`ModelCheckpoint` with ``save_last=keep_last``,
``every_n_train_steps=checkpoint_every`` and the best of ``monitor``): ``step-00000120.ckpt``
(the trainer's state, :meth:`Trainer.save`, with its hyperparameters) and
``step-00000120.json`` (the loop's position, history, scheduler and callback states) after
each evaluation and every ``checkpoint_every`` steps, one pair per step at most, the last
``keep_last`` kept; ``best-00000120.ckpt`` and ``.json`` at the best evaluation so far of
``monitor``. Each file is written atomically, the ``.json`` after its ``.ckpt``: a crash
leaves complete pairs. A run that does not resume refuses a folder holding checkpoints.
``resume=True`` continues from the pair written last: with the same training batches in
the same order (a list, a DataLoader without shuffling, or a function ``epoch -> batches``
such as :func:`array_batches`), the run goes on bitwise as if it had not stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import numpy as np

import normgrad.checkpoint as checkpoints
from normgrad.util import strict_json
from normgrad.util.files import PathLike
from normgrad._session import TrainerError
from normgrad.callbacks import (Callback, CSVLogger, EarlyStopping, ModelCheckpoint, PlotLogger, ProgressBar,
                                TensorBoardLogger)
from normgrad.callbacks.base import check_mode, improved, monitored
from normgrad.metrics import Metric, evaluate

__all__ = ["fit", "FitResult", "Callback", "EarlyStopping", "ModelCheckpoint", "array_batches"]


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
    """The running loop: what the callbacks see (``trainer``, ``epoch``, ``epochs``, ``batch``,
    ``batches``, ``history``, ``evaluations``, ``columns``, ``should_stop``, ``at_epoch_end``,
    ``epoch_done``)
    and what a checkpoint's ``.json`` holds (:meth:`checkpoint_state`)."""

    def __init__(self, trainer, train, epochs: int, columns: List[str], callbacks: List[Callback], scheduler,
                 scheduler_interval: str, evaluation, metrics: Dict[str, Metric], output: Optional[str], labels: str,
                 evaluate_every: Optional[int], monitor: str, mode: str):
        import normgrad.schedules as schedules

        self.trainer, self.train, self.epochs, self.columns, self.callbacks = trainer, train, epochs, columns, callbacks
        self.scheduler, self.scheduler_interval = scheduler, scheduler_interval
        self.plateau = isinstance(scheduler, schedules.ReduceLROnPlateau)
        self.evaluation, self.metrics, self.output, self.labels = evaluation, metrics, output, labels
        self.evaluate_every, self.monitor, self.mode = evaluate_every, monitor, mode
        self.epoch, self.batch = 1, 0  # the epoch running, and how many of its batches are done
        self.batches: Iterable = ()
        self.history: List[Dict[str, float]] = []
        self.evaluations: List[Dict[str, float]] = []
        self.since_evaluation: List[float] = []
        self.best: Optional[Dict[str, float]] = None
        self.should_stop = False
        self.at_epoch_end = False  # during the evaluation that ends an epoch
        self.epoch_done = False  # during on_epoch_end: the epoch, its evaluation and its scheduler step done

    def records(self) -> List[Dict[str, float]]:
        """Step and evaluation records in the order they were made."""
        return sorted(self.history + self.evaluations, key=lambda r: (r["step"], "train_loss" in r))

    def checkpoint_state(self) -> Dict[str, Any]:
        """What a checkpoint's ``.json`` holds (the callbacks' ``on_save_checkpoint`` first)."""
        for callback in self.callbacks:
            callback.on_save_checkpoint(self)
        # written at an epoch's end, the run goes on with the next epoch
        epoch, batch = (self.epoch + 1, 0) if self.epoch_done else (self.epoch, self.batch)
        return {"epoch": epoch, "batch": batch, "columns": self.columns, "history": self.history,
                "evaluations": self.evaluations,
                "since_evaluation": self.since_evaluation, "best": self.best,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "callbacks": {key: c.state_dict() for key, c in _keyed(self.callbacks).items() if c.state_dict()}}

    def run(self) -> None:
        try:
            for callback in self.callbacks:
                callback.on_fit_start(self)
            if self.batch and not self.should_stop:  # resumed from a checkpoint written before its step's evaluation
                self._evaluate_if_due()
            while self.epoch <= self.epochs and not self.should_stop and self._run_epoch():
                pass
        finally:
            for callback in self.callbacks:
                callback.on_fit_end(self)

    def _run_epoch(self) -> bool:
        """The epoch (a resumed one: its batches not done yet); False when stopped mid-epoch."""
        self.batches = self.train(self.epoch) if callable(self.train) else self.train
        for callback in self.callbacks:
            callback.on_epoch_start(self)
        position = 0
        for batch in self.batches:
            position += 1
            if position <= self.batch:  # done before the checkpoint this run resumed from
                continue
            self._step(batch, position)
            if self.should_stop:
                return False
        if position == 0:
            raise TrainerError(f"the training batches yielded no batch in epoch {self.epoch}"
                               + (" (a generator runs out after one epoch: pass a list or a function of "
                                  "the epoch)" if self.epoch > 1 else ""))
        every_rank = getattr(self.trainer, "from_every_rank", None)  # a data-parallel trainer's ranks
        if every_rank is not None:  # all end the epoch here, or one whose batches ran out is named
            every_rank(position, f"the end of epoch {self.epoch}")
        self.at_epoch_end = True
        try:
            record = (self.evaluations[-1] if self._evaluated() else self._evaluate())
        finally:
            self.at_epoch_end = False
        # the epoch's scheduler step first: the epoch-end checkpoint holds the values the next step uses
        if self.scheduler is not None and not self.plateau and self.scheduler_interval == "epoch":
            self._step_scheduler()
        self.epoch_done = True
        try:
            for callback in self.callbacks:
                callback.on_epoch_end(self, record)
        finally:
            self.epoch_done = False
        self.epoch, self.batch = self.epoch + 1, 0
        return True

    def _step(self, batch, position: int) -> None:
        for callback in self.callbacks:
            callback.on_batch_start(self, batch)
        for callback in self.callbacks:
            callback.on_before_optimizer_step(self, batch)
        trainer = self.trainer
        used = {name: float(trainer.hyperparameters[name]) for name in _hyperparameter_names(trainer)}
        positional = batch if isinstance(batch, (tuple, list)) else (batch,)
        result = trainer.step(*positional, outputs=[])
        self.batch = position
        record = {"epoch": self.epoch, "step": trainer.step_count, "loss": result.loss, **used}
        self.history.append(record)
        self.since_evaluation.append(result.loss)
        if self.scheduler is not None and not self.plateau and self.scheduler_interval == "step":
            self._step_scheduler()
        for callback in self.callbacks:
            callback.on_step_end(self, record)
        self._evaluate_if_due()

    def _step_scheduler(self, *value: float) -> None:
        """``scheduler.step()``; a value it sets that no step can use (OneCycleLR's lr past its
        last step, just below 0) is refused when a step uses it, as torch lets it be."""
        deferring = getattr(self.trainer.hyperparameters, "deferring_checks", None)
        with deferring() if deferring is not None else contextlib.nullcontext():
            self.scheduler.step(*value)

    def _evaluated(self) -> bool:
        return bool(self.evaluations) and self.evaluations[-1]["step"] == self.trainer.step_count

    def _evaluate_if_due(self) -> None:
        every = self.evaluate_every
        if every is not None and self.trainer.step_count % every == 0 and not self._evaluated():
            self._evaluate()

    def _evaluate(self) -> Dict[str, float]:
        record = {"epoch": self.epoch, "step": self.trainer.step_count,
                  "train_loss": float(np.mean(self.since_evaluation)) if self.since_evaluation else float("nan")}
        if self.evaluation is not None:
            batches = self.evaluation(self.epoch) if callable(self.evaluation) else self.evaluation
            record.update(evaluate(self.trainer, batches, self.metrics, output=self.output, labels=self.labels))
        self.since_evaluation = []
        self.evaluations.append(record)
        value = monitored(record, self.monitor)
        if self.plateau:
            self._step_scheduler(value)
        if improved(value, None if self.best is None else self.best[self.monitor], self.mode):
            self.best = record
        for callback in self.callbacks:
            callback.on_evaluation_end(self, record)
        return record


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
        callbacks: :class:`~normgrad.callbacks.Callback` objects (e.g. :class:`EarlyStopping`,
            :class:`ModelCheckpoint`), called in order, the ModelCheckpoint ones last.
        scheduler: a :mod:`normgrad.schedules` scheduler on this trainer: ``step()`` after
            each optimizer step (``scheduler_interval="step"``, e.g. OneCycleLR) or after each
            epoch (``"epoch"``); a ReduceLROnPlateau gets ``step(monitor's value)`` after each
            evaluation.
        monitor: the evaluation value that picks the best checkpoint and that
            ReduceLROnPlateau watches (default ``val_loss`` given ``evaluation``, else
            ``train_loss``).
        mode: ``"min"`` (a lower ``monitor`` is better) or ``"max"`` (a higher one is).
        checkpoint_dir: where a :class:`ModelCheckpoint` writes (see the module's description).
        keep_last: how many of its latest checkpoints are kept.
        checkpoint_every: a checkpoint every this many steps too (besides those after each
            evaluation and at each epoch's end).
        resume: continue from the checkpoint written last in ``checkpoint_dir`` (or, without
            it, in the first ModelCheckpoint's ``dirpath``; from the start when it holds none).
        log_dir: writes ``metrics.csv``, TensorBoard events (when the tensorboard package
            is installed) and ``training.png`` (when matplotlib is) there. A data-parallel
            trainer (:mod:`normgrad.mpi`) logs, shows progress and writes files on rank 0 only.
        progress: a tqdm progress bar per epoch (when tqdm is installed).

    Raises:
        TrainerError: a bad option, a monitor no evaluation record holds, a checkpoint folder
            holding checkpoints without ``resume``, a folder to resume from whose checkpoint
            does not fit, and whatever :meth:`Trainer.step` raises.
    """
    _check_options(trainer, epochs, evaluate_every, checkpoint_every, keep_last, scheduler, scheduler_interval, mode)
    monitor = monitor or ("val_loss" if evaluation is not None else "train_loss")
    metrics = dict(metrics or {})
    for name, metric in metrics.items():
        if not isinstance(name, str) or not callable(metric):
            raise TrainerError(f"metrics[{name!r}] must be a function f(outputs, labels) -> number under a string name "
                               f"(normgrad.metrics.accuracy, ...); got {metric!r}")
    if metrics and evaluation is None:
        raise TrainerError("metrics need validation batches (evaluation=...)")
    own = (ModelCheckpoint(checkpoint_dir, monitor=monitor, mode=mode, save_top_k=1, save_last=keep_last,
                           every_n_train_steps=checkpoint_every) if checkpoint_dir is not None else None)
    saving = getattr(trainer, "is_saving_rank", True)
    given = list(callbacks) + ([own] if own is not None else [])
    writers = [c for c in given if isinstance(c, ModelCheckpoint)]
    ordered = ([c for c in given if not isinstance(c, ModelCheckpoint)]
               + (_loggers(log_dir) + _progress_bar(progress) if saving else []) + writers)
    evaluation_columns = ["train_loss"] + (["val_loss"] + [f"val_{m}" for m in metrics] if evaluation is not None else [])
    columns = ["epoch", "step", "loss"] + _hyperparameter_names(trainer) + evaluation_columns
    loop = _Loop(trainer, train, epochs, columns, ordered, scheduler, scheduler_interval, evaluation, metrics, output,
                 labels, evaluate_every, monitor, mode)
    resumed = own or (writers[0] if writers else None)
    if resume and resumed is None:
        raise TrainerError("resume=True needs the checkpoint_dir (or a ModelCheckpoint callback) to resume from")
    _prepare_folders(writers, resume)
    point = resumed.resume_point() if resume else None
    if point is not None:
        _resume(loop, point, scheduler, ordered)
    loop.run()
    return FitResult(history=loop.history, evaluations=loop.evaluations, stopped_early=loop.should_stop,
                     best=loop.best, best_checkpoint=resumed.best_model_path if resumed else None,
                     last_checkpoint=resumed.last_model_path if resumed else None)


def _check_options(trainer, epochs, evaluate_every, checkpoint_every, keep_last, scheduler, scheduler_interval,
                   mode) -> None:
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
    check_mode(mode)


def _prepare_folders(writers: Sequence[ModelCheckpoint], resume: bool) -> None:
    """Makes the checkpoint folders; refuses one folder for two ModelCheckpoints, and a used
    folder for a run that does not resume (pruning would rank and delete the earlier run's
    files with this one's, and best/last would name that run's)."""
    seen: Dict[str, ModelCheckpoint] = {}
    for writer in writers:
        folder = os.path.realpath(writer.dirpath)
        if folder in seen:
            raise TrainerError(f"two ModelCheckpoint callbacks write to {writer.dirpath}: give each its own folder")
        seen[folder] = writer
        os.makedirs(writer.dirpath, exist_ok=True)
        used = writer.used()
        if used and not resume:
            shown = ", ".join(used[:2]) + (f" and {len(used) - 2} more" if len(used) > 2 else "")
            raise TrainerError(f"checkpoint folder {writer.dirpath} holds an earlier run's checkpoints ({shown}): "
                               "continue that run with resume=True (normgrad train: --resume), or write to another "
                               "folder (normgrad train: another --out or --checkpoint-dir), or empty this one")


def _hyperparameter_names(trainer) -> List[str]:
    """lr first, then the trainer's other hyperparameters (a trainer without the mapping: lr)."""
    names = list(getattr(trainer, "hyperparameters", None) or ["lr"])
    return ["lr"] + [name for name in names if name != "lr"]


def _loggers(log_dir: Optional[PathLike]) -> List[Callback]:
    if log_dir is None:
        return []
    os.makedirs(log_dir, exist_ok=True)
    loggers: List[Callback] = [CSVLogger(os.path.join(log_dir, "metrics.csv"))]
    for kind, path in ((TensorBoardLogger, log_dir), (PlotLogger, os.path.join(log_dir, "training.png"))):
        try:
            loggers.append(kind(path))
        except (ImportError, TrainerError):  # the optional package is not installed
            pass
    return loggers


def _progress_bar(enabled: bool) -> List[Callback]:
    if not enabled:
        return []
    try:
        return [ProgressBar()]
    except ImportError:  # tqdm is not installed
        return []


def _latest(folder: Optional[str], prefix: str, suffix: str) -> Optional[str]:
    """The newest complete ``prefix`` pair's file of ``suffix`` in ``folder`` (None: none)."""
    names = ModelCheckpoint(folder).checkpoints(prefix) if folder is not None else []
    return os.path.join(folder, names[-1] + suffix) if names else None


def _resume(loop: _Loop, path: str, scheduler, callbacks: Sequence[Callback]) -> None:
    """The loop, trainer, scheduler and callbacks as the checkpoint of ``path`` (a ``.json``) left them."""
    try:
        with open(path, encoding="utf-8") as file:
            state = strict_json.loads(file.read())
        loop.epoch, loop.batch = int(state["epoch"]), int(state["batch"])
        loop.history, loop.evaluations = state["history"], state["evaluations"]
        loop.since_evaluation, loop.best = state["since_evaluation"], state["best"]
        saved_scheduler, saved_callbacks = state["scheduler"], state["callbacks"]
        saved_columns = state.get("columns", loop.columns)  # written before the columns were: not checked
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise TrainerError(f"cannot resume from {path}: {error}") from None
    checkpoint = path[:-5] + ".ckpt"
    try:  # another model's folder says so first, before what the run was given
        saved_state = checkpoints.load(checkpoint)
        checkpoints.check_matches(saved_state, loop.trainer._expected)
    except checkpoints.CheckpointError as error:
        raise TrainerError(f"cannot resume from {checkpoint}: {error} (checked against the step graph's state)") from None
    if saved_columns != loop.columns:
        raise TrainerError(f"cannot resume from {path}: its run logged {', '.join(map(str, saved_columns))}; this one "
                           f"logs {', '.join(loop.columns)}: give fit the same evaluation batches and metrics "
                           "(normgrad train: the same --eval and --metrics)")
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
