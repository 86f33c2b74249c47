"""Small forward models built in code, shared by the training-graph tests."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

FLOAT = onnx.TensorProto.FLOAT


def model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Dict[str, Sequence],
    outputs: Sequence[str],
    initializers: Optional[Dict[str, np.ndarray]] = None,
    opset: int = 18,
    elem_type: int = FLOAT,
) -> onnx.ModelProto:
    """A model of ``nodes``; ``inputs`` maps names to shapes; output shapes are inferred."""
    graph = oh.make_graph(
        list(nodes),
        "test",
        [oh.make_tensor_value_info(name, elem_type, list(shape)) for name, shape in inputs.items()],
        [oh.make_tensor_value_info(name, elem_type, None) for name in outputs],
        initializer=[onh.from_array(value, name) for name, value in (initializers or {}).items()],
    )
    result = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    result.ir_version = 10
    inferred = onnx.shape_inference.infer_shapes(result)
    del result.graph.output[:]
    result.graph.output.extend(inferred.graph.output)
    return result


def weights(seed: int, **shapes: Sequence[int]) -> Dict[str, np.ndarray]:
    """Random float32 arrays by name."""
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape) * 0.5).astype(np.float32) for name, shape in shapes.items()}


def resnet_block(channels: int = 4, training: int = 1, opset: int = 15) -> onnx.ModelProto:
    """Conv-BN-ReLU-Conv-BN + skip, ReLU."""
    params = weights(1, w1=(channels, channels, 3, 3), w2=(channels, channels, 3, 3), b1=(channels,))
    for i in (1, 2):
        rng = np.random.default_rng(10 + i)
        params[f"s{i}"] = rng.uniform(0.5, 1.5, channels).astype(np.float32)
        params[f"t{i}"] = rng.standard_normal(channels).astype(np.float32)
        params[f"m{i}"] = rng.standard_normal(channels).astype(np.float32) * 0.1
        params[f"v{i}"] = rng.uniform(0.5, 1.5, channels).astype(np.float32)
    bn = dict(training_mode=training) if opset >= 14 else {}
    stats = lambda i: [f"n{i}", f"rm{i}", f"rv{i}"] if training else [f"n{i}"]
    nodes = [
        oh.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        oh.make_node("BatchNormalization", ["c1", "s1", "t1", "m1", "v1"], stats(1), **bn),
        oh.make_node("Relu", ["n1"], ["r1"]),
        oh.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        oh.make_node("BatchNormalization", ["c2", "s2", "t2", "m2", "v2"], stats(2), **bn),
        oh.make_node("Add", ["n2", "x"], ["sum"]),
        oh.make_node("Relu", ["sum"], ["y"]),
    ]
    return model(nodes, {"x": (2, channels, 5, 5)}, ["y"], params, opset=opset)


def group_norm_block(channels: int = 4, groups: int = 2, opset: int = 21) -> onnx.ModelProto:
    """Conv-GroupNormalization-SiLU (Sigmoid * x)."""
    scale_len = channels if opset >= 21 else groups
    params = weights(2, w=(channels, 3, 3, 3), b=(channels,))
    params["gamma"] = np.random.default_rng(3).uniform(0.5, 1.5, scale_len).astype(np.float32)
    params["beta"] = np.random.default_rng(4).standard_normal(scale_len).astype(np.float32)
    nodes = [
        oh.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        oh.make_node("GroupNormalization", ["c", "gamma", "beta"], ["n"], num_groups=groups, epsilon=1e-5),
        oh.make_node("Sigmoid", ["n"], ["s"]),
        oh.make_node("Mul", ["n", "s"], ["y"]),
    ]
    return model(nodes, {"x": (2, 3, 4, 4)}, ["y"], params, opset=opset)


def instance_norm_block(channels: int = 3) -> onnx.ModelProto:
    """Conv-InstanceNormalization-LeakyRelu."""
    params = weights(5, w=(channels, 2, 3, 3))
    params["gamma"] = np.random.default_rng(6).uniform(0.5, 1.5, channels).astype(np.float32)
    params["beta"] = np.random.default_rng(7).standard_normal(channels).astype(np.float32)
    nodes = [
        oh.make_node("Conv", ["x", "w"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1]),
        oh.make_node("InstanceNormalization", ["c", "gamma", "beta"], ["n"], epsilon=1e-5),
        oh.make_node("LeakyRelu", ["n"], ["y"], alpha=0.1),
    ]
    return model(nodes, {"x": (2, 2, 7, 7)}, ["y"], params, opset=17)


def mlp(classes: int = 3) -> onnx.ModelProto:
    """Gemm-Tanh-MatMul-Add."""
    params = weights(8, w1=(5, 6), b1=(6,), w2=(6, classes), b2=(classes,))
    nodes = [
        oh.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
        oh.make_node("Tanh", ["h"], ["a"]),
        oh.make_node("MatMul", ["a", "w2"], ["z"]),
        oh.make_node("Add", ["z", "b2"], ["y"]),
    ]
    return model(nodes, {"x": ("N", 5)}, ["y"], params)
