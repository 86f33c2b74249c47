"""SiLUGrad, GeluGrad, GeluTanhGrad (ops/activation_grad.py): the float64 reference against
finite differences of the activations and torch autograd; the C++ kernel (both loops, 1/2/4
threads, bitwise) and the Python kernel within a few float32 ulps of the reference over
the whole float range (inf, NaN, subnormal results); the function bodies; bad inputs named;
the step graphs use the operators for float32 SiLU and erf GELU chains (with and without
onnxscript) and match their ``--inline`` form (the standard ops) at every optimization level."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest

import normgrad
from _helpers import assert_step_matches_inline, cpp_available, cpp_results_by_loop_and_threads
from normgrad.graphs import build_step_graph, build_training_graph
from normgrad.graphs.optimizers import hyperparameter_feeds
from normgrad.graphs.patterns import _declarative
from normgrad.ops import DOMAIN, IR_VERSION, ONNX_OPSET, OPSET_VERSION, NormgradInputError, activation_grad, harness
from normgrad.ops._common import tensor_type

ACTIVATIONS = list(activation_grad.ACTIVATIONS)
OP = activation_grad.ACTIVATIONS
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")
ULPS = 8
"""Kernel error bound, in float32 ulps of |dy| times the sum of f''s terms' magnitudes (the
scale at which float32 can resolve a result that is a difference of terms)."""


def _activation(name: str, x: np.ndarray) -> np.ndarray:
    """f(x) in float64, written from the definitions (not from f')."""
    if name == "silu":
        return x / (1 + np.exp(-x))
    if name == "gelu_erf":
        return 0.5 * x * np.frompyfunc(math.erfc, 1, 1)(-x / math.sqrt(2)).astype(np.float64)
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _terms(name: str, x: np.ndarray) -> np.ndarray:
    """|first term| + |second term| of f' (the magnitude its float32 value is resolved at)."""
    x = x.astype(np.float64)
    with np.errstate(all="ignore"):
        if name == "gelu_erf":
            density = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
            cdf = 0.5 * np.frompyfunc(math.erfc, 1, 1)(-x / math.sqrt(2)).astype(np.float64)
            return cdf + np.where(density == 0, 0.0, np.abs(x * density))
        v, c = (x, x) if name == "silu" else (
            2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3), 2 * math.sqrt(2 / math.pi) * x * (1 + 0.134145 * x * x))
        e = np.exp(-np.abs(v))
        spread = e / (1 + e) ** 2
        return np.where(v >= 0, 1 / (1 + e), e / (1 + e)) + np.where(spread == 0, 0.0, np.abs(c * spread))


def _wide_x() -> np.ndarray:
    rng = np.random.default_rng(0)
    special = [np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-30, -1e-30, 1e-42, 3e38, -3e38, 1e13, -1e13, 88.7, -88.7,
               103.9, -103.9, -104.1, 200.0, -200.0, -0.7518, -1.2785, -2.3994]
    return np.concatenate([rng.standard_normal(30000) * 3, rng.uniform(-120, 120, 30000), np.linspace(-4, 2, 20001),
                           np.array(special)]).astype(np.float32)


def _assert_close(name: str, x: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:
    truth = dy.astype(np.float64) * activation_grad.derivative(name, x)
    np.testing.assert_array_equal(np.isnan(dx), np.isnan(truth))
    scale = np.abs(dy.astype(np.float64)) * _terms(name, x)
    ulp = np.spacing(scale.astype(np.float32)).astype(np.float64)
    # a subnormal intermediate (e, s (1 - s), exp(-x^2 / 2)) holds fewer bits: its absolute
    # rounding (2**-149), carried by the factor it multiplies
    carried = np.abs(dy.astype(np.float64)) * (1 + np.abs(x.astype(np.float64)) ** 3) * 2.0**-149
    finite = ~np.isnan(truth)
    with np.errstate(invalid="ignore"):
        error = np.abs(dx.astype(np.float64) - truth)
    bad = finite & ~(error <= ULPS * ulp + ULPS * carried)
    assert not bad.any(), (name, x[bad][:5], dx[bad][:5], truth[bad][:5])


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_reference_is_the_derivative(name):
    """Central finite differences of f in float64, on x where they resolve f' to 1e-7."""
    x = np.linspace(-9, 9, 721)
    step = 1e-5
    numeric = (_activation(name, x + step) - _activation(name, x - step)) / (2 * step)
    np.testing.assert_allclose(activation_grad.derivative(name, x), numeric, rtol=1e-7, atol=1e-9)
    np.testing.assert_array_equal(activation_grad.derivative(name, np.array([np.inf, -np.inf])), [1.0, 0.0])


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_reference_matches_torch_autograd(name):
    torch = pytest.importorskip("torch")
    x = np.concatenate([np.linspace(-30, 30, 6001), [-80.0, 80.0]])
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    function = {"silu": torch.nn.functional.silu, "gelu_erf": torch.nn.functional.gelu,
                "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}[name]
    function(t).sum().backward()
    # torch computes 1 - t^2 and 1 + erf by subtraction: their float64 tails are off by
    # about 1e-16, times the factor (x u' ~ x^3) they multiply
    ours, theirs = activation_grad.derivative(name, x), t.grad.numpy()
    assert np.all(np.abs(ours - theirs) <= 1e-12 * np.abs(theirs) + 1e-16 * (1 + np.abs(x) ** 3))


@pytest.mark.parametrize("backend", ["python"] + (["cpp"] if cpp_available() else []))
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_kernels_within_a_few_ulps_of_the_reference(backend, name):
    x = _wide_x()
    dy = np.random.default_rng(1).standard_normal(x.size).astype(np.float32)
    dx = harness.run(backend, OP[name], {"dy": dy, "x": x}, threads=1)["dx"]
    assert dx.dtype == np.float32 and dx.shape == x.shape
    _assert_close(name, x, dy, dx)


@pytest.mark.parametrize("backend", ["python"] + (["cpp"] if cpp_available() else []))
@pytest.mark.parametrize("shape", [(0,), (1,), (3, 0, 2), (2, 3, 5)])
def test_empty_and_small_shapes(backend, shape):
    x = np.linspace(-3, 3, int(np.prod(shape))).astype(np.float32).reshape(shape)
    dy = np.ones_like(x)
    for name in ACTIVATIONS:
        dx = harness.run(backend, OP[name], {"dy": dy, "x": x})["dx"]
        assert dx.shape == shape
        _assert_close(name, x, dy, dx)


@pytest.mark.parametrize("backend", ["functions", "evaluator"])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_function_bodies(backend, name):
    """The standard-op forms (float32 textbook formulas: checked where they do not cancel)."""
    x = np.linspace(-5, 5, 201).astype(np.float32)
    dy = np.random.default_rng(2).standard_normal(x.size).astype(np.float32)
    dx = harness.run(backend, OP[name], {"dy": dy, "x": x})["dx"]
    truth = dy * activation_grad.derivative(name, x)
    np.testing.assert_allclose(dx, truth, rtol=1e-5, atol=2e-6 * np.abs(dy).max())


_RUN_CPP = """
import sys, numpy as np
from normgrad.ops import harness
x = np.random.default_rng(3).standard_normal(3 * 70001).astype(np.float32).reshape(3, 70001) * 4
dy = np.random.default_rng(4).standard_normal(x.shape).astype(np.float32)
np.save(sys.argv[1], np.stack([harness.run("cpp", op, {"dy": dy, "x": x}, threads=int(sys.argv[2]))["dx"]
                               for op in ("SiLUGrad", "GeluGrad", "GeluTanhGrad")]))
"""


@needs_cpp
def test_cpp_loops_bitwise_at_every_thread_count(tmp_path):
    """The baseline loop (NORMGRAD_KERNELS=generic) and the AVX2 one at 1, 2 and 4 threads:
    the same bits, within a few ulps of the reference."""
    results = cpp_results_by_loop_and_threads(tmp_path, _RUN_CPP)
    first = results["generic", 1]
    for where, value in results.items():
        assert value.tobytes() == first.tobytes(), where
    x = np.random.default_rng(3).standard_normal(3 * 70001).astype(np.float32).reshape(3, 70001) * 4
    dy = np.random.default_rng(4).standard_normal(x.shape).astype(np.float32)
    for name, dx in zip(ACTIVATIONS, first):
        _assert_close(name, x, dy, dx)


def _node_model(op_type, feeds):
    """One node, without onnx's type checks (which would refuse the bad types first)."""
    node = oh.make_node(op_type, ["dy", "x"], ["dx"], domain=DOMAIN)
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info(name, tensor_type(value.dtype), None)
                                        for name, value in feeds.items()],
                          [oh.make_tensor_value_info("dx", tensor_type(feeds["x"].dtype), None)])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", ONNX_OPSET), oh.make_opsetid(DOMAIN, OPSET_VERSION)],
                         ir_version=IR_VERSION)


BAD = {
    "dy shape": ({"dy": np.zeros((2, 3), np.float32), "x": np.zeros((3, 2), np.float32)},
                 "input 'dy' must have the shape of 'x' [3, 2]; got [2, 3]"),
    "x float16": ({"dy": np.zeros(3, np.float16), "x": np.zeros(3, np.float16)}, "input 'x' must be float32; got float16"),
}


@needs_cpp
@pytest.mark.parametrize("case", BAD)
def test_cpp_bad_input_names_the_input(case):
    feeds, rule = BAD[case]
    options = ort.SessionOptions()
    normgrad.session_options("cpp", options)
    for op_type in OP.values():
        session = ort.InferenceSession(_node_model(op_type, feeds).SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        with pytest.raises(Exception) as error:
            session.run(None, feeds)
        message = str(error.value)
        # onnxruntime may refuse a float16 x itself (no kernel of that type) before ours runs
        assert f"{op_type}: {rule}" in message or (case == "x float16" and "float16" in message), message


@pytest.mark.parametrize("case", BAD)
def test_validate_names_the_input(case):
    feeds, rule = BAD[case]
    for operator in activation_grad.OPERATORS:
        with pytest.raises(NormgradInputError, match=f"{operator.OP_TYPE}: {rule}".replace("[", r"\[").replace("]", r"\]")):
            operator.reference(**feeds)


def test_unknown_activation_is_named():
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        activation_grad.standard_form("relu", None, None, "dy", "x")
    with pytest.raises(KeyError):
        activation_grad.ActivationGradOperator("relu")


def test_schema_refuses_float16():
    model = harness.node_model("SiLUGrad", {"dy": np.zeros(3, np.float16), "x": np.zeros(3, np.float16)})
    with pytest.raises(Exception, match="float16|Type"):
        onnx.checker.check_model(model, full_check=True)


# ----------------------------------------------------------------------------- step graphs


def _const(name, value):
    return oh.make_node("Constant", [], [name], value=onh.from_array(np.asarray(value, np.float32)))


def _forward(dtype=onnx.TensorProto.FLOAT, silu_order=("h", "s")):
    """x @ w1 -> SiLU (Mul(h, Sigmoid(h))) -> @ w2 -> erf GELU (dynamo's chain) -> @ w3."""
    rng = np.random.default_rng(0)
    np_dtype = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    weights = {name: onh.from_array((rng.standard_normal(shape) * 0.7).astype(np_dtype), name)
               for name, shape in (("w1", (6, 8)), ("w2", (8, 8)), ("w3", (8, 4)))}
    cast = [] if dtype == onnx.TensorProto.FLOAT else [oh.make_node("Cast", [n], [n + "_t"], to=dtype)
                                                        for n in ("sqrt2", "one", "half")]
    suffix = "" if dtype == onnx.TensorProto.FLOAT else "_t"
    nodes = [_const("sqrt2", math.sqrt(2)), _const("one", 1.0), _const("half", 0.5), *cast,
             oh.make_node("MatMul", ["x", "w1"], ["h"]), oh.make_node("Sigmoid", ["h"], ["s"]),
             oh.make_node("Mul", list(silu_order), ["a"]), oh.make_node("MatMul", ["a", "w2"], ["g"]),
             oh.make_node("Div", ["g", "sqrt2" + suffix], ["e0"]), oh.make_node("Erf", ["e0"], ["e1"]),
             oh.make_node("Add", ["e1", "one" + suffix], ["e2"]), oh.make_node("Mul", ["e2", "half" + suffix], ["e3"]),
             oh.make_node("Mul", ["g", "e3"], ["b"]), oh.make_node("MatMul", ["b", "w3"], ["y"])]
    graph = oh.make_graph(nodes, "mlp", [oh.make_tensor_value_info("x", dtype, [5, 6])],
                          [oh.make_tensor_value_info("y", dtype, [5, 4])], list(weights.values()))
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=IR_VERSION)


@pytest.mark.parametrize("silu_order", [("h", "s"), ("s", "h")])
def test_step_graph_uses_the_operators_and_matches_the_inline_form(silu_order):
    """The default step graph has one SiLUGrad, the erf chain as one GeluWithSlope (only with
    onnxscript's rewriter; its gradient a Mul by the slope, no GeluGrad) and no
    Sigmoid-gradient Sub; at every optimization level, with
    the C++ and Python kernels and with the bodies onnxruntime inlines, its updated weights
    match the ``--inline`` form's (the standard ops) to float32 rounding."""
    forward = _forward(silu_order=silu_order)
    step, initial = build_step_graph(build_training_graph(forward, loss="mse"), "adamw")
    inline, _ = build_step_graph(build_training_graph(forward, loss="mse", inline=True), "adamw")
    ops = [n.op_type for n in step.graph.node if n.domain == DOMAIN]
    assert ops.count("SiLUGrad") == 1
    assert ops.count("GeluWithSlope") == (1 if _declarative.AVAILABLE else 0) and "GeluGrad" not in ops
    assert not any(n.domain == DOMAIN for n in inline.graph.node)
    rng = np.random.default_rng(7)
    feeds = {**hyperparameter_feeds(step), **initial, "x": rng.standard_normal((5, 6)).astype(np.float32),
             "labels": rng.standard_normal((5, 4)).astype(np.float32), "lr": np.array(0.1, np.float32),
             "step": np.array(1, np.float32)}
    assert_step_matches_inline(step, inline, feeds, ("w1.next", "w2.next", "w3.next"))


def test_without_onnxscript_silu_still_fused(monkeypatch):
    """The wheel stage has no onnxscript: the hand-written SiLU matcher still fuses, the erf
    GELU goes node by node (Erf's rule), and the gradients still match the inline form."""
    monkeypatch.setattr(_declarative, "AVAILABLE", False)
    forward = _forward()
    with pytest.warns(UserWarning, match="onnxscript is not installed"):
        training = build_training_graph(forward, loss="mse")
    ops = [n.op_type for n in training.model.graph.node]
    assert ops.count("SiLUGrad") == 1 and "GeluGrad" not in ops


def test_float16_keeps_the_standard_form():
    forward = _forward(onnx.TensorProto.FLOAT16)
    training = build_training_graph(forward, loss="mse")
    assert not any(n.domain == DOMAIN and n.op_type in OP.values() for n in training.model.graph.node)


@needs_cpp
def test_bench_activation_grad_runs(capsys):
    """The benchmark's smoke test: a row per activation and one for the erf GELU's forward and
    backward, both sides timed (each side's outputs checked against the float64 reference
    inside)."""
    from normgrad.tools import bench_activation_grad

    result = bench_activation_grad.main(["--rounds", "1", "--shape", "16", "33"])
    printed = capsys.readouterr().out
    for activation, op_type in OP.items():
        assert f"| {activation} ({op_type}) |" in printed
        assert result[activation]["standard"] > 0 and result[activation]["operator"] > 0
    assert "| erf GELU forward and backward (Gelu, GeluGrad -> GeluWithSlope, Mul) |" in printed
    assert all(value > 0 for value in result["gelu_erf forward and backward"].values())


_TANH_CONSTANTS = {"three": 3.0, "cubic": 0.044715, "root": math.sqrt(2 / math.pi), "one": 1.0, "half": 0.5}


@pytest.mark.parametrize("form", ["half_first", "half_last"])
def test_tanh_gelu_chain_is_one_operator(form):
    """The written-out tanh GELU (NewGELUActivation's 0.5 * x first, or x (1 + tanh) first)
    differentiates as one GeluTanhGrad with onnxscript's rewriter (node by node without it);
    the gradient is the float64 derivative either way (to the body's float32 rounding)."""
    nodes = [_const(name, value) for name, value in _TANH_CONSTANTS.items()]
    nodes += [oh.make_node("Pow", ["x", "three"], ["p"]), oh.make_node("Mul", ["cubic", "p"], ["c"]),
              oh.make_node("Add", ["c", "x"], ["a"]), oh.make_node("Mul", ["root", "a"], ["u"]),
              oh.make_node("Tanh", ["u"], ["t"]), oh.make_node("Add", ["one", "t"], ["b"])]
    if form == "half_first":
        nodes += [oh.make_node("Mul", ["half", "x"], ["h"]), oh.make_node("Mul", ["b", "h"], ["y"])]
    else:
        nodes += [oh.make_node("Mul", ["x", "b"], ["h"]), oh.make_node("Mul", ["h", "half"], ["y"])]
    graph = oh.make_graph(nodes, "gelu", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 6])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 6])])
    forward = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=IR_VERSION)
    training = build_training_graph(forward)
    backward = [n.op_type for n in training.model.graph.node[len(nodes):]]
    if _declarative.AVAILABLE:
        assert "GeluTanhGrad" in backward and "Tanh" not in backward and "Pow" not in backward, backward
    x = np.linspace(-6, 6, 24, dtype=np.float32).reshape(4, 6)
    dy = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    session = ort.InferenceSession(training.model.SerializeToString(), providers=["CPUExecutionProvider"])
    (grad,) = session.run(["x_grad"], training.feeds({"x": x, "y_grad": dy}))
    # a plain session runs the body, the float32 textbook form: 1 - t^2 cancels in the tails
    np.testing.assert_allclose(grad, dy * activation_grad.derivative("gelu_tanh", x), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_new_gelu_as_exported_matches_torch(tmp_path):
    """transformers' NewGELUActivation (GPT-2's gelu_new) exported by TorchScript: one
    GeluTanhGrad with onnxscript's rewriter, x's gradient torch autograd's."""
    torch = pytest.importorskip("torch")
    activations = pytest.importorskip("transformers.activations")
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), activations.NewGELUActivation(), torch.nn.Linear(8, 3))
    x = torch.linspace(-3, 3, 30).reshape(5, 6)
    path = tmp_path / "gelu.onnx"
    torch.onnx.export(module, (x,), str(path), input_names=["x"], output_names=["y"], dynamo=False, opset_version=18)
    training = build_training_graph(onnx.load(path))
    ops = [n.op_type for n in training.model.graph.node]
    if _declarative.AVAILABLE:
        assert "GeluTanhGrad" in ops, ops
    dy = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    session = ort.InferenceSession(training.model.SerializeToString(), providers=["CPUExecutionProvider"])
    (grad,) = session.run(["x_grad"], training.feeds({"x": x.numpy(), "y_grad": dy.numpy()}))
    xt = x.clone().requires_grad_(True)
    module(xt).backward(dy)
    np.testing.assert_allclose(grad, xt.grad.numpy(), rtol=1e-4, atol=1e-5)
