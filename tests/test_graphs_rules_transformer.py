"""The transformer-family gradient rules alone: float64 central finite differences, and
exact expectations where finite differences cannot decide (ties, random masks)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

from normgrad.graphs import build_training_graph

from _graph_models import model, weights
from test_graphs_rules import _check, _node


def _run(training: onnx.ModelProto, feeds, outputs):
    session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(outputs, feeds)


@pytest.mark.parametrize("op_type", ["Sin", "Cos"])
def test_sin_cos(op_type):
    _check(model([_node(op_type, ["x"])], {"x": (3, 4)}, ["y"]))


def test_cast_like():
    """Gradient cast back to the input's type; the type donor gets none."""
    params = {"like": np.zeros((), np.float64)}
    nodes = [oh.make_node("CastLike", ["x", "like"], ["d"]), oh.make_node("Mul", ["d", "d"], ["m"]),
             _node("Cast", ["m"], to=onnx.TensorProto.FLOAT)]
    training = build_training_graph(model(nodes, {"x": (2, 3)}, ["y"], params))
    assert "like_grad" not in [o.name for o in training.graph.output]
    _check(model(nodes, {"x": (2, 3)}, ["y"], params))


@pytest.mark.parametrize("shapes", [((2, 3), (2, 3), (2, 3)), ((2, 1, 4), (3, 1), (4,)), ((4,), (), (2, 3, 4))])
def test_where(shapes):
    rng = np.random.default_rng(0)
    params = {"c": rng.random(shapes[0]) > 0.5}
    forward = model([_node("Where", ["c", "a", "b"])], {"a": shapes[1], "b": shapes[2]}, ["y"], params)
    _check(forward)


@pytest.mark.parametrize("op_type", ["Max", "Min", "Mean", "Sum"])
@pytest.mark.parametrize("shapes", [((3, 4),), ((2, 3, 4), (2, 3, 4)), ((2, 1, 4), (3, 1), (4,))])
def test_variadic(op_type, shapes):
    if op_type == "Mean" and len(shapes) == 3:  # onnx's reference Mean needs the first input at the output's shape
        shapes = ((2, 3, 4),) + shapes[1:]
    inputs = {f"x{i}": shape for i, shape in enumerate(shapes)}
    _check(model([_node(op_type, list(inputs))], inputs, ["y"]))


@pytest.mark.parametrize("op_type", ["Max", "Min"])
def test_variadic_ties_split_equally(op_type):
    """As torch.maximum/minimum: inputs tying for the result share the gradient equally."""
    a = np.array([1.0, 2.0, 3.0, 5.0], np.float32)
    b = np.array([1.0, 1.0, 3.0, 5.0], np.float32)
    c = np.array([0.0, 4.0, 3.0, 5.0], np.float32) * (1 if op_type == "Max" else -1)
    c[3] = 5.0
    inputs = {"a": (4,), "b": (4,), "c": (4,)}
    training = build_training_graph(model([_node(op_type, ["a", "b", "c"])], inputs, ["y"]))
    dy = np.array([1.0, 2.0, 3.0, 6.0], np.float32)
    grads = _run(training, {"a": a, "b": b, "c": c, "y_grad": dy}, ["a_grad", "b_grad", "c_grad"])
    stacked = np.stack([a, b, c])
    result = stacked.max(0) if op_type == "Max" else stacked.min(0)
    ties = (stacked == result).astype(np.float64)
    expected = dy * ties / ties.sum(0)
    np.testing.assert_allclose(np.stack(grads), expected, rtol=1e-6)
    torch = pytest.importorskip("torch")
    tensors = [torch.tensor(v, requires_grad=True) for v in (a, b)]
    pair = torch.maximum if op_type == "Max" else torch.minimum
    pair(*tensors).backward(torch.tensor(dy))
    two = build_training_graph(model([_node(op_type, ["a", "b"])], {"a": (4,), "b": (4,)}, ["y"]))
    ours = _run(two, {"a": a, "b": b, "y_grad": dy}, ["a_grad", "b_grad"])
    for mine, theirs in zip(ours, tensors):
        np.testing.assert_allclose(mine, theirs.grad.numpy(), rtol=1e-6)
