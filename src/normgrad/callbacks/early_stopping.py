"""Early stopping: :class:`EarlyStopping`."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from normgrad._session import TrainerError
from normgrad.callbacks.base import Callback, check_mode, improved, monitored

__all__ = ["EarlyStopping"]


class EarlyStopping(Callback):
    """Stops the run when ``monitor`` (a name of the evaluation records, e.g. ``val_loss``,
    ``val_accuracy``) has not improved by more than ``min_delta`` for ``patience``
    evaluations in a row (``mode``: ``"min"`` or ``"max"`` is better; a NaN never improves)."""

    def __init__(self, monitor: str = "val_loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0):
        check_mode(mode)
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
        value = monitored(record, self.monitor)
        if improved(value, self.best, self.mode, self.min_delta):
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
