"""Helpers the rewrite passes share: fresh names, constant values, readers, float32 dims,
replacing matched chains by fused nodes, ``com.microsoft`` nodes by their standard-ONNX form,
and the context every pass's ``apply`` takes.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Dict, FrozenSet, Optional

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnx.shape_inference

from normgrad.graphs.context import constant_node_value
from normgrad.graphs.rules.registry import CONTRIB_DOMAIN
from normgrad.ops import DOMAIN, _common
from normgrad.ops.node_writer import NodeWriter

__all__ = ["RewriteContext", "unique_name", "constant_values", "float32_dims", "value_readers", "replace_chains",
           "CONTRIB_DOMAIN", "expand_contrib_nodes", "value_dims", "int64_scalar", "axis_length"]


@dataclasses.dataclass
class RewriteContext:
    """What the passes of :data:`normgrad.graphs.rewrites.PASSES` read besides the model.

    Attributes:
        opset: the model's default-domain opset (the opset pass raises it).
        trainable: the float initializers that get a gradient: no pass fuses one away as a
            fixed operand (its gradient would be lost).
        infer_shapes: the model with its inferred types (the builder's also gives the output
            types of the com.microsoft ops whose rules know them).
    """

    opset: int
    trainable: FrozenSet[str] = frozenset()
    infer_shapes: Callable[[onnx.ModelProto], onnx.ModelProto] = onnx.shape_inference.infer_shapes


def unique_name(graph: onnx.GraphProto, hint: str) -> str:
    """``hint_K``, K the smallest that names no value of ``graph``."""
    names = {n for node in graph.node for n in list(node.input) + list(node.output)}
    names |= {i.name for i in graph.input} | {t.name for t in graph.initializer}
    k = 0
    while f"{hint}_{k}" in names:
        k += 1
    return f"{hint}_{k}"


def constant_values(graph: onnx.GraphProto, name: str):
    """The value of ``name`` if an initializer or a Constant node of ``graph`` holds it, else None."""
    for init in graph.initializer:
        if init.name == name:
            return onh.to_array(init)
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == name and node.attribute:
            return constant_node_value(node)
    return None


def float32_dims(graph: onnx.GraphProto) -> Dict[str, list]:
    """{value: its dims, each an int, a symbol or None} of the graph's float32 inputs,
    initializers and inferred values of known rank."""
    types = {info.name: info.type.tensor_type for info in list(graph.input) + list(graph.value_info)}
    types.update((init.name, oh.make_tensor_type_proto(init.data_type, list(init.dims)).tensor_type)
                 for init in graph.initializer)
    return {name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
            for name, t in types.items() if t.HasField("shape") and t.elem_type == onnx.TensorProto.FLOAT}


def value_readers(graph: onnx.GraphProto) -> Dict[str, list]:
    """{value: the nodes reading it, in graph order}."""
    readers: Dict[str, list] = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)
    return readers


def replace_chains(model: onnx.ModelProto, replaced: Dict[int, list], constants: set) -> int:
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


def expand_contrib_nodes(model: onnx.ModelProto, context: RewriteContext, op_types, expand) -> int:
    """Replaces, in place, each main-graph ``com.microsoft`` node of one of ``op_types`` by the
    standard-ONNX nodes ``expand(writer, node, types)`` emits through ``writer`` (a
    :class:`~normgrad.ops.node_writer.NodeWriter` of the model's opset, scoped to the node;
    ``types``: {value: TypeProto} from ``context.infer_shapes``, run again after an expansion
    for a node reading a value of unknown shape, since onnx's knows no ``com.microsoft``
    schema) writing the node's outputs under their names; returns how many."""
    count, types, writer, stale = 0, {}, None, False
    for node in [n for n in model.graph.node if n.domain == CONTRIB_DOMAIN and n.op_type in op_types]:
        if writer is None or (stale and any(name and value_dims(types, name) is None for name in node.input)):
            inferred = context.infer_shapes(model).graph
            types = {i.name: i.type for i in list(inferred.input) + list(inferred.value_info) + list(inferred.output)}
            types.update((t.name, oh.make_tensor_type_proto(t.data_type, list(t.dims))) for t in inferred.initializer)
            writer, stale = NodeWriter(inferred, context.opset), False
        start = len(writer.nodes)
        writer.scope(f"{node.name or node.op_type}/expanded")
        expand(writer, node, types)
        stale = True
        at = list(model.graph.node).index(node)
        replacement = list(writer.nodes[start:])
        del model.graph.node[at]
        for offset, new in enumerate(replacement):
            model.graph.node.insert(at + offset, new)
        count += 1
    return count


def value_dims(types: Dict[str, onnx.TypeProto], name: str) -> Optional[list]:
    """The dims of ``name`` in ``types`` (an int, or None where unknown), None if its rank is unknown."""
    type_proto = types.get(name)
    if type_proto is None or not type_proto.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in type_proto.tensor_type.shape.dim]


def int64_scalar(writer: NodeWriter, value: int) -> str:
    """An int64 scalar Constant."""
    return writer.op("Constant", value=onh.from_array(np.asarray(value, np.int64)))


def axis_length(writer: NodeWriter, value: str, axis: int) -> str:
    """The runtime length of ``value``'s axis ``axis``, a scalar."""
    return writer.op("Squeeze", writer.shape_of(value, start=axis, end=axis + 1), writer.ints([0]))
