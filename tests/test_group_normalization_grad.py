"""GroupNormalizationGrad on every backend against the float64 reference and finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import assert_close

from normgrad.ops import group_normalization_grad as gng
from normgrad.ops import harness

OP = gng.OP_TYPE
# (x shape, gamma shape): full gamma as in CANN, broadcast gammas, odd sizes, G = 1, N = 1.
CASES = [
    ((2, 3, 4), (2, 3, 4)),
    ((2, 3, 2, 5), (1, 3, 2, 1)),
    ((1, 4, 3, 7), (4, 3, 1)),
    ((3, 1, 5), (1,)),
    ((2, 2, 3, 2, 3), (1, 2, 3, 1, 1)),
    ((1, 2, 1, 1), (1, 2, 1, 1)),
]


def make_inputs(x_shape, gamma_shape, seed=0, stats_dtype=np.float32, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.normal(0.5, 2.0, size=x_shape)
    grouped = x.reshape(x_shape[0], x_shape[1], -1) if x.size else np.zeros(x_shape[:2] + (1,))
    return {
        "x": x.astype(dtype),
        "dy": rng.normal(size=x_shape).astype(dtype),
        "gamma": rng.normal(1.0, 0.5, size=gamma_shape).astype(dtype),
        "mean": grouped.mean(-1).astype(stats_dtype),
        "rstd": (1 / np.sqrt(grouped.var(-1) + 1e-5)).astype(stats_dtype),
    }


@pytest.mark.parametrize("x_shape,gamma_shape", CASES, ids=str)
def test_matches_reference(backend, x_shape, gamma_shape):
    inputs = make_inputs(x_shape, gamma_shape, seed=len(x_shape))
    expected = gng.reference(**inputs)
    actual = harness.run(backend, OP, inputs)
    for name, value in zip(gng.OUTPUTS, expected):
        assert_close(actual[name], value, what=name)


def _group_norm(x, gamma, beta, groups_shape):
    grouped = x.reshape(groups_shape)
    mean = grouped.mean(-1, keepdims=True)
    var = grouped.var(-1, keepdims=True)
    return ((grouped - mean) / np.sqrt(var + 1e-5)).reshape(x.shape) * gamma + beta


@pytest.mark.parametrize("gamma_shape", [(2, 3, 2, 2), (1, 3, 2, 1), (3, 1, 1)], ids=str)
def test_gradients_match_finite_differences(gamma_shape):
    """dx, dgamma, dbeta are the derivatives of sum(dy * GroupNorm(x)), statistics recomputed."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 3, 2, 2))
    dy = rng.normal(size=x.shape)
    gamma = rng.normal(1.0, 0.5, size=gamma_shape)
    beta = rng.normal(size=gamma_shape)
    groups = (2, 3, -1)
    grouped = x.reshape(groups)
    mean, rstd = grouped.mean(-1), 1 / np.sqrt(grouped.var(-1) + 1e-5)
    result = gng.reference(x, dy, gamma, mean, rstd)

    def numeric(wrt, h=1e-6):
        args = {"x": x, "gamma": gamma, "beta": beta}
        grad = np.zeros_like(args[wrt])
        for index in np.ndindex(grad.shape):
            values = []
            for step in (h, -h):
                moved = dict(args)
                moved[wrt] = args[wrt].copy()
                moved[wrt][index] += step
                values.append((dy * _group_norm(moved["x"], moved["gamma"], moved["beta"], groups)).sum())
            grad[index] = (values[0] - values[1]) / (2 * h)
        return grad

    np.testing.assert_allclose(result.dx, numeric("x"), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(result.dgamma, numeric("gamma"), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(result.dbeta, numeric("beta"), rtol=1e-6, atol=1e-7)


def test_cann_formula_is_not_the_gradient():
    """CANN's dx = rstd/M*gamma*(M*dy - s1 - x_hat*s2) is the gradient only where gamma is 1."""
    per_channel = make_inputs((2, 4, 3, 5), (1, 4, 3, 1), seed=6)
    true = gng.reference(**per_channel).dx.astype(np.float64)
    cann = gng.cann_formula(**per_channel)
    assert np.abs(cann - true).max() > 0.1 * np.abs(true).max()
    constant = dict(per_channel, gamma=np.full((1, 4, 1, 1), 1.7, np.float32))
    cann = gng.cann_formula(**constant)
    assert np.abs(cann - gng.reference(**constant).dx).max() > 0.1 * np.abs(cann).max()
    constant = dict(per_channel, gamma=np.ones((1, 4, 1, 1), np.float32))
    np.testing.assert_allclose(
        gng.cann_formula(**constant), gng.reference(**constant).dx.astype(np.float64), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("x_shape", [(0, 2, 3), (2, 2, 0), (2, 2, 0, 3)], ids=str)
def test_empty_input(backend, x_shape):
    inputs = make_inputs(x_shape, (1, 2) + (1,) * (len(x_shape) - 2))
    actual = harness.run(backend, OP, inputs)
    assert actual["dx"].shape == x_shape
    np.testing.assert_array_equal(actual["dgamma"], np.zeros(inputs["gamma"].shape, np.float32))
    np.testing.assert_array_equal(actual["dbeta"], np.zeros(inputs["gamma"].shape, np.float32))


@pytest.mark.parametrize("wanted", [["dx"], ["dx", "dgamma"], ["dx", "dbeta"]], ids=str)
def test_optional_outputs(backend, wanted):
    if backend == "python":
        pytest.skip("the Python bridge needs every output named")
    inputs = make_inputs((2, 3, 4, 2), (1, 3, 4, 1), seed=7)
    expected = dict(zip(gng.OUTPUTS, gng.reference(**inputs)))
    actual = harness.run(backend, OP, inputs, outputs=wanted)
    assert sorted(actual) == sorted(wanted)
    for name in wanted:
        assert_close(actual[name], expected[name], what=name)


def test_float32_statistics_with_float16_data(backend):
    if backend == "python":
        pytest.skip("the Python bridge is float32 only")
    inputs = make_inputs((2, 2, 3, 4), (1, 2, 3, 1), seed=8, dtype=np.float16, stats_dtype=np.float32)
    expected = gng.reference(**inputs)
    actual = harness.run(backend, OP, inputs)
    for name, value in zip(gng.OUTPUTS, expected):
        assert actual[name].dtype == np.float16
        assert_close(actual[name], value, dtype=np.float16, what=name)


def test_deterministic(backend):
    inputs = make_inputs((4, 8, 16, 33 * 31), (1, 8, 16, 1), seed=9)
    # Bitwise equal across runs and across intra-op thread counts (onnxruntime backends).
    first, second = harness.run(backend, OP, inputs, threads=1), harness.run(backend, OP, inputs, threads=3)
    for name in gng.OUTPUTS:
        np.testing.assert_array_equal(first[name], second[name])
