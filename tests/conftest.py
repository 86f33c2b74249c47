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
