"""The :class:`normgrad.train.Trainer`'s state and its checkpoints.

:class:`TrainerState` holds the state tensors (trainable weights, optimizer tensors,
BatchNorm running statistics) in onnxruntime ``OrtValue`` buffers, two per tensor (the one
a run reads and the one it writes, swapped after the run) or one for a tensor updated in
place; the step count, the Dropout seed and the hyperparameters the next step uses; and
their checkpoints (:meth:`~TrainerState.load`, :meth:`~TrainerState.save`). It refuses to
write over a file the trainer reads (:meth:`~TrainerState.refuse_overwriting`, which the
trainer's exports use too)."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import onnx

from normgrad import checkpoint as checkpoints
from normgrad._files import PathAliasError, PathLike, refuse_aliases
from normgrad._hyperparameters import CHECKPOINT_METADATA, Hyperparameters, from_checkpoint
from normgrad._step_graph import StepGraph
from normgrad.errors import TrainerError

__all__ = ["TrainerState", "STEP_METADATA", "SEED_METADATA", "initial_seed", "writing"]

STEP_METADATA = "normgrad.step"
"""Checkpoint metadata key: the number of optimizer steps taken (the next step is this + 1)."""
SEED_METADATA = "normgrad.dropout_seed"
"""Checkpoint metadata key: the Dropout seed (with the step count, what the next masks depend on)."""

Source = Union[PathLike, onnx.ModelProto, checkpoints.Checkpoint, Mapping[str, np.ndarray]]


class TrainerState:
    """The state tensors of a step graph in onnxruntime buffers, with the step count, the
    Dropout seed and the hyperparameters, and their checkpoints.

    Args:
        ort: the onnxruntime module.
        expected: ``{name: (dtype, shape)}`` of the state tensors (a checkpoint must match).
        device: ``(device, device_id)`` where the buffers live.
        in_place: the tensors with one buffer (every session updates them in place).
        accumulators: ``{name: shape}`` of the gradient accumulators a split step binds
            (float32, zero at each step's first micro-batch: :attr:`zeros`).
        read_files: ``(description, path)`` of the files the trainer reads, which no write
            may replace.
        seed: the Dropout seed before a checkpoint gives one.
        hyperparameters: the trainer's; a checkpoint restores and saves their values.

    Attributes:
        step: optimizer steps taken.
        seed: the Dropout seed.
        zeros: ``{accumulator: zero OrtValue}``.
    """

    def __init__(self, ort, expected: Mapping[str, Tuple[np.dtype, Tuple[int, ...]]], device: Tuple[str, int],
                 in_place: set, accumulators: Mapping[str, Sequence[int]], read_files: List, seed: int,
                 hyperparameters: Hyperparameters):
        self._ort, self.expected, self._device, self.in_place = ort, expected, device, in_place
        self.zeros = {name: self.ortvalue(np.zeros(shape, np.float32)) for name, shape in accumulators.items()}
        self.read_files = read_files
        self.checkpoint_files: List[Tuple[str, PathLike]] = []
        self.seed = seed
        self.hyperparameters = hyperparameters
        self.step = 0
        self._buffers: Dict[str, List] = {}
        self._current: Dict[str, int] = {}

    def ortvalue(self, array: np.ndarray):
        """A copy of ``array`` in an OrtValue on the state's device."""
        device, device_id = self._device
        return self._ort.OrtValue.ortvalue_from_numpy(np.array(array, copy=True, order="C"), device, device_id)

    def __contains__(self, name: str) -> bool:
        return name in self._buffers

    def value(self, name: str):
        """The OrtValue holding the current value of a state tensor (or accumulator)."""
        return self._buffers[name][self._current[name]]

    def next_buffer(self, name: str):
        """The OrtValue a run writes the next value of ``name`` to (:meth:`value` for one
        updated in place)."""
        return self._buffers[name][1 - self._current[name]]

    def swap(self, names) -> None:
        """After a run that wrote ``names``: their next buffers become current."""
        for name in names:
            self._current[name] = 1 - self._current[name]

    def restore(self, kept: Mapping[str, np.ndarray]) -> None:
        """Writes ``{name: array}`` back into the current buffers."""
        for name, value in kept.items():
            self.value(name).update_inplace(value)

    def state_dict(self) -> Dict[str, np.ndarray]:
        """A copy of every state tensor (weights, optimizer state, running statistics)."""
        return {name: self.value(name).numpy().copy() for name in self.expected}

    def load(self, source: Source, broadcast: Callable[[Dict[str, np.ndarray]], Dict[str, np.ndarray]]) -> None:
        """Replaces the state, the step count, the hyperparameters it saved and (if it holds
        one) the Dropout seed with a checkpoint's: a path, its ``ModelProto``, a
        :class:`normgrad.checkpoint.Checkpoint` or ``{name: array}``. ``broadcast`` gets the
        checked arrays and returns those to use (a data-parallel trainer's rank 0's).

        Raises:
            TrainerError: an unreadable checkpoint; a tensor missing, extra, or of another
                dtype or shape than the step graph's; a malformed step count or seed.
        """
        ckpt = _read(source)
        try:
            checkpoints.check_matches(ckpt, self.expected)
        except checkpoints.CheckpointError as error:
            raise TrainerError(f"{error} (checked against the step graph's state)") from None
        step_text = ckpt.metadata.get(STEP_METADATA, "0")
        if not (step_text.isascii() and step_text.isdigit()):
            raise TrainerError(f"checkpoint metadata {STEP_METADATA} must be a step count, got {step_text!r}")
        tensors = broadcast({name: ckpt.tensors[name] for name in self.expected})
        self._buffers = {}
        for name, value in tensors.items():
            first = self.ortvalue(value)
            self._buffers[name] = [first, first if name in self.in_place else self.ortvalue(value)]
        self._current = {name: 0 for name in tensors}
        for accumulator, zeros in self.zeros.items():
            self._buffers[accumulator] = [self.ortvalue(zeros.numpy()), self.ortvalue(zeros.numpy())]
            self._current[accumulator] = 0
        self.step = int(step_text)
        self.hyperparameters.restore(from_checkpoint(ckpt.metadata))
        seed = _checkpoint_seed(ckpt.metadata)
        if seed is not None:
            self.seed = seed
        if not isinstance(source, (checkpoints.Checkpoint, Mapping, onnx.ModelProto)):
            self.checkpoint_files.append(("the trainer's checkpoint", source))

    def save(self, path: PathLike) -> None:
        """Writes the state, the step count, the seed and the hyperparameters to ``path``
        atomically (a temporary file in the same folder, then renamed; a crash leaves the
        previous file)."""
        refuse_overwriting({"checkpoint": path}, self.read_files)
        with writing("checkpoint", path):
            checkpoints.save(path, self.state_dict(), {STEP_METADATA: str(self.step), SEED_METADATA: str(self.seed),
                                                       CHECKPOINT_METADATA: self.hyperparameters.saved()})
        self.checkpoint_files.append(("a checkpoint the trainer saved", path))

    def refuse_overwriting(self, outputs: Mapping[str, PathLike]) -> None:
        """TrainerError when a write's target (or a data file it replaces) is a file the
        trainer reads (its step and evaluation graphs, their external data) or a checkpoint
        it loaded or saved."""
        refuse_overwriting(outputs, self.read_files + self.checkpoint_files)


def _read(source: Source) -> checkpoints.Checkpoint:
    if isinstance(source, checkpoints.Checkpoint):
        return source
    if isinstance(source, Mapping):
        return checkpoints.Checkpoint(tensors={k: np.asarray(v) for k, v in source.items()}, metadata={})
    try:
        return checkpoints.from_proto(source) if isinstance(source, onnx.ModelProto) else checkpoints.load(source)
    except checkpoints.CheckpointError as error:
        raise TrainerError(str(error)) from None


def _checkpoint_seed(metadata: Mapping[str, str]) -> Optional[int]:
    """The Dropout seed a checkpoint holds (None: none)."""
    seed_text = metadata.get(SEED_METADATA)
    if seed_text is None:
        return None
    try:
        seed = int(seed_text)
    except ValueError:
        seed = None
    if seed is None or not -2**63 <= seed < 2**63:
        raise TrainerError(f"checkpoint metadata {SEED_METADATA} must be an integer in the int64 range, got "
                           f"{seed_text[:40]!r}")
    return seed


def initial_seed(graph: StepGraph, seed) -> int:
    """The step graph's default Dropout seed, after checking ``seed`` (the Trainer's argument).

    Raises:
        TrainerError: a seed that is not an int64 integer, or one for a step graph whose
            Dropout nodes take none.
    """
    from normgrad.graphs import rewrites

    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                             or not -2**63 <= int(seed) < 2**63):
        raise TrainerError(f"seed must be an integer in the int64 range, got {seed!r}")
    dropout = json.loads(graph.metadata.get(rewrites.METADATA_DROPOUT, "null"))
    if seed is not None and dropout is None and any(
            n.op_type == "Dropout" and n.domain in ("", "ai.onnx") for n in graph.model.graph.node):
        raise TrainerError("the step graph's Dropout nodes draw unseeded masks (it was exported before Dropout "
                           "took a seed): export it again to train reproducibly with a seed")
    return int(dropout["seed"]) if dropout else 0


def refuse_overwriting(outputs: Mapping[str, PathLike], read: Sequence) -> None:
    """TrainerError when a write's outputs alias each other or a file in ``read``
    (:func:`normgrad._files.refuse_aliases`)."""
    try:
        refuse_aliases(outputs, read)
    except PathAliasError as error:
        raise TrainerError(str(error)) from None


@contextlib.contextmanager
def writing(what: str, path: PathLike):
    """An OSError while writing the trainer's ``what`` to ``path`` (a missing folder, a full
    disk, a folder in the file's place) raised again, of the same class, with a message naming
    ``path``, not the temporary file the write went through."""
    try:
        yield
    except OSError as error:
        message = f"cannot write the {what} {os.fspath(path)!r}: {error.strerror or error}"
        raise type(error)(error.errno, message) if error.errno else type(error)(message) from None
