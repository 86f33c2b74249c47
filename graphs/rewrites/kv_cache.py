"""Models with a KV cache (onnxruntime-genai's ``past_key_values.*`` inputs and ``present.*``
outputs) train without it: the graph inputs feeding only the past of com.microsoft
GroupQueryAttention nodes are dropped and those inputs omitted (a zero-length past: every
position of the batch is computed from scratch), the graph outputs that are only their
``present_*`` outputs are dropped (no gradient, nothing to feed back). A ``position_ids``
input of such a model is derived from ``attention_mask`` in the graph, as onnxruntime-genai
computes it for a prompt: the running count of attended positions minus one, 1 where masked.
The training data is then ``input_ids`` and ``attention_mask`` (and the labels).
"""

from __future__ import annotations

from typing import List

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.graphs.rewrites._graph import RewriteContext, unique_name, value_readers

__all__ = ["drop_kv_cache", "apply"]

_PAST_INPUTS, _PRESENT_OUTPUTS = (3, 4), (1, 2)
_CACHED_ATTENTION = {("com.microsoft", "GroupQueryAttention")}


def drop_kv_cache(model: onnx.ModelProto) -> int:
    """Drops, in place, the KV cache inputs and outputs of ``model``'s attention nodes (and
    derives ``position_ids`` from ``attention_mask`` when it drops any); returns how many graph
    inputs and outputs it dropped."""
    graph = model.graph
    attention = [n for n in graph.node if (n.domain, n.op_type) in _CACHED_ATTENTION]
    readers = value_readers(graph)
    fed = {i.name for i in graph.input}
    past = set()
    for node in attention:
        for index in _PAST_INPUTS:
            name = node.input[index] if len(node.input) > index else ""
            if name in fed and all((r.domain, r.op_type) in _CACHED_ATTENTION for r in readers[name]):
                past.add(name)
    for node in attention:
        node.input[:] = ["" if i in _PAST_INPUTS and name in past else name for i, name in enumerate(node.input)]
    present = {node.output[i] for node in attention for i in _PRESENT_OUTPUTS if len(node.output) > i} - {""}
    present -= {name for name in present if readers.get(name)}
    dropped_inputs = [i for i in graph.input if i.name in past]
    dropped_outputs = [o for o in graph.output if o.name in present]
    for info in dropped_inputs:
        graph.input.remove(info)
    for info in dropped_outputs:
        graph.output.remove(info)
    if dropped_inputs:
        _derive_position_ids(graph)
    return len(dropped_inputs) + len(dropped_outputs)


def _derive_position_ids(graph: onnx.GraphProto) -> None:
    """Replaces a ``position_ids`` graph input by ``Where(mask, CumSum(mask) - 1, 1)`` of ``attention_mask``."""
    inputs = {i.name: i for i in graph.input}
    if "position_ids" not in inputs or "attention_mask" not in inputs:
        return
    elem_type = inputs["position_ids"].type.tensor_type.elem_type
    names = [unique_name(graph, f"position_ids/{hint}") for hint in ("mask", "axis", "count", "one", "minus", "attended")]
    mask, axis, count, one, minus, attended = names
    nodes: List[onnx.NodeProto] = [
        oh.make_node("Cast", ["attention_mask"], [mask], to=onnx.TensorProto.INT64),
        oh.make_node("Constant", [], [axis], value=onh.from_array(np.asarray(1, np.int64))),
        oh.make_node("CumSum", [mask, axis], [count]),
        oh.make_node("Constant", [], [one], value=onh.from_array(np.asarray(1, np.int64))),
        oh.make_node("Sub", [count, one], [minus]),
        oh.make_node("Cast", [mask], [attended], to=onnx.TensorProto.BOOL),
        oh.make_node("Where", [attended, minus, one], [unique_name(graph, "position_ids/int64")]),
    ]
    nodes.append(oh.make_node("Cast", [nodes[-1].output[0]], ["position_ids"], to=elem_type))
    graph.input.remove(inputs["position_ids"])
    for node in reversed(nodes):
        graph.node.insert(0, node)


def apply(model: onnx.ModelProto, context: RewriteContext) -> int:
    """:func:`drop_kv_cache`."""
    return drop_kv_cache(model)
