"""The Trainer's sessions and its runs: :class:`TrainerSession` holds the onnxruntime
sessions of a step graph (one, or its gradient graph and its optimizer graph) and runs a
step, binding the state a :class:`normgrad._state.TrainerState` holds; the graph
onnxruntime actually runs (what may be updated in place), the session options (external
data, config entries, normgrad's kernels), and the gate that makes a step's state updates
all-or-nothing (:func:`_gate_state_updates`)."""

from __future__ import annotations

import copy
import json
import os
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np
import onnx

from normgrad.util.external_data import uses_external_data
from normgrad.util.files import StagedFile
from normgrad._step_graph import APPLIED, SPLIT_LOSS, StepGraph
from normgrad.errors import TrainerError
from normgrad.graphs import structure

# the names _data_parallel and tools/_train_step import from here (and loop/logs TrainerError)
from normgrad._step_graph import check_metadata as _check_step_metadata  # noqa: F401
from normgrad._step_graph import load_graph as _load_step_graph  # noqa: F401
from normgrad._step_graph import np_dtype as _np_dtype  # noqa: F401

__all__ = ["TrainerSession", "GraphSession", "prepare_session_options", "training_session_options",
           "keep_bfloat16_initializers", "DISABLE_PREPACKING"]


class TrainerSession:
    """The onnxruntime sessions a Trainer runs, and its runs.

    One session runs the step graph; when ``split`` (gradient accumulation, or a
    data-parallel subclass reducing gradients), one runs its gradient graph per micro-batch
    and one its optimizer graph. The session a step runs its forward and backward in (the
    step graph's, split: the gradient graph's) exposes no forward output: onnxruntime would
    keep each one alive to the end of the run (an LLM's logits through the whole backward).
    The first step asking for forward outputs replaces it by a session exposing them all
    (the forward tail's too: a bias Add the loss absorbed), which then serves every step:
    the lean session is dropped first, so at most one such session (and one copy of its
    frozen initializers) is alive. Each graph is gated (:func:`_gate_state_updates`): a step
    whose loss or a gradient is not finite writes no update, and every update may be in
    place.

    Attributes:
        accumulation: micro-batches per optimizer step.
        split: whether a step runs the gradient graph, then the optimizer graph.
        forward_outputs: the forward outputs a step can return.
        exposed: whether the step's session exposes them (from the first step asking for one).
        in_place: the state tensors every session updates in place (one buffer each), the
            exposing session's included before it is built.
        accumulators: ``{gradient accumulator: shape}`` of the gradient graph (split only).
        hyperparameter_inputs: the inputs of the session the hyperparameters feed.
        options, providers: what every session is made with.

    Raises:
        TrainerError: a corrupt ``normgrad.optimizer`` metadata (split).
    """

    def __init__(self, ort, graph: StepGraph, accumulation: int, split: bool, options, providers: List):
        from normgrad.graphs import step_graph

        self._ort, self._graph, self.accumulation, self.split = ort, graph, accumulation, split
        self.options, self.providers = options, providers
        try:
            self.forward_outputs: List[str] = step_graph.forward_outputs(graph.model)
        except ValueError:
            self.forward_outputs = []
        self.step_part: Optional[GraphSession] = None
        self.gradient: Optional[GraphSession] = None
        self.accumulators: Dict[str, tuple] = {}
        lean = self._forward_model(exposed=False)
        self._forward_state = graph.state if not split else json.loads(
            {e.key: e.value for e in lean.metadata_props}["normgrad.state"])
        self._set_forward_part(self.new_session(lean, self._forward_state))
        parts = [self.step_part] if not split else [self.gradient, self._optimizer_session()]
        # one buffer for a tensor only if every part that updates it can do so in place
        self.in_place = {name for name in graph.state
                         if all(name in part.in_place for part in parts if name in part.state)}
        self.exposed = set(self.forward_outputs) <= set(self.gradient.outputs if split else self.step_part.outputs)
        computed = {o for node in graph.model.graph.node for o in node.output}
        if not set(self.forward_outputs) <= computed:  # a tail (the bias Add the loss absorbed): what it
            exposing = self._forward_model(exposed=True)  # reads is not updated in place
            read = {name: out for name, out in self._forward_state.items()
                    if name in {i.name for i in exposing.graph.input}}
            self.in_place -= set(read) - structure.in_place_updates(exposing.graph, read)
        self.hyperparameter_inputs = self.step_part.inputs if not split else self._optimizer.inputs
        self._loss = ort.OrtValue.ortvalue_from_numpy(np.zeros((), np.float32))
        self._applied = ort.OrtValue.ortvalue_from_numpy(np.zeros((), np.bool_))

    def _gated(self, model: onnx.ModelProto, loss: str) -> onnx.ModelProto:
        return _gate_state_updates(model, self._graph.state, [f"{p}_grad" for p in self._graph.parameters], loss)

    def _forward_model(self, exposed: bool) -> onnx.ModelProto:
        """The graph a step runs its forward and backward in: the gated step graph (split: the
        gradient graph), with every forward output a graph output too when ``exposed``."""
        from normgrad.graphs import step_graph

        names = self.forward_outputs if exposed else []
        if not self.split:
            return self._gated(step_graph.expose_forward_outputs(self._graph.model, names), "loss")
        try:
            gradient = step_graph.build_gradient_graph(self._graph.model)
        except (ValueError, KeyError, TypeError) as error:
            raise TrainerError(f"corrupt step graph: metadata normgrad.optimizer: {error}") from None
        return step_graph.expose_forward_outputs(gradient, names)

    def _set_forward_part(self, part: Optional["GraphSession"]) -> None:
        if self.split:
            self.gradient = part
        else:
            self.step_part = part

    def _optimizer_session(self) -> "GraphSession":
        """The split step's optimizer session (:attr:`accumulators` set)."""
        from normgrad.graphs import optimizers, step_graph

        graph = self._graph
        try:
            kind, hyper = optimizers.optimizer_options(graph.model)
        except (ValueError, KeyError, TypeError) as error:
            raise TrainerError(f"corrupt step graph: metadata normgrad.optimizer: {error}") from None
        shapes = {p: list(graph.expected[p][1]) for p in graph.parameters}
        optimizer = optimizers.build_optimizer_graph(shapes, kind, **hyper)
        self._optimizer = self.new_session(self._gated(optimizer, SPLIT_LOSS), graph.state)
        self.accumulators = {p + step_graph.ACCUMULATOR_SUFFIX: graph.expected[p][1] for p in graph.parameters}
        return self._optimizer

    def new_session(self, model: onnx.ModelProto, state: Mapping[str, str]) -> "GraphSession":
        """A session of ``model`` with the trainer's options; ``state``: as :class:`GraphSession`'s."""
        return GraphSession(self._ort, model, self.options, self.providers, state)

    def _forward_part(self, fetched: Mapping[str, object]) -> "GraphSession":
        """The session a step runs its forward and backward in (split: the gradient graph's);
        from the first step fetching forward outputs on, the one exposing them (:meth:`_expose`)."""
        if fetched and not self.exposed:
            self._expose()
        return self.gradient if self.split else self.step_part

    def _expose(self) -> None:
        """Replaces the lean session by one exposing every forward output. The lean one is
        dropped first (its memory freed before the new one takes its own); it is made again
        if the new one cannot be."""
        exposing = self._forward_model(exposed=True)
        self._set_forward_part(None)
        try:
            part = self.new_session(exposing, self._forward_state)
            unsafe = (self.in_place & set(part.state)) - part.in_place
            if unsafe:  # the graph onnxruntime runs reads them after their update: not seen before it ran
                raise TrainerError(f"internal error: the session computing {self.forward_outputs} would read "
                                   f"{sorted(unsafe)} after their in-place update; please report it")
        except BaseException:
            self._set_forward_part(self.new_session(self._forward_model(exposed=False), self._forward_state))
            raise
        self._set_forward_part(part)
        self.exposed = True

    @property
    def applied(self) -> bool:
        """Whether the last step wrote its updates (its loss and every gradient finite)."""
        return bool(self._applied.numpy())

    def run(self, part: "GraphSession", state, feeds: Mapping[str, object], replace: Mapping[str, object] = {},
            fetched: Optional[Dict[str, object]] = None) -> float:
        """Runs ``part`` with ``feeds`` and the state tensors it reads bound from ``state``'s
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
            if name in state and name not in feeds:
                binding.bind_ortvalue_input(name, replace.get(name, state.value(name)))
        for name, next_value in part.state.items():
            binding.bind_ortvalue_output(next_value, state.next_buffer(name))
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
        state.swap(part.state)
        return float(self._loss.numpy()) if "loss" in part.outputs else float("nan")

    def step(self, state, feeds: Dict[str, np.ndarray], scalars: Dict[str, np.ndarray], fetched: Dict[str, object],
             reduce_gradients: Callable) -> float:
        """One optimizer step's runs on checked ``feeds`` with the hyperparameters and step
        ``scalars``; returns the loss (whether it was applied: :attr:`applied`).
        ``reduce_gradients`` (split): the gradients -> those the optimizer applies."""
        if not self.split:
            part = self._forward_part(fetched)
            return self.run(part, state, {**feeds, **scalars, **self._dropout_feeds(part, state.seed)}, fetched=fetched)
        return self._split_step(state, feeds, scalars, fetched, reduce_gradients)

    def _dropout_feeds(self, part: "GraphSession", seed: int, micro_batch: int = 0) -> Dict[str, np.ndarray]:
        """The seed (and micro-batch index) inputs of a part with seeded Dropout."""
        from normgrad.graphs import rewrites

        feeds = {rewrites.DROPOUT_SEED_INPUT: np.array(seed, np.int64),
                 rewrites.DROPOUT_MICRO_BATCH_INPUT: np.array(micro_batch, np.int64)}
        return {name: value for name, value in feeds.items() if name in part.inputs}

    def _split_step(self, state, feeds: Dict[str, np.ndarray], scalars: Dict[str, np.ndarray], fetched,
                    reduce_gradients: Callable) -> float:
        """Gradient graph per micro-batch, then the optimizer graph; the gradient graph's own
        state (running statistics) is restored when the step raises or is not applied."""
        kept = {name: state.value(name).numpy().copy() for name in self.gradient.state if name not in state.zeros}
        try:
            loss = self._accumulate(state, feeds, scalars["step"], fetched)
            gradients = {p: state.value(a) for p, a in zip(self._graph.parameters, self.accumulators)}
            gradients = reduce_gradients(gradients)
            self.run(self._optimizer, state, {**scalars, SPLIT_LOSS: np.array(loss, np.float32),
                                              **{f"{p}_grad": gradients[p] for p in self._graph.parameters}})
        except BaseException:
            state.restore(kept)
            raise
        if not self.applied:
            state.restore(kept)
        return loss

    def _accumulate(self, state, feeds: Dict[str, np.ndarray], step: np.ndarray,
                    fetched: Optional[Dict[str, object]] = None) -> float:
        k = self.accumulation
        scale = np.array(1.0 / k, np.float32)
        losses = []
        parts: Dict[str, List[np.ndarray]] = {name: [] for name in fetched or {}}
        gradient = self._forward_part(parts)
        for i in range(k):
            micro = {name: value[i * (len(value) // k):(i + 1) * (len(value) // k)] for name, value in feeds.items()}
            dropout = self._dropout_feeds(gradient, state.seed, i)
            if dropout:
                micro.update(dropout, step=step)
            fetched_micro = dict.fromkeys(parts)
            losses.append(self.run(gradient, state, {**micro, "grad_scale": scale}, state.zeros if i == 0 else {},
                                   fetched=fetched_micro))
            for name, value in fetched_micro.items():
                parts[name].append(value)
        for name, values in parts.items():  # a scalar output gets one entry per micro-batch
            fetched[name] = np.concatenate(values) if values[0].ndim else np.stack(values)
        return float(np.mean(losses))


def _gate_state_updates(model: onnx.ModelProto, state: Mapping[str, str], gradients: Sequence[str],
                        loss: Optional[str]) -> onnx.ModelProto:
    """A copy of ``model`` that outputs :data:`APPLIED` = loss + sum of every gradient's sum is
    finite (a NaN or inf anywhere reaches it; the sum overflows only past 3e38) and writes its
    state updates (``NAME.next``) only when it is true, with no copy of a state tensor: each
    update node that has an ``applied`` input (AdamUpdate, SGDUpdate, GatedUpdate) takes it
    (false: no update, no write: its outputs are its inputs); any other update (BatchNorm's
    running statistics) becomes GatedUpdate(NAME, update, APPLIED). Every write then waits for
    the loss and every gradient: a failing forward or backward node writes nothing, and every
    reader of a weight precedes its update (so it may be in place)."""
    from onnx import helper

    from normgrad.ops.api import add_functions_in_place
    from normgrad.ops import DOMAIN, OPERATORS, gated_update

    gated = copy.deepcopy(model)
    graph = gated.graph
    produced = {name for node in graph.node for name in node.output}
    terms = [loss] if loss else []
    nodes = []
    if loss and loss not in produced and loss not in {i.name for i in graph.input}:
        graph.input.append(helper.make_tensor_value_info(loss, onnx.TensorProto.FLOAT, []))
    for gradient in gradients:
        if gradient in produced or gradient in {i.name for i in graph.input}:
            nodes.append(helper.make_node("ReduceSum", [gradient], [f"{gradient}.gate_sum"], keepdims=0))
            terms.append(f"{gradient}.gate_sum")
    nodes.append(helper.make_node("Sum", terms, ["normgrad.gate_total"]))
    nodes.append(helper.make_node("Sub", ["normgrad.gate_total", "normgrad.gate_total"], ["normgrad.gate_zero"]))
    nodes.append(helper.make_node("Equal", ["normgrad.gate_zero", "normgrad.gate_zero"], [APPLIED]))  # NaN != NaN
    updates = set(state.values())
    gated_inside, op_types = set(), {gated_update.OP_TYPE}
    for node in graph.node:
        module = OPERATORS.get(node.op_type) if node.domain == DOMAIN else None
        if module is not None and "applied" in module.INPUTS and set(node.output) - {""} <= updates:
            applied_index = module.INPUTS.index("applied")
            node.input.extend([""] * (applied_index + 1 - len(node.input)))
            node.input[applied_index] = APPLIED
            gated_inside.update(node.output)
            op_types.add(node.op_type)
    renamed = {next_value: f"{next_value}.ungated" for next_value in state.values()
               if next_value in produced and next_value not in gated_inside}
    for node in graph.node:
        for index, name in enumerate(node.input):
            node.input[index] = renamed.get(name, name)
        for index, name in enumerate(node.output):
            node.output[index] = renamed.get(name, name)
    for value, next_value in state.items():
        if next_value in renamed:
            nodes.append(helper.make_node(gated_update.OP_TYPE, [value, renamed[next_value], APPLIED], [next_value],
                                          domain=DOMAIN))
    graph.node.extend(nodes)
    # the function bodies (for a session without normgrad's kernels) must read the new
    # inputs: attached again (an inlined step graph gets GatedUpdate's, its Where)
    kept = [f for f in gated.functions if not (f.domain == DOMAIN and f.name in op_types)]
    del gated.functions[:]
    gated.functions.extend(kept)
    add_functions_in_place(gated)
    graph.output.append(helper.make_tensor_value_info(APPLIED, onnx.TensorProto.BOOL, []))
    return gated


def training_session_options(ort, model: Optional[onnx.ModelProto] = None):
    """The Trainer's session options when the user gives none: onnxruntime's defaults with
    memory patterns and weight pre-packing off (pre-packing stays on for a ``model`` with a
    ``com.microsoft`` MatMulNBits node, below).

    A pattern plans one block for every intermediate of a run; a training step's backward
    keeps most of them alive, and with patterns off the CPU arena reuses freed chunks
    instead: on the benchmark's GPT-2 and Llama (4 layers, hidden 256, vocabulary 8192,
    [8, 128], 1 thread) the peak RSS falls by 200 MB (689 to 482 MB, 839 to 629 MB) at the
    same step time, where the arena off saves less and costs 5-20% of the step time.

    Pre-packing copies every constant weight a Gemm or MatMul reads into the GEMM's packed
    layout when the session is created, one copy per orientation read: a frozen base read by
    the forward (``Gemm(x, W, transB=1)``) and the backward (``Gemm(dY, W)``) is then held
    twice (two packed copies) or, at ``ORT_DISABLE_ALL``, three times (the original,
    memory-mapped from its data file, too). Off, it is held once and the GEMM packs panels
    as it goes, which costs CPU time with few tokens: on the 0.6 B LoRA hand run (64 tokens)
    the step's peak RSS falls from 3.93 to 2.39 GiB and its CPU time grows by about 25%
    (docs/explanation/performance.md).

    MatMulNBits is the exception: its kernel packs its quantized weights (and, at
    ``accuracy_level`` 4, computes with int8 activations as inference does) only when
    pre-packing is on; off, it dequantizes a float32 copy of the weight in every run, which
    is neither the inference's numbers nor its memory."""
    options = ort.SessionOptions()
    options.enable_mem_pattern = False
    if model is None or not any(node.op_type == "MatMulNBits" for node in model.graph.node):
        options.add_session_config_entry(DISABLE_PREPACKING, "1")
    return options


DISABLE_PREPACKING = "session.disable_prepacking"


def prepare_session_options(options, graph: StepGraph, eval_model: Optional[onnx.ModelProto], kernels) -> None:
    """Configures the sessions' ``options`` for the step graph and its evaluation graph: their
    external data read from the step graph's folder, normgrad's kernels registered
    (``kernels``: ``"auto"`` when the library is installed, ``"cpp"`` always, None never).

    Raises:
        FileNotFoundError: ``kernels="cpp"`` without the library.
    """
    if graph.uses_external_data() or (
            eval_model is not None and any(uses_external_data(t) for t in eval_model.graph.initializer)):
        _external_data_options(options, graph.external_data_folder)
    if kernels is not None:
        from normgrad.ops.api import session_options

        try:
            session_options("cpp", options)
        except FileNotFoundError:
            if kernels == "cpp":
                raise


def _external_data_options(options, folder: str) -> None:
    """Session options for a graph whose initializers keep their data in ``folder``: the
    sessions read them from there (not from the current folder), and the graph onnxruntime
    writes while creating a session (see :func:`_session_and_running_graph`) keeps them in
    a data file beside it instead of past protobuf's 2 GiB limit."""
    _set_config_entry(options, _EXTERNAL_FOLDER, folder)
    _set_config_entry(options, "session.optimized_model_external_initializers_file_name", "running.onnx.data")


def _config_entry(options, key: str) -> Optional[str]:
    try:
        return options.get_session_config_entry(key)
    except Exception:  # not set
        return None


def _set_config_entry(options, key: str, value: str) -> None:
    """Sets a session config entry unless it has that value (onnxruntime warns on each
    overwrite: a SessionOptions shared by two Trainers)."""
    if _config_entry(options, key) != value:
        options.add_session_config_entry(key, value)


class GraphSession:
    """One onnxruntime session of the trainer and its reused IOBinding.

    ``state`` maps state inputs to the outputs holding their next value."""

    def __init__(self, ort, model: onnx.ModelProto, options, providers, state: Mapping[str, str]):
        self.inputs = {i.name: i for i in model.graph.input}
        self.state = {name: state[name] for name in self.inputs if name in state}
        self.outputs = {o.name: o for o in model.graph.output}
        self.session, running = _session_and_running_graph(ort, model, options, providers)
        self.binding = self.session.io_binding()
        self.in_place = structure.in_place_updates(running.graph, self.state) if running is not None else set()


def _session_and_running_graph(ort, model: onnx.ModelProto, options, providers):
    """An onnxruntime session of ``model`` and the graph it runs (after onnxruntime's graph
    optimizations at ``options``' level and its partitioning), which onnxruntime writes out
    while it creates the session. The graph is None where onnxruntime cannot write it (a
    provider that compiles nodes): then nothing is updated in place."""
    import tempfile

    saved_path, saved_severity = options.optimized_model_filepath, options.log_severity_level
    with tempfile.TemporaryDirectory(prefix="normgrad-trainer-") as folder:
        path = os.path.join(folder, "running.onnx")
        options.optimized_model_filepath = path
        options.log_severity_level = max(saved_severity, 3)  # the warning that an optimized ALL-level graph is machine-specific
        try:
            session = _session(ort, model, options, providers)
            running = onnx.load(path, load_external_data=False)
        except Exception:
            session, running = None, None
        finally:
            options.optimized_model_filepath, options.log_severity_level = saved_path, saved_severity
    if session is None:
        session = _session(ort, model, options, providers)
    return session, running


_DISABLED_OPTIMIZERS = "optimization.disable_specified_optimizers"


def keep_bfloat16_initializers(model: onnx.ModelProto, options) -> None:
    """Turns off two of onnxruntime's optimizers for a model with bfloat16 initializers (a
    frozen base, read through Casts to float32: rewrites.bfloat16_in_float32): constant
    folding, which would replace each by a float32 copy, twice its memory, and common
    subexpression elimination, which would merge the Casts the graph builder gives each
    reader of a weight (rewrites.cast_stored_weights_per_reader) back into one whose float32
    output lives from the forward to the backward."""
    if not any(t.data_type == onnx.TensorProto.BFLOAT16 for t in model.graph.initializer):
        return
    disabled = (_config_entry(options, _DISABLED_OPTIMIZERS) or "").split(";")  # onnxruntime (1.19.2, 1.32) splits at ";"
    wanted = [name for name in ("ConstantFolding", "CommonSubexpressionElimination") if name not in disabled]
    if wanted:
        options.add_session_config_entry(_DISABLED_OPTIMIZERS, ";".join(filter(None, [*disabled, *wanted])))


_EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"


def _session(ort, model: onnx.ModelProto, options, providers):
    """An onnxruntime session of ``model``. With external data in a folder named by the
    options (:func:`_external_data_options`) on onnxruntime older than 1.21, which has no
    such option and reads an in-memory model's external data from the current folder, the
    model is loaded from a temporary file in that folder."""
    folder = _config_entry(options, _EXTERNAL_FOLDER)
    version = tuple(int(part) for part in ort.__version__.split(".")[:2] if part.isdigit())
    if folder is None or version >= (1, 21):
        return ort.InferenceSession(model.SerializeToString(), options, providers=providers)
    staged = StagedFile(os.path.join(folder, "normgrad-session.onnx"), [model.SerializeToString()])
    try:
        return ort.InferenceSession(staged.temporary, options, providers=providers)
    finally:
        staged.discard()
