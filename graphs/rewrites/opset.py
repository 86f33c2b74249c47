"""The forward model converted to the opset its gradient rules need, where the version
converter alone would produce a wrong or rejected model.

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
* The converter keeps Pad-2's ``value`` attribute on reflect/edge Pads, which Pad-11 rejects;
  it means nothing there and is dropped.
"""

from __future__ import annotations

from typing import Set

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnx.version_converter

from normgrad.graphs.context import attr, describe
from normgrad.graphs.rewrites._graph import RewriteContext, constant_values, unique_name
from normgrad.graphs.rules import UnsupportedOperatorError

__all__ = ["GROUP_NORM_PER_CHANNEL_OPSET", "MIN_OPSET", "convert_opset", "apply"]


MIN_OPSET = 15
"""The lowest default-domain opset of a training graph (normgrad function bodies need it)."""


GROUP_NORM_PER_CHANNEL_OPSET = 21


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
    tag = unique_name(graph, f"{node.name or 'GroupNormalization'}/per_channel_{index}")

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
                scales = constant_values(graph, node.input[1])
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


def apply(model: onnx.ModelProto, context: RewriteContext) -> int:
    """Converts ``model`` in place to the opset its gradient rules need (at least
    :data:`MIN_OPSET`; :func:`convert_opset`) and sets ``context.opset``; returns 1 if it
    converted, else 0."""
    from normgrad.graphs.rules import lookup

    needed = max([MIN_OPSET] + [rule.min_opset for rule in map(lookup, model.graph.node) if rule is not None])
    converted = convert_opset(model, context.opset, needed)
    if converted is model:
        return 0
    model.CopyFrom(converted)
    context.opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    return 1
