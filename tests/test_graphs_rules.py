"""Each gradient rule alone against float64 central finite differences."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from normgrad.graphs import UnsupportedOperatorError, build_training_graph

from _graph_models import batch_norm_parameters, model, run_training, weights
from _rule_checks import _check, _node


UNARY = ["Relu", "Sigmoid", "Tanh", "Exp", "Neg", "Abs", "Softplus", "Identity"]


@pytest.mark.parametrize("op_type", UNARY)
def test_unary(op_type):
    _check(model([_node(op_type, ["x"])], {"x": (3, 4)}, ["y"]))


def test_erf():
    """Against the closed form: onnx's reference Erf is an approximation without scipy."""
    import math

    import onnxruntime as ort

    training, _ = build_training_graph(model([_node("Erf", ["x"])], {"x": (3, 4)}, ["y"]))
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    dy = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    session = ort.InferenceSession(training.SerializeToString())
    _, grad = session.run(None, {"x": x, "y_grad": dy})
    np.testing.assert_allclose(grad, dy * 2 / math.sqrt(math.pi) * np.exp(-x.astype(np.float64) ** 2), rtol=1e-5)


@pytest.mark.parametrize(
    "op_type, attrs",
    [("LeakyRelu", {"alpha": 0.2}), ("Elu", {"alpha": 0.7}), ("HardSigmoid", {}), ("HardSwish", {}),
     ("Softmax", {"axis": 1}), ("LogSoftmax", {"axis": -1}), ("Softmax", {"axis": 0})],
)
def test_activation_with_attributes(op_type, attrs):
    _check(model([_node(op_type, ["x"], **attrs)], {"x": (3, 4, 2)}, ["y"]))


@pytest.mark.parametrize("op_type", ["Log", "Sqrt", "Reciprocal"])
def test_unary_positive_domain(op_type):
    nodes = [oh.make_node("Exp", ["x"], ["e"]), oh.make_node(op_type, ["e"], ["y"])]
    _check(model(nodes, {"x": (3, 4)}, ["y"]))


@pytest.mark.parametrize("inputs", [["x", "lo", "hi"], ["x", "lo"], ["x", "", "hi"]])
def test_clip(inputs):
    """x, min and max, each bound trainable, against finite differences; frozen bounds get none."""
    params = {name: value for name, value in (("lo", np.float32(-0.5)), ("hi", np.float32(0.7))) if name in inputs}
    forward = model([_node("Clip", inputs)], {"x": (4, 5)}, ["y"], {k: np.array(v) for k, v in params.items()})
    training, _ = build_training_graph(forward)
    assert [o.name for o in training.graph.output] == ["y", "x_grad"] + [f"{name}_grad" for name in params]
    _check(forward)
    training, _ = build_training_graph(forward, frozen=list(params))
    assert [o.name for o in training.graph.output] == ["y", "x_grad"]


@pytest.mark.parametrize("lo, hi", [(-0.5, 0.5), (0.5, -0.5), (0.5, 0.5)], ids=["ordered", "min-above-max", "equal"])
def test_clip_matches_torch_clamp_with_tensor_bounds(lo, hi):
    """torch.clamp(x, min_tensor, max_tensor) autograd, ties at the bounds included (x == min or
    max goes to x) and min > max (every element is max: max gets the gradient)."""
    torch = pytest.importorskip("torch")
    x = np.array([[-1.0, -0.5, -0.25, 0.0], [0.25, 0.5, 1.0, 0.5]], np.float32)
    dy = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    forward = model([_node("Clip", ["x", "lo", "hi"])], {"x": x.shape}, ["y"],
                    {"lo": np.array(lo, np.float32), "hi": np.array(hi, np.float32)})
    results = run_training(build_training_graph(forward), {"x": x, "y_grad": dy})
    xt, lot, hit = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (x, lo, hi))
    yt = torch.clamp(xt, lot, hit)
    yt.backward(torch.tensor(dy, dtype=torch.float64))
    np.testing.assert_allclose(results["y"], yt.detach().numpy(), rtol=1e-6)
    for name, tensor in (("x", xt), ("lo", lot), ("hi", hit)):
        np.testing.assert_allclose(results[f"{name}_grad"], tensor.grad.numpy(), rtol=1e-6, atol=1e-6, err_msg=name)


def test_clip_with_constant_bounds_matches_torch_clamp():
    """ReLU6's Clip (constant bounds 0 and 6): x's gradient where the output equals x, as
    torch.clamp(x, 0, 6) gives it, the ties x == 0 and x == 6 included; NaN passes none."""
    torch = pytest.importorskip("torch")
    x = np.array([[-1.0, 0.0, 0.5, 3.0], [5.5, 6.0, 7.0, np.nan]], np.float32)
    dy = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    forward = model([_node("Clip", ["x", "lo", "hi"])], {"x": x.shape}, ["y"],
                    {"lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32)})
    training = build_training_graph(forward, frozen=["lo", "hi"])
    assert "Equal" in {n.op_type for n in training.model.graph.node}
    results = run_training(training, {"x": x, "y_grad": dy})
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    torch.clamp(xt, 0.0, 6.0).backward(torch.tensor(dy, dtype=torch.float64))
    expected = np.nan_to_num(xt.grad.numpy(), nan=0.0)
    np.testing.assert_array_equal(results["x_grad"], expected.astype(np.float32))


@pytest.mark.parametrize("op_type", ["Add", "Sub", "Mul", "Div", "Pow"])
@pytest.mark.parametrize("shape_a, shape_b", [((2, 3, 4), (2, 3, 4)), ((2, 3, 4), (4,)), ((3, 1), (2, 1, 4)), ((1, 3, 1), ())])
def test_broadcasting_binary(op_type, shape_a, shape_b):
    nodes = [_node(op_type, ["a", "b"])]
    if op_type in ("Div", "Pow"):  # keep the divisor / base away from zero
        nodes = [oh.make_node("Exp", ["a"], ["ea"]), oh.make_node("Exp", ["b"], ["eb"]), _node(op_type, ["ea", "eb"])]
    _check(model(nodes, {"a": shape_a, "b": shape_b}, ["y"]))


def test_value_used_twice_sums_gradients():
    nodes = [oh.make_node("Mul", ["x", "x"], ["sq"]), oh.make_node("Add", ["sq", "x"], ["y"])]
    _check(model(nodes, {"x": (3, 4)}, ["y"]))


@pytest.mark.parametrize("trans_a, trans_b, alpha, beta, c_shape", [
    (0, 0, 1.0, 1.0, (5,)), (1, 0, 0.5, 2.0, (3, 5)), (0, 1, 1.5, 0.5, (1, 5)), (1, 1, 1.0, 1.0, (3, 1)),
])
def test_gemm(trans_a, trans_b, alpha, beta, c_shape):
    a_shape = (4, 3) if trans_a else (3, 4)
    b_shape = (5, 4) if trans_b else (4, 5)
    params = weights(0, b=b_shape, c=c_shape)
    node = _node("Gemm", ["a", "b", "c"], transA=trans_a, transB=trans_b, alpha=alpha, beta=beta)
    _check(model([node], {"a": a_shape}, ["y"], params))


@pytest.mark.parametrize("shape_a, shape_b", [
    ((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (3, 4, 2)), ((4,), (2, 4, 3)), ((2, 3, 4), (4,)), ((4,), (4,)),
])
def test_matmul(shape_a, shape_b):
    _check(model([_node("MatMul", ["a", "b"])], {"a": shape_a, "b": shape_b}, ["y"]))


@pytest.mark.parametrize("attrs, w_shape, x_shape", [
    ({}, (4, 3, 3, 3), (2, 3, 6, 6)),
    ({"pads": [1, 1, 1, 1], "strides": [2, 2]}, (4, 3, 3, 3), (2, 3, 7, 6)),
    ({"dilations": [2, 1], "pads": [2, 0, 1, 1]}, (2, 3, 3, 2), (1, 3, 7, 5)),
    ({"group": 2, "strides": [2, 1]}, (4, 2, 3, 3), (2, 4, 6, 5)),
    ({"group": 3, "pads": [1, 1, 1, 1]}, (3, 1, 3, 3), (2, 3, 5, 5)),  # depthwise
    ({"auto_pad": "SAME_UPPER", "strides": [2, 2]}, (2, 3, 3, 3), (1, 3, 6, 7)),
    ({"auto_pad": "SAME_LOWER"}, (2, 3, 2, 2), (1, 3, 5, 5)),
    ({"auto_pad": "VALID", "strides": [3, 3]}, (2, 3, 2, 2), (1, 3, 8, 7)),
    ({"strides": [2]}, (2, 3, 3), (2, 3, 9)),  # 1-D
    ({"pads": [1, 0, 1, 1, 0, 1]}, (2, 1, 2, 2, 2), (1, 1, 3, 4, 3)),  # 3-D
])
def test_conv(attrs, w_shape, x_shape):
    params = weights(1, w=w_shape, b=(w_shape[0],))
    _check(model([_node("Conv", ["x", "w", "b"], **attrs)], {"x": x_shape}, ["y"], params))


@pytest.mark.parametrize("op_type, attrs", [
    ("AveragePool", {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ("AveragePool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
    ("AveragePool", {"kernel_shape": [3, 2], "pads": [1, 0, 1, 1], "strides": [2, 1]}),
    ("MaxPool", {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]}),
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    ("GlobalAveragePool", {}),
])
def test_pool(op_type, attrs):
    _check(model([_node(op_type, ["x"], **attrs)], {"x": (2, 3, 6, 5)}, ["y"]))


@pytest.mark.parametrize("op_type, axes, keepdims", [
    ("ReduceSum", [1], 1), ("ReduceSum", [0, 2], 0), ("ReduceSum", None, 0),
    ("ReduceMean", [-1], 0), ("ReduceMean", [1, 2], 1), ("ReduceMean", None, 1),
])
@pytest.mark.parametrize("opset", [17, 18])
def test_reduce(op_type, axes, keepdims, opset):
    inputs, params, attrs = ["x"], {}, {"keepdims": keepdims}
    if axes is not None and (op_type == "ReduceSum" or opset >= 18):
        inputs.append("axes")
        params["axes"] = np.array(axes, np.int64)
    elif axes is not None:
        attrs["axes"] = axes
    _check(model([_node(op_type, inputs, **attrs)], {"x": (2, 3, 4)}, ["y"], params, opset=opset))


def test_shape_ops():
    params = {"shape": np.array([4, -1], np.int64), "axes": np.array([0], np.int64)}
    nodes = [
        oh.make_node("Reshape", ["x", "shape"], ["r"]),
        oh.make_node("Transpose", ["r"], ["t"], perm=[1, 0]),
        oh.make_node("Unsqueeze", ["t", "axes"], ["u"]),
        oh.make_node("Flatten", ["u"], ["f"], axis=1),
        oh.make_node("Squeeze", ["f", "axes"], ["s"]),
        oh.make_node("Transpose", ["s"], ["y"]),
    ]
    _check(model(nodes, {"x": (2, 3, 4)}, ["y"], params))


def test_concat_and_expand():
    params = {"shape": np.array([2, 3, 4], np.int64)}
    nodes = [
        oh.make_node("Expand", ["b", "shape"], ["e"]),
        oh.make_node("Concat", ["a", "e", "a"], ["y"], axis=-1),
    ]
    _check(model(nodes, {"a": (2, 3, 2), "b": (3, 1)}, ["y"], params))


def test_non_differentiable_shape_path():
    """Reshape's shape computed from Shape/Gather/Concat carries no gradient."""
    params = {"idx": np.array([0], np.int64), "minus_one": np.array([-1], np.int64)}
    nodes = [
        oh.make_node("Shape", ["x"], ["shp"]),
        oh.make_node("Gather", ["shp", "idx"], ["n"]),
        oh.make_node("Concat", ["n", "minus_one"], ["target"], axis=0),
        oh.make_node("Reshape", ["x", "target"], ["r"]),
        oh.make_node("Cast", ["r"], ["y"], to=onnx.TensorProto.FLOAT),
    ]
    _check(model(nodes, {"x": (2, 3, 4)}, ["y"], params))


def test_unused_float_input_gets_zero_gradient():
    forward = model([_node("Relu", ["x"])], {"x": (2, 3), "unused": (4,)}, ["y"])
    training, _ = build_training_graph(forward)
    assert "unused_grad" in [o.name for o in training.graph.output]
    _check(forward)


@pytest.mark.parametrize("training_mode", [0, 1])
@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 5), (2, 3, 4, 4)])
def test_batch_norm(training_mode, shape):
    channels = shape[1]
    params = batch_norm_parameters(channels, seed=0)
    outputs = ["y", "running_mean", "running_var"] if training_mode else ["y"]
    nodes = [oh.make_node("BatchNormalization", ["x", "s", "t", "m", "v"], outputs, training_mode=training_mode, epsilon=1e-3)]
    forward = model(nodes, {"x": shape}, ["y"], params, opset=15)
    training, _ = build_training_graph(forward)
    names = {o.name for o in training.graph.output}
    assert {"x_grad", "s_grad", "t_grad"} <= names and not {"m_grad", "v_grad"} & names
    _check(forward)


@pytest.mark.parametrize("opset", [9, 14])
def test_batch_norm_older_opsets(opset):
    rng = np.random.default_rng(0)
    params = {"s": rng.uniform(0.5, 1.5, 3).astype(np.float32), "t": np.zeros(3, np.float32),
              "m": np.zeros(3, np.float32), "v": np.ones(3, np.float32)}
    attrs = {"training_mode": 1} if opset >= 14 else {}
    outputs = ["y", "running_mean", "running_var"] + ([] if opset >= 14 else ["saved_mean", "saved_var"])
    nodes = [oh.make_node("BatchNormalization", ["x", "s", "t", "m", "v"], outputs, **attrs)]
    forward = model(nodes, {"x": (4, 3, 2)}, ["y"], params, opset=opset)
    training, _ = build_training_graph(forward)
    assert training.opset_import[0].version >= 15
    _check(forward)


@pytest.mark.parametrize("opset, groups", [(18, 2), (21, 2), (21, 4), (21, 1)])
def test_group_norm(opset, groups):
    channels = 4
    scale_len = channels if opset >= 21 else groups
    rng = np.random.default_rng(1)
    params = {"g": rng.uniform(0.5, 1.5, scale_len).astype(np.float32), "b": rng.standard_normal(scale_len).astype(np.float32)}
    node = _node("GroupNormalization", ["x", "g", "b"], num_groups=groups, epsilon=1e-4)
    _check(model([node], {"x": (2, channels, 3, 3)}, ["y"], params, opset=opset))


@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 4, 4), (1, 2, 2, 3, 2)])
def test_instance_norm(shape):
    rng = np.random.default_rng(2)
    params = {"g": rng.uniform(0.5, 1.5, shape[1]).astype(np.float32), "b": rng.standard_normal(shape[1]).astype(np.float32)}
    _check(model([_node("InstanceNormalization", ["x", "g", "b"])], {"x": shape}, ["y"], params))


def test_unsupported_operator_is_named():
    forward = model([oh.make_node("Softsign", ["x"], ["g"], name="scan"), _node("Relu", ["g"])], {"x": (3, 4)}, ["y"])
    with pytest.raises(UnsupportedOperatorError, match="operator Softsign \\(Softsign node 'scan'\\); a gradient must flow through it"):
        build_training_graph(forward)


def test_every_unsupported_operator_is_named_at_once():
    """Op type, count and first node of each, in graph order, in one error."""
    nodes = [
        oh.make_node("Softsign", ["x"], ["c1"], name="scan1"),
        oh.make_node("Trilu", ["c1"], ["t"], name="lower"),
        oh.make_node("Softsign", ["t"], ["c2"], name="scan2"),
        oh.make_node("Softsign", ["x"], ["off_path"], name="scan3"),
        _node("Relu", ["c2"]),
    ]
    forward = model(nodes, {"x": (3, 4)}, ["y"])
    expected = ("operators Softsign \\(2 nodes, first Softsign node 'scan1'\\), Trilu \\(Trilu node 'lower'\\); "
                "a gradient must flow through each of them")
    with pytest.raises(UnsupportedOperatorError, match=expected):
        build_training_graph(forward)


def test_unsupported_operator_off_the_gradient_path_is_fine():
    nodes = [oh.make_node("Softsign", ["x"], ["g"]), oh.make_node("Relu", ["x"], ["y"])]
    forward = model(nodes, {"x": (3, 4)}, ["y", "g"])
    forward.graph.output.pop()  # g is not an output: dead end
    _check(forward)


def test_broadcasting_with_symbolic_dims():
    """Broadcast axes that only the run time decides."""
    _check(model([_node("Mul", ["a", "b"])], {"a": ("N", "C", 4), "b": ("P", 1)}, ["y"]))


def test_initializer_shadowed_by_an_input_is_not_a_constant():
    """IR < 4 style: an initializer also listed as a graph input is only a default; the
    gradient must follow the axes fed at run time, not the stored ones."""
    import onnxruntime as ort

    forward = model([_node("ReduceSum", ["x", "axes"], keepdims=0)], {"x": (2, 3, 3)}, ["y"],
                    {"axes": np.array([1], np.int64)})
    forward.graph.input.append(oh.make_tensor_value_info("axes", onnx.TensorProto.INT64, [1]))
    training, initial = build_training_graph(forward)
    session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((2, 3, 3)).astype(np.float32)
    dy = np.arange(6, dtype=np.float32).reshape(2, 3)
    (grad,) = session.run(["x_grad"], {**initial, "x": x, "axes": np.array([2], np.int64), "y_grad": dy})
    np.testing.assert_array_equal(grad, np.broadcast_to(dy[:, :, None], (2, 3, 3)))


def test_pow_exponent_of_another_float_type():
    params = {"b": np.array([1.5, 2.0, 0.5], np.float64)}
    nodes = [oh.make_node("Exp", ["a"], ["ea"]), _node("Pow", ["ea", "b"])]
    _check(model(nodes, {"a": (2, 3)}, ["y"], params))


def test_max_pool_same_padding_with_dilations_is_refused():
    """onnxruntime drops the auto padding from Y once the Indices output is requested."""
    node = oh.make_node("MaxPool", ["x"], ["y"], name="pool", kernel_shape=[2, 2], auto_pad="SAME_UPPER",
                        strides=[2, 2], dilations=[2, 2])
    with pytest.raises(UnsupportedOperatorError, match="MaxPool node 'pool'.*dilations"):
        build_training_graph(model([node], {"x": (1, 1, 7, 6)}, ["y"]))


@pytest.mark.parametrize("opset, attrs, outputs", [
    (7, {"spatial": 0}, ["y"]),
    (7, {"spatial": 0}, ["y", "rm", "rv", "sm", "sv"]),
    (6, {"is_test": 0}, ["y", "rm", "rv", "sm", "sv"]),
])
def test_batch_norm_variants_without_opset_9_equivalent_are_refused(opset, attrs, outputs):
    params = {name: np.ones((3, 2), np.float32) for name in "stmv"}
    node = oh.make_node("BatchNormalization", ["x", "s", "t", "m", "v"], outputs, name="bn", **attrs)
    with pytest.raises(UnsupportedOperatorError, match=f"BatchNormalization node 'bn'.*{next(iter(attrs))}=0"):
        build_training_graph(model([node], {"x": (4, 3, 2)}, ["y"], params, opset=opset))


def test_output_that_is_an_input_keeps_the_gradient_name():
    """``x_grad`` is the gradient of input x even when x is also an output (its seed is renamed)."""
    forward = model([_node("Relu", ["x"])], {"x": (2, 3)}, ["y"])
    forward.graph.output.append(oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3]))
    training, _ = build_training_graph(forward)
    gradients = json.loads(next(p.value for p in training.metadata_props if p.key == "normgrad.gradients"))
    assert gradients == {"x_grad": "x"}
    assert "x_grad" not in [i.name for i in training.graph.input]
    _check(forward)


def test_unknown_domain_operator_on_the_gradient_path_is_named():
    graph = oh.make_graph(
        [oh.make_node("Warp", ["x"], ["w"], name="warp", domain="my.ops"), _node("Relu", ["w"])], "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
    )
    forward = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid("my.ops", 1)])
    with pytest.raises(UnsupportedOperatorError, match="Warp of domain 'my.ops' \\(Warp node 'warp'\\)"):
        build_training_graph(forward)


def test_trainable_parameter_at_an_input_the_rule_does_not_differentiate_is_refused():
    """w trains through the Mul and reaches Pad's constant_value, which Pad's rule gives no
    gradient: refused by name, not a silent zero; frozen, w builds."""
    nodes = [oh.make_node("Mul", ["x", "w"], ["xw"]), oh.make_node("ReduceMean", ["w"], ["fill"], keepdims=0),
             oh.make_node("Pad", ["xw", "pads", "fill"], ["y"], name="pad")]
    forward = model(nodes, {"x": (2, 3)}, ["y"], {"w": np.full((2, 3), 0.5, np.float32), "pads": np.array([0, 1, 0, 1])})
    with pytest.raises(UnsupportedOperatorError,
                       match="Pad node 'pad': input 2 \\('fill'\\) is computed from trainable parameter 'w', but the Pad rule"):
        build_training_graph(forward)
    assert [o.name for o in build_training_graph(forward, frozen=["w"]).model.graph.output] == ["y", "x_grad"]


def test_trainable_parameter_itself_at_an_input_the_rule_does_not_differentiate_is_not_refused():
    """TorchScript merges equal initializers: an eval-mode BatchNorm's running mean may be its
    bias's initializer (or an Identity of it); builds, as torch_exports warns of the merge."""
    nodes = [oh.make_node("Identity", ["t"], ["m"]), _node("BatchNormalization", ["x", "s", "t", "m", "v"])]
    params = {name: value for name, value in batch_norm_parameters(3).items() if name != "m"}
    forward = model(nodes, {"x": (2, 3, 4, 4)}, ["y"], params)
    assert {o.name for o in build_training_graph(forward).model.graph.output} >= {"s_grad", "t_grad"}


def test_trainable_parameter_at_integer_or_non_differentiable_inputs_is_not_refused():
    """w's shape (a Reshape's shape input), its sign test (a Where's condition) and x * w as the
    type CastLike reads (dynamo's slice assignment writes one) carry no gradient by nature."""
    nodes = [oh.make_node("Mul", ["x", "w"], ["xw"]), oh.make_node("Shape", ["w"], ["shape"]),
             oh.make_node("Reshape", ["xw", "shape"], ["r"]), oh.make_node("Greater", ["w", "zero"], ["positive"]),
             oh.make_node("CastLike", ["x", "xw"], ["x_like"]), oh.make_node("Where", ["positive", "r", "x_like"], ["y"])]
    params = {"w": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), "zero": np.array(0.0, np.float32)}
    forward = model(nodes, {"x": (2, 3)}, ["y"], params)
    _check(forward, frozen=["zero"])


def test_model_without_default_opset_is_refused():
    forward = model([_node("Relu", ["x"])], {"x": (2, 3)}, ["y"])
    forward.opset_import[0].domain = "com.example"
    with pytest.raises(ValueError, match="no default-domain opset"):
        build_training_graph(forward)


def test_max_pool_with_dynamic_spatial_dims():
    """The seed's shape is known only at run time; the checker feeds it that shape."""
    node = _node("MaxPool", ["x"], kernel_shape=[2, 2], strides=[2, 2])
    _check(model([node], {"x": ("N", 3, "H", "W")}, ["y"]))


@pytest.mark.parametrize("op_type", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("attrs", [{}, {"axis": 0}, {"axis": 1}, {"axis": -1}])
def test_softmax_before_opset_13_coerces_to_2d(op_type, attrs):
    """Opset < 13 normalizes over all axes from ``axis`` on (default 1): the version
    converter rewrites that into opset-13 semantics before differentiation."""
    _check(model([_node(op_type, ["x"], **attrs)], {"x": (2, 3, 4)}, ["y"], opset=11))
