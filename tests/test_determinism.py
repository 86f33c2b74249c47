"""Issue 13 item 9: exported training graphs give bitwise the same outputs for 1, 2, 3 and 7
intra-op threads on the CPU provider with the C++ kernels.

onnxruntime's CPU ReduceSum/ReduceMean kernels for a reduced-kept-reduced layout (axes
[0, 2, 3] of NCHW) or a kept-reduced-kept one (a middle axis) split the sum differently
once the thread count exceeds the kept extent (e.g. 4 channels, 5 threads), so the
exporter writes such sums as stages that reduce a leading or a trailing run
(``GradientContext.reduce``), and the function bodies do the same.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

import normgrad
from normgrad.graphs import build_training_graph, examples
from normgrad.tools.check import random_feeds

from _helpers import cpp_available
from _corpus_cases import CASES, MANIFEST, load_case

THREADS = (1, 2, 3, 7)
TRAINING_CASES = [name for name in CASES if MANIFEST[name]["kind"] == "training"]


def _options(threads: int) -> ort.SessionOptions:
    options = normgrad.session_options("cpp") if cpp_available() else ort.SessionOptions()
    options.intra_op_num_threads = threads
    return options


def _outputs_for_each_thread_count(model: onnx.ModelProto, feeds: dict) -> dict:
    """{threads: {output: array}} from one session per thread count."""
    results = {}
    for threads in THREADS:
        session = ort.InferenceSession(model.SerializeToString(), _options(threads), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        results[threads] = dict(zip(names, session.run(names, feeds)))
    return results


def _assert_bitwise_same(results: dict) -> None:
    first = results[THREADS[0]]
    differing = {}
    for threads in THREADS[1:]:
        for name, value in results[threads].items():
            a, b = np.ascontiguousarray(first[name]), np.ascontiguousarray(value)
            if a.shape != b.shape or a.tobytes() != b.tobytes():
                differing.setdefault(name, []).append(threads)
    assert not differing, f"outputs that differ from 1 thread (by thread count): {differing}"


@pytest.mark.parametrize("case", TRAINING_CASES)
def test_corpus_training_graph_is_bitwise_the_same_for_any_thread_count(case):
    model, inputs, _ = load_case(case)
    _assert_bitwise_same(_outputs_for_each_thread_count(model, inputs))


def test_resnet_block_of_realistic_size_is_bitwise_the_same_for_any_thread_count():
    training = build_training_graph(examples.resnet_block(channels=64, batch=8, size=28))
    _assert_bitwise_same(_outputs_for_each_thread_count(training.model, random_feeds(training)))


def test_staged_reductions_are_the_gradient_and_thread_count_independent():
    """Three channels (fewer than 7 threads): a conv bias (sum over [0, 2, 3]), a bias
    [1, C, 1, 1] added (sum_to over [0, 2, 3], kept dims) and a Softmax over the channel
    axis (a sum over a middle axis). Against float64 NumPy gradients."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((3, 3, 3, 3)) * 0.3).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    c = rng.standard_normal((1, 3, 1, 1)).astype(np.float32)
    forward = examples.model(
        [oh.make_node("Conv", ["x", "w", "b"], ["conv"], pads=[1, 1, 1, 1]),
         oh.make_node("Add", ["conv", "c"], ["shifted"]),
         oh.make_node("Softmax", ["shifted"], ["y"], axis=1)],
        {"x": (2, 3, 24, 24)}, ["y"], {"w": w, "b": b, "c": c}, opset=17,
    )
    training = build_training_graph(forward)
    feeds = random_feeds(training)
    results = _outputs_for_each_thread_count(training.model, feeds)
    _assert_bitwise_same(results)

    x, dy = feeds["x"].astype(np.float64), feeds["y_grad"].astype(np.float64)
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))  # [N, Ci, H, W, 3, 3]
    z = np.einsum("nchwij,ocij->nohw", windows, w.astype(np.float64)) + b[None, :, None, None] + c
    y = np.exp(z - z.max(axis=1, keepdims=True))
    y /= y.sum(axis=1, keepdims=True)
    dz = y * (dy - (dy * y).sum(axis=1, keepdims=True))
    got = results[1]
    for name, expected in (("c_grad", dz.sum(axis=(0, 2, 3), keepdims=True)), ("b_grad", dz.sum(axis=(0, 2, 3))),
                           ("w_grad", np.einsum("nohw,nchwij->ocij", dz, windows))):
        np.testing.assert_allclose(got[name], expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


def test_softmax_over_a_middle_axis_is_thread_count_independent():
    """The sum over axis 1 of [3, 300, 5] (kept-reduced-kept) goes to the end first."""
    training = build_training_graph(examples.model([oh.make_node("Softmax", ["x"], ["y"], axis=1)], {"x": (3, 300, 5)}, ["y"]))
    feeds = random_feeds(training)
    results = _outputs_for_each_thread_count(training.model, feeds)
    _assert_bitwise_same(results)
    y = results[1]["y"].astype(np.float64)
    dy = feeds["y_grad"].astype(np.float64)
    np.testing.assert_allclose(results[1]["x_grad"], y * (dy - (dy * y).sum(axis=1, keepdims=True)), atol=1e-6)
