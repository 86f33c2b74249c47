"""Each reader of a frozen bfloat16 weight's Cast gets its own Cast
(:func:`cast_stored_weights_per_reader`): run on the training graph after differentiation
(not a forward pass), so that no float32 copy of the base lives from the forward to the
backward.
"""

from __future__ import annotations

import copy
from typing import Dict

import onnx

from normgrad.graphs.context import reserve_name

__all__ = ["cast_stored_weights_per_reader"]


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
