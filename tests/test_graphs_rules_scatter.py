"""ScatterND and ScatterElements: gradients to the data and the updates for every reduction,
against float64 central finite differences (of onnxruntime's own forward, so repeated
positions with reduction "none" are judged by what onnxruntime writes) and torch autograd
(scatter_reduce's tie rule, index_put_, index_add_, scatter, slice assignment through both
exporters)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

from normgrad.graphs import UnsupportedOperatorError, build_training_graph
from normgrad.tools.check import check_gradients, random_feeds

from _graph_models import model

TOLERANCE = 1e-4
REDUCTIONS = ["none", "add", "mul", "max", "min"]


def _scatter_model(op_type, data_shape, indices, updates_shape, reduction, fed=False, **attrs):
    """y = op_type(x, i, u) with float inputs x and u; the indices an initializer (constant),
    or with ``fed`` a graph input (known only at run time)."""
    node = oh.make_node(op_type, ["x", "i", "u"], ["y"], reduction=reduction, **attrs)
    forward = model([node], {"x": data_shape, "u": updates_shape}, ["y"], initializers={} if fed else {"i": indices})
    if fed:
        forward.graph.input.append(oh.make_tensor_value_info("i", onnx.TensorProto.INT64, list(indices.shape)))
    return forward


def _check(forward, indices=None, seed=0, wrt=("u", "x")):
    """The worst gradient of every input (``wrt``) against float64 central differences
    (``indices``: the fed indices' value)."""
    training = build_training_graph(forward)
    feeds = None if indices is None else {**random_feeds(training, seed), "i": indices}
    checks = check_gradients(training, feeds=feeds, directions=3, seed=seed)
    assert sorted(c.wrt for c in checks) == list(wrt)
    worst = max(checks, key=lambda c: c.error)
    assert worst.error < TOLERANCE, worst


ND_CASES = {
    # rows of a matrix, one written twice, one counted from the end
    "rows": ((6, 3), np.array([[4], [1], [-2], [1]]), (4, 3)),
    # pairs into [5, 3, 2], a repeated pair, index batch of 2 x 2
    "pairs": ((5, 3, 2), np.array([[[1, 0], [3, 2]], [[1, 0], [-1, 1]]]), (2, 2, 2)),
    # every coordinate (torch's index_put_ form): single elements, one repeated
    "elements": ((3, 4, 2), np.array([[0, 1, 1], [2, 3, 0], [0, 1, 1], [1, -1, -1], [2, 0, 1]]), (5,)),
}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", sorted(ND_CASES))
def test_scatter_nd(case, reduction):
    data_shape, indices, updates_shape = ND_CASES[case]
    _check(_scatter_model("ScatterND", data_shape, indices, updates_shape, reduction))


ELEMENT_CASES = {
    "axis0": ((4, 3), np.array([[1, 0, 3], [1, 2, 3], [-3, 0, 0]]), 0),
    "axis1": ((3, 5), np.array([[1, 0, 4, 1], [2, 2, -1, 0]]), 1),
    "last_axis_3d": ((2, 3, 5), np.array([[[0, 4], [1, 1], [3, 2]], [[4, 4], [-5, 2], [0, 1]]]), -1),
}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", sorted(ELEMENT_CASES))
def test_scatter_elements(case, reduction):
    data_shape, indices, axis = ELEMENT_CASES[case]
    _check(_scatter_model("ScatterElements", data_shape, indices, indices.shape, reduction, axis=axis))


@pytest.mark.parametrize("op_type", ["ScatterND", "ScatterElements"])
@pytest.mark.parametrize("reduction", ["none", "mul"])
def test_indices_known_only_at_run_time(op_type, reduction):
    """Repeated positions found at run time: with "none" the last update written wins, as in
    onnxruntime's forward."""
    if op_type == "ScatterND":
        data_shape, indices, updates_shape = ND_CASES["pairs"]
        forward = _scatter_model(op_type, data_shape, indices, updates_shape, reduction, fed=True)
    else:
        data_shape, indices, axis = ELEMENT_CASES["axis0"]
        forward = _scatter_model(op_type, data_shape, indices, indices.shape, reduction, fed=True, axis=axis)
    _check(forward, indices)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("constant", ["x", "u"])
def test_one_side_constant(constant, reduction):
    """The data or the updates a Constant: only the other gets a gradient."""
    data_shape, indices, updates_shape = ND_CASES["pairs"]
    forward = _scatter_model("ScatterND", data_shape, indices, updates_shape, reduction)
    shape = data_shape if constant == "x" else updates_shape
    value = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    forward.graph.node.insert(0, oh.make_node("Constant", [], [constant], value=onnx.numpy_helper.from_array(value)))
    kept = [i for i in forward.graph.input if i.name != constant]
    del forward.graph.input[:]
    forward.graph.input.extend(kept)
    _check(forward, wrt=[name for name in ("u", "x") if name != constant])


def _gradients(forward, feeds, threads=1):
    """x_grad and u_grad of ``forward``'s training graph for ``feeds`` (y's seed included)."""
    model_, weights = build_training_graph(forward)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model_.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(["x_grad", "u_grad"], {**weights, **feeds})


@pytest.mark.parametrize("op_type", ["ScatterND", "ScatterElements"])
def test_mul_with_zero_updates(op_type):
    """A zero update gets the product of the others; two zeros at one position get nothing:
    against torch's scatter_reduce("prod"), whose gradient handles zeros the same way."""
    torch = pytest.importorskip("torch")
    x = np.array([[1.5, -2.0], [0.5, 3.0], [2.0, 0.0]])
    u = np.array([[0.0, 2.0], [3.0, 0.0], [0.0, 0.5], [-1.0, 4.0]])
    rows = np.array([0, 0, 1, 2])  # row 0: a zero and a 3 in column 0; a 2 and a zero in column 1
    dy = np.array([[1.0, -1.0], [2.0, 0.5], [-3.0, 1.5]])
    if op_type == "ScatterND":
        forward = _scatter_model(op_type, x.shape, rows[:, None], u.shape, "mul")
    else:
        forward = _scatter_model(op_type, x.shape, np.repeat(rows[:, None], 2, 1), u.shape, "mul", axis=0)
    dx, du = _gradients(forward, {"x": x.astype(np.float32), "u": u.astype(np.float32), "y_grad": dy.astype(np.float32)})
    xt, ut = torch.tensor(x, requires_grad=True), torch.tensor(u, requires_grad=True)
    xt.scatter_reduce(0, torch.tensor(np.repeat(rows[:, None], 2, 1)), ut, "prod").backward(torch.tensor(dy))
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-6)
    np.testing.assert_allclose(du, ut.grad.numpy(), rtol=1e-6)


@pytest.mark.parametrize("op_type", ["ScatterND", "ScatterElements"])
@pytest.mark.parametrize("reduction", ["max", "min"])
def test_ties_split_evenly_as_torch_scatter_reduce(op_type, reduction):
    """Ties between the data and updates, and among updates, against torch's
    scatter_reduce(amax/amin, include_self=True): dy split evenly among them."""
    torch = pytest.importorskip("torch")
    sign = 1.0 if reduction == "max" else -1.0
    x = sign * np.array([[2.0, 1.0, 0.0], [1.0, 5.0, 4.0], [3.0, 3.0, 3.0]])
    u = sign * np.array([[2.0, 1.0, -1.0], [2.0, 6.0, 4.0], [0.5, 5.0, 4.0], [3.0, 2.0, 3.0]])
    rows = np.array([0, 1, 1, 2])  # x[0, 0] ties two updates; x[1, 2] ties two; x[2, 0] and x[2, 2] one
    dy = np.random.default_rng(0).standard_normal(x.shape)
    if op_type == "ScatterND":
        forward = _scatter_model(op_type, x.shape, rows[:, None], u.shape, reduction)
    else:
        forward = _scatter_model(op_type, x.shape, np.repeat(rows[:, None], 3, 1), u.shape, reduction, axis=0)
    dx, du = _gradients(forward, {"x": x.astype(np.float32), "u": u.astype(np.float32), "y_grad": dy.astype(np.float32)})
    xt, ut = torch.tensor(x, requires_grad=True), torch.tensor(u, requires_grad=True)
    reduce = "amax" if reduction == "max" else "amin"
    xt.scatter_reduce(0, torch.tensor(np.repeat(rows[:, None], 3, 1)), ut, reduce).backward(torch.tensor(dy))
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(du, ut.grad.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("reduction", ["none", "mul", "max"])
def test_same_bits_at_any_thread_count(reduction):
    """Many updates to few rows: the gradients are bitwise the same at 1 and 4 threads."""
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 8, (4096, 1))
    forward = _scatter_model("ScatterND", (8, 16), rows, (4096, 16), reduction)
    feeds = {"x": rng.uniform(0.5, 1.5, (8, 16)).astype(np.float32), "u": rng.uniform(0.99, 1.01, (4096, 16)).astype(np.float32),
             "y_grad": rng.standard_normal((8, 16)).astype(np.float32)}
    one, four = _gradients(forward, feeds, threads=1), _gradients(forward, feeds, threads=4)
    for a, b in zip(one, four):
        np.testing.assert_array_equal(a, b)


def test_indices_of_unknown_length_are_refused_by_name():
    node = oh.make_node("ScatterND", ["x", "i", "u"], ["y"], name="write")
    forward = model([node], {"x": (4, 3), "u": ("N", 3)}, ["y"])
    forward.graph.input.append(oh.make_tensor_value_info("i", onnx.TensorProto.INT64, ["N", "K"]))
    with pytest.raises(UnsupportedOperatorError, match="ScatterND node 'write': ScatterND needs a static, positive last dim"):
        build_training_graph(forward)
