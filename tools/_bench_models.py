"""The models the benches time, shared by ``normgrad bench`` and its MPI section (:mod:`normgrad.tools.bench_mpi`)."""

from __future__ import annotations

import numpy as np
import onnx.helper as oh

from normgrad.graphs import examples

__all__ = ["resnet_forward"]


def resnet_forward(n: int, c: int, h: int, w: int):
    """The forward ONNX model of a ResNet basic block on x [n, c, h, w] (opset 17)."""
    rng = np.random.default_rng(42)
    std = np.sqrt(2.0 / (9 * c))  # He initialisation keeps the activations O(1)
    params = {
        "w1": (rng.standard_normal((c, c, 3, 3)) * std).astype(np.float32),
        "w2": (rng.standard_normal((c, c, 3, 3)) * std).astype(np.float32),
    }
    for i in (1, 2):
        params[f"s{i}"] = rng.uniform(0.5, 1.5, c).astype(np.float32)
        params[f"t{i}"] = (0.1 * rng.standard_normal(c)).astype(np.float32)
        params[f"m{i}"] = (0.1 * rng.standard_normal(c)).astype(np.float32)
        params[f"v{i}"] = rng.uniform(0.5, 1.5, c).astype(np.float32)
    nodes = [
        oh.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        oh.make_node("BatchNormalization", ["c1", "s1", "t1", "m1", "v1"], ["n1", "rm1", "rv1"], training_mode=1),
        oh.make_node("Relu", ["n1"], ["r1"]),
        oh.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        oh.make_node("BatchNormalization", ["c2", "s2", "t2", "m2", "v2"], ["n2", "rm2", "rv2"], training_mode=1),
        oh.make_node("Add", ["n2", "x"], ["sum"]),
        oh.make_node("Relu", ["sum"], ["y"]),
    ]
    return examples.model(nodes, {"x": (n, c, h, w)}, ["y"], params, opset=17, name="resnet_basic_block")
