"""The step graph a :class:`normgrad.train.Trainer` runs, read and checked before anything
is built from it: :class:`StepGraph` (its state, parameters, data inputs and loss, from its
metadata), the metadata rules (:func:`check_metadata`), the names the trainer reserves
(:func:`check_reserved_names`), and the files a trainer reads (:func:`files_read`), which
its writers must not replace."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Mapping, Optional, Tuple, Union

import numpy as np
import onnx

from normgrad._external_data import ExternalDataError, external_data_extent, external_data_files, uses_external_data
from normgrad._files import PathLike, complete_interrupted_commits, eval_graph_path, refuse_irregular_file
from normgrad.errors import TrainerError

__all__ = ["StepGraph", "load_graph", "check_metadata", "check_reserved_names", "check_external_data", "files_read",
           "exported_eval_graph", "evaluation_graph_and_files", "np_dtype", "APPLIED", "SPLIT_LOSS"]

APPLIED = "normgrad.applied"
"""Boolean output the trainer adds to the graphs it runs: whether the step's updates were
written (the loss and every gradient finite) or every state tensor kept its value."""

SPLIT_LOSS = "normgrad.loss"
"""Input of the trainer's optimizer graph: the step's mean loss, which gates its updates."""

_REQUIRED = ("normgrad.state", "normgrad.parameters", "normgrad.data_inputs", "normgrad.optimizer")


class StepGraph:
    """A step graph (path or ``ModelProto``) loaded and checked: its metadata JSON and of the
    rule of each key, no value named as the trainer names its own, every name the metadata
    gives one of its inputs or outputs.

    Attributes:
        model: the graph (its external data, a frozen base, stays in its files).
        path: where it was read from (None for a ``ModelProto``).
        external_data_folder: the absolute folder its external data is read from.
        metadata: its ``{key: value}`` metadata.
        state: ``{state input: output holding its next value}``.
        parameters: the trainable state inputs (their gradients are ``NAME_grad``).
        data_inputs: the inputs a batch feeds.
        loss: the ``normgrad.loss`` metadata (``{}`` without it).
        expected: ``{state input: (dtype, shape)}``, what a checkpoint must hold.

    Raises:
        TrainerError: an unreadable file, not a step graph, or a corrupt one.
    """

    def __init__(self, step_model: Union[PathLike, onnx.ModelProto], external_data_folder: Optional[PathLike]):
        model = step_model if isinstance(step_model, onnx.ModelProto) else load_graph(step_model)
        self.path = None if isinstance(step_model, onnx.ModelProto) else step_model
        if external_data_folder is None and self.path is not None:
            external_data_folder = os.path.dirname(os.path.abspath(os.fspath(step_model)))
        self.external_data_folder = os.path.abspath(os.fspath(external_data_folder or os.getcwd()))
        check_metadata(model)
        check_reserved_names(model)
        self.model = model
        self.metadata = {e.key: e.value for e in model.metadata_props}
        missing = [key for key in _REQUIRED if key not in self.metadata]
        if missing:
            raise TrainerError(f"not a step graph (metadata {missing[0]} missing): write one with "
                               "`normgrad export --loss ... --optimizer ...` or normgrad.graphs.build_step_graph")
        self.state: Dict[str, str] = _metadata_json(self.metadata, "normgrad.state", dict)
        self.parameters: List[str] = _metadata_json(self.metadata, "normgrad.parameters", list)
        self.data_inputs: List[str] = _metadata_json(self.metadata, "normgrad.data_inputs", list)
        self.loss = _metadata_json(self.metadata, "normgrad.loss", dict) if "normgrad.loss" in self.metadata else {}
        inputs = {i.name: i for i in self.model.graph.input}
        outputs = {o.name for o in self.model.graph.output}
        for name, next_value in self.state.items():
            if not isinstance(name, str) or name not in inputs or next_value not in outputs:
                raise TrainerError(f"corrupt step graph: metadata normgrad.state names {name!r} -> {next_value!r}, "
                                   "which is not one of its inputs and outputs")
        for name in self.data_inputs + self.parameters:
            if not isinstance(name, str) or name not in inputs:
                raise TrainerError(f"corrupt step graph: its metadata names {name!r}, which is not one of its inputs")
        self.expected: Dict[str, Tuple[np.dtype, Tuple[int, ...]]] = {
            name: (np_dtype(inputs[name]), tuple(d.dim_value for d in inputs[name].type.tensor_type.shape.dim))
            for name in self.state}

    def uses_external_data(self) -> bool:
        """Whether an initializer keeps its data in a file (a frozen base)."""
        return any(uses_external_data(t) for t in self.model.graph.initializer)


def load_graph(path: PathLike, what: str = "step graph") -> onnx.ModelProto:
    """The graph at ``path``, after finishing an interrupted commit of its folder
    (:func:`normgrad._files.complete_interrupted_commits`); its external data (a frozen base)
    stays in its files, which the sessions read from the graph's folder."""
    complete_interrupted_commits(os.path.dirname(os.path.abspath(os.fspath(path))))
    try:
        refuse_irregular_file(path, what)
        return onnx.load(os.fspath(path), load_external_data=False)
    except OSError as error:
        raise TrainerError(f"cannot read the {what} {os.fspath(path)!r}: {error.strerror or error}") from None
    except Exception as error:  # protobuf's DecodeError and what a cut file raises
        raise TrainerError(f"{os.fspath(path)!r} is not an ONNX model (corrupt or truncated: {error})") from None


def check_external_data(model: onnx.ModelProto, folder: str, what: str = "step graph") -> None:
    """TrainerError naming the first external tensor of ``model`` whose data cannot be used
    from ``folder`` (:func:`normgrad._external_data.external_data_extent`: a location outside it, a
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


def check_metadata(model: onnx.ModelProto, what: str = "step graph") -> None:
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


def check_reserved_names(model: onnx.ModelProto) -> None:
    """TrainerError naming a value of the step graph that has a name the trainer gives a value
    of the graphs it runs (the step gate, the split optimizer's loss input, the gradient
    graph's ``grad_scale`` and micro-batch index)."""
    from normgrad.graphs import rewrites

    graph = model.graph
    given = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    names = given | {o.name for o in graph.output} | {name for node in graph.node for name in node.output}
    reserved = {APPLIED, SPLIT_LOSS, "normgrad.gate_total", "normgrad.gate_zero", "grad_scale"}
    for name in sorted(names):
        if name in reserved or name.endswith((".gate_sum", ".ungated")) or (
                name == rewrites.DROPOUT_MICRO_BATCH_INPUT and name in given):
            raise TrainerError(f"the step graph has a value named {name!r}, a name the trainer gives a value of the "
                               "graphs it runs: rename it in the forward model and export again")


def files_read(model: onnx.ModelProto, path: Optional[PathLike], folder: str, what: str) -> list:
    """``(description, path)`` of the graph file at ``path`` (if given by path) and of the
    external-data files it reads: what the Trainer's writers must not replace."""
    files = [(f"the trainer's {what}", path)] if path is not None else []
    return files + [(f"a data file of the trainer's {what}", data) for data in external_data_files(model, folder)]


def evaluation_graph_and_files(graph: StepGraph, eval_model: Union[PathLike, onnx.ModelProto, None]
                               ) -> Tuple[Optional[onnx.ModelProto], list]:
    """The evaluation graph (``eval_model`` loaded when given by path) and the files a trainer
    of ``graph`` reads (:func:`files_read`, the evaluation graph exported beside the step graph
    among them), after checking both graphs' metadata and external data.

    Raises:
        TrainerError: an unreadable evaluation graph, corrupt metadata, unusable external data.
    """
    folder = graph.external_data_folder
    read = files_read(graph.model, graph.path, folder, "step graph")
    exported_eval = exported_eval_graph(graph.path)
    if exported_eval is not None:  # normgrad export's set: the evaluation graph beside the step graph
        read.append(("the evaluation graph exported with the step graph", exported_eval))
    if eval_model is not None and not isinstance(eval_model, onnx.ModelProto):
        eval_path = eval_model
        eval_model = load_graph(eval_path, "evaluation graph")
        read += files_read(eval_model, eval_path, folder, "evaluation graph")
    for model, what in ((graph.model, "step graph"), (eval_model, "evaluation graph")):
        if model is not None:
            check_metadata(model, what)
            check_external_data(model, folder, what)
    return eval_model, read


def exported_eval_graph(step_path: Optional[PathLike]) -> Optional[str]:
    """``NAME.eval.onnx`` beside a step graph ``NAME.onnx`` read from a file, if it exists:
    ``normgrad export --optimizer`` writes the two as one set."""
    if step_path is None:
        return None
    beside = eval_graph_path(os.fspath(step_path))
    return beside if os.path.isfile(beside) else None


def _metadata_json(metadata: Mapping[str, str], key: str, kind: type):
    try:
        value = json.loads(metadata[key])
    except ValueError:
        value = None
    if not isinstance(value, kind):
        raise TrainerError(f"corrupt step graph: metadata {key} must be a JSON {kind.__name__}; got {metadata[key][:80]!r}")
    return value


def np_dtype(info: onnx.ValueInfoProto) -> np.dtype:
    """The NumPy dtype of a tensor input or output."""
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type))
