"""Checkpoints of a :func:`normgrad.loop.fit` run, as Lightning's: :class:`ModelCheckpoint`.

A checkpoint is a pair of files in ``dirpath``: ``PREFIX-STEP.ckpt`` (the trainer's state,
:meth:`Trainer.save`, with its hyperparameters) and ``PREFIX-STEP.json`` (the loop's
position, history, scheduler and callback states, what a resumed run needs). The ``.json``
is written after its ``.ckpt`` and removed before it: a pair without its ``.json`` does
not count, so a kill at any instant leaves complete pairs. No pair is written twice: one
``step-`` pair per optimizer step at most (the first moment that asks for it writes it),
one ``best-`` pair per evaluation.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from normgrad.util import strict_json
from normgrad.util.files import PathLike, write_bytes_atomic
from normgrad._session import TrainerError
from normgrad.callbacks.base import Callback, check_mode, improved, monitored

__all__ = ["ModelCheckpoint"]

_FILE = re.compile(r"^(step|best)-(\d{8,})\.(ckpt|json)$")


def _count(name: str, value, minimum: int, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TrainerError(f"{name} must be {'None or ' if allow_none else ''}an integer >= {minimum}, got {value!r}")


class ModelCheckpoint(Callback):
    """Writes checkpoints of the run to ``dirpath``, as Lightning's ModelCheckpoint.

    Args:
        dirpath: the folder (made if missing). A run that does not resume refuses a folder
            that holds checkpoints already (it would mix two runs' files).
        monitor: the evaluation value (``val_loss``, ``val_accuracy``, ``train_loss``, ...)
            ranking the *top-k* checkpoints ``best-STEP``, considered at every evaluation
            (a NaN value never enters); None: no top-k checkpoints.
        mode: ``"min"`` or ``"max"``: which ``monitor`` values are better.
        save_top_k: how many top-k checkpoints to keep (the best ones; -1: all, 0: none).
        save_last: how many of the latest checkpoints ``step-STEP`` to keep (True: 1;
            False or 0: none): the resume points, written after every evaluation (those at
            an epoch's end: every ``every_n_epochs`` epochs), every ``every_n_train_steps``
            optimizer steps, and when a callback stops the run.
        every_n_train_steps: also a latest checkpoint every this many optimizer steps.
        every_n_epochs: the epochs whose end writes a latest checkpoint (None: none).

    Attributes:
        best_k_models: ``{path of a best-STEP.ckpt: its monitor value}``, the top-k kept.
        best_model_path: the path of the best of them (None before the first).
        best_model_score: its monitor value (None before the first).
        last_model_path: the path of the latest ``step-STEP.ckpt`` (None before the first).
    """

    def __init__(self, dirpath: PathLike, monitor: Optional[str] = None, mode: str = "min", save_top_k: int = 1,
                 save_last: Union[bool, int] = False, every_n_train_steps: Optional[int] = None,
                 every_n_epochs: Optional[int] = 1):
        check_mode(mode)
        _count("save_top_k", save_top_k, -1, allow_none=False)
        _count("save_last", int(save_last) if isinstance(save_last, bool) else save_last, 0, allow_none=False)
        _count("every_n_train_steps", every_n_train_steps, 1)
        _count("every_n_epochs", every_n_epochs, 1)
        if monitor is not None and not isinstance(monitor, str):
            raise TrainerError(f"monitor must be None or the name of an evaluation value, got {monitor!r}")
        self.dirpath = os.fspath(dirpath)
        self.monitor, self.mode, self.save_top_k = monitor, mode, save_top_k
        self.save_last = int(save_last)
        self.every_n_train_steps, self.every_n_epochs = every_n_train_steps, every_n_epochs
        self.best_k_models: Dict[str, float] = {}
        self._last_step: Optional[int] = None  # the step of the latest step- pair: one pair per step

    @property
    def best_model_path(self) -> Optional[str]:
        ranked = self._ranked()
        return ranked[0] if ranked else None

    @property
    def best_model_score(self) -> Optional[float]:
        path = self.best_model_path
        return None if path is None else self.best_k_models[path]

    @property
    def last_model_path(self) -> Optional[str]:
        names = self.checkpoints("step")
        return os.path.join(self.dirpath, names[-1] + ".ckpt") if names else None

    def _ranked(self) -> List[str]:
        """The top-k paths, best first (equal values: the earlier step first)."""
        sign = 1.0 if self.mode == "min" else -1.0
        return sorted(self.best_k_models, key=lambda path: (sign * self.best_k_models[path], path))

    # --- the folder

    def checkpoints(self, prefix: str) -> List[str]:
        """The names (``PREFIX-STEP``) of the complete pairs of ``prefix`` in the folder, oldest first."""
        try:
            entries = set(os.listdir(self.dirpath))
        except OSError:
            return []
        names = [entry[:-5] for entry in entries if entry.endswith(".json") and (m := _FILE.match(entry))
                 and m.group(1) == prefix]
        return sorted(name for name in names if name + ".ckpt" in entries)

    def used(self) -> List[str]:
        """The checkpoint files (either prefix, complete pair or not) the folder holds."""
        try:
            return sorted(entry for entry in os.listdir(self.dirpath) if _FILE.match(entry))
        except OSError:
            return []

    def resume_point(self) -> Optional[str]:
        """The ``.json`` of the pair written last: the highest step; at one step, a pair
        written after that step's evaluation before one written before it, and a latest
        pair before a top-k pair of the same evaluation (it was written after it)."""
        candidates: List[Tuple[Tuple[int, bool, bool], str]] = []
        for prefix in ("step", "best"):
            for name in self.checkpoints(prefix):
                path = os.path.join(self.dirpath, name + ".json")
                step = int(name.split("-")[1])
                candidates.append(((step, _evaluated(path, step), prefix == "step"), path))
        return max(candidates)[1] if candidates else None

    # --- the hooks

    def on_step_end(self, loop, record: Dict[str, float]) -> None:
        every = self.every_n_train_steps
        if self.save_last and ((every is not None and int(record["step"]) % every == 0) or loop.should_stop):
            self._save_last(loop)

    def on_evaluation_end(self, loop, record: Dict[str, float]) -> None:
        if self.monitor is not None and self.save_top_k != 0:
            self._consider(loop, record)
        if self.save_last and not loop.at_epoch_end:  # an epoch's end writes in on_epoch_end
            self._save_last(loop)

    def on_epoch_end(self, loop, record: Dict[str, float]) -> None:
        epoch_due = self.every_n_epochs is not None and loop.epoch % self.every_n_epochs == 0
        if self.save_last and (epoch_due or loop.should_stop):
            self._save_last(loop)

    def state_dict(self) -> Dict[str, Any]:
        return {"best_k_models": {os.path.basename(path): score for path, score in self.best_k_models.items()},
                "last_step": self._last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best_k_models = {os.path.join(self.dirpath, name): float(score)
                              for name, score in state["best_k_models"].items()}
        self._last_step = state["last_step"]

    # --- writing

    def _consider(self, loop, record: Dict[str, float]) -> None:
        """Writes a top-k pair when ``monitor`` enters the top k; removes the one it displaces."""
        value = monitored(record, self.monitor)
        ranked = self._ranked()
        full = self.save_top_k != -1 and len(ranked) >= self.save_top_k
        if not improved(value, self.best_k_models[ranked[-1]] if full else None, self.mode):
            return
        if full:
            del self.best_k_models[ranked[-1]]
        path = os.path.join(self.dirpath, f"best-{loop.trainer.step_count:08d}.ckpt")
        self.best_k_models[path] = value
        self._write(loop, path)

    def _save_last(self, loop) -> None:
        step = loop.trainer.step_count
        if self._last_step == step:  # written at this step already: a pair is never rewritten
            return
        self._last_step = step
        self._write(loop, os.path.join(self.dirpath, f"step-{step:08d}.ckpt"))

    def _write(self, loop, path: str) -> None:
        """The pair of ``path``: the ``.ckpt``, then the ``.json`` (the pair's commit point);
        then the pairs no longer kept are removed."""
        state = loop.checkpoint_state()
        loop.trainer.save(path)
        if getattr(loop.trainer, "is_saving_rank", True):  # (a data-parallel trainer: rank 0 writes)
            write_bytes_atomic(path[:-5] + ".json", strict_json.dumps(state).encode("utf-8"))
            self._prune()

    def _prune(self) -> None:
        """Removes the latest pairs beyond ``save_last`` and the top-k pairs no longer kept
        (the folder is this run's alone: a run that does not resume refuses a used one)."""
        kept = {os.path.basename(path)[:-5] for path in self.best_k_models}
        stale = self.checkpoints("step")[:-self.save_last] if self.save_last else self.checkpoints("step")
        stale += [name for name in self.checkpoints("best") if name not in kept]
        for name in stale:
            for suffix in (".json", ".ckpt"):
                try:
                    os.remove(os.path.join(self.dirpath, name + suffix))
                except FileNotFoundError:
                    pass


def _evaluated(path: str, step: int) -> bool:
    """Whether the pair's ``.json`` was written after the evaluation at its step."""
    try:
        with open(path, encoding="utf-8") as file:
            evaluations = strict_json.loads(file.read()).get("evaluations") or []
    except (OSError, ValueError, AttributeError):
        return False
    return bool(evaluations) and evaluations[-1].get("step") == step
