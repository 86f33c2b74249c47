"""Slices of one value along one axis that together cover it exactly, each element once
(``rotate_half``'s ``x[..., :d/2]`` and ``x[..., d/2:]``), become one Split: its gradient is
a Concat, where the Slices' is a zero Pad each and a Sum (:func:`tiling_slices_as_split`).
"""

from __future__ import annotations

from typing import Dict

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.graphs.context import reserve_name
from normgrad.graphs.rewrites._graph import RewriteContext, constant_values

__all__ = ["tiling_slices_as_split", "apply"]


def _slice_interval(graph: onnx.GraphProto, node: onnx.NodeProto, shapes: Dict[str, list]):
    """(axis, start, end) of a Slice of one axis with step 1 and constant bounds, clamped to
    the static length of that axis of its input; None otherwise."""
    if node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or len(node.input) < 4:
        return None
    shape = shapes.get(node.input[0])
    values = [constant_values(graph, name) if name else None for name in list(node.input[1:5]) + [""] * (5 - len(node.input))]
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


def apply(model: onnx.ModelProto, context: RewriteContext) -> int:
    """:func:`tiling_slices_as_split`."""
    return tiling_slices_as_split(model)
