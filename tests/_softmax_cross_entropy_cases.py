"""SoftmaxCrossEntropy test cases and their float64 truths, shared by the plain and the bias-fused loss tests."""

from __future__ import annotations

import numpy as np


def _truth(x, labels, ignore_index=None):
    """float64 torch-style mean cross-entropy and its gradient, by log-sum-exp; with every
    sample ignored, NaN (0 / 0) for both, as the loss's standard-op form gives."""
    x = x.astype(np.float64)
    counted = np.ones(len(labels), bool) if ignore_index is None else labels != ignore_index
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        shifted = x - np.max(x, axis=1, keepdims=True)  # kept apart: 1e30 + log(C) would round to 1e30
        exps = np.exp(shifted)
        log_probs = shifted - np.log(np.sum(exps, axis=1, keepdims=True))
        safe = np.where(counted, labels, 0)
        picked = log_probs[np.arange(len(labels)), safe]
        count = counted.sum()
        loss = -np.sum(np.where(counted, picked, picked * 0)) / count
        onehot = np.zeros_like(x)
        onehot[np.arange(len(labels)), safe] = counted
        weight = (counted / count)[:, None]
        grad = (exps / np.sum(exps, axis=1, keepdims=True) - onehot) * weight
    return loss, grad


def _case(name, seed=0):
    """(logits, labels, attributes, ignore_index) of a named case."""
    rng = np.random.default_rng(seed)
    shape = {"large C": (64, 8195), "odd": (7, 11), "one class": (5, 1)}.get(name, (33, 300))
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    labels = rng.integers(0, shape[1], shape[0])
    ignore = None
    if name == "far apart":  # most labels' probabilities far below float32's smallest
        x = (rng.standard_normal(shape) * 60 + rng.uniform(-500, 500, (shape[0], 1))).astype(np.float32)
    elif name == "huge":
        x = (rng.choice([-1e30, 0.0, 1e30], shape) + rng.standard_normal(shape)).astype(np.float32)
    elif name == "-inf":  # masked classes; a label on one gives an infinite loss
        x[:, ::4] = -np.inf
        labels[0] = 0
    elif name in ("nan", "+inf"):
        x[3, 7] = np.nan if name == "nan" else np.inf
    elif name == "ignore -100":
        ignore = -100
        labels[::3] = ignore
    elif name == "ignore a class":
        ignore = 2
    elif name == "all ignored":
        ignore = -100
        labels[:] = ignore
    attributes = {} if ignore is None else {"ignore_index": ignore}
    return x, labels, attributes, ignore


CASES = ["odd", "large C", "one class", "far apart", "huge", "-inf", "nan", "+inf", "ignore -100", "ignore a class",
         "all ignored"]


def _compare(loss, grad, x, labels, ignore):
    expected_loss, expected_grad = _truth(x, labels, ignore)
    assert loss.shape in ((), (1,)) and grad.shape == x.shape and grad.dtype == np.float32  # (1,): the Python bridge's scalar
    loss = loss.reshape(())
    if np.isfinite(expected_loss):
        assert abs(float(loss) - expected_loss) <= 2e-6 * max(1.0, abs(expected_loss)), (float(loss), expected_loss)
    else:
        np.testing.assert_equal(float(loss), expected_loss)
    count = len(labels) if ignore is None else max(1, int((labels != ignore).sum()))
    np.testing.assert_allclose(grad, expected_grad, rtol=2e-5, atol=1e-6 / count)
