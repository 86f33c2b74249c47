"""onnxruntime's fused ``com.microsoft`` normalizations and activations (graphs/rules/contrib_norm.py,
contrib_activations.py, embed_layer_norm.py): each op's gradients against float64 central finite
differences of a NumPy reference of the op, and against the training graph of the same computation
written in standard ONNX ops (the unfused graph)."""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Sequence

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest

from normgrad.graphs import UnsupportedOperatorError, build_training_graph
from normgrad.ops.activation_grad import TANH_GELU_CUBIC

MS = "com.microsoft"
Reference = Callable[[Dict[str, np.ndarray]], Dict[str, np.ndarray]]


# ------------------------------------------------------------------------- harness
def _model(nodes: Sequence[onnx.NodeProto], feeds: Dict[str, np.ndarray], outputs: Sequence[str],
           opset: int = 17) -> onnx.ModelProto:
    """Every feed a graph input (the float ones differentiated), ``outputs`` the graph's."""
    inputs = [oh.make_tensor_value_info(name, oh.np_dtype_to_tensor_dtype(value.dtype), value.shape)
              for name, value in feeds.items()]
    graph = oh.make_graph(list(nodes), "contrib", inputs, [oh.make_empty_tensor_value_info(name) for name in outputs])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset), oh.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {k: v for k, v in feeds.items() if k in names})))


def _seeds(outputs: Dict[str, np.ndarray], seed: int = 7) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"{name}_grad": rng.standard_normal(value.shape).astype(np.float32) for name, value in outputs.items()}


def _gradients(forward: onnx.ModelProto, feeds: Dict[str, np.ndarray], seeds: Dict[str, np.ndarray],
               rewrite: Callable[[onnx.ModelProto], None] = lambda model: None) -> Dict[str, np.ndarray]:
    """{input: its gradient} from ``forward``'s training graph (``rewrite``: applied to it before the run)."""
    training = build_training_graph(forward)
    rewrite(training.model)
    values = _run(training.model, {**training.feeds(feeds), **seeds})
    return {name[: -len("_grad")]: value for name, value in values.items() if name.endswith("_grad")}


def _check_finite_differences(reference: Reference, feeds: Dict[str, np.ndarray], seeds: Dict[str, np.ndarray],
                              grads: Dict[str, np.ndarray], directions: int = 2) -> None:
    """<grad, v> against the float64 central difference of sum(reference(feeds) * seeds) along random v."""
    as64 = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()}

    def scalar(values):
        outputs = reference(values)
        return sum(float(np.sum(outputs[name[: -len("_grad")]] * seed)) for name, seed in seeds.items())

    rng = np.random.default_rng(3)
    assert grads, "no gradient outputs"
    for name, grad in grads.items():
        for _ in range(directions):
            v = rng.standard_normal(grad.shape)
            h = 1e-6 * max(1.0, float(np.sqrt(np.mean(as64[name] ** 2))))
            plus, minus = dict(as64), dict(as64)
            plus[name], minus[name] = as64[name] + h * v, as64[name] - h * v
            numeric = (scalar(plus) - scalar(minus)) / (2 * h)
            analytic = float(np.sum(grad.astype(np.float64) * v))
            scale = abs(numeric) + float(np.linalg.norm(grad)) * float(np.linalg.norm(v)) / math.sqrt(grad.size)
            assert abs(analytic - numeric) <= 1e-4 * scale, (name, analytic, numeric)


def _check(fused: onnx.ModelProto, unfused: onnx.ModelProto, reference: Reference, feeds: Dict[str, np.ndarray],
           rewrite: Callable[[onnx.ModelProto], None] = lambda model: None) -> Dict[str, np.ndarray]:
    """The fused model's gradients against finite differences of ``reference`` and against the
    unfused model's gradients (1e-5 of each gradient's scale); its outputs against the reference's."""
    outputs = reference({k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()})
    seeds = _seeds(outputs)
    grads = _gradients(fused, feeds, seeds, rewrite)
    expected = _gradients(unfused, feeds, seeds)
    assert sorted(grads) == sorted(expected)
    for name, grad in grads.items():
        scale = max(1.0, float(np.abs(expected[name]).max()))
        np.testing.assert_allclose(grad, expected[name], rtol=0, atol=1e-5 * scale, err_msg=name)
    _check_finite_differences(reference, feeds, seeds, grads)
    return outputs


def _floats(seed: int, **shapes: Sequence[int]) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _layer_norm(s, gamma, beta, epsilon):
    centred = s - s.mean(-1, keepdims=True)
    y = centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + epsilon) * gamma
    return y if beta is None else y + beta


def _rms_norm(s, gamma, epsilon, axis=-1):
    axes = tuple(range(axis % s.ndim, s.ndim))
    return s / np.sqrt((s * s).mean(axes, keepdims=True) + epsilon) * gamma


def _constant(name: str, value) -> onnx.NodeProto:
    return oh.make_node("Constant", [], [name], value=onh.from_array(np.asarray(value), name))


def _rms_nodes(s: str, gamma: str, y: str, epsilon: float, axes: Sequence[int]) -> List[onnx.NodeProto]:
    """RMSNorm of ``s`` over ``axes`` in standard ops (opset 17)."""
    return [oh.make_node("Mul", [s, s], [f"{y}/sq"]), oh.make_node("ReduceMean", [f"{y}/sq"], [f"{y}/ms"], axes=list(axes)),
            _constant(f"{y}/eps", np.float32(epsilon)), oh.make_node("Add", [f"{y}/ms", f"{y}/eps"], [f"{y}/var"]),
            oh.make_node("Sqrt", [f"{y}/var"], [f"{y}/rms"]), oh.make_node("Div", [s, f"{y}/rms"], [f"{y}/n"]),
            oh.make_node("Mul", [f"{y}/n", gamma], [y])]


def _sum_nodes(names: Sequence[str], out: str) -> List[onnx.NodeProto]:
    nodes, total = [], names[0]
    for i, name in enumerate(names[1:]):
        target = out if i == len(names) - 2 else f"{out}/{i}"
        nodes.append(oh.make_node("Add", [total, name], [target]))
        total = target
    return nodes


# ------------------------------------------------------------------ Skip*LayerNormalization
@pytest.mark.parametrize("skip_shape", [(2, 3, 5), (3, 5), (1, 3, 5)])
@pytest.mark.parametrize("beta, bias", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("sum_used", [False, True])
def test_skip_layer_normalization(skip_shape, beta, bias, sum_used):
    epsilon = 1e-3
    feeds = _floats(0, x=(2, 3, 5), skip=skip_shape, gamma=(5,), **({"beta": (5,)} if beta else {}),
                    **({"bias": (5,)} if bias else {}))
    fused_inputs = ["x", "skip", "gamma", "beta" if beta else "", "bias" if bias else ""]
    while not fused_inputs[-1]:
        fused_inputs.pop()
    outputs = ["y", "s"] if sum_used else ["y"]
    fused = oh.make_node("SkipLayerNormalization", fused_inputs, ["y", "mean", "inv_std_var", "s" if sum_used else ""],
                         domain=MS, epsilon=epsilon)
    unfused = _sum_nodes(["x", "skip"] + (["bias"] if bias else []), "s") + [
        oh.make_node("LayerNormalization", ["s", "gamma"] + (["beta"] if beta else []), ["y"], axis=-1, epsilon=epsilon)]

    def reference(f):
        s = f["x"] + f["skip"] + (f["bias"] if bias else 0)
        return {"y": _layer_norm(s, f["gamma"], f.get("beta"), epsilon), **({"s": s} if sum_used else {})}

    expected = _check(_model([fused], feeds, outputs), _model(unfused, feeds, outputs), reference, feeds)
    np.testing.assert_allclose(_run(_model([fused], feeds, outputs), feeds)["y"], expected["y"], atol=1e-5)


def test_skip_layer_normalization_float16():
    """A float16 model (statistics in float32): its gradients are the float32 unfused graph's
    on the same values, to float16 rounding."""
    feeds = {k: v.astype(np.float16) for k, v in _floats(3, x=(2, 3, 8), skip=(2, 3, 8), gamma=(8,), beta=(8,)).items()}
    seeds = {"y_grad": np.random.default_rng(4).standard_normal((2, 3, 8)).astype(np.float16)}
    fused = oh.make_node("SkipLayerNormalization", ["x", "skip", "gamma", "beta"], ["y"], domain=MS, epsilon=1e-5)
    unfused = _sum_nodes(["x", "skip"], "s") + [oh.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], epsilon=1e-5)]
    grads = _gradients(_model([fused], feeds, ["y"]), feeds, seeds)
    as32 = {k: v.astype(np.float32) for k, v in {**feeds, **seeds}.items()}
    expected = _gradients(_model(unfused, {k: as32[k] for k in feeds}, ["y"]), {k: as32[k] for k in feeds},
                          {"y_grad": as32["y_grad"]})
    for name, grad in grads.items():
        assert grad.dtype == np.float16
        scale = float(np.abs(expected[name]).max())
        np.testing.assert_allclose(grad.astype(np.float32), expected[name], rtol=0, atol=4e-3 * scale, err_msg=name)


def test_skip_layer_normalization_default_epsilon_is_onnxruntimes():
    """Rows of tiny variance: the gradient uses the schema's 1e-12 as onnxruntime's forward does."""
    feeds = {"x": (np.arange(16, dtype=np.float32).reshape(2, 8) * 1e-3), "skip": np.zeros((2, 8), np.float32),
             "gamma": np.linspace(0.5, 1.5, 8, dtype=np.float32)}
    fused = oh.make_node("SkipLayerNormalization", ["x", "skip", "gamma"], ["y"], domain=MS)
    unfused = _sum_nodes(["x", "skip"], "s") + [oh.make_node("LayerNormalization", ["s", "gamma"], ["y"], epsilon=1e-12)]
    expected = _check(_model([fused], feeds, ["y"]), _model(unfused, feeds, ["y"]),
                      lambda f: {"y": _layer_norm(f["x"] + f["skip"], f["gamma"], None, 1e-12)}, feeds)
    np.testing.assert_allclose(_run(_model([fused], feeds, ["y"]), feeds)["y"], expected["y"], atol=1e-4)


@pytest.mark.parametrize("skip_shape", [(2, 3, 6), (3, 6)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("sum_used", [False, True])
def test_skip_simplified_layer_normalization(skip_shape, bias, sum_used):
    """The gradient is the running onnxruntime's derivative: where its kernel ignores the bias
    (1.19.2: y and the sum are RMSNorm(x + skip) and x + skip), the bias's gradient is zero."""
    epsilon = 1e-5
    feeds = _floats(1, x=(2, 3, 6), skip=skip_shape, gamma=(6,), **({"bias": (6,)} if bias else {}))
    outputs = ["y", "s"] if sum_used else ["y"]
    fused = oh.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"] + (["bias"] if bias else []),
                         ["y", "", "inv_std_var", "s" if sum_used else ""], domain=MS, epsilon=epsilon)
    added = bias and _kernel_adds_the_bias(_run(_model([fused], feeds, outputs), feeds)["y"], feeds, epsilon)
    # an ignored bias reaches the unfused sum times zero: it is an input there too, with a zero gradient
    ignored = [_constant("zero", np.float32(0)), oh.make_node("Mul", ["bias", "zero"], ["ignored"])]
    unfused = ((ignored if bias and not added else []) + _sum_nodes(["x", "skip"] + (["bias" if added else "ignored"] if bias else []), "s")
               + _rms_nodes("s", "gamma", "y", epsilon, [-1]))

    def reference(f):
        s = f["x"] + f["skip"] + (f["bias"] if added else 0)
        return {"y": _rms_norm(s, f["gamma"], epsilon), **({"s": s} if sum_used else {})}

    expected = _check(_model([fused], feeds, outputs), _model(unfused, feeds, outputs), reference, feeds)
    np.testing.assert_allclose(_run(_model([fused], feeds, outputs), feeds)["y"], expected["y"], atol=1e-5)
    if bias and not added:
        seeds = _seeds({name: value.astype(np.float32) for name, value in expected.items()})
        assert not _gradients(_model([fused], feeds, outputs), feeds, seeds)["bias"].any()


def _kernel_adds_the_bias(y: np.ndarray, feeds: Dict[str, np.ndarray], epsilon: float) -> bool:
    """Whether the running onnxruntime's CPU SkipSimplifiedLayerNormalization gave ``y`` with the
    bias added (1.32) or as RMSNorm(x + skip) (1.19.2 reads no bias)."""
    s = feeds["x"].astype(np.float64) + feeds["skip"]
    for added, total in ((True, s + feeds["bias"]), (False, s)):
        if np.allclose(y, _rms_norm(total, feeds["gamma"], epsilon), rtol=0, atol=1e-5):
            return added
    raise AssertionError("the kernel's output is neither RMSNorm(x + skip + bias) nor RMSNorm(x + skip)")


@pytest.mark.parametrize("shape, axis", [((2, 3, 6), -1), ((2, 3, 5), -2), ((4, 7), 1)])
@pytest.mark.parametrize("inv_std_var", [False, True])
def test_simplified_layer_normalization(shape, axis, inv_std_var):
    """The default-domain op onnxruntime defines (onnxruntime-genai's RMSNorm)."""
    epsilon = 1e-6
    rank = len(shape)
    feeds = _floats(2, x=shape, gamma=shape[axis % rank:])
    fused = oh.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["y", "isv" if inv_std_var else ""],
                         axis=axis, epsilon=epsilon, stash_type=1)
    unfused = _rms_nodes("x", "gamma", "y", epsilon, range(axis % rank, rank))
    reference = lambda f: {"y": _rms_norm(f["x"], f["gamma"], epsilon, axis)}  # noqa: E731
    expected = _check(_model([fused], feeds, ["y"]), _model(unfused, feeds, ["y"]), reference, feeds)
    np.testing.assert_allclose(_run(_model([fused], feeds, ["y"]), feeds)["y"], expected["y"], atol=1e-5)


def test_step_and_eval_graphs_type_what_an_onnxruntime_op_computes():
    """onnx's inference cannot type a com.microsoft op's output; the rules' output types carry
    it into the training graph, so the evaluation graph's outputs are typed (its checker refuses
    an untyped output)."""
    from normgrad.graphs import build_step_graph
    from normgrad.graphs.step_graph import build_eval_graph

    feeds = _floats(0, x=(2, 3, 5), skip=(2, 3, 5))
    gamma = onh.from_array(np.linspace(0.5, 1.5, 5).astype(np.float32), "gamma")
    nodes = [oh.make_node("SkipLayerNormalization", ["x", "skip", "gamma"], ["n"], domain=MS),
             oh.make_node("FastGelu", ["n"], ["y"], domain=MS)]
    model = _model(nodes, feeds, ["y"])
    model.graph.initializer.append(gamma)
    training = build_training_graph(model, loss="mse")
    assert {v.name for v in training.model.graph.value_info} >= {"n", "y"}
    step, _ = build_step_graph(training, "adamw")
    (output,) = [o for o in build_eval_graph(step).graph.output if o.name == "y"]
    assert output.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_value for d in output.type.tensor_type.shape.dim] == [2, 3, 5]


def test_gradient_into_a_statistics_output_is_refused_in_one_line():
    feeds = _floats(0, x=(2, 4), skip=(2, 4), gamma=(4,))
    fused = oh.make_node("SkipLayerNormalization", ["x", "skip", "gamma"], ["y", "mean"], domain=MS)
    with pytest.raises(UnsupportedOperatorError, match=r"mean or inv_std_var output") as caught:
        build_training_graph(_model([fused], feeds, ["y", "mean"]))
    assert "\n" not in str(caught.value)


def test_contrib_op_without_rule_is_named_in_one_line():
    feeds = _floats(0, x=(2, 3, 3))
    node = oh.make_node("Inverse", ["x"], ["y"], domain=MS, name="inv")
    model = _model([node], feeds, ["y"])
    model.graph.output[0].CopyFrom(oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3, 3]))
    with pytest.raises(UnsupportedOperatorError) as caught:
        build_training_graph(model)
    message = str(caught.value)
    assert "no gradient rule for operator Inverse of domain 'com.microsoft'" in message and "\n" not in message


# ---------------------------------------------------------------------------- activations
def _gelu_erf_nodes(x: str, y: str) -> List[onnx.NodeProto]:
    return [_constant(f"{y}/r", np.float32(math.sqrt(0.5))), _constant(f"{y}/one", np.float32(1.0)),
            _constant(f"{y}/half", np.float32(0.5)), oh.make_node("Mul", [x, f"{y}/r"], [f"{y}/a"]),
            oh.make_node("Erf", [f"{y}/a"], [f"{y}/e"]), oh.make_node("Add", [f"{y}/e", f"{y}/one"], [f"{y}/c"]),
            oh.make_node("Mul", [x, f"{y}/c"], [f"{y}/m"]), oh.make_node("Mul", [f"{y}/m", f"{y}/half"], [y])]


def _gelu_tanh_nodes(x: str, y: str) -> List[onnx.NodeProto]:
    return [_constant(f"{y}/k", np.float32(math.sqrt(2 / math.pi))), _constant(f"{y}/c", np.float32(TANH_GELU_CUBIC)),
            _constant(f"{y}/one", np.float32(1.0)), _constant(f"{y}/half", np.float32(0.5)),
            oh.make_node("Mul", [x, x], [f"{y}/x2"]), oh.make_node("Mul", [f"{y}/x2", x], [f"{y}/x3"]),
            oh.make_node("Mul", [f"{y}/x3", f"{y}/c"], [f"{y}/cx3"]), oh.make_node("Add", [x, f"{y}/cx3"], [f"{y}/in"]),
            oh.make_node("Mul", [f"{y}/in", f"{y}/k"], [f"{y}/u"]), oh.make_node("Tanh", [f"{y}/u"], [f"{y}/t"]),
            oh.make_node("Add", [f"{y}/t", f"{y}/one"], [f"{y}/p"]), oh.make_node("Mul", [x, f"{y}/p"], [f"{y}/m"]),
            oh.make_node("Mul", [f"{y}/m", f"{y}/half"], [y])]


def _gelu_erf(z):
    return 0.5 * z * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))


def _gelu_tanh(z):
    return 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + TANH_GELU_CUBIC * z ** 3)))


@pytest.mark.parametrize("op_type, bias", [("Gelu", False), ("BiasGelu", True), ("FastGelu", False), ("FastGelu", True)])
@pytest.mark.parametrize("shape", [(2, 3, 5), (7,)])
def test_gelu_family(op_type, bias, shape):
    feeds = _floats(4, x=shape, **({"bias": shape[-1:]} if bias else {}))
    feeds["x"] *= 2
    z = "z" if bias else "x"
    chain = _gelu_tanh_nodes if op_type == "FastGelu" else _gelu_erf_nodes
    unfused = ([oh.make_node("Add", ["x", "bias"], ["z"])] if bias else []) + chain(z, "y")
    fused = oh.make_node(op_type, ["x", "bias"] if bias else ["x"], ["y"], domain=MS)
    function = _gelu_tanh if op_type == "FastGelu" else _gelu_erf
    reference = lambda f: {"y": function(f["x"] + (f["bias"] if bias else 0))}  # noqa: E731
    expected = _check(_model([fused], feeds, ["y"]), _model(unfused, feeds, ["y"]), reference, feeds)
    np.testing.assert_allclose(_run(_model([fused], feeds, ["y"]), feeds)["y"], expected["y"], atol=1e-5)


@pytest.mark.parametrize("alpha", [None, 1.0, -0.5])
def test_quick_gelu(alpha):
    feeds = _floats(5, x=(3, 9))
    feeds["x"] *= 3
    value = 1.702 if alpha is None else alpha
    fused = oh.make_node("QuickGelu", ["x"], ["y"], domain=MS, **({} if alpha is None else {"alpha": alpha}))
    unfused = [_constant("alpha", np.float32(value)), oh.make_node("Mul", ["x", "alpha"], ["ax"]),
               oh.make_node("Sigmoid", ["ax"], ["s"]), oh.make_node("Mul", ["x", "s"], ["y"])]
    reference = lambda f: {"y": f["x"] / (1 + np.exp(-value * f["x"]))}  # noqa: E731
    expected = _check(_model([fused], feeds, ["y"]), _model(unfused, feeds, ["y"]), reference, feeds)
    np.testing.assert_allclose(_run(_model([fused], feeds, ["y"]), feeds)["y"], expected["y"], atol=1e-5)


def _bias_add_as_adds(model: onnx.ModelProto) -> None:
    """onnxruntime has BiasAdd for CUDA only: the forward node computed by two Adds instead."""
    (index, node), = [(i, n) for i, n in enumerate(model.graph.node) if n.op_type == "BiasAdd"]
    x, bias, skip = node.input
    model.graph.node.remove(node)
    for offset, added in enumerate(_sum_nodes([x, bias, skip], node.output[0])):
        model.graph.node.insert(index + offset, added)


def test_bias_add():
    feeds = _floats(6, x=(2, 3, 4), bias=(4,), skip=(2, 3, 4))
    fused = oh.make_node("BiasAdd", ["x", "bias", "skip"], ["y"], domain=MS)
    unfused = _sum_nodes(["x", "bias", "skip"], "y")
    reference = lambda f: {"y": f["x"] + f["bias"] + f["skip"]}  # noqa: E731
    _check(_model([fused], feeds, ["y"]), _model(unfused, feeds, ["y"]), reference, feeds, rewrite=_bias_add_as_adds)


# -------------------------------------------------------------------- EmbedLayerNormalization
@pytest.mark.parametrize("segments", [True, False])
@pytest.mark.parametrize("positions", [None, "row", "batch"])
@pytest.mark.parametrize("sum_used", [False, True])
@pytest.mark.parametrize("vocabulary", [11, 70])  # the one-hot GEMM and the scatter-add of Gather's rule
def test_embed_layer_normalization(segments, positions, sum_used, vocabulary):
    batch, length, hidden, epsilon = 2, 5, 6, 1e-5
    rng = np.random.default_rng(8)
    feeds = {"ids": rng.integers(0, vocabulary, (batch, length)).astype(np.int32)}
    feeds["ids"][0, :2] = 3  # repeated rows accumulate
    if segments:
        feeds["segment_ids"] = rng.integers(0, 2, (batch, length)).astype(np.int32)
    feeds.update(_floats(9, word=(vocabulary, hidden), position=(8, hidden), **({"segment": (2, hidden)} if segments else {}),
                         gamma=(hidden,), beta=(hidden,)))
    feeds["mask"] = np.ones((batch, length), np.int32)
    if positions is not None:
        rows = 1 if positions == "row" else batch
        feeds["position_ids"] = rng.integers(0, 8, (rows, length)).astype(np.int32)
    position_ids = feeds.get("position_ids", np.arange(length, dtype=np.int32)[None])
    inputs = ["ids", "segment_ids" if segments else "", "word", "position", "segment" if segments else "", "gamma", "beta",
              "mask", "position_ids" if positions else ""]
    while not inputs[-1]:
        inputs.pop()
    outputs = ["y", "s"] if sum_used else ["y"]
    fused = oh.make_node("EmbedLayerNormalization", inputs, ["y", "mask_index", "s" if sum_used else ""], domain=MS,
                         epsilon=epsilon)
    position_input = "position_ids" if positions else "arange"
    unfused = ([] if positions else [_constant("arange", position_ids)]) + [
        oh.make_node("Gather", ["word", "ids"], ["w"]), oh.make_node("Gather", ["position", position_input], ["p"])]
    unfused += [oh.make_node("Gather", ["segment", "segment_ids"], ["g"])] if segments else []
    unfused += _sum_nodes(["w", "p"] + (["g"] if segments else []), "s")
    unfused += [oh.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], epsilon=epsilon)]

    def reference(f):
        s = f["word"][f["ids"]] + f["position"][np.broadcast_to(position_ids, f["ids"].shape)]
        if segments:
            s = s + f["segment"][f["segment_ids"]]
        return {"y": _layer_norm(s, f["gamma"], f["beta"], epsilon), **({"s": s} if sum_used else {})}

    expected = _check(_model([fused], feeds, outputs), _model(unfused, feeds, outputs), reference, feeds)
    np.testing.assert_allclose(_run(_model([fused], feeds, outputs), feeds)["y"], expected["y"], atol=1e-5)


# ------------------------------------------------------------------- fused by onnxruntime's optimizer
def _tiny_transformer(model_type: str):
    transformers = pytest.importorskip("transformers")
    if model_type == "bert":
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                         vocab_size=50, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)
        return transformers.BertModel(config, add_pooling_layer=False)
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50, n_positions=16, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return transformers.GPT2Model(config)


def _adamw_losses(model: onnx.ModelProto, frozen, batches) -> List[float]:
    """The losses of 3 AdamW steps, then the evaluation graph's (``normgrad export --optimizer``
    writes it: its outputs are typed though onnx cannot type the fused ops' outputs)."""
    from normgrad.graphs import build_step_graph
    from normgrad.graphs.step_graph import build_eval_graph
    from normgrad.train import Trainer

    step, initial = build_step_graph(build_training_graph(model, loss="mse", frozen=frozen), "adamw")
    trainer = Trainer(step, initial, lr=1e-2, eval_model=build_eval_graph(step))
    return [float(trainer.step(**batch)) for batch in batches] + [trainer.evaluate(**batches[0]).loss]


@pytest.mark.slow
@pytest.mark.parametrize("model_type, opt_level, fused_ops", [
    ("bert", 2, {"SkipLayerNormalization", "BiasGelu"}),
    ("gpt2", 1, {"SkipLayerNormalization", "FastGelu"}),
])
def test_fused_by_onnxruntime_optimizer_trains_as_unfused(tmp_path, model_type, opt_level, fused_ops):
    """A tiny BertModel / GPT2Model exported by normgrad.torch.export, fused by
    ``optimize_model(model_type=..., opt_level=..., use_gpu=False)``: its AdamW losses over 3
    steps are the unfused export's (1e-5). The optimizer folds some weights into new constants
    (transposed weights, the token-type and position rows read, the attention scale and mask), so
    both train the torch parameters they hold by name and freeze the rest. (BERT at opt_level 1
    writes Gelu, whose result onnxruntime 1.32 itself refuses to load: "Attempt to replace the
    existing tensor".)"""
    torch = pytest.importorskip("torch")
    from onnxruntime.transformers.optimizer import optimize_model

    from normgrad.graphs import torch_exports
    from normgrad.torch import export

    class LastHiddenState(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids)[0]

    torch.manual_seed(0)
    path = tmp_path / "unfused.onnx"
    unfused = export(LastHiddenState(_tiny_transformer(model_type)).train(), (torch.zeros(2, 5, dtype=torch.int64),), path,
                     input_names=["input_ids"], output_names=["hidden"])
    fused = optimize_model(str(path), model_type=model_type, num_heads=2, hidden_size=32, opt_level=opt_level,
                           use_gpu=False).model
    assert {n.op_type for n in fused.graph.node if n.domain == MS} == fused_ops
    # the optimizer keeps normgrad's metadata: its list of parameters names some it folded away, which is
    # refused in one line (dropped here); its nn.Embedding semantics (BERT's padding_idx 0: that row gets no
    # gradient) still hold
    with pytest.raises(torch_exports.MisexportedModelError, match=r"names .*transformer optimizer folded them") as refused:
        build_training_graph(fused, loss="mse")
    assert "\n" not in str(refused.value)
    kept = [p for p in fused.metadata_props if p.key != torch_exports.METADATA_TORCH_PARAMETERS]
    del fused.metadata_props[:]
    fused.metadata_props.extend(kept)
    parameters = set(torch_exports.torch_parameters(unfused))
    shared = parameters & {t.name for t in fused.graph.initializer}
    assert len(shared) >= 6
    rng = np.random.default_rng(0)
    batches = [{"input_ids": rng.integers(0, 50, (2, 5)).astype(np.int64),
                "labels": rng.standard_normal((2, 5, 32)).astype(np.float32)} for _ in range(3)]
    for batch in batches:
        batch["input_ids"][0, 0] = 0  # BERT's padding row
    expected = _adamw_losses(unfused, parameters - shared, batches)
    losses = _adamw_losses(fused, {t.name for t in fused.graph.initializer} - shared, batches)
    np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=0)
    assert expected[2] < expected[0]
