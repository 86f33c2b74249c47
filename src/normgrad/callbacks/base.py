"""The :class:`Callback` hooks :func:`normgrad.loop.fit` calls, and the monitored-value
helpers the callbacks that judge evaluations share."""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional

from normgrad._session import TrainerError

__all__ = ["Callback"]


class Callback:
    """Hooks :func:`normgrad.loop.fit` calls, as Lightning's; override those you need.

    ``loop`` is the running loop: its ``trainer``, ``epoch``, ``batch`` (the batches of
    the epoch done), ``history`` (step records), ``evaluations`` (evaluation records),
    ``columns`` (the record names, for loggers); set ``loop.should_stop = True`` to end the
    run after the current step. The callbacks run in the order given, the
    :class:`~normgrad.callbacks.ModelCheckpoint` ones last (a checkpoint holds what every
    other callback did at that point).

    A callback with state to carry over a resume returns it from :meth:`state_dict` (JSON
    values) and takes it back in :meth:`load_state_dict` (matched by its class and its
    rank among the callbacks of that class)."""

    def on_fit_start(self, loop) -> None:
        """Before the first step (after a resume's state is restored)."""

    def on_epoch_start(self, loop) -> None:
        """Before an epoch's first step (a resumed epoch: before its next step), with
        ``loop.batches`` the epoch's batches."""

    def on_batch_start(self, loop, batch) -> None:
        """Before a batch's step, with the batch."""

    def on_before_optimizer_step(self, loop, batch) -> None:
        """Just before the optimizer step (normgrad's step runs the forward, the backward and
        the update as one session run, so: after :meth:`on_batch_start`); a hyperparameter
        set here is the one this step uses."""

    def on_step_end(self, loop, record: Dict[str, float]) -> None:
        """After each optimizer step (and the scheduler's step, with
        ``scheduler_interval="step"``), with its step record."""

    def on_evaluation_end(self, loop, record: Dict[str, float]) -> None:
        """After each evaluation (and a ReduceLROnPlateau's step), with its evaluation record."""

    def on_epoch_end(self, loop, record: Dict[str, float]) -> None:
        """After each epoch (after its evaluation), with the epoch's evaluation record."""

    def on_save_checkpoint(self, loop) -> None:
        """Before a checkpoint is written (loggers flush their files here, so that a killed
        run's logs reach at least its latest checkpoint)."""

    def on_fit_end(self, loop) -> None:
        """When the run ends, finished, stopped or failed."""

    def state_dict(self) -> Dict[str, Any]:
        """The state a resumed run needs (JSON values); {} for none."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Takes back what :meth:`state_dict` returned."""


def improved(value: float, best: Optional[float], mode: str, min_delta: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` (None: nothing yet) by more than ``min_delta``; a NaN
    never does (``x < nan`` is never true, so a NaN kept as the best would stay the best)."""
    if math.isnan(value):
        return False
    if best is None or math.isnan(best):
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta


def check_mode(mode: str) -> None:
    if mode not in ("min", "max"):
        raise TrainerError(f"mode must be 'min' or 'max', got {mode!r}")


def monitored(record: Mapping[str, float], name: str) -> float:
    """The value ``name`` of an evaluation record, or a TrainerError listing the names it has."""
    if name not in record:
        raise TrainerError(f"monitor {name!r} is not among the evaluation's values: "
                           f"{', '.join(n for n in record if n not in ('epoch', 'step'))}")
    return float(record[name])
