"""MaxPoolGrad: every backend (the C++ kernel, the function body on onnxruntime beside the
Python kernels and alone, onnx's ReferenceEvaluator) against the float64 reference, which float64
finite differences of a direct max pool check and torch's max_pool2d backward checks where the
maxima tie; the C++ kernel's bits at every thread count; bad inputs named; the MaxPool rule
writes it for 2-D float pools with explicit pads, and the forward MaxPool then has no Indices."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from _helpers import assert_cpp_bits_everywhere, bad_input_tests, cpp_available, zeros
from normgrad.graphs import build_training_graph
from normgrad.graphs.examples import model
from normgrad.ops import DOMAIN, harness, max_pool_grad

OP = max_pool_grad.OP_TYPE
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")

CASES = {  # name: (x shape [N, C, H, W], attributes)
    "3x3 stride 2 pad 1 (ResNet, ShuffleNet)": ((2, 5, 9, 11), {"kernel_shape": [3, 3], "strides": [2, 2],
                                                                "pads": [1, 1, 1, 1]}),
    "2x2 stride 2": ((3, 13, 8, 6), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    "3x3 stride 1 overlapping": ((2, 3, 7, 10), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
    "1x1 maps": ((2, 17, 1, 1), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "batch 1, stride 2, odd sizes": ((1, 9, 11, 21), {"kernel_shape": [3, 3], "strides": [2, 2]}),
    "ceil_mode, odd sizes": ((2, 3, 10, 13), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    "ceil_mode, uneven pads": ((1, 4, 9, 12), {"kernel_shape": [2, 3], "strides": [3, 2], "pads": [1, 0, 0, 1],
                                              "ceil_mode": 1}),
    "dilation 2": ((2, 3, 12, 15), {"kernel_shape": [3, 2], "strides": [1, 2], "pads": [2, 1, 2, 0],
                                    "dilations": [2, 2]}),
}


def _attributes(case):
    return {**max_pool_grad.ATTRIBUTES, **CASES[case][1]}


def _out_shape(shape, attributes):
    sizes = [max_pool_grad.output_sizes(shape[2 + i], attributes["kernel_shape"][i], attributes["strides"][i],
                                        attributes["pads"][i], attributes["pads"][i + 2], attributes["dilations"][i],
                                        attributes["ceil_mode"])[-1] for i in range(2)]
    return list(shape[:2]) + sizes


def _inputs(case, dtype=np.float32, seed=0):
    """x of distinct values at least 1e-2 apart (no ties: the gradient is the derivative), and dy."""
    shape, attributes = CASES[case][0], _attributes(case)
    rng = np.random.default_rng(seed)
    x = (rng.permutation(int(np.prod(shape))).reshape(shape) - np.prod(shape) / 2) * 1e-2
    dy = rng.standard_normal(_out_shape(shape, attributes))
    return {"x": x.astype(dtype), "dy": dy.astype(dtype)}, attributes


def _direct_max_pool(x, attributes):
    """MaxPool's output in float64, output pixel by output pixel, the padding left out."""
    ho, wo = _out_shape(x.shape, attributes)[2:]
    y = np.empty(x.shape[:2] + (ho, wo))
    for i in range(ho):
        for j in range(wo):
            taps = [s * attributes["strides"][axis] - attributes["pads"][axis]
                    + attributes["dilations"][axis] * np.arange(attributes["kernel_shape"][axis])
                    for axis, s in ((0, i), (1, j))]
            rows, columns = (t[(t >= 0) & (t < x.shape[2 + axis])] for axis, t in enumerate(taps))
            y[:, :, i, j] = x[:, :, rows][:, :, :, columns].max((2, 3))
    return y


@pytest.mark.parametrize("case", CASES)
def test_reference_is_the_finite_difference_gradient(case):
    """dx is the float64 central difference of sum(max_pool(x) * dy) (exact up to rounding:
    with the maxima 1e-2 apart, a step of 1e-4 moves no maximum)."""
    feeds, attributes = _inputs(case, np.float64)
    dx = max_pool_grad.reference(**feeds, **attributes).dx
    rng = np.random.default_rng(1)
    for flat in rng.choice(dx.size, size=min(dx.size, 40), replace=False):
        index = np.unravel_index(flat, dx.shape)
        values = {}
        for sign in (1, -1):
            moved = feeds["x"].copy()
            moved[index] += sign * 1e-4
            values[sign] = (_direct_max_pool(moved, attributes) * feeds["dy"]).sum()
        assert abs((values[1] - values[-1]) / 2e-4 - dx[index]) < 1e-9, index
    assert np.count_nonzero(dx) > 0


@pytest.mark.parametrize("case", ["3x3 stride 2 pad 1 (ResNet, ShuffleNet)", "3x3 stride 1 overlapping",
                                  "ceil_mode, odd sizes", "dilation 2"])
def test_reference_takes_the_first_of_tied_maxima_as_torch_does(case):
    """After a ReLU most windows tie at 0: torch's max_pool2d backward sends dy to the first
    maximum in row-major order, and so does the reference."""
    torch = pytest.importorskip("torch")
    feeds, attributes = _inputs(case, np.float64)
    x = np.maximum(np.round(feeds["x"] * 3), 0)  # ties: many zeros and repeated values
    a = attributes
    tx = torch.tensor(x, requires_grad=True)
    y = torch.nn.functional.max_pool2d(tx, a["kernel_shape"], a["strides"], padding=0, dilation=a["dilations"],
                                       ceil_mode=bool(a["ceil_mode"])) if not any(a["pads"]) else None
    if y is None:  # torch pads symmetrically: pad x by hand with -inf where the pads differ
        pt, pl, pb, pr = a["pads"]
        padded = torch.nn.functional.pad(tx, (pl, pr, pt, pb), value=-np.inf)
        y = torch.nn.functional.max_pool2d(padded, a["kernel_shape"], a["strides"], dilation=a["dilations"],
                                           ceil_mode=bool(a["ceil_mode"]))
    assert list(y.shape) == list(feeds["dy"].shape)
    y.backward(torch.tensor(feeds["dy"]))
    np.testing.assert_array_equal(max_pool_grad.reference(x, feeds["dy"], **attributes).dx, tx.grad.numpy())
    if cpp_available():  # the kernel's vector lanes choose alike (the values are exact in float32)
        wide_x = np.tile(x, 3).astype(np.float32)  # rows long enough for whole blocks of 8 windows
        wide = {"x": wide_x, "dy": np.random.default_rng(5).standard_normal(_out_shape(wide_x.shape, attributes))
                .astype(np.float32)}
        dx = harness.run("cpp", OP, wide, attributes=attributes)["dx"]
        # (a wrong choice moves a whole dy; the sums of several round in float32 there)
        np.testing.assert_allclose(dx, max_pool_grad.reference(**wide, **attributes).dx, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", CASES)
def test_every_backend_is_the_float64_gradient(backend, case):
    """float32 on every backend: each element a sum of at most ceil(k / s) ** 2 values of dy,
    within the float32 rounding of such a sum."""
    feeds, attributes = _inputs(case)
    if backend == "evaluator" and any(attributes["pads"]) and set(attributes["strides"] + attributes["dilations"]) == {1}:
        pytest.skip("onnx's ReferenceEvaluator gives MaxPool's Indices in padded coordinates at strides and "
                    "dilations 1 (onnx 1.23: its common pool path), which the function body's scatter reads")
    dx = np.asarray(harness.run(backend, OP, feeds, attributes=attributes)["dx"])
    x64 = feeds["x"].astype(np.float64)  # exact: the same maxima
    truth = max_pool_grad.reference(x64, feeds["dy"].astype(np.float64), **attributes).dx
    scale = max_pool_grad.reference(x64, np.abs(feeds["dy"]).astype(np.float64), **attributes).dx
    assert dx.dtype == np.float32 and dx.shape == feeds["x"].shape
    assert (np.abs(dx - truth) <= 2 ** -22 * 9 * scale + 1e-30).all()


@pytest.mark.parametrize("backend", ["evaluator"] + (["cpp"] if cpp_available() else []))
@pytest.mark.parametrize("case", ["batch 1, stride 2, odd sizes", "ceil_mode, uneven pads", "dilation 2"])
def test_float64(backend, case):
    feeds, attributes = _inputs(case, np.float64)
    dx = harness.run(backend, OP, feeds, attributes=attributes)["dx"]
    assert dx.dtype == np.float64
    np.testing.assert_allclose(dx, max_pool_grad.reference(**feeds, **attributes).dx, rtol=1e-14, atol=1e-14)


_THREADS_SCRIPT = """
import sys, numpy as np
from normgrad.ops import harness
rng = np.random.default_rng(2)
results = []
for shape, k, stride, pad in [((3, 40, 19, 45), 3, 2, 1), ((2, 24, 21, 33), 3, 1, 1), ((4, 30, 16, 16), 2, 2, 0)]:
    size = [(s + 2 * pad - k) // stride + 1 for s in shape[2:]]
    feeds = {"x": np.round(rng.standard_normal(shape), 1).astype(np.float32),
             "dy": rng.standard_normal((shape[0], shape[1], *size)).astype(np.float32)}
    out = harness.run("cpp", "MaxPoolGrad", feeds, threads=int(sys.argv[2]),
                      attributes={"kernel_shape": [k, k], "strides": [stride] * 2, "pads": [pad] * 4})
    results.append(out["dx"].ravel())
np.save(sys.argv[1], np.concatenate(results))
"""


@needs_cpp
def test_cpp_kernel_gives_the_same_bits_at_every_thread_count(tmp_path):
    """Each plane whole on one thread, its windows in order: the same bits at 1, 2 and 4 threads."""
    assert_cpp_bits_everywhere(tmp_path, _THREADS_SCRIPT)


BAD = {
    "x rank 3": ({"x": zeros(1, 1, 4), "dy": zeros(1, 1, 4, 4)},
                 "input 'x' must have rank 4 ([N, C, H, W]); got shape [1, 1, 4]"),
    "int32": ({"x": zeros(1, 1, 4, 4, dtype=np.int32), "dy": zeros(1, 1, 4, 4)},
              "input 'x' must be float32 or float64; got int32"),
    "types differ": ({"x": zeros(1, 1, 4, 4), "dy": zeros(1, 1, 4, 4, dtype=np.float64)},
                     "input 'dy' must have x's type float32; got float64"),
    "dy not the output size": ({"x": zeros(2, 3, 4, 4), "dy": zeros(2, 3, 4, 5)},
                               "input 'dy' must have the MaxPool's output shape [2, 3, 4, 4]; got [2, 3, 4, 5]"),
}

test_cpp_bad_input_names_the_input, test_validate_names_the_input = bad_input_tests(max_pool_grad, BAD)


@needs_cpp
def test_cpp_bad_attribute_names_it():
    feeds, attributes = _inputs("2x2 stride 2")
    with pytest.raises(Exception, match=r"MaxPoolGrad: attribute 'strides' must be 2 integers >= 1; got \[2, 0\]"):
        harness.run("cpp", OP, feeds, attributes={**attributes, "strides": [2, 0]})
    with pytest.raises(Exception, match=r"the padded input \[2, 2\] must hold the dilated kernel \[3, 3\]"):
        harness.run("cpp", OP, {"x": zeros(1, 1, 2, 2), "dy": zeros(1, 1, 1, 1)},
                    attributes={"kernel_shape": [3, 3]})
    with pytest.raises(Exception, match="attribute 'ceil_mode' must be 0 or 1; got 2"):
        max_pool_grad.reference(**feeds, **{**attributes, "ceil_mode": 2})


# -- the MaxPool rule -----------------------------------------------------------------------------


def _pool_forward(shape=(2, 6, 9, 9), elem_type=onnx.TensorProto.FLOAT, **attributes):
    attributes = attributes or {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
    weights = {"s": np.asarray([1.5], dtype)}
    nodes = [oh.make_node("Mul", ["x", "s"], ["h"]), oh.make_node("MaxPool", ["h"], ["y"], **attributes)]
    return model(nodes, {"x": list(shape)}, ["y"], weights, elem_type=elem_type)


def _ops(graph):
    return collections.Counter(n.op_type for n in graph.node)


@pytest.mark.parametrize("elem_type", [onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE])
def test_max_pool_gradient_is_one_operator_and_the_forward_has_no_indices(elem_type):
    graph = build_training_graph(_pool_forward(elem_type=elem_type)).model.graph
    nodes = [n for n in graph.node if n.op_type == OP]
    assert len(nodes) == 1 and nodes[0].domain == DOMAIN
    assert {a.name: oh.get_attribute_value(a) for a in nodes[0].attribute} == \
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "dilations": [1, 1], "ceil_mode": 0}
    pools = [n for n in graph.node if n.op_type == "MaxPool"]
    assert len(pools) == 1 and [o for o in pools[0].output if o] == ["y"]
    assert "ScatterElements" not in _ops(graph)


@pytest.mark.parametrize("case", ["1-D", "auto_pad SAME_UPPER"])
def test_other_max_pools_keep_the_graph_form(case):
    forward = (_pool_forward((2, 3, 9), kernel_shape=[3], strides=[2]) if case == "1-D"
               else _pool_forward(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER"))
    ops = _ops(build_training_graph(forward).model.graph)
    assert OP not in ops and ops["ScatterElements"] == 1


@pytest.mark.parametrize("form", ["inline", "portable"])
def test_inline_and_portable_forms_are_standard_onnx_with_the_same_gradient(form):
    """``--inline`` and ``--portable`` write the function body (MaxPool's Indices and a
    ScatterElements): no normgrad node, x's gradient the reference's."""
    from normgrad.graphs.portable import make_portable

    attributes = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 1, 1], "ceil_mode": 1}
    training = build_training_graph(_pool_forward(**attributes))
    rewritten = (build_training_graph(_pool_forward(**attributes), inline=True).model if form == "inline"
                 else make_portable(training.model)[0])
    assert not any(n.domain == DOMAIN for n in rewritten.graph.node)
    assert {"MaxPool", "ScatterElements"} <= set(_ops(rewritten.graph))
    rng = np.random.default_rng(4)
    x = rng.permutation(2 * 6 * 81).reshape(2, 6, 9, 9).astype(np.float32)
    y_grad = rng.standard_normal(_out_shape(x.shape, {**max_pool_grad.ATTRIBUTES, **attributes})).astype(np.float32)
    expected = 1.5 * max_pool_grad.reference(1.5 * x.astype(np.float64), y_grad.astype(np.float64), **attributes).dx
    for backend, graph in (("functions", rewritten), ("cpp", training.model)):
        if backend == "cpp" and not cpp_available():
            continue
        outputs = harness.run_model(graph, {**training.weights, "x": x, "y_grad": y_grad}, backend)
        np.testing.assert_allclose(outputs["x_grad"], expected, rtol=1e-6, atol=1e-6, err_msg=backend)
