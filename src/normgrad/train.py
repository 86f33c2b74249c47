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
in :mod:`normgrad._session`. The Trainer's methods live by concern: construction, stepping
and the data-parallel hooks here; the state, checkpoints and exported files in
:mod:`normgrad._state`; checking a batch in :mod:`normgrad._batches`; evaluation in
:mod:`normgrad._evaluation` (each a base class of :class:`Trainer`); the hyperparameters in
:mod:`normgrad._hyperparameters`; ``fit`` in :mod:`normgrad.loop`.

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

from normgrad.ops import api
import normgrad.checkpoint as checkpoints
from normgrad._batches import BatchFeeds, _unpack_dict
from normgrad._evaluation import EvalResult, Evaluation
from normgrad.util.external_data import uses_external_data
from normgrad.util.files import PathLike
from normgrad._hyperparameters import Hyperparameters, graph_defaults
from normgrad._session import (APPLIED, _SPLIT_LOSS, TrainerError, _check_external_data, _check_reserved_names,
                               _check_step_metadata, _exported_eval_graph, _external_data_options, _files_read,
                               _gate_state_updates,
                               _keep_bfloat16_initializers, _load_step_graph, _metadata_json, _np_dtype, _Part,
                               training_session_options)
from normgrad._state import SEED_METADATA, STEP_METADATA, TrainerState
from normgrad.schedules import Schedule, constant, cosine, linear_warmup

__all__ = ["Trainer", "TrainerError", "StepResult", "EvalResult", "constant", "linear_warmup", "cosine",
           "STEP_METADATA", "SEED_METADATA"]


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



class Trainer(TrainerState, BatchFeeds, Evaluation):
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
            :func:`normgrad._session.training_session_options` (memory patterns and weight
            pre-packing off).
        kernels: ``"auto"`` registers normgrad's C++ kernels when the library is installed
            (function bodies otherwise), ``"cpp"`` requires them, ``None`` registers none
            (the step graph's function bodies run).
        device: where the state buffers live (``"cpu"``, or e.g. ``"cuda"`` with ``device_id``).
        eval_model: the evaluation graph :meth:`evaluate` runs (path or ``ModelProto``, e.g. the
            ``NAME.eval.onnx`` that ``normgrad export --optimizer`` writes); default: built
            from the step graph (:func:`normgrad.graphs.step_graph.build_eval_graph`, the same
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

        from normgrad.graphs import optimizers, step_graph, structure

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
        exported_eval = _exported_eval_graph(step_path)
        if exported_eval is not None:  # normgrad export's set: the evaluation graph beside the step graph
            self._read_files.append(("the evaluation graph exported with the step graph", exported_eval))
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

            try:
                api.session_options("cpp", options)
            except FileNotFoundError:
                if kernels == "cpp":
                    raise
        self.split = accumulation > 1 or type(self).reduce_gradients is not Trainer.reduce_gradients
        try:
            self.forward_outputs: List[str] = step_graph.forward_outputs(model)
        except ValueError:
            self.forward_outputs = []
        self._session_arguments = (options, providers)
        self._eval_source = eval_model
        self._evaluation: Optional[_Part] = None
        # outputs only the step graph's forward tail computes (a bias Add the loss absorbed) would
        # cost onnxruntime a pass each step: a second session has them, built at the first step
        # asking for one (its frozen initializers would otherwise be held twice from the start)
        computed = {o for node in model.graph.node for o in node.output}
        self._tail_outputs = {o for o in self.forward_outputs if o not in computed}
        everyday = [o for o in self.forward_outputs if o in computed]
        if self.split:
            try:
                gradient_graph = step_graph.build_gradient_graph(model)
                gradient = step_graph.expose_forward_outputs(gradient_graph, everyday)
                kind, hyper = optimizers.optimizer_options(model)
            except (ValueError, KeyError, TypeError) as error:
                raise TrainerError(f"corrupt step graph: metadata normgrad.optimizer: {error}") from None
            shapes = {p: list(self._expected[p][1]) for p in self.parameters}
            optimizer = optimizers.build_optimizer_graph(shapes, kind, **hyper)
            grad_state = json.loads({e.key: e.value for e in gradient.metadata_props}["normgrad.state"])
            self._gradient = _Part(onnxruntime, gradient, options, providers, grad_state)
            tail_model = step_graph.expose_forward_outputs(gradient_graph, self.forward_outputs) \
                if self._tail_outputs else None
            self._tail_state = grad_state
            gated = _gate_state_updates(optimizer, self._state_map, [f"{p}_grad" for p in self.parameters], _SPLIT_LOSS)
            self._optimizer = _Part(onnxruntime, gated, options, providers, self._state_map)
            self._accumulators = [p + step_graph.ACCUMULATOR_SUFFIX for p in self.parameters]
            self._zeros = {a: self._ortvalue(np.zeros(self._expected[p][1], np.float32))
                           for a, p in zip(self._accumulators, self.parameters)}
            parts = [self._gradient, self._optimizer]
        else:
            def gated_step(exposed_outputs):
                exposed = step_graph.expose_forward_outputs(model, exposed_outputs)
                return _gate_state_updates(exposed, self._state_map, [f"{p}_grad" for p in self.parameters], "loss")

            self._step_part = _Part(onnxruntime, gated_step(everyday), options, providers, self._state_map)
            tail_model = gated_step(self.forward_outputs) if self._tail_outputs else None
            self._tail_state = self._state_map
            parts = [self._step_part]
        # one buffer for a tensor only if every part that updates it can do so in place
        self._in_place = {name for name in self._state_map
                          if all(name in part.in_place for part in parts if name in part.state)}
        self._tail_model = tail_model
        self._tail_part: Optional[_Part] = None
        if self._tail_model is not None:  # what the tail reads (the bias) is not updated in place
            tail_inputs = {i.name for i in self._tail_model.graph.input}
            tail_state = {name: out for name, out in self._tail_state.items() if name in tail_inputs}
            self._in_place -= set(tail_state) - structure.in_place_updates(self._tail_model.graph, tail_state)
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

    def _with_tail(self) -> _Part:
        """The step's (or, split, the gradients') session that also computes the forward tail's
        outputs, built at the first step asking for one."""
        if self._tail_part is None:
            part = _Part(self._ort, self._tail_model, *self._session_arguments, self._tail_state)
            unsafe = (self._in_place & set(part.state)) - part.in_place
            if unsafe:  # the graph onnxruntime runs reads them after their update: not seen before it ran
                raise TrainerError(f"internal error: the session computing {sorted(self._tail_outputs)} would read "
                                   f"{sorted(unsafe)} after their in-place update; please report it")
            self._tail_part = part
        return self._tail_part

    def _hyperparameters(self, model: onnx.ModelProto, inputs) -> Hyperparameters:
        """The step graph's hyperparameters at their defaults (:func:`graph_defaults`)."""
        from normgrad.graphs import optimizers, step_graph

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

    def lr(self, step: Optional[int] = None) -> float:
        """The learning rate of ``step`` (default: the next step)."""
        return self.hyperparameters.value("lr", self._step + 1 if step is None else step)

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

    def _dropout_feeds(self, part: "_Part", micro_batch: int = 0) -> Dict[str, np.ndarray]:
        """The seed (and micro-batch index) inputs of a part with seeded Dropout."""
        from normgrad.graphs import rewrites

        feeds = {rewrites.DROPOUT_SEED_INPUT: np.array(self._seed, np.int64),
                 rewrites.DROPOUT_MICRO_BATCH_INPUT: np.array(micro_batch, np.int64)}
        return {name: value for name, value in feeds.items() if name in part.inputs}

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
            part = self._with_tail() if self._tail_outputs & set(fetched) else self._step_part
            loss = self._run(part, {**feeds, **scalars, **self._dropout_feeds(part)}, fetched=fetched)
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
        gradient = self._with_tail() if self._tail_outputs & set(parts) else self._gradient
        for i in range(k):
            micro = {name: value[i * (len(value) // k):(i + 1) * (len(value) // k)] for name, value in feeds.items()}
            dropout = self._dropout_feeds(gradient, i)
            if dropout:
                micro.update(dropout, step=step)
            fetched_micro = dict.fromkeys(parts)
            losses.append(self._run(gradient, {**micro, "grad_scale": scale}, self._zeros if i == 0 else {},
                                    fetched=fetched_micro))
            for name, value in fetched_micro.items():
                parts[name].append(value)
        for name, values in parts.items():  # a scalar output gets one entry per micro-batch
            fetched[name] = np.concatenate(values) if values[0].ndim else np.stack(values)
        return float(np.mean(losses))

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
