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

Learning-rate schedules are plain Python functions of the 1-based step
(:mod:`normgrad.schedules`: :func:`constant`, :func:`linear_warmup`, :func:`cosine`); the
onnxruntime plumbing (sessions, the graph onnxruntime runs, external data, the step gate) is
in :mod:`normgrad._session`.

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

import dataclasses
import json
import os
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import onnx

from normgrad import checkpoint as checkpoints
from normgrad._files import PathLike, save_models_external, uses_external_data
from normgrad._hyperparameters import CHECKPOINT_METADATA, Hyperparameters, from_checkpoint, graph_defaults
from normgrad._session import (APPLIED, _SPLIT_LOSS, TrainerError, _check_external_data, _check_reserved_names,
                               _check_step_metadata, _external_data_options, _files_read, _gate_state_updates,
                               _keep_bfloat16_initializers, _load_step_graph, _metadata_json, _np_dtype, _Part,
                               _refuse_overwriting, training_session_options)
from normgrad.schedules import Schedule, constant, cosine, linear_warmup

__all__ = ["Trainer", "TrainerError", "StepResult", "EvalResult", "constant", "linear_warmup", "cosine",
           "STEP_METADATA", "SEED_METADATA"]

STEP_METADATA = "normgrad.step"
"""Checkpoint metadata key: the number of optimizer steps taken (the next step is this + 1)."""
SEED_METADATA = "normgrad.dropout_seed"
"""Checkpoint metadata key: the Dropout seed (with the step count, what the next masks depend on)."""




@dataclasses.dataclass
class StepResult:
    """One optimizer step: what :meth:`Trainer.step` returns when asked for ``outputs``, and
    what :meth:`Trainer.steps` yields.

    Attributes:
        loss: the step's loss (with accumulation, the mean of the micro-batch losses).
        outputs: ``{name: array}``, the requested forward outputs of the step's forward pass
            (train mode, the weights before the update; with accumulation, the micro-batches'
            outputs concatenated along axis 0).
        step: the optimizer step it was (1-based; :attr:`Trainer.step_count` after it).
        lr: the learning rate it used.
        epoch: the 1-based epoch (:meth:`Trainer.steps` only; None from :meth:`Trainer.step`).
    """

    loss: float
    outputs: Dict[str, np.ndarray]
    step: int
    lr: float
    epoch: Optional[int] = None


@dataclasses.dataclass
class EvalResult:
    """What :meth:`Trainer.evaluate` returns: the loss and the requested forward outputs
    (``{name: array}``) in eval mode, with the trainer's current state."""

    loss: float
    outputs: Dict[str, np.ndarray]


def _unpack_dict(batch: Sequence, named: Mapping[str, object]) -> Tuple[Sequence, Dict[str, object]]:
    """A batch given as one dict ``{input name: array}`` -> the same inputs by name."""
    if len(batch) == 1 and isinstance(batch[0], Mapping):
        twice = sorted(set(batch[0]) & set(named))
        if twice:
            raise TrainerError(f"batch input {twice[0]!r} given both in the dict and by keyword")
        return (), {**batch[0], **named}
    return batch, dict(named)
class Trainer:
    """Trains with a step graph, keeping its state in onnxruntime.

    Args:
        step_model: the step graph (path or ``ModelProto``) written by ``normgrad export
            --optimizer`` or :func:`normgrad.graphs.build_step_graph`.
        checkpoint: its state: a checkpoint path (``.ckpt`` beside the step graph, or one
            :meth:`save` wrote), the checkpoint's ``ModelProto``, a
            :class:`normgrad.checkpoint.Checkpoint`, or ``{name: array}`` (the initial state
            ``build_step_graph`` returns).
        lr, weight_decay, betas, eps, momentum, dampening, max_grad_norm: the optimizer's
            hyperparameters, each a number or a schedule ``f(step) -> value`` of the 1-based
            optimizer step (``betas``: a pair of them); None keeps the checkpoint's value, else
            the step graph's (its export value; lr 1e-3 for a graph that stores none). Only those
            the step graph takes (:attr:`hyperparameters`); set them between steps there.
        accumulation: micro-batches per optimizer step: :meth:`step` splits its batch along
            axis 0 into this many equal parts and averages their gradients.
        providers: onnxruntime execution providers (default ``["CPUExecutionProvider"]``).
        session_options: an ``onnxruntime.SessionOptions`` (threads, logging, ...). None:
            :func:`normgrad._session.training_session_options` (memory patterns off).
        kernels: ``"auto"`` registers normgrad's C++ kernels when the library is installed
            (function bodies otherwise), ``"cpp"`` requires them, ``None`` registers none
            (the step graph's function bodies run).
        device: where the state buffers live (``"cpu"``, or e.g. ``"cuda"`` with ``device_id``).
        eval_model: the evaluation graph :meth:`evaluate` runs (path or ``ModelProto``, e.g. the
            ``NAME.eval.onnx`` that ``normgrad export --optimizer`` writes); default: built
            from the step graph (:func:`normgrad.graphs.optimizers.build_eval_graph`, the same
            function) when first needed.
        seed: the Dropout seed (an int64 integer): Dropout masks are a function of it, the
            step and the micro-batch (:func:`normgrad.graphs.rewrites.seed_dropout`). None:
            the checkpoint's seed if it has one, else the step graph's (``normgrad export
            --seed``, default 0). Saved in every checkpoint.
        external_data_folder: the folder the external data of the step graph (and evaluation
            graph) is in, e.g. a frozen base that :func:`normgrad.torch.export` wrote with
            ``external_data=True``; default: the step graph's folder when it is given by
            path, else the current folder.
        nonfinite: what a step whose loss or a gradient is NaN or infinite does (its updates
            are never written): ``"raise"`` a :class:`TrainerError`, or ``"skip"`` it (the
            step count stays; :attr:`skipped_steps` counts such steps).

    Raises:
        TrainerError: not a step graph (or a corrupt one: unreadable, malformed metadata);
            a checkpoint with a missing, extra or mis-shaped tensor (the error names it); a
            bad option.
    """

    def __init__(
        self,
        step_model: Union[PathLike, onnx.ModelProto],
        checkpoint: Union[PathLike, onnx.ModelProto, checkpoints.Checkpoint, Mapping[str, np.ndarray]],
        *,
        lr: Union[float, Schedule, None] = None,
        weight_decay: Union[float, Schedule, None] = None,
        betas: Optional[Tuple[Union[float, Schedule], Union[float, Schedule]]] = None,
        eps: Union[float, Schedule, None] = None,
        momentum: Union[float, Schedule, None] = None,
        dampening: Union[float, Schedule, None] = None,
        max_grad_norm: Union[float, Schedule, None] = None,
        accumulation: int = 1,
        providers: Optional[Sequence] = None,
        session_options=None,
        kernels: Optional[str] = "auto",
        device: str = "cpu",
        device_id: int = 0,
        eval_model: Union[PathLike, onnx.ModelProto, None] = None,
        seed: Optional[int] = None,
        nonfinite: str = "raise",
        external_data_folder: Optional[PathLike] = None,
    ):
        import onnxruntime

        from normgrad.graphs import optimizers

        self._ort = onnxruntime
        self._eval_path = None if eval_model is None or isinstance(eval_model, onnx.ModelProto) else eval_model
        model = step_model if isinstance(step_model, onnx.ModelProto) else _load_step_graph(step_model)
        if external_data_folder is None and not isinstance(step_model, onnx.ModelProto):
            external_data_folder = os.path.dirname(os.path.abspath(os.fspath(step_model)))
        self.external_data_folder = os.path.abspath(os.fspath(external_data_folder or os.getcwd()))
        _check_step_metadata(model)
        _check_reserved_names(model)
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
        if nonfinite not in ("raise", "skip"):
            raise TrainerError(f"nonfinite must be 'raise' or 'skip', got {nonfinite!r}")
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self.accumulation = accumulation
        self.step_model = model
        self._state_map: Dict[str, str] = _metadata_json(metadata, "normgrad.state", dict)
        self.parameters: List[str] = _metadata_json(metadata, "normgrad.parameters", list)
        self.data_inputs: List[str] = _metadata_json(metadata, "normgrad.data_inputs", list)
        self._loss_metadata = _metadata_json(metadata, "normgrad.loss", dict) if "normgrad.loss" in metadata else {}
        inputs = {i.name: i for i in model.graph.input}
        outputs = {o.name for o in model.graph.output}
        for name, next_value in self._state_map.items():
            if not isinstance(name, str) or name not in inputs or next_value not in outputs:
                raise TrainerError(f"corrupt step graph: metadata normgrad.state names {name!r} -> {next_value!r}, "
                                   "which is not one of its inputs and outputs")
        for name in self.data_inputs + self.parameters:
            if not isinstance(name, str) or name not in inputs:
                raise TrainerError(f"corrupt step graph: its metadata names {name!r}, which is not one of its inputs")
        self._classes = self._class_count()
        self._expected = {name: (_np_dtype(inputs[name]), tuple(d.dim_value for d in inputs[name].type.tensor_type.shape.dim))
                          for name in self._state_map}
        self._device = (device, device_id)
        providers = list(providers) if providers is not None else ["CPUExecutionProvider"]
        options = session_options if session_options is not None else training_session_options(onnxruntime)
        _keep_bfloat16_initializers(model, options)
        step_path = None if isinstance(step_model, onnx.ModelProto) else step_model
        self._read_files = _files_read(model, step_path, self.external_data_folder, "step graph")
        self._checkpoint_files: List[Tuple[str, PathLike]] = []
        if eval_model is not None and not isinstance(eval_model, onnx.ModelProto):
            eval_model = _load_step_graph(eval_model, "evaluation graph")
            self._read_files += _files_read(eval_model, self._eval_path, self.external_data_folder, "evaluation graph")
        for graph, what in ((model, "step graph"), (eval_model, "evaluation graph")):
            if graph is not None:
                _check_step_metadata(graph, what)
                _check_external_data(graph, self.external_data_folder, what)
        if any(uses_external_data(t) for t in model.graph.initializer) or (
                eval_model is not None and any(uses_external_data(t) for t in eval_model.graph.initializer)):
            _external_data_options(options, self.external_data_folder)
        if kernels is not None:
            import normgrad

            try:
                normgrad.session_options("cpp", options)
            except FileNotFoundError:
                if kernels == "cpp":
                    raise
        self.split = accumulation > 1 or type(self).reduce_gradients is not Trainer.reduce_gradients
        try:
            self.forward_outputs: List[str] = optimizers.forward_outputs(model)
        except ValueError:
            self.forward_outputs = []
        self._session_arguments = (options, providers)
        self._eval_source = eval_model
        self._evaluation: Optional[_Part] = None
        if self.split:
            try:
                gradient = optimizers.expose_forward_outputs(optimizers.build_gradient_graph(model), self.forward_outputs)
                kind, hyper = optimizers.optimizer_options(model)
            except (ValueError, KeyError, TypeError) as error:
                raise TrainerError(f"corrupt step graph: metadata normgrad.optimizer: {error}") from None
            shapes = {p: list(self._expected[p][1]) for p in self.parameters}
            optimizer = optimizers.build_optimizer_graph(shapes, kind, **hyper)
            grad_state = json.loads({e.key: e.value for e in gradient.metadata_props}["normgrad.state"])
            self._gradient = _Part(onnxruntime, gradient, options, providers, grad_state)
            gated = _gate_state_updates(optimizer, self._state_map, [f"{p}_grad" for p in self.parameters], _SPLIT_LOSS)
            self._optimizer = _Part(onnxruntime, gated, options, providers, self._state_map)
            self._accumulators = [p + optimizers.ACCUMULATOR_SUFFIX for p in self.parameters]
            self._zeros = {a: self._ortvalue(np.zeros(self._expected[p][1], np.float32))
                           for a, p in zip(self._accumulators, self.parameters)}
        else:
            exposed = optimizers.expose_forward_outputs(model, self.forward_outputs)
            gated = _gate_state_updates(exposed, self._state_map, [f"{p}_grad" for p in self.parameters], "loss")
            self._step_part = _Part(onnxruntime, gated, options, providers, self._state_map)
        parts = [self._gradient, self._optimizer] if self.split else [self._step_part]
        # one buffer for a tensor only if every part that updates it can do so in place
        self._in_place = {name for name in self._state_map
                          if all(name in part.in_place for part in parts if name in part.state)}
        self._buffers: Dict[str, List] = {}
        self._current: Dict[str, int] = {}
        self._loss = self._ort.OrtValue.ortvalue_from_numpy(np.zeros((), np.float32))
        self._applied = self._ort.OrtValue.ortvalue_from_numpy(np.zeros((), np.bool_))
        self._seed = self._initial_seed(metadata, seed)
        self.hyperparameters = self._hyperparameters(model, self._step_part.inputs if not self.split
                                                     else self._optimizer.inputs)
        self._set_state(checkpoint)
        if seed is not None:
            self._seed = int(seed)
        given = dict(lr=lr, weight_decay=weight_decay, eps=eps, momentum=momentum, dampening=dampening,
                     max_grad_norm=max_grad_norm)
        if betas is not None:
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise TrainerError(f"betas must be a pair (beta1, beta2) of numbers or schedules; got {betas!r}")
            given.update(beta1=betas[0], beta2=betas[1])
        for name, value in given.items():
            if value is not None:
                self.hyperparameters.set(name, value)

    def _hyperparameters(self, model: onnx.ModelProto, inputs) -> Hyperparameters:
        """The step graph's hyperparameters at their defaults (:func:`graph_defaults`)."""
        from normgrad.graphs import optimizers

        try:
            kind, options = optimizers.optimizer_options(model)
        except (ValueError, KeyError, TypeError) as error:
            raise TrainerError(f"corrupt step graph: metadata normgrad.optimizer: {error}") from None
        structural = {name: options[name] for name in ("nesterov", "amsgrad") if name in options}
        self._hyperparameter_inputs = inputs
        return Hyperparameters(kind, graph_defaults(model), structural, lambda: self._step + 1)

    @property
    def schedule(self) -> Schedule:
        """The learning rate as a function of the 1-based step (``hyperparameters["lr"]``'s)."""
        return self.hyperparameters.schedule("lr") or constant(self.hyperparameters["lr"])

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

    def _dropout_feeds(self, part: "_Part", micro_batch: int = 0) -> Dict[str, np.ndarray]:
        """The seed (and micro-batch index) inputs of a part with seeded Dropout."""
        from normgrad.graphs import rewrites

        feeds = {rewrites.DROPOUT_SEED_INPUT: np.array(self._seed, np.int64),
                 rewrites.DROPOUT_MICRO_BATCH_INPUT: np.array(micro_batch, np.int64)}
        return {name: value for name, value in feeds.items() if name in part.inputs}

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
            checkpoints.save(path, self.state_dict(), {STEP_METADATA: str(self._step), SEED_METADATA: str(self._seed),
                                                       CHECKPOINT_METADATA: self.hyperparameters.saved()})
            self._checkpoint_files.append(("a checkpoint the trainer saved", path))

    def load(self, path: Union[PathLike, onnx.ModelProto, checkpoints.Checkpoint]) -> None:
        """Replaces the state and step count (and the Dropout seed, if it holds one) with a checkpoint's.

        Raises:
            TrainerError: a tensor missing, extra, or of another dtype or shape than the step graph's.
        """
        self._set_state(path)

    # -- running ----------------------------------------------------------------------------

    def _run(self, part: _Part, feeds: Mapping[str, object], replace: Mapping[str, object] = {},
             fetched: Optional[Dict[str, object]] = None) -> float:
        """Runs ``part`` with ``feeds`` and the trainer's state tensors it reads bound from the
        current buffers (or ``replace``); the next values of the state it updates go into the
        other buffers, which then become current. Returns the loss; sets each key of
        ``fetched`` to that output's value (a NumPy array)."""
        binding = part.binding
        binding.clear_binding_outputs()  # outputs fetched by an earlier run are not fetched again
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
        if APPLIED in part.outputs:
            binding.bind_ortvalue_output(APPLIED, self._applied)
        for name in fetched or {}:  # bound last: get_outputs() lists the outputs in binding order
            binding.bind_output(name, "cpu")
        part.session.run_with_iobinding(binding)
        if fetched:
            values = binding.get_outputs()[-len(fetched):]
            fetched.update((name, np.array(value.numpy(), copy=True)) for name, value in zip(list(fetched), values))
        for name in part.state:
            self._current[name] = 1 - self._current[name]
        return float(self._loss.numpy()) if "loss" in part.outputs else float("nan")

    def _batch(self, batch: Sequence, named: Mapping[str, object], whole: bool = False) -> Dict[str, np.ndarray]:
        """The checked feeds of a batch; ``whole``: run at once (:meth:`evaluate`), not split
        into ``accumulation`` micro-batches."""
        accumulation = 1 if whole else self.accumulation
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
            if accumulation > 1 and (value.ndim == 0 or value.shape[0] % accumulation):
                raise TrainerError(f"with accumulation {accumulation}, batch input {name!r} needs a first axis "
                                   f"divisible by {accumulation}; got shape {list(value.shape)}")
            fed = (value.shape[0] // accumulation,) + value.shape[1:] if accumulation > 1 else value.shape
            dims = [d.dim_value if d.HasField("dim_value") else None for d in inputs[name].type.tensor_type.shape.dim]
            if len(dims) != len(fed) or any(d is not None and d != f for d, f in zip(dims, fed)):
                micro = f" (each of the {accumulation} micro-batches)" if accumulation > 1 else ""
                wanted = [d if d is not None else "any" for d in dims]
                raise TrainerError(f"batch input {name!r}{micro} has shape {list(fed)}; the step graph takes {wanted}")
        self._check_batch(feeds)
        return feeds

    def _check_batch(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Refuses, before anything runs, an empty batch, inputs that disagree on a dimension
        the step graph names alike (``batch``), and cross_entropy labels outside 0..C-1
        (other than the loss's ignore_index)."""
        inputs = {i.name: i for i in self.step_model.graph.input}
        symbols: Dict[str, Tuple[str, int, int]] = {}
        for name, value in feeds.items():
            if value.size == 0:
                raise TrainerError(f"batch input {name!r} is empty (shape {list(value.shape)}); a step needs at least one sample")
            for axis, dim in enumerate(inputs[name].type.tensor_type.shape.dim):
                if dim.HasField("dim_param") and dim.dim_param and axis < value.ndim:
                    first = symbols.setdefault(dim.dim_param, (name, axis, value.shape[axis]))
                    if first[2] != value.shape[axis]:
                        raise TrainerError(
                            f"batch input {name!r} has {value.shape[axis]} along axis {axis} and {first[0]!r} "
                            f"{first[2]} along axis {first[1]}; the step graph names both {dim.dim_param!r}, so they must agree")
        loss = self._loss_metadata
        if loss.get("kind") != "cross_entropy" or "labels" not in feeds:
            return
        labels = feeds["labels"]
        ignore_index = (loss.get("options") or {}).get("ignore_index")
        valid = labels >= 0 if ignore_index is None else (labels >= 0) | (labels == ignore_index)
        if self._classes is not None:
            valid &= (labels < self._classes) | (labels == ignore_index if ignore_index is not None else False)
        if not valid.all():
            bad = labels[~valid].flat[0]
            allowed = f"0..{self._classes - 1}" if self._classes is not None else "non-negative"
            also = f" or the ignore_index {ignore_index}" if ignore_index is not None else ""
            raise TrainerError(f"batch input 'labels' holds {bad}; cross_entropy labels must be class indices {allowed}{also}")

    def _class_count(self) -> Optional[int]:
        """C of a cross_entropy loss: axis 1 of its forward output, where the step graph knows it."""
        if self._loss_metadata.get("kind") != "cross_entropy":
            return None
        output = self._loss_metadata.get("output")
        graph = self.step_model.graph
        if not any(info.name == output for info in graph.value_info):
            try:
                graph = onnx.shape_inference.infer_shapes(self.step_model).graph
            except Exception:  # a graph onnx cannot infer: labels are checked against 0 only
                return None
        for info in list(graph.value_info) + list(graph.output):
            if info.name == output:
                dims = info.type.tensor_type.shape.dim
                return dims[1].dim_value if len(dims) > 1 and dims[1].HasField("dim_value") else None
        return None

    def step(self, *batch, outputs: Optional[Sequence[str]] = None, **named) -> Union[float, StepResult]:
        """One optimizer step on a batch: the step graph's data inputs positionally in
        ``trainer.data_inputs`` order, by name, or as one dict ``{input name: array}``.
        Returns its loss (with accumulation, the mean of the micro-batch losses), or with
        ``outputs`` (names among :attr:`forward_outputs`, e.g. ``["logits"]``) a
        :class:`StepResult` holding the loss and those outputs of the step's forward pass.

        Raises:
            TrainerError: a batch the step graph cannot take (names, dtypes, shapes, an empty
                batch, cross_entropy labels outside 0..C-1 or the ignore_index), a learning
                rate that is not a finite number >= 0, or (``nonfinite="raise"``) a
                non-finite loss or gradient. The state and step count are then unchanged,
                as they are when onnxruntime raises during the step."""
        batch, named = _unpack_dict(batch, named)
        fetched = self._requested(outputs)
        feeds = self._batch(batch, named)
        step = self._step + 1
        scalars = {**self.hyperparameters.feeds(step, self._hyperparameter_inputs), "step": np.array(step, np.float32)}
        if not self.split:
            loss = self._run(self._step_part, {**feeds, **scalars, **self._dropout_feeds(self._step_part)}, fetched=fetched)
        else:
            loss = self._split_step(feeds, scalars, fetched)
        if not bool(self._applied.numpy()):
            self.skipped_steps += 1
            if self.nonfinite == "raise":
                raise TrainerError(f"step {step}: the loss ({loss}) or a gradient is not finite; the state is unchanged "
                                   "(Trainer(..., nonfinite='skip') skips such steps)")
        else:
            self._step = step
        if outputs is None:
            return loss
        return StepResult(loss=loss, outputs=fetched, step=self._step, lr=float(scalars["lr"]))

    def _split_step(self, feeds: Dict[str, np.ndarray], scalars: Dict[str, np.ndarray], fetched=None) -> float:
        """Gradient graph per micro-batch, then the optimizer graph; the gradient graph's own
        state (running statistics) is restored when the step raises or is not applied."""
        kept = {name: self._value(name).numpy().copy() for name in self._gradient.state if name not in self._zeros}
        try:
            loss = self._accumulate(feeds, scalars["step"], fetched)
            gradients = {p: self._value(a) for p, a in zip(self.parameters, self._accumulators)}
            gradients = self.reduce_gradients(gradients)
            self._run(self._optimizer, {**scalars, _SPLIT_LOSS: np.array(loss, np.float32),
                                        **{f"{p}_grad": gradients[p] for p in self.parameters}})
        except BaseException:
            self._restore(kept)
            raise
        if not bool(self._applied.numpy()):
            self._restore(kept)
        return loss

    def _restore(self, kept: Mapping[str, np.ndarray]) -> None:
        for name, value in kept.items():
            self._value(name).update_inplace(value)

    def _accumulate(self, feeds: Dict[str, np.ndarray], step: np.ndarray,
                    fetched: Optional[Dict[str, object]] = None) -> float:
        k = self.accumulation
        scale = np.array(1.0 / k, np.float32)
        losses = []
        parts: Dict[str, List[np.ndarray]] = {name: [] for name in fetched or {}}
        for i in range(k):
            micro = {name: value[i * (len(value) // k):(i + 1) * (len(value) // k)] for name, value in feeds.items()}
            dropout = self._dropout_feeds(self._gradient, i)
            if dropout:
                micro.update(dropout, step=step)
            fetched_micro = dict.fromkeys(parts)
            losses.append(self._run(self._gradient, {**micro, "grad_scale": scale}, self._zeros if i == 0 else {},
                                    fetched=fetched_micro))
            for name, value in fetched_micro.items():
                parts[name].append(value)
        for name, values in parts.items():  # a scalar output gets one entry per micro-batch
            fetched[name] = np.concatenate(values) if values[0].ndim else np.stack(values)
        return float(np.mean(losses))

    def _requested(self, outputs: Optional[Sequence[str]]) -> Dict[str, object]:
        names = [outputs] if isinstance(outputs, str) else list(outputs or [])
        for name in names:
            if name not in self.forward_outputs:
                raise TrainerError(f"output {name!r} is not a forward output the step graph computes; it computes "
                                   f"{', '.join(map(repr, self.forward_outputs)) or 'none'}")
        return dict.fromkeys(names)

    def steps(self, batches: Iterable, epochs: int = 1, outputs: Optional[Sequence[str]] = None) -> Iterator[StepResult]:
        """Takes one :meth:`step` per batch of ``batches``, ``epochs`` times over, yielding a
        :class:`StepResult` after each (lazily: nothing runs until the loop asks for the next
        result). A batch is a tuple or list (positional), a dict (by input name) or a single
        array. For epochs > 1, ``batches`` must be iterable again (a list, a DataLoader), not
        a generator. Wrap it in tqdm for a progress bar; log from the loop body::

            for result in tqdm(trainer.steps(batches, epochs=3), total=3 * len(batches)):
                if result.step % 100 == 0:
                    logging.info("step %d loss %.4f", result.step, result.loss)

        Raises:
            TrainerError: ``epochs`` < 1, or an epoch in which ``batches`` yields no batch.
        """
        if not isinstance(epochs, int) or epochs < 1:
            raise TrainerError(f"epochs must be an integer >= 1, got {epochs!r}")
        for epoch in range(1, epochs + 1):
            count = 0
            for batch in batches:
                count += 1
                if isinstance(batch, (tuple, list)):
                    result = self.step(*batch, outputs=outputs or [])
                else:
                    result = self.step(batch, outputs=outputs or [])
                result.epoch = epoch
                yield result
            if count == 0:
                again = (" (a generator or iterator runs out after one epoch: pass a list or a DataLoader)"
                         if epoch > 1 else "")
                raise TrainerError(f"batches yielded no batch in epoch {epoch}{again}")

    def fit(self, train, **options):
        """Epochs over ``train`` with evaluation, callbacks, early stopping, a scheduler,
        checkpoints, resume and logs: :func:`normgrad.loop.fit` (its arguments, its
        :class:`normgrad.loop.FitResult`)."""
        from normgrad.loop import fit

        return fit(self, train, **options)

    def evaluate(self, *batch, outputs: Optional[Sequence[str]] = None, **named) -> EvalResult:
        """The loss and forward outputs of a batch in eval mode (BatchNorm on its running
        statistics, Dropout off, as torch's ``model.eval()``) with the current state, and no
        update: no weight, optimizer tensor, running statistic or step count changes. The
        batch is given as to :meth:`step` (labels included), whole (not split into
        micro-batches). ``outputs``: the forward outputs to return (default: all that the
        evaluation graph computes)."""
        batch, named = _unpack_dict(batch, named)
        part = self._evaluation_part()
        available = [o for o in part.outputs if o != "loss"]
        names = available if outputs is None else ([outputs] if isinstance(outputs, str) else list(outputs))
        for name in names:
            if name not in available:
                raise TrainerError(f"output {name!r} is not computed by the evaluation graph; it computes "
                                   f"{', '.join(map(repr, available)) or 'none'}")
        feeds = self._batch(batch, named, whole=True)
        fetched = dict.fromkeys(names)
        loss = self._run(part, {name: value for name, value in feeds.items() if name in part.inputs}, fetched=fetched)
        return EvalResult(loss=loss, outputs=fetched)

    def _evaluation_part(self) -> _Part:
        if self._evaluation is None:
            from normgrad.graphs import optimizers

            source = self._eval_source
            if source is None:
                model = optimizers.build_eval_graph(self.step_model)
            else:
                model = source if isinstance(source, onnx.ModelProto) else _load_step_graph(source)
            step_inputs = {i.name: i for i in self.step_model.graph.input}
            for info in model.graph.input:
                if info.name in self._expected:
                    dims = tuple(d.dim_value for d in info.type.tensor_type.shape.dim)
                    if (_np_dtype(info), dims) != self._expected[info.name]:
                        raise TrainerError(f"evaluation graph input {info.name!r} is {_np_dtype(info)} {list(dims)}; "
                                           f"the step graph's state tensor is {self._expected[info.name][0]} "
                                           f"{list(self._expected[info.name][1])}")
                elif info.name not in self.data_inputs:
                    raise TrainerError(f"evaluation graph input {info.name!r} is neither a data input nor a state "
                                       "tensor of the step graph: not this step graph's evaluation graph")
                elif _np_dtype(info) != _np_dtype(step_inputs[info.name]):
                    raise TrainerError(f"evaluation graph input {info.name!r} is {_np_dtype(info)}; the step graph's "
                                       f"is {_np_dtype(step_inputs[info.name])}: not this step graph's evaluation graph")
            if "loss" not in {o.name for o in model.graph.output}:
                raise TrainerError("the evaluation graph has no 'loss' output")
            options, providers = self._session_arguments
            self._evaluation = _Part(self._ort, model, options, providers, {})
        return self._evaluation

    # -- results ----------------------------------------------------------------------------

    def lr(self, step: Optional[int] = None) -> float:
        """The learning rate of ``step`` (default: the next step)."""
        return self.hyperparameters.value("lr", self._step + 1 if step is None else step)

    def inference_model(self) -> onnx.ModelProto:
        """The forward model with the trained weights and running statistics as initializers,
        BatchNormalization in inference mode and Dropout as Identity: any onnxruntime runs it."""
        from normgrad.graphs.optimizers import build_inference_model

        return build_inference_model(self.step_model, self.state_dict())

    def export_inference_model(self, path: PathLike) -> None:
        """Writes :meth:`inference_model` to ``path`` atomically (with a frozen base in external
        data, or past 1 GiB of weights, its weights in ``PATH.HASH.data`` beside it)."""
        if self.is_saving_rank:
            self._refuse_overwriting({"inference model": path})
            self._save_model(self.inference_model(), path)

    def save_adapter(self, directory: PathLike) -> None:
        """Writes the trained LoRA adapters as peft's ``adapter_model.safetensors`` +
        ``adapter_config.json`` in ``directory`` (:func:`normgrad.lora.save_adapter`; the step
        graph must come from a peft model exported with :func:`normgrad.torch.export`)."""
        from normgrad import lora

        if self.is_saving_rank:
            self._refuse_overwriting({"adapter " + name: os.path.join(directory, name)
                                      for name in (lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG)})
            lora.save_adapter(directory, self.step_model, self.state_dict())

    def export_merged_model(self, path: PathLike) -> None:
        """Writes the inference model with the trained LoRA adapters folded into their base
        weights (:func:`normgrad.lora.merged_model`) to ``path`` atomically (with a frozen base in
        external data, or past 1 GiB of weights, its weights in ``PATH.HASH.data`` beside it)."""
        from normgrad import lora

        if self.is_saving_rank:
            self._refuse_overwriting({"merged model": path})
            self._save_model(lora.merged_model(self.step_model, self.state_dict(), self.external_data_folder), path)

    def _refuse_overwriting(self, outputs: Mapping[str, PathLike]) -> None:
        """TrainerError when an export's target (or a data file it replaces) is a file the
        trainer reads (its step and evaluation graphs, their external data) or a checkpoint
        it loaded or saved."""
        _refuse_overwriting(outputs, self._read_files + self._checkpoint_files)

    def _save_model(self, model: onnx.ModelProto, path: PathLike) -> None:
        """``model`` to ``path`` atomically; a model reading external data (a frozen base) or
        past :data:`normgrad._files.INLINE_MODEL_BYTES` keeps its large tensors in
        ``PATH.HASH.data`` beside it (one set: :func:`normgrad._files.commit_files`)."""
        save_models_external({path: model}, self.external_data_folder)
