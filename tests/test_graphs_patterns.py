"""Multi-node patterns differentiated as a whole (normgrad.graphs.patterns): torch's
TorchScript GroupNorm chain, its fused gradient, and the fallback to the per-node rules."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from normgrad.graphs import TrainingGraph, build_training_graph

from _graph_models import model, run_training
from _pattern_checks import _backward_ops, _check, _unfused


def torch_group_norm_block(
    shape: Sequence[int] = (2, 4, 3, 3),
    groups: int = 2,
    affine: str = "unsqueeze",
    opset: int = 17,
    swap: bool = False,
    norm_scale: Optional[np.ndarray] = None,
) -> onnx.ModelProto:
    """GroupNorm as torch's TorchScript exporter writes it: Reshape [0, G, -1] →
    InstanceNormalization(Constant ones(G), Constant zeros(G)) → Reshape(Shape(x)) →
    Mul(w) → Add(b), with output ``y``.

    ``affine``: "unsqueeze" (Unsqueeze of [C] initializers, as exported), "reshape"
    (Reshape of them to [C, 1, ...]), "folded" ([C, 1, ...] initializers, as with
    constant folding) or "none" (Constant ones/zeros [1, 1, ...], as without affine).
    ``swap`` writes Mul(w, r) and Add(b, m); ``norm_scale`` replaces the ones(G) scale.
    """
    channels, rank = shape[1], len(shape)
    column = [channels] + [1] * (rank - 2)
    rng = np.random.default_rng(11)
    weight = rng.uniform(0.5, 1.5, channels).astype(np.float32)
    bias = rng.standard_normal(channels).astype(np.float32)
    const = lambda name, value: oh.make_node("Constant", [], [name], value=onh.from_array(np.asarray(value), name))
    scale = np.ones(groups, np.float32) if norm_scale is None else np.asarray(norm_scale, np.float32)
    nodes = [
        const("target", np.array([0, groups, -1], np.int64)),
        oh.make_node("Reshape", ["x", "target"], ["grouped"]),
        const("ones", scale),
        const("zeros", np.zeros(groups, np.float32)),
        oh.make_node("InstanceNormalization", ["grouped", "ones", "zeros"], ["normed"], epsilon=1e-5),
        oh.make_node("Shape", ["x"], ["x_shape"]),
        oh.make_node("Reshape", ["normed", "x_shape"], ["restored"]),
    ]
    params: Dict[str, np.ndarray] = {}
    if affine == "unsqueeze":
        params = {"weight": weight, "bias": bias}
        nodes += [const("axes", np.arange(1, rank - 1, dtype=np.int64))]
        nodes += [oh.make_node("Unsqueeze", [p, "axes"], [f"{p}_col"]) for p in ("weight", "bias")]
        w, b = "weight_col", "bias_col"
    elif affine == "reshape":
        params = {"weight": weight, "bias": bias}
        nodes += [const("column", np.array([-1] + column[1:], np.int64))]
        nodes += [oh.make_node("Reshape", [p, "column"], [f"{p}_col"]) for p in ("weight", "bias")]
        w, b = "weight_col", "bias_col"
    elif affine == "folded":
        params = {"weight": weight.reshape(column), "bias": bias.reshape(column)}
        w, b = "weight", "bias"
    elif affine == "none":
        nodes += [const("one", np.ones([1] * (rank - 1), np.float32)), const("zero", np.zeros([1] * (rank - 1), np.float32))]
        w, b = "one", "zero"
    else:
        raise ValueError(affine)
    pair = lambda first, second: [second, first] if swap else [first, second]
    nodes += [
        oh.make_node("Mul", pair("restored", w), ["scaled"]),
        oh.make_node("Add", pair("scaled", b), ["y"]),
    ]
    return model(nodes, {"x": shape}, ["y"], params, opset=opset)


def _assert_fused(forward: onnx.ModelProto, training: TrainingGraph, norms: int = 1, affine: bool = True) -> List[str]:
    """One GroupNormalizationGrad per GroupNorm, and the affine's gradient passes gone:
    against the per-node rules, at least two ReduceSum (dw, db: sums over the data) and two
    Mul (dy * w, dy * r) fewer per GroupNorm with a trainable affine, one Mul (dy * 1)
    fewer without one.

    Returns the GroupNormalizationGrad nodes' dgamma/dbeta outputs in use."""
    ops, base = _backward_ops(forward, training), _backward_ops(forward, _unfused(forward, only=["torch_group_norm"]))
    assert ops["GroupNormalizationGrad"] == base["GroupNormalizationGrad"] == norms, ops
    assert base["ReduceSum"] - ops["ReduceSum"] >= (2 * norms if affine else 0), (ops, base)
    assert base["Mul"] - ops["Mul"] == (2 * norms if affine else norms), (ops, base)
    grads = [n for n in training.model.graph.node if n.op_type == "GroupNormalizationGrad"]
    return [name for node in grads for name in node.output[1:] if name]


def _assert_not_fused(forward: onnx.ModelProto, training: TrainingGraph) -> None:
    ops = _backward_ops(forward, training)
    assert ops["GroupNormalizationGrad"] == 1, ops  # the InstanceNormalization rule's
    assert ops["ReduceSum"] >= 1, ops  # the Mul/Add rules' sums for the affine (or none: see caller)


@pytest.mark.parametrize("shape, groups", [((2, 4, 3, 3), 2), ((2, 6, 5), 3), ((1, 4, 2, 3, 2), 4), ((3, 8), 2), (("N", 4, "H", 3), 2)])
@pytest.mark.parametrize("affine", ["unsqueeze", "reshape", "folded"])
def test_fused_gradient_matches_finite_differences(shape, groups, affine):
    forward = torch_group_norm_block(shape, groups, affine)
    training = build_training_graph(forward)
    wanted = _assert_fused(forward, training)
    assert len(wanted) == 2  # dgamma and dbeta from the one node
    ops = _backward_ops(forward, training)  # the only Mul: the recomputed variance's (x - mean)^2
    assert ops["ReduceSum"] == 0 and ops["Mul"] == 1, ops
    outputs = {o.name for o in training.model.graph.output}
    assert {"x_grad", "weight_grad", "bias_grad"} <= outputs
    _check(training)


@pytest.mark.parametrize("opset", [15, 16, 17, 18])
@pytest.mark.parametrize("swap", [False, True])
def test_fused_across_opsets_and_operand_order(opset, swap):
    forward = torch_group_norm_block(opset=opset, swap=swap)
    training = build_training_graph(forward)
    _assert_fused(forward, training)
    _check(training)


@pytest.mark.parametrize("inline", [False, True])
def test_fused_without_affine(inline):
    """affine=False: Mul/Add by Constant ones/zeros [1, 1, 1]; only dx is wanted."""
    forward = torch_group_norm_block(affine="none")
    training = build_training_graph(forward, inline=inline)
    if not inline:
        assert _assert_fused(forward, training, affine=False) == []
    assert [o.name for o in training.model.graph.output] == ["y", "x_grad"]
    _check(training)


def test_fused_scalar_weight_with_channel_bias():
    """Mixed affine shapes: a trainable [1, 1, 1] weight and a [C, 1, 1] bias."""
    forward = torch_group_norm_block(affine="folded")
    for init in forward.graph.initializer:
        if init.name == "weight":
            init.CopyFrom(onh.from_array(np.full((1, 1, 1), 1.3, np.float32), "weight"))
    forward = model(list(forward.graph.node), {"x": (2, 4, 3, 3)}, ["y"],
                    {t.name: onh.to_array(t) for t in forward.graph.initializer})
    training = build_training_graph(forward)
    _assert_fused(forward, training)
    _check(training)


def _with_extra(forward: onnx.ModelProto, value: str, as_output: bool) -> onnx.ModelProto:
    """``forward`` with intermediate ``value`` also read by a Tanh (or made a graph output)."""
    nodes = list(forward.graph.node)
    params = {t.name: onh.to_array(t) for t in forward.graph.initializer}
    outputs = ["y"]
    if as_output:
        outputs.append(value)
    else:
        nodes.append(oh.make_node("Tanh", [value], ["extra"]))
        outputs.append("extra")
    return model(nodes, {"x": (2, 4, 3, 3)}, outputs, params)


@pytest.mark.parametrize("value", ["grouped", "normed", "restored", "scaled"])
@pytest.mark.parametrize("as_output", [False, True])
def test_fallback_when_an_intermediate_is_used_elsewhere(value, as_output):
    forward = _with_extra(torch_group_norm_block(), value, as_output)
    training = build_training_graph(forward)
    _assert_not_fused(forward, training)
    _check(training)


def test_fallback_when_the_norm_scale_is_not_ones():
    forward = torch_group_norm_block(norm_scale=[1.0, 2.0])
    training = build_training_graph(forward)
    _assert_not_fused(forward, training)
    _check(training)


def test_fallback_when_the_norm_scale_is_trainable():
    """An initializer scale becomes a training-graph input: its value may change, and it
    needs its own gradient."""
    forward = torch_group_norm_block()
    nodes = [n for n in forward.graph.node if n.output[0] != "ones"]
    params = {t.name: onh.to_array(t) for t in forward.graph.initializer}
    params["ones"] = np.ones(2, np.float32)
    forward = model(nodes, {"x": (2, 4, 3, 3)}, ["y"], params)
    training = build_training_graph(forward)
    assert "ones_grad" in {o.name for o in training.model.graph.output}
    _assert_not_fused(forward, training)
    _check(training)


def test_fallback_when_groups_do_not_split_channels():
    """Reshape [0, 2, -1] of 3 channels: groups straddle channels; not a GroupNorm."""
    forward = torch_group_norm_block(shape=(2, 3, 2, 2), groups=2)
    training = build_training_graph(forward)
    _assert_not_fused(forward, training)
    _check(training)


def test_fallback_when_the_weight_is_not_per_channel():
    """A [C, H, W] weight (broadcast over N only) is not a channel affine."""
    forward = torch_group_norm_block(affine="folded")
    params = {t.name: onh.to_array(t) for t in forward.graph.initializer}
    params["weight"] = np.random.default_rng(0).uniform(0.5, 1.5, (4, 3, 3)).astype(np.float32)
    forward = model(list(forward.graph.node), {"x": (2, 4, 3, 3)}, ["y"], params)
    training = build_training_graph(forward)
    _assert_not_fused(forward, training)
    _check(training)


# ------------------------------------------------------------------------------------ torch
def _torch_export(torch, module, shape, path, opset, folding):
    torch.onnx.export(
        module, (torch.randn(shape),), str(path), dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
        do_constant_folding=folding, input_names=["x"], output_names=["y"], opset_version=opset,
    )
    return onnx.load(str(path))


@pytest.mark.parametrize("case, shape, opset, folding", [
    ("conv_gn", (2, 3, 6, 6), 17, False),
    ("conv_gn", (2, 3, 6, 6), 15, True),
    ("gn_1d", (2, 6, 7), 18, False),
    ("gn_1d", (2, 6, 7), 16, True),
    ("no_affine", (2, 6, 5, 4), 17, False),
])
def test_torchscript_group_norm_matches_autograd(tmp_path, case, shape, opset, folding):
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(0)
    modules = {
        "conv_gn": lambda: nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.GroupNorm(3, 6), nn.SiLU(), nn.GroupNorm(2, 6)),
        "gn_1d": lambda: nn.Sequential(nn.GroupNorm(2, 6), nn.Tanh()),
        "no_affine": lambda: nn.GroupNorm(3, 6, affine=False),
    }
    module = modules[case]().train()
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn_like(param) * 0.5 + (1.0 if param.ndim == 1 else 0.0))
    forward = _torch_export(torch, module, shape, tmp_path / f"{case}.onnx", opset, folding)
    norms = sum(isinstance(m, nn.GroupNorm) for m in module.modules())
    assert sum(n.op_type == "InstanceNormalization" for n in forward.graph.node) == norms
    training = build_training_graph(forward)
    _assert_fused(forward, training, norms, affine=case != "no_affine")

    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    xt = torch.tensor(x, requires_grad=True)
    out = module(xt)
    dy = rng.standard_normal(tuple(out.shape)).astype(np.float32)
    out.backward(torch.tensor(dy))
    results = run_training(training, {"x": x, "y_grad": dy})
    initial = training.weights
    np.testing.assert_allclose(results["y"], out.detach().numpy(), rtol=1e-4, atol=1e-5)

    # parameters by value: constant folding renames the [C, 1, 1] weight/bias initializers
    expected = {"x": xt.grad.numpy()}
    for name in initial:
        (param,) = [p for p in module.parameters() if np.array_equal(p.detach().numpy().ravel(), initial[name].ravel())]
        expected[name] = param.grad.numpy().reshape(initial[name].shape)
    assert len(expected) == 1 + sum(1 for _ in module.parameters())
    for name, grad in expected.items():
        got = results[f"{name}_grad"]
        error = np.abs(got - grad).max() / np.abs(grad).max()
        assert error < 2e-5, (name, error)
