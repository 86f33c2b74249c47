"""CumSum, PRelu, Mish, DepthToSpace and SpaceToDepth against float64 central finite differences."""

from __future__ import annotations

import numpy as np
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from normgrad.graphs import build_training_graph
from normgrad.tools.check import check_gradients

from _graph_models import model, run_training

TOLERANCE = 1e-4


def _check(forward, tolerance=TOLERANCE, **kwargs):
    checks = check_gradients(build_training_graph(forward, **kwargs), directions=2)
    assert checks, "no gradient outputs"
    worst = max(checks, key=lambda c: c.error)
    assert worst.error < tolerance, worst


def _axis(value):
    return oh.make_node("Constant", [], ["axis"], value=onh.from_array(np.asarray(value, np.int64)))


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [1, -1])
def test_cumsum(exclusive, reverse, axis):
    nodes = [_axis(axis), oh.make_node("CumSum", ["x", "axis"], ["y"], exclusive=exclusive, reverse=reverse)]
    _check(model(nodes, {"x": (2, 5, 3)}, ["y"]))


def test_cumsum_computed_axis():
    """The axis read from the graph at run time (a Shape-derived int32)."""
    nodes = [
        oh.make_node("Shape", ["x"], ["shape"], start=0, end=1),
        oh.make_node("Sub", ["shape", "one"], ["axis64"]),
        oh.make_node("Squeeze", ["axis64"], ["axis_s"]),
        oh.make_node("Cast", ["axis_s"], ["axis"], to=6),
        oh.make_node("CumSum", ["x", "axis"], ["y"], reverse=1),
    ]
    forward = model(nodes, {"x": (2, 4)}, ["y"], initializers={"one": np.asarray([1], np.int64)})
    _check(forward)


@pytest.mark.parametrize("slope_shape", [(1,), (3, 1, 1), (4,), (1, 4), (2, 3, 1, 4)])
def test_prelu(slope_shape):
    rng = np.random.default_rng(0)
    slope = (rng.standard_normal(slope_shape) * 0.5).astype(np.float32)
    forward = model([oh.make_node("PRelu", ["x", "slope"], ["y"])], {"x": (2, 3, 5, 4)}, ["y"], initializers={"slope": slope})
    _check(forward)


def test_mish():
    _check(model([oh.make_node("Mish", ["x"], ["y"])], {"x": (3, 7)}, ["y"], opset=18))


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space(mode):
    _check(model([oh.make_node("DepthToSpace", ["x"], ["y"], blocksize=2, mode=mode)], {"x": (2, 12, 3, 2)}, ["y"]))


def test_depth_to_space_dynamic_sizes():
    """One training graph for any batch and image size (CRD's regrouping copies run-time dims)."""
    import onnxruntime as ort

    forward = model([oh.make_node("DepthToSpace", ["x"], ["y"], blocksize=3, mode="CRD")], {"x": ("N", 18, "H", "W")}, ["y"])
    training, initial = build_training_graph(forward)
    session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    for shape in ((1, 18, 2, 3), (2, 18, 4, 1)):
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        dy = np.random.default_rng(1).standard_normal((shape[0], 2, shape[2] * 3, shape[3] * 3)).astype(np.float32)
        dx = session.run(["x_grad"], {**initial, "x": x, "y_grad": dy})[0]
        # CRD: y[n, c, h*b + i, w*b + j] = x[n, c*b*b + i*b + j, h, w], so dx gathers dy the same way
        expected = dy.reshape(shape[0], 2, shape[2], 3, shape[3], 3).transpose(0, 1, 3, 5, 2, 4).reshape(shape)
        np.testing.assert_array_equal(dx, expected)


def test_space_to_depth():
    _check(model([oh.make_node("SpaceToDepth", ["x"], ["y"], blocksize=2)], {"x": (2, 3, 4, 6)}, ["y"]))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_loop_matches_torch(tmp_path, mode, exporter):
    """The exporters' EmbeddingBag Loops, with an empty bag (torch: zeros; TorchScript's
    ReduceMean would give NaN), rewritten to Gather + MatMul: output and weight gradient as torch's."""
    torch = pytest.importorskip("torch")
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    import json

    import normgrad.torch

    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(9, 3, mode=mode)
    ids, offsets = torch.tensor([1, 2, 2, 8, 0, 5]), torch.tensor([0, 2, 2, 5])
    forward = normgrad.torch.export(bag, (ids, offsets), tmp_path / "bag.onnx", input_names=["ids", "offsets"],
                                    output_names=["y"], exporter=exporter)
    assert any(n.op_type == "Loop" for n in forward.graph.node)
    training = build_training_graph(forward)
    assert not any(n.op_type == "Loop" for n in training.model.graph.node)
    dy = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    results = run_training(training, {"ids": ids.numpy(), "offsets": offsets.numpy(), "y_grad": dy})
    y = bag(ids, offsets)
    y.backward(torch.tensor(dy))
    np.testing.assert_allclose(results["y"], y.detach().numpy(), rtol=1e-6, atol=1e-6)
    gradient_of = json.loads(next(p.value for p in training.model.metadata_props if p.key == "normgrad.gradients"))
    grad_name = next(g for g, source in gradient_of.items() if source == "weight")
    np.testing.assert_allclose(results[grad_name], bag.weight.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_other_loops_are_still_refused_by_name():
    """A Loop that is not the EmbeddingBag form (here: a loop-carried float) keeps failing
    with the operator named."""
    from normgrad.graphs import UnsupportedOperatorError

    body = oh.make_graph(
        [oh.make_node("Identity", ["cond_in"], ["cond_out"]), oh.make_node("Mul", ["acc", "acc"], ["acc_out"])],
        "body",
        [oh.make_tensor_value_info("i", 7, []), oh.make_tensor_value_info("cond_in", 9, []),
         oh.make_tensor_value_info("acc", 1, None)],
        [oh.make_tensor_value_info("cond_out", 9, []), oh.make_tensor_value_info("acc_out", 1, None)],
    )
    nodes = [oh.make_node("Constant", [], ["trips"], value=onh.from_array(np.asarray(3, np.int64))),
             oh.make_node("Constant", [], ["cond"], value=onh.from_array(np.asarray(True))),
             oh.make_node("Loop", ["trips", "cond", "x"], ["y"], body=body)]
    with pytest.raises(UnsupportedOperatorError, match="Loop"):
        build_training_graph(model(nodes, {"x": (2,)}, ["y"]))
