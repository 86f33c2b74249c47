"""Shared fixtures: the backends every operator test runs on, and closeness checks."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

import normgrad
from normgrad.ops import harness

FLOAT32_ONLY = {"python"}
# Relative tolerance per dtype, scaled by the magnitude of the expected values.
TOLERANCE = {np.dtype(np.float32): 2e-5, np.dtype(np.float16): 2e-3, np.dtype(ml_dtypes.bfloat16): 1.6e-2}


def cpp_available() -> bool:
    try:
        normgrad.library_path()
    except FileNotFoundError:
        if os.environ.get("NORMGRAD_REQUIRE_CPP") == "1":
            raise
        return False
    return True


@pytest.fixture(params=harness.BACKENDS)
def backend(request) -> str:
    if request.param == "cpp" and not cpp_available():
        pytest.skip("C++ library not built")
    return request.param


def assert_close(actual: np.ndarray, expected: np.ndarray, dtype=np.float32, what: str = "") -> None:
    """Asserts ``actual`` matches the float64 truth within ``dtype``'s tolerance."""
    actual = np.asarray(actual)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    expected64 = np.asarray(expected, dtype=np.float64)
    scale = max(1.0, float(np.abs(expected64).max())) if expected64.size else 1.0
    error = float(np.abs(actual.astype(np.float64) - expected64).max()) if expected64.size else 0.0
    assert error <= TOLERANCE[np.dtype(dtype)] * scale, f"{what}: max error {error:.3g} at scale {scale:.3g}"


def batch_norm_inputs(shape, t=np.float32, u=None, seed=0, offset=0.0) -> dict:
    """BatchNorm inputs for a random x of ``shape``: its batch statistics, a random dy and
    weight; grad_out/input in ``t``, the per-channel tensors in ``u`` (``t`` when None)."""
    u = t if u is None else u
    rng = np.random.default_rng(seed)
    x = rng.normal(offset, 1.0, size=shape)
    axes = (0,) + tuple(range(2, len(shape)))
    mean = x.mean(axis=axes) if x.size else np.zeros(shape[1])
    var = x.var(axis=axes) if x.size else np.ones(shape[1])
    return {
        "grad_out": rng.normal(size=shape).astype(t),
        "input": x.astype(t),
        "mean": mean.astype(u),
        "invstd": (1.0 / np.sqrt(var + 1e-5)).astype(u),
        "weight": rng.normal(size=shape[1]).astype(u),
    }


def run_all(backend: str, op_type: str, inputs: dict, **kwargs) -> dict:
    return harness.run(backend, op_type, inputs, **kwargs)


def with_relu_output(inputs: dict, seed: int = 0) -> dict:
    """``inputs`` plus ``relu_output`` y = max(z, 0) for a random z (a third of y exactly 0),
    with grad_out NaN or inf wherever y is 0: the fused ReLU backward must give exactly 0 there."""
    rng = np.random.default_rng(seed)
    dy = inputs["grad_out"]
    y = np.maximum(rng.normal(size=dy.shape) - 0.4, 0.0).astype(dy.dtype)
    blocked = y.astype(np.float64) <= 0
    poison = np.where(rng.random(dy.shape) < 0.5, np.nan, np.inf)
    return {**inputs, "grad_out": np.where(blocked, poison, dy.astype(np.float64)).astype(dy.dtype), "relu_output": y}


def relu_masked_truth(inputs: dict) -> dict:
    """The same inputs without ``relu_output``, grad_out masked explicitly: the definition
    of the fused input, for the references to be checked against."""
    y = inputs["relu_output"]
    masked = np.where(y.astype(np.float64) > 0, inputs["grad_out"].astype(np.float64), 0.0)
    return {**{k: v for k, v in inputs.items() if k != "relu_output"}, "grad_out": masked.astype(inputs["grad_out"].dtype)}
