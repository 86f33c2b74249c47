"""Attention graphs whose softmax backward the softmax tests check."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.ops import DOMAIN, IR_VERSION


def _attention(dtype=onnx.TensorProto.FLOAT, axis=-1, safe=True):
    """scores = (x w_q)(x w_k)^T + mask; p = Softmax; torch's safe softmax Where(IsNaN(p), 0, p)
    (``safe``); p (x w_v) w_o, with a causal mask."""
    rng = np.random.default_rng(0)
    np_dtype = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    inits = [onh.from_array((rng.standard_normal((6, 6)) * 0.5).astype(np_dtype), name)
             for name in ("w_q", "w_k", "w_v", "w_o")]
    mask = np.zeros((5, 5), np_dtype)
    mask[np.triu_indices(5, 1)] = -np.inf
    inits.append(onh.from_array(mask, "mask"))
    nodes = [oh.make_node("Constant", [], ["zero"], value=onh.from_array(np.zeros((), np_dtype)))]  # as exporters write it
    nodes += [oh.make_node("MatMul", ["x", "w_q"], ["q"]), oh.make_node("MatMul", ["x", "w_k"], ["k"]),
             oh.make_node("MatMul", ["x", "w_v"], ["v"]), oh.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             oh.make_node("MatMul", ["q", "kt"], ["s0"]), oh.make_node("Add", ["s0", "mask"], ["scores"]),
             oh.make_node("Softmax", ["scores"], ["p"], axis=axis)]
    if safe:
        nodes += [oh.make_node("IsNaN", ["p"], ["nan"]), oh.make_node("Where", ["nan", "zero", "p"], ["weights"])]
    else:
        nodes += [oh.make_node("Identity", ["p"], ["weights"])]
    nodes += [oh.make_node("MatMul", ["weights", "v"], ["h"]), oh.make_node("MatMul", ["h", "w_o"], ["y"])]
    graph = oh.make_graph(nodes, "attention", [oh.make_tensor_value_info("x", dtype, [3, 5, 6])],
                          [oh.make_tensor_value_info("y", dtype, [3, 5, 6])], inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=IR_VERSION)


def _ops(model, domain=DOMAIN):
    return [n.op_type for n in model.graph.node if n.domain == domain]
