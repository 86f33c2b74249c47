"""Small step graphs, their batches and session options, shared by the Trainer tests."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from normgrad.graphs import build_step_graph, build_training_graph
from normgrad.ops import IR_VERSION


def _linear_tanh_linear(batch="batch"):
    """Linear(8, 16) - tanh - Linear(16, 5) on x [N, 3, 8] as torch exports a Linear on a 3-D
    input: MatMul(x, Transpose(W)) + b; output y [N, 3, 5] (for cross_entropy: 3 classes,
    labels [N, 5])."""
    rng = np.random.default_rng(0)
    weights = {"a.weight": rng.standard_normal((16, 8)) * 0.4, "a.bias": rng.standard_normal(16) * 0.1,
               "b.weight": rng.standard_normal((5, 16)) * 0.4, "b.bias": rng.standard_normal(5) * 0.1}
    nodes = []
    for layer, source, target in (("a", "x", "h"), ("b", "t", "y")):
        nodes += [helper.make_node("Transpose", [f"{layer}.weight"], [f"{layer}.wt"], perm=[1, 0]),
                  helper.make_node("MatMul", [source, f"{layer}.wt"], [f"{layer}.mm"]),
                  helper.make_node("Add", [f"{layer}.mm", f"{layer}.bias"], [target])]
        if layer == "a":
            nodes.append(helper.make_node("Tanh", ["h"], ["t"]))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3, 5])],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = IR_VERSION
    return model


def _step(loss="mse", kind="sgd", loss_options=None, **options):
    training = build_training_graph(_linear_tanh_linear(), loss=loss, loss_options=loss_options)
    return build_step_graph(training, kind, **options)


def _options(level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    return options


def _mse_batch(seed=1, n=4):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 3, 8)).astype(np.float32),
            "labels": rng.standard_normal((n, 3, 5)).astype(np.float32)}
