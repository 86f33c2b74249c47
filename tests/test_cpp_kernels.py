"""The compiled kernels (``session_options("cpp")``) against the float64 NumPy references.

Covers every (T, U) dtype pair, odd and empty shapes, omitted optional inputs and outputs in
every combination (trailing and ""), bitwise determinism across intra-op thread counts, the
portable (non-AVX2) kernels, and a battery of bad inputs, each in its own subprocess so that
a crash fails the test instead of killing the run.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import subprocess
import sys

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper

import normgrad
from normgrad.ops import DOMAIN, IR_VERSION, ONNX_OPSET, OPSET_VERSION
from _helpers import batch_norm_inputs as bn_inputs
from _helpers import relu_masked_truth, with_relu_output
from normgrad.ops import batch_norm_elemt_backward as bne
from normgrad.ops import harness
from normgrad.ops import batch_norm_reduce_backward as bnr
from normgrad.ops import group_normalization_grad as gng
from normgrad.ops import layer_normalization_grad as lng
from normgrad.ops import rms_normalization_grad as rmsg
from normgrad.ops import _common
from normgrad.ops._common import tensor_type

try:
    normgrad.library_path()
except FileNotFoundError:  # pragma: no cover - depends on the install
    if os.environ.get("NORMGRAD_REQUIRE_CPP") == "1":
        raise
    pytest.skip("C++ library not built", allow_module_level=True)

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
DTYPE_IDS = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", BF16: "bf16"}
# Relative error allowed per output dtype (on top of the inputs being rounded to T first).
RTOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2e-3, BF16: 1.6e-2}
HERE = pathlib.Path(__file__).parent


# --------------------------------------------------------------------------- helpers


def _model(op_type, inputs, outputs, attributes=None):
    """One node; ``inputs``/``outputs`` are (name or "", array or None) lists, kept as given."""
    node = helper.make_node(op_type, [n for n, _ in inputs], list(outputs), domain=DOMAIN, **(attributes or {}))
    graph_inputs = [helper.make_tensor_value_info(n, tensor_type(v.dtype), list(v.shape)) for n, v in inputs if n]
    graph_outputs = [onnx.ValueInfoProto(name=n) for n in outputs if n]
    graph = helper.make_graph([node], op_type, graph_inputs, graph_outputs)
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid(DOMAIN, OPSET_VERSION)],
        ir_version=IR_VERSION,
    )


def run_cpp(op_type, inputs, outputs, attributes=None, threads=None):
    """Runs one node on the C++ kernels; returns {output name: array}."""
    feeds = {name: value for name, value in inputs if name}
    return harness.run_model(_model(op_type, inputs, outputs, attributes), feeds, "cpp", threads)


def _cast(value, dtype):
    return np.asarray(value, dtype=np.float64).astype(dtype)


def assert_close(actual, expected, dtype, scale, what):
    """|actual - expected| <= RTOL[dtype] * scale, with ``scale`` the magnitude of the terms."""
    assert actual.dtype == np.dtype(dtype), f"{what}: dtype {actual.dtype} != {dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if expected.size == 0:
        return
    error = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    bound = RTOL[np.dtype(dtype)] * np.maximum(scale, np.abs(expected.astype(np.float64)))
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert (error <= bound).all(), f"{what}: error {error[worst]:.3g} > {bound[worst]:.3g} at {worst}"


def bn_scale(inputs):
    """Per-channel magnitude of the sums' terms: the float32 accumulation error scales with it."""
    x = inputs["input"].astype(np.float64)
    dy = np.abs(inputs["grad_out"].astype(np.float64))
    axes = (0,) + tuple(range(2, x.ndim))
    per_channel = (1, -1) + (1,) * (x.ndim - 2)
    xmu = np.abs(x - inputs["mean"].astype(np.float64).reshape(per_channel))
    sdy = dy.sum(axis=axes) if x.size else np.zeros(x.shape[1])
    sdyxmu = (dy * xmu).sum(axis=axes) if x.size else np.zeros(x.shape[1])
    return {"sum_dy": sdy, "grad_bias": sdy, "sum_dy_xmu": sdyxmu,
            "grad_weight": sdyxmu * np.abs(inputs["invstd"].astype(np.float64))}


def check_bn_reduce(inputs, outputs=bnr.OUTPUTS, attributes=None, threads=None, scale_factor=1.0):
    names = [n if n in outputs else "" for n in bnr.OUTPUTS]
    while names and not names[-1]:
        names.pop()
    actual = run_cpp(bnr.OP_TYPE, [(n, inputs[n]) for n in bnr.INPUTS if inputs.get(n) is not None], names,
                     attributes, threads)
    expected = bnr.reference(**inputs, **(attributes or {}))._asdict()
    scale = bn_scale(inputs)
    u = inputs["mean"].dtype
    assert sorted(actual) == sorted(n for n in names if n)
    for name, value in actual.items():
        # float32 accumulation of K terms: error ~ K * eps32 * |terms| at worst; observed much less.
        assert_close(value, expected[name], u, scale[name] * scale_factor, name)
    return actual


# --------------------------------------------------------------------------- BatchNormReduceBackward

BN_SHAPES = [(4, 3), (2, 1, 7), (1, 5, 3, 2, 3), (3, 2, 5, 5), (1, 1, 1), (5, 3, 37), (3, 4, 100), (2, 2, 70001)]


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("u", DTYPES, ids=DTYPE_IDS.get)
def test_bn_reduce_all_dtypes(t, u):
    for i, shape in enumerate(BN_SHAPES):
        check_bn_reduce(bn_inputs(shape, t, u, seed=i))


@pytest.mark.parametrize("shape", [(0, 3), (0, 2, 5), (3, 2, 0), (2, 3, 4, 0, 5)], ids=str)
def test_bn_reduce_empty_gives_zeros(shape):
    actual = check_bn_reduce(bn_inputs(shape, np.float32, np.float32))
    for value in actual.values():
        assert value.shape == (shape[1],) and not value.any()


def test_bn_reduce_large_mean_does_not_cancel():
    # |mean| / std = 1e4: Σdy·x − mean·Σdy would lose every digit in float32.
    inputs = bn_inputs((8, 3, 300), np.float32, np.float32, seed=3, offset=1e4)
    inputs["mean"] = inputs["input"].astype(np.float64).mean(axis=(0, 2)).astype(np.float32)
    check_bn_reduce(inputs)


@pytest.mark.parametrize("flags", list(itertools.product([0, 1], repeat=3)), ids=str)
def test_bn_reduce_flags(flags):
    attributes = dict(zip(("input_g", "weight_g", "bias_g"), flags))
    allowed = [n for n, f in zip(bnr.OUTPUTS, (flags[0], flags[0], flags[1], flags[2])) if f]
    inputs = bn_inputs((3, 4, 5), np.float32, np.float32)
    if allowed:
        check_bn_reduce(inputs, allowed, attributes)
    for name, flag in zip(bnr.OUTPUTS, ("input_g", "input_g", "weight_g", "bias_g")):
        if not attributes[flag]:
            with pytest.raises(Exception, match=f"output '{name}' is named but attribute '{flag}' is 0"):
                check_bn_reduce(inputs, [name], attributes)


@pytest.mark.parametrize("weight", ["present", "trailing-omitted", "empty-name"])
def test_bn_reduce_optional_io_every_combination(weight):
    inputs = bn_inputs((2, 3, 4), np.float16, np.float32, seed=5)
    expected = bnr.reference(**inputs)._asdict()
    node_inputs = [(n, inputs[n]) for n in bnr.INPUTS[:4]]
    if weight == "present":
        node_inputs.append(("weight", inputs["weight"]))
    elif weight == "empty-name":
        node_inputs.append(("", None))
    for mask in itertools.product([0, 1], repeat=4):
        if not any(mask):
            continue
        for trailing_empty in (False, True):
            names = [n if m else "" for n, m in zip(bnr.OUTPUTS, mask)]
            if not trailing_empty:
                while not names[-1]:
                    names.pop()
            actual = run_cpp(bnr.OP_TYPE, node_inputs, names)
            assert sorted(actual) == sorted(n for n in names if n)
            for name, value in actual.items():
                np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-5, err_msg=name)


def _bitwise_same_for_threads(run):
    results = [run(threads) for threads in (1, 2, 3, 4, 1, 3)]
    for other in results[1:]:
        for name in results[0]:
            assert results[0][name].tobytes() == other[name].tobytes(), name


@pytest.mark.parametrize("shape", [(16, 5, 70, 130), (2, 3, 140000), (64, 40, 4, 4), (64, 2, 3)], ids=str)
def test_bn_reduce_bitwise_deterministic_across_threads(shape):
    inputs = bn_inputs(shape, np.float32, np.float32, seed=7)
    feeds = [(n, inputs[n]) for n in bnr.INPUTS if n in inputs]
    _bitwise_same_for_threads(lambda threads: run_cpp(bnr.OP_TYPE, feeds, list(bnr.OUTPUTS), threads=threads))


_SHORT_ROWS_MEMORY_SCRIPT = r"""
import resource, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import test_cpp_kernels as t
n, c = 1 << 10, 1 << 16  # float16 [N, C] with C*S above a work unit: 128 MiB per input
feeds = [("grad_out", np.ones((n, c), np.float16)), ("input", np.ones((n, c), np.float16)),
         ("mean", np.zeros(c, np.float32)), ("invstd", np.ones(c, np.float32))]
t.run_cpp(t.bnr.OP_TYPE, [(k, v[:64]) if k in ("grad_out", "input") else (k, v) for k, v in feeds], ["sum_dy"])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = t.run_cpp(t.bnr.OP_TYPE, feeds, ["sum_dy"], threads=2)["sum_dy"]
assert (out == n).all(), out
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_bn_reduce_short_rows_need_no_input_sized_temporary():
    """[N, C] input with C*S above a work unit: the per-(unit, channel) partials must not
    grow to 16 bytes per input element (1 GiB here, eight times the float16 input)."""
    process = subprocess.run([sys.executable, "-c", _SHORT_ROWS_MEMORY_SCRIPT, str(HERE)], capture_output=True,
                             text=True, timeout=1800)
    assert process.returncode == 0, process.stderr[-3000:]
    growth_mib = int(process.stdout.strip().splitlines()[-1])
    assert growth_mib < 128, f"peak RSS grew by {growth_mib} MiB"


# --------------------------------------------------------------------------- BatchNormElemtBackward


ELEMT_INPUTS = ("grad_out", "input", "mean", "invstd", "weight", "sum_dy", "sum_dy_xmu")


def elemt_inputs(shape, t, u, seed=0, offset=0.0):
    inputs = bn_inputs(shape, t, u, seed, offset)
    sums = bnr.reference(**{k: inputs[k] for k in ("grad_out", "input", "mean", "invstd")})
    inputs["sum_dy"] = sums.sum_dy
    inputs["sum_dy_xmu"] = sums.sum_dy_xmu
    return inputs


def check_elemt(inputs, threads=None):
    actual = run_cpp("BatchNormElemtBackward", [(n, inputs[n]) for n in ELEMT_INPUTS], ["grad_input"],
                     threads=threads)["grad_input"]
    expected = bne.reference(*(inputs[n] for n in ELEMT_INPUTS)).grad_input
    # The magnitude of the terms, which float32 arithmetic errs relative to.
    dy, x, mean, invstd, weight, sdy, sdyxmu = (np.abs(inputs[n].astype(np.float64)) for n in ELEMT_INPUTS)
    per_channel = (1, -1) + (1,) * (x.ndim - 2)
    mean, invstd, weight, sdy, sdyxmu = (v.reshape(per_channel) for v in (mean, invstd, weight, sdy, sdyxmu))
    count = max(1, x.size // x.shape[1])
    xmu = np.abs(inputs["input"].astype(np.float64) - inputs["mean"].astype(np.float64).reshape(per_channel))
    scale = (dy + sdy / count + xmu * invstd**2 * sdyxmu / count) * invstd * weight
    assert_close(actual, expected, inputs["input"].dtype, scale, "grad_input")
    return actual


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("u", DTYPES, ids=DTYPE_IDS.get)
def test_elemt_all_dtypes(t, u):
    for i, shape in enumerate(BN_SHAPES[:-1] + [(2, 2, 3, 0), (0, 3, 2)]):
        check_elemt(elemt_inputs(shape, t, u, seed=i))


def test_elemt_large_mean_and_determinism():
    inputs = elemt_inputs((8, 3, 301), np.float32, np.float32, seed=2, offset=1e3)
    check_elemt(inputs)
    _bitwise_same_for_threads(lambda threads: {"dx": check_elemt(inputs, threads)})


# --------------------------------------------------------------------------- fused ReLU backward


def check_relu_masked(shape, t, u, seed=0, threads=None):
    """Both BatchNorm ops with relu_output (NaN/inf grad_out where it is 0) against the
    float64 references of the explicitly masked grad_out; returns the C++ outputs."""
    inputs = with_relu_output(bn_inputs(shape, t, u, seed=seed), seed=seed + 1)
    masked = relu_masked_truth(inputs)
    feeds = [(n, inputs[n]) for n in bnr.INPUTS]
    sums = run_cpp(bnr.OP_TYPE, feeds, list(bnr.OUTPUTS), threads=threads)
    expected, scale = bnr.reference(**masked)._asdict(), bn_scale(masked)
    for name, value in sums.items():
        assert_close(value, expected[name], u, scale[name], name)
    elemt = {**inputs, "sum_dy": sums["sum_dy"], "sum_dy_xmu": sums["sum_dy_xmu"]}
    dx = run_cpp(bne.OP_TYPE, [(n, elemt[n]) for n in bne.INPUTS], ["grad_input"], threads=threads)["grad_input"]
    truth = bne.reference(**{**masked, "sum_dy": sums["sum_dy"], "sum_dy_xmu": sums["sum_dy_xmu"]}).grad_input
    assert np.isfinite(dx.astype(np.float64)).all()
    np.testing.assert_allclose(dx.astype(np.float64), truth.astype(np.float64), rtol=RTOL[np.dtype(t)],
                               atol=RTOL[np.dtype(t)] * max(1.0, float(np.abs(truth.astype(np.float64)).max())))
    return {**sums, "grad_input": dx}


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("u", DTYPES, ids=DTYPE_IDS.get)
def test_relu_output_all_dtypes(t, u):
    for i, shape in enumerate(BN_SHAPES):
        check_relu_masked(shape, t, u, seed=i)


@pytest.mark.parametrize("shape", [(16, 5, 70, 130), (2, 3, 140000), (64, 40, 4, 4), (64, 2, 3)], ids=str)
def test_relu_output_bitwise_deterministic_across_threads(shape):
    _bitwise_same_for_threads(lambda threads: check_relu_masked(shape, np.float32, np.float32, seed=2, threads=threads))


def test_relu_output_absent_is_bit_for_bit_the_unmasked_op():
    """A relu_output of all ones, or a positive scalar, masks nothing: the same bits as none."""
    inputs = bn_inputs((3, 4, 301), np.float32, np.float32, seed=4)
    feeds = [(n, inputs[n]) for n in bnr.INPUTS[:5]]
    plain = run_cpp(bnr.OP_TYPE, feeds, list(bnr.OUTPUTS))
    for y in (np.ones((3, 4, 301), np.float32), np.float32(3.0)):
        masked = run_cpp(bnr.OP_TYPE, feeds + [("relu_output", y)], list(bnr.OUTPUTS))
        for name in bnr.OUTPUTS:
            assert plain[name].tobytes() == masked[name].tobytes(), name


# --------------------------------------------------------------------------- GroupNormalizationGrad

GN_CASES = [  # (x shape, gamma shape)
    ((2, 4, 3, 10), (1, 4, 3, 1)),
    ((2, 4, 3, 10), (2, 4, 3, 10)),
    ((2, 4, 3, 10), (4, 3, 1)),
    ((2, 4, 3, 10), (1, 4, 3, 10)),
    ((2, 4, 3, 10), (10,)),
    ((2, 4, 3, 10), (3, 1)),
    ((2, 4, 3, 10), (1, 1, 1, 1)),
    ((2, 4, 3, 10), ()),
    ((3, 2, 5), (1, 2, 5)),
    ((1, 3, 2, 2, 7), (3, 2, 1, 1)),
    ((1, 3, 2, 2, 7), (1, 3, 2, 2, 1)),
    ((2, 1, 1), (1, 1, 1)),
    ((5, 2, 33), (1, 2, 1)),
    ((2, 2, 4, 9, 9), (1, 2, 4, 1, 9)),
    ((2, 3, 1, 17, 1), (3, 1, 17, 1)),
]


def gn_inputs(x_shape, gamma_shape, t, u, seed=0, offset=0.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(offset, 1.0, size=x_shape)
    n, g = x_shape[:2]
    grouped = x.reshape(n, g, -1) if x.size else np.zeros((n, g, 1))
    return {
        "x": _cast(x, t),
        "dy": _cast(rng.normal(size=x_shape), t),
        "gamma": _cast(rng.normal(size=gamma_shape), t),
        "mean": _cast(grouped.mean(-1), u),
        "rstd": _cast(1.0 / np.sqrt(grouped.var(-1) + 1e-5), u),
    }


def check_gn(inputs, outputs=gng.OUTPUTS, threads=None, trailing_empty=False):
    names = [n if n in outputs else "" for n in gng.OUTPUTS]
    if not trailing_empty:
        while names and not names[-1]:
            names.pop()
    actual = run_cpp(gng.OP_TYPE, [(n, inputs[n]) for n in gng.INPUTS], names, threads=threads)
    assert sorted(actual) == sorted(n for n in names if n)
    expected = gng.reference(**inputs)._asdict()
    # Scales: dx's terms are O(rstd·|γ·dy|); dgamma/dbeta sum |dy·x̂| / |dy| terms.
    x = inputs["x"]
    t = x.dtype
    x64 = x.astype(np.float64)
    dy64 = np.abs(inputs["dy"].astype(np.float64))
    n, g = x.shape[:2]
    x_hat = (x64.reshape(n, g, -1) - inputs["mean"].astype(np.float64)[..., None]) if x.size else x64
    x_hat = (x_hat * inputs["rstd"].astype(np.float64)[..., None]).reshape(x.shape) if x.size else x64
    for name, value in actual.items():
        if name == "dx":
            scale = 1.0
            if x.size:
                xh, gdy, rstd64 = gng._normalised(*(inputs[k] for k in gng.INPUTS))
                xh, gdy = np.abs(xh), np.abs(gdy)
                terms = rstd64 * (gdy + gdy.mean(-1, keepdims=True) + xh * (gdy * xh).mean(-1, keepdims=True))
                scale = terms.reshape(x.shape)
        else:
            terms = dy64 * np.abs(x_hat) if name == "dgamma" else dy64
            scale = _common.sum_to_shape(terms, inputs["gamma"].shape) if x.size else 1.0
        truth = _truth(inputs, name)
        assert_close(value, truth, t, scale, name)
    return actual


def _truth(inputs, name):
    """The float64 reference before its cast to T (so T rounding is counted once)."""
    x, dy, gamma, mean, rstd = (inputs[n] for n in gng.INPUTS)
    x_hat, g, rstd64 = gng._normalised(x, dy, gamma, mean, rstd)
    if name == "dx":
        if not x_hat.shape[-1]:
            return g.reshape(x.shape)
        dx = rstd64 * (g - g.mean(-1, keepdims=True) - x_hat * (g * x_hat).mean(-1, keepdims=True))
        return dx.reshape(x.shape)
    dy64 = dy.astype(np.float64)
    value = dy64 * x_hat.reshape(x.shape) if name == "dgamma" else dy64
    return _common.sum_to_shape(value, gamma.shape)


@pytest.mark.parametrize("t,u", [(t, u) for t in DTYPES for u in DTYPES if u in (t, np.dtype(np.float32))],
                         ids=lambda d: DTYPE_IDS[np.dtype(d)])
def test_gn_all_dtypes_and_broadcasts(t, u):
    for i, (x_shape, gamma_shape) in enumerate(GN_CASES):
        check_gn(gn_inputs(x_shape, gamma_shape, t, u, seed=i))


@pytest.mark.parametrize("x_shape,gamma_shape", [((0, 2, 3), (1, 2, 3)), ((2, 3, 0), (1, 3, 1)),
                                                 ((2, 3, 4, 0), (3, 1, 1))], ids=str)
def test_gn_empty(x_shape, gamma_shape):
    actual = check_gn(gn_inputs(x_shape, gamma_shape, np.float32, np.float32))
    assert actual["dx"].shape == x_shape
    assert actual["dgamma"].shape == gamma_shape and not actual["dgamma"].any()
    assert actual["dbeta"].shape == gamma_shape and not actual["dbeta"].any()


def test_gn_optional_outputs_every_combination():
    inputs = gn_inputs((2, 4, 3, 10), (1, 4, 3, 1), np.float32, np.float32, seed=4)
    for dgamma, dbeta in itertools.product([0, 1], repeat=2):
        wanted = ["dx"] + (["dgamma"] if dgamma else []) + (["dbeta"] if dbeta else [])
        for trailing_empty in (False, True):
            check_gn(inputs, wanted, trailing_empty=trailing_empty)


def test_gn_large_mean():
    check_gn(gn_inputs((2, 4, 3, 50), (1, 4, 3, 1), np.float32, np.float32, seed=8, offset=1e3))


@pytest.mark.parametrize("gamma_shape", [(1, 8, 4, 1), (1, 8, 4, 300), (300,)], ids=str)
def test_gn_bitwise_deterministic_across_threads(gamma_shape):
    inputs = gn_inputs((6, 8, 4, 300), gamma_shape, np.float32, np.float32, seed=9)
    _bitwise_same_for_threads(lambda threads: check_gn(inputs, threads=threads))


def check_gn_long_group():
    """One group of 4M elements whose dy is constant 1 + 2**-10: a float32 running sum of
    it loses the 2**-10 once it passes 2**15, so a kernel that lets one float32 lane add
    up more than a few thousand terms gets s1 (hence dx) and dbeta wrong by ~1e-3."""
    inputs = gn_inputs((1, 1, 1 << 22), (1, 1, 1), np.float32, np.float32, seed=11)
    inputs["dy"] = np.full(inputs["x"].shape, 1.0 + 2.0**-10, np.float32)
    actual = check_gn(inputs)
    assert actual["dbeta"][0, 0, 0] == np.float32((1 << 22) * (1.0 + 2.0**-10))


def test_gn_long_group_sums_do_not_drift():
    check_gn_long_group()


# --------------------------------------------------------------------------- LayerNormalizationGrad, RMSNormalizationGrad

ROW_OPS = {"layer": lng, "rms": rmsg}
# (x shape, axis, scale shape): D below, at and around the vector width, long rows, a scale
# broadcast over the normalised axes, leading 1s, axis 0.
ROW_CASES = [
    ((5, 1), -1, (1,)),
    ((3, 7), -1, (7,)),
    ((4, 8), -1, (8,)),
    ((70, 9), -1, (9,)),
    ((2, 3, 33), -1, (33,)),
    ((37, 100), 1, (100,)),
    ((2, 4, 5, 6), 2, (1, 6)),
    ((2, 4, 5, 6), -3, (4, 1, 6)),
    ((3, 769), 0, (3, 769)),
    ((1, 2, 1, 130), -1, (1, 1, 1, 130)),
]


def _row_mean(value, axes):
    """The mean over ``axes``, 0 for an empty row (no warning)."""
    count = int(np.prod([value.shape[a] for a in axes]))
    return value.sum(axes, keepdims=True) / max(count, 1)


def row_inputs(kind, x_shape, axis, scale_shape, t, u, seed=0, offset=0.5):
    rng = np.random.default_rng(seed)
    x = _cast(rng.normal(offset, 2.0, size=x_shape), t)
    axes = tuple(range(axis % len(x_shape), len(x_shape)))
    x64 = x.astype(np.float64)
    inputs = {"dy": _cast(rng.normal(size=x_shape), t), "x": x, "scale": _cast(rng.normal(1.0, 0.5, size=scale_shape), t)}
    if kind == "layer":
        mean = _row_mean(x64, axes)
        inputs["mean"] = _cast(mean, u)
        inputs["inv_std_dev"] = _cast(1 / np.sqrt(_row_mean((x64 - mean) ** 2, axes) + 1e-5), u)
    else:
        inputs["inv_rms"] = _cast(1 / np.sqrt(_row_mean(x64**2, axes) + 1e-5), u)
    return inputs


def _row_scales(kind, inputs, axis):
    """The magnitude of each output's terms (the float32 accumulation error scales with it)."""
    module = ROW_OPS[kind]
    dy, x, scale, *stats = (inputs[n].astype(np.float64) for n in module.INPUTS)
    ax = axis % x.ndim
    axes = tuple(range(ax, x.ndim))
    mean = stats[0] if kind == "layer" else 0.0
    rstd = stats[-1]
    x_hat = np.abs((x - mean) * rstd)
    g = np.abs(dy * scale)
    dx = rstd * (g + x_hat * _row_mean(g * x_hat, axes) + _row_mean(g, axes))
    terms = {"dx": dx, "dscale": _common.sum_to_shape(np.abs(dy) * x_hat, scale.shape)}
    terms["dbias"] = _common.sum_to_shape(np.abs(dy), scale.shape)
    return terms


def check_rows(kind, inputs, axis=-1, outputs=None, threads=None):
    module = ROW_OPS[kind]
    outputs = module.OUTPUTS if outputs is None else outputs
    names = [n if n in outputs else "" for n in module.OUTPUTS]
    while names and not names[-1]:
        names.pop()
    actual = run_cpp(module.OP_TYPE, [(n, inputs[n]) for n in module.INPUTS], names, {"axis": axis}, threads)
    expected = module.reference(**inputs, axis=axis)._asdict()
    scales = _row_scales(kind, inputs, axis)
    assert sorted(actual) == sorted(n for n in names if n)
    for name, value in actual.items():
        assert_close(value, expected[name].astype(np.float64), inputs["x"].dtype, scales[name], f"{kind} {name}")
    return actual


@pytest.mark.parametrize("kind", ROW_OPS)
@pytest.mark.parametrize("t,u", [(t, u) for t in DTYPES for u in DTYPES if u in (t, np.dtype(np.float32))],
                         ids=lambda d: DTYPE_IDS[d])
def test_rows_all_dtypes_and_shapes(kind, t, u):
    for i, (x_shape, axis, scale_shape) in enumerate(ROW_CASES):
        check_rows(kind, row_inputs(kind, x_shape, axis, scale_shape, t, u, seed=i), axis)


@pytest.mark.parametrize("kind", ROW_OPS)
@pytest.mark.parametrize("x_shape,axis", [((0, 4), -1), ((3, 0), -1), ((2, 0, 3), 1), ((0,), 0)], ids=str)
def test_rows_empty(kind, x_shape, axis):
    scale_shape = x_shape[axis % len(x_shape):]
    inputs = row_inputs(kind, x_shape, axis, scale_shape, np.float32, np.float32)
    actual = check_rows(kind, inputs, axis)
    for name in ROW_OPS[kind].OUTPUTS[1:]:
        np.testing.assert_array_equal(actual[name], np.zeros(scale_shape, np.float32))


@pytest.mark.parametrize("kind", ROW_OPS)
def test_rows_optional_outputs_every_combination(kind):
    module = ROW_OPS[kind]
    inputs = row_inputs(kind, (70, 45), -1, (45,), np.float16, np.float32, seed=3)
    for bits in itertools.product((0, 1), repeat=len(module.OUTPUTS) - 1):
        wanted = ["dx"] + [n for n, b in zip(module.OUTPUTS[1:], bits) if b]
        check_rows(kind, inputs, outputs=wanted)


@pytest.mark.parametrize("kind", ROW_OPS)
def test_rows_long_rows_and_large_mean(kind):
    """Rows of 70001 (float32 lane sums split every kSumBlock) around a mean 1000 times the
    spread: x - mean is taken before any product, so nothing cancels."""
    check_rows(kind, row_inputs(kind, (3, 70001), -1, (70001,), np.float32, np.float32, seed=4))
    check_rows(kind, row_inputs(kind, (40, 64), -1, (64,), np.float32, np.float32, seed=5, offset=1000.0))


@pytest.mark.parametrize("kind", ROW_OPS)
@pytest.mark.parametrize("x_shape,axis,scale_shape", [((1000, 130), -1, (130,)), ((3, 5, 70001), 1, (1, 70001)),
                                                     ((77, 3, 300), -2, (3, 300))], ids=str)
def test_rows_bitwise_deterministic_across_threads(kind, x_shape, axis, scale_shape):
    module = ROW_OPS[kind]
    inputs = row_inputs(kind, x_shape, axis, scale_shape, np.float32, np.float32, seed=6)
    feeds = [(n, inputs[n]) for n in module.INPUTS]
    _bitwise_same_for_threads(
        lambda threads: run_cpp(module.OP_TYPE, feeds, list(module.OUTPUTS), {"axis": axis}, threads=threads)
    )


# --------------------------------------------------------------------------- portable kernels

_GENERIC_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import test_cpp_kernels as t
for i, shape in enumerate(t.BN_SHAPES[:-1]):
    for dt in t.DTYPES:
        t.check_bn_reduce(t.bn_inputs(shape, dt, np.float32, seed=i))
        t.check_elemt(t.elemt_inputs(shape, dt, dt, seed=i))
        t.check_relu_masked(shape, dt, np.float32, seed=i)
for i, (xs, gs) in enumerate(t.GN_CASES):
    for dt in t.DTYPES:
        t.check_gn(t.gn_inputs(xs, gs, dt, dt, seed=i))
t.check_gn_long_group()
for kind in t.ROW_OPS:
    for i, (xs, axis, ss) in enumerate(t.ROW_CASES):
        for dt in t.DTYPES:
            t.check_rows(kind, t.row_inputs(kind, xs, axis, ss, dt, np.float32, seed=i), axis)
    t.check_rows(kind, t.row_inputs(kind, (3, 70001), -1, (70001,), np.float32, np.float32, seed=4))
print("ok")
"""


def test_portable_kernels_without_avx2():
    env = dict(os.environ, NORMGRAD_KERNELS="generic")
    process = subprocess.run([sys.executable, "-c", _GENERIC_SCRIPT, str(HERE)], capture_output=True, text=True,
                             env=env, timeout=1800)
    assert process.returncode == 0 and process.stdout.strip() == "ok", process.stderr[-3000:]


# --------------------------------------------------------------------------- bad inputs


def _f(*shape, dtype=np.float32):
    return np.ones(shape, dtype)


def _bn_case(**changes):
    base = {"grad_out": _f(2, 3, 4), "input": _f(2, 3, 4), "mean": _f(3), "invstd": _f(3), "weight": _f(3)}
    base.update(changes)
    return ("BatchNormReduceBackward", [(n, base[n]) for n in bnr.INPUTS if base.get(n) is not None], None)


def _elemt_case(**changes):
    base = {"grad_out": _f(2, 3, 4), "input": _f(2, 3, 4), **{n: _f(3) for n in ELEMT_INPUTS[2:]}}
    base.update(changes)
    return ("BatchNormElemtBackward", [(n, base[n]) for n in bne.INPUTS if base.get(n) is not None], None)


def _gn_case(**changes):
    base = {"x": _f(2, 3, 4), "dy": _f(2, 3, 4), "gamma": _f(1, 3, 4), "mean": _f(2, 3), "rstd": _f(2, 3)}
    base.update(changes)
    return ("GroupNormalizationGrad", [(n, base[n]) for n in gng.INPUTS], None)


def _row_case(kind, attributes=None, **changes):
    module = ROW_OPS[kind]
    base = {"dy": _f(2, 3, 4), "x": _f(2, 3, 4), "scale": _f(4), "mean": _f(2, 3, 1), "inv_std_dev": _f(2, 3, 1),
            "inv_rms": _f(2, 3, 1)}
    base.update(changes)
    return (module.OP_TYPE, [(n, base[n]) for n in module.INPUTS], attributes)


F16, F64, I32 = np.float16, np.float64, np.int32
# (case id, (op, inputs, attributes), text the error must contain)
BAD_CASES = [
    ("bn-grad_out-shape", _bn_case(grad_out=_f(2, 3, 5)), "'grad_out'"),
    ("bn-grad_out-rank", _bn_case(grad_out=_f(2, 3)), "'grad_out'"),
    ("bn-input-rank-1", _bn_case(grad_out=_f(3), input=_f(3)), "'input'"),
    ("bn-input-rank-9", _bn_case(grad_out=_f(*[1] * 9), input=_f(*[1] * 9)), "'input'"),
    ("bn-input-C-0", _bn_case(grad_out=_f(2, 0, 3), input=_f(2, 0, 3)), "'input'"),
    ("bn-mean-length", _bn_case(mean=_f(4)), "'mean' must have shape [3]"),
    ("bn-mean-short", _bn_case(mean=_f(1)), "'mean'"),
    ("bn-mean-rank", _bn_case(mean=_f(1, 3)), "'mean'"),
    ("bn-mean-scalar", _bn_case(mean=np.float32(1.0).reshape(())), "'mean'"),
    ("bn-invstd-length", _bn_case(invstd=_f(2)), "'invstd'"),
    ("bn-weight-length", _bn_case(weight=_f(5)), "'weight'"),
    ("bn-grad_out-dtype", _bn_case(grad_out=_f(2, 3, 4, dtype=F16)), "'grad_out'"),
    ("bn-input-float64", _bn_case(grad_out=_f(2, 3, 4, dtype=F64), input=_f(2, 3, 4, dtype=F64)), "'grad_out'"),
    ("bn-invstd-dtype", _bn_case(invstd=_f(3, dtype=F16)), "'invstd'"),
    ("bn-weight-dtype", _bn_case(weight=_f(3, dtype=F16)), "'weight'"),
    ("bn-mean-int", _bn_case(mean=_f(3, dtype=I32)), "'mean'"),
    ("bn-flag-2", ("BatchNormReduceBackward", _bn_case()[1], {"input_g": 2}), "'input_g'"),
    ("bn-flag-off-output", ("BatchNormReduceBackward", _bn_case()[1], {"bias_g": 0}), "'grad_bias'"),
    ("bn-relu_output-shape", _bn_case(relu_output=_f(2, 3, 5)), "'relu_output' must have the shape of 'input'"),
    ("bn-relu_output-dtype", _bn_case(relu_output=_f(2, 3, 4, dtype=F16)), "'relu_output' must have the dtype"),
    ("elemt-relu_output-broadcast", _elemt_case(relu_output=_f(2, 1, 4)), "'relu_output'"),
    ("elemt-sum_dy-length", _elemt_case(sum_dy=_f(2)), "'sum_dy'"),
    ("elemt-weight-length", _elemt_case(weight=_f(30)), "'weight'"),
    ("elemt-sum_dy_xmu-dtype", _elemt_case(sum_dy_xmu=_f(3, dtype=F16)), "'sum_dy_xmu'"),
    ("elemt-grad_out-shape", _elemt_case(grad_out=_f(2, 3, 5)), "'grad_out'"),
    ("elemt-input-rank-1", _elemt_case(grad_out=_f(3), input=_f(3)), "'input'"),
    ("gn-dy-shape", _gn_case(dy=_f(2, 3, 5)), "'dy'"),
    ("gn-x-rank-2", _gn_case(x=_f(2, 3), dy=_f(2, 3), gamma=_f(1, 3)), "'x'"),
    ("gn-x-rank-9", _gn_case(x=_f(*[1] * 9), dy=_f(*[1] * 9), gamma=_f(1)), "'x'"),
    ("gn-gamma-not-broadcastable", _gn_case(gamma=_f(1, 3, 5)), "'gamma'"),
    ("gn-gamma-too-big", _gn_case(gamma=_f(2, 3, 4, 4)), "'gamma'"),
    ("gn-gamma-rank", _gn_case(gamma=_f(1, 2, 3, 4)), "'gamma'"),
    ("gn-mean-shape", _gn_case(mean=_f(2, 4)), "'mean'"),
    ("gn-mean-transposed", _gn_case(mean=_f(3, 2)), "'mean'"),
    ("gn-rstd-shape", _gn_case(rstd=_f(2)), "'rstd'"),
    ("gn-gamma-dtype", _gn_case(gamma=_f(1, 3, 4, dtype=F16)), "'gamma'"),
    ("gn-dy-dtype", _gn_case(dy=_f(2, 3, 4, dtype=F16)), "'dy'"),
    ("gn-rstd-dtype", _gn_case(rstd=_f(2, 3, dtype=F16)), "'rstd'"),
    ("gn-mean-bf16-with-f16", _gn_case(**{n: _f(*s, dtype=F16) for n, s in
                                          (("x", (2, 3, 4)), ("dy", (2, 3, 4)), ("gamma", (1, 3, 4)), ("rstd", (2, 3)))},
                                       mean=_f(2, 3, dtype=ml_dtypes.bfloat16)), "'mean'"),
    ("ln-dy-shape", _row_case("layer", dy=_f(2, 3, 5)), "'dy'"),
    ("ln-dy-dtype", _row_case("layer", dy=_f(2, 3, 4, dtype=F16)), "'dy'"),
    ("ln-x-scalar", _row_case("layer", x=np.float32(1).reshape(()), dy=np.float32(1).reshape(())), "'x'"),
    ("ln-x-float64", _row_case("layer", x=_f(2, 3, 4, dtype=F64), dy=_f(2, 3, 4, dtype=F64)), "'x'"),
    ("ln-axis-3", _row_case("layer", {"axis": 3}), "'axis'"),
    ("ln-axis--4", _row_case("layer", {"axis": -4}), "'axis'"),
    ("ln-axis-float", _row_case("layer", {"axis": -1.0}), "'axis'"),
    ("ln-scale-not-broadcastable", _row_case("layer", scale=_f(5)), "'scale'"),
    ("ln-scale-per-row", _row_case("layer", scale=_f(3, 4)), "'scale'"),
    ("ln-scale-rank", _row_case("layer", scale=_f(1, 1, 1, 4)), "'scale'"),
    ("ln-scale-dtype", _row_case("layer", scale=_f(4, dtype=F16)), "'scale'"),
    ("ln-mean-no-trailing-1", _row_case("layer", mean=_f(2, 3)), "'mean'"),
    ("ln-mean-axis-mismatch", _row_case("layer", {"axis": -2}), "'mean'"),
    ("ln-inv_std_dev-shape", _row_case("layer", inv_std_dev=_f(3, 2, 1)), "'inv_std_dev'"),
    ("ln-inv_std_dev-dtype", _row_case("layer", inv_std_dev=_f(2, 3, 1, dtype=F16)), "'inv_std_dev'"),
    ("ln-mean-int", _row_case("layer", mean=_f(2, 3, 1, dtype=I32)), "'mean'"),
    ("rms-inv_rms-shape", _row_case("rms", inv_rms=_f(2, 1, 1)), "'inv_rms'"),
    ("rms-inv_rms-f16-with-bf16", _row_case("rms", **{n: _f(*s, dtype=ml_dtypes.bfloat16) for n, s in
                                                     (("x", (2, 3, 4)), ("dy", (2, 3, 4)), ("scale", (4,)))},
                                            inv_rms=_f(2, 3, 1, dtype=F16)), "'inv_rms'"),
    ("rms-scale-shape", _row_case("rms", scale=_f(2, 3, 4)), "'scale'"),
    ("rms-axis-5", _row_case("rms", {"axis": 5}), "'axis'"),
]

_BAD_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import test_cpp_kernels as t
case_id = sys.argv[2]
op, inputs, attributes = dict((c[0], c[1]) for c in t.BAD_CASES)[case_id]
try:
    t.run_cpp(op, inputs, [n for n in t.OUTPUT_NAMES[op]], attributes)
    print(json.dumps({"outcome": "returned"}))
except Exception as error:
    print(json.dumps({"outcome": "raised", "message": str(error)}))
"""

OUTPUT_NAMES = {"BatchNormReduceBackward": bnr.OUTPUTS, "BatchNormElemtBackward": ("grad_input",),
                "GroupNormalizationGrad": gng.OUTPUTS, lng.OP_TYPE: lng.OUTPUTS, rmsg.OP_TYPE: rmsg.OUTPUTS}


@pytest.mark.slow
def test_bad_inputs_are_rejected_without_crashing():
    """Each case in its own process (a crash is a failure, not the end of the run)."""
    processes = {
        case_id: subprocess.Popen([sys.executable, "-c", _BAD_SCRIPT, str(HERE), case_id], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        for case_id, _, _ in BAD_CASES
    }
    failures = []
    for case_id, _, expected in BAD_CASES:
        out, err = processes[case_id].communicate(timeout=1800)
        if processes[case_id].returncode != 0:
            failures.append(f"{case_id}: process died ({processes[case_id].returncode}): {err[-500:]}")
            continue
        result = json.loads(out.strip().splitlines()[-1])
        if result["outcome"] != "raised" or expected not in result["message"]:
            failures.append(f"{case_id}: {result}")
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- loading


def test_library_exports_only_the_entry_point():
    import ctypes

    library = ctypes.CDLL(normgrad.library_path())
    assert hasattr(library, "RegisterCustomOps")
    assert not hasattr(library, "_ZN8normgrad5g_apiE")  # internals stay hidden


_OLD_RUNTIME_SCRIPT = r"""
import ctypes, glob, os, sys
import onnxruntime
ort = ctypes.CDLL(glob.glob(os.path.join(os.path.dirname(onnxruntime.__file__), "capi", "libonnxruntime.so*"))[0])
ort.OrtGetApiBase.restype = ctypes.c_void_p
real = ctypes.cast(ort.OrtGetApiBase(), ctypes.POINTER(ctypes.c_void_p * 2)).contents
GET_API = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)
VERSION = ctypes.CFUNCTYPE(ctypes.c_char_p)
real_get_api = GET_API(real[0])

@GET_API
def get_api(version):  # an onnxruntime 1.16: API versions 1..16
    return real_get_api(version) if version <= 16 else None

@VERSION
def version_string():
    return b"1.16.3"

base = (ctypes.c_void_p * 2)(ctypes.cast(get_api, ctypes.c_void_p), ctypes.cast(version_string, ctypes.c_void_p))
library = ctypes.CDLL(sys.argv[1])
library.RegisterCustomOps.restype = ctypes.c_void_p
library.RegisterCustomOps.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
status = library.RegisterCustomOps(None, ctypes.addressof(base))
assert status, "expected an error status"
api = ctypes.cast(real_get_api(1), ctypes.POINTER(ctypes.c_void_p * 8)).contents
# OrtApi: CreateStatus, GetErrorCode, GetErrorMessage, ...
get_message = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(api[2])
print(get_message(status).decode())
"""


def test_old_onnxruntime_gets_a_clear_error():
    """A runtime without API version 17 gets an error status naming both versions, not a crash."""
    process = subprocess.run([sys.executable, "-c", _OLD_RUNTIME_SCRIPT, normgrad.library_path()],
                             capture_output=True, text=True, timeout=900)
    assert process.returncode == 0, process.stderr[-2000:]
    assert "API version 17" in process.stdout and "1.16.3" in process.stdout, process.stdout
