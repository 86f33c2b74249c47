"""The logs of :func:`normgrad.loop.fit`, each a :class:`normgrad.loop.Callback`: a CSV file
(:class:`CSVLogger`), TensorBoard event files written with the ``tensorboard`` package's own
event writer (:class:`TensorBoardLogger`; the ``train`` extra), and a PNG of the loss and
metric curves (:class:`PlotLogger`, matplotlib).

Each writes what the loop records: a row per optimizer step (``epoch, step, loss, lr`` and
the trainer's other hyperparameters) and
a row per evaluation (``epoch, step, train_loss`` and the validation loss and metrics,
``val_loss, val_accuracy, ...``). On a resumed run the CSV is rewritten from the
checkpoint's history (atomically) and TensorBoard gets a session start at the resumed step,
so the steps a crashed run logged past its last checkpoint are dropped by TensorBoard's reader.
"""

from __future__ import annotations

import csv
import io
import os
import time
from typing import Dict, List

from normgrad._files import PathLike, write_bytes_atomic
from normgrad.loop import Callback

__all__ = ["CSVLogger", "TensorBoardLogger", "PlotLogger"]


class CSVLogger(Callback):
    """Rows to ``path`` as the run goes (columns ``epoch, step, loss, lr``, the other
    hyperparameters, ``train_loss, val_loss, val_<metric>...``; a row fills its own).
    Flushed after each evaluation."""

    def __init__(self, path: PathLike):
        self.path = os.fspath(path)
        self._file = None

    def on_fit_start(self, loop) -> None:
        self._columns = loop.columns
        text = io.StringIO()
        writer = csv.DictWriter(text, self._columns, lineterminator="\n")
        writer.writeheader()
        for record in loop.records():
            writer.writerow(record)
        write_bytes_atomic(self.path, text.getvalue().encode("utf-8"))
        self._file = open(self.path, "a", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, self._columns, lineterminator="\n")

    def on_step_end(self, loop, record: Dict[str, float]) -> None:
        self._writer.writerow(record)

    def on_evaluation_end(self, loop, record: Dict[str, float]) -> None:
        self._writer.writerow(record)
        self._file.flush()

    def on_fit_end(self, loop) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardLogger(Callback):
    """Scalars (tags: the record's names, ``loss``, ``lr``, ``val_loss``, ...) at their
    optimizer step, to a TensorBoard event file in ``folder``, through
    ``tensorboard.summary.writer.event_file_writer.EventFileWriter``."""

    def __init__(self, folder: PathLike):
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            from normgrad._session import TrainerError

            raise TrainerError("TensorBoard logs need the tensorboard package: pip install 'normgrad[train]'") from None
        self.folder = os.fspath(folder)
        self._proto = (event_pb2, summary_pb2, EventFileWriter)
        self._writer = None

    def on_fit_start(self, loop) -> None:
        event_pb2, _, EventFileWriter = self._proto
        os.makedirs(self.folder, exist_ok=True)
        self._writer = EventFileWriter(self.folder)
        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=loop.trainer.step_count + 1, session_log=start))

    def _scalars(self, record: Dict[str, float]) -> None:
        event_pb2, summary_pb2, _ = self._proto
        values = [summary_pb2.Summary.Value(tag=name, simple_value=float(value)) for name, value in record.items()
                  if name not in ("epoch", "step")]
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(record["step"]),
                                               summary=summary_pb2.Summary(value=values)))

    def on_step_end(self, loop, record: Dict[str, float]) -> None:
        self._scalars(record)

    def on_evaluation_end(self, loop, record: Dict[str, float]) -> None:
        self._scalars(record)
        self._writer.flush()

    def on_fit_end(self, loop) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


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

