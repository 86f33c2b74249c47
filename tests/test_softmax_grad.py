"""SoftmaxGrad (ops/softmax_grad.py): the float64 reference against torch autograd and float64
finite differences of the softmax; the C++ kernel (both loops, 1/2/4 threads, bitwise), the
Python kernel and the function body against the reference; NaN rows; bad inputs named; the
step graph of an attention with torch's safe softmax uses the operator (float32, last axis
only), matches its ``--inline`` form at every optimization level, and the portable form
writes the standard ops again."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest

import normgrad
from _helpers import (assert_step_matches_inline, cpp_available, cpp_error, cpp_results_by_loop_and_threads,
                      step_outputs)
from normgrad.graphs import build_step_graph, build_training_graph
from normgrad.graphs.optimizers import hyperparameter_feeds
from normgrad.graphs.portable import as_exported, make_portable
from normgrad.ops import NormgradInputError, harness, softmax_grad
from _attention_graphs import _attention, _ops

OP = softmax_grad.OP_TYPE
KERNELS = ["python"] + (["cpp"] if cpp_available() else [])
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")
SHAPES = [(0,), (1,), (7,), (3, 8), (2, 3, 33), (4, 0), (2, 0, 5), (5, 128), (3, 300), (2, 1000)]
"""Empty, one element, rows shorter than a lane group, one group, a tail, one and more than
one of the kernel's 256-element blocks."""


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True, initial=-np.inf))
    return e / e.sum(axis=-1, keepdims=True)


def _inputs(shape, seed=0, spread=3.0):
    rng = np.random.default_rng(seed)
    y = _softmax(rng.standard_normal(shape) * spread).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    return dy, y


def _assert_close(dy, y, dx):
    """Within float32 rounding of the terms: |y| (|dy| + sum |dy y|), a few ulps."""
    dy64, y64 = dy.astype(np.float64), y.astype(np.float64)
    truth = y64 * (dy64 - np.sum(dy64 * y64, axis=-1, keepdims=True))
    scale = np.abs(y64) * (np.abs(dy64) + np.sum(np.abs(dy64 * y64), axis=-1, keepdims=True))
    assert dx.dtype == np.float32 and dx.shape == y.shape
    assert np.all(np.abs(dx.astype(np.float64) - truth) <= 4 * np.finfo(np.float32).eps * scale + 1e-44)


def test_reference_is_the_softmax_derivative():
    """Central finite differences of sum(dy * softmax(x)) in float64."""
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((3, 6)), rng.standard_normal((3, 6))
    numeric = np.zeros_like(x)
    step = 1e-6
    for index in np.ndindex(x.shape):
        shifted = x.copy()
        shifted[index] += step
        up = np.sum(dy * _softmax(shifted))
        shifted[index] -= 2 * step
        numeric[index] = (up - np.sum(dy * _softmax(shifted))) / (2 * step)
    np.testing.assert_allclose(softmax_grad.reference(dy, _softmax(x)).dx, numeric, rtol=1e-7, atol=1e-9)


def test_reference_matches_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x = torch.tensor(rng.standard_normal((2, 3, 5, 17)) * 4, requires_grad=True)
    dy = torch.tensor(rng.standard_normal((2, 3, 5, 17)))
    y = torch.softmax(x, dim=-1)
    y.backward(dy)
    ours = softmax_grad.reference(dy.numpy(), y.detach().numpy()).dx
    np.testing.assert_allclose(ours, x.grad.numpy(), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_match_the_reference(backend, shape):
    dy, y = _inputs(shape)
    _assert_close(dy, y, harness.run(backend, OP, {"dy": dy, "y": y}, threads=1)["dx"])


@pytest.mark.parametrize("backend", ["functions", "evaluator"])
@pytest.mark.parametrize("shape", [(1,), (3, 8), (2, 3, 33), (3, 300)])
def test_function_body_matches_the_reference(backend, shape):
    dy, y = _inputs(shape, seed=2)
    _assert_close(dy, y, harness.run(backend, OP, {"dy": dy, "y": y})["dx"])


@pytest.mark.parametrize("backend", KERNELS + ["functions"])
def test_non_finite_entries(backend):
    """A NaN y (a fully masked row's softmax) makes that row's dx NaN whole; an infinite dy
    gives the formula's infinities and NaN (the reference's, as the standard-op form's); the
    other rows are untouched."""
    dy, y = _inputs((4, 19), seed=3)
    y[1] = np.nan
    dy[2, 5] = np.inf
    dx = harness.run(backend, OP, {"dy": dy, "y": y})["dx"]
    assert np.isnan(dx[1]).all()
    np.testing.assert_array_equal(dx[2], softmax_grad.reference(dy, y).dx[2])
    assert np.isnan(dx[2, 5]) and np.isinf(dx[2]).sum() == 18
    _assert_close(dy[[0, 3]], y[[0, 3]], dx[[0, 3]])


_RUN_CPP = """
import sys, numpy as np
from normgrad.ops import harness
rng = np.random.default_rng(4)
x = rng.standard_normal((8, 4, 64, 131)) * 3
y = (np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)).astype(np.float32)
dy = rng.standard_normal(y.shape).astype(np.float32)
np.save(sys.argv[1], harness.run("cpp", "SoftmaxGrad", {"dy": dy, "y": y}, threads=int(sys.argv[2]))["dx"])
"""


@needs_cpp
def test_cpp_loops_bitwise_at_every_thread_count(tmp_path):
    """The portable loop (NORMGRAD_KERNELS=generic) and the AVX2 one at 1, 2 and 4 threads:
    the same bits."""
    results = cpp_results_by_loop_and_threads(tmp_path, _RUN_CPP)
    first = results["generic", 1]
    for where, value in results.items():
        assert value.tobytes() == first.tobytes(), where


BAD = {
    "dy shape": ({"dy": np.zeros((2, 3), np.float32), "y": np.zeros((3, 2), np.float32)},
                 "input 'dy' must have the shape of 'y' [3, 2]; got [2, 3]"),
    "y scalar": ({"dy": np.zeros((), np.float32), "y": np.zeros((), np.float32)},
                 "input 'y' must have rank >= 1 (rows along the last axis); got a scalar"),
    "y float16": ({"dy": np.zeros(3, np.float16), "y": np.zeros(3, np.float16)}, "input 'dy' must be float32; got float16"),
}


@needs_cpp
@pytest.mark.parametrize("case", BAD)
def test_cpp_bad_input_names_the_input(case):
    feeds, rule = BAD[case]
    message = cpp_error(OP, feeds)
    # onnxruntime may refuse a float16 input itself (no kernel of that type) before ours runs
    assert f"{OP}: {rule}" in message or (case == "y float16" and "float16" in message), message


@pytest.mark.parametrize("case", BAD)
def test_validate_names_the_input(case):
    feeds, rule = BAD[case]
    with pytest.raises(NormgradInputError, match=re.escape(f"{OP}: {rule}")):
        softmax_grad.reference(**feeds)


# ----------------------------------------------------------------------------- step graphs


def test_step_graph_uses_the_operator_and_matches_the_inline_form():
    """The safe softmax's gradient is one SoftmaxGrad (no Mul/ReduceSum/Sub/Mul chain); at every
    optimization level, with the C++ and Python kernels and with the bodies onnxruntime
    inlines, the updated weights match the ``--inline`` form's (the standard ops) to float32
    rounding, and the C++ kernel's step is bitwise the same at 1, 2 and 4 threads."""
    forward = _attention()
    step, initial = build_step_graph(build_training_graph(forward, loss="mse"), "adamw")
    inline, _ = build_step_graph(build_training_graph(forward, loss="mse", inline=True), "adamw")
    assert _ops(step).count(OP) == 1
    assert not _ops(inline) and _ops(inline, "").count("ReduceSum") == _ops(step, "").count("ReduceSum") + 1
    rng = np.random.default_rng(7)
    feeds = {**hyperparameter_feeds(step), **initial, "x": rng.standard_normal((3, 5, 6)).astype(np.float32),
             "labels": rng.standard_normal((3, 5, 6)).astype(np.float32), "lr": np.array(0.1, np.float32),
             "step": np.array(1, np.float32)}
    expected = step_outputs(inline, feeds, None, "ORT_DISABLE_ALL")
    weights = [name + ".next" for name in ("w_q", "w_k", "w_v", "w_o")]
    assert all(np.isfinite(expected[name]).all() for name in weights)
    assert_step_matches_inline(step, inline, feeds, weights)


def test_gradient_matches_torch_autograd():
    """x's gradient through the safe softmax attention is torch's."""
    torch = pytest.importorskip("torch")
    forward = _attention()
    training = build_training_graph(forward)
    assert OP in _ops(training.model)
    weights = {i.name: torch.tensor(onh.to_array(i)) for i in forward.graph.initializer}
    x = np.random.default_rng(8).standard_normal((3, 5, 6)).astype(np.float32)
    dy = np.random.default_rng(9).standard_normal((3, 5, 6)).astype(np.float32)
    options = ort.SessionOptions()
    if cpp_available():
        normgrad.session_options("cpp", options)
    session = ort.InferenceSession(training.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    (grad,) = session.run(["x_grad"], training.feeds({"x": x, "y_grad": dy}))
    xt = torch.tensor(x, requires_grad=True)
    scores = (xt @ weights["w_q"]) @ (xt @ weights["w_k"]).transpose(1, 2) + weights["mask"]
    p = torch.softmax(scores, dim=-1)
    p = torch.where(torch.isnan(p), torch.zeros(()), p)
    (p @ (xt @ weights["w_v"]) @ weights["w_o"]).backward(torch.tensor(dy))
    np.testing.assert_allclose(grad, xt.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["float64", "middle axis", "unsafe"])
def test_which_softmax_gradients_use_the_operator(case):
    """float32 over the last axis (-1 or rank - 1), safe or not; float64 or another axis
    keep the standard-op form."""
    forward = {"float64": lambda: _attention(onnx.TensorProto.DOUBLE), "middle axis": lambda: _attention(axis=1),
               "unsafe": lambda: _attention(axis=2, safe=False)}[case]()
    ops = _ops(build_training_graph(forward).model)
    assert ops.count(OP) == (1 if case == "unsafe" else 0), ops


def test_portable_form_writes_the_standard_ops():
    """``--portable`` writes the body (Mul, ReduceSum, Sub, Mul); ``normgrad export``'s default
    form keeps the operator (the expansion is a costly rewrite)."""
    step, _ = build_step_graph(build_training_graph(_attention(), loss="mse"), "adamw")
    portable, _ = make_portable(step)
    assert OP not in _ops(portable) and "ReduceSum" in _ops(portable, "")
    exported, _ = as_exported(step)
    assert OP in _ops(exported)
