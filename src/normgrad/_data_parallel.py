"""The data-parallel Trainer of :mod:`normgrad.mpi`: :class:`DataParallelTrainer`, with the
checks that keep the ranks in step (the same step graph and options everywhere, batches of
one size, bitwise the same state after the first step), the checkpoint read on rank 0 and
broadcast, and files written on rank 0 with every rank told of the outcome. Imported on
first use of ``normgrad.mpi.DataParallelTrainer``, so that ``import normgrad.mpi`` does not
import :mod:`normgrad.train`; the communicator and collectives it uses are
:mod:`normgrad.mpi`'s."""

from __future__ import annotations

import json
import re
from typing import Mapping

import numpy as np
import onnx

from normgrad import checkpoint as checkpoints
from normgrad._session import _check_step_metadata, _load_step_graph
from normgrad.mpi import CollectiveMismatchError, _sequential, broadcast, comm, gather, init, initialized, rank, size
from normgrad.train import Trainer, TrainerError

__all__ = ["DataParallelTrainer"]


class DataParallelTrainer(Trainer):
    """:class:`normgrad.train.Trainer` under ``mpirun``, for a step graph exported with
    ``--data-parallel`` (and usually ``--sync-batch-norm``), whose AllReduce nodes average
    the gradients: every rank applies the same optimizer step to the same weights.

    * :func:`init` is called if it has not been;
    * the checkpoint is read on rank 0 only and broadcast, so every rank starts from rank
      0's state (weights, optimizer tensors, running statistics, step count);
    * :meth:`save` and :meth:`export_inference_model` write on rank 0 only and return on
      every rank once the file is in place;
    * normgrad's C++ kernels are required with more than one rank (the function body of
      AllReduce is the identity: ranks would silently drift apart), and sessions run their
      nodes sequentially, so the collectives come in graph order on every rank;
    * at construction, the ranks compare a fingerprint of their step graphs and options
      (lr schedule, accumulation, seed) and fail if any differs;
    * each :meth:`step` first checks that every rank passes a batch of the same size;
    * :func:`normgrad.metrics.evaluate` (and so :func:`normgrad.loop.fit`) combines the
      ranks' validation shards: the loss and metrics are those of all of them together,
      the same on every rank;
    * after the first step, the ranks compare a digest of their state
      (:meth:`check_in_sync`) and fail if it differs;
    * these checks (and :meth:`save`) wait at most :func:`timeout` for the other ranks,
      then raise :class:`CollectiveTimeoutError` naming the ranks that did not come.

    Each rank passes :meth:`step` its own shard of the global batch (:func:`shard`).
    Same arguments as :class:`normgrad.train.Trainer`.

    Raises:
        TrainerError: more than one rank and a step graph without ``--data-parallel``,
            or ``kernels=None``; ranks with different step graphs or options.
        CollectiveTimeoutError: a rank did not reach the construction within :func:`timeout`.
    """

    def __init__(self, step_model, checkpoint, **options):
        if not initialized():
            init()
        # loaded as the Trainer loads it: a frozen base stays in its external data files
        model = step_model if isinstance(step_model, onnx.ModelProto) else _load_step_graph(step_model)
        _check_step_metadata(model)
        metadata = {entry.key: entry.value for entry in model.metadata_props}
        parallel = json.loads(metadata.get("normgrad.data_parallel", "{}"))
        if size() > 1:
            if not parallel.get("data_parallel"):
                raise TrainerError(f"{size()} ranks but the step graph does not average gradients over them: "
                                   "export it with --data-parallel (and --sync-batch-norm for BatchNorm)")
            if options.get("kernels", "auto") is None:
                raise TrainerError("data-parallel training needs normgrad's C++ kernels (kernels='cpp'): "
                                   "AllReduce's function body is the identity")
            options["kernels"] = "cpp"
        _check_same_everywhere(model, options)
        options["session_options"] = _sequential(options.get("session_options"))
        self._checked = False
        # without synchronized BatchNorm each rank's running statistics follow its own
        # batches (as in torch DDP without SyncBatchNorm); rank 0's are the ones saved
        self._per_rank = set() if parallel.get("sync_batch_norm") else set(
            json.loads(metadata.get("normgrad.running_statistics", "[]")))
        super().__init__(step_model, _from_rank_0(checkpoint), **options)

    def broadcast_state(self, tensors):
        return broadcast(tensors)

    @property
    def is_saving_rank(self) -> bool:
        return rank() == 0

    def load(self, path) -> None:
        super().load(_from_rank_0(path))

    def save(self, path) -> None:
        _then_barrier(super().save, path, f"the end of a save after step {self.step_count}")

    def export_inference_model(self, path) -> None:
        _then_barrier(super().export_inference_model, path,
                      f"the end of an inference model's export after step {self.step_count}")

    def step(self, *batch, **named) -> float:
        """:meth:`normgrad.train.Trainer.step` on this rank's batch.

        Raises:
            TrainerError: the ranks' batches differ in size (the averaged gradient would
                weight their samples unequally).
            CollectiveTimeoutError: a rank did not come to this step within :func:`timeout`.
        """
        values = list(batch) + [named[name] for name in sorted(named)]
        sizes = _gather([int(np.shape(v)[0]) if np.ndim(v) else None for v in values], f"step {self.step_count + 1}")
        if any(s != sizes[0] for s in sizes):
            shown = ", ".join(f"rank {r}: {s[0] if len(set(s)) == 1 else s}" for r, s in enumerate(sizes))
            raise TrainerError(f"the ranks pass batches of different sizes at step {self.step_count + 1} "
                               f"({shown} samples): every rank needs as many samples, or the averaged gradient "
                               "weights them unequally (normgrad.mpi.shard splits a global batch evenly)")
        loss = super().step(*batch, **named)
        if not self._checked:
            self.check_in_sync()
            self._checked = True
        return loss

    def from_every_rank(self, value, what: str) -> list:
        """Every rank's ``value`` in rank order (:func:`normgrad.mpi.gather`): how
        :func:`normgrad.metrics.evaluate` combines the ranks' validation shards into one
        record, so that every rank takes the same decisions (best checkpoint, early stop,
        ReduceLROnPlateau) from it."""
        return _gather(value, f"{what} after step {self.step_count}")

    def check_in_sync(self) -> None:
        """Raises TrainerError on every rank unless all ranks hold bitwise the same state
        (running statistics excepted without synchronized BatchNorm)."""
        import hashlib

        digest = hashlib.sha256()
        for name, value in sorted(self.state_dict().items()):
            if name in self._per_rank:
                continue
            digest.update(name.encode())
            digest.update(np.ascontiguousarray(value).tobytes())
        digests = _gather(digest.hexdigest(), f"the state check after step {self.step_count}")
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            raise TrainerError(f"ranks {differ} hold other weights than rank 0 after a step: the gradients were "
                               "not averaged (a step graph without --data-parallel, or AllReduce run as its "
                               "function body instead of normgrad's kernel)")

_COMPARED_OPTIONS = ("lr", "weight_decay", "betas", "eps", "momentum", "dampening", "max_grad_norm", "accumulation",
                     "seed")
"""The Trainer options every rank must give alike: a rank with another learning rate or
schedule would drift from step 2 on without any error."""


def _sampled(value):
    """``value`` as compared across ranks: a schedule by its values at a few steps (two
    schedule objects are never equal by identity across processes), a pair elementwise."""
    if isinstance(value, (tuple, list)):
        return [_sampled(item) for item in value]
    if callable(value):
        try:
            return [float(value(step)) for step in (1, 2, 10, 100, 1000)]
        except Exception as error:  # noqa: BLE001 - compared as it is
            return f"schedule raising {type(error).__name__}"
    return value


def _check_same_everywhere(model: onnx.ModelProto, options) -> None:
    """Raises TrainerError on every rank unless all ranks run the same step graph with
    the same options (what would otherwise drift apart silently from step 2 on)."""
    import hashlib

    mine = {"step graph": hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()}
    for name in _COMPARED_OPTIONS:
        mine[name] = repr(_sampled(options.get(name)))
    everyone = _gather(mine, "DataParallelTrainer construction")
    for key in mine:
        differ = [r for r, theirs in enumerate(everyone) if theirs[key] != everyone[0][key]]
        if differ:
            what = "step graph (optimizer, hyperparameters, model)" if key == "step graph" else f"option {key}"
            detail = "" if key == "step graph" else f" ({', '.join(f'rank {r}: {e[key]}' for r, e in enumerate(everyone))})"
            raise TrainerError(f"ranks {differ} run another {what} than rank 0{detail}: every rank must run the same "
                               "step graph with the same options")

def _from_rank_0(source):
    """A checkpoint given as a path, read on rank 0 and broadcast (other sources as given)."""
    if isinstance(source, (checkpoints.Checkpoint, Mapping)) or comm() is None or size() == 1:
        return source
    loaded, error = None, None
    if rank() == 0:
        try:
            loaded = checkpoints.load(source)
        except checkpoints.CheckpointError as problem:
            error = str(problem)
    error, metadata = _gather((error, loaded.metadata if loaded is not None else None),
                              "the checkpoint read on rank 0")[0]
    if error is not None:
        raise TrainerError(f"{error} (read on rank 0)")
    tensors = broadcast(loaded.tensors if loaded is not None else None)
    return checkpoints.Checkpoint(tensors=tensors, metadata=metadata)

def _then_barrier(write, path, what: str) -> None:
    """``write(path)`` on rank 0 (the Trainer's writers skip the others), then every rank
    told of the outcome at the collective ``what`` (no path: it may differ by rank)."""
    error = None
    try:
        write(path)
    except Exception as problem:  # noqa: BLE001 - reported on every rank below
        error = f"{type(problem).__name__}: {problem}"
    errors = _gather(error, what)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise TrainerError(f"writing {path} failed on rank {failed[0][0]}: {failed[0][1]}")


def _gather(value, what: str) -> list:
    """:func:`normgrad.mpi.gather`, with ranks that came to different collectives reported
    as the TrainerError a user can act on (on every rank: each sees every rank's label)."""
    try:
        return gather(value, what)
    except CollectiveMismatchError as error:
        raise TrainerError(_out_of_step(error.labels)) from None


def _out_of_step(labels) -> str:
    """Why the ranks came to different collectives, from what each came to."""
    shown = ", ".join(f"rank {r} to {label}" for r, label in enumerate(labels))
    steps = [int(label.split()[1]) - 1 for label in labels if re.fullmatch(r"step \d+", label)]
    if not steps or len(steps) == len(labels):
        return (f"the ranks are out of step: {shown}: every rank must make the same calls of the trainer "
                "(steps, evaluations, saves) in the same order")
    ended = [r for r, label in enumerate(labels) if not re.fullmatch(r"step \d+", label)]
    return (f"the ranks' training batches ran out at different steps: {shown}: rank{'s' if len(ended) > 1 else ''} "
            f"{', '.join(map(str, ended))} had no batch for step {max(steps) + 1} while the others did; every rank "
            "needs as many batches per epoch (normgrad.mpi.shard splits each global batch evenly over the ranks)")

