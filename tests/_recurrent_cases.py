"""Recurrent (RNN, GRU, LSTM) test cases, shared by the rule tests and the runtime tests."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh

from normgrad.ops import IR_VERSION


GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _case(kind, steps=4, batch=3, size=2, hidden=3, direction="forward", layout=0, bias=True, lens=None,
          initial=False, peephole=False, outputs=None, seed=0, **attrs):
    rng = np.random.default_rng(seed)
    directions = 2 if direction == "bidirectional" else 1
    gates = GATES[kind]
    values = {
        "X": rng.standard_normal((batch, steps, size) if layout else (steps, batch, size)),
        "W": rng.standard_normal((directions, gates * hidden, size)) * 0.6,
        "R": rng.standard_normal((directions, gates * hidden, hidden)) * 0.6,
    }
    if bias:
        values["B"] = rng.standard_normal((directions, 2 * gates * hidden)) * 0.5
    if lens is not None:
        values["sequence_lens"] = np.asarray(lens, np.int32)
    state_shape = (batch, directions, hidden) if layout else (directions, batch, hidden)
    if initial:
        values["initial_h"] = rng.standard_normal(state_shape) * 0.5
        if kind == "LSTM":
            values["initial_c"] = rng.standard_normal(state_shape) * 0.5
    if peephole:
        values["P"] = rng.standard_normal((directions, 3 * hidden)) * 0.5
    values = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in values.items()}
    names = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"][: {"LSTM": 8, "GRU": 6, "RNN": 6}[kind]]
    node_inputs = [n if n in values else "" for n in names]
    while not node_inputs[-1]:
        node_inputs.pop()
    all_outputs = ["Y", "Y_h", "Y_c"][: 3 if kind == "LSTM" else 2]
    outputs = outputs or all_outputs
    node_outputs = [o if o in outputs else "" for o in all_outputs]
    while not node_outputs[-1]:
        node_outputs.pop()
    node = oh.make_node(kind, node_inputs, node_outputs, hidden_size=hidden, direction=direction, layout=layout, **attrs)
    graph_inputs = [oh.make_tensor_value_info(n, onnx.TensorProto.INT32 if n == "sequence_lens" else onnx.TensorProto.FLOAT,
                                              list(values[n].shape)) for n in names if n in values]
    graph = oh.make_graph([node], "rnn", graph_inputs, [oh.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in outputs])
    forward = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=IR_VERSION)
    return forward, values, outputs
