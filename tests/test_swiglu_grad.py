"""SwiGLUGrad (ops/swiglu_grad.py): the float64 reference against finite differences and torch
autograd; the C++ kernel's dgate bitwise SiLUGrad's for dy * up and both outputs within a few
float32 ulps of the reference (both loops, 1/2/4 threads, bitwise alike); the Python kernel
and the function body; bad inputs named; the step graph of a gated MLP uses the operator for
``Mul(SiLU(gate), up)`` and matches its ``--inline`` form (the standard ops) at every
optimization level (the forward's SiLUMul, tests/test_silu_mul.py, differentiated as SwiGLUGrad),
and neither applies where it should not."""

from __future__ import annotations

import os

import numpy as np
import pytest

from _helpers import (assert_step_matches_inline, cpp_available, cpp_error, cpp_results_by_loop_and_threads,
                      step_outputs)
from normgrad.graphs import build_step_graph, build_training_graph
from normgrad.graphs.optimizers import hyperparameter_feeds
from normgrad.ops import DOMAIN, NormgradInputError, activation_grad, harness, swiglu_grad
from _swiglu_reference import _forward, _within_ulps

OP = swiglu_grad.OP_TYPE
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")


def _inputs(n=20011, seed=0):
    rng = np.random.default_rng(seed)
    gate = np.concatenate([rng.standard_normal(n) * 4, [np.inf, -np.inf, np.nan, 0.0, -0.0, 90.0, -90.0, -110.0]])
    return {"dy": rng.standard_normal(gate.size).astype(np.float32), "gate": gate.astype(np.float32),
            "up": rng.standard_normal(gate.size).astype(np.float32)}


def test_reference_is_the_gradient_of_silu_gate_times_up():
    """Central float64 differences of y = silu(gate) up, against both outputs."""
    rng = np.random.default_rng(1)
    gate, up, dy = (rng.standard_normal(50) * 3 for _ in range(3))
    silu = lambda g: g / (1 + np.exp(-g))  # noqa: E731
    h = 1e-6
    result = swiglu_grad.reference(dy, gate, up)
    np.testing.assert_allclose(result.dgate, dy * up * (silu(gate + h) - silu(gate - h)) / (2 * h), rtol=1e-7,
                               atol=1e-9)
    np.testing.assert_allclose(result.dup, dy * silu(gate), rtol=1e-12, atol=0)


def test_reference_matches_torch_autograd():
    torch = pytest.importorskip("torch")
    values = _inputs(500)
    gate, up = (torch.tensor(values[k].astype(np.float64)[:500], requires_grad=True) for k in ("gate", "up"))
    (torch.nn.functional.silu(gate) * up).backward(torch.tensor(values["dy"].astype(np.float64)[:500]))
    result = swiglu_grad.reference(*(values[k].astype(np.float64)[:500] for k in ("dy", "gate", "up")))
    np.testing.assert_allclose(result.dgate, gate.grad.numpy(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(result.dup, up.grad.numpy(), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("backend", ["python"] + (["cpp"] if cpp_available() else []))
def test_kernels_within_a_few_ulps_of_the_reference(backend):
    """dgate at the scale of |dy up| times the sum of silu''s terms' magnitudes, dup at |dy silu(gate)|."""
    values = _inputs()
    out = harness.run(backend, OP, values)
    wide = {k: v.astype(np.float64) for k, v in values.items()}
    truth = swiglu_grad.reference(**wide)
    with np.errstate(all="ignore"):
        s = activation_grad.sigmoid(wide["gate"])
        terms = np.nan_to_num(s + np.abs(wide["gate"]) * s * (1 - s), nan=1.0)  # 1 at gate = inf
        _within_ulps(out["dgate"], truth.dgate, np.abs(wide["dy"] * wide["up"]) * terms)
        _within_ulps(out["dup"], truth.dup, np.abs(wide["dy"] * wide["gate"]) * s)


@needs_cpp
def test_dgate_is_silu_grad_of_dy_times_up_bitwise():
    values = _inputs()
    silu = harness.run("cpp", "SiLUGrad", {"dy": values["dy"] * values["up"], "x": values["gate"]})["dx"]
    np.testing.assert_array_equal(harness.run("cpp", OP, values)["dgate"], silu)


@pytest.mark.parametrize("backend", ["functions", "evaluator"])
def test_function_body(backend):
    """The standard ops (away from the tails, where 1 - s cancels in float32)."""
    values = {k: v[:2000] for k, v in _inputs().items()}
    out = harness.run(backend, OP, values)
    truth = swiglu_grad.reference(**{k: v.astype(np.float64) for k, v in values.items()})
    np.testing.assert_allclose(out["dgate"], truth.dgate, rtol=2e-4, atol=1e-5)
    np.testing.assert_allclose(out["dup"], truth.dup, rtol=1e-5, atol=1e-6)


@needs_cpp
def test_cpp_loops_bitwise_at_every_thread_count(tmp_path):
    """The AVX2 lanes and the portable loop (NORMGRAD_KERNELS=generic), at 1, 2 and 4 threads,
    past the kernel's 16384-element chunks: the same bits."""
    script = (f"import sys, numpy as np; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
              "from test_swiglu_grad import _inputs; from normgrad.ops import harness; "
              "out = harness.run('cpp', 'SwiGLUGrad', _inputs(70001), threads=int(sys.argv[2])); "
              "np.save(sys.argv[1], np.stack([out['dgate'], out['dup']]))")
    results = cpp_results_by_loop_and_threads(tmp_path, script)
    first = results["auto", 1]
    for where, result in results.items():
        np.testing.assert_array_equal(result, first, err_msg=str(where))


BAD = {
    "up of another shape": ("up", np.zeros((2, 4), np.float32), "must have the shape of 'gate' [2, 3]; got [2, 4]"),
    "dy of another shape": ("dy", np.zeros(6, np.float32), "must have the shape of 'gate' [2, 3]; got [6]"),
    "int32 gate": ("gate", np.zeros((2, 3), np.int32), "must be float32; got int32"),
}


def _good():
    return {name: np.ones((2, 3), np.float32) for name in swiglu_grad.INPUTS}


@needs_cpp
@pytest.mark.parametrize("case", BAD)
def test_cpp_bad_input_names_the_input(case):
    name, bad, rule = BAD[case]
    assert f"{OP}: input '{name}' {rule}" in cpp_error(OP, {**_good(), name: bad})


@pytest.mark.parametrize("case", BAD)
def test_validate_names_the_input(case):
    name, bad, rule = BAD[case]
    with pytest.raises(NormgradInputError) as error:
        swiglu_grad.reference(**{**_good(), name: bad})
    assert f"{OP}: input '{name}' {rule.split(';')[0].replace(' [2, 3]', '')}" in str(error.value)


# ----------------------------------------------------------------------------- step graphs


@pytest.mark.parametrize("variant", ["swiglu", "both swapped"])
def test_step_graph_uses_the_operator_and_matches_the_inline_form(variant):
    """The forward's SiLUMul and one SwiGLUGrad, no SiLUGrad, no Sigmoid; the updated weights
    match the ``--inline`` form's at every level with the C++ and Python kernels and the
    inlined bodies, and the same bits at 1, 2 and 4 threads; the gradients are torch's."""
    forward = _forward(variant)
    step, initial = build_step_graph(build_training_graph(forward, loss="mse"), "sgd")
    inline, _ = build_step_graph(build_training_graph(forward, loss="mse", inline=True), "sgd")
    ops = [n.op_type for n in step.graph.node if n.domain == DOMAIN]
    assert ops.count(OP) == 1 and ops.count("SiLUMul") == 1 and "SiLUGrad" not in ops
    assert not any(n.op_type == "Sigmoid" for n in step.graph.node)
    assert not any(n.domain == DOMAIN for n in inline.graph.node)
    rng = np.random.default_rng(7)
    x, labels = rng.standard_normal((5, 6)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)
    feeds = {**hyperparameter_feeds(step), **initial, "x": x, "labels": labels, "lr": np.array(0.1, np.float32),
             "step": np.array(1, np.float32)}
    assert_step_matches_inline(step, inline, feeds, ("wg.next", "wu.next", "wd.next"))
    torch = pytest.importorskip("torch")
    w = {k: torch.tensor(initial[k].astype(np.float64), requires_grad=True) for k in ("wg", "wu", "wd")}
    tx = torch.tensor(x.astype(np.float64))
    y = (torch.nn.functional.silu(tx @ w["wg"]) * (tx @ w["wu"])) @ w["wd"]
    torch.nn.functional.mse_loss(y, torch.tensor(labels.astype(np.float64))).backward()
    got = step_outputs(step, feeds, "cpp" if cpp_available() else None, "ORT_ENABLE_ALL")
    for k in w:
        np.testing.assert_allclose(got[f"{k}.next"], initial[k] - 0.1 * w[k].grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["broadcast", "self", "read twice"])
def test_pattern_stays_off_where_it_does_not_apply(variant):
    """up broadcast, up the SiLU's own input, or the SiLU read elsewhere: no SiLUMul, SiLUGrad
    and the product's own gradients; the step still matches its --inline form."""
    forward = _forward(variant)
    step, initial = build_step_graph(build_training_graph(forward, loss="mse"), "sgd")
    inline, _ = build_step_graph(build_training_graph(forward, loss="mse", inline=True), "sgd")
    ops = [n.op_type for n in step.graph.node if n.domain == DOMAIN]
    assert OP not in ops and "SiLUMul" not in ops and ops.count("SiLUGrad") == 1
    rng = np.random.default_rng(3)
    feeds = {**hyperparameter_feeds(step), **initial, "x": rng.standard_normal((5, 6)).astype(np.float32),
             "labels": rng.standard_normal((5, 4)).astype(np.float32), "lr": np.array(0.1, np.float32),
             "step": np.array(1, np.float32)}
    expected = step_outputs(inline, feeds, None, "ORT_DISABLE_ALL")
    got = step_outputs(step, feeds, "cpp" if cpp_available() else None, "ORT_ENABLE_ALL")
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
