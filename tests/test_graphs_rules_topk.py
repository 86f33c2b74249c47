"""TopK's gradient (to X through the values; the indices carry none) against float64 central
finite differences, torch autograd, and the indices onnxruntime picks among ties."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper
import pytest

from normgrad.graphs import build_training_graph
from normgrad.tools.check import check_gradients

from _graph_models import model, run_training


def _topk_model(shape, k, axis, largest=1, sorted_=1, opset=18, indices_output=True):
    """y = TopK(x, k) values times a weight (so that X's gradient is not dy itself)."""
    outputs = ["values", "indices" if indices_output else ""]
    nodes = [oh.make_node("TopK", ["x", "k"], outputs, axis=axis, largest=largest, sorted=sorted_),
             oh.make_node("Mul", ["values", "w"], ["y"])]
    out_shape = list(shape)
    out_shape[axis] = k
    w = np.random.default_rng(1).standard_normal(out_shape).astype(np.float32)
    return model(nodes, {"x": shape}, ["y"], {"k": np.asarray([k], np.int64), "w": w}, opset=opset)


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("largest", [0, 1])
def test_topk_finite_differences(axis, largest):
    checks = check_gradients(build_training_graph(_topk_model((4, 6, 5), 3, axis, largest)), directions=2)
    assert {c.wrt for c in checks} == {"x", "w"}
    worst = max(checks, key=lambda c: c.error)
    assert worst.error < 1e-4, worst


def test_topk_without_indices_output_and_opset_15():
    """The indices output omitted in the forward (added for the backward); an opset-15 model
    raised to 16 for ScatterElements' reduction."""
    forward = _topk_model((3, 7), 4, 1, opset=15, indices_output=False)
    checks = check_gradients(build_training_graph(forward), directions=2)
    worst = max(checks, key=lambda c: c.error)
    assert worst.error < 1e-4, worst


@pytest.mark.parametrize("largest", [0, 1])
def test_topk_matches_torch(largest):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 5)).astype(np.float32)
    forward = _topk_model(x.shape, 3, 1, largest)
    w = next(t for t in forward.graph.initializer if t.name == "w")
    dy = rng.standard_normal((2, 3, 5)).astype(np.float32)
    results = run_training(build_training_graph(forward), {"x": x, "y_grad": dy})
    x_torch = torch.tensor(x, requires_grad=True)
    values = torch.topk(x_torch, 3, dim=1, largest=bool(largest)).values
    y = values * torch.tensor(onnx.numpy_helper.to_array(w))
    y.backward(torch.tensor(dy))
    np.testing.assert_allclose(results["y"], y.detach().numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(results["x_grad"], x_torch.grad.numpy(), rtol=1e-6, atol=1e-6)


def _indices_and_gradient(x, k, axis, largest=1, sorted_=1):
    """onnxruntime's TopK indices of ``x`` and the training graph's dx for a random dvalues."""
    nodes = [oh.make_node("TopK", ["x", "k"], ["y", "indices"], axis=axis, largest=largest, sorted=sorted_)]
    forward = model(nodes, {"x": x.shape}, ["y"], {"k": np.asarray([k], np.int64)})
    forward.graph.output.append(oh.make_tensor_value_info("indices", onnx.TensorProto.INT64, None))
    dy_shape = list(x.shape)
    dy_shape[axis] = k
    dy = np.random.default_rng(2).standard_normal(dy_shape).astype(np.float32)
    results = run_training(build_training_graph(forward), {"x": x, "y_grad": dy})
    np.testing.assert_array_equal(results["y"], np.take_along_axis(x, results["indices"], axis))
    return results["indices"], dy, results["x_grad"]


@pytest.mark.parametrize("sorted_", [0, 1])
@pytest.mark.parametrize("axis", [0, 1])
def test_topk_ties_follow_the_indices_onnxruntime_picks(sorted_, axis):
    """Among equal values (and in whatever order an unsorted TopK returns them) the gradient
    goes to the elements whose indices onnxruntime's TopK returns, each once: dx is dvalues
    put at exactly those indices, zeros elsewhere."""
    x = np.array([[1.0, 3.0, 3.0, 2.0, 3.0], [0.5, 0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 3.0, 3.0, -1.0]], np.float32)
    indices, dy, dx = _indices_and_gradient(x, 2, axis, sorted_=sorted_)
    expected = np.zeros_like(x)
    np.put_along_axis(expected, indices, dy, axis=axis)
    np.testing.assert_array_equal(dx, expected)
    assert all(len(set(line)) == 2 for line in np.moveaxis(indices, axis, -1).reshape(-1, 2))
