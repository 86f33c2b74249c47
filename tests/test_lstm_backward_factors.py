"""LSTMBackwardFactors: every backend (C++ kernel, Python kernel, function body on onnxruntime
and on onnx's ReferenceEvaluator) gives the LSTM backward's factors of the float64 formulas,
last step first; the C++ kernel gives the function body's bits on both its loops at any thread
count; bad inputs named; an LSTM's training graph holds one per direction by default, and its gradients are
bitwise those of the ``--inline`` form (the standard ops) at every optimization level."""

from __future__ import annotations

import collections
import os

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

import normgrad
from _helpers import bad_input_tests, cpp_available, cpp_results_by_loop_and_threads
from normgrad.graphs import build_training_graph
from normgrad.ops import harness, lstm_backward_factors, python_kernels

BACKENDS = ["reference", "evaluator", "functions", "python"] + (["cpp"] if cpp_available() else [])
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")
LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL")
OP = lstm_backward_factors.OP_TYPE

SHAPES = {  # [T, H, ...]
    "steps": (6, 5, 3),
    "one step": (1, 4, 2),
    "no steps": (0, 4, 2),
    "rank 2": (7, 9),
    "rank 4": (3, 2, 4, 5),
    "parallel steps": (64, 64, 32),
}


def _inputs(shape, dtype=np.float32, seed=0):
    """Gates in their activations' ranges, cells and tanh(cells) as a forward gives them."""
    rng = np.random.default_rng(seed)
    sigmoid = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    feeds = {name: sigmoid(rng.standard_normal(shape)) for name in ("i", "o", "f")}
    feeds["g"] = np.tanh(rng.standard_normal(shape))
    feeds["cells"] = 2 * rng.standard_normal(shape)
    feeds["act_c"] = np.tanh(feeds["cells"])
    feeds["c0"] = rng.standard_normal(shape[1:])
    return {name: value.astype(dtype) for name, value in feeds.items()}


def _truth(feeds):
    """The factors step by step in float64, written out apart from the reference's arrays."""
    v = {name: value.astype(np.float64) for name, value in feeds.items()}
    steps = v["i"].shape[0]
    factors, a_c, keep = [], [], []
    for t in reversed(range(steps)):
        c_prev = v["c0"] if t == 0 else v["cells"][t - 1]
        i, o, f, g, act_c = (v[name][t] for name in ("i", "o", "f", "g", "act_c"))
        factors.append(np.concatenate([g * i * (1 - i), act_c * o * (1 - o), c_prev * f * (1 - f), i * (1 - g ** 2)]))
        a_c.append(o * (1 - act_c ** 2))
        keep.append(f)
    step = v["i"].shape[1:]
    empty = lambda rows: np.zeros((0, rows * step[0], *step[1:]))  # noqa: E731
    return (np.stack(factors) if steps else empty(4), np.stack(a_c) if steps else empty(1),
            np.stack(keep) if steps else empty(1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SHAPES)
def test_every_backend_gives_the_float64_factors_last_step_first(backend, case):
    feeds = _inputs(SHAPES[case])
    out = harness.run(backend, OP, feeds)
    for name, truth in zip(lstm_backward_factors.OUTPUTS, _truth(feeds)):
        assert out[name].dtype == np.float32 and out[name].shape == truth.shape, name
        # a few float32 roundings of values below 4 in magnitude
        np.testing.assert_allclose(out[name], truth, rtol=0, atol=4 * 2 ** -22, err_msg=f"{backend}: {name}")


@pytest.mark.parametrize("backend", ["reference", "functions", "evaluator"] + (["cpp"] if cpp_available() else []))
def test_float64(backend):
    feeds = _inputs(SHAPES["steps"], np.float64)
    out = harness.run(backend, OP, feeds)
    for name, truth in zip(lstm_backward_factors.OUTPUTS, _truth(feeds)):
        assert out[name].dtype == np.float64
        np.testing.assert_allclose(out[name], truth, rtol=0, atol=1e-15, err_msg=f"{backend}: {name}")


_KERNEL_SHAPE = (24, 67, 31)  # 2077 elements a step: two of the kernel's 1024-element chunks and a part

_RUN_CPP = f"""
import sys, numpy as np
from normgrad.ops import harness
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from test_lstm_backward_factors import OP, _KERNEL_SHAPE, _inputs, _output_bytes
runs = [harness.run("cpp", OP, _inputs(_KERNEL_SHAPE, dtype), threads=int(sys.argv[2])) for dtype in (np.float32, np.float64)]
np.save(sys.argv[1], _output_bytes(runs))
"""


def _output_bytes(runs):
    """Every output of every run, as one array of bytes."""
    return np.concatenate([run[name].ravel().view(np.uint8) for run in runs for name in lstm_backward_factors.OUTPUTS])


@needs_cpp
def test_cpp_kernel_gives_the_function_bodys_bits_on_every_loop_and_thread_count(tmp_path):
    """The portable loop (NORMGRAD_KERNELS=generic) and the AVX2 one, at 1, 2 and 4 threads, in
    float32 and float64: the function body's bits."""
    body = _output_bytes([harness.run("functions", OP, _inputs(_KERNEL_SHAPE, dtype)) for dtype in (np.float32, np.float64)])
    for where, value in cpp_results_by_loop_and_threads(tmp_path, _RUN_CPP).items():
        assert value.tobytes() == body.tobytes(), where


def _bad(**changes):
    feeds = _inputs(SHAPES["steps"])
    feeds.update(changes)
    return feeds


BAD = {
    "i rank 1": (_bad(i=np.zeros(6, np.float32)), "input 'i' must have rank >= 2 ([T, H, ...]); got shape [6]"),
    "int32": ({name: value.astype(np.int32) for name, value in _inputs(SHAPES["steps"]).items()},
              "input 'i' must be float32 or float64; got int32"),
    "cells shape": (_bad(cells=np.zeros((6, 5, 4), np.float32)), "input 'cells' must have the shape"),
    "c0 shape": (_bad(c0=np.zeros((6, 5, 3), np.float32)), "input 'c0' must have the shape"),
    "g dtype": (_bad(g=np.zeros((6, 5, 3), np.float64)), "input 'g' must have the dtype of 'i'"),
}


test_cpp_bad_input_names_the_input, test_validate_names_the_input = bad_input_tests(lstm_backward_factors, BAD)


def test_python_kernel_bad_input_logs_and_returns_nan():
    """The bridge cannot raise: the message names the input, the outputs are NaN."""
    out = harness.run("python", OP, BAD["c0 shape"][0], static_shapes=False)
    assert all(np.isnan(out[name]).all() for name in lstm_backward_factors.OUTPUTS)
    assert "input 'c0' must have the shape" in python_kernels.errors()[-1]


def test_shape_inference():
    value = lambda name, dims: oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, dims)  # noqa: E731
    graph = oh.make_graph(
        [oh.make_node(OP, list(lstm_backward_factors.INPUTS), list(lstm_backward_factors.OUTPUTS),
                      domain=normgrad.ops.DOMAIN)], "t",
        [value(name, ["t", 5, "b"]) for name in lstm_backward_factors.INPUTS[:6]] + [value("c0", [5, "b"])],
        [value(name, None) for name in lstm_backward_factors.OUTPUTS])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18),
                                                oh.make_opsetid(normgrad.ops.DOMAIN, normgrad.ops.OPSET_VERSION)])
    outputs = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph.output
    assert [[d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in outputs] == \
        [["t", 20, "b"], ["t", 5, "b"], ["t", 5, "b"]]


# -- in an LSTM's training graph --------------------------------------------------------------

def _lstm(bidirectional: bool, peepholes: bool = False):
    """A 1-layer LSTM as onnx writes it, [T, B, I] -> Y, with its weights as initializers."""
    from normgrad.graphs.examples import model

    steps, batch, features, hidden = 7, 3, 4, 5
    directions = 2 if bidirectional else 1
    rng = np.random.default_rng(3)
    weights = {"W": rng.standard_normal((directions, 4 * hidden, features)) * 0.5,
               "R": rng.standard_normal((directions, 4 * hidden, hidden)) * 0.5,
               "B": rng.standard_normal((directions, 8 * hidden)) * 0.1}
    inputs = ["x", "W", "R", "B"]
    if peepholes:
        weights["P"] = rng.standard_normal((directions, 3 * hidden)) * 0.1
        inputs += ["", "", "", "P"]
    node = oh.make_node("LSTM", inputs, ["y"], hidden_size=hidden,
                        direction="bidirectional" if bidirectional else "forward")
    weights = {k: v.astype(np.float32) for k, v in weights.items()}
    return model([node], {"x": [steps, batch, features]}, ["y"], weights), (steps, directions, batch, hidden)


def _session(graph, threads, level):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    if cpp_available():
        normgrad.session_options("cpp", options)
    return ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("bidirectional", [False, True], ids=["forward", "bidirectional"])
def test_lstm_training_graph_holds_one_per_direction_and_the_standard_forms_bits(bidirectional):
    forward, (steps, directions, batch, hidden) = _lstm(bidirectional)
    training, initial = build_training_graph(forward)
    inline, _ = build_training_graph(forward, inline=True)
    counts = collections.Counter(n.op_type for n in training.graph.node)
    assert counts[OP] == directions
    assert not any(n.op_type == OP for n in inline.graph.node) and not inline.functions
    rng = np.random.default_rng(4)
    feeds = {**initial, "x": rng.standard_normal((steps, batch, 4)).astype(np.float32),
             "y_grad": rng.standard_normal((steps, directions, batch, hidden)).astype(np.float32)}
    outputs = [o.name for o in training.graph.output]
    for level in LEVELS:
        for threads in (1, 2):
            ours = _session(training, threads, level).run(outputs, feeds)
            standard = _session(inline, threads, level).run(outputs, feeds)
            for name, a, b in zip(outputs, ours, standard):
                np.testing.assert_array_equal(a, b, err_msg=f"{name}, {level}, {threads} threads")


def test_peepholes_keep_the_standard_form():
    """Peepholes add terms to the factors: the rule writes its standard ops instead."""
    forward, _ = _lstm(False, peepholes=True)
    training, _ = build_training_graph(forward)
    assert not any(n.op_type == OP for n in training.graph.node)
