"""Portable training graphs: rewrites that let every execution provider run a training or
step graph correctly, not only onnxruntime's CPU provider. ``normgrad export`` makes all but
:data:`COSTLY_REWRITES` by default (:func:`as_exported`); ``--portable`` makes them all.

Each rewrite keeps the graph's arithmetic and works around a defect measured on
onnxruntime-openvino 1.24.1 (device CPU); ``tests/test_openvino_defects.py`` holds a
minimal reproducer of each:

* **weights as pure inputs**: an input that is also an initializer is frozen to its stored
  value by OpenVINO, so fed weights were ignored. The initializer goes; its value is
  returned (for a checkpoint).
* **the SoftmaxCrossEntropy loss node as its function body** (costly: the kernel is faster):
  the standard ops the cross-entropy losses are written in without the operator
  (``normgrad.ops.softmax_cross_entropy``), which the rewrites below then see as before;
  BiasSoftmaxCrossEntropy's the same behind an Add of the bias, with a ReduceSum for it.
* **no constant weight shared by a ConvTranspose**: a constant square weight [C, C, k, k]
  read by both a Conv and a ConvTranspose gives a wrong ConvTranspose. Each ConvTranspose
  gets its own copy of a constant weight another node also reads.
* **OneHot as Equal + Where**: OpenVINO leaves OneHot with a run-time depth to the CPU
  provider, and the constant-folded value it would read then leaves the OpenVINO subgraph
  under a name onnxruntime does not find ("Output names mismatch").
* **Size as ReduceProd(Shape)**: OpenVINO leaves Size to the CPU provider; between two
  OpenVINO parts (the mse loss's Size of the model output) that makes the partition cyclic:
  the session fails ("the graph is not acyclic") or, in larger graphs, the forward pass
  falls back to the CPU provider.
* **LayerNormalization statistics beside it**: OpenVINO takes a LayerNormalization with
  its Y output only ("LayerNormalization expects 1 output tensor ... Got: 3 outputs"), and
  the gradient reads its Mean and InvStdDev. They are computed beside the node instead. (No
  minimal reproducer: a lone such node runs, on the CPU provider; the transformer layer's
  graph fails to compile without the rewrite, ``tests/test_openvino.py``.)
* **seeded Dropout** (a training graph's; a step graph's always is): OpenVINO refuses
  training-mode Dropout; the mask is drawn from the ``dropout_seed`` and ``step`` inputs by
  standard ops, as the step graph draws it: integer arithmetic exact in 32 bits, so OpenVINO
  (which computes int64 in 32 bits and int32 Div/Mod in float32:
  ``test_openvino_defects.py``) draws onnxruntime's masks bitwise.
* **EmbeddingGrad as its standard ops** (not a defect: the graph other runtimes got before
  the operator existed): the gradient of a Gather from a float32 table, which onnxruntime's
  CPU provider runs as one normgrad kernel, is written as its function body, a
  ScatterElements into a zero table (:func:`normgrad.graphs.rewrites.expand_operator`).
* **OuterProductSum as its Gemm** (not a defect either): a large float32 weight gradient
  (onnxruntime's CPU provider only) becomes the standard Gemm with transA; MatrixTranspose, the
  copy that step graphs written before it hold, becomes the standard Transpose, which the
  runtime folds into its GEMM.
* **SoftmaxGrad as its standard ops** (not a defect either): the gradient of a float32
  Softmax over the last axis (onnxruntime's CPU provider only) becomes Mul, ReduceSum, Sub, Mul.
* **SafeSoftmax and BiasSafeSoftmax as their standard ops** (not a defect either):
  attention's safe softmax (onnxruntime's CPU provider only) becomes the Add of its mask and
  the Softmax, IsNaN, Where torch's exporters wrote.
* **SiLUMul as its standard ops** (not a defect either): Llama's gated unit silu(gate) * up
  (onnxruntime's CPU provider only) becomes the Sigmoid, Mul, Mul torch's exporters wrote.
* **GeluWithSlope as its standard ops** (not a defect either): the erf GELU that also writes
  its derivative (onnxruntime's CPU provider only) becomes the exporter's Div, Erf, Add, Mul,
  Mul and the derivative's standard ops.
* **RotateHalfEmbedding as its standard ops** (not a defect either): the rotary position
  embedding (onnxruntime's CPU provider only) becomes the Split, Neg, Concat, Mul, Mul, Add
  torch's exporters wrote (its gradient of x: the same with the sin the body selects).
* **LSTMBackwardFactors as its standard ops** (not a defect either): an LSTM backward's
  per-step factors (onnxruntime's CPU provider only) become the Sub, Mul, Concat and the
  Slices reversing them in time that the rule wrote before the operator.
* **DepthwiseConv as its standard op** (not a defect either): a depthwise Conv's forward
  (onnxruntime's CPU provider only) becomes the Conv it was.
* **DepthwiseConvGrad as its standard ops** (not a defect either): both gradients of a
  depthwise Conv (onnxruntime's CPU provider only) become the ConvTranspose and the grouped
  Conv with dy as its kernel that the rule wrote before the operator.
* **MaxPoolGrad as its standard ops** (not a defect either): a 2-D MaxPool's input gradient
  (onnxruntime's CPU provider only) becomes the MaxPool's Indices output and the
  ScatterElements the rule wrote before the operator.
* **gradient clipping without If** (costly: the norm is then computed at every step, also
  when clipping is off): tract runs an If only on a constant condition
  (:func:`normgrad.graphs.optimizers.clipping_without_if`).
* **GroupNormalization-21 expanded** into its ONNX function body: OpenVINO translates the
  node but loses its output's rank, fails to compile it, and drags every neighbour onto the
  CPU provider.
* **unused inputs last**: with an input nothing reads before used ones, OpenVINO binds the
  inputs by position (Sub(a, b) computed c - a). Moved behind the others, it shifts none.
  An input read only by a node whose local function body ignores it (BatchNormReduceBackward's
  ``weight``) counts as unused: onnxruntime inlines the body before OpenVINO binds.
* **CastLike of a constant folded**: OpenVINO leaves a CastLike whose input is a Constant
  (what ``add_functions`` feeds a BatchNorm node that omits ``relu_output``, and what the
  masked body compares with) to the CPU provider, and in the ResNet block's inlined
  training graph that split the partition so that 197 of its 336 nodes ran on the CPU
  provider (none with the fold; ``tests/test_openvino.py`` checks the corpus case). Each
  becomes a Constant of the target's type when that type is known. No minimal reproducer
  was found: in small graphs only the Cast itself stays on the CPU provider.
* **Scan bodies that read no outer-scope value** (measured on OpenVINO's own runtime
  2026.4.1: "Number of Scan node inputs is less than required based on body graph
  parameters", e.g. the LSTM training graph's Scans read R from outside): each such value
  becomes a loop-carried state the body passes on unchanged. It costs a copy per step on
  onnxruntime's CPU provider (4% of the LSTM benchmark's step): a costly rewrite, also made
  by ``--inline``.
* **float64 scalars in float32**: OpenVINO's CPU device has no float64, so the step
  graph's float64 scalars (the optimizer hyperparameter inputs and Adam's bias
  corrections, float64 by default as torch's Python floats) ran on the CPU provider and
  split the EP's partition. They become float32 (the hyperparameter inputs too: feed the
  dtype the graph declares, as ``hyperparameter_feeds`` and the Trainer do), and each
  ``1 - b ** t`` becomes ``-expm1(t * log(b))`` with expm1(a) = 2 tanh(a/2) / (1 - tanh(a/2)):
  float32 ``1 - 0.999 ** t`` loses about 5 digits to cancellation in early steps, this
  form none (``tests/test_portable.py`` checks AdamW's trajectory against torch.optim).
  Changes rounding, so only ``--portable`` makes it.
* **no training-mode BatchNormalization**: OpenVINO refuses ``training_mode=1`` at
  compile time without falling back to the CPU provider; the exporter writes the batch
  statistics explicitly, and a graph that still has such a node is refused here.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Sequence, Set, Tuple

import numpy as np
import onnx
import onnx.helper as oh
import onnx.inliner
import onnx.numpy_helper as onh

from normgrad.util.external_data import check_model
from normgrad.graphs.context import attr, describe, reserve_name, value_types
from normgrad.graphs.optimizers import clipping_without_if
from normgrad.graphs.rewrites import dropout_seed
from normgrad.graphs.rewrites.expand import expand_operator
from normgrad.graphs.tidy import read_names
from normgrad.ops import (bias_safe_softmax, bias_softmax_cross_entropy, depthwise_conv, depthwise_conv_grad, embedding_grad,
                          gelu_with_slope, lstm_backward_factors, matrix_transpose, max_pool_grad,
                          outer_product_sum,
                          rotate_half_embedding, safe_softmax, silu_mul, softmax_cross_entropy, softmax_grad)

__all__ = ["make_portable", "as_exported", "scan_bodies_self_contained", "EXPANDED_OPS", "REWRITES", "COSTLY_REWRITES"]

EXPANDED_OPS = ("GroupNormalization",)
"""Default-domain function ops replaced by their ONNX function bodies."""
_EXPAND_DOMAIN = "normgrad.portable.expand"


class _Names:
    """Fresh value names that collide with nothing in the graph."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.used: Set[str] = {i.name for i in graph.input} | {t.name for t in graph.initializer}
        for node in graph.node:
            self.used.update(node.input)
            self.used.update(node.output)
            self.used.add(node.name)

    def __call__(self, hint: str) -> str:
        return reserve_name(self.used, hint)


def weights_as_inputs(graph: onnx.GraphProto) -> Dict[str, np.ndarray]:
    """Drops every initializer that is also a graph input; returns their values."""
    inputs = {i.name for i in graph.input}
    moved = {t.name: onh.to_array(t).copy() for t in graph.initializer if t.name in inputs}
    kept = [t for t in graph.initializer if t.name not in inputs]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return moved


def _refuse_training_batch_norm(graph: onnx.GraphProto) -> None:
    for node in graph.node:
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and attr(node, "training_mode", 0):
            raise ValueError(
                f"{describe(node)}: BatchNormalization with training_mode=1 is not portable (OpenVINO refuses it "
                "at compile time); the exporter writes its batch statistics explicitly, so this graph was not "
                "built by this version of normgrad"
            )


def _unshare_conv_transpose_weights(graph: onnx.GraphProto, names: _Names) -> None:
    """Gives each ConvTranspose its own copy of a constant weight that another node reads too."""
    initializers = {t.name: t for t in graph.initializer}
    constants = {n.output[0]: n for n in graph.node if n.op_type == "Constant"}
    readers: Dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    nodes: List[onnx.NodeProto] = []
    for node in graph.node:
        weight = node.input[1] if node.op_type == "ConvTranspose" and len(node.input) > 1 else None
        if weight is not None and readers.get(weight, 0) > 1 and (weight in initializers or weight in constants):
            copy_name = names(f"{weight}/ConvTranspose_copy")
            if weight in initializers:
                duplicate = copy.deepcopy(initializers[weight])
                duplicate.name = copy_name
                graph.initializer.append(duplicate)
            else:
                duplicate_node = copy.deepcopy(constants[weight])
                duplicate_node.output[0] = copy_name
                duplicate_node.name = names(f"{constants[weight].name or 'Constant'}/copy")
                nodes.append(duplicate_node)
            node.input[1] = copy_name
            readers[weight] -= 1
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def _const(names: _Names, hint: str, value: np.ndarray) -> Tuple[str, onnx.NodeProto]:
    name = names(hint)
    return name, oh.make_node("Constant", [], [name], name=names(f"{hint}/node"), value=onh.from_array(value))


def _onehot_nodes(node: onnx.NodeProto, rank: int, names: _Names) -> List[onnx.NodeProto]:
    """OneHot(indices, depth, values, axis) as Where(Equal(indices, classes), on, off), with
    negative indices counted from depth as OneHot does. No computed value is 0-d: OpenVINO
    left a Reshape of depth to a 0-d value to the CPU provider, and constants it folded then
    crossed the boundary (the "Output names mismatch" defect again)."""
    indices, depth, values = node.input
    out = node.output[0]
    prefix = node.name or out
    axis = attr(node, "axis", -1)
    axis = axis + rank + 1 if axis < 0 else axis
    shape = [1] * (rank + 1)
    shape[axis] = -1
    constants = {
        "zero": np.array([0], np.int64),
        "one": np.array([1], np.int64),
        "classes_shape": np.array(shape, np.int64),
        "axis": np.array([axis], np.int64),
        "cumsum_axis": np.array(0, np.int64),  # an input, so 0-d is fine
    }
    names_of = {}
    nodes = []
    for hint, value in constants.items():
        names_of[hint], constant = _const(names, f"{prefix}/{hint}", value)
        nodes.append(constant)
    zero, one = names_of["zero"], names_of["one"]
    v = {h: names(f"{prefix}/{h}") for h in ("depth64", "depth", "ones", "counts", "range", "classes", "indices64",
                                              "negative", "wrapped", "indices", "unsqueezed", "hits", "off", "on")}
    make = lambda op, inputs, output, **kw: oh.make_node(op, inputs, [v[output]], name=names(f"{prefix}/{op}"), **kw)  # noqa: E731
    return nodes + [
        make("Cast", [depth], "depth64", to=onnx.TensorProto.INT64),
        make("Reshape", [v["depth64"], one], "depth"),
        make("ConstantOfShape", [v["depth"]], "ones", value=onh.from_array(np.array([1], np.int64))),
        make("CumSum", [v["ones"], names_of["cumsum_axis"]], "counts"),
        make("Sub", [v["counts"], one], "range"),
        make("Reshape", [v["range"], names_of["classes_shape"]], "classes"),
        make("Cast", [indices], "indices64", to=onnx.TensorProto.INT64),
        make("Less", [v["indices64"], zero], "negative"),
        make("Add", [v["indices64"], v["depth"]], "wrapped"),
        make("Where", [v["negative"], v["wrapped"], v["indices64"]], "indices"),
        make("Unsqueeze", [v["indices"], names_of["axis"]], "unsqueezed"),
        make("Equal", [v["unsqueezed"], v["classes"]], "hits"),
        make("Gather", [values, zero], "off"),
        make("Gather", [values, one], "on"),
        oh.make_node("Where", [v["hits"], v["on"], v["off"]], [out], name=names(f"{prefix}/Where")),
    ]


def _onehot_as_equal(model: onnx.ModelProto, names: _Names) -> None:
    graph = model.graph
    if not any(n.op_type == "OneHot" for n in graph.node):
        return
    types = value_types(model)
    nodes: List[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != "OneHot" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        rank = _rank(types, node.input[0])
        if rank is None:
            raise ValueError(f"{describe(node)}: the rank of its indices is unknown, so it cannot be made portable")
        nodes.extend(_onehot_nodes(node, rank, names))
    del graph.node[:]
    graph.node.extend(nodes)


def _size_as_shape_product(graph: onnx.GraphProto, names: _Names) -> None:
    """Size(v) as ReduceProd(Shape(v)): OpenVINO does not take Size, and one left to the CPU
    provider between two OpenVINO parts makes the partition cyclic."""
    nodes: List[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type == "Size" and node.domain in ("", "ai.onnx"):
            prefix = node.name or node.output[0]
            shape = names(f"{prefix}/shape")
            nodes.append(oh.make_node("Shape", [node.input[0]], [shape], name=names(f"{prefix}/Shape")))
            nodes.append(oh.make_node("ReduceProd", [shape], [node.output[0]], name=names(f"{prefix}/ReduceProd"),
                                      keepdims=0))
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def _layer_norm_statistics_beside(model: onnx.ModelProto, names: _Names) -> None:
    """A LayerNormalization whose Mean or InvStdDev output is read (the gradient reads both)
    keeps its Y output only; the two are computed beside it, as the node defines them:
    mean = ReduceMean(x) and 1 / sqrt(ReduceMean((x - mean)^2) + epsilon) over the axes from
    ``axis``, in the ``stash_type`` (float32 by default). OpenVINO takes one output only
    ("LayerNormalization expects 1 output tensor")."""
    graph = model.graph
    targets = [n for n in graph.node if n.op_type == "LayerNormalization" and n.domain in ("", "ai.onnx")
               and any(name for name in n.output[1:])]
    if not targets:
        return
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    types = value_types(model)
    nodes: List[onnx.NodeProto] = []
    for node in graph.node:
        nodes.append(node)
        if not any(node is target for target in targets):
            continue
        x = node.input[0]
        rank = _rank(types, x)
        if rank is None:
            raise ValueError(f"{describe(node)}: the rank of '{x}' is unknown; its statistics cannot be computed beside it")
        prefix = node.name or node.output[0]
        axes = list(range(attr(node, "axis", -1) % rank, rank))
        stash = attr(node, "stash_type", onnx.TensorProto.FLOAT)
        x_type = types[x].tensor_type.elem_type

        def op(op_type, *inputs, output=None, **attrs):
            out = output or names(f"{prefix}/{op_type.lower()}")
            nodes.append(oh.make_node(op_type, list(inputs), [out], name=names(f"{prefix}/{op_type}"), **attrs))
            return out

        def mean_over_axes(value, output=None):
            if opset >= 18:
                axes_value, constant = _const(names, f"{prefix}/axes", np.asarray(axes, np.int64))
                nodes.append(constant)
                return op("ReduceMean", value, axes_value, output=output, keepdims=1)
            return op("ReduceMean", value, output=output, axes=axes, keepdims=1)

        wanted = list(node.output[1:3]) + [""] * (3 - len(node.output))
        values = x if x_type == stash else op("Cast", x, to=stash)
        mean = mean_over_axes(values, output=wanted[0] or None)
        centered = op("Sub", values, mean)
        variance = mean_over_axes(op("Mul", centered, centered))
        epsilon, constant = _const(names, f"{prefix}/epsilon",
                                   np.asarray(attr(node, "epsilon", 1e-5), oh.tensor_dtype_to_np_dtype(stash)))
        nodes.append(constant)
        op("Reciprocal", op("Sqrt", op("Add", variance, epsilon)), output=wanted[1] or None)
        del node.output[1:]
    del graph.node[:]
    graph.node.extend(nodes)


def _dropout_seeded(model: onnx.ModelProto, names: _Names) -> onnx.ModelProto:
    """Training-mode Dropout of a training graph as the step graph writes it: a mask drawn by
    standard integer ops from two new scalar inputs, ``dropout_seed`` (int64) and ``step``
    (float, the step graph's 1-based optimizer step; :func:`normgrad.graphs.rewrites.seed_dropout`),
    which the gradient reads as it read the node's mask. OpenVINO refuses training-mode
    Dropout ("Training mode is not supported for Dropout op"). A step graph is built from the
    training graph before this rewrite (``build_step_graph(training, ..., portable=True)``;
    ``normgrad export --portable --optimizer`` does so): it draws its own masks. Each draw's
    DropoutMask node (the step graph's too) is written as its function body, the standard
    ops (:func:`normgrad.graphs.rewrites.expand_dropout_masks`)."""
    import json

    graph = model.graph
    if not dropout_seed.training_dropouts(graph):
        return dropout_seed.expand_dropout_masks(model)
    if "step" in names.used:
        raise ValueError("the graph already has a value named 'step', the input a seeded Dropout mask needs")
    names("step")
    outputs = dropout_seed.seed_dropout(graph, "step", 0)
    graph.input.insert(len(graph.input) - 1, oh.make_tensor_value_info("step", onnx.TensorProto.FLOAT, []))
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    kept = [n for n in graph.node if n.op_type != "Constant" or n.output[0] in read]  # the ratio/mode constants
    del graph.node[:]
    graph.node.extend(kept)
    meta = {entry.key: entry for entry in model.metadata_props}
    value = json.dumps({"seed": 0, "outputs": outputs})
    if dropout_seed.METADATA_DROPOUT in meta:
        meta[dropout_seed.METADATA_DROPOUT].value = value
    else:
        model.metadata_props.append(onnx.StringStringEntryProto(key=dropout_seed.METADATA_DROPOUT, value=value))
    return dropout_seed.expand_dropout_masks(model)


def _is_float64_scalar(types: Dict[str, onnx.TypeProto], name: str) -> bool:
    info = types.get(name)
    return (info is not None and info.tensor_type.elem_type == onnx.TensorProto.DOUBLE
            and _rank(types, name) == 0)


def _float64_scalars_in_float32(model: onnx.ModelProto, names: _Names) -> None:
    """Every 0-d float64 graph input, initializer, Constant and Cast becomes float32 (the values computed
    from them follow), and ``Sub(1, Pow(b, t))`` on them becomes ``-expm1(t * log(b))``,
    exact to a few float32 roundings where the subtraction would cancel."""
    graph = model.graph
    types = value_types(model)
    scalars = {name for name in types if _is_float64_scalar(types, name)}
    if not scalars:
        return
    for value in graph.input:
        if value.name in scalars:
            value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    ones = set()
    for index, tensor in enumerate(graph.initializer):
        if tensor.name in scalars:
            value = onh.to_array(tensor).astype(np.float32)
            graph.initializer[index].CopyFrom(onh.from_array(value, tensor.name))
            if value == 1:
                ones.add(tensor.name)
    producers = {}
    for node in graph.node:
        if node.domain not in ("", "ai.onnx") or not node.output or node.output[0] not in scalars:
            continue
        producers[node.output[0]] = node
        if node.op_type == "Constant":
            value = onh.to_array(node.attribute[0].t).astype(np.float32)
            node.attribute[0].t.CopyFrom(onh.from_array(value, node.attribute[0].t.name))
            if value == 1:
                ones.add(node.output[0])
        elif node.op_type == "Cast":
            node.attribute[0].i = onnx.TensorProto.FLOAT
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    nodes: List[onnx.NodeProto] = []
    for node in graph.node:
        power = producers.get(node.input[1]) if node.op_type == "Sub" and len(node.input) == 2 else None
        if node.output[0] not in scalars or node.input[0] not in ones or power is None or power.op_type != "Pow":
            nodes.append(node)
            continue
        prefix = node.name or node.output[0]

        def op(op_type, *inputs, output=None):
            out = output or names(f"{prefix}/{op_type.lower()}")
            nodes.append(oh.make_node(op_type, list(inputs), [out], name=names(f"{prefix}/{op_type}")))
            return out

        base, exponent = power.input
        constants = {hint: _const(names, f"{prefix}/{hint}", value) for hint, value in (
            ("ones", np.ones([1], np.float32)), ("half", np.array(0.5, np.float32)),
            ("minus_two", np.array(-2.0, np.float32)), ("axes", np.array([0], np.int64)))}
        nodes += [constant for _, constant in constants.values()]
        one_1d, half, minus_two, axes = (constants[hint][0] for hint in ("ones", "half", "minus_two", "axes"))
        # in [1]: the EP leaves a 0-d Log or Tanh to the CPU provider
        tanh = op("Tanh", op("Mul", op("Mul", exponent, op("Log", op("Mul", base, one_1d))), half))
        expm1 = op("Div", op("Mul", tanh, minus_two), op("Sub", node.input[0], tanh))
        if opset >= 13:
            op("Squeeze", expm1, axes, output=node.output[0])
        else:
            nodes.append(oh.make_node("Squeeze", [expm1], [node.output[0]], name=names(f"{prefix}/Squeeze"), axes=[0]))
    del graph.node[:]
    graph.node.extend(nodes)
    live = read_names(graph) | {o.name for o in graph.output}
    kept = [n for n in graph.node if n.op_type != "Pow" or any(o in live for o in n.output)]
    del graph.node[:]
    graph.node.extend(kept)


def _rank(types: Dict[str, onnx.TypeProto], name: str):
    info = types.get(name)
    if info is None or not info.tensor_type.HasField("shape"):
        return None
    return len(info.tensor_type.shape.dim)


def _expand_function_ops(model: onnx.ModelProto, names: _Names) -> onnx.ModelProto:
    """Replaces every default-domain node of :data:`EXPANDED_OPS` by the ONNX function body
    its schema builds for its attributes and input types."""
    graph = model.graph
    targets = [n for n in graph.node if n.op_type in EXPANDED_OPS and n.domain in ("", "ai.onnx")]
    if not targets:
        return model
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    types = value_types(model)
    functions = []
    for node in targets:
        schema = onnx.defs.get_schema(node.op_type, opset)
        input_types = [types[name].SerializeToString() if name else onnx.TypeProto().SerializeToString() for name in node.input]
        if schema.has_context_dependent_function:
            body = schema.get_context_dependent_function_with_opset_version(
                schema.since_version, node.SerializeToString(), input_types
            )
        else:
            body = schema.get_function_with_opset_version(schema.since_version)
        function = onnx.FunctionProto()
        function.ParseFromString(body if isinstance(body, bytes) else body.SerializeToString())
        function.domain = _EXPAND_DOMAIN
        function.name = names(f"{node.op_type}_{node.name or node.output[0]}")
        del function.attribute[:]  # attributes were bound when the body was built
        del function.attribute_proto[:]
        node.domain, node.op_type = _EXPAND_DOMAIN, function.name
        del node.attribute[:]
        functions.append(function)
    model.functions.extend(functions)
    model.opset_import.append(oh.make_opsetid(_EXPAND_DOMAIN, 1))
    model = onnx.inliner.inline_selected_functions(model, [(_EXPAND_DOMAIN, f.name) for f in functions])
    kept_functions = [f for f in model.functions if f.domain != _EXPAND_DOMAIN]
    del model.functions[:]
    model.functions.extend(kept_functions)
    kept_opsets = [o for o in model.opset_import if o.domain != _EXPAND_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept_opsets)
    return model


def _fold_constant_casts(model: onnx.ModelProto) -> None:
    """Replaces CastLike(Constant, target) by a Constant of the target's element type, where
    the target is a folded constant or shape inference knows its type; a source Constant
    nothing reads any more goes (onnxruntime would warn that its initializer is unused)."""
    graph = model.graph
    constants: Dict[str, np.ndarray] = {}
    sources: Set[str] = set()
    types = None
    for index, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            constants[node.output[0]] = onh.to_array(node.attribute[0].t)
        elif node.op_type == "CastLike" and node.input[0] in constants:
            target = node.input[1]
            if target in constants:
                dtype = constants[target].dtype
            else:
                types = value_types(model) if types is None else types
                elem = types[target].tensor_type.elem_type if target in types else 0
                if not elem:
                    continue
                dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
            value = constants[node.input[0]].astype(dtype)
            sources.add(node.input[0])
            graph.node[index].CopyFrom(oh.make_node("Constant", [], [node.output[0]], name=node.name,
                                                    value=onh.from_array(value)))
            constants[node.output[0]] = value
    unread = sources - read_names(graph) - {o.name for o in graph.output}
    if unread:
        kept = [n for n in graph.node if not (n.op_type == "Constant" and n.output[0] in unread)]
        del graph.node[:]
        graph.node.extend(kept)


def _read_names(nodes, functions: Dict[Tuple[str, str], onnx.FunctionProto]) -> Set[str]:
    """Every value the nodes (and their subgraphs, recursively) read. A node of a local
    function reads only the inputs its body reads: onnxruntime inlines the body before
    OpenVINO sees the graph."""
    read: Set[str] = set()
    for node in nodes:
        body = functions.get((node.domain, node.op_type))
        if body is None:
            read.update(node.input)
        else:
            used = _read_names(body.node, functions) | set(body.output)
            read.update(actual for actual, formal in zip(node.input, body.input) if formal in used)
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                read |= _read_names(sub.node, functions)
                read |= {o.name for o in sub.output}
    return read


def _unused_inputs_last(model: onnx.ModelProto) -> None:
    """Moves the inputs nothing reads behind the others (names, and so feeds, unchanged)."""
    graph = model.graph
    functions = {(f.domain, f.name): f for f in model.functions}
    read = _read_names(graph.node, functions) | {o.name for o in graph.output}
    ordered = [i for i in graph.input if i.name in read] + [i for i in graph.input if i.name not in read]
    del graph.input[:]
    graph.input.extend(ordered)


REWRITES = ("cross_entropy_expanded", "group_normalization_expanded", "layer_norm_statistics_beside", "dropout_seeded",
            "embedding_grad_expanded", "matrix_transpose_expanded", "outer_product_sum_expanded", "softmax_grad_expanded",
            "safe_softmax_expanded", "silu_mul_expanded", "gelu_with_slope_expanded", "rotate_half_embedding_expanded",
            "lstm_backward_factors_expanded", "depthwise_conv_expanded", "depthwise_conv_grad_expanded",
            "max_pool_grad_expanded", "onehot_as_equal",
            "size_as_shape_product",
            "conv_transpose_own_weight", "constant_casts_folded", "scan_bodies_self_contained",
            "float64_scalars_in_float32", "clipping_without_if", "unused_inputs_last")
"""The rewrites :func:`make_portable` applies after moving the weights, by name (``skip``)."""
COSTLY_REWRITES = ("cross_entropy_expanded", "onehot_as_equal", "layer_norm_statistics_beside", "dropout_seeded",
                   "embedding_grad_expanded", "matrix_transpose_expanded", "outer_product_sum_expanded",
                   "softmax_grad_expanded",
                   "safe_softmax_expanded", "silu_mul_expanded", "gelu_with_slope_expanded",
                   "rotate_half_embedding_expanded", "lstm_backward_factors_expanded", "depthwise_conv_expanded",
                   "depthwise_conv_grad_expanded", "max_pool_grad_expanded", "scan_bodies_self_contained",
                   "float64_scalars_in_float32", "clipping_without_if")
"""The rewrites that cost measurable time on onnxruntime's CPU provider
(``python -m normgrad.tools.bench_portable``), or change the rounding (float64 scalars in
float32): only ``normgrad export --portable`` makes them."""

_EXPANDED_OPERATORS = (("embedding_grad_expanded", (embedding_grad,)), ("matrix_transpose_expanded", (matrix_transpose,)),
                       ("outer_product_sum_expanded", (outer_product_sum,)),
                       ("softmax_grad_expanded", (softmax_grad,)),
                       ("safe_softmax_expanded", (bias_safe_softmax, safe_softmax)), ("silu_mul_expanded", (silu_mul,)),
                       ("gelu_with_slope_expanded", (gelu_with_slope,)),
                       ("rotate_half_embedding_expanded", (rotate_half_embedding,)),
                       ("lstm_backward_factors_expanded", (lstm_backward_factors,)),
                       ("depthwise_conv_expanded", (depthwise_conv,)),
                       ("depthwise_conv_grad_expanded", (depthwise_conv_grad,)),
                       ("max_pool_grad_expanded", (max_pool_grad,)))
"""The rewrites of :func:`make_portable` that write normgrad operators as their function
bodies, in this order, with the operators' modules (each rewrite's in turn)."""


def scan_bodies_self_contained(model: onnx.ModelProto) -> None:
    """Makes each outer-scope value a main-graph Scan's body reads directly a loop-carried
    state that the body passes on (Identity) and the Scan's final value of which nobody reads."""
    types = None
    for node in model.graph.node:
        if node.op_type != "Scan" or node.domain not in ("", "ai.onnx"):
            continue
        body = next(a.g for a in node.attribute if a.name == "body")
        produced = {i.name for i in body.input} | {t.name for t in body.initializer} | {
            o for n in body.node for o in n.output}
        outer = sorted({i for n in body.node for i in n.input if i and i not in produced})
        if not outer:
            continue
        types = types or value_types(model)
        names = _Names(model.graph)
        names.used.update(produced | {n.name for n in body.node})
        inner = {name: names(f"{node.name or 'scan'}/carried") for name in outer}
        for body_node in body.node:
            body_node.input[:] = [inner.get(i, i) for i in body_node.input]
        passed = [names(f"{node.name or 'scan'}/carried_out") for _ in outer]
        body.node.extend(oh.make_node("Identity", [inner[name]], [out], name=f"{out}/Identity")
                         for name, out in zip(outer, passed))
        carried_types = [types.get(name, onnx.TypeProto()) for name in outer]
        body_inputs, body_outputs = list(body.input), list(body.output)
        del body.input[:], body.output[:]
        body.input.extend([oh.make_value_info(inner[name], t) for name, t in zip(outer, carried_types)] + body_inputs)
        body.output.extend([oh.make_value_info(out, t) for out, t in zip(passed, carried_types)] + body_outputs)
        node.input[:] = outer + list(node.input)
        node.output[:] = [names(f"{node.name or 'scan'}/carried_final") for _ in outer] + list(node.output)


def _expanded(model: onnx.ModelProto, module) -> onnx.ModelProto:
    """``model`` with every node of the normgrad operator of ``module`` written as its function body."""
    return expand_operator(model, module)


def make_portable(model: onnx.ModelProto, skip: Sequence[str] = (), in_place: bool = False
                  ) -> Tuple[onnx.ModelProto, Dict[str, np.ndarray]]:
    """A copy of a training or step graph that every execution provider runs correctly (see
    the module docstring for each rewrite), and the values of the initializers it turned
    into pure inputs (the trainable weights of a training graph; none for a step graph).

    The inputs keep their names, so the same feeds work; inputs nothing reads (``step`` of
    plain SGD) move behind the others.

    ``skip``: names from :data:`REWRITES` not to apply (weights always become inputs).
    ``in_place``: rewrite ``model`` itself instead of a copy (a caller that drops it saves a
    copy of the graph, gigabytes for 10^6 nodes).

    Raises:
        ValueError: a BatchNormalization in training mode is left, or a OneHot whose indices
            have an unknown rank, or an unknown name in ``skip``.
    """
    unknown = sorted(set(skip) - set(REWRITES))
    if unknown:
        raise ValueError(f"unknown portable rewrites {unknown}; known: {list(REWRITES)}")
    if not in_place:
        model = copy.deepcopy(model)
    _refuse_training_batch_norm(model.graph)
    moved = weights_as_inputs(model.graph)
    if "cross_entropy_expanded" not in skip:
        model = _expanded(_expanded(model, bias_softmax_cross_entropy), softmax_cross_entropy)
    if "group_normalization_expanded" not in skip:
        model = _expand_function_ops(model, _Names(model.graph))
    names = _Names(model.graph)
    if "layer_norm_statistics_beside" not in skip:
        _layer_norm_statistics_beside(model, names)
    if "dropout_seeded" not in skip:
        model = _dropout_seeded(model, names)
    for rewrite, modules in _EXPANDED_OPERATORS:
        if rewrite not in skip:
            for module in modules:
                model = _expanded(model, module)
    if "onehot_as_equal" not in skip:
        _onehot_as_equal(model, names)
    if "size_as_shape_product" not in skip:
        _size_as_shape_product(model.graph, names)
    if "conv_transpose_own_weight" not in skip:
        _unshare_conv_transpose_weights(model.graph, names)
    if "constant_casts_folded" not in skip:
        _fold_constant_casts(model)
    if "scan_bodies_self_contained" not in skip:
        scan_bodies_self_contained(model)
    if "float64_scalars_in_float32" not in skip:
        _float64_scalars_in_float32(model, names)
    if "clipping_without_if" not in skip:
        clipping_without_if(model)
    if "unused_inputs_last" not in skip:
        _unused_inputs_last(model)
    check_model(model)
    return model, moved


def as_exported(model: onnx.ModelProto, in_place: bool = False) -> Tuple[onnx.ModelProto, Dict[str, np.ndarray]]:
    """What ``normgrad export`` writes by default for a training or step graph: weights as
    pure inputs and every portable rewrite but :data:`COSTLY_REWRITES`; returns the graph and
    the moved weights' values (for :func:`normgrad.checkpoint.save`)."""
    return make_portable(model, skip=COSTLY_REWRITES, in_place=in_place)
