"""BatchNormReduceBackward on every backend against the float64 reference and finite differences."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _helpers import assert_close, batch_norm_inputs, relu_masked_truth, with_relu_output

from normgrad.ops import batch_norm_reduce_backward as bnr
from normgrad.ops import NormgradInputError, harness

OP = bnr.OP_TYPE
SHAPES = [(4, 3), (2, 1, 7), (1, 5, 3, 2, 3), (3, 2, 5, 5), (1, 1, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(backend, shape):
    inputs = batch_norm_inputs(shape, seed=len(shape))
    expected = bnr.reference(**inputs)
    actual = harness.run(backend, OP, inputs)
    for name, value in zip(bnr.OUTPUTS, expected):
        assert_close(actual[name], value, what=name)


def test_gradients_match_finite_differences():
    """grad_weight and grad_bias are the derivatives of sum(dy * BatchNorm(x)) in weight and bias."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 4, 5))
    dy = rng.normal(size=x.shape)
    weight, bias = rng.normal(size=4), rng.normal(size=4)
    mean, var = x.mean(axis=(0, 2)), x.var(axis=(0, 2))
    invstd = 1 / np.sqrt(var + 1e-5)

    def loss(w, b):
        y = (x - mean[None, :, None]) * invstd[None, :, None] * w[None, :, None] + b[None, :, None]
        return float((dy * y).sum())

    def central(f, v, i, h=1e-6):
        up, down = v.copy(), v.copy()
        up[i] += h
        down[i] -= h
        return (f(up) - f(down)) / (2 * h)

    result = bnr.reference(dy, x, mean, invstd, weight)
    fd_weight = [central(lambda w: loss(w, bias), weight, c) for c in range(4)]
    fd_bias = [central(lambda b: loss(weight, b), bias, c) for c in range(4)]
    np.testing.assert_allclose(result.grad_weight, fd_weight, rtol=1e-7, atol=1e-7)
    np.testing.assert_allclose(result.grad_bias, fd_bias, rtol=1e-7, atol=1e-7)
    np.testing.assert_allclose(result.sum_dy_xmu, result.grad_weight / invstd, rtol=1e-12)


def test_large_mean_does_not_cancel(backend):
    """|mean| >> std: sum(dy*x) - mean*sum(dy) would lose every digit in float32."""
    inputs = batch_norm_inputs((8, 3, 64), seed=2, offset=1e4)
    expected = bnr.reference(**inputs).sum_dy_xmu
    actual = harness.run(backend, OP, inputs)["sum_dy_xmu"]
    assert_close(actual, expected, what="sum_dy_xmu")
    x64, dy64 = inputs["input"].astype(np.float64), inputs["grad_out"].astype(np.float64)
    cancelling = (dy64 * x64).sum(axis=(0, 2)).astype(np.float32) - inputs["mean"] * dy64.sum(axis=(0, 2)).astype(
        np.float32
    )
    assert np.abs(cancelling - expected).max() > 100 * np.abs(actual - expected).max()


@pytest.mark.parametrize("shape", [(0, 3, 4), (2, 3, 0), (0, 2)], ids=str)
def test_empty_input_gives_zero_sums(backend, shape):
    inputs = batch_norm_inputs(shape)
    actual = harness.run(backend, OP, inputs)
    for name in bnr.OUTPUTS:
        np.testing.assert_array_equal(actual[name], np.zeros(shape[1], np.float32), err_msg=name)


FLAG_SETS = [dict(zip(bnr.ATTRIBUTES, bits)) for bits in itertools.product((0, 1), repeat=3)]


@pytest.mark.parametrize("flags", FLAG_SETS, ids=lambda f: "".join(str(v) for v in f.values()))
@pytest.mark.parametrize("with_weight", [True, False])
def test_flags_and_optional_io(backend, flags, with_weight):
    if backend == "python" and (not with_weight or not all(flags.values())):
        pytest.skip("the Python bridge needs every input and output named")
    inputs = batch_norm_inputs((2, 3, 4), seed=3)
    if not with_weight:
        inputs["weight"] = None
    wanted = [name for name in bnr.OUTPUTS if flags[bnr.OUTPUT_FLAGS[name]]]
    if not wanted:
        pytest.skip("a node needs at least one output")
    expected = dict(zip(bnr.OUTPUTS, bnr.reference(**inputs, **flags)))
    actual = harness.run(backend, OP, inputs, outputs=wanted, attributes=flags)
    assert sorted(actual) == sorted(wanted)
    for name in wanted:
        assert_close(actual[name], expected[name], what=name)


def test_reference_leaves_flagged_off_outputs_unset():
    result = bnr.reference(**batch_norm_inputs((2, 3)), input_g=0, weight_g=1, bias_g=0)
    assert result.sum_dy is None and result.sum_dy_xmu is None and result.grad_bias is None
    assert result.grad_weight is not None


def test_deterministic(backend):
    inputs = batch_norm_inputs((8, 16, 33, 31), seed=4)
    # Bitwise equal across runs and across intra-op thread counts (onnxruntime backends).
    first, second = harness.run(backend, OP, inputs, threads=1), harness.run(backend, OP, inputs, threads=3)
    for name in bnr.OUTPUTS:
        np.testing.assert_array_equal(first[name], second[name])


@pytest.mark.parametrize("shape", [(6, 3), (2, 3, 70), (3, 4, 9, 11)], ids=str)
def test_relu_output_masks_grad_out(backend, shape):
    """Every backend against the float64 truth: grad_out masked by relu_output > 0 as a
    select (NaN/inf grad_out where relu_output is 0 contributes exactly 0)."""
    inputs = with_relu_output(batch_norm_inputs(shape, seed=5), seed=6)
    truth = bnr.reference(**relu_masked_truth(inputs))
    assert all(np.isfinite(value).all() for value in truth)
    np.testing.assert_array_equal(bnr.reference(**inputs), truth)  # the reference's own select
    actual = harness.run(backend, OP, inputs)
    for name in bnr.OUTPUTS:
        assert_close(actual[name], getattr(truth, name), what=name)


@pytest.mark.parametrize("value", [2.0, 0.0, -1.0])
def test_relu_output_scalar_is_one_mask_for_all(backend, value):
    inputs = batch_norm_inputs((2, 3, 40), seed=7)
    inputs["relu_output"] = np.float32(value)
    expected = bnr.reference(**batch_norm_inputs((2, 3, 40), seed=7)) if value > 0 else None
    actual = harness.run(backend, OP, inputs)
    for name in bnr.OUTPUTS:
        want = getattr(expected, name) if value > 0 else np.zeros(3, np.float32)
        assert_close(actual[name], want, what=name)


@pytest.mark.parametrize("bad, message", [
    (lambda x: np.ones((2, 3, 5), np.float32), "'relu_output' must have the shape of 'input' \\[2, 3, 4\\] or be a scalar"),
    (lambda x: np.ones((2, 3, 4), np.float16), "'relu_output' must have the dtype of 'input'"),
])
def test_relu_output_validation(bad, message):
    inputs = batch_norm_inputs((2, 3, 4))
    with pytest.raises(NormgradInputError, match=message):
        bnr.reference(**inputs, relu_output=bad(inputs["input"]))
