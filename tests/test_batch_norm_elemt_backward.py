"""BatchNormElemtBackward: reference, validation, schema inference and function body."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

import normgrad
from _helpers import assert_close
from normgrad.ops import harness
from normgrad.ops import NormgradInputError, batch_norm_elemt_backward as elemt, batch_norm_reduce_backward as reduce_op

_TYPES = {np.float32: onnx.TensorProto.FLOAT, np.float16: onnx.TensorProto.FLOAT16}


def _bn_inputs(shape, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2 + 3).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    axes = (0,) + tuple(range(2, len(shape)))
    if x.size:
        mean, var = x.astype(np.float64).mean(axis=axes), x.astype(np.float64).var(axis=axes)
    else:
        mean, var = np.zeros(shape[1]), np.ones(shape[1])
    invstd = 1 / np.sqrt(var + 1e-5)
    weight = rng.uniform(0.5, 1.5, shape[1])
    sums = reduce_op.reference(dy, x, mean.astype(np.float32), invstd.astype(np.float32))
    return dy, x, mean.astype(np.float32), invstd.astype(np.float32), weight.astype(np.float32), sums.sum_dy, sums.sum_dy_xmu


def _batch_norm(x, weight, eps=1e-5):
    axes = (0,) + tuple(range(2, x.ndim))
    per_channel = (1, -1) + (1,) * (x.ndim - 2)
    mean = x.mean(axis=axes, keepdims=True)
    var = x.var(axis=axes, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight.reshape(per_channel)


@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 5), (2, 3, 4, 5), (2, 2, 3, 2, 2)])
def test_reference_is_batch_norm_gradient(shape):
    dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu = _bn_inputs(shape)
    x64, w64, dy64 = x.astype(np.float64), weight.astype(np.float64), dy.astype(np.float64)
    grad = elemt.reference(dy64.astype(np.float32), x, mean, invstd, weight, sum_dy, sum_dy_xmu).grad_input
    rng = np.random.default_rng(1)
    for _ in range(3):
        direction = rng.standard_normal(shape)
        h = 1e-5
        numeric = ((_batch_norm(x64 + h * direction, w64) - _batch_norm(x64 - h * direction, w64)) * dy64).sum() / (2 * h)
        np.testing.assert_allclose((grad * direction).sum(), numeric, rtol=2e-4, atol=1e-4)


def test_reference_matches_torch_autograd():
    torch = pytest.importorskip("torch")
    dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu = _bn_inputs((3, 4, 5, 6))
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    out = torch.nn.functional.batch_norm(
        xt, None, None, torch.tensor(weight, dtype=torch.float64), None, training=True, eps=1e-5
    )
    out.backward(torch.tensor(dy, dtype=torch.float64))
    grad = elemt.reference(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu).grad_input
    np.testing.assert_allclose(grad, xt.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_empty_input_gives_empty_output():
    x = np.zeros((0, 3, 4), np.float32)
    vec = np.ones(3, np.float32)
    assert elemt.reference(x, x, vec, vec, vec, vec, vec).grad_input.shape == (0, 3, 4)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "grad_out": a["grad_out"][:1]}, "grad_out"),
        (lambda a: {**a, "input": a["input"].reshape(-1)}, "rank"),
        (lambda a: {**a, "sum_dy": a["sum_dy"][:2]}, "sum_dy"),
        (lambda a: {**a, "weight": a["weight"].astype(np.float16)}, "weight"),
        (lambda a: {**a, "mean": None}, "mean"),
        (lambda a: {**a, "input": a["input"].astype(np.int32)}, "float32"),
    ],
)
def test_validate_rejects(change, message):
    args = dict(zip(elemt.INPUTS, _bn_inputs((2, 3, 4))))
    with pytest.raises(NormgradInputError, match=message):
        elemt.reference(**change(args))


_REQUIRED = elemt.INPUTS[:7]  # all but relu_output


def _model(rank, dtype=np.float32, channels=3):
    t = _TYPES[dtype]
    dims = ["N", channels] + [f"d{i}" for i in range(rank - 2)]
    node = oh.make_node(elemt.OP_TYPE, list(_REQUIRED), ["grad_input"], domain=normgrad.DOMAIN)
    inputs = [oh.make_tensor_value_info(name, t, dims) for name in _REQUIRED[:2]]
    inputs += [oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [channels]) for name in _REQUIRED[2:]]
    graph = oh.make_graph([node], "elemt", inputs, [oh.make_tensor_value_info("grad_input", t, dims)])
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(normgrad.DOMAIN, 1)], ir_version=10
    )
    return model


def test_schema_inference():
    model = onnx.shape_inference.infer_shapes(_model(4), strict_mode=True)
    out = model.graph.output[0].type.tensor_type
    assert out.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_param or d.dim_value for d in out.shape.dim] == ["N", 3, "d0", "d1"]
    bad = _model(4)
    bad.graph.input[5].type.tensor_type.shape.dim[0].dim_value = 4
    with pytest.raises((onnx.shape_inference.InferenceError, NormgradInputError), match="sum_dy"):
        onnx.shape_inference.infer_shapes(bad, strict_mode=True)


@pytest.mark.parametrize("shape", [(5, 3), (2, 3, 7), (2, 3, 4, 5), (1, 3, 2, 3, 2), (0, 3, 4), (1, 1, 1)], ids=str)
def test_matches_reference(backend, shape):
    inputs = dict(zip(elemt.INPUTS, _bn_inputs(shape)))
    expected = elemt.reference(**inputs).grad_input
    assert_close(harness.run(backend, elemt.OP_TYPE, inputs)["grad_input"], expected, what="grad_input")


def test_function_body_passes_the_checker():
    onnx.checker.check_model(normgrad.add_functions(_model(4)), full_check=True)


def test_function_body_float16():
    model = normgrad.add_functions(_model(4, np.float16))
    args = list(_bn_inputs((2, 3, 4, 5)))
    args[0], args[1] = args[0].astype(np.float16), args[1].astype(np.float16)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, dict(zip(elemt.INPUTS, args)))
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, elemt.reference(*args).grad_input, rtol=1e-2, atol=1e-2)


def _masked_elemt_inputs(shape, seed=0):
    """Elemt inputs with relu_output, the sums those of the masked grad_out."""
    from _helpers import batch_norm_inputs, relu_masked_truth, with_relu_output

    inputs = with_relu_output(batch_norm_inputs(shape, seed=seed), seed=seed + 1)
    sums = reduce_op.reference(**inputs)
    return {**inputs, "sum_dy": sums.sum_dy, "sum_dy_xmu": sums.sum_dy_xmu}, relu_masked_truth


@pytest.mark.parametrize("shape", [(6, 3), (2, 3, 70), (3, 4, 9, 11)], ids=str)
def test_relu_output_masks_grad_out(backend, shape):
    """Every backend against the float64 truth: dx of the explicitly masked grad_out, finite
    although grad_out is NaN/inf wherever relu_output is 0."""
    inputs, masked = _masked_elemt_inputs(shape, seed=3)
    truth = elemt.reference(**masked(inputs)).grad_input
    assert np.isfinite(truth).all()
    np.testing.assert_array_equal(elemt.reference(**inputs).grad_input, truth)
    assert_close(harness.run(backend, elemt.OP_TYPE, inputs)["grad_input"], truth, what="grad_input")


def test_relu_output_validation():
    inputs, _ = _masked_elemt_inputs((2, 3, 4))
    with pytest.raises(NormgradInputError, match="'relu_output' must have the shape of 'input'"):
        elemt.reference(**{**inputs, "relu_output": inputs["relu_output"][:, :1]})


def test_add_functions_feeds_a_neutral_scalar_to_nodes_without_relu_output():
    """One body per op type: when one node gives relu_output, the body reads it, and a node
    of the same op type without it is fed the scalar 1 (no mask), computing what it did."""
    inputs, _ = _masked_elemt_inputs((2, 3, 5), seed=8)
    plain = dict(zip(_REQUIRED, _bn_inputs((2, 3, 5), seed=9)))
    nodes = [oh.make_node(elemt.OP_TYPE, list(elemt.INPUTS), ["masked"], domain=normgrad.DOMAIN),
             oh.make_node(elemt.OP_TYPE, [f"p_{n}" for n in _REQUIRED], ["plain"], domain=normgrad.DOMAIN)]
    feeds = {**inputs, **{f"p_{n}": v for n, v in plain.items()}}
    graph = oh.make_graph(nodes, "two", [oh.make_tensor_value_info(n, onnx.TensorProto.FLOAT, list(v.shape)) for n, v in feeds.items()],
                          [oh.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2, 3, 5]) for n in ("masked", "plain")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(normgrad.DOMAIN, 1)], ir_version=10)
    with_bodies = normgrad.add_functions(model)
    onnx.checker.check_model(with_bodies, full_check=True)
    assert len(with_bodies.functions) == 1 and "relu_output" in with_bodies.functions[0].input
    assert normgrad.add_functions(with_bodies) == with_bodies
    session = ort.InferenceSession(with_bodies.SerializeToString(), providers=["CPUExecutionProvider"])
    masked, unmasked = session.run(None, feeds)
    assert_close(masked, elemt.reference(**inputs).grad_input, what="masked")
    assert_close(unmasked, elemt.reference(**plain).grad_input, what="plain")
    # without a masked node the body and the nodes are what they always were
    alone = oh.make_model(oh.make_graph(nodes[1:], "one", graph.input[8:], graph.output[1:]),
                          opset_imports=model.opset_import, ir_version=10)
    assert normgrad.add_functions(alone).functions[0] == elemt.function_body(18)
    assert list(normgrad.add_functions(alone).graph.node[0].input) == [f"p_{n}" for n in _REQUIRED]
