"""The transformer-family gradient rules alone: float64 central finite differences, and
exact expectations where finite differences cannot decide (ties, random masks)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

import normgrad
from normgrad.graphs import TrainingGraph, UnsupportedOperatorError, build_training_graph
from normgrad.graphs.patterns import _declarative
from normgrad.graphs.rules import gather

from _graph_models import model, weights
from _helpers import cpp_available
from _rule_checks import _check, _node


def _run(training: TrainingGraph, feeds, outputs):
    session = ort.InferenceSession(training.model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(outputs, training.feeds(feeds))


@pytest.mark.parametrize("op_type", ["Sin", "Cos"])
def test_sin_cos(op_type):
    _check(model([_node(op_type, ["x"])], {"x": (3, 4)}, ["y"]))


def test_cast_like():
    """Gradient cast back to the input's type; the type donor gets none."""
    params = {"like": np.zeros((), np.float64)}
    nodes = [oh.make_node("CastLike", ["x", "like"], ["d"]), oh.make_node("Mul", ["d", "d"], ["m"]),
             _node("Cast", ["m"], to=onnx.TensorProto.FLOAT)]
    training, _ = build_training_graph(model(nodes, {"x": (2, 3)}, ["y"], params))
    assert "like_grad" not in [o.name for o in training.graph.output]
    _check(model(nodes, {"x": (2, 3)}, ["y"], params))


@pytest.mark.parametrize("shapes", [((2, 3), (2, 3), (2, 3)), ((2, 1, 4), (3, 1), (4,)), ((4,), (), (2, 3, 4))])
def test_where(shapes):
    rng = np.random.default_rng(0)
    params = {"c": rng.random(shapes[0]) > 0.5}
    forward = model([_node("Where", ["c", "a", "b"])], {"a": shapes[1], "b": shapes[2]}, ["y"], params)
    _check(forward)


def _safe_softmax_model():
    """torch's safe softmax as the dynamo exporter writes it: Where(IsNaN(p), 0, p), p = Softmax(s)."""
    nodes = [oh.make_node("Constant", [], ["zero"], value=onnx.numpy_helper.from_array(np.zeros((), np.float32))),
             oh.make_node("Softmax", ["s"], ["p"], axis=-1), oh.make_node("IsNaN", ["p"], ["nan"]),
             oh.make_node("Where", ["nan", "zero", "p"], ["q"]), _node("Mul", ["q", "v"])]
    params = {"v": np.linspace(-1, 1, 20).astype(np.float32).reshape(4, 5)}
    return model(nodes, {"s": (3, 4, 5)}, ["y"], params)


def test_safe_softmax_gradient():
    """The builder writes the float32 chain as one normgrad:SafeSoftmax (no Where left), whose
    gradient matches finite differences and is 0 over a row it zeroed (a non-finite input
    there; its output is the constant 0). Where the chain is not matched (the condition read
    through an Identity), Where(IsNaN(p), 0, p) passes dy to the Softmax output p unmasked (no
    Where in the backward): such a row's gradient is NaN, as through the masked form; the
    other rows are the same in both."""
    forward = _safe_softmax_model()
    _check(forward)
    training, initial = build_training_graph(forward)
    assert [n.op_type for n in training.graph.node].count("SafeSoftmax") == 1
    assert sum(n.op_type == "Where" for n in training.graph.node) == 0
    masked = onnx.ModelProto()
    masked.CopyFrom(forward)
    masked.graph.node[3].input[0] = "nan_used"  # a condition the rule cannot see through
    masked.graph.node.insert(3, oh.make_node("Identity", ["nan"], ["nan_used"]))
    masked_training, _ = build_training_graph(masked)
    assert sum(n.op_type == "Where" for n in masked_training.graph.node) == 2
    rng = np.random.default_rng(1)
    s = rng.standard_normal((3, 4, 5)).astype(np.float32)
    s[1, 2, 3], s[2, 0, 1] = np.inf, np.nan
    feeds = {**initial, "s": s, "y_grad": rng.standard_normal((3, 4, 5)).astype(np.float32)}
    results = []
    for graph in (training, masked_training):
        session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
        results.append(session.run(["s_grad"], feeds)[0])
    bad = np.zeros((3, 4), bool)
    bad[1, 2] = bad[2, 0] = True
    assert (results[0][bad] == 0).all() and np.isnan(results[1][bad]).all()
    for result in results:
        assert np.isfinite(result[~bad]).all()
    np.testing.assert_array_equal(results[0][~bad], results[1][~bad])


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


@pytest.mark.parametrize("data_shape, indices, axis", [
    ((5, 3), [[0, 2, 2], [-1, 4, 0]], 0),  # embedding lookup with repeats and a negative index
    ((2, 4, 3), [3, -4, 3], 1),
    ((2, 3, 4), [[1], [-1]], -1),
    ((3, 4), 1, 0),  # scalar index: a class token
    ((2, 5, 3), -2, 1),
])
def test_gather(data_shape, indices, axis):
    params = {"idx": np.asarray(indices, np.int64)}
    nodes = [oh.make_node("Gather", ["x", "idx"], ["g"], axis=axis), _node("Mul", ["g", "g"])]
    _check(model(nodes, {"x": data_shape}, ["y"], params))


def test_gather_int32_indices_and_symbolic_dims():
    params = {"idx": np.asarray([[0, -1], [1, 1]], np.int32)}  # the checker runs V = D = 2
    nodes = [oh.make_node("Gather", ["x", "idx"], ["g"]), _node("Mul", ["g", "g"])]
    _check(model(nodes, {"x": ("V", "D")}, ["y"], params))


@pytest.mark.parametrize("indices, axis", [([[0, 2], [2, -1], [1, 1]], 1), ([[1, 0, 0, 2], [-3, 0, 1, 1]], 0), ([[3], [0], [-1]], 1)])
def test_gather_elements(indices, axis):
    params = {"idx": np.asarray(indices, np.int64)}
    nodes = [oh.make_node("GatherElements", ["x", "idx"], ["g"], axis=axis), _node("Mul", ["g", "g"])]
    _check(model(nodes, {"x": (3, 4)}, ["y"], params))


@pytest.mark.parametrize("op_type, shape", [("Gather", (2, 256)), ("Gather", (64, 16)), ("Gather", (65, 16)),
                                            ("GatherElements", (20, 64))])
def test_gather_gradient_is_bitwise_the_same_for_any_thread_count(op_type, shape):
    """Repeated indices accumulate in one order (onnxruntime's ScatterND add would not): a
    scatter-add (for Gather an EmbeddingGrad node: its C++ kernel and its ScatterElements
    body), or for tables of at most ONE_HOT_ROWS rows one GEMM of the one-hot indices."""
    rng = np.random.default_rng(0)
    idx = rng.integers(0, shape[0], (32, 64)).astype(np.int64)
    training, initial = build_training_graph(model([_node(op_type, ["x", "idx"])], {"x": shape}, ["y"], {"idx": idx}))
    one_hot = op_type == "Gather" and shape[0] <= gather.ONE_HOT_ROWS
    expected_op = "Gemm" if one_hot else "EmbeddingGrad" if op_type == "Gather" else "ScatterElements"
    assert any(n.op_type == expected_op for n in training.graph.node)
    feeds = {**initial, "x": rng.standard_normal(shape).astype(np.float32)}
    feeds["y_grad"] = rng.standard_normal((32, 64, shape[1]) if op_type == "Gather" else (32, 64)).astype(np.float32)
    results = []
    for kernels, threads in [(None, 1), (None, 2), (None, 3)] + ([("cpp", 1), ("cpp", 2)] if cpp_available() else []):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        if kernels:
            normgrad.session_options(kernels, options)
        session = ort.InferenceSession(training.SerializeToString(), options, providers=["CPUExecutionProvider"])
        results.append(session.run(["x_grad"], feeds)[0])
    for result in results[1:]:
        np.testing.assert_array_equal(result, results[0])
    expected = np.zeros(shape)
    if op_type == "Gather":
        np.add.at(expected, idx, feeds["y_grad"].astype(np.float64))
    else:
        np.add.at(expected, (idx, np.arange(64)[None, :]), feeds["y_grad"].astype(np.float64))
    # float32 sums of up to 2048 terms (the 2-row table's), in whichever order
    np.testing.assert_allclose(results[0], expected, rtol=0, atol=1e-6 * max(10.0, np.abs(expected).max()))


def _dropout_model(ratio, training, mask_output=False, runtime=False):
    params = {} if runtime else {"ratio": np.asarray(ratio, np.float32), "training": np.asarray(training)}
    outputs = ["y", "mask"] if mask_output else ["y"]
    node = oh.make_node("Dropout", ["x", "ratio", "training"], outputs, name="drop", seed=3)
    forward = model([node], {"x": (6, 50)}, ["y"], params)
    if runtime:
        forward.graph.input.extend([oh.make_tensor_value_info("ratio", onnx.TensorProto.FLOAT, []),
                                    oh.make_tensor_value_info("training", onnx.TensorProto.BOOL, [])])
    if mask_output:
        forward.graph.output.append(oh.make_tensor_value_info("mask", onnx.TensorProto.BOOL, [6, 50]))
    return forward


def test_dropout_training_mode_with_ratio_zero():
    """p = 0 in training mode (torch's export of nn.Dropout(0)): the identity, through the mask."""
    _check(_dropout_model(0.0, True))


@pytest.mark.parametrize("mask_output", [True, False])
def test_dropout_training_mode_uses_the_forward_mask(mask_output):
    ratio = 0.4
    training = build_training_graph(_dropout_model(ratio, True, mask_output))
    assert any(n.op_type == "Dropout" and len(n.output) == 2 and n.output[1] for n in training.model.graph.node)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 50)).astype(np.float32)
    dy = rng.standard_normal((6, 50)).astype(np.float32)
    outputs = ["y", "x_grad"] + (["mask"] if mask_output else [])
    y, grad, *mask = _run(training, {"x": x, "y_grad": dy}, outputs)
    mask = mask[0] if mask_output else y != 0
    assert 0.2 < 1 - mask.mean() < 0.6, "the mask should drop about 40%"
    np.testing.assert_array_equal(y, np.where(mask, x / np.float32(1 - ratio), 0))  # the mask y was drawn with
    assert np.all(grad[~mask] == 0)
    np.testing.assert_allclose(grad[mask], dy[mask] / (1 - ratio), rtol=1e-6)
    torch = pytest.importorskip("torch")
    expected = torch.ops.aten.native_dropout_backward(torch.tensor(dy), torch.tensor(mask), 1 / (1 - ratio))
    np.testing.assert_allclose(grad, expected.numpy(), rtol=1e-6)


def test_dropout_ratio_and_training_mode_at_run_time():
    training = build_training_graph(_dropout_model(None, None, mask_output=True, runtime=True))
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((6, 50)).astype(np.float32), "y_grad": rng.standard_normal((6, 50)).astype(np.float32)}
    for ratio in (0.0, 0.25):  # onnxruntime refuses ratio 1
        feeds.update(ratio=np.asarray(ratio, np.float32), training=np.asarray(True))
        grad, mask = _run(training, feeds, ["x_grad", "mask"])
        expected = np.where(mask, feeds["y_grad"] / np.float32(1 - ratio), 0)
        np.testing.assert_allclose(grad, expected, rtol=1e-6)
    feeds.update(ratio=np.asarray(0.5, np.float32), training=np.asarray(False))
    (grad,) = _run(training, feeds, ["x_grad"])
    np.testing.assert_array_equal(grad, feeds["y_grad"])


REDUCTIONS = ["ReduceSumSquare", "ReduceL2", "ReduceLogSumExp", "ReduceMax", "ReduceMin"]


@pytest.mark.parametrize("op_type", REDUCTIONS)
@pytest.mark.parametrize("axes, keepdims", [([1], 1), ([0, -1], 0), (None, 0), (None, 1)])
@pytest.mark.parametrize("opset", [17, 18])
def test_reductions(op_type, axes, keepdims, opset):
    inputs, params, attrs = ["x"], {}, {"keepdims": keepdims}
    if axes is not None and opset >= 18:
        inputs.append("axes")
        params["axes"] = np.array(axes, np.int64)
    elif axes is not None:
        attrs["axes"] = axes
    _check(model([_node(op_type, inputs, **attrs)], {"x": (2, 3, 4)}, ["y"], params, opset=opset))


@pytest.mark.parametrize("op_type", REDUCTIONS)
def test_reductions_with_run_time_axes_and_symbolic_dims(op_type):
    forward = model([_node(op_type, ["x", "axes"], keepdims=0)], {"x": ("N", 3, "W")}, ["y"], opset=18)
    forward.graph.input.append(oh.make_tensor_value_info("axes", onnx.TensorProto.INT64, [1]))
    forward.graph.output[0].CopyFrom(oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", "W"]))
    training = build_training_graph(forward)
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    dy = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    (grad,) = _run(training, {"x": x, "axes": np.array([-2], np.int64), "y_grad": dy}, ["x_grad"])
    torch = pytest.importorskip("torch")
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = {"ReduceSumSquare": lambda: (t * t).sum(1), "ReduceL2": lambda: t.norm(dim=1),
         "ReduceLogSumExp": lambda: t.logsumexp(1), "ReduceMax": lambda: t.amax(1), "ReduceMin": lambda: t.amin(1)}[op_type]()
    y.backward(torch.tensor(dy, dtype=torch.float64))
    np.testing.assert_allclose(grad, t.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op_type", ["ReduceMax", "ReduceMin"])
def test_reduce_max_min_ties_split_as_torch(op_type):
    torch = pytest.importorskip("torch")
    x = np.array([[1.0, 3.0, 3.0, -2.0], [2.0, 2.0, 2.0, 2.0], [-5.0, 0.0, -5.0, 4.0]], np.float32)
    dy = np.array([1.0, 3.0, 2.0], np.float32)
    training = build_training_graph(model([_node(op_type, ["x"], axes=[1], keepdims=0)], {"x": (3, 4)}, ["y"], opset=17))
    (grad,) = _run(training, {"x": x, "y_grad": dy}, ["x_grad"])
    t = torch.tensor(x, requires_grad=True)
    (t.amax(1) if op_type == "ReduceMax" else t.amin(1)).backward(torch.tensor(dy))
    np.testing.assert_allclose(grad, t.grad.numpy(), rtol=1e-6)
    assert np.count_nonzero(grad) > 3  # ties actually present


def test_reduce_l2_of_zeros_has_zero_gradient():
    training = build_training_graph(model([_node("ReduceL2", ["x"], axes=[1], keepdims=1)], {"x": (2, 3)}, ["y"], opset=17))
    x = np.array([[0.0, 0.0, 0.0], [3.0, 0.0, 4.0]], np.float32)
    (grad,) = _run(training, {"x": x, "y_grad": np.ones((2, 1), np.float32)}, ["x_grad"])
    np.testing.assert_allclose(grad, [[0, 0, 0], [0.6, 0, 0.8]], rtol=1e-6)


@pytest.mark.parametrize("equation, shapes", [
    ("bhid,bhjd->bhij", [(2, 2, 3, 4), (2, 2, 5, 4)]),  # attention scores
    ("bhij,bhjd->bhid", [(2, 2, 3, 5), (2, 2, 5, 4)]),  # attention-weighted values
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ij->ji", [(3, 4)]),
    ("bid->bdi", [(2, 3, 4)]),
    ("ij,jk", [(3, 4), (4, 5)]),  # implicit output: ik
    ("ij->i", [(3, 4)]),  # j summed out: broadcast back
    ("ij,kj->", [(3, 4), (2, 4)]),
    ("i,j->ij", [(3,), (4,)]),
    ("abc,cd,ad->b", [(2, 3, 4), (4, 5), (2, 5)]),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (1, 3, 4, 2)]),  # broadcast ellipsis
    ("b...d,d->b...", [(2, 3, 4), (4,)]),
    ("k,b...d->b...k", [(3,), (2, 3, 4)]),
    ("...ij->...i", [(2, 3, 4)]),
])
def test_einsum(equation, shapes):
    inputs = {f"x{i}": shape for i, shape in enumerate(shapes)}
    forward = model([_node("Einsum", list(inputs), equation=equation)], inputs, ["y"])
    if equation == "...ij,...jk->...ik":  # onnx's shape inference does not broadcast ellipses
        forward.graph.output[0].CopyFrom(oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3, 3, 2]))
    _check(forward)


@pytest.mark.parametrize("equation, inputs", [
    ("bhid,bhjd->bhij", {"q": ("B", 2, "T", 4), "k": ("B", 2, "S", 4)}),
    ("b...d,d->b...", {"q": ("B", "T", 4), "k": (4,)}),
])
def test_einsum_with_symbolic_dims(equation, inputs):
    _check(model([_node("Einsum", ["q", "k"], equation=equation)], inputs, ["y"]))


def test_einsum_diagonal_is_refused():
    forward = model([oh.make_node("Einsum", ["x"], ["y"], name="diag", equation="ii->i")], {"x": (3, 3)}, ["y"])
    with pytest.raises(UnsupportedOperatorError, match="Einsum node 'diag'.*repeated"):
        build_training_graph(forward)


def _gelu_erf_derivative(x):
    """Phi(x) + x phi(x) in float64 (closed form: onnx's reference Erf is only an approximation)."""
    import math

    x = x.astype(np.float64)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    return cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def test_gelu_tanh():
    _check(model([_node("Gelu", ["x"], approximate="tanh")], {"x": (3, 5)}, ["y"], opset=20))


def test_gelu_erf():
    x = np.linspace(-4, 4, 24, dtype=np.float32).reshape(4, 6)
    dy = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    training = build_training_graph(model([_node("Gelu", ["x"])], {"x": (4, 6)}, ["y"], opset=20))
    (grad,) = _run(training, {"x": x, "y_grad": dy}, ["x_grad"])
    np.testing.assert_allclose(grad, dy * _gelu_erf_derivative(x), rtol=1e-5, atol=1e-6)


def test_gelu_against_torch():
    torch = pytest.importorskip("torch")
    x = np.linspace(-4, 4, 24, dtype=np.float32).reshape(4, 6)
    dy = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    for approximate in ("none", "tanh"):
        training = build_training_graph(model([_node("Gelu", ["x"], approximate=approximate)], {"x": (4, 6)}, ["y"], opset=20))
        (grad,) = _run(training, {"x": x, "y_grad": dy}, ["x_grad"])
        t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        torch.nn.functional.gelu(t, approximate=approximate).backward(torch.tensor(dy, dtype=torch.float64))
        np.testing.assert_allclose(grad, t.grad.numpy(), rtol=1e-5, atol=1e-6)


_GELU_CONSTANTS = {"sqrt2": np.sqrt(2), "one": 1.0, "half": 0.5, "three": 3.0, "c": 0.044715, "k": np.sqrt(2 / np.pi)}


def test_gelu_tanh_decomposition_node_by_node():
    """The chains exporters write before opset 20 need no rule of their own."""
    nodes = [oh.make_node("Pow", ["x", "three"], ["t0"]), oh.make_node("Mul", ["t0", "c"], ["t1"]),
             oh.make_node("Add", ["x", "t1"], ["t2"]), oh.make_node("Mul", ["t2", "k"], ["t3"]),
             oh.make_node("Tanh", ["t3"], ["t4"]), oh.make_node("Add", ["t4", "one"], ["t5"]),
             oh.make_node("Mul", ["x", "t5"], ["t6"]), _node("Mul", ["t6", "half"])]
    consts = {n: np.float32(v) for n, v in _GELU_CONSTANTS.items() if n in ("three", "c", "k", "one", "half")}
    _check(model(nodes, {"x": (3, 4)}, ["y"], consts))


def test_gelu_erf_decomposition_node_by_node():
    nodes = [oh.make_node("Div", ["x", "sqrt2"], ["e0"]), oh.make_node("Erf", ["e0"], ["e1"]),
             oh.make_node("Add", ["e1", "one"], ["e2"]), oh.make_node("Mul", ["x", "e2"], ["e3"]),
             _node("Mul", ["e3", "half"])]
    consts = {n: np.float32(v) for n, v in _GELU_CONSTANTS.items() if n in ("sqrt2", "one", "half")}
    training = build_training_graph(model(nodes, {"x": (4, 6)}, ["y"], consts))
    x = np.linspace(-4, 4, 24, dtype=np.float32).reshape(4, 6)
    dy = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    (grad,) = _run(training, {"x": x, "y_grad": dy}, ["x_grad"])
    np.testing.assert_allclose(grad, dy * _gelu_erf_derivative(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["dynamo", "torchscript"])
def test_gelu_erf_chain_differentiated_as_one(form):
    """The exporters' written-out erf GELU (constants as Constant nodes, as exported) takes
    the short backward of graphs/patterns/gelu_erf_chain.py (with onnxscript): no Erf, Div or Neg in it; the
    gradient is GELU's float64 derivative (not finite differences: the checker's float64 Erf
    is an approximation)."""
    def constant(name, value):
        return oh.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.asarray(value, np.float32)))

    nodes = [constant("sqrt2", np.sqrt(2)), constant("one", 1.0), constant("half", 0.5),
             oh.make_node("Div", ["x", "sqrt2"], ["e0"]), oh.make_node("Erf", ["e0"], ["e1"]),
             oh.make_node("Add", ["one", "e1"], ["e2"])]
    if form == "dynamo":
        nodes += [oh.make_node("Mul", ["half", "e2"], ["e3"]), _node("Mul", ["x", "e3"])]
    else:
        nodes += [oh.make_node("Mul", ["e2", "x"], ["e3"]), _node("Mul", ["e3", "half"])]
    forward = model(nodes, {"x": (4, 6)}, ["y"])
    training = build_training_graph(forward)
    backward = [n.op_type for n in training.model.graph.node[len(nodes):]]
    if _declarative.AVAILABLE:  # the patterns need onnxscript's rewriter; without it, node by node
        assert not {"Erf", "Div", "Neg", "Sum"} & set(backward), backward
    x = np.linspace(-6, 6, 24, dtype=np.float32).reshape(4, 6)
    dy = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    (grad,) = _run(training, {"x": x, "y_grad": dy}, ["x_grad"])
    np.testing.assert_allclose(grad, dy * _gelu_erf_derivative(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("orders", [("x", "e3", "half", "e2"), ("e3", "x", "e2", "half")])
def test_dynamo_gelu_erf_written_in_the_order_onnxruntime_fuses(tmp_path, orders):
    """The dynamo exporter's x * ((erf(x / sqrt 2) + 1) * 0.5) becomes (x * (erf + 1)) * 0.5:
    the same bits on float32 values up to 2^127 (a product by 0.5 is exact; beyond, x times
    erf + 1 = 2 overflows where the exported product does not), and
    onnxruntime's optimizer turns it into one Gelu kernel, which it does not for the other
    order. (Its gradient: test_gelu_erf_chain_differentiated_as_one.)"""
    from normgrad.graphs import rewrites

    consts = {"sqrt2": np.float32(np.sqrt(2)), "one": np.float32(1.0), "half": np.float32(0.5)}
    nodes = [oh.make_node("Div", ["x", "sqrt2"], ["e0"]), oh.make_node("Erf", ["e0"], ["e1"]),
             oh.make_node("Add", ["one", "e1"], ["e2"]), oh.make_node("Mul", list(orders[2:]), ["e3"]),
             _node("Mul", list(orders[:2]))]
    exported = model(nodes, {"x": (4, 64)}, ["y"], consts)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(exported)
    assert rewrites.gelu_erf_fusable_order(rewritten) == 1
    assert rewrites.gelu_erf_fusable_order(rewritten) == 0  # nothing left in the other order
    x = np.concatenate([np.linspace(-12, 12, 128), np.geomspace(1e-30, 1.7e38, 64), -np.geomspace(1e-30, 1.7e38, 64)])
    x = x.astype(np.float32).reshape(4, 64)
    fused, values = {}, {}
    for tag, graph in (("exported", exported), ("rewritten", rewritten)):
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(tmp_path / f"{tag}.onnx")
        ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])
        fused[tag] = {n.op_type for n in onnx.load(tmp_path / f"{tag}.onnx").graph.node}
        values[tag + " fused"] = ort.InferenceSession(graph.SerializeToString(), options,
                                                      providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        plain = ort.SessionOptions()
        plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        values[tag] = ort.InferenceSession(graph.SerializeToString(), plain,
                                           providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert fused["rewritten"] == {"Gelu"} and "Gelu" not in fused["exported"]
    np.testing.assert_array_equal(values["rewritten"], values["exported"])
    np.testing.assert_allclose(values["rewritten fused"], values["exported"], rtol=1e-5, atol=1e-30)  # its own erf
