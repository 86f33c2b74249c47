"""What normgrad does to every graph it writes so that onnxruntime has nothing to warn about
when it loads it: onnxruntime logs one warning per initializer that no node reads ("Removing
initializer ... It is not used by any node") and per CastLike whose inputs are constants
("Could not find a CPU kernel and hence can't constant fold CastLike node"), at every session
creation. Both are fixed in the graph, not by lowering the log level."""

from __future__ import annotations

from typing import Dict, Set

import onnx
from onnx import helper

from normgrad.graphs.structure import subgraph_captures
from normgrad.ops import DOMAIN, OPSET_VERSION

__all__ = ["read_names", "prune_unused_initializers", "cast_like_to_cast", "tidy"]


def read_names(graph: onnx.GraphProto) -> Set[str]:
    """Every value name a node of ``graph`` reads, its subgraphs' outer-scope reads included."""
    names = {name for node in graph.node for name in [*node.input, *subgraph_captures(node)]}
    names.discard("")
    return names


def prune_unused_initializers(graph: onnx.GraphProto) -> int:
    """Removes the initializers of ``graph`` that no node reads and that are neither a graph
    input nor a graph output, and the Constant nodes whose output nothing reads (onnxruntime
    turns those into initializers, then warns that they are unused); returns how many."""
    keep = read_names(graph) | {i.name for i in graph.input} | {o.name for o in graph.output}
    unused = [t for t in graph.initializer if t.name not in keep]
    for tensor in unused:
        graph.initializer.remove(tensor)
    constants = [n for n in graph.node if n.op_type == "Constant" and n.domain in ("", "ai.onnx")
                 and not any(o in keep for o in n.output)]
    for node in constants:
        graph.node.remove(node)
    return len(unused) + len(constants)


def _weightless(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers of 1 KiB or more are graph inputs of their type
    and shape: what shape inference needs of them, without copying a large model's weights
    (shape inference serializes the model, and parses what it returns)."""
    graph = model.graph
    skeleton = onnx.ModelProto(ir_version=model.ir_version)
    skeleton.opset_import.extend(model.opset_import)
    if not any(o.domain == DOMAIN for o in model.opset_import) and any(n.domain == DOMAIN for n in model.graph.node):
        # the normgrad nodes a training graph has before add_functions imports their domain
        skeleton.opset_import.append(helper.make_opsetid(DOMAIN, OPSET_VERSION))
    skeleton.functions.extend(model.functions)
    target = skeleton.graph
    target.name = graph.name
    for field in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(target, field).extend(getattr(graph, field))
    declared = {i.name for i in graph.input}
    for tensor in graph.initializer:
        if tensor.ByteSize() < 1024:
            target.initializer.append(tensor)
        elif tensor.name not in declared:
            target.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    return skeleton


def _element_types(model: onnx.ModelProto) -> Dict[str, int]:
    graph = model.graph
    types = {t.name: t.data_type for t in graph.initializer}
    try:
        inferred = onnx.shape_inference.infer_shapes(_weightless(model)).graph
    except Exception:  # a graph shape inference cannot follow: use what it declares
        inferred = graph
    for info in [*inferred.input, *inferred.value_info, *inferred.output, *graph.value_info]:
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
            types.setdefault(info.name, info.type.tensor_type.elem_type)
    return types


def cast_like_to_cast(model: onnx.ModelProto) -> int:
    """Rewrites each default-domain ``CastLike(x, like)`` of the main graph whose ``like`` has a
    known element type as ``Cast(x, to=that type)`` (the same values; onnxruntime's CPU
    provider has no CastLike kernel to fold a constant one with); returns how many."""
    if not any(node.op_type == "CastLike" and node.domain in ("", "ai.onnx") for node in model.graph.node):
        return 0  # shape inference of a graph of 10^6 nodes takes a gigabyte
    types = _element_types(model)
    count = 0
    for index, node in enumerate(model.graph.node):
        if node.op_type != "CastLike" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        to = types.get(node.input[1])
        if not to:
            continue
        cast = helper.make_node("Cast", [node.input[0]], list(node.output), name=node.name, to=to)
        cast.attribute.extend(a for a in node.attribute if a.name == "saturate")
        model.graph.node[index].CopyFrom(cast)
        count += 1
    return count


def tidy(model: onnx.ModelProto, cast_like: bool = True) -> onnx.ModelProto:
    """``model`` (changed in place and returned) without unused initializers and, with
    ``cast_like``, with CastLike nodes as Cast (:func:`cast_like_to_cast`)."""
    if cast_like:
        cast_like_to_cast(model)
    prune_unused_initializers(model.graph)
    return model
