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
Trainer is composed of parts it holds, each an object with a small interface: the step graph
read and checked (:class:`normgrad._step_graph.StepGraph`); its sessions and their runs
(:class:`normgrad._session.TrainerSession`: the graph onnxruntime runs, external data, the
step gate); the checks of a batch (:class:`normgrad._batches.BatchFeeds`); the state, step
count, seed and hyperparameters with their checkpoints (:class:`normgrad._state.TrainerState`,
:class:`normgrad._hyperparameters.Hyperparameters`); evaluation
(:class:`normgrad._evaluation.Evaluation`). ``fit`` is :func:`normgrad.loop.fit`.

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
import os
from typing import Dict, Iterable, Iterator, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import onnx

import normgrad.checkpoint as checkpoints
from normgrad._batches import BatchFeeds, unpack_dict
from normgrad._evaluation import EvalResult, Evaluation
from normgrad.util.external_data import save_models_external
from normgrad.util.files import PathLike
from normgrad._hyperparameters import Hyperparameters, graph_defaults
from normgrad._session import TrainerSession, keep_bfloat16_initializers, prepare_session_options, training_session_options
from normgrad._state import SEED_METADATA, STEP_METADATA, TrainerState, initial_seed, writing
from normgrad._step_graph import StepGraph, evaluation_graph_and_files
from normgrad.errors import TrainerError
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



class Trainer:
    """Trains with a step graph, keeping its state in onnxruntime.

    Args:
        step_model: the step graph (path or ``ModelProto``) written by ``normgrad export
            --optimizer`` or :func:`normgrad.graphs.build_step_graph`.
        checkpoint: its state: a checkpoint path (``.ckpt`` beside the step graph, or one
            :meth:`save` wrote), the checkpoint's ``ModelProto``, a
            :class:`normgrad.checkpoint.Checkpoint`, or ``{name: array}`` (the initial state
            ``build_step_graph`` returns).
        lr: the learning rate. It and the optimizer's other hyperparameters below are each
            a number or a schedule ``f(step) -> value`` of the 1-based optimizer step; None
            keeps the checkpoint's value, else the step graph's (its export value; lr 1e-3 for
            a graph that stores none). Only those the step graph takes
            (:attr:`hyperparameters`); set them between steps there.
        weight_decay: the weight decay.
        betas: Adam's ``(beta1, beta2)``, a pair of numbers or schedules.
        eps: Adam's epsilon.
        momentum: SGD's momentum.
        dampening: SGD's dampening.
        max_grad_norm: the global gradient norm clipped to.
        accumulation: micro-batches per optimizer step: :meth:`step` splits its batch along
            axis 0 into this many equal parts and averages their gradients.
        providers: onnxruntime execution providers (default ``["CPUExecutionProvider"]``).
        session_options: an ``onnxruntime.SessionOptions`` (threads, logging, ...). None:
            :func:`normgrad._session.training_session_options` (memory patterns and weight
            pre-packing off, but for MatMulNBits models).
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

        graph = StepGraph(step_model, external_data_folder)
        _check_options(accumulation, kernels, nonfinite)
        self.nonfinite, self.accumulation, self.skipped_steps = nonfinite, accumulation, 0
        self.step_model, self.external_data_folder = graph.model, graph.external_data_folder
        self.parameters, self.data_inputs = graph.parameters, graph.data_inputs
        self._graph = graph
        options = session_options if session_options is not None else training_session_options(onnxruntime, graph.model)
        keep_bfloat16_initializers(graph.model, options)
        eval_model, read_files = evaluation_graph_and_files(graph, eval_model)
        prepare_session_options(options, graph, eval_model, kernels)
        self.split = accumulation > 1 or type(self).reduce_gradients is not Trainer.reduce_gradients
        providers = list(providers) if providers is not None else ["CPUExecutionProvider"]
        self._session = TrainerSession(onnxruntime, graph, accumulation, self.split, options, providers)
        self.forward_outputs = self._session.forward_outputs
        self._feeds = BatchFeeds(graph, accumulation, self.forward_outputs)
        self._evaluation = Evaluation(graph, eval_model, self._session, self._feeds)
        first_seed = initial_seed(graph, seed)
        self.hyperparameters = _graph_hyperparameters(graph.model, lambda: self._state.step + 1)
        self._state = TrainerState(onnxruntime, graph.expected, (device, device_id), self._session.in_place,
                                   self._session.accumulators, read_files, first_seed, self.hyperparameters)
        self._state.load(checkpoint, self.broadcast_state)
        if seed is not None:
            self._state.seed = int(seed)
        self._set_hyperparameters(dict(lr=lr, weight_decay=weight_decay, eps=eps, momentum=momentum,
                                       dampening=dampening, max_grad_norm=max_grad_norm), betas)

    def _set_hyperparameters(self, given: Dict[str, object], betas) -> None:
        """Sets the hyperparameters given to the constructor (None: kept)."""
        if betas is not None:
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise TrainerError(f"betas must be a pair (beta1, beta2) of numbers or schedules; got {betas!r}")
            given.update(beta1=betas[0], beta2=betas[1])
        for name, value in given.items():
            if value is not None:
                self.hyperparameters.set(name, value)

    @property
    def schedule(self) -> Schedule:
        """The learning rate as a function of the 1-based step (``hyperparameters["lr"]``'s)."""
        return self.hyperparameters.schedule("lr") or constant(self.hyperparameters["lr"])

    def lr(self, step: Optional[int] = None) -> float:
        """The learning rate of ``step`` (default: the next step)."""
        return self.hyperparameters.value("lr", self._state.step + 1 if step is None else step)

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

    # -- stepping and evaluating ------------------------------------------------------------

    def step(self, *batch, outputs: Optional[Sequence[str]] = None, **named) -> Union[float, StepResult]:
        """One optimizer step on a batch: the step graph's data inputs positionally in
        ``trainer.data_inputs`` order, by name, or as one dict ``{input name: array}``.
        Returns its loss (with accumulation, the mean of the micro-batch losses), or with
        ``outputs`` (names among :attr:`forward_outputs`, e.g. ``["logits"]``) a
        :class:`StepResult` holding the loss and those outputs of the step's forward pass.
        Steps hold no forward output until one asks: from then on every step's run holds
        them to its end, asked for or not (:class:`normgrad._session.TrainerSession`).

        Raises:
            TrainerError: a batch the step graph cannot take (names, dtypes, shapes, an empty
                batch, cross_entropy labels outside 0..C-1 or the ignore_index), a learning
                rate that is not a finite number >= 0, or (``nonfinite="raise"``) a
                non-finite loss or gradient. The state and step count are then unchanged,
                as they are when onnxruntime raises during the step."""
        batch, named = unpack_dict(batch, named)
        fetched = self._feeds.requested(outputs)
        feeds = self._feeds.feeds(batch, named)
        step = self._state.step + 1
        scalars = {**self.hyperparameters.feeds(step, self._session.hyperparameter_inputs),
                   "step": np.array(step, np.float32)}
        loss = self._session.step(self._state, feeds, scalars, fetched, self.reduce_gradients)
        if not self._session.applied:
            self.skipped_steps += 1
            if self.nonfinite == "raise":
                raise TrainerError(f"step {step}: the loss ({loss}) or a gradient is not finite; the state is unchanged "
                                   "(Trainer(..., nonfinite='skip') skips such steps)")
        else:
            self._state.step = step
        if outputs is None:
            return loss
        return StepResult(loss=loss, outputs=fetched, step=self._state.step, lr=float(scalars["lr"]))

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

    def evaluate(self, *batch, outputs: Optional[Sequence[str]] = None, **named) -> EvalResult:
        """The loss and forward outputs of a batch in eval mode (BatchNorm on its running
        statistics, Dropout off, as torch's ``model.eval()``) with the current state, and no
        update: no weight, optimizer tensor, running statistic or step count changes. The
        batch is given as to :meth:`step` (labels included), whole (not split into
        micro-batches). ``outputs``: the forward outputs to return (default: all that the
        evaluation graph computes)."""
        batch, named = unpack_dict(batch, named)
        return self._evaluation.evaluate(self._state, batch, named, outputs)

    def fit(self, train, **options):
        """Epochs over ``train`` with evaluation, callbacks, early stopping, a scheduler,
        checkpoints, resume and logs: :func:`normgrad.loop.fit` (its arguments, its
        :class:`normgrad.loop.FitResult`)."""
        from normgrad.loop import fit

        return fit(self, train, **options)

    # -- the state, checkpoints and the files written from them -----------------------------

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far (the checkpoint's ``normgrad.step``)."""
        return self._state.step

    @property
    def seed(self) -> int:
        """The Dropout seed (saved in checkpoints; see the ``seed`` argument)."""
        return self._state.seed

    def state_dict(self) -> Dict[str, np.ndarray]:
        """A copy of every state tensor (weights, optimizer state, running statistics)."""
        return self._state.state_dict()

    def save(self, path: PathLike) -> None:
        """Writes the state and the step count to ``path`` atomically (a temporary file in the
        same folder, then renamed; a crash leaves the previous file). Reloading it gives
        bitwise the same state, and training on from it bitwise the same steps."""
        if self.is_saving_rank:
            self._state.save(path)

    def load(self, path: Union[PathLike, onnx.ModelProto, checkpoints.Checkpoint]) -> None:
        """Replaces the state and step count (and the Dropout seed, if it holds one) with a checkpoint's.

        Raises:
            TrainerError: a tensor missing, extra, or of another dtype or shape than the step graph's.
        """
        self._state.load(path, self.broadcast_state)

    def inference_model(self) -> onnx.ModelProto:
        """The forward model with the trained weights and running statistics as initializers,
        BatchNormalization in inference mode and Dropout as Identity: any onnxruntime runs it."""
        from normgrad.graphs.step_graph import build_inference_model

        return build_inference_model(self.step_model, self.state_dict())

    def export_inference_model(self, path: PathLike) -> None:
        """Writes :meth:`inference_model` to ``path`` atomically (with a frozen base in external
        data, or past 1 GiB of weights, its weights in ``PATH.HASH.data`` beside it)."""
        if self.is_saving_rank:
            self._state.refuse_overwriting({"inference model": path})
            with writing("inference model", path):
                save_models_external({path: self.inference_model()}, self.external_data_folder)

    def save_adapter(self, directory: PathLike) -> None:
        """Writes the trained LoRA adapters as peft's ``adapter_model.safetensors`` +
        ``adapter_config.json`` in ``directory`` (:func:`normgrad.lora.save_adapter`; the step
        graph must come from a peft model exported with :func:`normgrad.torch.export`)."""
        import normgrad.lora as lora

        if self.is_saving_rank:
            self._state.refuse_overwriting({"adapter " + name: os.path.join(directory, name)
                                            for name in (lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG)})
            with writing("adapter folder", directory):
                lora.save_adapter(directory, self.step_model, self.state_dict())

    def export_merged_model(self, path: PathLike) -> None:
        """Writes the inference model with the trained LoRA adapters folded into their base
        weights (:func:`normgrad.lora.merged_model`) to ``path`` atomically (with a frozen base in
        external data, or past 1 GiB of weights, its weights in ``PATH.HASH.data`` beside it)."""
        import normgrad.lora as lora

        if self.is_saving_rank:
            self._state.refuse_overwriting({"merged model": path})
            # the merged weights of an external base are computed one at a time as they are written
            merged, merged_weights = lora.merged_model_streamed(self.step_model, self.state_dict(),
                                                                self.external_data_folder)
            with writing("merged model", path):
                save_models_external({path: merged}, self.external_data_folder, contents=merged_weights)

    # -- what tests, normgrad.loop and normgrad.metrics read of the parts ---------------------

    @property
    def _loss_metadata(self) -> Dict[str, object]:
        return self._graph.loss

    @property
    def _expected(self) -> Dict[str, Tuple[np.dtype, Tuple[int, ...]]]:
        return self._graph.expected

    @property
    def _state_map(self) -> Dict[str, str]:
        return self._graph.state

    @property
    def _in_place(self) -> set:
        return self._session.in_place

    @property
    def _step_part(self):
        return self._session.step_part

    @property
    def _gradient(self):
        return self._session.gradient


def _check_options(accumulation, kernels, nonfinite) -> None:
    if not isinstance(accumulation, int) or accumulation < 1:
        raise TrainerError(f"accumulation must be an integer >= 1, got {accumulation!r}")
    if kernels not in ("auto", "cpp", None):
        raise TrainerError(f"kernels must be 'auto', 'cpp' or None, got {kernels!r}")
    if nonfinite not in ("raise", "skip"):
        raise TrainerError(f"nonfinite must be 'raise' or 'skip', got {nonfinite!r}")


def _graph_hyperparameters(model: onnx.ModelProto, next_step) -> Hyperparameters:
    """The step graph's hyperparameters at their defaults (:func:`graph_defaults`);
    ``next_step()``: the step a schedule is evaluated at by default."""
    from normgrad.graphs import optimizers

    try:
        kind, options = optimizers.optimizer_options(model)
    except (ValueError, KeyError, TypeError) as error:
        raise TrainerError(f"corrupt step graph: metadata normgrad.optimizer: {error}") from None
    structural = {name: options[name] for name in ("nesterov", "amsgrad") if name in options}
    return Hyperparameters(kind, graph_defaults(model), structural, next_step)
