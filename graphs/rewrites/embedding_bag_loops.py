"""The Loop torch's exporters write for ``nn.EmbeddingBag`` (sum or mean) becomes Gather +
MatMul by a bag-membership matrix (:func:`embedding_bags`).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.graphs.context import attr
from normgrad.graphs.rewrites._graph import RewriteContext, unique_name

__all__ = ["embedding_bags", "apply"]


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


def embedding_bags(model: onnx.ModelProto) -> int:
    """Rewrites, in place, the Loops torch's exporters write for ``nn.EmbeddingBag`` (offsets
    form, mode sum or mean; TorchScript: :func:`_embedding_bag_parts`, dynamo:
    :func:`_dynamo_embedding_bag_parts`) as Gather + MatMul: the rows summed per bag by a
    [bags, rows] 0/1 membership matrix (``starts[k] <= j < ends[k]``), divided by
    max(bag size, 1) for mean (an empty bag is 0, as in torch). Gradients then flow through
    the Gather and MatMul rules. Other Loops stay (and are refused where a gradient must
    pass). The matrix costs bags x len(ids) elements. Returns how many Loops it rewrote."""
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
            tag = unique_name(graph, f"{node.name or 'Loop'}/embedding_bag")
            rows = f"{tag}/rows"
            made = [oh.make_node("Gather", [weight, ids], [rows])]
            made += _bag_reduction(tag, rows, starts, ends, node.input[0], mode, node.output[0])
            replaced[id(node)] = made
            continue
        parts = _dynamo_embedding_bag_parts(graph, node, readers)
        if parts is not None:
            rows, bounds, mode, concat = parts
            tag = unique_name(graph, f"{node.name or 'Loop'}/embedding_bag")
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
        return 0
    kept = [new for node in graph.node if id(node) not in dropped for new in replaced.get(id(node), [node])]
    del graph.node[:]
    graph.node.extend(kept)
    return len(replaced)


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


def apply(model: onnx.ModelProto, context: RewriteContext) -> int:
    """:func:`embedding_bags`."""
    return embedding_bags(model)
