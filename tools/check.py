"""``normgrad check TRAIN.onnx``: every gradient of a training graph against float64
central finite differences of its forward part.

The training graph runs once in onnxruntime as written (function bodies, or a kernel
backend), returning its gradients and the forward values its piecewise operators decide
on. Its forward part (the nodes the forward outputs and the loss need) is copied with
every float tensor turned into float64 and evaluated by ``onnx.reference.ReferenceEvaluator``
(with a BLAS-backed float64 Conv). Every piecewise decision of that copy is held at the
one the float32 run made: ReLU/LeakyRelu/PRelu masks, Abs signs, Clip and HardSigmoid
ranges, MaxPool, Max/Min and ReduceMax/ReduceMin winners, Dropout masks, and every
boolean or integer value computed in the forward (comparisons feeding a Where, ArgMax).
The differences then measure the derivative of the very piece of the function the
analytic gradient belongs to: a ReLU input within the step of 0 (a kink) cannot make a
right gradient look wrong, and a branch the float32 graph did not take cannot make a
wrong one look right. How many held decisions the step would have flipped is reported.

The scalar differentiated is the loss, or sum(y * y_grad) over the seeded outputs. Each
gradient g of a value x is compared along random directions v (standard normal): <g, v>
against (f(x + h v) - f(x - h v)) / 2h, with the step picked per gradient,
h = step * RMS(x) (step 1 when x is all zeros).
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import json
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.ops import api
from normgrad.graphs.builder import (METADATA_GRADIENTS, METADATA_LOSS, METADATA_SEEDS, METADATA_WEIGHTS, AnyTrainingGraph,
                                     training_graph_parts)
from normgrad.graphs.portable import weights_as_inputs
from normgrad.graphs.structure import subgraph_captures
from normgrad.ops import DOMAIN

__all__ = ["GradientCheck", "random_feeds", "forward_function", "check_gradients", "check_metadata", "reference_op", "main"]

_FLOAT = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


@dataclasses.dataclass
class GradientCheck:
    """The comparison for one gradient output.

    Attributes:
        gradient: the gradient output's name.
        wrt: the input or initializer it is the gradient of.
        analytic: <g, v> per direction.
        numeric: the central differences per direction.
        error: max over directions of |analytic - numeric| / scale, with scale the largest
            of |numeric|, |g| (the typical size of <g, v> for a standard normal v) and
            1e-3 times the largest |g| of all gradients (so that a gradient that is zero
            in exact arithmetic, such as a conv bias before BatchNorm, is not judged on
            float32 round-off alone).
        step: the step h used (``step`` times the RMS of the value).
        kinks: the most decisions of ReLU-type, Abs, Clip or HardSigmoid nodes that the
            step flips in the float64 forward (x ± h v against x): kinks within the step,
            held at the float32 run's decisions, so they do not count against the gradient.
        rounded: such decisions the float64 forward takes differently from the float32
            run at x itself (an input that float32 rounding puts on the other side), held
            too; the same for every gradient of one check.
        note: why the comparison is trivial, if it is: ``"empty"`` (a zero-size tensor: no
            direction to move along, nothing to compare), or that the loss reads no element
            (its output is empty: the loss is NaN and its gradient must be exactly zero,
            compared with a finite difference of 0).
    """

    gradient: str
    wrt: str
    analytic: List[float]
    numeric: List[float]
    error: float
    step: float = 0.0
    kinks: int = 0
    rounded: int = 0
    note: str = ""


def _metadata(model: onnx.ModelProto, key: str):
    for prop in model.metadata_props:
        if prop.key == key:
            try:
                return json.loads(prop.value)
            except ValueError as error:
                raise ValueError(f"metadata {key} is not valid JSON ({error})") from None
    raise ValueError(f"{key} missing from the model's metadata: not a training graph written by normgrad")


def check_metadata(model: onnx.ModelProto) -> None:
    """Checks that the training-graph metadata names values the graph has.

    Raises:
        ValueError: a key is missing, is not JSON of the right shape, or names a graph
            input or output that does not exist (the message names key and value).
    """
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    if any(prop.key == "normgrad.optimizer" for prop in model.metadata_props):
        raise ValueError("the model is a step graph (export --optimizer): check compares a training graph's gradients; "
                         "export the model without --optimizer and check that")
    if model.graph.name == "normgrad_checkpoint" and not model.graph.node:
        raise ValueError("the file is a checkpoint, not a training graph")
    seeds, gradients, loss = (_metadata(model, key) for key in (METADATA_SEEDS, METADATA_GRADIENTS, METADATA_LOSS))
    for key, value in ((METADATA_SEEDS, seeds), (METADATA_GRADIENTS, gradients)):
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ValueError(f"metadata {key} must be a JSON object of names; got {value!r}")
    if loss is not None and not (isinstance(loss, dict) and isinstance(loss.get("output"), str)):
        raise ValueError(f"metadata {METADATA_LOSS} must be null or an object with an 'output' name; got {loss!r}")
    named = [(METADATA_GRADIENTS, g, "output", outputs) for g in gradients]
    named += [(METADATA_GRADIENTS, w, "input", inputs) for w in gradients.values()]
    named += [(METADATA_SEEDS, y, "output", outputs) for y in seeds]
    named += [(METADATA_SEEDS, seed, "input", inputs) for seed in seeds.values()]
    if loss is not None:
        named += [(METADATA_LOSS, loss["output"], "output", outputs), (METADATA_LOSS, "loss", "output", outputs)]
    for key, name, kind, names in named:
        if name not in names:
            raise ValueError(f"metadata {key} names '{name}', which is not a graph {kind} of the model")


def _dims(info: onnx.ValueInfoProto, symbols: Dict[str, int], default: int) -> List[int]:
    dims = []
    for d in info.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        else:
            dims.append(symbols.setdefault(d.dim_param or f"?{len(symbols)}", default))
    return dims


def _refuse_beyond_memory(name: str, dims: List[int], dtype: np.dtype) -> None:
    """ValueError when a random value for input ``name`` would not fit this machine's memory."""
    import os

    needed = int(np.prod(dims, dtype=object)) * dtype.itemsize
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if needed > memory:
        raise ValueError(f"input {name!r} of shape {dims} ({dtype}) needs {needed / 2**30:.1f} GiB, more than this "
                         f"machine's memory ({memory / 2**30:.1f} GiB); check a graph with smaller static dimensions")


def random_feeds(training: AnyTrainingGraph, seed: int = 0, batch: int = 2) -> Dict[str, np.ndarray]:
    """Random values for every input of training graph ``training`` (either form of
    :func:`check_gradients`).

    Trainable weights get their values (a :class:`~normgrad.graphs.TrainingGraph`'s, or
    those a model alone stores as initializers); other float inputs standard normal values;
    ``labels`` of a cross-entropy loss class indices within the output's axis 1. Symbolic
    dims become ``batch``, but a seed gradient gets the shape its output has at run time.
    """
    model, weights = training_graph_parts(training)
    rng = np.random.default_rng(seed)
    loss = _metadata(model, METADATA_LOSS)
    symbols: Dict[str, int] = {}
    feeds: Dict[str, np.ndarray] = {}
    for info in model.graph.input:
        if info.name in weights:
            feeds[info.name] = weights[info.name]
            continue
        elem_type = info.type.tensor_type.elem_type
        dtype = oh.tensor_dtype_to_np_dtype(elem_type)
        dims = _dims(info, symbols, batch)
        _refuse_beyond_memory(info.name, dims, np.dtype(dtype))
        if elem_type in _FLOAT:
            feeds[info.name] = rng.standard_normal(dims).astype(dtype)
        else:
            feeds[info.name] = np.zeros(dims, dtype)
    seeds = _metadata(model, METADATA_SEEDS)
    static = {i.name for i in model.graph.input if all(d.HasField("dim_value") for d in i.type.tensor_type.shape.dim)}
    unknown = {output: seed for output, seed in seeds.items() if seed not in static}
    if unknown:
        for output, shape in _output_shapes(model, list(unknown), feeds).items():
            feeds[unknown[output]] = rng.standard_normal(shape).astype(feeds[unknown[output]].dtype)
    if loss and loss["kind"] == "cross_entropy":
        classes = _output_shapes(model, [loss["output"]], feeds)[loss["output"]][1]
        feeds["labels"] = rng.integers(0, classes, feeds["labels"].shape).astype(np.int64)
    return feeds


def _output_shapes(model: onnx.ModelProto, outputs: Sequence[str], feeds: Dict[str, np.ndarray]) -> Dict[str, tuple]:
    """The run-time shapes of forward ``outputs``, from onnxruntime running the forward part."""
    import onnxruntime

    forward = api.add_functions(_forward_model(model, outputs, double=False))  # (BatchNorm's statistics)
    options = onnxruntime.SessionOptions()
    session = onnxruntime.InferenceSession(forward.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = {i.name for i in forward.graph.input}
    values = session.run(list(outputs), {k: v for k, v in feeds.items() if k in names})
    return {name: value.shape for name, value in zip(outputs, values)}


def _to_double(graph: onnx.GraphProto) -> None:
    """Turns every float tensor of ``graph`` (inputs, outputs, initializers, constants, Cast targets) into float64."""
    for info in list(graph.input) + list(graph.output):
        if info.type.tensor_type.elem_type in _FLOAT:
            info.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    del graph.value_info[:]
    for index, init in enumerate(graph.initializer):
        if init.data_type in _FLOAT:
            graph.initializer[index].CopyFrom(onh.from_array(onh.to_array(init).astype(np.float64), init.name))
    for node in graph.node:
        if node.op_type == "GroupNormalization" and not any(a.name == "stash_type" for a in node.attribute):
            node.attribute.append(oh.make_attribute("stash_type", onnx.TensorProto.DOUBLE))
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in _FLOAT:
                attr.t.CopyFrom(onh.from_array(onh.to_array(attr.t).astype(np.float64), attr.t.name))
            elif attr.name in ("to", "dtype", "stash_type") and attr.type == onnx.AttributeProto.INT and attr.i in _FLOAT:
                # onnx's reference Layer/RMSNormalization compute in X's type but refuse a stash_type other than 1
                if not (node.op_type in ("LayerNormalization", "RMSNormalization") and attr.name == "stash_type"):
                    attr.i = onnx.TensorProto.DOUBLE
            elif attr.name == "value_float" and node.op_type == "Constant":
                value = attr.f
                attr.Clear()
                attr.CopyFrom(oh.make_attribute("value", onh.from_array(np.asarray(value, np.float64))))


def _forward_nodes(model: onnx.ModelProto, outputs: Sequence[str]) -> List[onnx.NodeProto]:
    """The nodes of ``model`` that ``outputs`` need, in graph order."""
    needed = set(outputs)
    nodes = []
    for node in reversed(model.graph.node):
        if any(name in needed for name in node.output):
            nodes.append(node)
            needed.update(list(node.input) + subgraph_captures(node))
    nodes.reverse()
    return nodes


def _forward_model(model: onnx.ModelProto, outputs: Sequence[str], double: bool = True,
                   nodes: Optional[Sequence[onnx.NodeProto]] = None,
                   extra_inputs: Sequence[onnx.ValueInfoProto] = ()) -> onnx.ModelProto:
    """The nodes of ``model`` that ``outputs`` need (or ``nodes``), in float64 (``double``) or as written."""
    nodes = list(_forward_nodes(model, outputs) if nodes is None else nodes)
    needed = set(outputs)
    for node in nodes:
        needed.update(list(node.input) + subgraph_captures(node))
    by_name = {o.name: o for o in model.graph.output}
    output_infos = [by_name.get(name) or oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in outputs]
    graph = oh.make_graph(
        nodes,
        "forward",
        [i for i in model.graph.input if i.name in needed] + list(extra_inputs),
        output_infos,
        initializer=[t for t in model.graph.initializer if t.name in needed],
    )
    if double:
        _to_double(graph)
    forward = oh.make_model(graph, opset_imports=[o for o in model.opset_import if o.domain in ("", "ai.onnx", DOMAIN)])
    forward.ir_version = model.ir_version
    return forward


# ------------------------------------------------------------------ float64 evaluation


def reference_op(module):
    """An ``OpRun`` evaluating ``module``'s operator with its float64 NumPy reference."""
    from onnx.reference.op_run import OpRun

    def _run(self, *args, **_):
        # an omitted input ("") is None: onnx 1.23's evaluator passes the value of an earlier
        # node's omitted output (also "") in its place
        given = list(self.onnx_node.input)
        values = {name: arg if index >= len(given) or given[index] else None
                  for index, (name, arg) in enumerate(zip(module.INPUTS, args))}
        kwargs = {k: values.get(k) for k in module.INPUTS}
        attributes = {name: type(default)(getattr(self, name, default)) for name, default in module.ATTRIBUTES.items()}
        result = tuple(module.reference(**kwargs, **attributes))[: len(self.onnx_node.output)]
        # an output the node omits ("") may be one the reference does not compute (None): the
        # evaluator takes only tensors, and reads no omitted output
        return tuple(np.empty(0) if value is None and not name else value
                     for value, name in zip(result, self.onnx_node.output))

    from normgrad.ops import DOMAIN

    return type(module.OP_TYPE, (OpRun,), {"op_domain": DOMAIN, "_run": _run})


def _float64_ops() -> list:
    """Operator overrides for ``ReferenceEvaluator``: Conv as strided windows and one BLAS
    tensordot per group (the reference Conv loops in Python: ~10x slower on a ResNet); the
    normgrad operators by their float64 NumPy references (the loss's SoftmaxCrossEntropy is
    a forward node)."""
    from onnx.reference.ops.op_conv import Conv

    class FastConv(Conv):
        op_domain = ""

        def _run(self, X, W, B=None, auto_pad=None, dilations=None, group=None, kernel_shape=None, pads=None,
                 strides=None):
            rank = X.ndim - 2
            if rank < 1 or auto_pad not in (None, "NOTSET", "VALID"):
                return super()._run(X, W, B, auto_pad=auto_pad, dilations=dilations, group=group,
                                    kernel_shape=kernel_shape, pads=pads, strides=strides)
            strides = list(strides or [1] * rank)
            dilations = list(dilations or [1] * rank)
            pads = [0] * (2 * rank) if auto_pad == "VALID" or pads is None else list(pads)
            group = group or 1
            padded = np.pad(X, [(0, 0), (0, 0)] + [(pads[i], pads[rank + i]) for i in range(rank)])
            spans = [(k - 1) * d + 1 for k, d in zip(W.shape[2:], dilations)]
            windows = np.lib.stride_tricks.sliding_window_view(padded, spans, axis=tuple(range(2, 2 + rank)))
            windows = windows[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)
                              + tuple(slice(None, None, d) for d in dilations)]  # [N, C, *out, *kernel]
            c_group, m_group = X.shape[1] // group, W.shape[0] // group
            axes = ([1] + list(range(2 + rank, 2 + 2 * rank)), [1] + list(range(2, 2 + rank)))
            parts = [
                np.moveaxis(np.tensordot(windows[:, g * c_group:(g + 1) * c_group], W[g * m_group:(g + 1) * m_group],
                                         axes=axes), -1, 1)
                for g in range(group)
            ]
            Y = parts[0] if group == 1 else np.concatenate(parts, axis=1)
            if B is not None:
                Y = Y + B.reshape((1, -1) + (1,) * rank)
            return (Y.astype(X.dtype),)

    FastConv.__name__ = "Conv"
    from normgrad.ops import OPERATORS

    return [FastConv] + [reference_op(module) for module in OPERATORS.values()]


def _onnxruntime_runner(model: onnx.ModelProto) -> Callable[[Dict[str, np.ndarray]], list]:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    session = onnxruntime.InferenceSession(api.add_functions(model).SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(None, feeds)


def _runner(model: onnx.ModelProto) -> Callable[[Dict[str, np.ndarray]], list]:
    """``onnx.reference.ReferenceEvaluator`` (exact float64 NumPy), or onnxruntime where the
    evaluator cannot run the model (onnxruntime's float64 kernels of some ops, e.g. Erf,
    are float32-accurate, too coarse for finite differences). Returns every graph output."""
    from onnx.reference import ReferenceEvaluator

    try:
        evaluator = ReferenceEvaluator(model, new_ops=_float64_ops())
    except Exception:
        return _onnxruntime_runner(model)
    fallback: List[Callable] = []

    def run(feeds: Dict[str, np.ndarray]) -> list:
        if not fallback:
            try:
                return evaluator.run(None, feeds)
            except Exception:  # an attribute value the evaluator lacks (e.g. negative Pad pads)
                fallback.append(_onnxruntime_runner(model))
        return fallback[0](feeds)

    return run


def _objective(model: onnx.ModelProto) -> Tuple[List[str], Callable[[list, Dict[str, np.ndarray]], float]]:
    """The forward outputs the checked scalar is made of, and the scalar from their values."""
    seeds = _metadata(model, METADATA_SEEDS)
    loss = _metadata(model, METADATA_LOSS)
    if loss:
        return ["loss"], lambda values, feeds: float(values[0])
    outputs = list(seeds)
    return outputs, lambda values, feeds: float(
        sum(np.sum(y * feeds[seeds[name]].astype(np.float64)) for name, y in zip(outputs, values)))


def _float64_feeds(feeds: Dict[str, np.ndarray], names) -> Dict[str, np.ndarray]:
    return {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items() if k in names}


def forward_function(training: AnyTrainingGraph) -> Callable[[Dict[str, np.ndarray]], float]:
    """The scalar the training graph differentiates, evaluated in float64 (no decision held).

    Returns:
        ``f(feeds) -> float``: the loss, or the sum over seeded outputs of sum(y * y_grad);
        weights ``feeds`` leaves out get their values from ``training``.
    """
    model, weights = training_graph_parts(training)
    outputs, scalar = _objective(model)
    forward = _forward_model(model, outputs)
    run = _runner(forward)
    names = {i.name for i in forward.graph.input}
    return lambda feeds: scalar(run(_float64_feeds({**weights, **feeds}, names)), feeds)


# ------------------------------------------------------------------ held decisions

_MASKED = ("Relu", "LeakyRelu", "PRelu", "Abs", "Clip", "HardSigmoid", "HardSwish")
"""Elementwise piecewise operators: the decision is a function of input 0 (and Clip's bounds)."""


def _attr(node: onnx.NodeProto, name: str, default):
    for attribute in node.attribute:
        if attribute.name == name:
            return oh.get_attribute_value(attribute)
    return default


def _clip_bounds(node: onnx.NodeProto, values: Dict[str, np.ndarray]):
    bound = lambda index, attribute, default: (  # noqa: E731
        values[node.input[index]].astype(np.float64) if len(node.input) > index and node.input[index]
        else _attr(node, attribute, default))
    return bound(1, "min", -np.inf), bound(2, "max", np.inf)


def _hard_sigmoid_range(node: onnx.NodeProto, x: np.ndarray):
    """(alpha, z = alpha x + beta) of a HardSigmoid, or the one inside HardSwish."""
    alpha, beta = (1 / 6, 0.5) if node.op_type == "HardSwish" else (_attr(node, "alpha", 0.2), _attr(node, "beta", 0.5))
    return alpha, beta, alpha * x.astype(np.float64) + beta


def _decision(node: onnx.NodeProto, values: Dict[str, np.ndarray]) -> np.ndarray:
    """The branch each element of a :data:`_MASKED` node takes, as small integers."""
    x = values[node.input[0]]
    if node.op_type == "Abs":
        return np.sign(x).astype(np.int8)
    if node.op_type == "Clip":
        low, high = _clip_bounds(node, values)
        return (x < low).astype(np.int8) - (x > high).astype(np.int8)
    if node.op_type in ("HardSigmoid", "HardSwish"):
        _, _, z = _hard_sigmoid_range(node, x)
        return (z > 0).astype(np.int8) + (z >= 1).astype(np.int8)
    return (x > 0).astype(np.int8)


class _Holder:
    """Rewrites a float64 forward so that every piecewise decision is the float32 run's."""

    def __init__(self, values: Dict[str, np.ndarray]):
        self.values = values  # float32 run values by name
        self.nodes: List[onnx.NodeProto] = []
        self.inputs: List[onnx.ValueInfoProto] = []
        self.feeds: Dict[str, np.ndarray] = {}

    def held(self, name: str, value: np.ndarray) -> str:
        """A new forward input holding ``value`` (float arrays as float64)."""
        held = f"held/{len(self.feeds)}/{name}"
        value = np.asarray(value)
        value = value.astype(np.float64) if value.dtype.kind == "f" else value
        self.feeds[held] = value
        self.inputs.append(oh.make_tensor_value_info(held, oh.np_dtype_to_tensor_dtype(value.dtype), list(value.shape)))
        return held

    def node(self, op_type: str, inputs: Sequence[str], output: str, **attrs) -> str:
        self.nodes.append(oh.make_node(op_type, list(inputs), [output], **attrs))
        return output

    def rewrite(self, node: onnx.NodeProto, float_typed: Callable[[str], bool]) -> bool:
        """Appends ``node`` held at the float32 run's decisions; False if it has none to hold."""
        op, values, out = node.op_type, self.values, node.output[0] if node.output else ""
        if op in ("Relu", "LeakyRelu", "Abs"):
            x = values[node.input[0]]
            factor = {"Relu": (x > 0).astype(np.float64), "Abs": np.sign(x).astype(np.float64),
                      "LeakyRelu": np.where(x > 0, 1.0, _attr(node, "alpha", 0.01))}[op]
            self.node("Mul", [node.input[0], self.held(out, factor)], out)
        elif op == "PRelu":
            scaled = self.node("Mul", node.input[:2], out + "/negative")
            self.node("Where", [self.held(out, values[node.input[0]] > 0), node.input[0], scaled], out)
        elif op == "Clip":  # x * inside + min * at_min + max * at_max, the bounds as values (they may be trained)
            x = values[node.input[0]]
            low, high = _clip_bounds(node, values)
            at_high = (x > high) | (low > high)
            at_low = ~at_high & (x < low)
            inside = (~at_high & ~at_low).astype(np.float64)
            terms = [self.node("Mul", [node.input[0], self.held(out, inside)], out + "/inside")]
            for index, at_bound, value in ((1, at_low, low), (2, at_high, high)):
                bound = node.input[index] if len(node.input) > index and node.input[index] else None
                held = self.held(out, np.where(at_bound, 1.0 if bound else value, 0.0))
                terms.append(self.node("Mul", [bound, held], f"{out}/bound{index}") if bound else held)
            self.node("Sum", terms, out)
        elif op in ("HardSigmoid", "HardSwish"):
            alpha, beta, z = _hard_sigmoid_range(node, values[node.input[0]])
            inside = (z > 0) & (z < 1)
            slope, offset = self.held(out, alpha * inside), self.held(out, beta * inside + (z >= 1))
            sigmoid_name = out + "/hard_sigmoid" if op == "HardSwish" else out
            self.node("Add", [self.node("Mul", [node.input[0], slope], out + "/scaled"), offset], sigmoid_name)
            if op == "HardSwish":
                self.node("Mul", [node.input[0], sigmoid_name], out)
        elif op in ("Max", "Min"):
            y = values[out]
            ties = [np.broadcast_to(values[name], y.shape) == y for name in node.input]
            count = np.maximum(sum(t.astype(np.float64) for t in ties), 1.0)
            terms = [self.node("Mul", [name, self.held(out, t / count)], f"{out}/term{i}")
                     for i, (name, t) in enumerate(zip(node.input, ties))]
            self.node("Sum", terms, out)
        elif op in ("ReduceMax", "ReduceMin"):
            x, y = values[node.input[0]], values[out]
            axes = values[node.input[1]] if len(node.input) > 1 and node.input[1] else _attr(node, "axes", None)
            axes = tuple(range(x.ndim)) if axes is None or np.size(axes) == 0 else tuple(int(a) % x.ndim for a in np.ravel(axes))
            keepdims = _attr(node, "keepdims", 1)
            ties = (x == (y if keepdims else np.expand_dims(y, axes))).astype(np.float64)
            weights = ties / np.maximum(ties.sum(axis=axes, keepdims=True), 1.0)
            weighted = self.node("Mul", [node.input[0], self.held(out, weights)], out + "/weighted")
            self.node("ReduceSum", [weighted, self.held(out + "/axes", np.asarray(axes, np.int64))], out,
                      keepdims=keepdims)
        elif op == "MaxPool":
            flat = self.node("Reshape", [node.input[0], self.held(out + "/flat", np.asarray([-1], np.int64))],
                             out + "/flat")
            indices = self.held(out, values[node.output[1]])
            self.node("Gather", [flat, indices], out)
            if node.output[1]:
                self.node("Identity", [indices], node.output[1])
        elif op == "Dropout":
            ratio = float(values[node.input[1]]) if len(node.input) > 1 and node.input[1] else _attr(node, "ratio", 0.5)
            training = bool(values[node.input[2]]) if len(node.input) > 2 and node.input[2] else False
            mask = values[node.output[1]]
            scale = mask / (1.0 - ratio) if training and ratio < 1 else np.ones(mask.shape)
            if training and ratio >= 1:
                scale = np.zeros(mask.shape)
            self.node("Mul", [node.input[0], self.held(out, scale)], out)
            if node.output[1]:
                self.node("Identity", [self.held(node.output[1], mask)], node.output[1])
        elif node.output and all(name and not float_typed(name) for name in node.output) and node.op_type != "Constant":
            for name in node.output:  # comparisons, ArgMax, casts to integers: their float32-run values
                self.node("Identity", [self.held(name, values[name])], name)
        else:
            return False
        return True


def _needed_decision_values(nodes: Sequence[onnx.NodeProto], float_typed: Callable[[str], bool]) -> List[str]:
    """The float32-run values :class:`_Holder` needs for ``nodes``."""
    names: List[str] = []
    for node in nodes:
        if node.op_type in _MASKED or node.op_type in ("ReduceMax", "ReduceMin"):
            names += [n for n in node.input if n] + ([node.output[0]] if node.op_type.startswith("Reduce") else [])
        elif node.op_type in ("Max", "Min"):
            names += list(node.input) + [node.output[0]]
        elif node.op_type in ("MaxPool", "Dropout"):
            names += [n for n in node.input[1:] if n] + [node.output[1]]
        elif node.output and all(n and not float_typed(n) for n in node.output) and node.op_type != "Constant":
            names += list(node.output)
    return list(dict.fromkeys(names))


def _with_second_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose MaxPool and Dropout nodes name their Indices/mask output."""
    model = copy.deepcopy(model)
    for node in model.graph.node:
        if node.op_type in ("MaxPool", "Dropout"):
            while len(node.output) < 2:
                node.output.append("")
            if not node.output[1]:
                node.output[1] = f"{node.output[0]}/check_second_output"
    return model


def _float_typed(model: onnx.ModelProto) -> Callable[[str], bool]:
    """Whether a value of ``model`` is of a float type (unknown types count as float)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type
             for v in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return lambda name: types.get(name, onnx.TensorProto.FLOAT) in _FLOAT or types.get(name) == 0


class _HeldForward:
    """The checked scalar in float64, with the float32 run's decisions held.

    The base point is evaluated once with every intermediate value kept; a perturbation of
    one value re-evaluates only the nodes downstream of it.

    Args:
        model: the training graph, MaxPool/Dropout second outputs named.
        values: the float32 run's values of :func:`_needed_decision_values`, initializers and feeds.
        nodes: the forward nodes.
        float_typed: whether a value name is of a float type.
    """

    def __init__(self, model: onnx.ModelProto, values: Dict[str, np.ndarray], nodes, float_typed):
        self.outputs, self.scalar = _objective(model)
        holder = _Holder(values)
        self.masked: List[onnx.NodeProto] = []
        for node in nodes:
            if not holder.rewrite(node, float_typed):
                holder.nodes.append(node)
            elif node.op_type in _MASKED:
                self.masked.append(node)
        probes = list(dict.fromkeys(n for node in self.masked for n in node.input if n))
        graph_inputs = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
        self.probes = [name for name in probes if name not in graph_inputs]
        self.bounds = {name: np.asarray(values[name], np.float64) for name in probes if name in graph_inputs}
        self.held = [_decision(node, values) for node in self.masked]  # the float32 run's
        self.model = _forward_model(model, self.outputs + self.probes, nodes=holder.nodes, extra_inputs=holder.inputs)
        self.names = {i.name for i in self.model.graph.input}
        self.held_feeds = holder.feeds
        self.values: Dict[str, np.ndarray] = {}
        self.feeds64: Dict[str, np.ndarray] = {}
        self._parts: Dict[str, Tuple[Optional[Callable], List[str], List[str]]] = {}

    def base(self, feeds64: Dict[str, np.ndarray]) -> Tuple[float, List[np.ndarray]]:
        """Evaluates the base point, keeping every value; (the scalar, the decisions)."""
        from onnx.reference import ReferenceEvaluator

        feeds = {**{k: v for k, v in feeds64.items() if k in self.names}, **self.held_feeds}
        self.feeds64 = feeds64 = {**self.bounds, **feeds64}
        try:
            computed = ReferenceEvaluator(self.model, new_ops=_float64_ops()).run(None, feeds, intermediate=True)
        except Exception:  # something the evaluator lacks: whole runs by _runner
            self._whole = _runner(self.model)
            self.values = {**feeds64, **dict(zip(self.outputs + self.probes, self._whole(feeds)))}
        else:
            self._whole = None
            self.values = {**feeds64, **computed}
        return self._result(self.values)

    def _result(self, values) -> Tuple[float, List[np.ndarray]]:
        return self.scalar([values[o] for o in self.outputs], self.feeds64), [_decision(n, values) for n in self.masked]

    def _part(self, wrt: str):
        """(a runner of the nodes downstream of ``wrt``, its inputs, its outputs)."""
        if wrt not in self._parts:
            from onnx.reference import ReferenceEvaluator

            produced, nodes = {wrt}, []
            for node in self.model.graph.node:
                if any(name in produced for name in list(node.input) + subgraph_captures(node)):
                    nodes.append(node)
                    produced.update(name for name in node.output if name)
            reads = dict.fromkeys(n for node in nodes for n in list(node.input) + subgraph_captures(node) if n)
            inputs = [n for n in reads if n not in produced or n == wrt]
            outputs = [n for n in self.outputs + self.probes if n in produced and n != wrt]
            run = None
            if outputs:
                info = lambda name: oh.make_tensor_value_info(  # noqa: E731
                    name, oh.np_dtype_to_tensor_dtype(np.asarray(self.values[name]).dtype), None)
                graph = oh.make_graph(nodes, "downstream", [info(n) for n in inputs], [info(n) for n in outputs])
                part = oh.make_model(graph, opset_imports=list(self.model.opset_import))
                part.ir_version = self.model.ir_version
                run = ReferenceEvaluator(part, new_ops=_float64_ops()).run
            self._parts[wrt] = (run, inputs, outputs)
        return self._parts[wrt]

    def perturbed(self, wrt: str, value: np.ndarray) -> Tuple[float, List[np.ndarray]]:
        """(the scalar, the decisions) with ``wrt`` set to ``value``."""
        if self._whole is not None:
            feeds = {**{k: v for k, v in self.feeds64.items() if k in self.names}, **self.held_feeds, wrt: value}
            return self._result({**self.values, **dict(zip(self.outputs + self.probes, self._whole(feeds))), wrt: value})
        run, inputs, outputs = self._part(wrt)
        if run is None:
            return self._result(collections.ChainMap({wrt: value}, self.values))
        results = run(None, {name: value if name == wrt else self.values[name] for name in inputs})
        return self._result(collections.ChainMap({wrt: value}, dict(zip(outputs, results)), self.values))


def _flipped(decisions: List[np.ndarray], held: List[np.ndarray]) -> int:
    return int(sum(np.count_nonzero(d != h) for d, h in zip(decisions, held)))


def check_gradients(
    training: AnyTrainingGraph,
    feeds: Optional[Dict[str, np.ndarray]] = None,
    session_options=None,
    directions: int = 1,
    step: float = 1e-6,
    seed: int = 0,
) -> List[GradientCheck]:
    """Compares every gradient output of training graph ``model`` with finite differences.

    Args:
        training: a training graph: what :func:`normgrad.graphs.build_training_graph`
            returns, or its model alone (then weights that are pure inputs need ``feeds``, or
            get random values).
        feeds: the inputs; :func:`random_feeds` and the weights' values when None. Weights
            ``feeds`` leaves out get their values from ``training``.
        session_options: onnxruntime ``SessionOptions`` for the training graph (e.g.
            ``normgrad.session_options("cpp")``); when None, plain options and the
            function bodies (attached with ``normgrad.add_functions`` if missing).
        directions: random directions per gradient.
        step: the central-difference step relative to the value's RMS: h = step * RMS(x).
        seed: seeds the feeds and the directions.

    Returns:
        One :class:`GradientCheck` per gradient output, in output order.

    Raises:
        ValueError: the metadata is malformed (:func:`check_metadata`), or ``directions``
            or ``step`` is not positive.
    """
    if directions < 1 or not (np.isfinite(step) and step > 0):
        raise ValueError(f"directions must be >= 1 and step a finite number > 0; got {directions}, {step}")
    import onnxruntime

    model, weights = training_graph_parts(training)
    if any(t.name in weights for t in model.graph.initializer):  # an older normgrad's form
        model = copy.deepcopy(model)
        weights_as_inputs(model.graph)
    check_metadata(model)
    feeds = {**random_feeds(model, seed), **weights} if feeds is None else {**weights, **feeds}
    if session_options is None:  # the function bodies, attached if the model lacks them
        model = api.add_functions(model)
        session_options = onnxruntime.SessionOptions()
    model = _with_second_outputs(model)
    float_typed = _float_typed(model)
    nodes = _forward_nodes(model, _objective(model)[0])
    graph_values = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    decided = [n for n in _needed_decision_values(nodes, float_typed) if n not in graph_values]
    gradients = _metadata(model, METADATA_GRADIENTS)
    loss_of = (_metadata(model, METADATA_LOSS) or {}).get("output")
    run_model = copy.deepcopy(model)
    outputs = {o.name for o in run_model.graph.output}
    run_model.graph.output.extend(oh.make_empty_tensor_value_info(n) for n in decided if n not in outputs)
    fetched = list(dict.fromkeys(list(gradients) + decided + ([loss_of] if loss_of in outputs else [])))
    session = onnxruntime.InferenceSession(run_model.SerializeToString(), session_options, providers=["CPUExecutionProvider"])
    run = dict(zip(fetched, session.run(fetched, feeds)))
    # a loss of an empty output (a mean over no element) is NaN, and constant: every gradient is zero
    no_element = f"the loss reads no element (output {loss_of} is empty)" if loss_of in run and run[loss_of].size == 0 else ""
    initializers = {t.name: onh.to_array(t) for t in model.graph.initializer}
    forward = _HeldForward(model, {**initializers, **feeds, **run}, nodes, float_typed)
    feeds64 = _float64_feeds(feeds, set(feeds))
    _, at_base = forward.base(feeds64)
    rounded = _flipped(at_base, forward.held)
    rng = np.random.default_rng(seed + 1)
    measured = []
    for grad_name, wrt in gradients.items():
        g = run[grad_name].astype(np.float64)
        base = feeds64[wrt]
        rms = float(np.sqrt(np.mean(np.square(base)))) if base.size else 0.0
        h = step * (rms if np.isfinite(rms) and rms > 0 else 1.0)
        note = "empty" if base.size == 0 else no_element
        analytic, numeric, flipped = [], [], 0
        for _ in range(directions):
            v = rng.standard_normal(g.shape)
            analytic.append(float(np.sum(g * v)))
            if note:  # no direction to move along, or a constant loss: the finite difference is 0
                numeric.append(0.0)
                continue
            plus, decisions_plus = forward.perturbed(wrt, base + h * v)
            minus, decisions_minus = forward.perturbed(wrt, base - h * v)
            numeric.append((plus - minus) / (2 * h))
            flipped = max(flipped, _flipped(decisions_plus, at_base), _flipped(decisions_minus, at_base))
        typical = float(np.linalg.norm(g))  # the size of <g, v> for a standard normal v
        measured.append((grad_name, wrt, analytic, numeric, typical, h, flipped, note))
    floor = 1e-3 * max([m[4] for m in measured] + [1e-30])
    checks = []
    for grad_name, wrt, analytic, numeric, typical, h, flipped, note in measured:
        errors = [abs(a - n) / max(abs(n), typical, floor) for a, n in zip(analytic, numeric)]
        checks.append(GradientCheck(grad_name, wrt, analytic, numeric, max(errors, default=0.0), h, flipped, rounded,
                                    note))
    return checks


_ORT_ERRORS = ("Fail", "InvalidArgument", "InvalidGraph", "InvalidProtobuf", "NoSuchFile", "NotImplemented",
               "RuntimeException")
"""onnxruntime's exception classes for a model it cannot load or run."""


def _feeds_with_checkpoint(model: onnx.ModelProto, model_path: str, checkpoint_path: Optional[str], seed: int):
    """:func:`random_feeds`, with the checkpoint's tensors for the inputs it names (the
    weights ``normgrad export`` moved out of the graph). A checkpoint given but missing, or one
    whose tensor does not fit its input, is an error."""
    import os

    import normgrad.checkpoint as checkpoint

    feeds = random_feeds(model, seed)
    path = checkpoint_path
    if path is None:
        beside = (model_path[: -len(".onnx")] if model_path.endswith(".onnx") else model_path) + ".ckpt"
        path = beside if os.path.isfile(beside) else None
    if path is None:
        return feeds
    try:
        tensors = checkpoint.load(path).tensors
    except checkpoint.CheckpointError as error:
        raise CheckpointFeedError(str(error)) from None
    extra = sorted(set(tensors) - set(feeds))
    if extra:
        raise CheckpointFeedError(f"{path}: tensor {extra[0]!r} is no input of {model_path}: the checkpoint is another "
                                  f"model's (not in the graph: {', '.join(extra)})")
    missing = [name for name in _metadata(model, METADATA_WEIGHTS) or [] if name not in tensors]
    if missing:
        raise CheckpointFeedError(f"{path}: no tensor for weight {missing[0]!r} of {model_path}: the checkpoint is "
                                  f"another model's (missing: {', '.join(missing)})")
    for name, value in tensors.items():
        if name in feeds:
            if value.shape != feeds[name].shape or value.dtype != feeds[name].dtype:
                raise CheckpointFeedError(f"{path}: tensor {name!r} is {value.dtype}{list(value.shape)}; the graph's "
                                          f"input is {feeds[name].dtype}{list(feeds[name].shape)}")
            feeds[name] = value
    return feeds


class CheckpointFeedError(ValueError):
    """The checkpoint given to ``normgrad check`` cannot feed the graph's weights."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``normgrad check``; returns the process exit code (1 if a gradient fails)."""
    from normgrad.util.files import refuse_irregular_file
    from normgrad.tools.cli import ArgumentParser, CommandError, load_model, one_line, positive_float, positive_int

    parser = ArgumentParser(prog="normgrad check", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="training graph written by `normgrad export`")
    parser.add_argument("--backend", choices=("functions", "cpp", "python"), default="functions",
                        help="run normgrad ops through their function bodies (default) or a kernel library")
    parser.add_argument("--directions", type=positive_int, default=1, help="random directions per gradient (default 1)")
    parser.add_argument("--step", type=positive_float, default=1e-6,
                        help="finite-difference step relative to each value's RMS (default 1e-6)")
    parser.add_argument("--tolerance", type=positive_float, default=1e-3,
                        help="largest accepted relative error (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=None,
                        help="the weights to check at (written by `normgrad export`; default: MODEL with .ckpt for "
                             ".onnx, when that file exists; without one, weights that are pure inputs get random values)")
    args = parser.parse_args(argv)
    import onnxruntime.capi.onnxruntime_pybind11_state as ort_errors

    runtime_errors = tuple(getattr(ort_errors, name) for name in _ORT_ERRORS if hasattr(ort_errors, name))
    started = time.perf_counter()
    try:
        for path in (args.model, args.checkpoint):
            if path is not None:
                refuse_irregular_file(path, "input")
        model = load_model(args.model)
        check_metadata(model)
        options = None
        if args.backend != "functions":

            options = api.session_options(args.backend)
        feeds = _feeds_with_checkpoint(model, args.model, args.checkpoint, args.seed)
        checks = check_gradients(model, feeds, session_options=options, directions=args.directions, step=args.step,
                                 seed=args.seed)
    except (CommandError, ValueError, KeyError, OSError, onnx.checker.ValidationError) as error:
        print(f"normgrad check: {one_line(error)}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"normgrad check: out of memory checking {args.model}", file=sys.stderr)
        return 1
    except runtime_errors as error:
        print(f"normgrad check: onnxruntime cannot run {args.model}: {one_line(error)}", file=sys.stderr)
        return 1
    failed = 0
    for check in checks:
        ok = check.error <= args.tolerance
        failed += not ok
        if check.note == "empty":
            print(f"OK   {check.gradient:<40} empty: a zero-size tensor, nothing to compare")
            continue
        print(
            f"{'OK  ' if ok else 'FAIL'} {check.gradient:<40} rel.err {check.error:.2e}  "
            f"<g,v> {check.analytic[0]: .6e}  finite diff {check.numeric[0]: .6e}  step {check.step:.1e}"
            + (f"  kinks held {check.kinks}" if check.kinks else "")
            + (f"  ({check.note}: the gradient must be zero)" if check.note else "")
        )
    kinks = sum(1 for check in checks if check.kinks)
    rounded = checks[0].rounded if checks else 0
    print(f"{len(checks) - failed}/{len(checks)} gradients within {args.tolerance:g}"
          + (f"; {kinks} had a ReLU-type input within the step of its kink" if kinks else "")
          + (f"; {rounded} ReLU-type input(s) on the other side of the kink in float64 than in float32" if rounded else "")
          + ("; all held at the float32 run's side" if kinks or rounded else "")
          + f" ({time.perf_counter() - started:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
