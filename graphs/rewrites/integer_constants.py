"""Integer arithmetic on constants only (shape computations) folded into Constants, so that
onnx shape inference sees through it (:func:`fold_integer_constants`).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.graphs.context import FLOAT_ELEM_TYPES, constant_node_value
from normgrad.graphs.rewrites._graph import RewriteContext

__all__ = ["fold_integer_constants", "apply"]


_FOLDED_ELEMENTS = 4096
"""Integer constants folded larger than this stay computed (shape arithmetic is far smaller)."""


def fold_integer_constants(model: onnx.ModelProto) -> int:
    """Replaces, in place, each default-domain node whose inputs are all integer or bool
    constants (Constant nodes, initializers) and whose outputs are too by Constant nodes of
    its values (onnx's reference evaluator computes them); returns how many nodes.

    Shape arithmetic exporters write (TorchScript's nn.MultiheadAttention computes its q/k/v
    reshape target with Mod, Slice and Concat) then has constant operands, which onnx shape
    inference follows; float values, where gradients flow, are never folded, nor is data left in
    external files (an int4 model's packed weights, which no shape depends on)."""
    import onnx.reference

    graph = model.graph
    integer = lambda value: value.dtype.kind in "iub"  # noqa: E731
    constants = {t.name: onh.to_array(t) for t in graph.initializer
                 if t.data_type not in FLOAT_ELEM_TYPES and t.data_location != onnx.TensorProto.EXTERNAL}
    constants = {name: value for name, value in constants.items() if integer(value)}
    opsets = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    nodes, folded = [], 0
    for node in graph.node:
        inputs = [name for name in node.input if name]
        foldable = (
            node.domain in ("", "ai.onnx") and inputs and all(name in constants for name in inputs)
            and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        )
        if node.op_type == "Constant" or not foldable:
            value = constant_node_value(node) if node.op_type == "Constant" and node.attribute else None
            if value is not None and integer(value):
                constants[node.output[0]] = value
            nodes.append(node)
            continue
        operands = {name: constants[name] for name in inputs}
        single = oh.make_model(
            oh.make_graph([node], "fold", [oh.make_tensor_value_info(n, oh.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                                           for n, v in operands.items()],
                          [oh.make_empty_tensor_value_info(o) for o in node.output if o]),
            opset_imports=opsets,
        )
        try:
            values = [np.asarray(v) for v in onnx.reference.ReferenceEvaluator(single).run(None, operands)]
        except Exception:  # an op the reference evaluator lacks: leave it computed
            nodes.append(node)
            continue
        if not all(integer(v) and v.size <= _FOLDED_ELEMENTS for v in values):
            nodes.append(node)
            continue
        folded += 1
        for name, value in zip([o for o in node.output if o], values):
            constants[name] = value
            nodes.append(oh.make_node("Constant", [], [name], value=onh.from_array(value, name)))
    del graph.node[:]
    graph.node.extend(nodes)
    return folded


def apply(model: onnx.ModelProto, context: RewriteContext) -> int:
    """:func:`fold_integer_constants`."""
    return fold_integer_constants(model)
