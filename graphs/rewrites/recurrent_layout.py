"""LSTM, GRU and RNN with ``layout=1`` (batch first), which onnxruntime's CPU kernels refuse,
become ``layout=0`` nodes between Transposes of X, the initial states and the outputs
(:func:`recurrent_layout_0`); the gradient rules then see time-major nodes only.
"""

from __future__ import annotations

import onnx
import onnx.helper as oh

from normgrad.graphs.context import attr
from normgrad.graphs.rewrites._graph import RewriteContext, unique_name

__all__ = ["recurrent_layout_0", "apply"]


_RECURRENT_STATE_INPUTS = {"LSTM": (5, 6), "GRU": (5,), "RNN": (5,)}


def recurrent_layout_0(model: onnx.ModelProto) -> int:
    """Rewrites, in place, each LSTM/GRU/RNN with ``layout=1`` (X [B, T, I], states
    [B, D, H], Y [B, T, D, H]) as a ``layout=0`` node with its X and initial states
    transposed in and its outputs transposed out (names unchanged); returns how many."""
    graph = model.graph
    if not any(n.op_type in _RECURRENT_STATE_INPUTS and attr(n, "layout", 0) == 1 for n in graph.node):
        return 0
    kept, rewritten = [], 0
    for node in graph.node:
        if node.op_type not in _RECURRENT_STATE_INPUTS or attr(node, "layout", 0) != 1:
            kept.append(node)
            continue
        tag = unique_name(graph, f"{node.name or node.op_type}/time_major")
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
        rewritten += 1
    del graph.node[:]
    graph.node.extend(kept)
    return rewritten


def apply(model: onnx.ModelProto, context: RewriteContext) -> int:
    """:func:`recurrent_layout_0`."""
    return recurrent_layout_0(model)
