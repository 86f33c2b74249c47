"""Forward-graph rewrites applied before differentiation, where the version converter alone
would produce a wrong or rejected model.

* BatchNormalization before opset 14 chose training mode by its number of outputs; the
  converter neither accepts the saved mean/var outputs nor sets ``training_mode``. Its
  per-activation form (``spatial=0``, opsets 7-8) and opset < 7's ``is_test=0`` have no
  opset-9+ equivalent and are refused.
* GroupNormalization-18 (scale and bias per group) is deprecated, so ``onnx.checker``
  rejects it, and the converter turns it into GroupNormalization-21 (per channel) without
  expanding scale and bias. We expand them in the graph (Reshape/Expand, which the
  gradient flows back through) and convert to opset 21.
* Upsample (opsets 7-9) and Resize-10 become Resize-11+ without the coordinate mode they
  had: the converter leaves the new default half_pixel, which changes what linear
  computes. We set onnxruntime's semantics: asymmetric coordinates, and for nearest
  floor (upsampling; Upsample allows no other) or ceil (a Resize-10 that downsamples).
* Sequence values (SplitToSequence, SequenceConstruct read by SequenceAt and
  ConcatFromSequence), through which a gradient cannot flow, become tensor ops:
  :mod:`normgrad.graphs.sequences`.
* The converter keeps Pad-2's ``value`` attribute on reflect/edge Pads, which Pad-11 rejects;
  it means nothing there and is dropped.
* LSTM, GRU and RNN with ``layout=1`` (batch first), which onnxruntime's CPU kernels refuse,
  become ``layout=0`` nodes between Transposes of X, the initial states and the outputs
  (:func:`recurrent_layout_0`); the gradient rules then see time-major nodes only.
* The Loop torch's TorchScript exporter writes for ``nn.EmbeddingBag`` (sum or mean) becomes
  Gather + MatMul by a bag-membership matrix (:func:`embedding_bags`).
* Integer arithmetic on constants only (shape computations) is folded into Constants, so
  that onnx shape inference sees through it (:func:`fold_integer_constants`).
* bfloat16 arithmetic, which onnxruntime's CPU provider has no kernels for, is computed in
  float32 from bfloat16 weights that stay stored as bfloat16 (:func:`bfloat16_in_float32`).
* ``MatMul(x, Transpose(W))`` (torch's exporters' ``x @ W.T``) becomes a Gemm with
  ``transB=1`` that reads W in place, forward and backward (:func:`transposed_weight_products`).
* Slices of one value along one axis that together cover it exactly, each element once
  (``rotate_half``'s ``x[..., :d/2]`` and ``x[..., d/2:]``), become one Split: its gradient
  is a Concat, where the Slices' is a zero Pad each and a Sum (:func:`tiling_slices_as_split`).
* The dynamo exporter's erf GELU, ``x * ((erf(x / sqrt 2) + 1) * 0.5)``, is written in
  TorchScript's order, ``(x * (erf(x / sqrt 2) + 1)) * 0.5``, which onnxruntime fuses into
  one Gelu kernel (:func:`gelu_erf_fusable_order`; the same bits: a product by 0.5 is exact,
  below |x| = 2^127, where x (erf + 1) overflows).
* torch's safe softmax, ``Where(IsNaN(Softmax(x)), 0, Softmax(x))`` over the last axis of a
  float32 x (scaled-dot-product attention's), becomes one ``normgrad:SafeSoftmax``: one pass
  per row instead of three, its gradient 0 on fully masked rows as torch's
  (:func:`safe_softmaxes`).
* Llama's gated unit ``Mul(Mul(gate, Sigmoid(gate)), up)`` of float32 gate and up of one static
  shape becomes one ``normgrad:SiLUMul``: one pass instead of two (onnxruntime's QuickGelu,
  then the Mul), no silu(gate) written in between; its gradient SwiGLUGrad
  (:func:`silu_products`).
* The erf GELU of a float32 x (the exporters' Div, Erf, Add, Mul, Mul chain, or Gelu-20 with
  approximate="none") becomes one ``normgrad:GeluWithSlope`` writing y and its derivative in
  one pass: the gradient is then ``Mul(dy, slope)`` instead of GeluGrad's erf and exp over
  again (:func:`gelu_erf_slopes`).
* The rotary position embedding of Llama and its relatives, ``x * cos + Concat(-x2, x1) * sin``
  (x1, x2 the halves of x's last axis, a Split after :func:`tiling_slices_as_split`), becomes
  one ``normgrad:RotateHalfEmbedding``: one pass instead of six, the same bits
  (:func:`rotate_half_embeddings`).
"""

from __future__ import annotations

import collections
import copy

from typing import Dict, Set

import numpy as np
import onnx
import onnx.helper as oh
import onnx.inliner
import onnx.numpy_helper as onh
import onnx.version_converter

from normgrad.graphs.context import FLOAT_ELEM_TYPES as _FLOAT_TYPES
from normgrad.graphs.context import GradientContext, attr, constant_node_value, describe, reserve_name
from normgrad.graphs.patterns import GraphView, _declarative, gelu_erf_chain
from normgrad.graphs.patterns.silu import match_gated_silu
from normgrad.graphs.portable import value_types
from normgrad.graphs.rules import UnsupportedOperatorError
from normgrad.ops import (DOMAIN, _common, bias_safe_softmax, dropout_mask, gelu_with_slope, rotate_half_embedding,
                          safe_softmax, silu_mul)

__all__ = ["GROUP_NORM_PER_CHANNEL_OPSET", "convert_opset", "fold_integer_constants", "seed_dropout",
           "expand_dropout_masks", "expand_operator", "DROPOUT_SEED_INPUT", "DROPOUT_MICRO_BATCH_INPUT", "METADATA_DROPOUT",
           "recurrent_layout_0", "embedding_bags",
           "bfloat16_in_float32", "bfloat16_values", "transposed_weight_products", "cast_stored_weights_per_reader",
           "safe_softmaxes", "silu_products", "gelu_erf_slopes", "rotate_half_embeddings"]

GROUP_NORM_PER_CHANNEL_OPSET = 21


def _unique(graph: onnx.GraphProto, hint: str) -> str:
    names = {n for node in graph.node for n in list(node.input) + list(node.output)}
    names |= {i.name for i in graph.input} | {t.name for t in graph.initializer}
    k = 0
    while f"{hint}_{k}" in names:
        k += 1
    return f"{hint}_{k}"


def _batch_norm_training_outputs(graph: onnx.GraphProto) -> Set[str]:
    """Y of every pre-14 BatchNormalization in training mode; drops unread saved mean/var.

    Raises:
        UnsupportedOperatorError: a BatchNormalization with ``spatial=0`` or ``is_test=0``.
    """
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    training = set()
    for node in graph.node:
        if node.op_type != "BatchNormalization":
            continue
        for name, meaning in (("spatial", "per-activation statistics"), ("is_test", "training mode, opset < 7")):
            if attr(node, name, None) == 0:
                raise UnsupportedOperatorError(
                    f"{describe(node)}: BatchNormalization with {name}=0 ({meaning}) is not supported; "
                    "re-export the model with opset 9 or newer"
                )
        if len([o for o in node.output if o]) <= 1:
            continue
        if len(node.output) > 3:
            if any(name in used for name in node.output[3:]):
                raise ValueError(f"{describe(node)}: its saved mean/variance outputs are used; opset 14+ has no equivalent")
            del node.output[3:]
        training.add(node.output[0])
    return training


def _per_channel(graph: onnx.GraphProto, nodes: list, node: onnx.NodeProto, index: int, groups: int) -> str:
    """Emits nodes expanding GroupNormalization-18 input ``index`` ([G]) to [C]."""
    tag = _unique(graph, f"{node.name or 'GroupNormalization'}/per_channel_{index}")

    def const(values) -> str:
        name = f"{tag}/c{len(nodes)}"
        nodes.append(oh.make_node("Constant", [], [name], value=onh.from_array(np.asarray(values, np.int64))))
        return name

    def emit(op_type: str, *inputs: str, **attrs) -> str:
        name = f"{tag}/{op_type.lower()}{len(nodes)}"
        nodes.append(oh.make_node(op_type, list(inputs), [name], **attrs))
        return name

    channels = emit("Shape", node.input[0], start=1, end=2)
    per_group = emit("Div", channels, const([groups]))
    column = emit("Reshape", node.input[index], const([groups, 1]))
    expanded = emit("Expand", column, emit("Concat", const([groups]), per_group, axis=0))
    return emit("Reshape", expanded, const([-1]))


def _expand_group_norm_18(graph: onnx.GraphProto) -> None:
    nodes = []
    for node in graph.node:
        if node.op_type == "GroupNormalization":
            groups = next(oh.get_attribute_value(a) for a in node.attribute if a.name == "num_groups")
            scale = _per_channel(graph, nodes, node, 1, groups)
            bias = _per_channel(graph, nodes, node, 2, groups)
            node.input[1], node.input[2] = scale, bias
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def _constant_values(graph: onnx.GraphProto, name: str):
    for init in graph.initializer:
        if init.name == name:
            return onh.to_array(init)
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == name and node.attribute:
            return constant_node_value(node)
    return None


def _legacy_resize_modes(graph: onnx.GraphProto, opset: int) -> dict:
    """{output of each Upsample / pre-11 Resize: the nearest_mode onnxruntime gives it};
    drops Pad-2's meaningless ``value`` of non-constant modes.

    Raises:
        UnsupportedOperatorError: a nearest Resize-10 whose scales are not constant or both
            up- and downsample (onnxruntime rounds each way differently; Resize-11 cannot).
    """
    modes = {}
    for node in graph.node:
        if node.op_type == "Pad" and attr(node, "mode", "constant") != "constant":
            for attribute in [a for a in node.attribute if a.name == "value"]:
                node.attribute.remove(attribute)
        if node.op_type == "Upsample" or (node.op_type == "Resize" and opset < 11):
            rounding = "floor"
            if node.op_type == "Resize" and attr(node, "mode", "nearest") == "nearest":
                scales = _constant_values(graph, node.input[1])
                if scales is None or (np.any(scales < 1) and np.any(scales > 1)):
                    raise UnsupportedOperatorError(
                        f"{describe(node)}: an opset-10 nearest Resize needs constant scales that all up- or all "
                        "downsample (onnxruntime rounds each way differently); re-export with opset 11 or newer"
                    )
                rounding = "ceil" if np.any(scales < 1) else "floor"
            modes[node.output[0]] = rounding
    return modes


def convert_opset(model: onnx.ModelProto, opset: int, needed: int) -> onnx.ModelProto:
    """``model`` (default-domain ``opset``) converted to at least opset ``needed``.

    Returns ``model`` itself when nothing needs converting.

    Raises:
        ValueError: the version converter fails.
        UnsupportedOperatorError: a BatchNormalization variant without an opset-9+ equivalent.
    """
    graph = model.graph
    if 18 <= opset < GROUP_NORM_PER_CHANNEL_OPSET and any(n.op_type == "GroupNormalization" for n in graph.node):
        _expand_group_norm_18(graph)
        needed = max(needed, GROUP_NORM_PER_CHANNEL_OPSET)
    if opset >= needed:
        return model
    training = _batch_norm_training_outputs(graph) if opset < 14 else set()
    resize_modes = _legacy_resize_modes(graph, opset) if opset < 11 else {}
    try:
        converted = onnx.version_converter.convert_version(model, needed)
    except Exception as error:  # the converter raises bare RuntimeErrors
        raise ValueError(f"cannot convert the model from opset {opset} to {needed}: {error}") from error
    for node in converted.graph.node:
        if node.op_type == "BatchNormalization" and node.output[0] in training:
            for attr in list(node.attribute):
                if attr.name == "training_mode":
                    node.attribute.remove(attr)
            node.attribute.append(oh.make_attribute("training_mode", 1))
        if node.op_type == "Resize" and node.output[0] in resize_modes:
            for attr_ in [a for a in node.attribute if a.name in ("coordinate_transformation_mode", "nearest_mode")]:
                node.attribute.remove(attr_)
            node.attribute.extend([
                oh.make_attribute("coordinate_transformation_mode", "asymmetric"),
                oh.make_attribute("nearest_mode", resize_modes[node.output[0]]),
            ])
    return converted


_RECURRENT_STATE_INPUTS = {"LSTM": (5, 6), "GRU": (5,), "RNN": (5,)}


def recurrent_layout_0(model: onnx.ModelProto) -> None:
    """Rewrites, in place, each LSTM/GRU/RNN with ``layout=1`` (X [B, T, I], states
    [B, D, H], Y [B, T, D, H]) as a ``layout=0`` node with its X and initial states
    transposed in and its outputs transposed out (names unchanged)."""
    graph = model.graph
    if not any(n.op_type in _RECURRENT_STATE_INPUTS and attr(n, "layout", 0) == 1 for n in graph.node):
        return
    kept = []
    for node in graph.node:
        if node.op_type not in _RECURRENT_STATE_INPUTS or attr(node, "layout", 0) != 1:
            kept.append(node)
            continue
        tag = _unique(graph, f"{node.name or node.op_type}/time_major")
        for index in (0,) + _RECURRENT_STATE_INPUTS[node.op_type]:
            if len(node.input) > index and node.input[index]:
                moved = f"{tag}_in{index}"
                kept.append(oh.make_node("Transpose", [node.input[index]], [moved], perm=[1, 0, 2]))
                node.input[index] = moved
        after = []
        for index, perm in enumerate(([2, 0, 1, 3], [1, 0, 2], [1, 0, 2])):
            if len(node.output) > index and node.output[index]:
                moved = f"{tag}_out{index}"
                after.append(oh.make_node("Transpose", [moved], [node.output[index]], perm=perm))
                node.output[index] = moved
        for attribute in node.attribute:
            if attribute.name == "layout":
                attribute.i = 0
        kept.append(node)
        kept.extend(after)
    del graph.node[:]
    graph.node.extend(kept)


_FOLDED_ELEMENTS = 4096
"""Integer constants folded larger than this stay computed (shape arithmetic is far smaller)."""


def fold_integer_constants(model: onnx.ModelProto) -> None:
    """Replaces, in place, each default-domain node whose inputs are all integer or bool
    constants (Constant nodes, initializers) and whose outputs are too by Constant nodes of
    its values (onnx's reference evaluator computes them).

    Shape arithmetic exporters write (TorchScript's nn.MultiheadAttention computes its q/k/v
    reshape target with Mod, Slice and Concat) then has constant operands, which onnx shape
    inference follows; float values, where gradients flow, are never folded."""
    import onnx.reference

    graph = model.graph
    integer = lambda value: value.dtype.kind in "iub"  # noqa: E731
    constants = {t.name: onh.to_array(t) for t in graph.initializer if t.data_type not in _FLOAT_TYPES}
    constants = {name: value for name, value in constants.items() if integer(value)}
    opsets = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    nodes = []
    for node in graph.node:
        inputs = [name for name in node.input if name]
        foldable = (
            node.domain in ("", "ai.onnx") and inputs and all(name in constants for name in inputs)
            and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        )
        if node.op_type == "Constant" or not foldable:
            value = _constant_values(graph, node.output[0]) if node.op_type == "Constant" else None
            if value is not None and integer(value):
                constants[node.output[0]] = value
            nodes.append(node)
            continue
        operands = {name: constants[name] for name in inputs}
        single = oh.make_model(
            oh.make_graph([node], "fold", [oh.make_tensor_value_info(n, oh.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                                           for n, v in operands.items()],
                          [oh.make_empty_tensor_value_info(o) for o in node.output if o]),
            opset_imports=opsets,
        )
        try:
            values = [np.asarray(v) for v in onnx.reference.ReferenceEvaluator(single).run(None, operands)]
        except Exception:  # an op the reference evaluator lacks: leave it computed
            nodes.append(node)
            continue
        if not all(integer(v) and v.size <= _FOLDED_ELEMENTS for v in values):
            nodes.append(node)
            continue
        for name, value in zip([o for o in node.output if o], values):
            constants[name] = value
            nodes.append(oh.make_node("Constant", [], [name], value=onh.from_array(value, name)))
    del graph.node[:]
    graph.node.extend(nodes)


DROPOUT_SEED_INPUT = "dropout_seed"
"""Step-graph input (int64 scalar) of :func:`seed_dropout`: the Dropout seed."""
DROPOUT_MICRO_BATCH_INPUT = "dropout_micro_batch"
"""The micro-batch index (int64 scalar) under gradient accumulation: a Constant 0 in a step
graph, an input of the gradient graph (:func:`normgrad.graphs.optimizers.build_gradient_graph`)."""
METADATA_DROPOUT = "normgrad.dropout"
"""Model metadata key: JSON {"seed": the default seed, "outputs": {Dropout output: its data input}}."""

_CHAIN_KEYS = (0x3C751DE9, 0x2B3D0209)
"""The fixed odd 30-bit keys of the key chain's two draws (varied hex digits, as squares keys should be)."""
_COUNTER_LIMBS = (("seed", 5), ("step", 2), ("micro_batch", 2))
"""The key chain's counters and their 15-bit limbs (5 cover an int64 seed)."""


def _training_dropouts(graph: onnx.GraphProto) -> list:
    """The default-domain Dropout nodes that may run in training mode (a training_mode input
    that is not the constant False)."""
    found = []
    for node in graph.node:
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
            continue
        training = node.input[2] if len(node.input) > 2 and node.input[2] else None
        value = _constant_values(graph, training) if training else np.asarray(False)
        if value is None or bool(np.asarray(value).reshape(-1)[0]):
            found.append(node)
    return found


def seed_dropout(graph: onnx.GraphProto, step: str, seed: int) -> dict:
    """Replaces, in place, every Dropout node of ``graph`` that may run in training mode by
    ops whose mask is a function of (seed, step, micro-batch, node, element):

    * squares on 30-bit words (:func:`normgrad.ops.dropout_mask.squares`: four rounds of
      x * x + y mod 2**30 and swapping 15-bit halves), exact in 32-bit integer arithmetic, so
      every runtime (OpenVINO computes int64 in 32 bits, tract has no int64 Square) draws the
      same masks;
    * a key: the 15-bit limbs of the seed (5), the step (2) and the micro-batch (2), limb j
      with value v as the counter j * 2**15 + v, each drawn under K1; the draws summed mod
      2**30 and drawn again under K2, made odd; node i (graph order) gets squares(i, key),
      made odd;
    * element e (row-major, mod 2**30) is kept when squares(e, node key)'s top 24 bits /
      2**24 >= ratio: probability 1 - ratio; kept elements are divided by 1 - ratio, as
      Dropout does. This draw is a ``normgrad:DropoutMask`` node (the key chain before it
      is a few scalar standard ops): onnxruntime runs its kernel, other runtimes its function
      body, the same generator in standard ops, which ``--inline`` and the portable form write
      in its place (:func:`expand_dropout_masks`).

    The seed is the new int64 scalar input ``dropout_seed`` (``seed``, recorded in the
    metadata, is what :class:`normgrad.train.Trainer` feeds by default); ``step`` names a
    scalar of the graph (the step graph's ``step``), cast to int64; the micro-batch index
    ``dropout_micro_batch`` is a Constant 0. The replaced nodes keep their output names (the
    mask too, which the Dropout gradient rule already reads): run after differentiation,
    forward and backward share one mask. Integer arithmetic only: bitwise the same on any
    onnxruntime, thread count and graph optimization level, and on OpenVINO and onnx's
    ReferenceEvaluator (``tests/test_runtimes.py``; on OpenVINO, which holds int64 as int32,
    for seeds of int32's range).

    Returns:
        {Dropout output: its data input} of the replaced nodes ({} and ``graph`` unchanged
        when there are none).

    Raises:
        ValueError: ``seed`` is not an int64 integer, or the graph already has a value named
            like a new input.
    """
    dropouts = _training_dropouts(graph)
    if not dropouts:
        return {}
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not -2**63 <= int(seed) < 2**63:
        raise ValueError(f"the Dropout seed must be an integer in the int64 range, got {seed!r}")
    names = {n for node in graph.node for n in list(node.input) + list(node.output)}
    names |= {i.name for i in graph.input} | {t.name for t in graph.initializer}
    for reserved in (DROPOUT_SEED_INPUT, DROPOUT_MICRO_BATCH_INPUT):
        if reserved in names:
            raise ValueError(f"the graph already has a value named {reserved!r}")
    emit = dropout_mask.Emitter(_unique(graph, "dropout_mask"))
    one = emit.const([1])
    step_int = emit.op("Cast", step, to=onnx.TensorProto.INT64)
    emit.op("Constant", value=onh.from_array(np.array(0, np.int64)), output=DROPOUT_MICRO_BATCH_INPUT)
    limbs = [limb for counter, (_, count) in zip((DROPOUT_SEED_INPUT, step_int, DROPOUT_MICRO_BATCH_INPUT), _COUNTER_LIMBS)
             for limb in emit.limbs(emit.op("Reshape", counter, one), count)]
    counters = (emit.const(np.arange(len(limbs)), np.int32),
                emit.op("Cast", emit.op("Concat", *limbs, axis=0), to=onnx.TensorProto.INT32))
    drawn = emit.squares(counters, emit.word_const(_CHAIN_KEYS[0]))
    high, low = (emit.op("ReduceSum", half, keepdims=1) for half in drawn)
    summed = emit.carry(low, high, emit.const(dropout_mask.LIMB, np.int32))
    key = emit.odd(emit.squares(summed, emit.word_const(_CHAIN_KEYS[1])))
    node_keys = emit.odd(emit.squares((emit.const(np.zeros(len(dropouts)), np.int32),
                                       emit.const(np.arange(len(dropouts)), np.int32)), key))
    # a Split, not Gathers: onnxruntime 1.19's GatherSliceToSplitFusion gives every fused
    # group the same node name, then rejects the graph
    node_keys = list(zip(*(emit.split(half, len(dropouts)) for half in node_keys)))
    chain, emit.nodes = emit.nodes, []
    replaced, outputs = {}, {}
    for index, node in enumerate(dropouts):
        x = node.input[0]
        ratio = node.input[1] if len(node.input) > 1 and node.input[1] else emit.const(0.5, np.float32)
        training = node.input[2]
        keep = emit.op(dropout_mask.OP_TYPE, x, emit.op("Cast", ratio, to=onnx.TensorProto.FLOAT), *node_keys[index],
                       domain=DOMAIN)
        runtime = _constant_values(graph, training) is None
        mask = node.output[1] if len(node.output) > 1 and node.output[1] else None
        if runtime:
            emit.op("Or", keep, emit.op("Not", training), output=mask)
        elif mask:
            emit.op("Identity", keep, output=mask)
        one_x = emit.op("CastLike", emit.const(1.0, np.float32), x)
        kept = emit.op("Div", x, emit.op("Sub", one_x, emit.op("CastLike", ratio, x)))
        masked = emit.op("Where", keep, kept, emit.op("CastLike", emit.const(0.0, np.float32), x),
                         output=None if runtime else node.output[0])
        if runtime:
            emit.op("Where", training, masked, x, output=node.output[0])
        replaced[id(node)], emit.nodes = emit.nodes, []
        outputs[node.output[0]] = x
    nodes = chain + [new for node in graph.node for new in replaced.get(id(node), [node])]
    del graph.node[:]
    graph.node.extend(nodes)
    graph.input.append(oh.make_tensor_value_info(DROPOUT_SEED_INPUT, onnx.TensorProto.INT64, []))
    return outputs


def expand_dropout_masks(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every main-graph DropoutMask node replaced by its function body (the
    generator in standard integer ops, as :func:`seed_dropout` wrote it before the operator
    existed); ``model`` itself when it has none."""
    return expand_operator(model, dropout_mask)


def expand_operator(model: onnx.ModelProto, module) -> onnx.ModelProto:
    """``model`` with every main-graph node of the normgrad operator ``module`` replaced by
    its function body; ``model`` itself when it has none."""
    selected = (DOMAIN, module.OP_TYPE)
    nodes = [n for n in model.graph.node if (n.domain, n.op_type) == selected]
    if not nodes:
        return model
    if not any((f.domain, f.name) == selected for f in model.functions):
        opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        reads = _common.attribute_reads(module, nodes)
        model.functions.append(module.function_body(opset, reads) if reads else module.function_body(opset))
    model = onnx.inliner.inline_selected_functions(model, [selected])
    kept = [f for f in model.functions if (f.domain, f.name) != selected]
    del model.functions[:]
    model.functions.extend(kept)
    if not any(n.domain == DOMAIN for n in model.graph.node) and not any(f.domain == DOMAIN for f in kept):
        opsets = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(opsets)
    return model


def _body_producers(body: onnx.GraphProto) -> dict:
    return {name: node for node in body.node for name in node.output}


def _embedding_bag_parts(node: onnx.NodeProto):
    """(weight, ids, starts, ends, mode) of torch's TorchScript EmbeddingBag Loop, else None.

    The Loop has no loop-carried values and one scan output, per iteration k
    ``Reduce{Sum,Mean}(Gather(weight, Slice(ids, starts[k], ends[k])), axis 0)`` with
    ``weight``, ``ids``, ``starts`` and ``ends`` from the outer graph."""
    if node.op_type != "Loop" or len(node.input) != 2 or len(node.output) != 1:
        return None
    body = next((a.g for a in node.attribute if a.name == "body"), None)
    if body is None or len(body.output) != 2 or len(body.input) != 2:
        return None
    produced, iteration = _body_producers(body), body.input[0].name
    reduce = produced.get(body.output[1].name)
    if reduce is None or reduce.op_type not in ("ReduceSum", "ReduceMean") or attr(reduce, "keepdims", 1) != 0:
        return None
    axes = attr(reduce, "axes", None)
    if axes is None and len(reduce.input) > 1:
        axes_node = produced.get(reduce.input[1])
        axes = None if axes_node is None or axes_node.op_type != "Constant" else onh.to_array(axes_node.attribute[0].t).tolist()
    gather = produced.get(reduce.input[0])
    if list(np.ravel(axes if axes is not None else [-1])) != [0] or gather is None or gather.op_type != "Gather" \
            or attr(gather, "axis", 0) != 0 or gather.input[0] in produced:
        return None
    sliced = produced.get(gather.input[1])
    if sliced is None or sliced.op_type != "Slice" or sliced.input[0] in produced or len(sliced.input) > 4:
        return None
    bounds = []
    for name in sliced.input[1:3]:
        unsqueeze = produced.get(name)
        picked = produced.get(unsqueeze.input[0]) if unsqueeze is not None and unsqueeze.op_type == "Unsqueeze" else None
        if picked is None or picked.op_type != "Gather" or picked.input[1] != iteration or picked.input[0] in produced:
            return None
        bounds.append(picked.input[0])
    return gather.input[0], sliced.input[0], bounds[0], bounds[1], "sum" if reduce.op_type == "ReduceSum" else "mean"


def embedding_bags(model: onnx.ModelProto) -> None:
    """Rewrites, in place, the Loops torch's exporters write for ``nn.EmbeddingBag`` (offsets
    form, mode sum or mean; TorchScript: :func:`_embedding_bag_parts`, dynamo:
    :func:`_dynamo_embedding_bag_parts`) as Gather + MatMul: the rows summed per bag by a
    [bags, rows] 0/1 membership matrix (``starts[k] <= j < ends[k]``), divided by
    max(bag size, 1) for mean (an empty bag is 0, as in torch). Gradients then flow through
    the Gather and MatMul rules. Other Loops stay (and are refused where a gradient must
    pass). The matrix costs bags x len(ids) elements."""
    graph = model.graph
    readers: dict = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    replaced, dropped = {}, set()
    for node in graph.node:
        tag = None
        parts = _embedding_bag_parts(node)
        if parts is not None:
            weight, ids, starts, ends, mode = parts
            tag = _unique(graph, f"{node.name or 'Loop'}/embedding_bag")
            rows = f"{tag}/rows"
            made = [oh.make_node("Gather", [weight, ids], [rows])]
            made += _bag_reduction(tag, rows, starts, ends, node.input[0], mode, node.output[0])
            replaced[id(node)] = made
            continue
        parts = _dynamo_embedding_bag_parts(graph, node, readers)
        if parts is not None:
            rows, bounds, mode, concat = parts
            tag = _unique(graph, f"{node.name or 'Loop'}/embedding_bag")
            made = [
                oh.make_node("Constant", [], [f"{tag}/one"], value=onh.from_array(np.asarray([1], np.int64))),
                oh.make_node("Constant", [], [f"{tag}/end"], value=onh.from_array(np.asarray([2 ** 62], np.int64))),
                oh.make_node("Slice", [bounds, f"{tag}/one", f"{tag}/end"], [f"{tag}/ends"]),
                oh.make_node("Size", [f"{tag}/ends"], [f"{tag}/bags"]),
            ]
            made += _bag_reduction(tag, rows, bounds, f"{tag}/ends", f"{tag}/bags", mode, concat.output[0])
            replaced[id(node)] = made
            dropped.add(id(concat))
    if not replaced:
        return
    kept = [new for node in graph.node if id(node) not in dropped for new in replaced.get(id(node), [node])]
    del graph.node[:]
    graph.node.extend(kept)


def _nested_nodes(graph: onnx.GraphProto):
    """The nodes of ``graph`` and of every subgraph inside it, depth first."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _nested_nodes(attribute.g)


def _dynamo_embedding_bag_parts(graph: onnx.GraphProto, node: onnx.NodeProto, readers: dict):
    """(rows, bounds, mode, concat node) of the Loop torch's dynamo exporter writes for
    ``nn.EmbeddingBag`` (onnxscript's torchlib, sum or mean), else None: a Loop that appends one
    reduced ``Slice(rows, start, end)`` per bag to a sequence that a ConcatFromSequence(axis 0)
    alone reads, ``start``/``end`` sliced from one outer ``bounds`` at the iteration, the mode a
    constant compared inside the body. ``rows`` is the already gathered (and weighted) rows."""
    if node.op_type != "Loop" or len(node.input) != 4 or len(node.output) != 2:
        return None
    producers = {name: n for n in graph.node for name in n.output}
    carried = [k for k in (0, 1) if getattr(producers.get(node.input[2 + k]), "op_type", None) == "SequenceEmpty"]
    if len(carried) != 1:  # the exporter writes the sequence and the bag index in either order
        return None
    sequence, index = node.output[carried[0]], node.output[1 - carried[0]]
    concat = readers.get(sequence, [])
    if len(concat) != 1 or concat[0].op_type != "ConcatFromSequence" or attr(concat[0], "axis", None) != 0 \
            or attr(concat[0], "new_axis", 0) or readers.get(index) or index in {o.name for o in graph.output} \
            or sequence in {o.name for o in graph.output}:
        return None
    body = next(a.g for a in node.attribute if a.name == "body")
    nested = list(_nested_nodes(body))
    inner = {name for n in nested for name in n.output} | {i.name for i in body.input}
    slices = [n for n in nested if n.op_type == "Slice" and n.input[0] not in inner]
    gathered = [n for n in slices if n.input[1] in inner and producers.get(n.input[0]) is not None
                and n.input[1] in {s.output[0] for s in slices}]  # Slice(rows, start, end), start itself a Slice
    bound_slices = [n for n in slices if n not in gathered]
    if not gathered or not bound_slices or len({n.input[0] for n in gathered}) != 1 or \
            len({n.input[0] for n in bound_slices}) != 1:
        return None
    modes = set()
    constants = {n.output[0]: n for n in nested if n.op_type == "Constant"}
    for n in nested:
        if n.op_type == "Equal":
            for name in n.input:
                c = constants.get(name)
                if c is not None and c.attribute and c.attribute[0].name == "value_int":
                    modes.add(c.attribute[0].i)
    reductions = {n.op_type for n in nested if n.op_type.startswith("Reduce")}
    if len(modes) != 1 or not reductions <= {"ReduceSum", "ReduceMean", "ReduceMax"}:
        return None
    mode = {0: "sum", 1: "mean"}.get(modes.pop())
    if mode is None:
        return None
    return gathered[0].input[0], bound_slices[0].input[0], mode, concat[0]


def _bag_reduction(tag: str, rows: str, starts: str, ends: str, bags: str, mode: str, output: str) -> list:
    """Nodes writing ``output`` [bags, D]: the rows of ``rows`` [n, D] at positions
    starts[k] <= j < ends[k] summed (or averaged, an empty bag 0) per bag k < ``bags``."""
    made = []

    def emit(op_type, *inputs, **attrs):
        name = f"{tag}/{op_type.lower()}{len(made)}"
        made.append(oh.make_node(op_type, list(inputs), [name], **attrs))
        return name

    def const(values):
        name = f"{tag}/c{len(made)}"
        made.append(oh.make_node("Constant", [], [name], value=onh.from_array(np.asarray(values, np.int64))))
        return name

    zero, one, column = const(0), const(1), const([1])
    indices = emit("Range", zero, emit("Cast", bags, to=onnx.TensorProto.INT64), one)
    bag_starts = emit("Unsqueeze", emit("Gather", starts, indices), column)
    bag_ends = emit("Unsqueeze", emit("Gather", ends, indices), column)
    positions = emit("Range", zero, emit("Squeeze", emit("Shape", rows, start=0, end=1), const([0])), one)
    inside = emit("And", emit("GreaterOrEqual", positions, bag_starts), emit("Less", positions, bag_ends))
    membership = emit("CastLike", inside, rows)
    total = emit("MatMul", membership, rows)
    if mode == "sum":
        made.append(oh.make_node("Identity", [total], [output]))
    else:
        count = emit("ReduceSum", membership, column, keepdims=1)
        made.append(oh.make_node("Div", [total, emit("Max", count, emit("CastLike", one, rows))], [output]))
    return made


_BFLOAT16_MOVES = frozenset({"Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Concat",
                             "Split", "Gather", "Shape"})
"""Ops whose CPU kernels onnxruntime (1.19.2 and 1.32, checked one by one) has for bfloat16:
data movement (and Cast); Expand, Where, Size and every arithmetic op have none."""

_DTYPE_ATTRIBUTES = {"RandomNormal": "dtype", "RandomUniform": "dtype", "RandomNormalLike": "dtype",
                     "RandomUniformLike": "dtype", "EyeLike": "dtype", "Bernoulli": "dtype"}


def bfloat16_values(tensor: onnx.TensorProto) -> np.ndarray:
    """A bfloat16 tensor's values, exactly, as float32 (the bfloat16 bits are the high half),
    whatever onnx's numpy_helper makes of bfloat16 in this version."""
    if tensor.HasField("raw_data"):
        bits = np.frombuffer(tensor.raw_data, dtype="<u2")
    else:
        bits = np.asarray(tensor.int32_data, dtype=np.uint32).astype(np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32).reshape(tuple(tensor.dims))


def bfloat16_in_float32(model: onnx.ModelProto) -> None:
    """Computes, in place, a model's bfloat16 arithmetic in float32, for onnxruntime's CPU
    provider, whose only bfloat16 kernels are Cast and data movement (:data:`_BFLOAT16_MOVES`).

    bfloat16 initializers and inputs stay bfloat16 (a frozen base keeps half the memory of
    float32); data movement on bfloat16 values stays bfloat16 (a Gather reads rows of a
    bfloat16 table), and every other node reads a bfloat16 input through its own
    Cast(to=FLOAT) placed right before it. Cast(to=BFLOAT16), bfloat16 Constants and
    ConstantOfShape, and the dtype of random ops become float32, so that what the exporter
    computed in bfloat16 is computed in float32 (more precisely than torch, which rounds
    each bfloat16 result). An output computed in bfloat16 (a causal LM's logits) becomes
    float32, its value before torch's rounding to bfloat16: onnxruntime's Python API cannot
    return bfloat16 arrays. Only the main graph is rewritten (a subgraph reading a bfloat16
    value keeps reading it as it is)."""
    bfloat16, float32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    graph = model.graph
    if not (any(t.data_type == bfloat16 for t in graph.initializer)
            or any(i.type.tensor_type.elem_type == bfloat16 for i in graph.input)
            or any((node.op_type == "Cast" and attr(node, "to", None) == bfloat16)
                   or (node.op_type == "Constant" and any(a.t.data_type == bfloat16 for a in node.attribute))
                   for node in graph.node)):
        return
    types = {name: value.tensor_type.elem_type for name, value in value_types(model).items()}
    names = {n for node in graph.node for n in [*node.input, *node.output, node.name]} | set(types)

    stored = {name for name in [i.name for i in graph.input] + [t.name for t in graph.initializer] if types.get(name) == bfloat16}
    computed: Set[str] = set()  # values that were bfloat16 and are now float32
    nodes = []
    for node in graph.node:
        read = [name for name in node.input if name in stored]
        outputs = [name for name in node.output if types.get(name) == bfloat16]
        if node.op_type == "Cast" or (node.op_type in _BFLOAT16_MOVES and not computed.intersection(node.input)):
            stored.update(outputs)
            if node.op_type == "Cast" and attr(node, "to", None) == bfloat16:
                next(a for a in node.attribute if a.name == "to").i = float32
                stored.difference_update(outputs)
                computed.update(outputs)
            nodes.append(node)
            continue
        casts = {}
        for name in dict.fromkeys(read):
            casts[name] = reserve_name(names, f"{name}_float32")
            nodes.append(oh.make_node("Cast", [name], [casts[name]], name=reserve_name(names, f"{node.name or node.op_type}_cast"), to=float32))
        node.input[:] = [casts.get(name, name) for name in node.input]
        for attribute in node.attribute:
            if attribute.name == "value" and attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == bfloat16:
                attribute.t.CopyFrom(onh.from_array(bfloat16_values(attribute.t), attribute.t.name))
            elif attribute.name == _DTYPE_ATTRIBUTES.get(node.op_type) and attribute.i == bfloat16:
                attribute.i = float32
        computed.update(outputs)
        nodes.append(node)
    for info in list(graph.value_info) + list(graph.output):
        if info.name in computed:
            info.type.tensor_type.elem_type = float32
    del graph.node[:]
    graph.node.extend(nodes)


def cast_stored_weights_per_reader(model: onnx.ModelProto) -> int:
    """Gives, in place, every reader of a ``Cast`` of a bfloat16 initializer (a frozen weight
    read in float32: :func:`bfloat16_in_float32`) after the first its own Cast, placed right
    before it; returns how many Casts were added. In a training graph the backward's
    ``Gemm(dY, W)`` otherwise reads the forward's cast of W, which then stays alive from the
    forward to the backward: a float32 copy of the whole base at the step's peak. Recast,
    only the weights of the layers being computed are float32 at a time (onnxruntime runs a
    Cast of an initializer just before its reader; the Trainer keeps its common
    subexpression elimination from merging the Casts back, :mod:`normgrad._session`)."""
    graph = model.graph
    stored = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.BFLOAT16}
    casts = {node.output[0]: node for node in graph.node
             if node.op_type == "Cast" and node.domain in ("", "ai.onnx") and node.input and node.input[0] in stored}
    names = {n for node in graph.node for n in [*node.input, *node.output, node.name]}
    first_reader: Dict[str, int] = {}
    nodes, added = [], 0
    for index, node in enumerate(graph.node):
        for position, name in enumerate(node.input):
            if name not in casts:
                continue
            if first_reader.setdefault(name, index) == index:
                continue
            cast = copy.deepcopy(casts[name])
            cast.output[0] = reserve_name(names, f"{name}.recast")
            cast.name = reserve_name(names, f"{casts[name].name or name}.recast")
            nodes.append(cast)
            node.input[position] = cast.output[0]
            added += 1
        nodes.append(node)
    if added:
        del graph.node[:]
        graph.node.extend(nodes)
    return added


_GEMM_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
"""Element types onnxruntime's CPU Gemm kernel has (1.19.2 to 1.32)."""


def transposed_weight_products(model: onnx.ModelProto) -> bool:
    """Rewrites, in place, each ``MatMul(x, Transpose(V, perm=[1, 0]))`` of float or double
    values (torch's exporters' ``x @ W.T``; also through the Cast that
    :func:`bfloat16_in_float32` puts after a bfloat16 weight's Transpose) into
    ``Gemm(x, V, transB=1)`` over x's flattened leading axes, reshaped back: the forward, and
    through the Gemm rule the backward (dx = dY V, dV = dY^T x), read V as it is stored.
    Otherwise onnxruntime transposes V every step, or, with constant folding, keeps a
    transposed copy of a frozen weight beside it. The Transposes and Casts nothing reads any
    more are dropped. Needs the model's inferred types (value_info); returns whether
    anything changed (then infer them again)."""
    graph = model.graph
    types = {t.name: (t.data_type, len(t.dims)) for t in graph.initializer}
    for info in list(graph.input) + list(graph.value_info) + list(graph.output):
        tensor = info.type.tensor_type
        types[info.name] = (tensor.elem_type, len(tensor.shape.dim) if tensor.HasField("shape") else None)
    producers = {name: node for node in graph.node for name in node.output if name}
    names = set(types) | {n for node in graph.node for n in [*node.input, *node.output, node.name]}
    casts = {}  # (V, to): its Cast, written once for every product that reads it
    flattened = {}  # x: its Flatten, one for every product that reads it (their dx sum as 2-D Gemm outputs)
    nodes, changed = [], False
    for node in graph.node:
        source = _transposed_matrix(node, producers, types)
        if source is None:
            nodes.append(node)
            continue
        weight, cast_to = source
        x, y = node.input[0], node.output[0]
        tag = node.name or y

        def emit(op_type, *inputs, output=None, **attributes):
            output = output or reserve_name(names, f"{tag}/{op_type.lower()}")
            nodes.append(oh.make_node(op_type, list(inputs), [output], name=reserve_name(names, f"{tag}/{op_type}"),
                                      **attributes))
            return output

        read = weight
        if cast_to is not None:
            if (weight, cast_to) not in casts:
                casts[weight, cast_to] = emit("Cast", weight, to=cast_to)
            read = casts[weight, cast_to]
        if types.get(x, (None, None))[1] == 2:
            emit("Gemm", x, read, output=y, transB=1)
        else:
            if x not in flattened:
                flattened[x] = emit("Flatten", x, axis=-1)
            product = emit("Gemm", flattened[x], read, transB=1)
            shape = emit("Concat", emit("Shape", x, end=-1), emit("Shape", weight, start=0, end=1), axis=0)
            emit("Reshape", product, shape, output=y)
        changed = True
    if changed:
        del graph.node[:]
        graph.node.extend(_without_unread(nodes, {o.name for o in graph.output}, ("Transpose", "Cast")))
    return changed


def _transposed_matrix(node: onnx.NodeProto, producers: dict, types: dict):
    """(V, the Cast's ``to`` or None) if ``node`` is a float/double MatMul whose second input
    is Transpose(V, perm=[1, 0]) of a matrix V, or a Cast of one; else None."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    if types.get(node.input[1], (None, None))[0] not in _GEMM_TYPES:
        return None
    source, cast_to = producers.get(node.input[1]), None
    if source is not None and source.op_type == "Cast" and source.domain in ("", "ai.onnx"):
        cast_to, source = attr(source, "to", None), producers.get(source.input[0])
    if source is None or source.op_type != "Transpose" or source.domain not in ("", "ai.onnx"):
        return None
    if types.get(source.input[0], (None, None))[1] != 2 or list(attr(source, "perm", [1, 0])) != [1, 0]:
        return None
    return source.input[0], cast_to


def _without_unread(nodes: list, outputs: Set[str], op_types) -> list:
    """``nodes`` without those of ``op_types`` whose outputs nothing reads (repeated until none)."""
    while True:
        read = {name for node in nodes for name in node.input} | outputs
        kept = [n for n in nodes if n.op_type not in op_types or any(o in read for o in n.output if o)]
        if len(kept) == len(nodes):
            return kept
        nodes = kept


def gelu_erf_fusable_order(model: onnx.ModelProto) -> int:
    """Rewrites, in place, each ``Mul(x, Mul(Add(Erf(Div(x, c)), 1), 0.5))`` (either operand
    order in each Mul and the Add) into ``Mul(Mul(x, Add(...)), 0.5)`` where the inner
    ``Mul(.., 0.5)`` is read by that product alone; returns how many. Only the order of the
    products changes: onnxruntime's GeluFusion matches this order and not the other."""
    graph = model.graph
    producers = {name: node for node in graph.node for name in node.output if name}
    readers = collections.Counter(name for node in graph.node for name in node.input)
    outputs = {o.name for o in graph.output}

    def made_by(name: str, op_type: str):
        node = producers.get(name)
        return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None

    def is_scalar(name: str, value: float) -> bool:
        found = _constant_values(graph, name)
        return found is not None and found.size == 1 and float(found.reshape(())) == value

    rewritten = 0
    for node in graph.node:
        if node.op_type != "Mul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        for x, cdf in (node.input, node.input[::-1]):
            halving = made_by(cdf, "Mul")
            if halving is None or readers[cdf] != 1 or cdf in outputs:
                continue
            sums = [(b, h) for b, h in (halving.input, halving.input[::-1]) if is_scalar(h, 0.5)]
            add = made_by(sums[0][0], "Add") if sums else None
            if add is None:
                continue
            erf = next((made_by(i, "Erf") for i in add.input if made_by(i, "Erf") is not None), None)
            other = [i for i in add.input if erf is None or i != erf.output[0]]
            div = made_by(erf.input[0], "Div") if erf is not None else None
            if div is None or div.input[0] != x or len(other) != 1 or not is_scalar(other[0], 1.0):
                continue
            halving.input[:] = [x, sums[0][0]]  # the former Mul(b, 0.5) now computes x * b
            node.input[:] = [cdf, sums[0][1]]  # and the product halves it
            rewritten += 1
            break
    return rewritten


def _slice_interval(graph: onnx.GraphProto, node: onnx.NodeProto, shapes: Dict[str, list]):
    """(axis, start, end) of a Slice of one axis with step 1 and constant bounds, clamped to
    the static length of that axis of its input; None otherwise."""
    if node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or len(node.input) < 4:
        return None
    shape = shapes.get(node.input[0])
    values = [_constant_values(graph, name) if name else None for name in list(node.input[1:5]) + [""] * (5 - len(node.input))]
    starts, ends, axes, steps = values
    if shape is None or starts is None or ends is None or axes is None or starts.size != 1 or ends.size != 1 \
            or axes.size != 1 or (steps is not None and (steps.size != 1 or int(steps.reshape(())) != 1)):
        return None
    axis = int(axes.reshape(())) % len(shape)
    length = shape[axis]
    if not isinstance(length, int):
        return None
    start, end = (int(v.reshape(())) for v in (starts, ends))
    start, end = (min(max(v + length if v < 0 else v, 0), length) for v in (start, end))
    return (axis, start, end) if start < end else None


def tiling_slices_as_split(model: onnx.ModelProto) -> int:
    """Rewrites, in place, Slices of one value along one static axis whose intervals cover it
    exactly once into one Split (opset 13+, the sizes an initializer-free Constant), its
    outputs the Slices' outputs; returns how many Splits. Needs the inferred shapes."""
    graph = model.graph
    shapes = {}
    for info in list(graph.input) + list(graph.value_info):
        if info.type.tensor_type.HasField("shape"):
            shapes[info.name] = [d.dim_value if d.HasField("dim_value") else None for d in info.type.tensor_type.shape.dim]
    groups: Dict[tuple, list] = {}
    for node in graph.node:
        interval = _slice_interval(graph, node, shapes)
        if interval is not None:
            groups.setdefault((node.input[0], interval[0]), []).append((interval[1], interval[2], node))
    replaced = {}
    position = {id(node): index for index, node in enumerate(graph.node)}
    names = {n for node in graph.node for n in [*node.input, *node.output, node.name]}
    for (x, axis), pieces in groups.items():
        pieces.sort(key=lambda piece: piece[0])
        ends = [0] + [end for _, end, _ in pieces]
        if len(pieces) < 2 or [start for start, _, _ in pieces] != ends[:-1] or ends[-1] != shapes[x][axis]:
            continue
        sizes = reserve_name(names, f"{x}/split_sizes")
        split_name = reserve_name(names, f"{x}/Split")
        constant = oh.make_node("Constant", [], [sizes], name=f"{split_name}/sizes",
                                value=onh.from_array(np.asarray([end - start for start, end, _ in pieces], np.int64)))
        split = oh.make_node("Split", [x, sizes], [node.output[0] for _, _, node in pieces], name=split_name, axis=axis)
        first = min((node for _, _, node in pieces), key=lambda node: position[id(node)])
        for _, _, node in pieces:
            replaced[id(node)] = [constant, split] if node is first else []
    if replaced:
        nodes = [new for node in graph.node for new in replaced.get(id(node), [node])]
        del graph.node[:]
        graph.node.extend(nodes)
    return sum(1 for new in replaced.values() if new)


def safe_softmaxes(model: onnx.ModelProto, trainable: Set[str] = frozenset()) -> int:
    """Rewrites, in place, torch's safe softmax ``Where(IsNaN(s), 0, s)``, s = Softmax(x) over
    the last axis of a float32 x, into one ``normgrad:SafeSoftmax(x)`` writing the Where's
    output, where s is read by that IsNaN and that Where alone and the IsNaN by the Where
    alone (none a graph output) and the 0 is a constant (not one of the ``trainable``
    initializers, whose gradient the fused node would lose); returns how many. Where x is an
    Add read by the Softmax alone of scores of x's static shape and a bias that fits them
    (:func:`normgrad.ops.bias_safe_softmax.broadcasts_over_rows`: attention's mask), the node
    is ``normgrad:BiasSafeSoftmax(scores, bias)`` in the Add's place too. Needs the inferred
    types. The gradient is then ``SoftmaxGrad`` of the zeroed output: 0 on a fully masked
    row, as torch's, where the Where and Softmax gradients give NaN."""
    graph = model.graph
    types = {info.name: info.type.tensor_type for info in list(graph.input) + list(graph.value_info)}
    readers = _readers(graph)
    producers = {name: node for node in graph.node for name in node.output}
    outputs = {o.name for o in graph.output}
    replaced: Dict[int, list] = {}
    zeros = set()

    known_dims = _float32_dims(graph)

    def float32_dims(name: str):
        """The static dims of a float32 value, else None."""
        dims = known_dims.get(name)
        return dims if dims is not None and all(isinstance(d, int) for d in dims) else None

    def scores_and_bias(x: str):
        """(scores, bias) of an Add x read by the softmax alone that BiasSafeSoftmax takes, else None."""
        add = producers.get(x)
        if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(readers[x]) != 1 \
                or x in outputs or float32_dims(x) is None:
            return None
        for scores, bias in (tuple(add.input), tuple(reversed(add.input))):
            bias_dims = float32_dims(bias)
            if float32_dims(scores) == float32_dims(x) and bias_dims is not None \
                    and bias_safe_softmax.broadcasts_over_rows(bias_dims, float32_dims(x)):
                return scores, bias
        return None

    for softmax in graph.node:
        if softmax.op_type != "Softmax" or softmax.domain not in ("", "ai.onnx"):
            continue
        x, s = softmax.input[0], softmax.output[0]
        x_type = types.get(x)
        if x_type is None or x_type.elem_type != onnx.TensorProto.FLOAT or not x_type.HasField("shape"):
            continue
        rank = len(x_type.shape.dim)
        if rank == 0 or attr(softmax, "axis", -1) not in (-1, rank - 1):
            continue
        pair = sorted(readers[s], key=lambda node: node.op_type)
        if s in outputs or [n.op_type for n in pair] != ["IsNaN", "Where"] or any(n.domain not in ("", "ai.onnx") for n in pair):
            continue
        isnan, where = pair
        if list(where.input) != [isnan.output[0], where.input[1], s] or readers[isnan.output[0]] != [where] \
                or isnan.output[0] in outputs:
            continue
        zero = _constant_values(graph, where.input[1])
        if where.input[1] in trainable or zero is None or zero.dtype != np.float32 or zero.size != 1 or zero.ndim > rank or float(zero.reshape(())) != 0.0:
            continue
        added = scores_and_bias(x)
        if added is None:
            fused = oh.make_node(safe_softmax.OP_TYPE, [x], [where.output[0]], name=softmax.name, domain=DOMAIN)
        else:
            fused = oh.make_node(bias_safe_softmax.OP_TYPE, list(added), [where.output[0]], name=softmax.name,
                                 domain=DOMAIN)
            replaced[id(producers[x])] = []
        replaced.update({id(softmax): [fused], id(isnan): [], id(where): []})
        zeros.add(where.input[1])
    return _replace_chains(model, replaced, zeros)


def _float32_dims(graph: onnx.GraphProto) -> Dict[str, list]:
    """{value: its dims, each an int, a symbol or None} of the graph's float32 inputs,
    initializers and inferred values of known rank."""
    types = {info.name: info.type.tensor_type for info in list(graph.input) + list(graph.value_info)}
    types.update((init.name, oh.make_tensor_type_proto(init.data_type, list(init.dims)).tensor_type)
                 for init in graph.initializer)
    return {name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
            for name, t in types.items() if t.HasField("shape") and t.elem_type == onnx.TensorProto.FLOAT}


def _readers(graph: onnx.GraphProto) -> Dict[str, list]:
    """{value: the nodes reading it, in graph order}."""
    readers: Dict[str, list] = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)
    return readers


def _replace_chains(model: onnx.ModelProto, replaced: Dict[int, list], constants: set) -> int:
    """Replaces each node of ``model``'s graph by ``replaced[id(node)]`` (a normgrad node for
    each chain, nothing for the chain's other nodes), drops the Constants writing
    ``constants`` that nothing reads any more, imports the normgrad domain; returns how many
    chains."""
    if not replaced:
        return 0
    graph = model.graph
    outputs = {o.name for o in graph.output}
    nodes = [new for node in graph.node for new in replaced.get(id(node), [node])]
    read = {name for node in nodes for name in node.input} | outputs
    nodes = [n for n in nodes if not (n.op_type == "Constant" and n.output[0] in constants and n.output[0] not in read)]
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(oh.make_opsetid(DOMAIN, _common.OPSET_VERSION))
    return sum(1 for new in replaced.values() if new)


def silu_products(model: onnx.ModelProto) -> int:
    """Rewrites, in place, each ``Mul(Mul(gate, Sigmoid(gate)), up)`` that
    :func:`normgrad.graphs.patterns.silu.match_gated_silu` accepts (float32 gate and up of one
    static shape, the Sigmoid and the SiLU read by the chain alone, neither a graph output)
    into one ``normgrad:SiLUMul(gate, up)`` writing the product's output; returns how many.
    Needs the inferred types."""
    graph = model.graph
    types = {init.name: oh.make_tensor_type_proto(init.data_type, list(init.dims)) for init in graph.initializer}
    types.update((info.name, info.type) for info in list(graph.input) + list(graph.value_info) + list(graph.output))
    view = GraphView(graph)
    replaced: Dict[int, list] = {}
    for node in graph.node:
        chain = match_gated_silu(view, types.get, node)
        if chain is None:
            continue
        fused = oh.make_node(silu_mul.OP_TYPE, [chain.gate, chain.up], [node.output[0]], name=node.name, domain=DOMAIN)
        replaced.update({id(node): [fused], id(chain.silu): [], id(chain.sigmoid): []})
    return _replace_chains(model, replaced, set())


def _rotate_half_parts(graph, node, producer, readers, outputs, dims):
    """(x, cos, sin, the chain's nodes) of ``node`` = Add(Mul(x, cos), Mul(Concat(Neg(x2), x1), sin))
    with (x1, x2) = Split(x) into the halves of its last axis, float32, every intermediate
    read by the chain alone and not a graph output; else None."""
    def standard(n, op_type):
        return n is not None and n.op_type == op_type and n.domain in ("", "ai.onnx")

    def only_for(value, reader):
        return value not in outputs and readers[value] == [reader]

    if not standard(node, "Add") or len(node.input) != 2:
        return None
    for direct, rotated in (tuple(node.input), tuple(reversed(node.input))):
        product, rotation = producer.get(direct), producer.get(rotated)
        if not (standard(product, "Mul") and standard(rotation, "Mul")) or product is rotation:
            continue
        for concat_out, sin in (tuple(rotation.input), tuple(reversed(rotation.input))):
            concat = producer.get(concat_out)
            if not standard(concat, "Concat") or len(concat.input) != 2:
                continue
            neg, split = producer.get(concat.input[0]), producer.get(concat.input[1])
            if not standard(neg, "Neg") or not standard(split, "Split") or producer.get(neg.input[0]) is not split \
                    or list(split.output) != [concat.input[1], neg.input[0]]:
                continue
            x = split.input[0]
            if x not in product.input or len(set(product.input)) != 2:
                continue
            cos = product.input[1] if product.input[0] == x else product.input[0]
            x_dims = dims.get(x)
            if x_dims is None or not x_dims or not isinstance(x_dims[-1], int) or x_dims[-1] % 2:
                continue
            last = len(x_dims) - 1
            if attr(split, "axis", 0) not in (-1, last) or attr(concat, "axis", None) not in (-1, last):
                continue
            if len(split.input) > 1 and split.input[1]:
                sizes = _constant_values(graph, split.input[1])
                if sizes is None or sizes.tolist() != [x_dims[-1] // 2] * 2:
                    continue
            if not all(_broadcasts_exactly(dims.get(v), x_dims) for v in (cos, sin)):
                continue
            chain = [split, neg, concat, rotation, product]
            if not (only_for(split.output[0], concat) and only_for(split.output[1], neg)
                    and only_for(neg.output[0], concat) and only_for(concat_out, rotation)
                    and only_for(rotated, node) and only_for(direct, node)):
                continue
            return x, cos, sin, chain
    return None


def _broadcasts_exactly(shape, x_dims) -> bool:
    """Whether a value of ``shape`` surely broadcasts to x's dims without enlarging them, its
    last axis x's (each dim 1, or x's: the same int or the same symbol)."""
    if shape is None or not shape or len(shape) > len(x_dims) or shape[-1] != x_dims[-1]:
        return False
    return all(dim == 1 or (dim is not None and dim == x_dim) for dim, x_dim in zip(reversed(shape), reversed(x_dims)))


def rotate_half_embeddings(model: onnx.ModelProto) -> int:
    """Rewrites, in place, the rotary position embedding ``Add(Mul(x, cos), Mul(Concat(Neg(x2),
    x1), sin))``, (x1, x2) = Split(x) into the two halves of its last axis, x, cos and sin
    float32, cos and sin broadcasting to x's shape, into one ``normgrad:RotateHalfEmbedding(x,
    cos, sin)`` writing the Add's output, where the Split's, Neg's, Concat's and Muls' outputs
    are read by the chain alone and are not graph outputs (any operand order of the Muls and
    the Add); returns how many. Needs the inferred types (after :func:`tiling_slices_as_split`,
    which makes torch's two Slices the Split where x's last axis is static: the halves are
    known equal only then)."""
    graph = model.graph
    dims = _float32_dims(graph)
    producer = {output: node for node in graph.node for output in node.output}
    readers = _readers(graph)
    outputs = {o.name for o in graph.output}
    replaced: Dict[int, list] = {}
    sizes = set()
    for node in graph.node:
        parts = _rotate_half_parts(graph, node, producer, readers, outputs, dims)
        if parts is None:
            continue
        x, cos, sin, chain = parts
        fused = oh.make_node(rotate_half_embedding.OP_TYPE, [x, cos, sin], [node.output[0]], name=node.name,
                             domain=DOMAIN, transposed=0)
        replaced[id(node)] = [fused]
        replaced.update((id(n), []) for n in chain)
        sizes.update(chain[0].input[1:])
    return _replace_chains(model, replaced, sizes)


def gelu_erf_slopes(model: onnx.ModelProto, opset: int, trainable: Set[str] = frozenset()) -> int:
    """Rewrites, in place, each erf GELU of a float32 x into one ``normgrad:GeluWithSlope(x)``
    writing y (the GELU's output name) and a new slope value; returns how many. The GELU is
    the chain :func:`normgrad.graphs.patterns.gelu_erf_chain.match_chain` matches (either
    product order; its intermediates read by the chain alone, none a graph output) or a
    default-domain ``Gelu`` with approximate="none", its constants none of the ``trainable``
    initializers (whose gradients the fused node would lose). Needs the inferred types; its
    constants no longer read are dropped."""
    graph = model.graph
    view = GraphView(graph)
    if "Erf" not in view.op_types and "Gelu" not in view.op_types:
        return 0
    ctx = GradientContext(graph, opset, set())
    used = {name for node in graph.node for name in list(node.input) + list(node.output)}
    used |= {i.name for i in graph.input} | {t.name for t in graph.initializer}
    replaced: Dict[int, list] = {}
    constants = set()
    for node in graph.node:
        if node.op_type == "Gelu" and node.domain in ("", "ai.onnx") and attr(node, "approximate", "none") == "none":
            bound, chain = {"x": node.input[0]}, [node]
        else:
            found = gelu_erf_chain.match_chain(view, ctx, node) if _declarative.AVAILABLE else None
            if found is None:  # (without onnxscript the backward's matcher warns that chains go node by node)
                continue
            bound, chain = found
        x = bound["x"]
        fixed = {bound[name] for name in ("root2", "one", "half") if name in bound}
        if ctx.elem_type(x) != onnx.TensorProto.FLOAT or any(id(n) in replaced for n in chain) or fixed & trainable:
            continue
        constants |= fixed
        y = node.output[0]
        slope = reserve_name(used, f"{y}_slope")
        fused = oh.make_node(gelu_with_slope.OP_TYPE, [x], [y, slope], name=node.name, domain=DOMAIN)
        replaced.update({id(n): [] for n in chain})
        replaced[id(node)] = [fused]
    return _replace_chains(model, replaced, constants)
