"""Small forward models built in code, shared by the training-graph tests.

The builders live in the package (:mod:`normgrad.graphs.examples`) so that the corpus
generator (``normgrad corpus``) can use them without importing the tests.
"""

from normgrad.graphs.examples import (  # noqa: F401
    FLOAT,
    group_norm_block,
    instance_norm_block,
    mlp,
    model,
    resnet_block,
    style_transfer_block,
    unet_block,
    unet_block_torchscript,
    weights,
)


def run_training(training, batch: dict) -> dict:
    """Every output of ``training`` (a :class:`normgrad.graphs.TrainingGraph`) by name, run
    in onnxruntime's CPU provider with its weights' initial values and ``batch``."""
    import onnxruntime as ort

    session = ort.InferenceSession(training.model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, training.feeds(batch))))


def batch_norm_parameters(channels: int, seed: int = 0) -> dict:
    """Scale, bias, running mean and running variance ("s", "t", "m", "v") of a BatchNormalization."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return {
        "s": rng.uniform(0.5, 1.5, channels).astype(np.float32),
        "t": rng.standard_normal(channels).astype(np.float32),
        "m": rng.standard_normal(channels).astype(np.float32),
        "v": rng.uniform(0.5, 1.5, channels).astype(np.float32),
    }


def two_layer_model(scale: float = 1.0):
    """x [4, 32] -> Relu(x @ w1) @ w2 [4, 8]; w1 and w2 of 1 KiB or more (past the inline
    limit of external data), both scaled by ``scale``."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(scale * rng.standard_normal((32, 32)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(scale * rng.standard_normal((32, 8)).astype(np.float32) / 4, "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "two_layers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], [w1, w2])
    built = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    built.ir_version = 8
    return built
