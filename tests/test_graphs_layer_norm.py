"""LayerNorm family in training graphs: the LayerNormalization and RMSNormalization rules,
the decomposed LayerNorm and RMSNorm chain patterns (onnxscript's rewriter), their
fallbacks to the per-node rules, and torch's layers through both exporters against autograd."""

from __future__ import annotations

import io
from typing import Dict, Optional, Sequence

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest

from normgrad.graphs import TrainingGraph, UnsupportedOperatorError, build_training_graph
from normgrad.graphs.patterns import _declarative

from _graph_models import model, run_training
from _pattern_checks import _backward_ops, _check

needs_onnxscript = pytest.mark.skipif(not _declarative.AVAILABLE, reason="onnxscript is not installed: no chain patterns")


def _const(name: str, value) -> onnx.NodeProto:
    return oh.make_node("Constant", [], [name], value=onh.from_array(np.asarray(value), name))


def _params(seed: int, **shapes: Sequence[int]) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.uniform(0.5, 1.5, shape).astype(np.float32) for name, shape in shapes.items()}


# ------------------------------------------------------------------------------ rules
def layer_norm_model(shape=(2, 3, 8), axis=-1, scale_shape=None, bias_shape="scale", opset=17, stats=False):
    """One LayerNormalization; ``bias_shape`` "scale" (the scale's shape), None (no bias) or a shape."""
    rank = len(shape)
    scale_shape = list(shape[axis % rank:]) if scale_shape is None else list(scale_shape)
    params = _params(3, scale=scale_shape)
    inputs = ["x", "scale"]
    if bias_shape is not None:
        params["bias"] = _params(4, bias=scale_shape if bias_shape == "scale" else bias_shape)["bias"]
        inputs.append("bias")
    outputs = ["y", "mean", "inv_std_dev"] if stats else ["y"]
    node = oh.make_node("LayerNormalization", inputs, outputs, axis=axis, epsilon=1e-3)
    tanh = oh.make_node("Tanh", ["y"], ["out"])  # a nonlinear loss of y
    return model([node, tanh], {"x": shape}, ["out"], params, opset=opset)


@pytest.mark.parametrize("shape, axis, scale_shape, bias_shape", [
    ((2, 3, 8), -1, None, "scale"),
    ((2, 3, 8), -1, None, None),
    ((2, 3, 4), -2, None, "scale"),
    ((2, 3, 4), 1, [4], [4]),              # a [D] scale broadcast over the normalised axes 1..2
    ((2, 3, 4), -2, [1, 3, 4], [1]),       # leading 1s; a bias of another shape: dy summed
    ((4, 6), 0, None, "scale"),            # the whole tensor one row
])
@pytest.mark.parametrize("opset", [17, 18])
def test_layer_normalization_rule_matches_finite_differences(shape, axis, scale_shape, bias_shape, opset):
    forward = layer_norm_model(shape, axis, scale_shape, bias_shape, opset)
    _skip_unless_runs(forward, {"x": np.zeros(shape, np.float32)})
    training = build_training_graph(forward)
    ops = _backward_ops(forward, training)
    assert ops["LayerNormalizationGrad"] == 1, ops
    assert ops["ReduceMean"] == 0 and ops["Sqrt"] == 0, ops  # the forward's statistics, not recomputed
    (norm,) = [n for n in training.model.graph.node if n.op_type == "LayerNormalization"]
    assert len(norm.output) == 3 and all(norm.output), norm.output  # Mean and InvStdDev added
    bias_from_op = bias_shape in ("scale", None) or bias_shape == scale_shape
    assert (ops["ReduceSum"] == 0) == bias_from_op, ops  # dy summed to the bias only if it is shaped otherwise
    outputs = {o.name for o in training.model.graph.output}
    assert {"x_grad", "scale_grad"} | ({"bias_grad"} if bias_shape else set()) <= outputs
    _check(training)


def test_layer_normalization_rule_reuses_existing_statistics_outputs():
    forward = layer_norm_model(stats=True)
    training = build_training_graph(forward)
    (norm,) = [n for n in training.model.graph.node if n.op_type == "LayerNormalization"]
    assert list(norm.output) == ["y", "mean", "inv_std_dev"]
    (grad,) = [n for n in training.model.graph.node if n.op_type == "LayerNormalizationGrad"]
    assert list(grad.input[3:]) == ["mean", "inv_std_dev"]
    _check(training)


def test_layer_normalization_refuses_a_gradient_through_its_statistics():
    forward = layer_norm_model(stats=True)
    forward.graph.output.append(oh.make_tensor_value_info("mean", onnx.TensorProto.FLOAT, None))
    with pytest.raises(UnsupportedOperatorError, match="Mean or InvStdDev output"):
        build_training_graph(forward)


def _skip_unless_runs(forward: onnx.ModelProto, feeds: Dict[str, np.ndarray]) -> None:
    """Skips unless this onnxruntime runs the forward model (onnxruntime 1.19.2's
    LayerNormalization refuses a scale smaller than the normalised shape)."""
    try:
        ort.InferenceSession(forward.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    except Exception as error:
        pytest.skip(f"onnxruntime {ort.__version__} cannot run the forward model: {str(error).splitlines()[0]}")


def test_layer_normalization_rule_float16_runs_in_float16():
    """float16 x, scale, bias: LayerNormalizationGrad takes them as they are, with the float32
    statistics the forward writes; gradients agree with the float32 graph's to float16's precision."""
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((2, 3, 8)).astype(np.float32), rng.standard_normal((2, 3, 8)).astype(np.float32)
    results = {}
    for elem_type, dtype in ((onnx.TensorProto.FLOAT, np.float32), (onnx.TensorProto.FLOAT16, np.float16)):
        params = {k: v.astype(dtype) for k, v in _params(3, scale=[8], bias=[8]).items()}
        node = oh.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], epsilon=1e-3)
        forward = model([node], {"x": (2, 3, 8)}, ["y"], params, opset=17, elem_type=elem_type)
        training = build_training_graph(forward)
        (grad,) = [n for n in training.model.graph.node if n.op_type == "LayerNormalizationGrad"]
        assert not any(n.op_type == "Cast" for n in training.model.graph.node), "no casts around the grad op"
        try:
            results[dtype] = run_training(training, {"x": x.astype(dtype), "y_grad": dy.astype(dtype)})
        except Exception as error:  # onnxruntime without a float16 LayerNormalization kernel
            pytest.skip(f"onnxruntime cannot run the float16 graph: {error}")
    for name in ("x_grad", "scale_grad", "bias_grad"):
        want, got = results[np.float32][name], results[np.float16][name].astype(np.float32)
        assert results[np.float16][name].dtype == np.float16
        assert np.abs(got - want).max() < 1e-2 * np.abs(want).max(), name


@pytest.mark.parametrize("shape, axis, scale_shape", [((2, 3, 8), -1, None), ((2, 3, 4), -2, None), ((2, 3, 4), 1, [4])])
def test_rms_normalization_rule_matches_finite_differences(shape, axis, scale_shape):
    """RMSNormalization-23: 1 / rms recomputed beside the forward (one ReduceMean)."""
    scale_shape = list(shape[axis % len(shape):]) if scale_shape is None else scale_shape
    node = oh.make_node("RMSNormalization", ["x", "scale"], ["y"], axis=axis, epsilon=1e-3)
    forward = model([node, oh.make_node("Tanh", ["y"], ["out"])], {"x": shape}, ["out"], _params(3, scale=scale_shape), opset=23)
    _skip_unless_runs(forward, {"x": np.zeros(shape, np.float32)})  # opset 23: not in older onnxruntimes
    training = build_training_graph(forward)
    ops = _backward_ops(forward, training)
    assert ops["RMSNormalizationGrad"] == 1 and ops["ReduceMean"] == 1, ops
    _check(training)


# ------------------------------------------------------------------------ chain patterns
def layer_norm_chain(
    shape=(2, 3, 8), axes=(-1,), square="pow", divide="div", affine="bias", swap=False, opset=17,
    eps_initializer=False, scale_shape=None,
) -> onnx.ModelProto:
    """A written-out LayerNorm: ReduceMean → Sub → Pow|Mul → ReduceMean → Add → Sqrt →
    Div | Mul(Reciprocal) → [Mul(w) → [Add(b)]], then Tanh. Value names: mean, centred,
    squared, variance, shifted, std, normed, scaled, y."""
    pair = lambda a, b: [b, a] if swap else [a, b]
    axes_list = list(axes)
    if opset >= 18:
        reduce = lambda src, dst: oh.make_node("ReduceMean", [src, "axes"], [dst], keepdims=1)
        nodes = [_const("axes", np.array(axes_list, np.int64))]
    else:
        reduce = lambda src, dst: oh.make_node("ReduceMean", [src], [dst], axes=axes_list, keepdims=1)
        nodes = []
    params: Dict[str, np.ndarray] = {}
    nodes += [reduce("x", "mean"), oh.make_node("Sub", ["x", "mean"], ["centred"])]
    if square == "pow":
        nodes += [_const("two", np.float32(2.0)), oh.make_node("Pow", ["centred", "two"], ["squared"])]
    else:
        nodes += [oh.make_node("Mul", ["centred", "centred"], ["squared"])]
    nodes += [reduce("squared", "variance")]
    if eps_initializer:
        params["eps"] = np.float32(1e-3)
    else:
        nodes += [_const("eps", np.float32(1e-3))]
    nodes += [oh.make_node("Add", pair("variance", "eps"), ["shifted"]), oh.make_node("Sqrt", ["shifted"], ["std"])]
    if divide == "div":
        nodes += [oh.make_node("Div", ["centred", "std"], ["normed"])]
    else:
        nodes += [oh.make_node("Reciprocal", ["std"], ["inv_std"]), oh.make_node("Mul", pair("centred", "inv_std"), ["normed"])]
    last = "normed"
    normalised = list(shape[len(shape) - len(axes_list):])
    if affine in ("scale", "bias"):
        params["w"] = _params(5, w=normalised if scale_shape is None else scale_shape)["w"]
        nodes += [oh.make_node("Mul", pair("normed", "w"), ["scaled"])]
        last = "scaled"
    if affine == "bias":
        params["b"] = _params(6, b=normalised)["b"] - 1.0
        nodes += [oh.make_node("Add", pair("scaled", "b"), ["y"])]
        last = "y"
    nodes += [oh.make_node("Tanh", [last], ["out"])]
    return model(nodes, {"x": shape}, ["out"], params, opset=opset)


def _assert_fused(forward, training, op_type="LayerNormalizationGrad"):
    ops = _backward_ops(forward, training)
    assert ops[op_type] == 1, ops
    assert ops["ReduceMean"] == 0 and ops["ReduceSum"] == 0 and ops["Pow"] == 0, ops  # no pass of the chain node by node
    return ops


def _assert_not_fused(forward, training):
    ops = _backward_ops(forward, training)
    assert ops["LayerNormalizationGrad"] == 0 and ops["RMSNormalizationGrad"] == 0, ops


@needs_onnxscript
@pytest.mark.parametrize("square", ["pow", "mul"])
@pytest.mark.parametrize("divide", ["div", "reciprocal"])
@pytest.mark.parametrize("affine", ["bias", "scale", "none"])
@pytest.mark.parametrize("swap", [False, True])
def test_layer_norm_chain_fused(square, divide, affine, swap):
    forward = layer_norm_chain(square=square, divide=divide, affine=affine, swap=swap)
    training = build_training_graph(forward)
    ops = _assert_fused(forward, training)
    (grad,) = [n for n in training.model.graph.node if n.op_type == "LayerNormalizationGrad"]
    assert grad.input[3] == "mean"  # the chain's own statistics
    if divide == "reciprocal":
        assert grad.input[4] == "inv_std" and ops["Reciprocal"] == 0, ops
    _check(training)


@needs_onnxscript
@pytest.mark.parametrize("shape, axes, opset", [
    ((2, 3, 4), (-2, -1), 17), ((2, 3, 4), (1, 2), 18), ((5, 8), (-1,), 18), (("N", 3, 8), (-1,), 17),
])
def test_layer_norm_chain_fused_axes_and_opsets(shape, axes, opset):
    forward = layer_norm_chain(shape, axes, opset=opset)
    training = build_training_graph(forward)
    _assert_fused(forward, training)
    if "N" not in shape:
        _check(training)


@needs_onnxscript
def test_layer_norm_chain_with_a_broadcast_scale():
    """w [8] against normalised axes 1..2 of [2, 3, 8]: the scale gradient summed over the broadcast."""
    forward = layer_norm_chain((2, 3, 8), (1, 2), affine="scale", scale_shape=[8])
    training = build_training_graph(forward)
    _assert_fused(forward, training)
    _check(training)


def _unfused(forward: onnx.ModelProto) -> TrainingGraph:
    from _pattern_checks import _unfused as unfused

    return unfused(forward)


@needs_onnxscript
@pytest.mark.parametrize("affine", ["bias", "none"])
def test_float16_layer_norm_chain_with_casts(affine):
    """torch's TorchScript exporter below opset 17 writes a float16 nn.LayerNorm with the
    centred values cast to double and the result cast back: one LayerNormalizationGrad on
    float16 x, the float16 mean and the double 1/std cast to float32; gradients equal to the
    node-by-node graph's to float16 precision."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 8)).astype(np.float16)
    nodes = [
        oh.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]),
        oh.make_node("Sub", ["x", "mean"], ["centred"]),
        oh.make_node("Cast", ["centred"], ["centred64"], to=onnx.TensorProto.DOUBLE),
        _const("two", np.float64(2.0)),
        oh.make_node("Pow", ["centred64", "two"], ["squared"]),
        oh.make_node("ReduceMean", ["squared"], ["variance"], axes=[-1]),
        _const("eps", np.float64(1e-3)),
        oh.make_node("Add", ["variance", "eps"], ["shifted"]),
        oh.make_node("Sqrt", ["shifted"], ["std"]),
        oh.make_node("Div", ["centred64", "std"], ["normed"]),
        oh.make_node("Cast", ["normed"], ["y" if affine == "none" else "normed16"], to=onnx.TensorProto.FLOAT16),
    ]
    params = {}
    if affine == "bias":
        params = {k: v.astype(np.float16) for k, v in _params(3, w=[8], b=[8]).items()}
        nodes += [oh.make_node("Mul", ["normed16", "w"], ["scaled"]), oh.make_node("Add", ["scaled", "b"], ["y"])]
    forward = model(nodes, {"x": (2, 3, 8)}, ["y"], params, opset=16, elem_type=onnx.TensorProto.FLOAT16)
    training = build_training_graph(forward)
    ops = _backward_ops(forward, training)
    assert ops["LayerNormalizationGrad"] == 1 and ops["ReduceSum"] == 0, ops
    (grad,) = [n for n in training.model.graph.node if n.op_type == "LayerNormalizationGrad"]
    assert grad.input[1] == "x" and grad.input[2] != "centred64"
    feeds = {"x": x, "y_grad": rng.standard_normal((2, 3, 8)).astype(np.float16)}
    fused, reference = run_training(training, feeds), run_training(_unfused(forward), feeds)
    for name in [o.name for o in training.model.graph.output if o.name.endswith("_grad")]:
        want, got = reference[name].astype(np.float32), fused[name].astype(np.float32)
        assert fused[name].dtype == np.float16 and np.abs(got - want).max() < 1e-2 * np.abs(want).max(), name


@pytest.mark.parametrize("case", ["centred_read_elsewhere", "std_output", "eps_trainable", "axes_not_trailing", "weight_per_row"])
def test_layer_norm_chain_fallback(case):
    """Anything unexpected falls back to the per-node rules, still correct."""
    shape, axes, kwargs = (2, 3, 8), (-1,), {}
    if case == "eps_trainable":
        kwargs["eps_initializer"] = True
    if case == "axes_not_trailing":
        axes = (1,)
    if case == "weight_per_row":
        kwargs.update(affine="scale", scale_shape=[3, 1])
    forward = layer_norm_chain(shape, axes, **kwargs)
    if case in ("centred_read_elsewhere", "std_output"):
        nodes = list(forward.graph.node)
        params = {t.name: onh.to_array(t) for t in forward.graph.initializer}
        extra = {"centred_read_elsewhere": "centred", "std_output": "std"}[case]
        if case == "centred_read_elsewhere":
            nodes.append(oh.make_node("Sigmoid", [extra], ["extra"]))
            extra = "extra"
        forward = model(nodes, {"x": shape}, ["out", extra], params, opset=17)
    training = build_training_graph(forward)
    ops = _backward_ops(forward, training)
    if case == "weight_per_row" and _declarative.AVAILABLE:  # the normalisation alone is fused, the Mul goes through its rule
        assert ops["LayerNormalizationGrad"] == 1 and ops["ReduceSum"] >= 1, ops
    elif case == "centred_read_elsewhere" and _declarative.AVAILABLE:
        # from centred on, the chain is an RMSNorm of centred; Sub and ReduceMean go node by node
        assert ops["LayerNormalizationGrad"] == 0 and ops["RMSNormalizationGrad"] == 1, ops
    else:
        _assert_not_fused(forward, training)
    if case == "eps_trainable":
        assert "eps_grad" in {o.name for o in training.model.graph.output}
    _check(training)


def rms_norm_chain(
    shape=(2, 3, 8), inverse="reciprocal", cast_in=False, cast_out=False, affine=True, swap=False, square="pow",
) -> onnx.ModelProto:
    """A written-out RMSNorm as transformers' LlamaRMSNorm (TorchScript: Div(1, Sqrt)) or
    the dynamo exporter's nn.RMSNorm (Reciprocal) write it, then Tanh."""
    pair = lambda a, b: [b, a] if swap else [a, b]
    nodes = []
    x = "x"
    if cast_in:
        nodes += [oh.make_node("Cast", ["x"], ["x32"], to=onnx.TensorProto.FLOAT)]
        x = "x32"
    if square == "pow":
        nodes += [_const("two", np.float32(2.0)), oh.make_node("Pow", [x, "two"], ["squared"])]
    else:
        nodes += [oh.make_node("Mul", [x, x], ["squared"])]
    nodes += [
        oh.make_node("ReduceMean", ["squared"], ["mean_square"], axes=[-1], keepdims=1),
        _const("eps", np.float32(1e-3)),
        oh.make_node("Add", pair("mean_square", "eps"), ["shifted"]),
        oh.make_node("Sqrt", ["shifted"], ["rms"]),
    ]
    if inverse == "reciprocal":
        nodes += [oh.make_node("Reciprocal", ["rms"], ["inv"]), oh.make_node("Mul", pair(x, "inv"), ["normed"])]
    elif inverse == "div_one":
        nodes += [_const("one", np.float32(1.0)), oh.make_node("Div", ["one", "rms"], ["inv"]),
                  oh.make_node("Mul", pair(x, "inv"), ["normed"])]
    else:
        nodes += [oh.make_node("Div", [x, "rms"], ["normed"])]
    last = "normed"
    if cast_out:
        nodes += [oh.make_node("Cast", ["normed"], ["normed_cast"], to=onnx.TensorProto.FLOAT)]
        last = "normed_cast"
    params = {}
    if affine:
        params = _params(7, w=[shape[-1]])
        nodes += [oh.make_node("Mul", pair(last, "w"), ["y"])]
        last = "y"
    nodes += [oh.make_node("Tanh", [last], ["out"])]
    return model(nodes, {"x": shape}, ["out"], params, opset=17)


@needs_onnxscript
@pytest.mark.parametrize("inverse", ["reciprocal", "div_one", "divide"])
@pytest.mark.parametrize("casts", [False, True])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("swap", [False, True])
def test_rms_norm_chain_fused(inverse, casts, affine, swap):
    forward = rms_norm_chain(inverse=inverse, cast_in=casts, cast_out=casts, affine=affine, swap=swap)
    training = build_training_graph(forward)
    ops = _assert_fused(forward, training, "RMSNormalizationGrad")
    (grad,) = [n for n in training.model.graph.node if n.op_type == "RMSNormalizationGrad"]
    assert grad.input[3] == ("rms" if inverse == "divide" else "inv") or ops["Reciprocal"] == 1
    if inverse != "divide":
        assert grad.input[3] == "inv" and ops["Reciprocal"] == 0, ops  # the chain's own 1 / rms
    _check(training)


@needs_onnxscript
def test_rms_norm_chain_squared_by_mul():
    forward = rms_norm_chain(square="mul")
    training = build_training_graph(forward)
    _assert_fused(forward, training, "RMSNormalizationGrad")
    _check(training)


def test_chains_without_onnxscript_go_node_by_node(monkeypatch):
    """Without onnxscript: a warning, no fusion, the same gradients."""
    monkeypatch.setattr(_declarative, "AVAILABLE", False)
    for forward in (layer_norm_chain(), rms_norm_chain()):
        with pytest.warns(UserWarning, match="onnxscript is not installed"):
            training = build_training_graph(forward)
        _assert_not_fused(forward, training)
        _check(training)


@needs_onnxscript
def test_chains_fall_back_when_the_rewriter_fails(monkeypatch):
    """An error inside onnxscript (here: viewing the graph) is a warning, not a failed export."""

    def broken(view, ctx):
        raise RuntimeError("cannot view this graph")

    monkeypatch.setattr(_declarative, "_ir_view", broken)
    forward = layer_norm_chain()
    with pytest.warns(UserWarning, match="onnxscript's rewriter failed on this graph .RuntimeError: cannot view this graph"):
        training = build_training_graph(forward)
    _assert_not_fused(forward, training)
    _check(training)


# -------------------------------------------------------------- torch's layers, both exporters
def _torch_layers(torch):
    nn = torch.nn
    from_transformers = None
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm as from_transformers
    except ImportError:
        pass
    return {
        "layer_norm": lambda: nn.LayerNorm(8),
        "layer_norm_2d": lambda: nn.LayerNorm([4, 8]),
        "layer_norm_no_affine": lambda: nn.LayerNorm(8, elementwise_affine=False),
        "layer_norm_no_bias": lambda: nn.LayerNorm(8, bias=False),
        "rms_norm": lambda: nn.RMSNorm(8, eps=1e-5),
        "rms_norm_2d": lambda: nn.RMSNorm([4, 8], eps=1e-5),
        "rms_norm_no_affine": lambda: nn.RMSNorm(8, eps=1e-5, elementwise_affine=False),
        "llama_rms_norm": (lambda: from_transformers(8)) if from_transformers else None,
    }


@pytest.mark.parametrize("exporter, opset", [("torchscript", 17), ("torchscript", 16), ("dynamo", 18)])
@pytest.mark.parametrize("layer", [
    "layer_norm", "layer_norm_2d", "layer_norm_no_affine", "layer_norm_no_bias",
    "rms_norm", "rms_norm_2d", "rms_norm_no_affine", "llama_rms_norm",
])
def test_torch_layers_match_autograd(layer, exporter, opset):
    """Each layer between two Linear layers (so x's gradient and the weights' pass through
    it), exported by TorchScript (opset 17: LayerNormalization; opset 16: the decomposed
    chain) or dynamo; the gradient op asserted; gradients against torch autograd."""
    torch = pytest.importorskip("torch")
    make = _torch_layers(torch)[layer]
    if make is None:
        pytest.skip("transformers is not installed")
    nn = torch.nn
    torch.manual_seed(0)
    norm = make()
    module = nn.Sequential(nn.Linear(8, 8), norm, nn.Linear(8, 3)).train()
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(torch.randn(param.shape) * 0.5 + (1.0 if name.startswith("1.") and name.endswith("weight") else 0.0))
    x = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)
    try:
        if exporter == "torchscript":
            buffer = io.BytesIO()
            torch.onnx.export(module, (torch.tensor(x),), buffer, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                              do_constant_folding=False, input_names=["x"], output_names=["y"], opset_version=opset)
            forward = onnx.load_from_string(buffer.getvalue())
        else:
            forward = torch.onnx.export(module, (torch.tensor(x),), dynamo=True, opset_version=opset, input_names=["x"],
                                        output_names=["y"], optimize=False, verbose=False).model_proto
    except Exception as error:  # TorchScript has no ONNX symbolic for aten::rms_norm
        pytest.skip(f"the {exporter} exporter cannot export {layer}: {type(error).__name__}: {str(error).splitlines()[0]}")
    training = build_training_graph(forward)
    grad_op = "RMSNormalizationGrad" if "rms" in layer else "LayerNormalizationGrad"
    chain = exporter == "dynamo" and "rms" in layer or layer == "llama_rms_norm" or opset < 17
    ops = _backward_ops(forward, training)
    assert ops[grad_op] == (1 if _declarative.AVAILABLE or not chain else 0), ops

    xt = torch.tensor(x, requires_grad=True)
    out = module(xt)
    dy = np.random.default_rng(1).standard_normal(tuple(out.shape)).astype(np.float32)
    out.backward(torch.tensor(dy))
    results = run_training(training, {"x": x, "y_grad": dy})
    np.testing.assert_allclose(results["y"], out.detach().numpy(), rtol=1e-5, atol=1e-5)
    expected = {"x": xt.grad.numpy(), **{name: p.grad.numpy() for name, p in module.named_parameters()}}
    largest = max(np.abs(g).max() for g in expected.values())
    for name, grad in expected.items():
        assert np.abs(results[f"{name}_grad"] - grad).max() < 1e-5 * largest, name
