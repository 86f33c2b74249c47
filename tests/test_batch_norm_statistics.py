"""Training-mode BatchNormalization as forward statistics: running statistics as torch
updates them, and the all-reduce hook synchronized BatchNorm plugs into."""

from __future__ import annotations

import numpy as np
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from normgrad.graphs import build_training_graph

from _graph_models import batch_norm_parameters, model, run_training

C = 3


def _bn_model(momentum: float = 0.9):
    params = batch_norm_parameters(C, seed=5)
    node = oh.make_node("BatchNormalization", ["x", "s", "t", "m", "v"], ["y", "rm", "rv"], training_mode=1, momentum=momentum, epsilon=1e-3)
    return model([node], {"x": (4, C, 5, 3)}, ["y", "rm", "rv"], params, opset=15), params


def _run(training, x, seed):
    return run_training(training, {"x": x, "y_grad": seed})


def _inputs():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, C, 5, 3)) * 2 + 3).astype(np.float32)
    return x, rng.standard_normal(x.shape).astype(np.float32)


def test_running_statistics_are_not_differentiated():
    forward, _ = _bn_model()
    training, _ = build_training_graph(forward)
    assert [i.name for i in training.graph.input if i.name.endswith("_grad")] == ["y_grad"]
    assert {o.name for o in training.graph.output} == {"y", "rm", "rv", "x_grad", "s_grad", "t_grad"}


def test_forward_and_running_statistics_match_float64():
    forward, params = _bn_model(momentum=0.8)
    x, seed = _inputs()
    out = _run(build_training_graph(forward), x, seed)
    x64 = x.astype(np.float64)
    mean, var = x64.mean(axis=(0, 2, 3)), x64.var(axis=(0, 2, 3))
    count = x.size // C
    y = (x64 - mean[:, None, None]) / np.sqrt(var[:, None, None] + 1e-3) * params["s"][:, None, None] + params["t"][:, None, None]
    np.testing.assert_allclose(out["y"], y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["rm"], 0.8 * params["m"] + 0.2 * mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["rv"], 0.8 * params["v"] + 0.2 * var * count / (count - 1), rtol=1e-6, atol=1e-6)


def test_running_statistics_match_torch_train_mode():
    torch = pytest.importorskip("torch")
    forward, params = _bn_model(momentum=0.9)
    x, seed = _inputs()
    out = _run(build_training_graph(forward), x, seed)
    layer = torch.nn.BatchNorm2d(C, eps=1e-3, momentum=0.1).double().train()
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(params["s"]))
        layer.bias.copy_(torch.from_numpy(params["t"]))
        layer.running_mean.copy_(torch.from_numpy(params["m"]))
        layer.running_var.copy_(torch.from_numpy(params["v"]))
    xt = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    yt = layer(xt)
    yt.backward(torch.from_numpy(seed.astype(np.float64)))
    np.testing.assert_allclose(out["rm"], layer.running_mean.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["rv"], layer.running_var.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["x_grad"], xt.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out["s_grad"], layer.weight.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_all_reduce_hook_over_two_identical_ranks_changes_nothing():
    """Two ranks holding the same batch: the global statistics are the local ones, dx is the
    single-process dx, and the scale/bias gradients stay local. Doubling as the all-reduce
    catches a count or a sum that misses it (the mean, the variance or dx would move)."""
    forward, _ = _bn_model()
    x, seed = _inputs()
    calls = []

    def doubling(ctx, value):
        calls.append(value)
        return ctx.op("Add", value, value)

    synced = _run(build_training_graph(forward, batch_norm_all_reduce=doubling), x, seed)
    local = _run(build_training_graph(forward), x, seed)
    assert len(calls) == 3  # sum and count, squared deviations, backward sums
    for name in set(local) - {"rv"}:
        np.testing.assert_allclose(synced[name], local[name], rtol=1e-6, atol=1e-6, err_msg=name)
    var = x.astype(np.float64).var(axis=(0, 2, 3))
    count = 2 * (x.size // C)  # the unbiased running variance counts the global batch
    np.testing.assert_allclose(synced["rv"], 0.9 * _bn_model()[1]["v"] + 0.1 * var * count / (count - 1), rtol=1e-6)


def test_all_reduce_hook_uses_the_global_count():
    """One rank of two whose other rank holds zeros: the statistics are over both batches."""
    forward, _ = _bn_model()
    x, seed = _inputs()
    other_rank_count = x.size // C

    calls = []

    def with_empty_peer(ctx, value):
        """The peer's sums are those of zeros, except the squared deviations (x - mean)^2."""
        calls.append(value)
        if len(calls) == 1:  # sum and count
            peer = np.zeros(C + 1, np.float32)
            peer[-1] = other_rank_count
            return ctx.op("Add", value, ctx.op("Constant", value=onh.from_array(peer)))
        return value

    out = _run(build_training_graph(forward, batch_norm_all_reduce=with_empty_peer), x, seed)
    both = np.concatenate([x, np.zeros_like(x)]).astype(np.float64)
    mean = both.mean(axis=(0, 2, 3))
    np.testing.assert_allclose(out["rm"], 0.9 * _bn_model()[1]["m"] + 0.1 * mean, rtol=1e-6, atol=1e-6)


def test_all_reduce_hook_with_fused_relu_changes_nothing():
    """BatchNormalization -> Relu (the ReLU backward fused into the BatchNorm ops): the
    doubling all-reduce over two identical ranks leaves every output as the local graph's."""
    forward, _ = _bn_model()
    relu = oh.make_node("Relu", ["y"], ["r"])
    forward.graph.node.append(relu)
    forward.graph.output[0].name = "r"
    x, seed = _inputs()

    def doubling(ctx, value):
        return ctx.op("Add", value, value)

    def run(training):
        assert any(n.domain == "normgrad" and n.input[-1] == "r" for n in training.model.graph.node)  # fused
        return run_training(training, {"x": x, "r_grad": seed})

    synced, local = run(build_training_graph(forward, batch_norm_all_reduce=doubling)), run(build_training_graph(forward))
    for name in set(local) - {"rv"}:
        np.testing.assert_allclose(synced[name], local[name], rtol=1e-6, atol=1e-6, err_msg=name)
    masked = np.where(local["r"] > 0, seed, 0).astype(np.float64)
    np.testing.assert_allclose(local["t_grad"], masked.sum(axis=(0, 2, 3)), rtol=1e-5, atol=1e-5)
