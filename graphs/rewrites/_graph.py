"""Helpers the rewrite passes share: fresh names, constant values, readers, float32 dims,
replacing matched chains by fused nodes, and the context every pass's ``apply`` takes.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Dict, FrozenSet

import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.graphs.context import constant_node_value
from normgrad.ops import DOMAIN, _common

__all__ = ["RewriteContext", "unique_name", "constant_values", "float32_dims", "value_readers", "replace_chains"]


@dataclasses.dataclass
class RewriteContext:
    """What the passes of :data:`normgrad.graphs.rewrites.PASSES` read besides the model.

    Attributes:
        opset: the model's default-domain opset (the opset pass raises it).
        trainable: the float initializers that get a gradient: no pass fuses one away as a
            fixed operand (its gradient would be lost).
    """

    opset: int
    trainable: FrozenSet[str] = frozenset()


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
