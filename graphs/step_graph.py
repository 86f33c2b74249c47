"""Step, gradient, evaluation and inference graphs: a training graph with a loss composed with
one optimizer step (:func:`normgrad.graphs.optimizers.build_optimizer_graph`), and the graphs cut
out of a step graph.

* :func:`build_step_graph`: (data inputs, state, ``lr``, ``step``, hyperparameters) ->
  (``loss``, ``NAME.next`` per state input); its initial state for a checkpoint.
* :func:`build_gradient_graph`: the gradient half of a step graph, accumulating micro-batch
  gradients (the optimizer graph runs after it, an all-reduce between the two).
* :func:`build_eval_graph`: loss and forward outputs in torch's eval mode, no update.
* :func:`build_inference_model`: the forward model with its trained state as initializers.
"""

from __future__ import annotations

import base64
import copy
import json
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from normgrad.ops import api, depthwise_conv
from normgrad.util.external_data import check_model
import normgrad.graphs.rewrites as rewrites
from normgrad.graphs.optimizers import (build_optimizer_graph, clipping_without_if, hyperparameter_defaults, next_name,
                                         optimizer_state_names)
from normgrad.graphs.portable import make_portable
from normgrad.graphs.structure import subgraph_captures
from normgrad.graphs.tidy import tidy
from normgrad.ops._common import DOMAIN, IR_VERSION

if TYPE_CHECKING:
    from normgrad.graphs.builder import AnyTrainingGraph

__all__ = [
    "build_step_graph",
    "build_gradient_graph",
    "build_eval_graph",
    "build_inference_model",
    "running_statistics",
    "expose_forward_outputs",
    "forward_outputs",
    "live_nodes",
    "read_values",
    "ACCUMULATOR_SUFFIX",
    "METADATA_FORWARD_TAIL",
]

ACCUMULATOR_SUFFIX = "_grad.sum"
"""``P_grad.sum``: the gradient accumulator input of :func:`build_gradient_graph` for parameter ``P``."""


def live_nodes(nodes: Sequence[onnx.NodeProto], outputs: Sequence[str]) -> List[onnx.NodeProto]:
    """The nodes some of ``outputs`` depends on, in graph order (the gradients of data inputs
    are not step outputs)."""
    needed, live = set(outputs), []
    for node in reversed(nodes):
        if any(name in needed for name in node.output):
            live.append(node)
            needed.update(node.input)
            needed.update(subgraph_captures(node))
    return live[::-1]


METADATA_FORWARD_TAIL = "normgrad.forward_tail"
"""Step graph metadata: the forward nodes computing the loss's model output that the step
does not run (a bias Add the loss node absorbed, ``normgrad.graphs.losses.bias_add_before``,
and its Reshapes), with the initializers only they read: a JSON string of a base64 GraphProto, which
:func:`forward_outputs`, :func:`expose_forward_outputs`, :func:`build_eval_graph` and
:func:`build_inference_model` put back."""


def _forward_tail(training: onnx.GraphProto, live: Sequence[onnx.NodeProto], loss_output: str,
                  state: set) -> Optional[str]:
    """:data:`METADATA_FORWARD_TAIL` of a step graph of ``live`` nodes, or None when they
    compute the loss's model output themselves."""
    running = {id(node) for node in live}
    tail = [n for n in live_nodes(list(training.node), [loss_output]) if id(n) not in running]
    if not tail:
        return None
    read_by_step = read_values(live)
    read = read_values(tail)
    initializers = [t for t in training.initializer if t.name in read and t.name not in read_by_step
                    and t.name not in state]
    graph = helper.make_graph(tail, "forward_tail", [], [onnx.ValueInfoProto(name=loss_output)], initializers)
    return json.dumps(base64.b64encode(graph.SerializeToString()).decode("ascii"))


def _tail(model: onnx.ModelProto) -> onnx.GraphProto:
    """The :data:`METADATA_FORWARD_TAIL` graph of ``model`` (empty without one)."""
    encoded = next((p.value for p in model.metadata_props if p.key == METADATA_FORWARD_TAIL), None)
    if encoded is None:
        return onnx.GraphProto()
    try:
        return onnx.GraphProto.FromString(base64.b64decode(json.loads(encoded), validate=True))
    except Exception:  # not JSON, not base64 or not a GraphProto
        raise ValueError(f"corrupt step graph: metadata {METADATA_FORWARD_TAIL} is not a base64 GraphProto") from None


def _with_tail(model: onnx.ModelProto, names: Sequence[str]) -> Tuple[List[onnx.NodeProto], List[onnx.TensorProto]]:
    """The forward-tail nodes (and initializers) that compute those of ``names`` the nodes
    of ``model`` do not."""
    produced = {o for node in model.graph.node for o in node.output}
    missing = [n for n in names if n not in produced]
    tail = _tail(model) if missing else onnx.GraphProto()
    nodes = live_nodes(list(tail.node), missing)
    read = read_values(nodes)
    return nodes, [t for t in tail.initializer if t.name in read]


def read_values(nodes: Sequence[onnx.NodeProto]) -> set:
    """The values ``nodes`` read, their subgraphs' captures included."""
    return {name for node in nodes for name in list(node.input) + subgraph_captures(node)}


def _metadata(model: onnx.ModelProto) -> Dict[str, object]:
    return {entry.key: json.loads(entry.value) for entry in model.metadata_props if entry.key.startswith("normgrad.")}


def _sub_model(step: onnx.ModelProto, name: str, nodes: List[onnx.NodeProto], inputs: List[onnx.ValueInfoProto],
               outputs: List[onnx.ValueInfoProto], properties: Mapping[str, str],
               initializers: Sequence[onnx.TensorProto] = (), check: bool = True) -> onnx.ModelProto:
    """A model of ``nodes`` cut out of ``step``, with the initializers they read (plus
    ``initializers``) and the function bodies and opsets of the domains they use."""
    read = read_values(nodes)
    stored = list(step.graph.initializer) + list(_tail(step).initializer)
    graph = helper.make_graph(nodes, name, inputs, outputs,
                              initializer=[t for t in stored if t.name in read] + list(initializers),
                              value_info=[v for v in step.graph.value_info if v.name in read])
    domains = {node.domain for node in nodes} | {""}
    opsets = [o for o in step.opset_import if o.domain in domains or (o.domain == "ai.onnx" and "" in domains)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="normgrad")
    model.functions.extend(f for f in step.functions if f.domain in domains)
    model.ir_version = IR_VERSION
    helper.set_model_props(model, dict(properties))
    if check:
        check_model(model)
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
    nodes = [copy.deepcopy(n) for n in live_nodes(step.graph.node, outputs + grad_outputs)]
    micro_batch = [n for n in nodes if n.op_type == "Constant" and list(n.output) == [rewrites.DROPOUT_MICRO_BATCH_INPUT]]
    for constant in micro_batch:  # seeded Dropout: the micro-batch index becomes an input
        nodes.remove(constant)
    accumulated = []
    for p in parameters:
        total = p + ACCUMULATOR_SUFFIX
        scaled = helper.make_node("Mul", [f"{p}_grad", "grad_scale"], [f"{total}.scaled"])
        nodes += [scaled, helper.make_node("Add", [total, scaled.output[0]], [next_name(total)])]
        accumulated.append(total)
    read = read_values(nodes)
    inputs = [i for i in step.graph.input if i.name in read and i.name != "lr"]  # step: read by seeded Dropout
    inputs.append(helper.make_tensor_value_info("grad_scale", TensorProto.FLOAT, []))
    inputs += [helper.make_tensor_value_info(rewrites.DROPOUT_MICRO_BATCH_INPUT, TensorProto.INT64, []) for _ in micro_batch]
    inputs += [helper.make_tensor_value_info(a, TensorProto.FLOAT, _dims(types[p])) for a, p in zip(accumulated, parameters)]
    loss = [o for o in step.graph.output if o.name == "loss"]
    state_outputs = [o for o in step.graph.output if o.name in {next_name(s) for s in statistics}]
    outputs_info = loss + state_outputs + [helper.make_tensor_value_info(next_name(a), TensorProto.FLOAT, _dims(types[p]))
                                           for a, p in zip(accumulated, parameters)]
    state = {**{s: next_name(s) for s in statistics}, **{a: next_name(a) for a in accumulated}}
    tail = {p.key: p.value for p in step.metadata_props if p.key == METADATA_FORWARD_TAIL}
    return _sub_model(step, f"{step.graph.name}_gradients", nodes, inputs, outputs_info,
                      {"normgrad.state": json.dumps(state), "normgrad.parameters": json.dumps(parameters), **tail})


def _dims(info: onnx.ValueInfoProto) -> List[int]:
    return [d.dim_value for d in info.type.tensor_type.shape.dim]


def build_inference_model(step: onnx.ModelProto, tensors: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """The forward model inside a step graph, for inference: the nodes computing its forward
    outputs (those the step graph still computes; for a model computing its own loss
    (``loss_output``), its other outputs when it has any), with every training-mode
    BatchNormalization normalizing with its running statistics instead of the batch's,
    Dropout as Identity, every depthwise Conv the step graph runs as a ``DepthwiseConv`` a
    Conv again, and every state tensor it reads (``tensors``: trained weights, running
    statistics) as an initializer.

    Raises:
        ValueError: ``step`` is not a step graph, or ``tensors`` lacks a state tensor the forward reads.
    """
    meta = _step_metadata(step)
    loss_output = meta["normgrad.loss"]["output"]
    outputs = forward_outputs(step)
    if meta["normgrad.loss"]["kind"] == "output" and len(outputs) > 1:
        outputs.remove(loss_output)  # a model computing its own loss: serve its other outputs
    nodes = [_as_conv(node) for node in live_nodes(_eval_mode_nodes(step), outputs)]
    read = read_values(nodes)
    state = set(meta["normgrad.state"])
    missing = sorted(n for n in state if n in read and n not in tensors)
    if missing:
        raise ValueError(f"no value for state tensor {missing[0]!r}, which the forward model reads")
    inputs = [i for i in step.graph.input if i.name in read and i.name not in state]
    trained = [numpy_helper.from_array(np.asarray(tensors[n]), n) for n in sorted(state & read)]
    model = _sub_model(step, step.graph.name.split("_training")[0] or "model", nodes, inputs,
                       _output_infos(step, outputs), {}, trained, check=False)
    _infer_output_types(model)
    check_model(model)
    return model


def _as_conv(node: onnx.NodeProto) -> onnx.NodeProto:
    """A ``DepthwiseConv`` node as the Conv it computes (its function body), other nodes as
    they are: the operator is for trained weights, and with constant ones runtimes run the Conv
    faster (onnxruntime in its NCHWc layout) and need no normgrad function."""
    if node.op_type != depthwise_conv.OP_TYPE or node.domain != DOMAIN:
        return node
    conv = helper.make_node("Conv", [name for name in node.input if name], list(node.output), name=node.name)
    conv.attribute.extend(node.attribute)
    return conv


def _step_metadata(step: onnx.ModelProto) -> Dict[str, object]:
    meta = _metadata(step)
    if "normgrad.loss" not in meta or not meta["normgrad.loss"]:
        raise ValueError("not a step graph written by normgrad: no normgrad.loss metadata")
    return meta


def forward_outputs(step: onnx.ModelProto) -> List[str]:
    """The forward model's outputs that a step graph still computes (those its loss needs;
    for a model computing its own loss (``loss_output``), that output among them)."""
    meta = _step_metadata(step)
    produced = {o for node in list(step.graph.node) + list(_tail(step).node) for o in node.output}
    return [o for o in meta.get("normgrad.forward_outputs", [meta["normgrad.loss"]["output"]]) if o in produced]


def _eval_mode_nodes(step: onnx.ModelProto) -> List[onnx.NodeProto]:
    """The step graph's nodes (and its forward tail's, :data:`METADATA_FORWARD_TAIL`) with
    every training-mode BatchNormalization normalizing with its running statistics instead
    of the batch's, and Dropout as Identity (torch's eval mode)."""
    meta = _metadata(step)
    running = {layer["output"]: layer for layer in meta.get("normgrad.batch_norm", [])}
    dropout_inputs = meta.get(rewrites.METADATA_DROPOUT, {}).get("outputs", {})  # seeded Dropout: {output: input}
    nodes = []
    for node in list(step.graph.node) + list(_tail(step).node):
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and node.output[0] in running:
            # the layer normalizes with its batch statistics in training: the running ones now
            node = copy.deepcopy(node)
            node.input[3], node.input[4] = running[node.output[0]]["running_mean"], running[node.output[0]]["running_var"]
        elif node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            node = helper.make_node("Identity", node.input[:1], node.output[:1], name=node.name)
        elif node.output and node.output[0] in dropout_inputs:
            node = helper.make_node("Identity", [dropout_inputs[node.output[0]]], node.output[:1], name=node.name)
        nodes.append(node)
    return nodes


def _output_infos(step: onnx.ModelProto, names: Sequence[str]) -> List[onnx.ValueInfoProto]:
    """The value infos of ``names`` as ``step`` types them (onnx infers no type for an output
    of a com.microsoft op), an untyped one where it does not (:func:`_infer_output_types`)."""
    typed = {v.name: v for v in list(step.graph.value_info) + list(step.graph.output) if v.HasField("type")}
    return [copy.deepcopy(typed[n]) if n in typed else onnx.ValueInfoProto(name=n) for n in names]


def _infer_output_types(model: onnx.ModelProto) -> None:
    """Fills in the types of ``model``'s graph outputs that have none, by shape inference."""
    untyped = [o for o in model.graph.output if not o.HasField("type")]
    if not untyped:
        return
    inferred_graph = onnx.shape_inference.infer_shapes(model).graph
    inferred = {o.name: o for o in list(inferred_graph.value_info) + list(inferred_graph.output) if o.HasField("type")}
    for output in untyped:
        if output.name in inferred:
            output.CopyFrom(inferred[output.name])


def expose_forward_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` (a step, gradient or eval graph) with the values ``names`` (computed
    by its nodes or its forward tail's, e.g. :func:`forward_outputs`) as graph outputs too,
    after its own outputs, for an onnxruntime session (``model`` itself when they all are
    outputs already).

    Raises:
        ValueError: a name no node of the graph computes.
    """
    tail_nodes, tail_initializers = _with_tail(model, names)
    produced = {o for node in list(model.graph.node) + tail_nodes for o in node.output}
    present = {o.name for o in model.graph.output}
    for name in names:
        if name not in produced:
            raise ValueError(f"{name!r} is not computed by the graph {model.graph.name!r}")
    added = [n for n in dict.fromkeys(names) if n not in present]
    if not added:
        return model
    exposed = copy.deepcopy(model)
    exposed.graph.node.extend(tail_nodes)  # (they read forward values and state the step reads before its update)
    exposed.graph.initializer.extend(tail_initializers)
    # typed where the graph records the type; onnxruntime (1.19.2 and newer) infers the
    # others when it loads the model
    known = {v.name: v for v in model.graph.value_info}
    exposed.graph.output.extend(copy.deepcopy(known[n]) if n in known else onnx.ValueInfoProto(name=n) for n in added)
    return exposed


def _rank_local_loss(step: onnx.ModelProto) -> Optional[str]:
    """In a ``--data-parallel`` step graph, the value this rank's loss has before it joins the
    gradients' bucketed all-reduce (``loss`` = Reshape(Split(Div(AllReduce(Concat(...,
    Reshape(local), ...)), ranks))[k]), :func:`normgrad.graphs.data_parallel.average_over_ranks`);
    None in a graph without that all-reduce."""
    producer = {name: node for node in step.graph.node for name in node.output}
    node = producer.get("loss")
    while node is not None and node.op_type == "Identity":
        node = producer.get(node.input[0])
    chain = [node]
    for op_type in ("Split", "Div", "AllReduce", "Concat"):
        node = producer.get(chain[-1].input[0]) if chain[-1] is not None else None
        chain.append(node if node is not None and node.op_type == op_type else None)
    reshape, split, _, all_reduce, concat = chain
    if reshape is None or reshape.op_type != "Reshape" or concat is None or all_reduce.domain != DOMAIN:
        return None
    flat = producer.get(concat.input[list(split.output).index(reshape.input[0])])
    return flat.input[0] if flat is not None and flat.op_type == "Reshape" else None


def build_eval_graph(step: onnx.ModelProto) -> onnx.ModelProto:
    """The evaluation graph of a step graph: (data inputs, the state tensors the forward reads:
    trained weights, running statistics) -> (``loss``, the :func:`forward_outputs`), in
    torch's eval mode (BatchNormalization on its running statistics, Dropout off; the nodes
    of :func:`build_inference_model`) and without an update. ``normgrad export --optimizer``
    writes it beside the step graph (``NAME.eval.onnx``); :meth:`normgrad.train.Trainer.evaluate`
    runs it with the trainer's current state. Of a ``--data-parallel`` step graph, ``loss`` is
    this rank's (no collective: a rank can evaluate alone).

    Raises:
        ValueError: ``step`` is not a step graph.
    """
    meta = _step_metadata(step)
    outputs = ["loss"] + [o for o in forward_outputs(step) if o != "loss"]
    nodes = _eval_mode_nodes(step)
    local = _rank_local_loss(step)
    if local is not None:  # this rank's loss, not the mean over the ranks in the gradient all-reduce
        nodes = [n for n in nodes if "loss" not in n.output] + [helper.make_node("Identity", [local], ["loss"])]
    nodes = live_nodes(nodes, outputs)
    read = read_values(nodes)
    inputs = [i for i in step.graph.input if i.name in read]
    state = [i.name for i in inputs if i.name in meta["normgrad.state"]]
    properties = {key: json.dumps(meta[key]) for key in ("normgrad.loss", "normgrad.data_inputs") if key in meta}
    properties["normgrad.eval_state"] = json.dumps(state)
    model = _sub_model(step, f"{step.graph.name}_eval", nodes, inputs, _output_infos(step, outputs), properties,
                       check=False)
    _infer_output_types(model)
    tidy(model)
    check_model(model)
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


def _refuse_clashing_names(names: set, trainable: List[str], kind: str, options: Mapping[str, object]) -> None:
    """ValueError naming a value of the training graph that has a name the optimizer step
    gives a state tensor or its next value (e.g. a weight ``W.exp_avg`` beside a weight ``W``)."""
    for weight in trainable:
        state = [weight] + optimizer_state_names(weight, kind, options.get("momentum", 0.0), options.get("amsgrad", False))
        for name in state[1:] + [next_name(n) for n in state]:
            if name in names:
                raise ValueError(f"the training graph has a value named {name!r}, the name the {kind} step gives a "
                                 f"state tensor of weight {weight!r} or its next value: rename it in the forward model")


def _step_properties(training: onnx.ModelProto, optimizer: onnx.ModelProto, statistics: Mapping[str, str],
                     state_inputs: set, extra: Mapping[str, str]) -> Dict[str, str]:
    """The step graph's metadata: the training graph's, the optimizer graph's (its state with
    the running statistics), ``extra``, the forward outputs and the data inputs."""
    metadata = {entry.key: entry.value for entry in training.metadata_props}
    step_metadata = {entry.key: entry.value for entry in optimizer.metadata_props}
    state_map = json.loads(step_metadata["normgrad.state"])
    state_map.update({s: next_name(s) for s in statistics})
    step_metadata["normgrad.state"] = json.dumps(state_map)
    step_metadata["normgrad.running_statistics"] = json.dumps(list(statistics))
    step_metadata.update(extra)
    graph = training.graph
    data_inputs = [i.name for i in graph.input if i.name not in state_inputs]
    gradients = json.loads(metadata["normgrad.gradients"])
    step_metadata["normgrad.forward_outputs"] = json.dumps(
        [o.name for o in graph.output if o.name != "loss" and o.name not in gradients])
    return {**metadata, **step_metadata, "normgrad.data_inputs": json.dumps(data_inputs)}


def build_step_graph(
    training: "AnyTrainingGraph", kind: str, portable: bool = False, *, dropout_seed: int = 0, **options
) -> Tuple[onnx.ModelProto, Dict[str, np.ndarray]]:
    """Composes a training graph that has a loss (``build_training_graph(model, loss=...)``,
    whose weights' values it takes) with :func:`build_optimizer_graph` into one step graph: (data inputs, state, ``lr``,
    ``step``) -> (``loss``, ``NAME.next`` per state input). Trainable weights become pure
    inputs (no initializer); so do the running statistics of every training-mode
    BatchNormalization (initializers read as inputs 3 and 4), whose ``NAME.next`` outputs are
    torch's train-mode update (:func:`running_statistics`). The returned dict holds every
    state input's initial value, for :func:`normgrad.checkpoint.save`. ``portable``: rewrite
    the step graph so that every execution provider runs it correctly
    (:func:`normgrad.graphs.portable.make_portable`).

    With training-mode Dropout, the step graph takes one more input, ``dropout_seed`` (int64
    scalar), and draws each mask from it, ``step`` and the micro-batch index
    (:func:`normgrad.graphs.rewrites.seed_dropout`); ``dropout_seed`` is recorded in the
    ``normgrad.dropout`` metadata as the seed :class:`normgrad.train.Trainer` feeds by default.

    Raises:
        ValueError: a training graph without a loss, a non-float32 trainable weight, a
            graph that already has a value named ``lr``, ``step`` or ``dropout_seed``, or a
            ``dropout_seed`` outside int64.
    """
    from normgrad.graphs.builder import training_graph_parts

    from_model_alone = isinstance(training, onnx.ModelProto)
    training, weights = training_graph_parts(training)
    metadata = {entry.key: entry.value for entry in training.metadata_props}
    if json.loads(metadata.get("normgrad.loss", "null")) is None:
        raise ValueError("a step graph needs a training graph built with a loss")
    graph = training.graph
    initializers = {t.name: t for t in graph.initializer}
    input_names = {i.name for i in graph.input}
    trainable = [name for name in json.loads(metadata["normgrad.gradients"]).values() if name in weights]
    for name in trainable:
        if weights[name].dtype != np.float32:
            raise ValueError(f"trainable weight {name!r} is not float32; step graphs are float32")
    names = input_names | {o for n in graph.node for o in n.output} | set(initializers)
    for reserved in ("lr", "step", *hyperparameter_defaults(kind, momentum=options.get("momentum", 0.0),
                                                           max_grad_norm=options.get("max_grad_norm"))):
        if reserved in names:
            raise ValueError(f"the training graph already has a value named {reserved!r}")
    if not trainable and from_model_alone:
        raise ValueError("the training graph model carries no trainable weight's value: pass the TrainingGraph that "
                         "build_training_graph returns, not its .model (a model alone has values only of weights it "
                         "stores as initializers), or every weight is frozen or none reaches the loss")
    if not trainable:
        raise ValueError("the training graph has no trainable weight (every initializer frozen, or none reaches the "
                         "loss): a step graph needs at least one")
    _refuse_clashing_names(names, trainable, kind, options)
    optimizer = build_optimizer_graph({n: list(weights[n].shape) for n in trainable}, kind, **options)
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
    live = live_nodes(nodes + list(optimizer.graph.node), [o.name for o in outputs])
    tail = _forward_tail(graph, live, json.loads(metadata["normgrad.loss"])["output"], state_inputs)
    step = helper.make_graph(
        live,
        f"{graph.name}_{kind}_step",
        inputs,
        outputs,
        initializer=[t for t in graph.initializer if t.name not in state_inputs] + list(optimizer.graph.initializer),
        # the forward outputs' types too (onnx infers none for an output of a com.microsoft op)
        value_info=list(graph.value_info) + [o for o in graph.output if o.name not in {x.name for x in outputs}],
    )
    dropout_outputs = rewrites.seed_dropout(step, "step", dropout_seed)
    model = helper.make_model(step, opset_imports=list(training.opset_import), producer_name="normgrad")
    model.functions.extend(training.functions)
    model.ir_version = IR_VERSION
    model = api.add_functions(model)  # the optimizer's AdamUpdate body and opset, if the training graph had none
    if metadata.get("normgrad.inline") == "true":  # standard domains only, as the training graph
        from normgrad.graphs.inline import inline_normgrad

        model = inline_normgrad(model)
        clipping_without_if(model)  # for the runtimes it is written for
    extra = {METADATA_FORWARD_TAIL: tail} if tail is not None else {}
    if dropout_outputs:
        extra[rewrites.METADATA_DROPOUT] = json.dumps({"seed": int(dropout_seed), "outputs": dropout_outputs})
    helper.set_model_props(model, _step_properties(training, optimizer, statistics, state_inputs, extra))
    tidy(model)
    check_model(model)
    initial = {n: np.array(weights[n], copy=True) for n in trainable}
    for n in trainable:
        for name in optimizer_state_names(n, kind, options.get("momentum", 0.0), options.get("amsgrad", False)):
            initial[name] = np.zeros(initial[n].shape, np.float32)
    initial.update({s: numpy_helper.to_array(initializers[s]).copy() for s in statistics})
    if portable:
        model, _ = make_portable(model)
    return model, initial
