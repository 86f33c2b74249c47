"""A training loop for step graphs (``normgrad export --optimizer``) in stock onnxruntime.

:class:`Trainer` runs a step graph with its state (trainable weights, optimizer tensors,
BatchNorm running statistics) kept in onnxruntime ``OrtValue`` buffers: each run binds the
state through an IOBinding and writes the ``NAME.next`` outputs into a second buffer per
tensor, and the two buffers swap roles after the run, so no state tensor is copied through
NumPy between steps. Only the batch goes in and the scalar loss comes out. A tensor whose
readers all precede its update in the graph's data dependencies (the optimizer moments, the
running statistics; :func:`normgrad.graphs.structure.in_place_updates`) has one buffer,
updated in place, as onnxruntime-training's optimizer does: AdamW's state then takes 4
copies of the weights' size instead of 6.

Learning-rate schedules are plain Python functions of the 1-based step (:func:`constant`,
:func:`linear_warmup`, :func:`cosine`).

**Data-parallel wrappers.** Three methods are the hooks a data-parallel (e.g. MPI) subclass
overrides, each a no-op here:

* :meth:`Trainer.broadcast_state`: gets the state as NumPy arrays before it becomes the
  trainer's (at construction and in :meth:`Trainer.load`) and returns what to use, e.g.
  rank 0's arrays broadcast to every rank;
* :attr:`Trainer.is_saving_rank`: :meth:`Trainer.save` and
  :meth:`Trainer.export_inference_model` write only where it is True (rank 0);
* :meth:`Trainer.reduce_gradients`: gets the micro-batch-averaged gradients
  (``{parameter: OrtValue}``) between the gradient graph and the optimizer graph and
  returns the gradients to apply (e.g. averaged over ranks, in place with
  ``OrtValue.update_inplace`` or as new OrtValues). Overriding it makes the trainer run the
  split graphs (gradient graph, then optimizer graph) even without accumulation.
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import onnx

from normgrad import checkpoint as checkpoints
from normgrad._files import PathLike, save_model_atomic
from normgrad.graphs import structure

__all__ = ["Trainer", "TrainerError", "constant", "linear_warmup", "cosine", "STEP_METADATA"]

STEP_METADATA = "normgrad.step"
"""Checkpoint metadata key: the number of optimizer steps taken (the next step is this + 1)."""

Schedule = Callable[[int], float]


class TrainerError(ValueError):
    """A step graph, checkpoint, batch or option the trainer cannot use."""


def constant(lr: float) -> Schedule:
    """lr at every step."""
    return lambda step: float(lr)


def linear_warmup(lr: float, warmup_steps: int) -> Schedule:
    """lr * step / warmup_steps for the first ``warmup_steps`` steps, then lr."""
    if warmup_steps < 1:
        raise TrainerError(f"warmup_steps must be >= 1, got {warmup_steps}")
    return lambda step: float(lr) * min(1.0, step / warmup_steps)


def cosine(lr: float, total_steps: int, warmup_steps: int = 0, min_lr: float = 0.0) -> Schedule:
    """Linear warmup over ``warmup_steps`` (if any), then cosine decay from lr to ``min_lr``
    at ``total_steps`` (min_lr after it): min_lr + (lr - min_lr) (1 + cos(pi t)) / 2, with t
    the fraction of the decay steps done."""
    if total_steps <= warmup_steps:
        raise TrainerError(f"total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps})")

    def schedule(step: int) -> float:
        if step <= warmup_steps:
            return float(lr) * step / warmup_steps
        done = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return float(min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * done)))

    return schedule


def _np_dtype(info: onnx.ValueInfoProto) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type))


class _Part:
    """One onnxruntime session of the trainer and its reused IOBinding.

    ``state`` maps state inputs to the outputs holding their next value."""

    def __init__(self, ort, model: onnx.ModelProto, options, providers, state: Mapping[str, str]):
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
        self.binding = self.session.io_binding()
        self.inputs = {i.name: i for i in model.graph.input}
        self.state = {name: state[name] for name in self.inputs if name in state}
        self.outputs = {o.name: o for o in model.graph.output}
        self.in_place = structure.in_place_updates(model.graph, self.state)


class Trainer:
    """Trains with a step graph, keeping its state in onnxruntime.

    Args:
        step_model: the step graph (path or ``ModelProto``) written by ``normgrad export
            --optimizer`` or :func:`normgrad.graphs.build_step_graph`.
        checkpoint: its state: a checkpoint path (``.ckpt`` beside the step graph, or one
            :meth:`save` wrote), the checkpoint's ``ModelProto``, a
            :class:`normgrad.checkpoint.Checkpoint`, or ``{name: array}`` (the initial state
            ``build_step_graph`` returns).
        lr: a float, or a schedule ``f(step) -> lr`` of the 1-based optimizer step.
        accumulation: micro-batches per optimizer step: :meth:`step` splits its batch along
            axis 0 into this many equal parts and averages their gradients.
        providers: onnxruntime execution providers (default ``["CPUExecutionProvider"]``).
        session_options: an ``onnxruntime.SessionOptions`` (threads, logging, ...).
        kernels: ``"auto"`` registers normgrad's C++ kernels when the library is installed
            (function bodies otherwise), ``"cpp"`` requires them, ``None`` registers none
            (the step graph's function bodies run).
        device: where the state buffers live (``"cpu"``, or e.g. ``"cuda"`` with ``device_id``).

    Raises:
        TrainerError: not a step graph; a checkpoint with a missing, extra or mis-shaped
            tensor (the error names it); a bad option.
    """

    def __init__(
        self,
        step_model: Union[PathLike, onnx.ModelProto],
        checkpoint: Union[PathLike, onnx.ModelProto, checkpoints.Checkpoint, Mapping[str, np.ndarray]],
        *,
        lr: Union[float, Schedule] = 1e-3,
        accumulation: int = 1,
        providers: Optional[Sequence] = None,
        session_options=None,
        kernels: Optional[str] = "auto",
        device: str = "cpu",
        device_id: int = 0,
    ):
        import onnxruntime

        from normgrad.graphs import optimizers

        self._ort = onnxruntime
        model = step_model if isinstance(step_model, onnx.ModelProto) else onnx.load(os.fspath(step_model))
        metadata = {e.key: e.value for e in model.metadata_props}
        missing = [k for k in ("normgrad.state", "normgrad.parameters", "normgrad.data_inputs", "normgrad.optimizer")
                   if k not in metadata]
        if missing:
            raise TrainerError(f"not a step graph (metadata {missing[0]} missing): write one with "
                               "`normgrad export --loss ... --optimizer ...` or normgrad.graphs.build_step_graph")
        if not isinstance(accumulation, int) or accumulation < 1:
            raise TrainerError(f"accumulation must be an integer >= 1, got {accumulation!r}")
        if kernels not in ("auto", "cpp", None):
            raise TrainerError(f"kernels must be 'auto', 'cpp' or None, got {kernels!r}")
        self.schedule: Schedule = lr if callable(lr) else constant(lr)
        self.accumulation = accumulation
        self.step_model = model
        self._state_map: Dict[str, str] = json.loads(metadata["normgrad.state"])
        self.parameters: List[str] = json.loads(metadata["normgrad.parameters"])
        self.data_inputs: List[str] = json.loads(metadata["normgrad.data_inputs"])
        inputs = {i.name: i for i in model.graph.input}
        self._expected = {name: (_np_dtype(inputs[name]), tuple(d.dim_value for d in inputs[name].type.tensor_type.shape.dim))
                          for name in self._state_map}
        self._device = (device, device_id)
        providers = list(providers) if providers is not None else ["CPUExecutionProvider"]
        options = session_options if session_options is not None else onnxruntime.SessionOptions()
        if kernels is not None:
            import normgrad

            try:
                normgrad.session_options("cpp", options)
            except FileNotFoundError:
                if kernels == "cpp":
                    raise
        self.split = accumulation > 1 or type(self).reduce_gradients is not Trainer.reduce_gradients
        if self.split:
            gradient = optimizers.build_gradient_graph(model)
            kind, hyper = optimizers.optimizer_options(model)
            shapes = {p: list(self._expected[p][1]) for p in self.parameters}
            optimizer = optimizers.build_optimizer_graph(shapes, kind, **hyper)
            grad_state = json.loads({e.key: e.value for e in gradient.metadata_props}["normgrad.state"])
            self._gradient = _Part(onnxruntime, gradient, options, providers, grad_state)
            self._optimizer = _Part(onnxruntime, optimizer, options, providers, self._state_map)
            self._accumulators = [p + optimizers.ACCUMULATOR_SUFFIX for p in self.parameters]
            self._zeros = {a: self._ortvalue(np.zeros(self._expected[p][1], np.float32))
                           for a, p in zip(self._accumulators, self.parameters)}
        else:
            self._step_part = _Part(onnxruntime, model, options, providers, self._state_map)
        parts = [self._gradient, self._optimizer] if self.split else [self._step_part]
        # one buffer for a tensor only if every part that updates it can do so in place
        self._in_place = {name for name in self._state_map
                          if all(name in part.in_place for part in parts if name in part.state)}
        self._buffers: Dict[str, List] = {}
        self._current: Dict[str, int] = {}
        self._loss = self._ort.OrtValue.ortvalue_from_numpy(np.zeros((), np.float32))
        self._set_state(checkpoint)

    # -- hooks for data-parallel subclasses -------------------------------------------------

    def broadcast_state(self, tensors: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """The state to start from, given the checkpoint's (checked) arrays. A data-parallel
        subclass returns rank 0's arrays on every rank."""
        return tensors

    @property
    def is_saving_rank(self) -> bool:
        """Whether :meth:`save` and :meth:`export_inference_model` write files (rank 0 only
        in a data-parallel subclass)."""
        return True

    def reduce_gradients(self, gradients: Dict[str, "object"]) -> Dict[str, "object"]:
        """``{parameter: OrtValue}`` mean gradients of this process's micro-batches -> the
        gradients the optimizer applies. A data-parallel subclass averages them over ranks."""
        return gradients

    # -- state ------------------------------------------------------------------------------

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
        if not step_text.isdigit():
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
            checkpoints.save(path, self.state_dict(), {STEP_METADATA: str(self._step)})

    def load(self, path: Union[PathLike, onnx.ModelProto, checkpoints.Checkpoint]) -> None:
        """Replaces the state and step count with a checkpoint's.

        Raises:
            TrainerError: a tensor missing, extra, or of another dtype or shape than the step graph's.
        """
        self._set_state(path)

    # -- running ----------------------------------------------------------------------------

    def _run(self, part: _Part, feeds: Mapping[str, object], replace: Mapping[str, object] = {}) -> float:
        """Runs ``part`` with ``feeds`` and the trainer's state tensors it reads bound from the
        current buffers (or ``replace``); the next values of the state it updates go into the
        other buffers, which then become current. Returns the loss."""
        binding = part.binding
        for name, value in feeds.items():
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, value)
            else:
                binding.bind_ortvalue_input(name, value)
        for name in part.inputs:
            if name in self._buffers and name not in feeds:
                binding.bind_ortvalue_input(name, replace.get(name, self._value(name)))
        for name, next_value in part.state.items():
            binding.bind_ortvalue_output(next_value, self._buffers[name][1 - self._current[name]])
        if "loss" in part.outputs:
            binding.bind_ortvalue_output("loss", self._loss)
        part.session.run_with_iobinding(binding)
        for name in part.state:
            self._current[name] = 1 - self._current[name]
        return float(self._loss.numpy()) if "loss" in part.outputs else float("nan")

    def _batch(self, batch: Sequence, named: Mapping[str, object]) -> Dict[str, np.ndarray]:
        if len(batch) > len(self.data_inputs):
            raise TrainerError(f"step() takes {len(self.data_inputs)} arrays ({', '.join(self.data_inputs)}); "
                               f"got {len(batch)}")
        twice = sorted(set(self.data_inputs[:len(batch)]) & set(named))
        if twice:
            raise TrainerError(f"batch input {twice[0]!r} given both positionally and by name")
        named = {**dict(zip(self.data_inputs, batch)), **named}
        unknown = sorted(set(named) - set(self.data_inputs))
        missing = [n for n in self.data_inputs if n not in named]
        if unknown or missing:
            raise TrainerError(f"the batch must be {', '.join(self.data_inputs)}; "
                               + (f"missing {missing[0]!r}" if missing else f"unknown {unknown[0]!r}"))
        inputs = {i.name: i for i in self.step_model.graph.input}
        feeds = {}
        for name in self.data_inputs:
            value, dtype = np.asarray(named[name]), _np_dtype(inputs[name])
            if value.dtype != dtype and value.dtype.kind != dtype.kind and not (value.dtype.kind in "iu" and dtype.kind in "iu"):
                raise TrainerError(f"batch input {name!r} must be {dtype} (or the same kind); got {value.dtype}")
            feeds[name] = np.ascontiguousarray(value, dtype)
            if self.accumulation > 1 and (value.ndim == 0 or value.shape[0] % self.accumulation):
                raise TrainerError(f"with accumulation {self.accumulation}, batch input {name!r} needs a first axis "
                                   f"divisible by {self.accumulation}; got shape {list(value.shape)}")
            fed = (value.shape[0] // self.accumulation,) + value.shape[1:] if self.accumulation > 1 else value.shape
            dims = [d.dim_value if d.HasField("dim_value") else None for d in inputs[name].type.tensor_type.shape.dim]
            if len(dims) != len(fed) or any(d is not None and d != f for d, f in zip(dims, fed)):
                micro = f" (each of the {self.accumulation} micro-batches)" if self.accumulation > 1 else ""
                wanted = [d if d is not None else "any" for d in dims]
                raise TrainerError(f"batch input {name!r}{micro} has shape {list(fed)}; the step graph takes {wanted}")
        return feeds

    def step(self, *batch, **named) -> float:
        """One optimizer step on a batch (the step graph's data inputs, positionally in
        ``trainer.data_inputs`` order or by name); returns its loss (with accumulation, the
        mean of the micro-batch losses)."""
        feeds = self._batch(batch, named)
        step = self._step + 1
        scalars = {"lr": np.array(self.schedule(step), np.float32), "step": np.array(step, np.float32)}
        if not self.split:
            loss = self._run(self._step_part, {**feeds, **scalars})
        else:
            loss = self._accumulate(feeds)
            gradients = {p: self._value(a) for p, a in zip(self.parameters, self._accumulators)}
            gradients = self.reduce_gradients(gradients)
            self._run(self._optimizer, {**scalars, **{f"{p}_grad": gradients[p] for p in self.parameters}})
        self._step = step
        return loss

    def _accumulate(self, feeds: Dict[str, np.ndarray]) -> float:
        k = self.accumulation
        scale = np.array(1.0 / k, np.float32)
        losses = []
        for i in range(k):
            micro = {name: value[i * (len(value) // k):(i + 1) * (len(value) // k)] for name, value in feeds.items()}
            losses.append(self._run(self._gradient, {**micro, "grad_scale": scale}, self._zeros if i == 0 else {}))
        return float(np.mean(losses))

    # -- results ----------------------------------------------------------------------------

    def lr(self, step: Optional[int] = None) -> float:
        """The learning rate of ``step`` (default: the next step)."""
        return self.schedule(self._step + 1 if step is None else step)

    def inference_model(self) -> onnx.ModelProto:
        """The forward model with the trained weights and running statistics as initializers,
        BatchNormalization in inference mode and Dropout as Identity: any onnxruntime runs it."""
        from normgrad.graphs.optimizers import build_inference_model

        return build_inference_model(self.step_model, self.state_dict())

    def export_inference_model(self, path: PathLike) -> None:
        """Writes :meth:`inference_model` to ``path`` atomically."""
        if self.is_saving_rank:
            save_model_atomic(self.inference_model(), path)

    def save_adapter(self, directory: PathLike) -> None:
        """Writes the trained LoRA adapters as peft's ``adapter_model.safetensors`` +
        ``adapter_config.json`` in ``directory`` (:func:`normgrad.lora.save_adapter`; the step
        graph must come from a peft model exported with :func:`normgrad.torch.export`)."""
        from normgrad import lora

        if self.is_saving_rank:
            lora.save_adapter(directory, self.step_model, self.state_dict())

    def export_merged_model(self, path: PathLike) -> None:
        """Writes the inference model with the trained LoRA adapters folded into their base
        weights (:func:`normgrad.lora.merged_model`) to ``path`` atomically."""
        from normgrad import lora

        if self.is_saving_rank:
            save_model_atomic(lora.merged_model(self.step_model, self.state_dict()), path)
