"""build_training_graph: a forward ONNX model -> forward + backward (reverse-mode) model."""

from __future__ import annotations

import copy
import fnmatch
import inspect
import json
import warnings
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple, Union

import numpy as np

import onnx
import onnx.helper as oh
import onnx.inliner
import onnx.numpy_helper
import onnx.shape_inference

from normgrad.ops.api import add_functions_in_place
from normgrad.util.external_data import check_model
import normgrad.graphs.adapters as adapters
import normgrad.graphs.data_parallel as data_parallel_rules
import normgrad.graphs.losses as losses
import normgrad.graphs.patterns as patterns
import normgrad.graphs.rewrites as rewrites
import normgrad.graphs.torch_exports as torch_exports
from normgrad.graphs.context import FLOAT_ELEM_TYPES, GradientContext, describe
from normgrad.graphs.rules import UnsupportedOperatorError, batch_norm, lookup
from normgrad.graphs.portable import COSTLY_REWRITES, make_portable, scan_bodies_self_contained
from normgrad.graphs.structure import check_graph_structure, subgraph_captures
from normgrad.graphs.tidy import tidy
from normgrad.ops import IR_VERSION

__all__ = ["build_training_graph", "MIN_OPSET", "GRAD_SUFFIX", "METADATA_SEEDS", "METADATA_GRADIENTS", "METADATA_LOSS",
           "METADATA_BATCH_NORM", "METADATA_WEIGHTS"]

MIN_OPSET = rewrites.MIN_OPSET
GRAD_SUFFIX = "_grad"
METADATA_SEEDS = "normgrad.seeds"
"""Model metadata key: JSON {forward output: its seed-gradient input}."""
METADATA_GRADIENTS = "normgrad.gradients"
"""Model metadata key: JSON {gradient output: the input or initializer it is the gradient of}."""
METADATA_WEIGHTS = "normgrad.weights"
"""Model metadata key: JSON list of the trainable weights (pure inputs whose initial values
:class:`TrainingGraph` ``.weights`` holds)."""
METADATA_BATCH_NORM = "normgrad.batch_norm"
"""Model metadata key: JSON list, per training-mode BatchNormalization, of {"output": its Y,
"running_mean", "running_var": its inputs 3 and 4, "running_mean_next", "running_var_next":
the values holding their train-mode update}."""
METADATA_LOSS = "normgrad.loss"
"""Model metadata key: JSON {"kind": loss name (``"output"`` for ``loss_output``), "output":
the output it applies to, "options": the loss options, when any}, or null."""


METADATA_INLINE = "normgrad.inline"
"""Model metadata key: "true" on a graph written with ``inline=True`` (standard domains only);
a step graph built from it is inlined too."""


def _default_opset(model: onnx.ModelProto) -> int:
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            return opset.version
    raise ValueError(
        "the model imports no default-domain opset (opset_import has no '' or 'ai.onnx' entry); "
        "add the opset its nodes were written for, e.g. onnx.helper.make_opsetid('', 17)"
    )


def _is_float(info_type: Optional[onnx.TypeProto]) -> bool:
    return (
        info_type is not None
        and info_type.HasField("tensor_type")
        and info_type.tensor_type.elem_type in FLOAT_ELEM_TYPES
    )


def _maybe_float(info_type: Optional[onnx.TypeProto]) -> bool:
    """Float, or of a type shape inference could not find."""
    return info_type is None or not info_type.tensor_type.elem_type or _is_float(info_type)


def _prepare(model: onnx.ModelProto, frozen: Set[str]) -> Tuple[onnx.ModelProto, int]:
    """Inlines local functions and runs :data:`normgrad.graphs.rewrites.PASSES`, infers
    shapes, runs :data:`normgrad.graphs.rewrites.FUSIONS` (none fuses away a trainable
    initializer, float and not in ``frozen``: its gradient would be lost); returns the model
    and its opset."""
    model = copy.deepcopy(model)
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    trainable = {t.name for t in model.graph.initializer if t.data_type in FLOAT_ELEM_TYPES and t.name not in frozen}
    context = rewrites.RewriteContext(opset=_default_opset(model), trainable=frozenset(trainable),
                                      infer_shapes=_infer_shapes)
    for rewrite in rewrites.PASSES:
        rewrite.apply(model, context)
    model = _infer_shapes(model)
    if sum(rewrite.apply(model, context) for rewrite in rewrites.FUSIONS):
        model = _infer_shapes(model)
    return model, context.opset


def _has_shape(type_proto: Optional[onnx.TypeProto]) -> bool:
    return type_proto is not None and type_proto.tensor_type.HasField("shape")


_SHAPE_PRESERVING = ("BatchNormalization", "GroupNormalization", "InstanceNormalization")


def _infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnx shape inference, plus the output shape of the normalization ops that onnx leaves
    unknown in some versions (BatchNormalization in training mode, GroupNormalization):
    the shape of their input; and the output types of the ops onnx does not know whose rule
    gives them (onnxruntime's ``com.microsoft`` ops: :attr:`Rule.output_types`)."""
    patched: Set[str] = set()
    while True:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
        types: Dict[str, onnx.TypeProto] = {}
        for info in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
            if info.name not in types or _has_shape(info.type):
                types[info.name] = info.type
        for init in model.graph.initializer:
            types.setdefault(init.name, oh.make_tensor_type_proto(init.data_type, list(init.dims)))
        added = False
        for node in inferred.graph.node:
            output = node.output[0]
            if (
                node.op_type in _SHAPE_PRESERVING
                and output not in patched
                and not _has_shape(types.get(output))
                and _has_shape(types.get(node.input[0]))
            ):
                model.graph.value_info.append(_value_info(output, types[node.input[0]]))
                patched.add(output)
                added = True
            rule = lookup(node)
            if rule is not None and rule.output_types is not None:
                for output, type_proto in zip(node.output, rule.output_types(node, types.get)):
                    if output and type_proto is not None and output not in patched and not _has_shape(types.get(output)):
                        model.graph.value_info.append(_value_info(output, type_proto))
                        types[output] = type_proto  # read by the next such op in this pass
                        patched.add(output)
                        added = True
        if not added:
            return inferred


def _active(
    graph: onnx.GraphProto, types: GradientContext, frozen: Set[str], stopped: Set[str]
) -> Tuple[Set[str], List[onnx.NodeProto]]:
    """Values reachable from a float input or non-frozen initializer through differentiable
    edges (never through ``stopped`` values), and the nodes without a rule that such a value enters."""
    active = {i.name for i in graph.input if _is_float(i.type)}
    active |= {t.name for t in graph.initializer if t.data_type in FLOAT_ELEM_TYPES and t.name not in frozen}
    unsupported: List[onnx.NodeProto] = []
    for node in graph.node:
        rule = lookup(node)
        if rule is None:
            if any(name in active for name in list(node.input) + subgraph_captures(node)):
                unsupported.append(node)
                active.update(name for name in node.output if _maybe_float(types.type_of(name)))
            continue
        if any(node.input[i] in active for i in rule.differentiable_inputs(types, node)):
            outputs = (node.output[i] for i in rule.differentiable_outputs(node))
            active.update(name for name in outputs if _maybe_float(types.type_of(name)) and name not in stopped)
    return active, unsupported


def _needing_grad(
    graph: onnx.GraphProto, types: GradientContext, active: Set[str], unsupported: List[onnx.NodeProto], seeds: List[str]
) -> Set[str]:
    """The active values from which a seeded output is reachable through differentiable edges.

    Raises:
        UnsupportedOperatorError: a gradient would have to flow through a node without a rule.
    """
    useful = set(seeds)
    for node in reversed(graph.node):
        rule = lookup(node)
        if rule is None:
            if any(name in useful for name in node.output):
                useful.update(node.input)
            continue
        if any(node.output[i] in useful for i in rule.differentiable_outputs(node)):
            useful.update(node.input[i] for i in rule.differentiable_inputs(types, node))
    needs = active & useful
    blocking: Dict[Tuple[str, str], List[onnx.NodeProto]] = {}  # (domain, op type) -> nodes, in graph order
    for node in unsupported:
        if any(name in needs for name in node.output):
            blocking.setdefault((node.domain, node.op_type), []).append(node)
    if blocking:
        gaps = []
        for (domain, op_type), nodes in blocking.items():
            where = f" of domain '{domain}'" if domain else ""
            count = f"{len(nodes)} nodes, first " if len(nodes) > 1 else ""
            gaps.append(f"{op_type}{where} ({count}{describe(nodes[0])})")
        raise UnsupportedOperatorError(
            f"no gradient rule for operator{'s' if len(gaps) > 1 else ''} {', '.join(gaps)}; a gradient must flow "
            f"through {'each of them' if len(gaps) > 1 else 'it'}. Supported: see normgrad.graphs.supported_op_types()"
        )
    _refuse_constant_parameters(graph, types, needs)
    return needs


_TYPE_ONLY_INPUTS = {("CastLike", 1)}
"""(op type, input index): inputs a node reads for their type or shape alone, whose values no
output depends on; a trainable value there loses no gradient."""


def _refuse_constant_parameters(graph: onnx.GraphProto, types: GradientContext, needs: Set[str]) -> None:
    """Refuses a node whose output needs a gradient but which takes a value computed from a
    trainable initializer at an input its rule does not differentiate (that parameter's
    gradient through it would silently be zero). The initializer itself there (or an
    Identity of it) is not refused: that is TorchScript's merge of equal tensors, a buffer
    sharing a parameter's initializer, which ``torch_exports.merged_initializers_warning`` names.

    Raises:
        UnsupportedOperatorError: naming the node, the input and the parameter.
    """
    aliases = {t.name: t.name for t in graph.initializer if t.name in needs}  # a trainable initializer or an Identity of it
    computed: Dict[str, str] = {}  # value -> a trainable initializer it is computed from
    for node in graph.node:
        rule = lookup(node)
        if rule is None or rule.gradient is None:  # no rule: refused above if it matters; None: no gradient at all
            continue
        differentiable = rule.differentiable_inputs(types, node)
        if any(node.output[i] in needs for i in rule.differentiable_outputs(node)):
            for index, name in enumerate(node.input):
                if name in computed and index not in differentiable and _maybe_float(types.type_of(name)) \
                        and (node.op_type, index) not in _TYPE_ONLY_INPUTS:
                    raise UnsupportedOperatorError(
                        f"{describe(node)}: input {index} ('{name}') is computed from trainable parameter "
                        f"'{computed[name]}', but the {node.op_type} rule gives that input no gradient; freeze "
                        f"'{computed[name]}' (--freeze) or keep it off that input")
        sources = [(node.input[i] in aliases, aliases.get(node.input[i]) or computed.get(node.input[i]))
                   for i in differentiable if node.input[i] in aliases or node.input[i] in computed]
        if sources:
            target = aliases if node.op_type == "Identity" and sources[0][0] else computed
            for i in rule.differentiable_outputs(node):
                if _maybe_float(types.type_of(node.output[i])):
                    target.setdefault(node.output[i], sources[0][1])


def _backward(graph: onnx.GraphProto, ctx: GradientContext, seeds: Dict[str, str]) -> Dict[str, List[str]]:
    """Emits the backward nodes; returns every value's gradient contributions.

    Chains a pattern (:mod:`normgrad.graphs.patterns`) matches are differentiated as a
    whole at their last node; their other nodes are skipped.
    """
    grads: Dict[str, List[str]] = {name: [grad] for name, grad in seeds.items()}
    matches = patterns.find_matches(graph, ctx)
    for node in reversed(list(graph.node)):
        match = matches.get(node)
        if match is not None:
            if matches.is_anchor(node) and grads.get(node.output[0]):
                ctx.scope(node)
                out_grad = ctx.gradient_of(ctx.sum_all(grads[node.output[0]]), node.output[0])
                for name, grad in match.gradient(ctx, out_grad):
                    grads.setdefault(name, []).append(grad)
            continue
        rule = lookup(node)
        if rule is None or rule.gradient is None:
            continue
        inputs = rule.differentiable_inputs(ctx, node)
        if not any(ctx.needs_grad(node.input[i]) for i in inputs):
            continue
        out_grads: List[Optional[str]] = [None] * len(node.output)
        for i in rule.differentiable_outputs(node):
            if grads.get(node.output[i]):
                ctx.scope(node)
                out_grads[i] = ctx.gradient_of(ctx.sum_all(grads[node.output[i]]), node.output[i])
        if not any(out_grads):
            continue
        ctx.scope(node)
        in_grads = rule.gradient(ctx, node, out_grads)
        for i, grad in enumerate(in_grads):
            if grad and i in inputs and ctx.needs_grad(node.input[i]):
                grads.setdefault(node.input[i], []).append(grad)
    return grads


def _nothing_differentiable(graph: onnx.GraphProto, frozen: Set[str]) -> str:
    """Why no output of ``graph`` is differentiable, in one line."""
    if not any(_is_float(i.type) for i in graph.input) and not any(
            t.data_type in FLOAT_ELEM_TYPES and t.name not in frozen for t in graph.initializer):
        quantized = sorted({n.op_type for n in graph.node if n.op_type in _QUANTIZED_WEIGHT_OPS})
        why = f" (the quantized weights of {', '.join(quantized)} are never trained: add LoRA adapters)" if quantized else ""
        return f"no trainable tensor: the model has no float input and no float initializer that is not frozen{why}"
    return ("no output of the model is differentiable: none is a float tensor that depends on a float input "
            f"or initializer (outputs: {', '.join(_describe_output(o) for o in graph.output) or 'none'})")


_QUANTIZED_WEIGHT_OPS = ("MatMulNBits",)


def _describe_output(info: onnx.ValueInfoProto) -> str:
    """'name (type)' of a graph output, for error messages."""
    elem_type = info.type.tensor_type.elem_type if info.type.HasField("tensor_type") else 0
    return f"{info.name} ({onnx.TensorProto.DataType.Name(elem_type).lower() if elem_type else 'not a tensor'})"


def _rule_typed_outputs(graph: onnx.GraphProto, known: Set[str]) -> List[onnx.ValueInfoProto]:
    """The inferred types of the outputs of the ops only whose rules give them (not in
    ``known``): kept in the training graph, as onnx's inference cannot find them again in it or
    in the step and evaluation graphs cut from it."""
    names = set()
    for node in graph.node:
        rule = lookup(node)
        if rule is not None and rule.output_types is not None:
            names.update(name for name in node.output if name and name not in known)
    return [info for info in list(graph.value_info) + list(graph.output) if info.name in names and _has_shape(info.type)]


def _value_info(name: str, type_proto: onnx.TypeProto) -> onnx.ValueInfoProto:
    info = onnx.ValueInfoProto(name=name)
    info.type.CopyFrom(type_proto)
    return info


def _name_running_outputs(graph: onnx.GraphProto) -> List[Dict[str, str]]:
    """Names the running-statistics outputs (1 and 2) of every training-mode
    BatchNormalization where absent, so that the graph computes their update, and lists
    them (:data:`METADATA_BATCH_NORM`)."""
    taken = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    found = []
    for node in graph.node:
        training = any(a.name == "training_mode" and a.i for a in node.attribute)
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx") or not training:
            continue
        while len(node.output) < 3:
            node.output.append("")
        for index in (1, 2):
            if not node.output[index]:
                name, k = f"{node.input[index + 2]}.updated", 1
                while name in taken:
                    k += 1
                    name = f"{node.input[index + 2]}.updated{k}"
                taken.add(name)
                node.output[index] = name
        found.append({"output": node.output[0], "running_mean": node.input[3], "running_var": node.input[4],
                      "running_mean_next": node.output[1], "running_var_next": node.output[2]})
    return found


def _loss_output(graph: onnx.GraphProto, float_outputs: List[onnx.ValueInfoProto], name: str) -> onnx.ValueInfoProto:
    """The graph output ``name``, checked to be a differentiable float scalar."""
    found = [o for o in graph.output if o.name == name]
    if not found:
        raise ValueError(f"loss output {name!r} is not an output of the model "
                         f"(outputs: {', '.join(o.name for o in graph.output)})")
    if found[0] not in float_outputs:
        raise ValueError(f"loss output {_describe_output(found[0])} is not a float tensor that depends on a float "
                         "input or trainable initializer")
    shape = found[0].type.tensor_type.shape if _has_shape(found[0].type) else None
    if shape is None or len(shape.dim) != 0:
        dims = "unknown" if shape is None else [d.dim_value or d.dim_param or "?" for d in shape.dim]
        raise ValueError(f"loss output {name!r} must be a scalar (shape []); its shape is {dims}")
    return found[0]


def _refuse_forward_names(graph: onnx.GraphProto, generated: Sequence[str]) -> None:
    """ValueError when a value of the forward graph already has a name the training graph
    gives its gradients or its loss."""
    forward = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    forward |= {o for node in graph.node for o in node.output}
    for name in generated:
        if name in forward:
            what = ("the generated loss" if name == "loss" else
                    f"the gradient of {name[: -len(GRAD_SUFFIX)]!r}")
            hint = " (or give loss_output='loss' / --loss-output loss if it is the model's loss)" if name == "loss" else ""
            raise ValueError(f"the model already has a value named {name!r}, the name the training graph gives "
                             f"{what}: rename that value in the model{hint}")


def frozen_parameters(
    model: onnx.ModelProto, freeze: Sequence[str] = (), trainable: Optional[Sequence[str]] = None
) -> Set[str]:
    """The float initializers to freeze: those matching a ``freeze`` name or fnmatch glob, and
    with ``trainable`` given, every one matching none of its patterns.

    Raises:
        ValueError: a pattern that matches no float initializer (a typo would train everything).
    """
    names = [t.name for t in model.graph.initializer if t.data_type in FLOAT_ELEM_TYPES]
    for option, patterns in (("--freeze", freeze), ("--trainable", trainable or ())):
        for pattern in patterns:
            if not fnmatch.filter(names, pattern):
                raise ValueError(f"{option} {pattern!r} matches no float initializer of the model")
    frozen = {n for n in names if any(fnmatch.fnmatchcase(n, p) for p in freeze)}
    if trainable is not None:
        frozen |= {n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in trainable)}
    return frozen


def _frozen_by_metadata(model: onnx.ModelProto) -> Set[str]:
    """With metadata from :func:`normgrad.torch.export`: every float initializer that is no
    torch parameter (buffers, constants), to be frozen. With LoRA adapters from
    :func:`normgrad.graphs.adapters.add_adapters`: every float initializer but the adapters.
    Without either: the exported graph's Constant nodes that a later tool (onnxruntime's
    transformer optimizer) stored as initializers (:func:`torch_exports.exported_constants`)."""
    lora = adapters.lora_layers(model)
    if lora is not None:
        trained = {name for layer in lora["layers"] for name in (layer.A, layer.B)}
        return {t.name for t in model.graph.initializer if t.data_type in FLOAT_ELEM_TYPES and t.name not in trained}
    parameters = torch_exports.torch_parameters(model)
    if parameters is None:
        return set(torch_exports.exported_constants(model))
    return {t.name for t in model.graph.initializer if t.data_type in FLOAT_ELEM_TYPES and t.name not in parameters}


class TrainingGraph(NamedTuple):
    """A training graph as ``normgrad export`` writes it, and its weights' initial values.

    Unpacks as ``model, weights = build_training_graph(...)``.
    """

    model: onnx.ModelProto
    """The training graph; every trainable weight is a pure input."""
    weights: Dict[str, np.ndarray]
    """{trainable weight: its initial value}, the forward model's initializer."""

    def feeds(self, batch: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """The inputs of one run: the weights' initial values and ``batch`` (which wins)."""
        return {**self.weights, **batch}


AnyTrainingGraph = Union[TrainingGraph, onnx.ModelProto]
"""A :class:`TrainingGraph`, or a training graph model alone (e.g. read from a file
``normgrad export`` wrote, whose weights are in its checkpoint)."""


def _check_weights(model: onnx.ModelProto, weights: Mapping[str, np.ndarray]) -> None:
    """ValueError naming the first trainable weight (:data:`METADATA_WEIGHTS`) that ``weights``
    lacks or gives in another shape than the graph's input, or a value ``weights`` gives for
    no input of the graph (a weight left out would silently become a data input)."""
    listed = next((json.loads(p.value) for p in model.metadata_props if p.key == METADATA_WEIGHTS), None)
    inputs = {i.name: i for i in model.graph.input}
    for name in listed or []:
        if name not in weights:
            raise ValueError(f"TrainingGraph.weights has no value for the trainable weight {name!r}: every weight "
                             "the training graph trains needs its initial value (build_training_graph returns them)")
    for name, value in weights.items():
        if name not in inputs:
            raise ValueError(f"TrainingGraph.weights gives {name!r}, which is no input of the training graph")
        dims = inputs[name].type.tensor_type.shape.dim
        declared = [d.dim_value if d.HasField("dim_value") else None for d in dims]
        shape = list(np.shape(value))
        if len(declared) != len(shape) or any(d is not None and d != n for d, n in zip(declared, shape)):
            raise ValueError(f"TrainingGraph.weights[{name!r}] has shape {shape}; the training graph's input "
                             f"{name!r} is {[d if d is not None else '?' for d in declared]}")


def training_graph_parts(training: AnyTrainingGraph) -> Tuple[onnx.ModelProto, Dict[str, np.ndarray]]:
    """(model, {weight: initial value}) of either form; a model alone has the values of the
    weights it still stores as initializers (an older normgrad's form), none otherwise."""
    if isinstance(training, TrainingGraph):
        _check_weights(training.model, training.weights)
        return training.model, training.weights
    if not isinstance(training, onnx.ModelProto):
        raise TypeError(f"expected a TrainingGraph or an onnx.ModelProto; got {type(training).__name__}")
    inputs = {i.name for i in training.graph.input}
    return training, {t.name: onnx.numpy_helper.to_array(t) for t in training.graph.initializer if t.name in inputs}


def build_training_graph(
    model: onnx.ModelProto,
    loss: Optional[str] = None,
    inline: bool = False,
    frozen: Iterable[str] = (),
    loss_options: Optional[Mapping[str, object]] = None,
    loss_output: Optional[str] = None,
    batch_norm_all_reduce: Optional[batch_norm.AllReduce] = None,
    data_parallel: bool = False,
    sync_batch_norm: bool = False,
    bucket_bytes: int = data_parallel_rules.DEFAULT_BUCKET_BYTES,
    portable: bool = False,
) -> "TrainingGraph":
    """Appends the reverse-mode gradient of ``model`` to it.

    The training graph is what ``normgrad export`` writes: its inputs are the forward
    inputs, every trainable weight (a pure input: no initializer holds it; its initial value
    is in :attr:`TrainingGraph.weights`) and, per float forward output ``y``, a seed
    gradient ``y_grad`` of y's type (with ``loss``: one ``labels`` input instead). Its
    outputs are the forward outputs (plus the scalar ``loss``) and ``NAME_grad`` for every
    float graph input and every trainable initializer (a float initializer on a
    differentiable path to the outputs; BatchNormalization running statistics are not).

    Args:
        model: the forward model (default-domain ops; local functions are inlined).
        loss: None or a name in :data:`normgrad.graphs.losses.LOSSES`: a loss of the first output.
        loss_options: the loss's options (torch's names, :data:`normgrad.graphs.losses.LOSS_OPTIONS`):
            ``label_smoothing``, ``ignore_index`` (cross_entropy), ``beta`` (smooth_l1).
        loss_output: instead of ``loss``, the name of a scalar float output the forward
            model already computes as its loss (seeded with gradient 1; no ``labels`` input).
        inline: write standard ops only (the normgrad function bodies inlined) instead of
            normgrad nodes plus their function bodies.
        frozen: initializer names that get no gradient (no gradient nodes at all; they stay
            plain initializers), e.g. from :func:`frozen_parameters`. A model written by
            :func:`normgrad.torch.export` also freezes every float initializer its metadata
            ``normgrad.torch_parameters`` does not list (buffers, constants).
        batch_norm_all_reduce: synchronized BatchNorm: training-mode BatchNormalization
            statistics and backward sums go through this all-reduce (see
            :func:`normgrad.graphs.rules.batch_norm.make_batch_statistics_explicit`).
        data_parallel: average the gradients of the trainable initializers and the loss over
            the MPI ranks (normgrad AllReduce, bucketed: :mod:`normgrad.graphs.data_parallel`);
            the gradients of graph inputs stay this rank's.
        sync_batch_norm: synchronized BatchNorm with normgrad's AllReduce (shorthand for
            ``batch_norm_all_reduce=normgrad.graphs.data_parallel.all_reduce``).
        bucket_bytes: the largest all-reduce of ``data_parallel``, in bytes.
        portable: also make the rewrites that cost measurable time on onnxruntime's CPU
            provider (:data:`normgrad.graphs.portable.COSTLY_REWRITES`, ``normgrad export
            --portable``); the others are always made (:func:`normgrad.graphs.portable.as_exported`).

    Returns:
        A :class:`TrainingGraph`: the model (IR version 10, the default-domain opset of
        ``model``, at least 15, 16 with MaxPool, checked with
        ``onnx.checker.check_model(full_check=True)``) and the trainable weights' initial
        values, to feed with each batch (``{**training.weights, **batch}``) or to pass on to
        :func:`normgrad.graphs.build_step_graph`.

    Raises:
        UnsupportedOperatorError: a gradient must flow through an operator (or a variant of one) without a rule.
        ValueError: unknown loss or loss option, a ``loss_output`` that is not a
            differentiable scalar output, an opset the version converter cannot raise, no
            differentiable output, or a malformed graph (a value produced twice, nodes out
            of topological order, a cycle).
        MisexportedModelError: (a ValueError) a torch export that cannot give torch's
            gradients, as far as the model shows it (:mod:`normgrad.graphs.torch_exports`).

    Warns:
        TorchExportWarning: trainable initializers that look like constants torch folded, or
            that torch's TorchScript exporter merged several tensors into.
    """
    stored = _assemble_training_graph(model, loss, inline, frozen, loss_options, loss_output, batch_norm_all_reduce,
                                      data_parallel, sync_batch_norm, bucket_bytes)
    return TrainingGraph(*make_portable(stored, skip=() if portable else COSTLY_REWRITES, in_place=True))


def training_graph_with_stored_weights(model: onnx.ModelProto, **options) -> onnx.ModelProto:
    """The training graph of :func:`build_training_graph` (same options but ``portable``) in
    the form whose trainable weights are graph inputs *and* initializers holding their
    initial values, without the portable rewrites: the form a runtime that ignores fed
    weights gets wrong (the corpus's ``_stored_weights`` cases test exactly that)."""
    if "portable" in options:
        raise TypeError("training_graph_with_stored_weights makes no portable rewrite: drop portable=")
    arguments = inspect.signature(build_training_graph).bind(model, **options)
    arguments.apply_defaults()
    del arguments.arguments["portable"]
    return _assemble_training_graph(*arguments.args)


class _Differentiated(NamedTuple):
    """The prepared forward model and what its backward pass needs (:func:`_differentiate`)."""

    model: onnx.ModelProto
    ctx: GradientContext
    float_outputs: List[onnx.ValueInfoProto]
    wanted: List[Tuple[str, onnx.TypeProto]]  # the values whose gradients are outputs, in order
    grad_names: List[str]
    trainable_inputs: List[onnx.ValueInfoProto]  # the trained initializers, as graph inputs
    running_statistics: List[Dict[str, str]]
    original_value_info: List[onnx.ValueInfoProto]
    peft_adapters: Optional[str]


def _assemble_training_graph(model, loss, inline, frozen, loss_options, loss_output, batch_norm_all_reduce,
                             data_parallel, sync_batch_norm, bucket_bytes) -> onnx.ModelProto:
    """:func:`build_training_graph` before the weights leave the initializers."""
    if inline and (data_parallel or sync_batch_norm or batch_norm_all_reduce):
        raise ValueError("inline=True writes AllReduce as its function body, the identity: it cannot be combined "
                         "with data_parallel or sync_batch_norm")
    if sync_batch_norm:
        batch_norm_all_reduce = batch_norm_all_reduce or data_parallel_rules.all_reduce
    lora = next((p.value for p in model.metadata_props if p.key == adapters.METADATA_LORA), None)
    forward = _differentiate(model, frozen, batch_norm_all_reduce, loss, loss_output, loss_options)
    del model  # the prepared copy in ``forward`` is the one assembled
    ctx, float_outputs = forward.ctx, forward.float_outputs
    seeds, extra_inputs, extra_outputs, appended, loss_name = _seed_backward(
        forward.model.graph, ctx, float_outputs, loss, loss_output, loss_options, data_parallel)
    grads = _backward(forward.model.graph, ctx, seeds)
    gradients, gradient_outputs, parallel_metadata = _gradient_outputs(
        forward, grads, appended, loss_name, data_parallel, batch_norm_all_reduce, bucket_bytes)
    result = _training_model(forward, extra_inputs, extra_outputs + gradient_outputs)
    # no Shape of a forward value keeps it alive until the backward: sizes from the forward's data inputs
    initializers = {t.name for t in forward.model.graph.initializer}
    data_inputs = [i.name for i in forward.model.graph.input if i.name not in initializers]
    rewrites.shapes_from_inputs(result, ctx.type_of, data_inputs)
    rewrites.depthwise_forwards(result)
    loss_of = float_outputs[0].name
    weight_names = [info.name for info in forward.trainable_inputs]
    running_statistics, peft_adapters = forward.running_statistics, forward.peft_adapters
    # a reference to any part of the prepared forward model or of the emitted nodes keeps
    # all of it alive
    del forward, ctx, float_outputs, extra_inputs, extra_outputs, gradient_outputs, grads
    metadata = {
        METADATA_SEEDS: json.dumps(seeds if loss is None else {}),
        METADATA_GRADIENTS: json.dumps(gradients),
        METADATA_WEIGHTS: json.dumps(weight_names),
        METADATA_LOSS: json.dumps(
            {"kind": loss, "output": loss_of, **({"options": dict(loss_options)} if loss_options else {})}
            if loss else {"kind": "output", "output": loss_output} if loss_output else None),
        **parallel_metadata,
    }
    if running_statistics:
        metadata[METADATA_BATCH_NORM] = json.dumps(running_statistics)
    if inline:
        metadata[METADATA_INLINE] = "true"
    if peft_adapters is not None:  # which trained tensors are LoRA adapters, for normgrad.lora
        metadata[torch_exports.METADATA_PEFT] = peft_adapters
    if lora is not None:  # the adapters of normgrad.graphs.adapters, for normgrad.lora
        metadata[adapters.METADATA_LORA] = lora
    oh.set_model_props(result, metadata)
    result.ir_version = IR_VERSION
    rewrites.cast_stored_weights_per_reader(result)
    tidy(result)
    result = add_functions_in_place(result)
    if inline:
        from normgrad.graphs.inline import inline_normgrad

        result = inline_normgrad(result)
        scan_bodies_self_contained(result)  # standard ops for other runtimes: OpenVINO's reads no outer scope
    result.ir_version = IR_VERSION
    check_model(result)
    return result


def _differentiate(model, frozen, batch_norm_all_reduce, loss, loss_output, loss_options) -> _Differentiated:
    """The forward model checked and prepared, the values a gradient must reach, and the
    context whose nodes the backward pass emits."""
    check_graph_structure(model.graph)
    torch_exports.check_forward_model(model)
    frozen = set(frozen) | _frozen_by_metadata(model)
    folded_constants = torch_exports.torchscript_folded_constants(model)
    merged_initializers = torch_exports.torchscript_merged_initializers(model)
    # bfloat16 values may become float32 (rewrites.bfloat16_in_float32): their types are inferred again
    # a Constant's type is its value's (onnxruntime-genai's builder declares its [1] constants as scalars)
    constants = {node.output[0] for node in model.graph.node if node.op_type == "Constant" and node.domain in ("", "ai.onnx")}
    original_value_info = [v for v in model.graph.value_info
                           if v.type.tensor_type.elem_type != onnx.TensorProto.BFLOAT16 and v.name not in constants]
    peft_adapters = next((p.value for p in model.metadata_props if p.key == torch_exports.METADATA_PEFT), None)
    embeddings = torch_exports.embedding_gradients(model)
    model, opset = _prepare(model, frozen)
    graph = model.graph
    original_value_info += _rule_typed_outputs(graph, {v.name for v in original_value_info})
    running_statistics = _name_running_outputs(graph)
    batch_statistics = batch_norm.make_batch_statistics_explicit(graph, opset, batch_norm_all_reduce)
    stopped = {name for stats in batch_statistics.values() for name in stats.running_outputs}
    types = GradientContext(graph, opset, set())
    active, unsupported = _active(graph, types, set(frozen), stopped)
    for output in graph.output:  # the graph outputs with the best type known
        if not _has_shape(output.type) and _has_shape(types.type_of(output.name)):
            output.type.CopyFrom(types.type_of(output.name))
    float_outputs = [o for o in graph.output if _is_float(o.type) and o.name in active]
    if not float_outputs:
        raise ValueError(_nothing_differentiable(graph, frozen))
    if loss_output is not None:
        if loss is not None:
            raise ValueError("give either a loss or a loss output, not both")
        float_outputs = [_loss_output(graph, float_outputs, loss_output)]
    if loss_options and loss is None:
        raise ValueError("loss options need a loss")
    seeded = [float_outputs[0].name] if loss is not None or loss_output is not None else [o.name for o in float_outputs]
    needs = _needing_grad(graph, types, active, unsupported, seeded)
    trained_folded = [name for name in folded_constants if name in needs]
    if trained_folded:
        warnings.warn(torch_exports.folded_constants_warning(
            trained_folded, torch_exports.torchscript_eval_mode(model, trained_folded)),
            torch_exports.TorchExportWarning, stacklevel=4)
    trained_merged = {kept: names for kept, names in merged_initializers.items() if kept in needs}
    if trained_merged:
        warnings.warn(torch_exports.merged_initializers_warning(trained_merged), torch_exports.TorchExportWarning, stacklevel=4)
    ctx = GradientContext(graph, opset, needs)
    ctx.batch_statistics = batch_statistics
    ctx.embeddings = embeddings

    input_names = {i.name for i in graph.input}
    wanted = [(i.name, i.type) for i in graph.input if _is_float(i.type)]
    trainable_inputs: List[onnx.ValueInfoProto] = []
    for init in graph.initializer:
        if init.name in needs and init.name not in input_names:
            info = oh.make_tensor_value_info(init.name, init.data_type, list(init.dims))
            trainable_inputs.append(info)
            wanted.append((init.name, info.type))
    # NAME_grad names the gradient of NAME, never a forward value (a reader of
    # outputs["W_grad"] must get the gradient); a seed of an output that is also an input or
    # initializer gets the suffixed name
    _refuse_forward_names(graph, [name + GRAD_SUFFIX for name, _ in wanted] +
                          (["loss"] if loss is not None else []))
    grad_names = [ctx.reserve(name + GRAD_SUFFIX) for name, _ in wanted]
    return _Differentiated(model, ctx, float_outputs, wanted, grad_names, trainable_inputs, running_statistics,
                           original_value_info, peft_adapters)


def _seed_backward(graph: onnx.GraphProto, ctx: GradientContext, float_outputs, loss, loss_output, loss_options,
                   data_parallel):
    """The loss appended (or the loss output, or one seed input per float output) and the
    seeds of the backward pass: ``(seeds, extra inputs, extra outputs, appended loss, its output name)``."""
    extra_inputs: List[onnx.ValueInfoProto] = []  # seeds or labels
    extra_outputs: List[onnx.ValueInfoProto] = []
    appended = loss_name = None
    if loss is not None:
        ctx.scope("loss")
        bias_add = losses.bias_add_before(graph, ctx, float_outputs[0].name)
        if bias_add is not None:  # a chain differentiated as a whole gives no gradient to its inner values
            matches, x_producer = patterns.find_matches(graph, ctx), ctx.producer(bias_add.x)
            if matches.get(bias_add.add) is not None or (
                    x_producer is not None and matches.get(x_producer) is not None and not matches.is_anchor(x_producer)):
                bias_add = None
        appended = losses.append_loss(ctx, loss, float_outputs[0], loss_options, bias_add)
        if ctx.reserve(appended.labels.name) != appended.labels.name:
            raise ValueError("the model already has a value named 'labels'")
        extra_inputs.append(appended.labels)
        loss_name = ctx.reserve("loss")
        if not data_parallel:  # else the mean over the ranks, in _gradient_outputs
            ctx.op("Identity", appended.loss, outputs=[loss_name])
        extra_outputs.append(_value_info(loss_name, oh.make_tensor_type_proto(appended.elem_type, [])))
        seeds = appended.seeds
    elif loss_output is not None:
        ctx.scope("loss")
        seeds = {loss_output: ctx.scalar(1.0, loss_output)}
        if loss_output != "loss":
            if ctx.reserve("loss") != "loss":
                raise ValueError("the model already has a value named 'loss' besides its loss output")
            ctx.op("Identity", loss_output, outputs=["loss"])
            extra_outputs.append(_value_info("loss", float_outputs[0].type))
    else:
        seeds = {}
        for output in float_outputs:
            seed = ctx.reserve(output.name + GRAD_SUFFIX)
            extra_inputs.append(_value_info(seed, output.type))
            seeds[output.name] = seed
    return seeds, extra_inputs, extra_outputs, appended, loss_name


def _gradient_outputs(forward: _Differentiated, grads, appended, loss_name, data_parallel, batch_norm_all_reduce,
                      bucket_bytes):
    """Each wanted value's gradient (averaged over the ranks when data-parallel) as the output
    ``NAME_grad``: ``({grad output: value}, their value infos, data-parallel metadata)``."""
    ctx, wanted = forward.ctx, forward.wanted
    ctx.scope("grad/outputs")
    values = {name: ctx.sum_all(grads[name]) if grads.get(name) else ctx.zeros_like(name) for name, _ in wanted}
    buckets = []
    if data_parallel:
        trainable = {info.name for info in forward.trainable_inputs}
        members = [data_parallel_rules.static_member(ctx, name, values[name]) for name, _ in wanted if name in trainable]
        if appended is not None:
            members.append(data_parallel_rules.static_member(ctx, loss_name, appended.loss, forward.float_outputs[0].name, []))
        averaged, buckets = data_parallel_rules.average_over_ranks(ctx, members, bucket_bytes)
        values.update((name, averaged[name]) for name in trainable)
        if appended is not None:
            ctx.op("Identity", averaged[loss_name], outputs=[loss_name])
    parallel_metadata = data_parallel_rules.metadata(data_parallel, batch_norm_all_reduce is not None, buckets)
    gradients: Dict[str, str] = {}
    outputs: List[onnx.ValueInfoProto] = []
    for (name, type_proto), grad_name in zip(wanted, forward.grad_names):
        ctx.op("Identity", values[name], outputs=[grad_name])
        gradients[grad_name] = name
        outputs.append(_value_info(grad_name, type_proto))
    return gradients, outputs, parallel_metadata


def _training_model(forward: _Differentiated, extra_inputs, extra_outputs) -> onnx.ModelProto:
    """The forward nodes (with the rules' replacements) and the emitted ones in one new model."""
    graph, ctx = forward.model.graph, forward.ctx
    # the training graph is assembled in the model that holds it, each node copied once; a
    # graph of 10^6 nodes takes gigabytes per copy
    result = oh.make_model(onnx.GraphProto(), opset_imports=list(forward.model.opset_import), producer_name="normgrad")
    new_graph = result.graph
    new_graph.name = f"{graph.name or 'model'}_training"
    new_graph.doc_string = "Training graph written by normgrad.graphs.build_training_graph"
    new_graph.input.extend(list(graph.input) + forward.trainable_inputs + extra_inputs)
    new_graph.output.extend(list(graph.output) + extra_outputs)
    new_graph.initializer.extend(graph.initializer)
    new_graph.sparse_initializer.extend(graph.sparse_initializer)
    new_graph.value_info.extend(forward.original_value_info)
    new_graph.value_info.extend(ctx.declared)
    if ctx.forward_replacements:
        for node in graph.node:
            replacement = ctx.forward_replacements.get(next((name for name in node.output if name), ""))
            new_graph.node.extend([node] if replacement is None else replacement)
    else:
        new_graph.node.extend(graph.node)
    new_graph.node.extend(ctx.nodes)
    return result
