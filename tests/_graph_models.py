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
