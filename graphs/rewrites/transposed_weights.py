"""``MatMul(x, Transpose(W))`` (torch's exporters' ``x @ W.T``) becomes a Gemm with ``transB=1``
that reads W in place, forward and backward (:func:`transposed_weight_products`).
"""

from __future__ import annotations

import copy
from typing import Set

import onnx
import onnx.helper as oh

from normgrad.graphs.context import attr, reserve_name
from normgrad.graphs.rewrites._graph import RewriteContext

__all__ = ["transposed_weight_products", "apply"]


_GEMM_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
"""Element types onnxruntime's CPU Gemm kernel has (1.19.2 to 1.32)."""


def transposed_weight_products(model: onnx.ModelProto) -> int:
    """Rewrites, in place, each ``MatMul(x, Transpose(V, perm=[1, 0]))`` of float or double
    values (torch's exporters' ``x @ W.T``; also through the Cast that
    :func:`bfloat16_in_float32` puts after a bfloat16 weight's Transpose) into
    ``Gemm(x, V, transB=1)`` over x's flattened leading axes, reshaped back: the forward, and
    through the Gemm rule the backward (dx = dY V, dV = dY^T x), read V as it is stored.
    Otherwise onnxruntime transposes V every step, or, with constant folding, keeps a
    transposed copy of a frozen weight beside it. The Transposes and Casts nothing reads any
    more are dropped. Needs the model's inferred types (value_info); returns how many
    products it rewrote (then infer them again)."""
    graph = model.graph
    types = {t.name: (t.data_type, len(t.dims)) for t in graph.initializer}
    for info in list(graph.input) + list(graph.value_info) + list(graph.output):
        tensor = info.type.tensor_type
        types[info.name] = (tensor.elem_type, len(tensor.shape.dim) if tensor.HasField("shape") else None)
    producers = {name: node for node in graph.node for name in node.output if name}
    names = set(types) | {n for node in graph.node for n in [*node.input, *node.output, node.name]}
    casts = {}  # (V, to): its Cast, written once for every product that reads it
    flattened = {}  # x: its Flatten, one for every product that reads it (their dx sum as 2-D Gemm outputs)
    nodes, changed = [], 0
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
        changed += 1
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


def apply(model: onnx.ModelProto, context: RewriteContext) -> int:
    """:func:`transposed_weight_products`."""
    return transposed_weight_products(model)
