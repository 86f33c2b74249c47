"""Optimizer graphs: one torch.optim step as an ONNX model that takes gradients as inputs.

:func:`build_optimizer_graph` builds the update alone, so a gradient graph can be composed
with it directly, through an accumulation of micro-batch gradients, or through an
all-reduce. Inputs: for each parameter ``P``: ``P`` and ``P_grad``; then the optimizer state
(``P.momentum_buffer`` for SGD with momentum; ``P.exp_avg``, ``P.exp_avg_sq`` and with
amsgrad ``P.max_exp_avg_sq`` for Adam/AdamW); then ``lr`` and ``step`` (float32 scalars,
``step`` 1-based as torch's ``state["step"]`` after its increment). Outputs: ``NAME.next``
for every parameter and state input. Semantics are torch's single-tensor implementations of
``torch.optim.SGD``/``Adam``/``AdamW`` and ``torch.nn.utils.clip_grad_norm_``. Initial state
is zeros (SGD's first step takes the gradient as its momentum buffer, as torch does).
"""

from __future__ import annotations

import copy
import json
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import normgrad
from normgrad.graphs.portable import make_portable
from normgrad.graphs.tidy import tidy
from normgrad.graphs.structure import subgraph_captures
from normgrad.ops._common import DOMAIN, IR_VERSION

__all__ = [
    "build_optimizer_graph",
    "build_step_graph",
    "optimizer_state_names",
    "next_name",
    "optimizer_options",
    "running_statistics",
    "build_gradient_graph",
    "build_inference_model",
    "ACCUMULATOR_SUFFIX",
]

ACCUMULATOR_SUFFIX = "_grad.sum"
"""``P_grad.sum``: the gradient accumulator input of :func:`build_gradient_graph` for parameter ``P``."""

_KINDS = ("sgd", "adam", "adamw")


def next_name(name: str) -> str:
    """The output that holds ``name``'s value after the step."""
    return f"{name}.next"


def optimizer_state_names(parameter: str, kind: str, momentum: float = 0.0, amsgrad: bool = False) -> List[str]:
    """The optimizer-state inputs kept for ``parameter``."""
    if kind == "sgd":
        return [f"{parameter}.momentum_buffer"] if momentum != 0 else []
    names = [f"{parameter}.exp_avg", f"{parameter}.exp_avg_sq"]
    return names + [f"{parameter}.max_exp_avg_sq"] if amsgrad else names


class _Nodes:
    def __init__(self) -> None:
        self.nodes: List[onnx.NodeProto] = []
        self.initializers: List[onnx.TensorProto] = []
        self._count = 0

    def const(self, value: float, dtype=np.float32) -> str:
        self._count += 1
        name = f"optimizer.const{self._count}"
        self.initializers.append(numpy_helper.from_array(np.array(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, output: Optional[str] = None, **attributes) -> str:
        self._count += 1
        output = output or f"optimizer.t{self._count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], **attributes))
        return output


def build_optimizer_graph(
    parameters: Mapping[str, Sequence[int]],
    kind: str,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    amsgrad: bool = False,
    clip_grad_norm: Optional[float] = None,
) -> onnx.ModelProto:
    """An ONNX model doing one optimizer step on float32 ``parameters`` ({name: shape}).

    Raises:
        ValueError: an unknown ``kind``, or a hyperparameter torch would refuse.
    """
    if kind not in _KINDS:
        raise ValueError(f"optimizer kind {kind!r} is not one of {', '.join(_KINDS)}")
    if not parameters:
        raise ValueError("build_optimizer_graph needs at least one parameter")
    if momentum < 0 or weight_decay < 0 or eps < 0:
        raise ValueError("momentum, weight_decay and eps must be >= 0")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD)")
    if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
        raise ValueError(f"betas must be two values in [0, 1), got {betas!r}")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"clip_grad_norm must be > 0, got {clip_grad_norm!r}")

    g = _Nodes()
    value_info = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))
    inputs = [value_info(p, s) for p, s in parameters.items()]
    inputs += [value_info(f"{p}_grad", s) for p, s in parameters.items()]
    state: Dict[str, str] = {}
    for p, s in parameters.items():
        for name in optimizer_state_names(p, kind, momentum, amsgrad):
            inputs.append(value_info(name, s))
    inputs += [value_info("lr", []), value_info("step", [])]

    grads = {p: f"{p}_grad" for p in parameters}
    # Adam/AdamW are AdamUpdate nodes, which scale the gradient themselves; Adam's L2 weight
    # decay is added to the scaled gradient before, as torch does
    fused = kind != "sgd" and not amsgrad
    fused_scale = fused and not (kind == "adam" and weight_decay != 0)
    grad_scale = None
    if clip_grad_norm is not None:
        squares = [g.op("ReduceSumSquare", grads[p], keepdims=0) for p in parameters]
        total = g.op("Sqrt", g.op("Sum", *squares))
        coefficient = g.op("Div", g.const(clip_grad_norm), g.op("Add", total, g.const(1e-6)))
        clamped = g.op("Min", coefficient, g.const(1.0))
        if fused_scale:
            grad_scale = clamped
        else:
            grads = {p: g.op("Mul", grads[p], clamped) for p in parameters}
    param_scale = None
    if kind == "adamw" and weight_decay != 0:
        param_scale = g.op("Sub", g.const(1.0), g.op("Mul", "lr", g.const(weight_decay)))

    if kind != "sgd":
        # bias corrections in float64, as torch computes them (Python floats): in float32,
        # 1 - 0.999**step loses about 5 digits to cancellation in the first steps
        beta1, beta2 = betas
        step64 = g.op("Cast", "step", to=TensorProto.DOUBLE)
        one = g.const(1.0, np.float64)
        correction1 = g.op("Sub", one, g.op("Pow", g.const(beta1, np.float64), step64))
        correction2 = g.op("Sub", one, g.op("Pow", g.const(beta2, np.float64), step64))
        step_size = g.op("Cast", g.op("Div", g.op("Cast", "lr", to=TensorProto.DOUBLE), correction1), to=TensorProto.FLOAT)
        correction2_sqrt = g.op("Cast", g.op("Sqrt", correction2), to=TensorProto.FLOAT)

    outputs = []
    for p, s in parameters.items():
        grad, param = grads[p], p
        if kind == "sgd":
            if weight_decay != 0:
                grad = g.op("Add", grad, g.op("Mul", param, g.const(weight_decay)))
            if momentum != 0:
                buffer = f"{p}.momentum_buffer"
                later = g.op("Add", g.op("Mul", buffer, g.const(momentum)), g.op("Mul", grad, g.const(1 - dampening)))
                first = g.op("Equal", "step", g.const(1.0))
                new_buffer = g.op("Where", first, grad, later, output=next_name(buffer))
                state[buffer] = new_buffer
                grad = g.op("Add", grad, g.op("Mul", new_buffer, g.const(momentum))) if nesterov else new_buffer
            g.op("Sub", param, g.op("Mul", grad, "lr"), output=next_name(p))
        elif fused:
            exp_avg, exp_avg_sq = f"{p}.exp_avg", f"{p}.exp_avg_sq"
            if kind == "adam" and weight_decay != 0:
                grad = g.op("Add", grad, g.op("Mul", param, g.const(weight_decay)))
            g.nodes.append(helper.make_node(
                "AdamUpdate",
                [param, grad, exp_avg, exp_avg_sq, step_size, correction2_sqrt, param_scale or "", grad_scale or ""],
                [next_name(p), next_name(exp_avg), next_name(exp_avg_sq)], domain=DOMAIN,
                beta2=float(np.float32(beta2)), one_minus_beta1=float(np.float32(1 - beta1)),
                one_minus_beta2=float(np.float32(1 - beta2)), epsilon=float(np.float32(eps))))
            while not g.nodes[-1].input[-1]:
                g.nodes[-1].input.pop()
            state[exp_avg], state[exp_avg_sq] = next_name(exp_avg), next_name(exp_avg_sq)
        else:  # amsgrad: the same step as separate ops, with the running maximum
            if weight_decay != 0:
                if kind == "adamw":
                    param = g.op("Mul", param, param_scale)
                else:
                    grad = g.op("Add", grad, g.op("Mul", param, g.const(weight_decay)))
            exp_avg, exp_avg_sq = f"{p}.exp_avg", f"{p}.exp_avg_sq"
            new_avg = g.op("Add", exp_avg, g.op("Mul", g.op("Sub", grad, exp_avg), g.const(1 - beta1)),
                           output=next_name(exp_avg))
            new_sq = g.op("Add", g.op("Mul", exp_avg_sq, g.const(beta2)),
                          g.op("Mul", g.op("Mul", grad, grad), g.const(1 - beta2)), output=next_name(exp_avg_sq))
            state[exp_avg], state[exp_avg_sq] = new_avg, new_sq
            max_sq = f"{p}.max_exp_avg_sq"
            second_moment = g.op("Max", max_sq, new_sq, output=next_name(max_sq))
            state[max_sq] = second_moment
            denominator = g.op("Add", g.op("Div", g.op("Sqrt", second_moment), correction2_sqrt), g.const(eps))
            update = g.op("Mul", g.op("Div", new_avg, denominator), step_size)
            g.op("Sub", param, update, output=next_name(p))
        outputs.append(value_info(next_name(p), s))
    outputs += [value_info(next_name(name), parameters[name.rsplit(".", 1)[0]]) for name in state]

    graph = helper.make_graph(g.nodes, f"{kind}_step", inputs, outputs, initializer=g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = IR_VERSION
    model = normgrad.add_functions(model)
    hyperparameters = {"kind": kind, "lr": "input", "clip_grad_norm": clip_grad_norm, "weight_decay": weight_decay}
    if kind == "sgd":
        hyperparameters.update(momentum=momentum, dampening=dampening, nesterov=nesterov)
    else:
        hyperparameters.update(betas=list(betas), eps=eps, amsgrad=amsgrad)
    helper.set_model_props(model, {
        "normgrad.state": json.dumps({**{p: next_name(p) for p in parameters}, **state}),
        "normgrad.parameters": json.dumps(list(parameters)),
        "normgrad.optimizer": json.dumps(hyperparameters),
    })
    onnx.checker.check_model(model, full_check=True)
    return model


def _live_nodes(nodes: Sequence[onnx.NodeProto], outputs: Sequence[str]) -> List[onnx.NodeProto]:
    """The nodes some output depends on (the gradients of data inputs are not step outputs)."""
    needed, live = set(outputs), []
    for node in reversed(nodes):
        if any(name in needed for name in node.output):
            live.append(node)
            needed.update(node.input)
            needed.update(subgraph_captures(node))
    return live[::-1]


def _read_values(nodes: Sequence[onnx.NodeProto]) -> set:
    return {name for node in nodes for name in list(node.input) + subgraph_captures(node)}


def _metadata(model: onnx.ModelProto) -> Dict[str, object]:
    return {entry.key: json.loads(entry.value) for entry in model.metadata_props if entry.key.startswith("normgrad.")}


def _sub_model(step: onnx.ModelProto, name: str, nodes: List[onnx.NodeProto], inputs: List[onnx.ValueInfoProto],
               outputs: List[onnx.ValueInfoProto], properties: Mapping[str, str],
               initializers: Sequence[onnx.TensorProto] = (), check: bool = True) -> onnx.ModelProto:
    """A model of ``nodes`` cut out of ``step``, with the initializers they read (plus
    ``initializers``) and the function bodies and opsets of the domains they use."""
    read = _read_values(nodes)
    graph = helper.make_graph(nodes, name, inputs, outputs,
                              initializer=[t for t in step.graph.initializer if t.name in read] + list(initializers),
                              value_info=[v for v in step.graph.value_info if v.name in read])
    domains = {node.domain for node in nodes} | {""}
    opsets = [o for o in step.opset_import if o.domain in domains or (o.domain == "ai.onnx" and "" in domains)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="normgrad")
    model.functions.extend(f for f in step.functions if f.domain in domains)
    model.ir_version = IR_VERSION
    helper.set_model_props(model, dict(properties))
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def build_gradient_graph(step: onnx.ModelProto) -> onnx.ModelProto:
    """The gradient half of a step graph, accumulating: (data inputs, parameters, running
    statistics, ``P_grad.sum`` per parameter, ``grad_scale``) -> (``loss``, ``NAME.next`` per
    running statistic, ``P_grad.sum.next`` = ``P_grad.sum`` + ``P_grad`` * ``grad_scale``).

    Run once per micro-batch with ``grad_scale`` = 1/k and the sums starting at zero, it
    gives the mean gradient of k micro-batches (torch's ``(loss / k).backward()`` k times)
    for the optimizer graph (:func:`build_optimizer_graph` with :func:`optimizer_options`),
    with room for an all-reduce between the two.
    """
    meta = _metadata(step)
    parameters = meta["normgrad.parameters"]
    statistics = meta.get("normgrad.running_statistics", [])
    types = {i.name: i for i in step.graph.input}
    grad_outputs = [f"{p}_grad" for p in parameters]
    outputs = ["loss"] + [next_name(s) for s in statistics]
    nodes = [copy.deepcopy(n) for n in _live_nodes(step.graph.node, outputs + grad_outputs)]
    accumulated = []
    for p in parameters:
        total = p + ACCUMULATOR_SUFFIX
        scaled = helper.make_node("Mul", [f"{p}_grad", "grad_scale"], [f"{total}.scaled"])
        nodes += [scaled, helper.make_node("Add", [total, scaled.output[0]], [next_name(total)])]
        accumulated.append(total)
    read = _read_values(nodes)
    inputs = [i for i in step.graph.input if i.name in read and i.name not in ("lr", "step")]
    inputs.append(helper.make_tensor_value_info("grad_scale", TensorProto.FLOAT, []))
    inputs += [helper.make_tensor_value_info(a, TensorProto.FLOAT, _dims(types[p])) for a, p in zip(accumulated, parameters)]
    loss = [o for o in step.graph.output if o.name == "loss"]
    state_outputs = [o for o in step.graph.output if o.name in {next_name(s) for s in statistics}]
    outputs_info = loss + state_outputs + [helper.make_tensor_value_info(next_name(a), TensorProto.FLOAT, _dims(types[p]))
                                           for a, p in zip(accumulated, parameters)]
    state = {**{s: next_name(s) for s in statistics}, **{a: next_name(a) for a in accumulated}}
    return _sub_model(step, f"{step.graph.name}_gradients", nodes, inputs, outputs_info,
                      {"normgrad.state": json.dumps(state), "normgrad.parameters": json.dumps(parameters)})


def _dims(info: onnx.ValueInfoProto) -> List[int]:
    return [d.dim_value for d in info.type.tensor_type.shape.dim]


def build_inference_model(step: onnx.ModelProto, tensors: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """The forward model inside a step graph, for inference: the nodes computing its forward
    outputs (those the step graph still computes; for a model computing its own loss
    (``loss_output``), its other outputs when it has any), with every training-mode
    BatchNormalization normalizing with its running statistics instead of the batch's,
    Dropout as Identity, and every state tensor it reads (``tensors``: trained weights,
    running statistics) as an initializer.

    Raises:
        ValueError: ``step`` is not a step graph, or ``tensors`` lacks a state tensor the forward reads.
    """
    meta = _metadata(step)
    if "normgrad.loss" not in meta or not meta["normgrad.loss"]:
        raise ValueError("not a step graph written by normgrad: no normgrad.loss metadata")
    loss_output = meta["normgrad.loss"]["output"]
    produced = {o for node in step.graph.node for o in node.output}
    outputs = [o for o in meta.get("normgrad.forward_outputs", [loss_output]) if o in produced]
    if meta["normgrad.loss"]["kind"] == "output" and len(outputs) > 1:
        outputs.remove(loss_output)  # a model computing its own loss: serve its other outputs
    running = {layer["output"]: layer for layer in meta.get("normgrad.batch_norm", [])}
    nodes = []
    for node in step.graph.node:
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and node.output[0] in running:
            # the layer normalizes with its batch statistics in training: the running ones now
            node = copy.deepcopy(node)
            node.input[3], node.input[4] = running[node.output[0]]["running_mean"], running[node.output[0]]["running_var"]
        elif node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            node = helper.make_node("Identity", node.input[:1], node.output[:1], name=node.name)
        nodes.append(node)
    nodes = _live_nodes(nodes, outputs)
    read = _read_values(nodes)
    state = set(meta["normgrad.state"])
    missing = sorted(n for n in state if n in read and n not in tensors)
    if missing:
        raise ValueError(f"no value for state tensor {missing[0]!r}, which the forward model reads")
    inputs = [i for i in step.graph.input if i.name in read and i.name not in state]
    trained = [numpy_helper.from_array(np.asarray(tensors[n]), n) for n in sorted(state & read)]
    model = _sub_model(step, step.graph.name.split("_training")[0] or "model", nodes, inputs,
                       [onnx.ValueInfoProto(name=o) for o in outputs], {}, trained, check=False)
    inferred_graph = onnx.shape_inference.infer_shapes(model).graph
    inferred = {o.name: o for o in list(inferred_graph.value_info) + list(inferred_graph.output) if o.HasField("type")}
    for output in model.graph.output:
        if output.name in inferred:
            output.CopyFrom(inferred[output.name])
    tidy(model)
    onnx.checker.check_model(model, full_check=True)
    return model


def running_statistics(training: onnx.ModelProto) -> Dict[str, str]:
    """{running statistic: the value holding its train-mode update} for every training-mode
    BatchNormalization of a training graph whose running_mean/running_var are initializers
    (``normgrad.batch_norm`` metadata, written by ``build_training_graph``)."""
    initializers = {t.name for t in training.graph.initializer}
    updated: Dict[str, str] = {}
    for layer in _metadata(training).get("normgrad.batch_norm", []):
        for stat in ("running_mean", "running_var"):
            if layer[stat] in initializers:
                if layer[stat] in updated:
                    raise ValueError(f"running statistic {layer[stat]!r} belongs to two training-mode BatchNormalization "
                                     "nodes; a step graph cannot update it twice")
                updated[layer[stat]] = layer[f"{stat}_next"]
    return updated


def optimizer_options(model: onnx.ModelProto) -> Tuple[str, Dict[str, object]]:
    """The optimizer kind and :func:`build_optimizer_graph` keyword arguments recorded in the
    ``normgrad.optimizer`` metadata of a step or optimizer graph."""
    metadata = {entry.key: entry.value for entry in model.metadata_props}
    if "normgrad.optimizer" not in metadata:
        raise ValueError("the model has no normgrad.optimizer metadata: not a step graph written by normgrad")
    options = json.loads(metadata["normgrad.optimizer"])
    kind = options.pop("kind")
    options.pop("lr", None)
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    return kind, options


def build_step_graph(
    training: onnx.ModelProto, kind: str, portable: bool = False, **options
) -> Tuple[onnx.ModelProto, Dict[str, np.ndarray]]:
    """Composes a training graph that has a loss (``build_training_graph(model, loss=...)``)
    with :func:`build_optimizer_graph` into one step graph: (data inputs, state, ``lr``,
    ``step``) -> (``loss``, ``NAME.next`` per state input). Trainable weights become pure
    inputs (no initializer); so do the running statistics of every training-mode
    BatchNormalization (initializers read as inputs 3 and 4), whose ``NAME.next`` outputs are
    torch's train-mode update (:func:`running_statistics`). The returned dict holds every
    state input's initial value, for :func:`normgrad.checkpoint.save`. ``portable``: rewrite
    the step graph so that every execution provider runs it correctly
    (:func:`normgrad.graphs.portable.make_portable`); ``training`` is the ordinary
    (non-portable) training graph.

    Raises:
        ValueError: a training graph without a loss, a non-float32 trainable weight, or a
            graph that already has a value named ``lr`` or ``step``.
    """
    metadata = {entry.key: entry.value for entry in training.metadata_props}
    if json.loads(metadata.get("normgrad.loss", "null")) is None:
        raise ValueError("a step graph needs a training graph built with a loss")
    graph = training.graph
    initializers = {t.name: t for t in graph.initializer}
    trainable = [name for name in json.loads(metadata["normgrad.gradients"]).values() if name in initializers]
    for name in trainable:
        if initializers[name].data_type != TensorProto.FLOAT:
            raise ValueError(f"trainable weight {name!r} is not float32; step graphs are float32")
    names = {i.name for i in graph.input} | {o for n in graph.node for o in n.output} | set(initializers)
    for reserved in ("lr", "step"):
        if reserved in names:
            raise ValueError(f"the training graph already has a value named {reserved!r}")
    optimizer = build_optimizer_graph({n: list(initializers[n].dims) for n in trainable}, kind, **options)
    statistics = running_statistics(training)
    nodes = list(graph.node) + [helper.make_node("Identity", [updated], [next_name(stat)])
                                for stat, updated in statistics.items()]
    present = {i.name for i in graph.input}
    produced = {o for n in graph.node for o in n.output}
    inputs = [i for i in graph.input if i.name not in statistics]
    inputs += [i for i in optimizer.graph.input if i.name not in present and i.name not in produced]
    inputs += [helper.make_tensor_value_info(s, initializers[s].data_type, list(initializers[s].dims)) for s in statistics]
    loss = [o for o in graph.output if o.name == "loss"]
    outputs = loss + list(optimizer.graph.output)
    outputs += [helper.make_tensor_value_info(next_name(s), initializers[s].data_type, list(initializers[s].dims))
                for s in statistics]
    state_inputs = set(trainable) | set(statistics)
    step = helper.make_graph(
        _live_nodes(nodes + list(optimizer.graph.node), [o.name for o in outputs]),
        f"{graph.name}_{kind}_step",
        inputs,
        outputs,
        initializer=[t for t in graph.initializer if t.name not in state_inputs] + list(optimizer.graph.initializer),
        value_info=list(graph.value_info),
    )
    model = helper.make_model(step, opset_imports=list(training.opset_import), producer_name="normgrad")
    model.functions.extend(training.functions)
    model.ir_version = IR_VERSION
    model = normgrad.add_functions(model)  # the optimizer's AdamUpdate body and opset, if the training graph had none
    step_metadata = {entry.key: entry.value for entry in optimizer.metadata_props}
    state_map = json.loads(step_metadata["normgrad.state"])
    state_map.update({s: next_name(s) for s in statistics})
    step_metadata["normgrad.state"] = json.dumps(state_map)
    step_metadata["normgrad.running_statistics"] = json.dumps(list(statistics))
    data_inputs = [i.name for i in graph.input if i.name not in state_inputs]
    gradients = json.loads(metadata["normgrad.gradients"])
    step_metadata["normgrad.forward_outputs"] = json.dumps(
        [o.name for o in graph.output if o.name != "loss" and o.name not in gradients])
    helper.set_model_props(model, {**metadata, **step_metadata, "normgrad.data_inputs": json.dumps(data_inputs)})
    tidy(model)
    onnx.checker.check_model(model, full_check=True)
    initial = {n: numpy_helper.to_array(initializers[n]).copy() for n in trainable}
    for n in trainable:
        for name in optimizer_state_names(n, kind, options.get("momentum", 0.0), options.get("amsgrad", False)):
            initial[name] = np.zeros(initial[n].shape, np.float32)
    initial.update({s: numpy_helper.to_array(initializers[s]).copy() for s in statistics})
    if portable:
        model, _ = make_portable(model)
    return model, initial
