"""A module's output and gradients against torch autograd, through both torch exporters: the check the
rule tests against torch share; skips without torch."""

from __future__ import annotations

import numpy as np
import pytest

from _transformer_blocks import _assert_gradients_match, _distinct_parameters, _export, _run_training

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional


class _Lambda(nn.Module):
    def __init__(self, fn, *layers):
        super().__init__()
        self.fn, self.layers = fn, nn.ModuleList(layers)

    def forward(self, x):
        return self.fn(x, *self.layers)


def _assert_matches_torch(forward, module, x, rng):
    """Output and gradients of x and every parameter for a random dy: torch autograd vs the training graph."""
    module.zero_grad()
    xt = torch.tensor(x, requires_grad=True)
    y = module(xt)
    dy = rng.standard_normal(tuple(y.shape)).astype(np.float32)
    y.backward(torch.tensor(dy))
    results, weights = _run_training(forward, {"x": x}, {"y": dy})
    np.testing.assert_allclose(results["y"], y.detach().numpy(), rtol=1e-5, atol=1e-5)
    _assert_gradients_match(results, weights, module, {"x": xt.grad.numpy()})


def _compare(module, x_shape, exporter, seed=0):
    """``module`` exported by ``exporter`` against torch autograd."""
    torch.manual_seed(seed)
    _distinct_parameters(module, seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(np.float32)
    try:
        forward = _export(module, (torch.tensor(x),), exporter, ["x"], ["y"])
    except torch.onnx.errors.UnsupportedOperatorError as error:  # the exporter's own gap, not ours
        pytest.skip(f"{exporter} exporter: {error}")
    _assert_matches_torch(forward, module, x, rng)
