"""Seeded Dropout in step graphs: masks are a function of (seed, step, micro-batch, node,
element) computed in the graph, reproducible by plain onnxruntime sessions on 1.32 and
(NORMGRAD_OLD_ORT_PYTHON) 1.19.2, at every thread count and optimization level; forward and
backward share one mask; Trainer runs with one seed are bitwise the same, and resuming from a
checkpoint continues bitwise."""

import json
import os

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

from normgrad import checkpoint
from normgrad.graphs import build_step_graph, build_training_graph, rewrites
from normgrad.graphs.optimizers import hyperparameter_feeds
from normgrad.graphs.step_graph import build_gradient_graph
from normgrad.train import SEED_METADATA, Trainer, TrainerError
from _dropout_runs import D, LR, N, RATIOS, _feeds, _forward, _mask_names, _masks, _run_plain


def _step(seed=0, kind="sgd", **forward):
    training = build_training_graph(_forward(**forward), loss="mse")
    return build_step_graph(training, kind, dropout_seed=seed)


# -- the generator, written again in NumPy from its documentation ------------------------------


def _reference_step(x, labels, W, V, masks, ratios=RATIOS, lr=LR):
    """float64 forward, loss, gradients and SGD update of _forward with the given masks."""
    x, labels, W, V = (np.asarray(a, np.float64) for a in (x, labels, W, V))
    (m1, m2), (p1, p2) = masks, ratios
    h = x * W
    d1 = np.where(m1, h / (1 - p1), 0)
    t = np.tanh(d1)
    d2 = np.where(m2, t / (1 - p2), 0)
    y = d2 * V
    loss = np.mean((y - labels) ** 2)
    dy = 2 * (y - labels) / y.size
    dV = (dy * d2).sum(axis=0)
    dt = np.where(m2, dy * V / (1 - p2), 0)
    dh = np.where(m1, dt * (1 - t ** 2) / (1 - p1), 0)
    dW = (dh * x).sum(axis=0)
    return loss, y, W - lr * dW, V - lr * dV


def _with_outputs(model, names):
    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.graph.output.extend(oh.make_empty_tensor_value_info(n) for n in names)
    return model


@pytest.mark.parametrize("runtime", ["current", "old"])
def test_plain_session_masks_are_the_documented_generator_in_forward_and_backward(tmp_path, runtime):
    """A plain session of the step graph (no Trainer) draws exactly the masks of the generator
    the docs describe, for a seed and a step; the forward output and the SGD update are the
    float64 reference with those very masks. The gradient graph (accumulation) draws the
    micro-batch's masks and gradients."""
    model, initial = _step(seed=11)
    metadata = json.loads({e.key: e.value for e in model.metadata_props}[rewrites.METADATA_DROPOUT])
    assert metadata["seed"] == 11 and sorted(metadata["outputs"]) == ["d1", "d2"]
    masks = _mask_names()
    probe = _with_outputs(model, masks + ["y"])
    for seed, step in [(11, 1), (11, 2), (-5, 7), (2**62 + 12345, 123456)]:
        feeds = {**hyperparameter_feeds(model), **initial, **_feeds(step, seed)}
        out = _run_plain(runtime, probe, feeds, tmp_path)
        expected = _masks(seed, step, 0, [(N, D)] * 2, RATIOS)
        for name, mask in zip(masks, expected):
            np.testing.assert_array_equal(out[name], mask, err_msg=f"seed {seed} step {step}")
        loss, y, W_next, V_next = _reference_step(feeds["x"], feeds["labels"], initial["W"], initial["V"], expected)
        np.testing.assert_allclose(out["y"], y, rtol=2e-6, atol=2e-6)
        np.testing.assert_allclose(out["loss"], loss, rtol=2e-6)
        np.testing.assert_allclose(out["W.next"], W_next, rtol=2e-6, atol=2e-6)
        np.testing.assert_allclose(out["V.next"], V_next, rtol=2e-6, atol=2e-6)
    gradient = _with_outputs(build_gradient_graph(model), masks)
    feeds = {**_feeds(5, 11, micro=3), "grad_scale": np.array(1.0, np.float32),
             "W": initial["W"], "V": initial["V"], "W_grad.sum": np.zeros(D, np.float32),
             "V_grad.sum": np.zeros(D, np.float32)}
    del feeds["lr"]
    out = _run_plain(runtime, gradient, feeds, tmp_path)
    expected = _masks(11, 5, 3, [(N, D)] * 2, RATIOS)
    for name, mask in zip(masks, expected):
        np.testing.assert_array_equal(out[name], mask)
    _, _, W_next, _ = _reference_step(feeds["x"], feeds["labels"], initial["W"], initial["V"], expected, lr=1.0)
    np.testing.assert_allclose(out["W_grad.sum.next"], initial["W"] - W_next, rtol=2e-6, atol=2e-6)


def test_masks_are_bitwise_the_same_across_threads_optimization_levels_and_runtimes(tmp_path):
    """The masks: bitwise at every thread count, optimization level and onnxruntime; every
    output: bitwise across thread counts (float rounding may differ between levels, which
    fuse other float ops)."""
    model, initial = _step(seed=3, kind="adamw")
    model = _with_outputs(model, _mask_names())
    feeds = {**hyperparameter_feeds(model), **initial, **_feeds(4)}
    runs = {(runtime, threads, level): _run_plain(runtime, model, feeds, tmp_path, threads, level)
            for runtime in ("current", "old") if runtime == "current" or os.environ.get("NORMGRAD_OLD_ORT_PYTHON")
            for threads in (1, 2) for level in ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_ALL")}
    first = runs[("current", 1, "ORT_DISABLE_ALL")]
    for (runtime, threads, level), run in runs.items():
        for name in _mask_names():
            np.testing.assert_array_equal(run[name], first[name], err_msg=f"{name} {runtime} {threads} {level}")
        for name, value in runs[(runtime, 1, level)].items():
            np.testing.assert_array_equal(run[name], value, err_msg=f"{name} {runtime} {threads} {level}")


def test_keep_rate_and_independence():
    """Keep rate 1 - p within 5 standard deviations; masks of other steps, micro-batches,
    seeds and nodes agree on a fraction of elements as independent masks would."""
    n, d = 300, 400
    model, initial = _step(seed=0, ratios=(0.3, 0.3), n=n, d=d)
    masks = _mask_names(ratios=(0.3, 0.3), n=n, d=d)
    session = ort.InferenceSession(_with_outputs(model, masks).SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    base = {**hyperparameter_feeds(model), **initial, "x": rng.standard_normal((n, d)).astype(np.float32),
            "labels": np.zeros((n, d), np.float32),
            "lr": np.array(0.0, np.float32)}
    draw = lambda step, seed=0: session.run(masks, {  # noqa: E731
        **base, "step": np.array(step, np.float32), "dropout_seed": np.array(seed, np.int64)})
    size, p = n * d, 0.3
    first = draw(1)
    for mask in first + draw(2) + draw(1, seed=1):
        assert abs(mask.mean() - (1 - p)) < 5 * np.sqrt(p * (1 - p) / size), mask.mean()
    agree = p * p + (1 - p) * (1 - p)  # independent masks
    for other in (draw(2)[0], draw(1, seed=1)[0], draw(1, seed=2**40)[0], first[1]):
        assert abs((other == first[0]).mean() - agree) < 5 * np.sqrt(agree * (1 - agree) / size)
    assert np.array_equal(draw(1)[0], first[0])
    # rows and columns are not patterned: each row and column keeps about 1 - p
    rows, columns = first[0].mean(axis=1), first[0].mean(axis=0)
    assert abs(rows.mean() - (1 - p)) < 0.01 and rows.std() < 2 * np.sqrt(p * (1 - p) / d)
    assert columns.std() < 2 * np.sqrt(p * (1 - p) / n)


def test_runtime_training_mode_masks_only_in_training():
    model, initial = _step(seed=2, runtime_training=True)
    session = ort.InferenceSession(_with_outputs(model, ["d1"]).SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {**hyperparameter_feeds(model), **initial, **_feeds(1, seed=2)}
    off = session.run(["d1"], {**feeds, "training": np.array(False)})[0]
    np.testing.assert_array_equal(off, feeds["x"] * initial["W"])
    on = session.run(["d1"], {**feeds, "training": np.array(True)})[0]
    mask = _masks(2, 1, 0, [(N, D)], RATIOS[:1])[0]
    np.testing.assert_allclose(on, np.where(mask, feeds["x"] * initial["W"] / (1 - RATIOS[0]), 0), rtol=1e-6)


def _batches(steps, rng_seed=5, n=N):
    rng = np.random.default_rng(rng_seed)
    return [(rng.standard_normal((n, D)).astype(np.float32), rng.standard_normal((n, D)).astype(np.float32))
            for _ in range(steps)]


def _losses(trainer, batches):
    return [trainer.step(x, labels) for x, labels in batches]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_runs_with_one_seed_are_bitwise_the_same(accumulation):
    model, initial = _step(seed=4, kind="adamw")
    batches = _batches(4, n=accumulation * N)
    run = lambda **kw: Trainer(model, initial, lr=LR, accumulation=accumulation, **kw)  # noqa: E731
    a, b, c = run(), run(), run(seed=5)
    assert (a.seed, c.seed) == (4, 5)
    losses_a, losses_b, losses_c = _losses(a, batches), _losses(b, batches), _losses(c, batches)
    assert losses_a == losses_b
    for name, value in a.state_dict().items():
        np.testing.assert_array_equal(b.state_dict()[name], value)
    assert losses_a != losses_c


def test_trainer_step_is_the_plain_session_of_the_step_graph():
    """Trainer's first step is bitwise a plain session.run of the step graph with step 1."""
    model, initial = _step(seed=9)
    x, labels = _batches(1)[0]
    trainer = Trainer(model, initial, lr=LR, kernels=None)
    loss = trainer.step(x, labels)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    out = dict(zip(names, session.run(None, {**hyperparameter_feeds(model), **initial, "x": x, "labels": labels,
                                            "lr": np.array(LR, np.float32),
                                             "step": np.array(1, np.float32),
                                             "dropout_seed": np.array(9, np.int64)})))
    assert np.float32(loss) == out["loss"]
    for name, value in trainer.state_dict().items():
        np.testing.assert_array_equal(value, out[f"{name}.next"])


@pytest.mark.parametrize("accumulation", [1, 2])
def test_resume_from_checkpoint_is_bitwise_the_uninterrupted_run(tmp_path, accumulation):
    model, initial = _step(seed=0, kind="adamw")
    batches = _batches(7, n=accumulation * N)
    straight = Trainer(model, initial, lr=LR, accumulation=accumulation, seed=21)
    expected = _losses(straight, batches)
    first = Trainer(model, initial, lr=LR, accumulation=accumulation, seed=21)
    losses = _losses(first, batches[:4])
    first.save(tmp_path / "mid.ckpt")
    assert checkpoint.load(tmp_path / "mid.ckpt").metadata[SEED_METADATA] == "21"
    resumed = Trainer(model, tmp_path / "mid.ckpt", lr=LR, accumulation=accumulation)  # seed from the checkpoint
    assert (resumed.seed, resumed.step_count) == (21, 4)
    losses += _losses(resumed, batches[4:])
    assert losses == expected
    for name, value in straight.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[name], value, err_msg=name)


def test_seed_errors_and_inference_model(tmp_path):
    model, initial = _step(seed=1)
    for bad in (1.5, True, 2**63, "3"):
        with pytest.raises(TrainerError, match="seed"):
            Trainer(model, initial, seed=bad)
    with pytest.raises(ValueError, match="int64"):
        _step(seed=2**64)
    checkpoint.save(tmp_path / "bad.ckpt", initial, {SEED_METADATA: "x"})
    with pytest.raises(TrainerError, match=SEED_METADATA):
        Trainer(model, tmp_path / "bad.ckpt")
    trainer = Trainer(model, initial, lr=LR)
    x, _ = _batches(1)[0]
    served = ort.InferenceSession(trainer.inference_model().SerializeToString(), providers=["CPUExecutionProvider"])
    W, V = initial["W"].astype(np.float64), initial["V"].astype(np.float64)
    np.testing.assert_allclose(served.run(None, {"x": x})[0], np.tanh(x * W) * V, rtol=1e-6, atol=1e-6)


def test_export_seed_option(tmp_path):
    from normgrad.tools.cli import main

    onnx.save(_forward(), tmp_path / "net.onnx")
    for seed in (None, 7):
        out = tmp_path / f"step_{seed}.onnx"
        args = ["export", str(tmp_path / "net.onnx"), "-o", str(out), "--loss", "mse", "--optimizer", "sgd"]
        assert main(args + ([] if seed is None else ["--seed", str(seed)])) == 0
        step = onnx.load(out)
        assert json.loads({e.key: e.value for e in step.metadata_props}[rewrites.METADATA_DROPOUT])["seed"] == (seed or 0)
        assert Trainer(step, tmp_path / f"step_{seed}.ckpt").seed == (seed or 0)
    for bad in (["--optimizer", "sgd", "--seed", "1e3"], ["--optimizer", "sgd", "--seed", str(2**63)], ["--seed", "3"]):
        assert main(["export", str(tmp_path / "net.onnx"), "-o", str(tmp_path / "x.onnx"), "--loss", "mse", *bad]) == 2
    assert not (tmp_path / "x.onnx").exists()
