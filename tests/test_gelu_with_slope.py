"""GeluWithSlope (ops/gelu_with_slope.py): the float64 reference against torch's gelu, its
autograd and finite differences; the C++ kernel's y within a few float32 ulps of the reference
(tails, infinities, NaN, signed zeros and subnormals included) and of torch's float32 gelu,
its slope bitwise GeluGrad's (so the backward's Mul(dy, slope) is GeluGrad(dy, x) bitwise),
both loops at 1/2/4 threads bitwise alike; the Python kernel and the function body; bad inputs
named; the builder's rewrite of the erf GELU (both product orders and Gelu-20, only for float32
and a chain read by itself); the step graph against its ``--inline`` form at every
optimization level and torch's gradients; the eval, inference and exposed-output graphs; the
portable form's standard ops."""

from __future__ import annotations

import math
import os

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest

import normgrad
from _helpers import (assert_step_matches_inline, cpp_available, cpp_error, cpp_results_by_loop_and_threads,
                      step_outputs)
from normgrad.graphs import build_step_graph, build_training_graph
from normgrad.graphs.optimizers import hyperparameter_feeds
from normgrad.graphs.step_graph import build_eval_graph, build_inference_model, expose_forward_outputs, forward_outputs
from normgrad.graphs.patterns import _declarative
from normgrad.graphs.portable import make_portable
from normgrad.ops import DOMAIN, IR_VERSION, NormgradInputError, activation_grad, gelu_with_slope, harness

OP = gelu_with_slope.OP_TYPE
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")
KERNELS = ["python"] + (["cpp"] if cpp_available() else [])
Y_ULPS = 8
"""y's bound against the float64 x Phi(x), in float32 ulps of y (measured: 6.7 near x = -0.14,
below 6 elsewhere; the erfcx polynomial's 1.8e-7 in float32 arithmetic, times E and x)."""
SPECIAL = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, 1.17e-38, -1.17e-38,
                    -13.2, -13.5, -14.0, -14.3, -14.5, -20.0, -1e30, 1e30, 3e38, -3e38], np.float32)
"""Infinities, NaN, signed zeros, subnormals, the tail where x Phi(x) becomes subnormal and 0."""


def _inputs(n=20011, seed=0):
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.standard_normal(n) * 5, np.linspace(-16, 16, 6401), SPECIAL]).astype(np.float32)


def test_reference_matches_torch_and_finite_differences():
    """y is torch's float64 gelu (approximate="none") and the slope its autograd, to torch's
    own float64 error (its 1 + erf cancels in the negative tail: a few 2^-52 times |x|, not
    times y), and the slope is the central float64 difference of y."""
    torch = pytest.importorskip("torch")
    x = _inputs(500)[:500].astype(np.float64)
    result = gelu_with_slope.reference(x)
    tx = torch.tensor(x, requires_grad=True)
    ty = torch.nn.functional.gelu(tx)
    ty.sum().backward()
    bound = 4 * 2.0**-52 * (1 + np.abs(x))
    assert (np.abs(result.y - ty.detach().numpy()) <= bound).all()
    assert (np.abs(result.slope - tx.grad.numpy()) <= bound).all()
    h = 1e-6
    difference = (gelu_with_slope.reference(x + h).y - gelu_with_slope.reference(x - h).y) / (2 * h)
    np.testing.assert_allclose(result.slope, difference, rtol=1e-7, atol=1e-9)


def _assert_y_within_ulps(y, x):
    """NaN where the float64 x Phi(x) is, infinities equal, the rest within Y_ULPS float32 ulps
    (of the subnormal spacing below 2^-126), zeros with x's sign."""
    truth = gelu_with_slope.reference(x.astype(np.float64)).y
    np.testing.assert_array_equal(np.isnan(y), np.isnan(truth))
    infinite = np.isinf(truth)
    np.testing.assert_array_equal(y[infinite], truth[infinite])
    finite = np.isfinite(truth)
    error = np.abs(y[finite].astype(np.float64) - truth[finite])
    bound = Y_ULPS * np.spacing(np.abs(truth[finite]).astype(np.float32)).astype(np.float64)
    assert (error <= bound).all(), x[finite][~(error <= bound)][:5]
    zeros = finite & (y == 0)
    np.testing.assert_array_equal(np.signbit(y[zeros]), np.signbit(x[zeros]))


@pytest.mark.parametrize("backend", KERNELS)
def test_kernels_within_a_few_ulps_of_the_reference(backend):
    """y within Y_ULPS of x Phi(x); the slope within 8 ulps of Phi(x) + |x| phi(x) (GeluGrad's
    bound)."""
    x = _inputs()
    out = harness.run(backend, OP, {"x": x})
    _assert_y_within_ulps(out["y"], x)
    wide = x.astype(np.float64)
    truth = activation_grad.derivative("gelu_erf", wide)
    np.testing.assert_array_equal(np.isnan(out["slope"]), np.isnan(truth))
    with np.errstate(all="ignore"):
        terms = gelu_with_slope.reference(np.abs(wide)).y / np.abs(wide) + np.abs(wide) * np.exp(-wide * wide / 2)
    finite = np.isfinite(wide)
    scale = np.where(np.isfinite(terms), terms, 1.0)[finite]
    bound = 8 * np.spacing(scale.astype(np.float32)).astype(np.float64) + 2.0**-140
    assert (np.abs(out["slope"][finite] - truth[finite]) <= bound).all()
    np.testing.assert_array_equal(out["slope"][np.isinf(wide)], np.where(wide[np.isinf(wide)] > 0, 1.0, 0.0))


@needs_cpp
def test_cpp_matches_torch_gelu_and_its_special_values():
    """torch's float32 gelu is within its own error of ours (its 1 + erf cancels in the
    negative tail: |x| 2^-24 per ulp of erf, not of y): within 8 |x| 2^-24 where torch's
    product x (1 + erf) stays finite (its AVX-512 loop overflows to inf past half of float32's
    largest value, where ours is the float64 truth: test_kernels_within_a_few_ulps_...); NaN
    where torch's is, and at +-inf torch's scalar values (gelu(-inf) is NaN, -inf times 0;
    its AVX-512 loop gives NaN at +inf too)."""
    torch = pytest.importorskip("torch")
    x = _inputs(100000)
    y = harness.run("cpp", OP, {"x": x})["y"]
    expected = torch.nn.functional.gelu(torch.from_numpy(x)).numpy()
    finite = np.isfinite(x) & (np.abs(x) < np.finfo(np.float32).max / 2)
    wide = x[finite].astype(np.float64)
    assert (np.abs(y[finite].astype(np.float64) - expected[finite]) <= 8 * np.abs(wide) * 2.0**-24).all()
    np.testing.assert_array_equal(np.isnan(y[np.isnan(x)]), np.isnan(expected[np.isnan(x)]))
    assert np.isnan(y[x == -np.inf]).all() and (y[x == np.inf] == np.inf).all()


@needs_cpp
def test_slope_is_gelu_grad_bitwise_and_its_product_is_gelu_grad_dx():
    """The slope is GeluGrad(1, x) and dy * slope (the backward's Mul) GeluGrad(dy, x), bitwise."""
    x = _inputs()
    dy = np.random.default_rng(2).standard_normal(x.size).astype(np.float32)
    slope = harness.run("cpp", OP, {"x": x})["slope"]
    ones = harness.run("cpp", "GeluGrad", {"dy": np.ones_like(x), "x": x})["dx"]
    np.testing.assert_array_equal(slope, ones)
    np.testing.assert_array_equal(dy * slope, harness.run("cpp", "GeluGrad", {"dy": dy, "x": x})["dx"])


@pytest.mark.parametrize("backend", ["functions", "evaluator"])
def test_function_body(backend):
    """The standard ops (|x| <= 5: float32's 1 + erf cancels further out)."""
    x = np.random.default_rng(3).uniform(-5, 5, 3000).astype(np.float32)
    out = harness.run(backend, OP, {"x": x})
    truth = gelu_with_slope.reference(x.astype(np.float64))
    np.testing.assert_allclose(out["y"], truth.y, rtol=0, atol=4e-6)
    np.testing.assert_allclose(out["slope"], truth.slope, rtol=0, atol=2e-6)


@needs_cpp
def test_cpp_loops_bitwise_at_every_thread_count(tmp_path):
    """The AVX2 lanes and the portable loop (NORMGRAD_KERNELS=generic), at 1, 2 and 4 threads,
    past the kernel's 16384-element chunks: the same bits."""
    script = (f"import sys, numpy as np; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
              "from test_gelu_with_slope import _inputs; from normgrad.ops import harness; "
              "out = harness.run('cpp', 'GeluWithSlope', {'x': _inputs(70001)}, threads=int(sys.argv[2])); "
              "np.save(sys.argv[1], np.stack([out['y'], out['slope']]))")
    results = cpp_results_by_loop_and_threads(tmp_path, script)
    first = results["auto", 1]
    for where, result in results.items():
        np.testing.assert_array_equal(result.view(np.uint32), first.view(np.uint32), err_msg=str(where))


@needs_cpp
def test_cpp_bad_input_names_the_input():
    assert f"{OP}: input 'x' must be float32; got int32" in cpp_error(OP, {"x": np.zeros((2, 3), np.int32)})


def test_validate_names_the_input():
    with pytest.raises(NormgradInputError, match=f"{OP}: input 'x' must be float32; got int32"):
        gelu_with_slope.reference(np.zeros((2, 3), np.int32))


# ----------------------------------------------------------------------------- the rewrite


needs_onnxscript = pytest.mark.skipif(not _declarative.AVAILABLE,
                                      reason="onnxscript is not installed: the exporters' chains are not matched")


def _mlp(form="dynamo", elem_type=onnx.TensorProto.FLOAT, shared=False, trained_constants=False):
    """x @ w1 + b1 -> erf GELU -> @ w2: the GELU as the dynamo exporter's chain
    ``x * ((erf(x / sqrt 2) + 1) * 0.5)``, TorchScript's ``(x * (erf + 1)) * 0.5``, opset 20's
    Gelu (approximate none or tanh); ``shared``: the chain's 1 + erf also a graph output. The
    chain's constants are Constant nodes, as the exporters write them, or with
    ``trained_constants`` initializers (which the builder trains: float, not frozen)."""
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
    rng = np.random.default_rng(0)
    weights = [onh.from_array((rng.standard_normal(shape) * 0.8).astype(dtype), name)
               for name, shape in (("w1", (6, 8)), ("b1", (8,)), ("w2", (8, 4)))]
    values = [onh.from_array(np.array(value, dtype), name)
              for name, value in (("root2", math.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]
    constants = values if trained_constants else []
    nodes = [oh.make_node("MatMul", ["x", "w1"], ["p"]), oh.make_node("Add", ["p", "b1"], ["h"])]
    if not trained_constants:
        nodes += [oh.make_node("Constant", [], [value.name], value=value) for value in values]
    if form.startswith("Gelu"):
        nodes.append(oh.make_node("Gelu", ["h"], ["a"], approximate="tanh" if form == "Gelu tanh" else "none"))
    else:
        nodes += [oh.make_node("Div", ["h", "root2"], ["scaled"]), oh.make_node("Erf", ["scaled"], ["erf"]),
                  oh.make_node("Add", ["erf", "one"], ["twice_cdf"])]
        if form == "dynamo":
            nodes += [oh.make_node("Mul", ["twice_cdf", "half"], ["cdf"]), oh.make_node("Mul", ["h", "cdf"], ["a"])]
        else:
            nodes += [oh.make_node("Mul", ["h", "twice_cdf"], ["xb"]), oh.make_node("Mul", ["xb", "half"], ["a"])]
    nodes.append(oh.make_node("MatMul", ["a", "w2"], ["y"]))
    outputs = [oh.make_tensor_value_info("y", elem_type, [5, 4])]
    if shared:
        outputs.append(oh.make_tensor_value_info("twice_cdf", elem_type, [5, 8]))
    graph = oh.make_graph(nodes, "gelu_mlp", [oh.make_tensor_value_info("x", elem_type, [5, 6])], outputs,
                          weights + constants)
    opset = 20 if form.startswith("Gelu") else 18
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=IR_VERSION)


def _ops(model, domain=DOMAIN):
    return [n.op_type for n in model.graph.node if n.domain == domain]


@pytest.mark.parametrize("form, elem_type, shared, trained_constants, rewritten", [
    pytest.param("dynamo", onnx.TensorProto.FLOAT, False, False, True, marks=needs_onnxscript),
    pytest.param("torchscript", onnx.TensorProto.FLOAT, False, False, True, marks=needs_onnxscript),
    ("Gelu", onnx.TensorProto.FLOAT, False, False, True), ("dynamo", onnx.TensorProto.DOUBLE, False, False, False),
    ("Gelu", onnx.TensorProto.DOUBLE, False, False, False), ("Gelu tanh", onnx.TensorProto.FLOAT, False, False, False),
    ("torchscript", onnx.TensorProto.FLOAT, True, False, False), ("dynamo", onnx.TensorProto.FLOAT, False, True, False)])
def test_which_gelus_become_the_operator(form, elem_type, shared, trained_constants, rewritten):
    """Both chain orders and Gelu-20 (approximate none) of a float32 x, writing the GELU's
    output name, and no GeluGrad; float64, the tanh Gelu, a chain whose 1 + erf is also an
    output and one whose constants are trained initializers (each gets its gradient) keep
    their nodes."""
    training = build_training_graph(_mlp(form, elem_type, shared, trained_constants), loss="mse")
    nodes = training.model.graph.node
    if trained_constants:
        assert {"root2_grad", "one_grad", "half_grad"} <= {o.name for o in training.model.graph.output}
    gelu = next(n for n in nodes if "a" in n.output)
    forward = [n.op_type for n in nodes if not n.name.startswith("grad")]
    if rewritten:
        assert (gelu.domain, gelu.op_type, gelu.input[0], gelu.output[0]) == (DOMAIN, OP, "h", "a")
        assert "Erf" not in forward and "Gelu" not in forward
        assert not any(n.op_type in ("GeluGrad", "GeluTanhGrad") for n in nodes)
    else:
        assert gelu.op_type in ("Mul", "Gelu") and not any(n.op_type == OP for n in nodes)


def _feeds(step, initial, seed=7):
    rng = np.random.default_rng(seed)
    return {**hyperparameter_feeds(step), **initial, "x": (rng.standard_normal((5, 6)) * 2).astype(np.float32),
            "labels": rng.standard_normal((5, 4)).astype(np.float32), "lr": np.array(0.1, np.float32),
            "step": np.array(1, np.float32)}


@pytest.mark.parametrize("form", [pytest.param("dynamo", marks=needs_onnxscript), "Gelu"])
def test_step_graph_matches_the_inline_form_and_torch(form):
    """At every optimization level, with the C++ and Python kernels and the inlined bodies,
    the updated weights match the ``--inline`` form's (the exporter's chain and GELU's
    standard-op gradient), bitwise at 1, 2 and 4 threads; the SGD step is torch's."""
    forward = _mlp(form)
    step, initial = build_step_graph(build_training_graph(forward, loss="mse"), "sgd")
    inline, _ = build_step_graph(build_training_graph(forward, loss="mse", inline=True), "sgd")
    assert _ops(step).count(OP) == 1 and "GeluGrad" not in _ops(step) and not _ops(inline)
    feeds = _feeds(step, initial)
    assert_step_matches_inline(step, inline, feeds, ("w1.next", "b1.next", "w2.next"))
    torch = pytest.importorskip("torch")
    w = {k: torch.tensor(initial[k].astype(np.float64), requires_grad=True) for k in ("w1", "b1", "w2")}
    y = torch.nn.functional.gelu(torch.tensor(feeds["x"].astype(np.float64)) @ w["w1"] + w["b1"]) @ w["w2"]
    torch.nn.functional.mse_loss(y, torch.tensor(feeds["labels"].astype(np.float64))).backward()
    got = step_outputs(step, feeds, "cpp" if cpp_available() else None, "ORT_ENABLE_ALL")
    for k in w:
        np.testing.assert_allclose(got[f"{k}.next"], initial[k] - 0.1 * w[k].grad.numpy(), rtol=1e-5, atol=1e-6)


def _session(model):
    options = ort.SessionOptions()
    if cpp_available():
        normgrad.session_options("cpp", options)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_eval_inference_and_exposed_graphs_compute_the_forward():
    """The eval graph's loss, the inference model's y and the step graph's exposed GELU
    output (GeluWithSlope's y, its slope unused) are torch's forward."""
    torch = pytest.importorskip("torch")
    step, initial = build_step_graph(build_training_graph(_mlp("Gelu"), loss="mse"), "sgd")
    feeds = _feeds(step, initial)
    w = {k: torch.tensor(initial[k].astype(np.float64)) for k in ("w1", "b1", "w2")}
    a = torch.nn.functional.gelu(torch.tensor(feeds["x"].astype(np.float64)) @ w["w1"] + w["b1"])
    y = (a @ w["w2"]).numpy()
    loss = float(np.mean((y - feeds["labels"]) ** 2))
    eval_graph = build_eval_graph(step)
    assert OP in _ops(eval_graph)
    session = _session(eval_graph)
    results = dict(zip([o.name for o in session.get_outputs()],
                       session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})))
    np.testing.assert_allclose(results["loss"], loss, rtol=1e-5)
    inference = build_inference_model(step, initial)
    session = _session(inference)
    got = session.run(["y"], {"x": feeds["x"]})[0]
    np.testing.assert_allclose(got, y, rtol=1e-5, atol=1e-6)
    exposed = expose_forward_outputs(step, forward_outputs(step) + ["a"])
    session = _session(exposed)
    got = session.run(["a"], {i.name: feeds[i.name] for i in session.get_inputs()})[0]
    np.testing.assert_allclose(got, a.numpy(), rtol=1e-5, atol=1e-6)


def test_portable_form_writes_the_standard_ops():
    """``--portable`` writes the body: the exporter's chain and the slope's standard ops."""
    step, _ = build_step_graph(build_training_graph(_mlp("Gelu"), loss="mse"), "sgd")
    portable, _ = make_portable(step)
    assert OP in _ops(step) and OP not in _ops(portable) and _ops(portable, "").count("Erf") == 1
