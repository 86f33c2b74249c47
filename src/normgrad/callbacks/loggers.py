"""The loggers of :func:`normgrad.loop.fit`, each a :class:`~normgrad.callbacks.Callback`: a
CSV file (:class:`CSVLogger`), TensorBoard event files written with the ``tensorboard``
package's own event writer (:class:`TensorBoardLogger`; the ``train`` extra), a PNG of the
loss and metric curves (:class:`PlotLogger`, matplotlib) and a tqdm progress bar per epoch
(:class:`ProgressBar`).

Each writes what the loop records: a row per optimizer step (``epoch, step, loss, lr`` and
the trainer's other hyperparameters) and a row per evaluation (``epoch, step, train_loss``
and the validation loss and metrics, ``val_loss, val_accuracy, ...``). The files are
flushed before each checkpoint, so a killed run's logs reach its latest checkpoint. On a
resumed run the CSV is rewritten from the checkpoint's history (atomically: no row of the
killed run past its checkpoint, none missing) and TensorBoard gets a session start at the
resumed step, so the steps a crashed run logged past its last checkpoint are dropped by
TensorBoard's reader.
"""

from __future__ import annotations

import csv
import io
import os
import time
from typing import Dict, List

from normgrad.util.files import PathLike, write_bytes_atomic
from normgrad._session import TrainerError
from normgrad.callbacks.base import Callback

__all__ = ["CSVLogger", "TensorBoardLogger", "PlotLogger", "ProgressBar"]


class _StreamLogger(Callback):
    """A logger appending to an open stream (``self._stream``, with ``flush`` and ``close``)
    as the run goes: flushed after each evaluation and before each checkpoint, closed at the end."""

    _stream = None

    def _record(self, record: Dict[str, float]) -> None:
        raise NotImplementedError

    def on_step_end(self, loop, record: Dict[str, float]) -> None:
        self._record(record)

    def on_evaluation_end(self, loop, record: Dict[str, float]) -> None:
        self._record(record)
        self._stream.flush()

    def on_save_checkpoint(self, loop) -> None:
        if self._stream is not None:
            self._stream.flush()

    def on_fit_end(self, loop) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


class CSVLogger(_StreamLogger):
    """Rows to ``path`` as the run goes (columns ``epoch, step, loss, lr``, the other
    hyperparameters, ``train_loss, val_loss, val_<metric>...``; a row fills its own).
    Flushed after each evaluation and before each checkpoint."""

    def __init__(self, path: PathLike):
        self.path = os.fspath(path)

    def on_fit_start(self, loop) -> None:
        self._columns = loop.columns
        text = io.StringIO()
        writer = csv.DictWriter(text, self._columns, lineterminator="\n")
        writer.writeheader()
        for record in loop.records():
            writer.writerow(record)
        write_bytes_atomic(self.path, text.getvalue().encode("utf-8"))
        self._stream = open(self.path, "a", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._stream, self._columns, lineterminator="\n")

    def _record(self, record: Dict[str, float]) -> None:
        self._writer.writerow(record)


class TensorBoardLogger(_StreamLogger):
    """Scalars (tags: the record's names, ``loss``, ``lr``, ``val_loss``, ...) at their
    optimizer step, to a TensorBoard event file in ``folder``, through
    ``tensorboard.summary.writer.event_file_writer.EventFileWriter``."""

    def __init__(self, folder: PathLike):
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise TrainerError("TensorBoard logs need the tensorboard package: pip install 'normgrad[train]'") from None
        self.folder = os.fspath(folder)
        self._proto = (event_pb2, summary_pb2, EventFileWriter)

    def on_fit_start(self, loop) -> None:
        event_pb2, _, EventFileWriter = self._proto
        os.makedirs(self.folder, exist_ok=True)
        self._stream = EventFileWriter(self.folder)
        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._stream.add_event(event_pb2.Event(wall_time=time.time(), step=loop.trainer.step_count + 1, session_log=start))

    def _record(self, record: Dict[str, float]) -> None:
        event_pb2, summary_pb2, _ = self._proto
        values = [summary_pb2.Summary.Value(tag=name, simple_value=float(value)) for name, value in record.items()
                  if name not in ("epoch", "step")]
        self._stream.add_event(event_pb2.Event(wall_time=time.time(), step=int(record["step"]),
                                               summary=summary_pb2.Summary(value=values)))


class PlotLogger(Callback):
    """A PNG at ``path`` (rewritten atomically after each epoch and at the end): the
    training loss per step with the validation loss per evaluation, and beside it the
    validation metrics (or, without any, the learning rate). Needs matplotlib."""

    def __init__(self, path: PathLike):
        import matplotlib  # noqa: F401  (refused here, not at the end of a run)

        self.path = os.fspath(path)

    def on_epoch_end(self, loop, record: Dict[str, float]) -> None:
        self.draw(loop.history, loop.evaluations)

    def on_fit_end(self, loop) -> None:
        self.draw(loop.history, loop.evaluations)

    def draw(self, history: List[Dict[str, float]], evaluations: List[Dict[str, float]]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=90)
        steps = [r["step"] for r in history]
        left.plot(steps, [r["loss"] for r in history], color="#9ecae1", linewidth=0.8, label="training loss (step)")
        at = [r["step"] for r in evaluations]
        for name, color in (("train_loss", "#08519c"), ("val_loss", "#a63603")):
            if evaluations and name in evaluations[0]:
                left.plot(at, [r[name] for r in evaluations], color=color, marker="o", markersize=3, label=name)
        left.set(xlabel="optimizer step", ylabel="loss", title="loss")
        if history and min(r["loss"] for r in history) > 0:
            left.set_yscale("log")
        left.legend(frameon=False, fontsize=8)
        metrics = [name for name in (evaluations[0] if evaluations else {})
                   if name.startswith("val_") and name != "val_loss"]
        for name in metrics:
            right.plot(at, [r[name] for r in evaluations], marker="o", markersize=3, label=name)
        if metrics:
            right.set(xlabel="optimizer step", title="validation metrics")
            right.legend(frameon=False, fontsize=8)
        else:
            right.plot(steps, [r["lr"] for r in history], color="#54278f")
            right.set(xlabel="optimizer step", ylabel="lr", title="learning rate")
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        plt.close(figure)
        write_bytes_atomic(self.path, buffer.getvalue())


class ProgressBar(Callback):
    """A tqdm progress bar per epoch (the loss and lr of the latest step; the epoch's
    evaluation at its end). Needs tqdm."""

    def __init__(self):
        from tqdm import tqdm

        self._tqdm = tqdm
        self._bar = None

    def on_epoch_start(self, loop) -> None:
        total = len(loop.batches) if hasattr(loop.batches, "__len__") else None
        self._bar = self._tqdm(total=total, initial=loop.batch, desc=f"epoch {loop.epoch}/{loop.epochs}", unit="step",
                               leave=True)

    def on_step_end(self, loop, record: Dict[str, float]) -> None:
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.3g}", refresh=False)

    def on_epoch_end(self, loop, record: Dict[str, float]) -> None:
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in record.items() if k not in ("epoch", "step")})
        self._close()

    def on_fit_end(self, loop) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
