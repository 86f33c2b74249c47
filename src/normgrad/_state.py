"""The :class:`normgrad.train.Trainer`'s state and the files written from it.

:class:`TrainerState`, a base of the Trainer, holds the methods around the state tensors'
``OrtValue`` buffers: the step count, the Dropout seed, :meth:`~TrainerState.state_dict`,
checkpoints (:meth:`~TrainerState.save`, :meth:`~TrainerState.load`) and the models and
adapters written from the trained state (:meth:`~TrainerState.export_inference_model`,
:meth:`~TrainerState.save_adapter`, :meth:`~TrainerState.export_merged_model`), each
refusing to overwrite a file the trainer reads. The buffers themselves are made and run
by :class:`normgrad.train.Trainer`."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Dict, Mapping, Union

import numpy as np
import onnx

import normgrad.checkpoint as checkpoints
from normgrad.util.external_data import save_models_external
from normgrad.util.files import PathLike
from normgrad._hyperparameters import CHECKPOINT_METADATA, from_checkpoint
from normgrad._session import TrainerError, _refuse_overwriting

__all__ = ["TrainerState", "STEP_METADATA", "SEED_METADATA"]

STEP_METADATA = "normgrad.step"
"""Checkpoint metadata key: the number of optimizer steps taken (the next step is this + 1)."""
SEED_METADATA = "normgrad.dropout_seed"
"""Checkpoint metadata key: the Dropout seed (with the step count, what the next masks depend on)."""


class TrainerState:
    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far (the checkpoint's ``normgrad.step``)."""
        return self._step

    def _ortvalue(self, array: np.ndarray):
        device, device_id = self._device
        return self._ort.OrtValue.ortvalue_from_numpy(np.array(array, copy=True, order="C"), device, device_id)

    def _set_state(self, source) -> None:
        if isinstance(source, checkpoints.Checkpoint):
            ckpt = source
        elif isinstance(source, Mapping):
            ckpt = checkpoints.Checkpoint(tensors={k: np.asarray(v) for k, v in source.items()}, metadata={})
        else:
            try:
                ckpt = checkpoints.from_proto(source) if isinstance(source, onnx.ModelProto) else checkpoints.load(source)
            except checkpoints.CheckpointError as error:
                raise TrainerError(str(error)) from None
        try:
            checkpoints.check_matches(ckpt, self._expected)
        except checkpoints.CheckpointError as error:
            raise TrainerError(f"{error} (checked against the step graph's state)") from None
        step_text = ckpt.metadata.get(STEP_METADATA, "0")
        if not (step_text.isascii() and step_text.isdigit()):
            raise TrainerError(f"checkpoint metadata {STEP_METADATA} must be a step count, got {step_text!r}")
        tensors = self.broadcast_state({name: ckpt.tensors[name] for name in self._expected})
        self._buffers = {}
        for name, value in tensors.items():
            first = self._ortvalue(value)
            self._buffers[name] = [first, first if name in self._in_place else self._ortvalue(value)]
        self._current = {name: 0 for name in tensors}
        if self.split:
            for accumulator, zeros in self._zeros.items():
                self._buffers[accumulator] = [self._ortvalue(zeros.numpy()), self._ortvalue(zeros.numpy())]
                self._current[accumulator] = 0
        self._step = int(step_text)
        self.hyperparameters.restore(from_checkpoint(ckpt.metadata))
        seed_text = ckpt.metadata.get(SEED_METADATA)
        if seed_text is not None:
            try:
                seed = int(seed_text)
            except ValueError:
                seed = None
            if seed is None or not -2**63 <= seed < 2**63:
                raise TrainerError(f"checkpoint metadata {SEED_METADATA} must be an integer in the int64 range, got "
                                   f"{seed_text[:40]!r}")
            self._seed = seed
        if not isinstance(source, (checkpoints.Checkpoint, Mapping, onnx.ModelProto)):
            self._checkpoint_files.append(("the trainer's checkpoint", source))

    def _initial_seed(self, metadata: Mapping[str, str], seed) -> int:
        """The step graph's default Dropout seed, after checking ``seed``."""
        from normgrad.graphs import rewrites

        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                                 or not -2**63 <= int(seed) < 2**63):
            raise TrainerError(f"seed must be an integer in the int64 range, got {seed!r}")
        dropout = json.loads(metadata.get(rewrites.METADATA_DROPOUT, "null"))
        if seed is not None and dropout is None and any(
                n.op_type == "Dropout" and n.domain in ("", "ai.onnx") for n in self.step_model.graph.node):
            raise TrainerError("the step graph's Dropout nodes draw unseeded masks (it was exported before Dropout "
                               "took a seed): export it again to train reproducibly with a seed")
        return int(dropout["seed"]) if dropout else 0

    @property
    def seed(self) -> int:
        """The Dropout seed (saved in checkpoints; see the ``seed`` argument)."""
        return self._seed

    def state_dict(self) -> Dict[str, np.ndarray]:
        """A copy of every state tensor (weights, optimizer state, running statistics)."""
        return {name: self._value(name).numpy().copy() for name in self._expected}

    def _value(self, name: str):
        return self._buffers[name][self._current[name]]

    def save(self, path: PathLike) -> None:
        """Writes the state and the step count to ``path`` atomically (a temporary file in the
        same folder, then renamed; a crash leaves the previous file). Reloading it gives
        bitwise the same state, and training on from it bitwise the same steps."""
        if self.is_saving_rank:
            _refuse_overwriting({"checkpoint": path}, self._read_files)
            with _writing("checkpoint", path):
                checkpoints.save(path, self.state_dict(), {STEP_METADATA: str(self._step), SEED_METADATA: str(self._seed),
                                                           CHECKPOINT_METADATA: self.hyperparameters.saved()})
            self._checkpoint_files.append(("a checkpoint the trainer saved", path))

    def load(self, path: Union[PathLike, onnx.ModelProto, checkpoints.Checkpoint]) -> None:
        """Replaces the state and step count (and the Dropout seed, if it holds one) with a checkpoint's.

        Raises:
            TrainerError: a tensor missing, extra, or of another dtype or shape than the step graph's.
        """
        self._set_state(path)

    def inference_model(self) -> onnx.ModelProto:
        """The forward model with the trained weights and running statistics as initializers,
        BatchNormalization in inference mode and Dropout as Identity: any onnxruntime runs it."""
        from normgrad.graphs.step_graph import build_inference_model

        return build_inference_model(self.step_model, self.state_dict())

    def export_inference_model(self, path: PathLike) -> None:
        """Writes :meth:`inference_model` to ``path`` atomically (with a frozen base in external
        data, or past 1 GiB of weights, its weights in ``PATH.HASH.data`` beside it)."""
        if self.is_saving_rank:
            self._refuse_overwriting({"inference model": path})
            with _writing("inference model", path):
                self._save_model(self.inference_model(), path)

    def save_adapter(self, directory: PathLike) -> None:
        """Writes the trained LoRA adapters as peft's ``adapter_model.safetensors`` +
        ``adapter_config.json`` in ``directory`` (:func:`normgrad.lora.save_adapter`; the step
        graph must come from a peft model exported with :func:`normgrad.torch.export`)."""
        import normgrad.lora as lora

        if self.is_saving_rank:
            self._refuse_overwriting({"adapter " + name: os.path.join(directory, name)
                                      for name in (lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG)})
            with _writing("adapter folder", directory):
                lora.save_adapter(directory, self.step_model, self.state_dict())

    def export_merged_model(self, path: PathLike) -> None:
        """Writes the inference model with the trained LoRA adapters folded into their base
        weights (:func:`normgrad.lora.merged_model`) to ``path`` atomically (with a frozen base in
        external data, or past 1 GiB of weights, its weights in ``PATH.HASH.data`` beside it)."""
        import normgrad.lora as lora

        if self.is_saving_rank:
            self._refuse_overwriting({"merged model": path})
            # the merged weights of an external base are computed one at a time as they are written
            merged, merged_weights = lora.merged_model_streamed(self.step_model, self.state_dict(),
                                                                self.external_data_folder)
            with _writing("merged model", path):
                save_models_external({path: merged}, self.external_data_folder, contents=merged_weights)

    def _refuse_overwriting(self, outputs: Mapping[str, PathLike]) -> None:
        """TrainerError when an export's target (or a data file it replaces) is a file the
        trainer reads (its step and evaluation graphs, their external data) or a checkpoint
        it loaded or saved."""
        _refuse_overwriting(outputs, self._read_files + self._checkpoint_files)

    def _save_model(self, model: onnx.ModelProto, path: PathLike) -> None:
        """``model`` to ``path`` atomically; a model reading external data (a frozen base) or
        past :data:`normgrad.util.external_data.INLINE_MODEL_BYTES` keeps its large tensors in
        ``PATH.HASH.data`` beside it (one set: :func:`normgrad.util.files.commit_files`)."""
        save_models_external({path: model}, self.external_data_folder)


@contextlib.contextmanager
def _writing(what: str, path: PathLike):
    """An OSError while writing the trainer's ``what`` to ``path`` (a missing folder, a full
    disk, a folder in the file's place) raised again, of the same class, with a message naming
    ``path``, not the temporary file the write went through."""
    try:
        yield
    except OSError as error:
        message = f"cannot write the {what} {os.fspath(path)!r}: {error.strerror or error}"
        raise type(error)(error.errno, message) if error.errno else type(error)(message) from None
