"""bfloat16 arithmetic, which onnxruntime's CPU provider has no kernels for, is computed in
float32 from bfloat16 weights that stay stored as bfloat16 (:func:`bfloat16_in_float32`).
"""

from __future__ import annotations

from typing import Set

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.graphs.context import attr, reserve_name, value_types
from normgrad.graphs.rewrites._graph import RewriteContext

__all__ = ["bfloat16_values", "bfloat16_in_float32", "apply"]


_BFLOAT16_MOVES = frozenset({"Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Concat",
                             "Split", "Gather", "Shape"})
"""Ops whose CPU kernels onnxruntime (1.19.2 and 1.32, checked one by one) has for bfloat16:
data movement (and Cast); Expand, Where, Size and every arithmetic op have none."""


_DTYPE_ATTRIBUTES = {"RandomNormal": "dtype", "RandomUniform": "dtype", "RandomNormalLike": "dtype",
                     "RandomUniformLike": "dtype", "EyeLike": "dtype", "Bernoulli": "dtype"}


def bfloat16_values(tensor: onnx.TensorProto) -> np.ndarray:
    """A bfloat16 tensor's values, exactly, as float32 (the bfloat16 bits are the high half),
    whatever onnx's numpy_helper makes of bfloat16 in this version."""
    if tensor.HasField("raw_data"):
        bits = np.frombuffer(tensor.raw_data, dtype="<u2")
    else:
        bits = np.asarray(tensor.int32_data, dtype=np.uint32).astype(np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32).reshape(tuple(tensor.dims))


def bfloat16_in_float32(model: onnx.ModelProto) -> int:
    """Computes, in place, a model's bfloat16 arithmetic in float32, for onnxruntime's CPU
    provider, whose only bfloat16 kernels are Cast and data movement (:data:`_BFLOAT16_MOVES`).

    bfloat16 initializers and inputs stay bfloat16 (a frozen base keeps half the memory of
    float32); data movement on bfloat16 values stays bfloat16 (a Gather reads rows of a
    bfloat16 table), and every other node reads a bfloat16 input through its own
    Cast(to=FLOAT) placed right before it. Cast(to=BFLOAT16), bfloat16 Constants and
    ConstantOfShape, and the dtype of random ops become float32, so that what the exporter
    computed in bfloat16 is computed in float32 (more precisely than torch, which rounds
    each bfloat16 result). An output computed in bfloat16 (a causal LM's logits) becomes
    float32, its value before torch's rounding to bfloat16: onnxruntime's Python API cannot
    return bfloat16 arrays. Only the main graph is rewritten (a subgraph reading a bfloat16
    value keeps reading it as it is). Returns how many values it computes in float32 now."""
    bfloat16, float32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    graph = model.graph
    if not (any(t.data_type == bfloat16 for t in graph.initializer)
            or any(i.type.tensor_type.elem_type == bfloat16 for i in graph.input)
            or any((node.op_type == "Cast" and attr(node, "to", None) == bfloat16)
                   or (node.op_type == "Constant" and any(a.t.data_type == bfloat16 for a in node.attribute))
                   for node in graph.node)):
        return 0
    types = {name: value.tensor_type.elem_type for name, value in value_types(model).items()}
    names = {n for node in graph.node for n in [*node.input, *node.output, node.name]} | set(types)

    stored = {name for name in [i.name for i in graph.input] + [t.name for t in graph.initializer] if types.get(name) == bfloat16}
    computed: Set[str] = set()  # values that were bfloat16 and are now float32
    nodes = []
    for node in graph.node:
        read = [name for name in node.input if name in stored]
        outputs = [name for name in node.output if types.get(name) == bfloat16]
        if node.op_type == "Cast" or (node.op_type in _BFLOAT16_MOVES and not computed.intersection(node.input)):
            stored.update(outputs)
            if node.op_type == "Cast" and attr(node, "to", None) == bfloat16:
                next(a for a in node.attribute if a.name == "to").i = float32
                stored.difference_update(outputs)
                computed.update(outputs)
            nodes.append(node)
            continue
        casts = {}
        for name in dict.fromkeys(read):
            casts[name] = reserve_name(names, f"{name}_float32")
            nodes.append(oh.make_node("Cast", [name], [casts[name]], name=reserve_name(names, f"{node.name or node.op_type}_cast"), to=float32))
        node.input[:] = [casts.get(name, name) for name in node.input]
        for attribute in node.attribute:
            if attribute.name == "value" and attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == bfloat16:
                attribute.t.CopyFrom(onh.from_array(bfloat16_values(attribute.t), attribute.t.name))
            elif attribute.name == _DTYPE_ATTRIBUTES.get(node.op_type) and attribute.i == bfloat16:
                attribute.i = float32
        computed.update(outputs)
        nodes.append(node)
    for info in list(graph.value_info) + list(graph.output):
        if info.name in computed:
            info.type.tensor_type.elem_type = float32
    del graph.node[:]
    graph.node.extend(nodes)
    return len(computed)


def apply(model: onnx.ModelProto, context: RewriteContext) -> int:
    """:func:`bfloat16_in_float32`."""
    return bfloat16_in_float32(model)
