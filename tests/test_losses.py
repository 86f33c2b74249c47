"""The elementwise losses against torch.nn.functional and float64 finite differences."""

import numpy as np
import onnxruntime as ort
import pytest

from normgrad.graphs import build_training_graph, examples


def _run(loss, x, labels):
    training = build_training_graph(examples.mlp(), loss=loss)
    session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    y, value, w2_grad = session.run(["y", "loss", "w2_grad"], {"x": x, "labels": labels})
    return y, float(value), w2_grad


def _labels(loss, rng, shape):
    if loss == "bce_with_logits":
        return rng.uniform(0, 1, shape).astype(np.float32)
    return (rng.standard_normal(shape) * 2).astype(np.float32)


@pytest.mark.parametrize("loss", ["bce_with_logits", "l1", "smooth_l1"])
def test_loss_matches_torch(loss):
    torch = pytest.importorskip("torch")
    functional = {"bce_with_logits": torch.nn.functional.binary_cross_entropy_with_logits,
                  "l1": torch.nn.functional.l1_loss, "smooth_l1": torch.nn.functional.smooth_l1_loss}[loss]
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 5)) * 3).astype(np.float32)
    y, value, _ = _run(loss, x, labels := _labels(loss, rng, (6, 3)))
    y_torch = torch.tensor(y.astype(np.float64), requires_grad=True)
    expected = functional(y_torch, torch.tensor(labels.astype(np.float64)))
    assert abs(value - expected.item()) <= 1e-6 * max(1.0, abs(expected.item()))


@pytest.mark.parametrize("loss", ["bce_with_logits", "l1", "smooth_l1"])
def test_loss_gradient_matches_finite_differences(loss):
    """d loss / d b2 in the graph vs float64 central differences of the loss through the graph's own forward."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((6, 5)) * 3).astype(np.float32)
    labels = _labels(loss, rng, (6, 3))
    training = build_training_graph(examples.mlp(), loss=loss)
    session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    y, b2_grad = session.run(["y", "b2_grad"], {"x": x, "labels": labels})
    y64, t = y.astype(np.float64), labels.astype(np.float64)

    def loss64(shift):
        d = y64 + shift - t
        if loss == "bce_with_logits":
            z = y64 + shift
            return np.mean(np.maximum(z, 0) - z * t + np.log1p(np.exp(-np.abs(z))))
        if loss == "l1":
            return np.mean(np.abs(d))
        return np.mean(np.where(np.abs(d) < 1, 0.5 * d * d, np.abs(d) - 0.5))

    h = 1e-6
    expected = np.array([(loss64(h * np.eye(3)[j]) - loss64(-h * np.eye(3)[j])) / (2 * h) for j in range(3)])
    np.testing.assert_allclose(b2_grad, expected, rtol=0, atol=1e-5 * max(1.0, np.abs(expected).max()))
