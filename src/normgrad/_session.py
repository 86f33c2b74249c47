"""The Trainer's onnxruntime plumbing: loading a step graph, its sessions and the graph
onnxruntime actually runs, external data, session config entries, and the gate that makes
a step's state updates all-or-nothing."""

from __future__ import annotations

import copy
import json
import os
from typing import Mapping, Optional, Sequence

import numpy as np
import onnx

from normgrad.util.files import (PathAliasError, PathLike, StagedFile, complete_interrupted_commits, eval_graph_path,
                             refuse_aliases, refuse_irregular_file)
from normgrad.util.external_data import ExternalDataError, external_data_extent, external_data_files, uses_external_data
from normgrad.graphs import structure


class TrainerError(ValueError):
    """A step graph, checkpoint, batch or option the trainer cannot use."""


APPLIED = "normgrad.applied"
"""Boolean output the trainer adds to the graphs it runs: whether the step's updates were
written (the loss and every gradient finite) or every state tensor kept its value."""


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


def training_session_options(ort):
    """The Trainer's session options when the user gives none: onnxruntime's defaults with
    memory patterns and weight pre-packing off.

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
    (docs/explanation/performance.md)."""
    options = ort.SessionOptions()
    options.enable_mem_pattern = False
    options.add_session_config_entry(DISABLE_PREPACKING, "1")
    return options


DISABLE_PREPACKING = "session.disable_prepacking"


_SPLIT_LOSS = "normgrad.loss"
"""Input of the trainer's optimizer graph: the step's mean loss, which gates its updates."""


def _load_step_graph(path: PathLike, what: str = "step graph") -> onnx.ModelProto:
    """The graph at ``path``, after finishing an interrupted commit of its folder
    (:func:`normgrad.util.files.complete_interrupted_commits`); its external data (a frozen base)
    stays in its files, which the sessions read from the graph's folder."""
    complete_interrupted_commits(os.path.dirname(os.path.abspath(os.fspath(path))))
    try:
        refuse_irregular_file(path, what)
        return onnx.load(os.fspath(path), load_external_data=False)
    except OSError as error:
        raise TrainerError(f"cannot read the {what} {os.fspath(path)!r}: {error.strerror or error}") from None
    except Exception as error:  # protobuf's DecodeError and what a cut file raises
        raise TrainerError(f"{os.fspath(path)!r} is not an ONNX model (corrupt or truncated: {error})") from None


def _external_data_options(options, folder: str) -> None:
    """Session options for a graph whose initializers keep their data in ``folder``: the
    sessions read them from there (not from the current folder), and the graph onnxruntime
    writes while creating a session (see :func:`_session_and_running_graph`) keeps them in
    a data file beside it instead of past protobuf's 2 GiB limit."""
    _set_config_entry(options, _EXTERNAL_FOLDER, folder)
    _set_config_entry(options, "session.optimized_model_external_initializers_file_name", "running.onnx.data")


def _check_external_data(model: onnx.ModelProto, folder: str, what: str = "step graph") -> None:
    """TrainerError naming the first external tensor of ``model`` whose data cannot be used
    from ``folder`` (:func:`normgrad.util.external_data.external_data_extent`: a location outside it, a
    missing file, one shorter than offset + length); onnxruntime would fail at session
    creation with its own message. Every graph the Trainer loads goes through it."""
    for tensor in model.graph.initializer:
        if uses_external_data(tensor):
            try:
                external_data_extent(tensor, folder)
            except ExternalDataError as error:
                raise TrainerError(f"{what}: {error}") from None


_METADATA_RULES = {
    "normgrad.state": ("an object of names", lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(x, str) for k, x in v.items())),
    "normgrad.parameters": ("a list of names", lambda v: _names(v)),
    "normgrad.data_inputs": ("a list of names", lambda v: _names(v)),
    "normgrad.forward_outputs": ("a list of names", lambda v: _names(v)),
    "normgrad.running_statistics": ("a list of names", lambda v: _names(v)),
    "normgrad.optimizer": ("an object", lambda v: isinstance(v, dict)),
    "normgrad.loss": ("null or an object with string 'kind' and 'output'", lambda v: v is None or (
        isinstance(v, dict) and isinstance(v.get("kind"), str) and isinstance(v.get("output"), str)
        and isinstance(v.get("options") or {}, dict))),
    "normgrad.dropout": ("null or an object with an int64 'seed' and an 'outputs' object", lambda v: v is None or (
        isinstance(v, dict) and _int64(v.get("seed")) and isinstance(v.get("outputs", {}), dict))),
    "normgrad.batch_norm": ("a list of objects", lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v)),
    "normgrad.data_parallel": ("an object", lambda v: isinstance(v, dict)),
    "normgrad.forward_tail": ("a string", lambda v: isinstance(v, str)),
}


def _names(value) -> bool:
    return isinstance(value, list) and all(isinstance(name, str) for name in value)


def _int64(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63


def _check_step_metadata(model: onnx.ModelProto, what: str = "step graph") -> None:
    """TrainerError naming the first ``normgrad.*`` metadata entry of ``model`` that is not
    JSON (every reader parses them all) or that breaks the rule of its key."""
    for entry in model.metadata_props:
        if not entry.key.startswith("normgrad."):
            continue
        try:
            value = json.loads(entry.value)
        except ValueError:
            raise TrainerError(f"corrupt {what}: metadata {entry.key} is not JSON; got {entry.value[:80]!r}") from None
        rule = _METADATA_RULES.get(entry.key)
        if rule is not None and not rule[1](value):
            raise TrainerError(f"corrupt {what}: metadata {entry.key} must be {rule[0]}; got {entry.value[:80]!r}")


def _check_reserved_names(model: onnx.ModelProto) -> None:
    """TrainerError naming a value of the step graph that has a name the trainer gives a value
    of the graphs it runs (the step gate, the split optimizer's loss input, the gradient
    graph's ``grad_scale`` and micro-batch index)."""
    from normgrad.graphs import rewrites

    graph = model.graph
    given = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    names = given | {o.name for o in graph.output} | {name for node in graph.node for name in node.output}
    reserved = {APPLIED, _SPLIT_LOSS, "normgrad.gate_total", "normgrad.gate_zero", "grad_scale"}
    for name in sorted(names):
        if name in reserved or name.endswith((".gate_sum", ".ungated")) or (
                name == rewrites.DROPOUT_MICRO_BATCH_INPUT and name in given):
            raise TrainerError(f"the step graph has a value named {name!r}, a name the trainer gives a value of the "
                               "graphs it runs: rename it in the forward model and export again")


def _files_read(model: onnx.ModelProto, path: Optional[PathLike], folder: str, what: str) -> list:
    """``(description, path)`` of the graph file at ``path`` (if given by path) and of the
    external-data files it reads: what the Trainer's writers must not replace."""
    files = [(f"the trainer's {what}", path)] if path is not None else []
    return files + [(f"a data file of the trainer's {what}", data) for data in external_data_files(model, folder)]


def _exported_eval_graph(step_path: Optional[PathLike]) -> Optional[str]:
    """``NAME.eval.onnx`` beside a step graph ``NAME.onnx`` read from a file, if it exists:
    ``normgrad export --optimizer`` writes the two as one set."""
    if step_path is None:
        return None
    beside = eval_graph_path(os.fspath(step_path))
    return beside if os.path.isfile(beside) else None


def _refuse_overwriting(outputs: Mapping[str, PathLike], read: Sequence) -> None:
    """TrainerError when a write's outputs alias each other or a file in ``read``
    (:func:`normgrad.util.files.refuse_aliases`)."""
    try:
        refuse_aliases(outputs, read)
    except PathAliasError as error:
        raise TrainerError(str(error)) from None


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


def _metadata_json(metadata: Mapping[str, str], key: str, kind: type):
    try:
        value = json.loads(metadata[key])
    except ValueError:
        value = None
    if not isinstance(value, kind):
        raise TrainerError(f"corrupt step graph: metadata {key} must be a JSON {kind.__name__}; got {metadata[key][:80]!r}")
    return value


def _np_dtype(info: onnx.ValueInfoProto) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type))


class _Part:
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


def _keep_bfloat16_initializers(model: onnx.ModelProto, options) -> None:
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
