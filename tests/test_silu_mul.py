"""SiLUMul (ops/silu_mul.py), Llama's gated unit y = silu(gate) * up in one pass: the float64
reference against torch's ``F.silu(gate) * up`` (special values included); the C++ kernel
within a few float32 ulps of the reference, its silu(gate) SwiGLUGrad's bit for bit, both
loops at 1/2/4 threads alike; the Python kernel and the function body; bad inputs named;
which chains the builder rewrites into it; the eval and inference graphs derived from a step
graph that has it. The step graph against its ``--inline`` form at every optimization level:
tests/test_swiglu_grad.py (its rule is SwiGLUGrad)."""

from __future__ import annotations

import itertools
import os

import numpy as np
import onnx
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest

import normgrad

from _helpers import cpp_available, cpp_error, cpp_results_by_loop_and_threads, step_outputs
from normgrad.graphs import build_step_graph, build_training_graph
from normgrad.graphs.portable import as_exported, make_portable
from normgrad.graphs.optimizers import hyperparameter_feeds
from normgrad.graphs.step_graph import build_eval_graph, build_inference_model
from normgrad.ops import DOMAIN, NormgradInputError, harness, silu_mul
from _swiglu_reference import _forward, _within_ulps

OP = silu_mul.OP_TYPE
KERNELS = ["python"] + (["cpp"] if cpp_available() else [])
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")

ULPS = 6
"""y's error bound in float32 ulps of |y| (measured: 4.6 on these inputs)."""

SPECIAL_GATES = [np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, -89.0, -90.0,
                 -104.0, -110.0]
SPECIAL_UPS = [1.0, -1.0, 0.0, -0.0, np.inf, -np.inf, np.nan, 3e38]


def _inputs(n=20011, seed=0):
    """Random gate (spread 4) and up, then every pair of the special values."""
    rng = np.random.default_rng(seed)
    pairs = np.array(list(itertools.product(SPECIAL_GATES, SPECIAL_UPS)))
    gate = np.concatenate([rng.standard_normal(n) * 4, pairs[:, 0]])
    up = np.concatenate([rng.standard_normal(n), pairs[:, 1]])
    return {"gate": gate.astype(np.float32), "up": up.astype(np.float32)}


CPP_SILU_ZERO_BELOW = -103.0
"""The C++ kernel's silu(gate) is -0.0 below this gate (exp(gate) is 0 there: silu(gate) is
beneath 2^-140, the subnormals' last few bits), as torch's float32 silu is below -88.7."""


def _truth(values, backend="python") -> np.ndarray:
    """The float64 reference, infinite where it is past float32's range; for the C++ kernel
    -0.0 * up where -inf < gate < CPP_SILU_ZERO_BELOW (so NaN for an infinite up, as in torch)."""
    gate, up = (values[k].astype(np.float64) for k in silu_mul.INPUTS)
    with np.errstate(over="ignore"):
        truth = silu_mul.reference(gate, up).y
        truth = np.where(np.isinf(truth.astype(np.float32)), truth.astype(np.float32), truth)
    with np.errstate(invalid="ignore"):
        return np.where((backend == "cpp") & (-np.inf < gate) & (gate < CPP_SILU_ZERO_BELOW), -0.0 * up, truth)


def test_reference_is_torchs_silu_times_up():
    """In float64, special values included: NaN where torch's is, infinities and zeros with
    torch's signs (silu(-inf) * up is NaN, -inf * 0, in both), the rest to 1e-12."""
    torch = pytest.importorskip("torch")
    values = _inputs(2000)
    gate, up = (values[k].astype(np.float64) for k in ("gate", "up"))
    expected = (torch.nn.functional.silu(torch.tensor(gate)) * torch.tensor(up)).numpy()
    result = silu_mul.reference(gate, up).y
    np.testing.assert_array_equal(np.isnan(result), np.isnan(expected))
    np.testing.assert_array_equal(np.signbit(result[~np.isnan(result)]), np.signbit(expected[~np.isnan(expected)]))
    np.testing.assert_allclose(result, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("backend", KERNELS)
def test_kernels_within_a_few_ulps_of_the_reference(backend):
    values = _inputs()
    y = harness.run(backend, OP, values)["y"]
    truth = _truth(values, backend)
    _within_ulps(y, truth, truth, ULPS)
    zeros = truth == 0
    np.testing.assert_array_equal(np.signbit(y[zeros]), np.signbit(truth[zeros]))


@pytest.mark.parametrize("backend", KERNELS)
def test_kernels_special_values_are_torchs(backend):
    """Every special pair in float32: NaN where torch's float32 is and the signs of its
    zeros and infinities, the values within the bound of the reference (torch's float64
    values, test_reference_is_torchs_silu_times_up); except that
    torch's float32 silu is -0.0 from gate = -88.7 on (its exp(-gate) overflows) where the
    kernels keep the tiny value (the C++ kernel down to CPP_SILU_ZERO_BELOW): there times an
    infinite up they give torch's float64 infinity, not NaN."""
    torch = pytest.importorskip("torch")
    values = {k: v[-len(SPECIAL_GATES) * len(SPECIAL_UPS):] for k, v in _inputs(0).items()}
    y = harness.run(backend, OP, values)["y"]
    gate, up = (torch.tensor(values[k]) for k in ("gate", "up"))
    float32 = (torch.nn.functional.silu(gate) * up).numpy()
    kept = values["gate"] >= (CPP_SILU_ZERO_BELOW if backend == "cpp" else -np.inf)
    band = (values["gate"] < -88.7) & kept & np.isinf(values["up"])
    np.testing.assert_array_equal(np.isnan(y[~band]), np.isnan(float32[~band]))
    numbers = ~np.isnan(float32)
    np.testing.assert_array_equal(np.signbit(y[numbers]), np.signbit(float32[numbers]))
    truth = _truth(values, backend)
    _within_ulps(y, truth, truth, ULPS)


@needs_cpp
def test_cpp_silu_is_swiglu_grads_bitwise():
    """y is SwiGLUGrad's dup for dy = up (dy * silu(gate)): one sigmoid for the forward and the backward."""
    values = _inputs()
    dup = harness.run("cpp", "SwiGLUGrad", {"dy": values["up"], **values})["dup"]
    assert harness.run("cpp", OP, values)["y"].tobytes() == dup.tobytes()


@pytest.mark.parametrize("backend", ["functions", "evaluator"])
def test_function_body(backend):
    """The standard ops, away from the tails (onnxruntime's Sigmoid flushes to 0 there; its
    QuickGelu, Mul(x, Sigmoid(x)) fused, is within 1e-6 of silu, not a few ulps)."""
    values = {k: v[:2000] for k, v in _inputs().items()}
    y = harness.run(backend, OP, values)["y"]
    np.testing.assert_allclose(y, _truth(values), rtol=1e-5, atol=2e-6)


@needs_cpp
def test_cpp_loops_bitwise_at_every_thread_count(tmp_path):
    """The AVX2 lanes and the portable loop (NORMGRAD_KERNELS=generic), at 1, 2 and 4 threads,
    past the kernel's 16384-element chunks and with a tail of fewer than 8: the same bits."""
    script = (f"import sys, numpy as np; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
              "from test_silu_mul import _inputs; from normgrad.ops import harness; "
              "np.save(sys.argv[1], harness.run('cpp', 'SiLUMul', _inputs(70001), threads=int(sys.argv[2]))['y'])")
    results = cpp_results_by_loop_and_threads(tmp_path, script)
    first = results["auto", 1]
    for where, result in results.items():
        assert result.tobytes() == first.tobytes(), where


BAD = {
    "up of another shape": ("up", np.zeros((2, 4), np.float32), "must have the shape of 'gate' [2, 3]; got [2, 4]"),
    "int32 gate": ("gate", np.zeros((2, 3), np.int32), "must be float32; got int32"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_names_the_input(case):
    """The reference's validation and the C++ kernel: the same message."""
    name, bad, rule = BAD[case]
    feeds = {**{other: np.ones((2, 3), np.float32) for other in silu_mul.INPUTS}, name: bad}
    with pytest.raises(NormgradInputError) as error:
        silu_mul.reference(**feeds)
    assert f"{OP}: input '{name}' {rule}" in str(error.value)
    if cpp_available():
        assert f"{OP}: input '{name}' {rule}" in cpp_error(OP, feeds)


# ----------------------------------------------------------------------------- the rewrite


@pytest.mark.parametrize("variant, outcome", [
    ("swiglu", "operator"), ("sigmoid first", "operator"), ("up first", "operator"), ("both swapped", "operator"),
    ("broadcast", "nodes"), ("self", "nodes"), ("read twice", "nodes"), ("sigmoid an output", "nodes"),
    ("silu an output", "nodes"), ("dynamic batch", "nodes, SwiGLUGrad"), ("float16", "nodes")])
def test_which_chains_become_the_operator(variant, outcome):
    """Only float32 gate and up of one static shape, the Sigmoid and the SiLU read by the
    chain alone; with a dim_param the chain stays but its gradient is one SwiGLUGrad
    (patterns/silu.py's gated_silu); elsewhere the standard ops stay, and no SwiGLUGrad."""
    dtype = onnx.TensorProto.FLOAT16 if variant == "float16" else onnx.TensorProto.FLOAT
    nodes = build_training_graph(_forward(variant, dtype), loss="mse").model.graph.node
    product = next(n for n in nodes if "p" in n.output)
    op_types = [n.op_type for n in nodes]
    if outcome == "operator":
        assert (product.domain, product.op_type, list(product.input)) == (DOMAIN, OP, ["g", "u"])
        assert "Sigmoid" not in op_types and op_types.count("SwiGLUGrad") == 1
    else:
        assert product.op_type == "Mul" and OP not in op_types
        assert op_types.count("SwiGLUGrad") == (1 if outcome == "nodes, SwiGLUGrad" else 0)
        assert op_types.count("Sigmoid") == 1


def test_named_dims_chain_gradient_reads_neither_sigmoid_nor_silu():
    """gate and up of one shape with a dim_param (onnxruntime-genai's [batch_size,
    sequence_length, F]): the forward keeps its nodes, the backward's one SwiGLUGrad reads
    gate and up, so neither the Sigmoid's nor the SiLU's output stays alive for it; the
    gradients are the float64 chain's."""
    training = build_training_graph(_forward("dynamic batch"), loss="mse")
    readers = [name for node in training.model.graph.node for name in node.input]
    assert readers.count("s") == 1 and readers.count("a") == 1  # the chain's own Muls
    rng = np.random.default_rng(3)
    x, labels = rng.standard_normal((7, 6)).astype(np.float32), rng.standard_normal((7, 4)).astype(np.float32)
    weights = {t.name: onh.to_array(t).astype(np.float64) for t in _forward().graph.initializer}
    g, u = x @ weights["wg"], x @ weights["wu"]
    sigmoid = 1 / (1 + np.exp(-g))
    product = g * sigmoid * u
    dy = 2 * (product @ weights["wd"] - labels) / labels.size
    dp = dy @ weights["wd"].T
    dg = dp * u * sigmoid * (1 + g * (1 - sigmoid))
    expected = {"wg": x.T @ dg, "wu": x.T @ (dp * g * sigmoid), "wd": product.T @ dy}
    options = ort.SessionOptions()
    normgrad.session_options("cpp" if cpp_available() else "python", options)
    model = training.model if cpp_available() else normgrad.prepare_for_python_kernels(training.model)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, training.feeds({"x": x, "labels": labels}))))
    for name, value in expected.items():
        np.testing.assert_allclose(got[f"{name}_grad"], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_eval_and_inference_graphs_have_the_operator():
    """A step graph's eval graph (loss and y) and inference model (y) keep SiLUMul and compute
    the forward's values: the standard-op forward model's y and its mean squared error."""
    forward = _forward()
    step, initial = build_step_graph(build_training_graph(forward, loss="mse"), "sgd")
    rng = np.random.default_rng(5)
    x, labels = rng.standard_normal((5, 6)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)
    expected = step_outputs(forward, {"x": x}, None, "ORT_DISABLE_ALL")["y"]
    kernels = "cpp" if cpp_available() else "python"
    evaluation = build_eval_graph(step)
    inference = build_inference_model(step, initial)
    for model in (evaluation, inference):
        assert [n.op_type for n in model.graph.node if n.domain == DOMAIN] == [OP]
    got = step_outputs(evaluation, {**hyperparameter_feeds(step), **initial, "x": x, "labels": labels}, kernels,
                       "ORT_ENABLE_ALL")
    np.testing.assert_allclose(got["y"], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["loss"], np.mean((expected.astype(np.float64) - labels) ** 2), rtol=1e-5)
    np.testing.assert_allclose(step_outputs(inference, {"x": x}, kernels, "ORT_ENABLE_ALL")["y"], expected,
                               rtol=1e-5, atol=1e-6)


def test_portable_form_writes_the_standard_ops():
    """``--portable`` writes the body (Sigmoid, Mul, Mul); ``normgrad export``'s default form
    keeps the operator (the expansion is a costly rewrite)."""
    step, _ = build_step_graph(build_training_graph(_forward(), loss="mse"), "sgd")
    portable, _ = make_portable(step)
    op_types = [n.op_type for n in portable.graph.node]
    assert OP not in op_types and op_types.count("Sigmoid") == 1
    exported, _ = as_exported(step)
    assert OP in [n.op_type for n in exported.graph.node]
