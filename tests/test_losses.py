"""The elementwise losses against torch.nn.functional and float64 finite differences."""

import numpy as np
import onnx.helper as oh
import onnxruntime as ort
import pytest

from normgrad.graphs import TrainingGraph, build_training_graph, examples


def _outputs(training: TrainingGraph, names, batch):
    """Outputs ``names`` of ``training`` run in onnxruntime with its weights and ``batch``."""
    session = ort.InferenceSession(training.model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(names, training.feeds(batch))


def _run(loss, x, labels):
    training = build_training_graph(examples.mlp(), loss=loss)
    y, value, w2_grad = _outputs(training, ["y", "loss", "w2_grad"], {"x": x, "labels": labels})
    return y, float(value), w2_grad


def _labels(loss, rng, shape):
    if loss == "bce_with_logits":
        return rng.uniform(0, 1, shape).astype(np.float32)
    return (rng.standard_normal(shape) * 2).astype(np.float32)


@pytest.mark.parametrize("loss", ["bce_with_logits", "l1", "smooth_l1"])
def test_loss_matches_torch(loss):
    torch = pytest.importorskip("torch")
    functional = {"bce_with_logits": torch.nn.functional.binary_cross_entropy_with_logits,
                  "l1": torch.nn.functional.l1_loss, "smooth_l1": torch.nn.functional.smooth_l1_loss}[loss]
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 5)) * 3).astype(np.float32)
    y, value, _ = _run(loss, x, labels := _labels(loss, rng, (6, 3)))
    y_torch = torch.tensor(y.astype(np.float64), requires_grad=True)
    expected = functional(y_torch, torch.tensor(labels.astype(np.float64)))
    assert abs(value - expected.item()) <= 1e-6 * max(1.0, abs(expected.item()))


@pytest.mark.parametrize("loss", ["bce_with_logits", "l1", "smooth_l1"])
def test_loss_gradient_matches_finite_differences(loss):
    """d loss / d b2 in the graph vs float64 central differences of the loss through the graph's own forward."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((6, 5)) * 3).astype(np.float32)
    labels = _labels(loss, rng, (6, 3))
    training = build_training_graph(examples.mlp(), loss=loss)
    y, b2_grad = _outputs(training, ["y", "b2_grad"], {"x": x, "labels": labels})
    y64, t = y.astype(np.float64), labels.astype(np.float64)

    def loss64(shift):
        d = y64 + shift - t
        if loss == "bce_with_logits":
            z = y64 + shift
            return np.mean(np.maximum(z, 0) - z * t + np.log1p(np.exp(-np.abs(z))))
        if loss == "l1":
            return np.mean(np.abs(d))
        return np.mean(np.where(np.abs(d) < 1, 0.5 * d * d, np.abs(d) - 0.5))

    h = 1e-6
    expected = np.array([(loss64(h * np.eye(3)[j]) - loss64(-h * np.eye(3)[j])) / (2 * h) for j in range(3)])
    np.testing.assert_allclose(b2_grad, expected, rtol=0, atol=1e-5 * max(1.0, np.abs(expected).max()))


def _additive_model(shape):
    """y = x + b: the graph's x_grad is dloss/dy itself, sample by sample."""
    channels = shape[1]
    bias = np.linspace(-1, 1, channels).astype(np.float32).reshape([channels] + [1] * (len(shape) - 2))
    return examples.model([oh.make_node("Add", ["x", "b"], ["y"])], {"x": shape}, ["y"], {"b": bias})


def _cross_entropy64(y, labels, label_smoothing, ignore_index):
    """float64 NumPy cross_entropy as torch defines it (mean over samples not ignored)."""
    log_probs = y - y.max(axis=1, keepdims=True)
    log_probs = log_probs - np.log(np.exp(log_probs).sum(axis=1, keepdims=True))
    valid = labels != ignore_index if ignore_index is not None else np.ones(labels.shape, bool)
    picked = np.take_along_axis(log_probs, np.expand_dims(np.where(valid, labels, 0), 1), axis=1)[:, 0]
    per_sample = (1 - label_smoothing) * -picked + label_smoothing / y.shape[1] * -log_probs.sum(axis=1)
    return per_sample[valid].sum() / valid.sum()


CROSS_ENTROPY_CASES = [
    ((6, 5), dict(label_smoothing=0.2)),
    ((6, 5), dict(ignore_index=-100)),
    ((6, 5), dict(label_smoothing=0.1, ignore_index=2)),
    ((4, 5, 3), dict(label_smoothing=0.3, ignore_index=-100)),
]


def _cross_entropy_case(shape, options, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2).astype(np.float32)
    labels = rng.integers(0, shape[1], (shape[0],) + shape[2:])
    ignore = options.get("ignore_index")
    if ignore is not None:
        labels.flat[::3] = ignore  # every third sample ignored
    training = build_training_graph(_additive_model(shape), loss="cross_entropy", loss_options=options)
    y, value, x_grad = _outputs(training, ["y", "loss", "x_grad"], {"x": x, "labels": labels})
    return y, labels, float(value), x_grad


@pytest.mark.parametrize("shape,options", CROSS_ENTROPY_CASES)
def test_cross_entropy_options_match_torch(shape, options):
    torch = pytest.importorskip("torch")
    y, labels, value, x_grad = _cross_entropy_case(shape, options, 5)
    y_torch = torch.tensor(y.astype(np.float64), requires_grad=True)
    expected = torch.nn.functional.cross_entropy(y_torch, torch.tensor(labels), **{"ignore_index": -100, **options})
    expected.backward()
    assert abs(value - expected.item()) <= 1e-6 * max(1.0, abs(expected.item()))
    scale = np.abs(y_torch.grad.numpy()).max()
    np.testing.assert_allclose(x_grad, y_torch.grad.numpy(), rtol=0, atol=1e-6 * scale)
    if "ignore_index" in options:  # ignored samples get exactly no gradient
        ignored = np.moveaxis(x_grad, 1, -1)[labels == options["ignore_index"]]
        assert ignored.size and not ignored.any()


@pytest.mark.parametrize("shape,options", CROSS_ENTROPY_CASES)
def test_cross_entropy_options_gradient_matches_finite_differences(shape, options):
    y, labels, value, x_grad = _cross_entropy_case(shape, options, 6)
    y64 = y.astype(np.float64)
    args = (labels, options.get("label_smoothing", 0.0), options.get("ignore_index"))
    assert abs(value - _cross_entropy64(y64, *args)) <= 1e-6 * max(1.0, abs(value))
    h, expected = 1e-6, np.zeros_like(y64)
    for index in np.ndindex(y64.shape):
        shift = np.zeros_like(y64)
        shift[index] = h
        expected[index] = (_cross_entropy64(y64 + shift, *args) - _cross_entropy64(y64 - shift, *args)) / (2 * h)
    np.testing.assert_allclose(x_grad, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("options", [{}, dict(ignore_index=-100)])
def test_cross_entropy_of_far_apart_logits_matches_float64(options):
    """Logits spread over hundreds (labels' probabilities far below float32's smallest, large
    offsets): each sample's log-probability still matches float64, and a sample with a
    non-finite logit makes the loss non-finite."""
    rng = np.random.default_rng(7)
    shape = (64, 300)
    x = (rng.standard_normal(shape) * 60 + rng.uniform(-500, 500, (shape[0], 1))).astype(np.float32)
    labels = rng.integers(0, shape[1], shape[0])
    training = build_training_graph(_additive_model(shape), loss="cross_entropy", loss_options=options)
    y, value = _outputs(training, ["y", "loss"], {"x": x, "labels": labels})
    expected = _cross_entropy64(y.astype(np.float64), labels, 0.0, None)
    assert expected > 150  # most labels' probabilities underflow float32
    assert abs(float(value) - expected) <= 1e-6 * expected
    for bad in (np.nan, np.inf, -np.inf):
        broken = x.copy()
        broken[5, :] = -np.inf if bad == -np.inf else broken[5, :]  # -inf: a row with no finite logit
        if bad != -np.inf:
            broken[5, 3] = bad
        (value,) = _outputs(training, ["loss"], {"x": broken, "labels": labels})
        assert not np.isfinite(value), bad


@pytest.mark.parametrize("beta", [0.0, 0.5, 2.0])
def test_smooth_l1_beta_matches_torch_and_finite_differences(beta):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((6, 4)) * 2).astype(np.float32)
    labels = (rng.standard_normal((6, 4)) * 2).astype(np.float32)
    training = build_training_graph(_additive_model((6, 4)), loss="smooth_l1", loss_options={"beta": beta})
    y, value, x_grad = _outputs(training, ["y", "loss", "x_grad"], {"x": x, "labels": labels})
    d = y.astype(np.float64) - labels

    def loss64(d):
        if beta == 0:
            return np.mean(np.abs(d))
        return np.mean(np.where(np.abs(d) < beta, 0.5 * d * d / beta, np.abs(d) - 0.5 * beta))

    assert abs(float(value) - loss64(d)) <= 1e-6 * max(1.0, loss64(d))
    h = 1e-6
    expected = np.array([(loss64(d + h * e) - loss64(d - h * e)) / (2 * h)
                         for e in np.eye(d.size).reshape((d.size,) + d.shape)]).reshape(d.shape)
    np.testing.assert_allclose(x_grad, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    torch = pytest.importorskip("torch")
    y_torch = torch.tensor(y.astype(np.float64), requires_grad=True)
    torch_loss = torch.nn.functional.smooth_l1_loss(y_torch, torch.tensor(labels.astype(np.float64)), beta=beta)
    torch_loss.backward()
    assert abs(float(value) - torch_loss.item()) <= 1e-6 * max(1.0, torch_loss.item())
    np.testing.assert_allclose(x_grad, y_torch.grad.numpy(), rtol=0, atol=1e-6 * np.abs(expected).max())


def test_bad_loss_options():
    with pytest.raises(ValueError, match="no option 'beta'"):
        build_training_graph(examples.mlp(), loss="mse", loss_options={"beta": 1.0})
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        build_training_graph(examples.mlp(), loss="cross_entropy", loss_options={"label_smoothing": 1.5})
    with pytest.raises(ValueError, match="beta must be >= 0"):
        build_training_graph(examples.mlp(), loss="smooth_l1", loss_options={"beta": -1.0})


@pytest.mark.parametrize("loss_name", ["total", "loss"])
def test_loss_output_gradients_equal_the_mse_loss(loss_name):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    target = rng.standard_normal((4, 3)).astype(np.float32)
    own = build_training_graph(examples.mlp_with_loss(loss_name), loss_output=loss_name)
    assert "labels" not in {i.name for i in own.model.graph.input}
    names = ["loss", "w1_grad", "b1_grad", "w2_grad", "b2_grad"]
    got = dict(zip(names, _outputs(own, names, {"x": x, "target": target})))
    mse = build_training_graph(examples.mlp(), loss="mse")
    expected = dict(zip(names, _outputs(mse, names, {"x": x, "labels": target})))
    for name in names:
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-6 * max(1.0, np.abs(expected[name]).max()))


def test_bad_loss_output():
    model = examples.mlp_with_loss()
    with pytest.raises(ValueError, match="'nope' is not an output"):
        build_training_graph(model, loss_output="nope")
    with pytest.raises(ValueError, match=r"'y' must be a scalar \(shape \[\]\); its shape is \[4, 3\]"):
        build_training_graph(model, loss_output="y")
    with pytest.raises(ValueError, match="not both"):
        build_training_graph(model, loss="mse", loss_output="total")


def test_cli_loss_flags(tmp_path, capsys):
    import onnx
    from normgrad.tools import export as export_tool

    source = tmp_path / "mlp.onnx"
    onnx.save(examples.mlp(), str(source))
    target = tmp_path / "out.onnx"
    assert export_tool.main([str(source), "-o", str(target), "--loss", "cross_entropy",
                             "--label-smoothing", "0.1", "--ignore-index", "-100"]) == 0
    meta = {p.key: p.value for p in onnx.load(str(target)).metadata_props}
    assert '"label_smoothing": 0.1' in meta["normgrad.loss"] and '"ignore_index": -100' in meta["normgrad.loss"]
    for argv in (["--loss", "mse", "--beta", "1"], ["--loss", "cross_entropy", "--label-smoothing", "2"],
                 ["--loss", "mse", "--loss-output", "y"]):
        with pytest.raises(SystemExit) as usage:
            export_tool.main([str(source), "-o", str(target)] + argv)
        assert usage.value.code == 2
    capsys.readouterr()
    assert export_tool.main([str(source), "-o", str(tmp_path / "own.onnx"), "--loss-output", "y"]) == 1
    error = capsys.readouterr().err
    assert "must be a scalar" in error and error.strip().count("\n") == 0


def _causal_lm64(logits, labels, ignore_index=-100):
    """float64 NumPy: position t predicts label t + 1, mean over the predictions not ignored."""
    targets = np.concatenate([labels[:, 1:], np.full((labels.shape[0], 1), ignore_index)], axis=1)
    return _cross_entropy64(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), 0.0, ignore_index)


@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_causal_lm_matches_transformers_and_finite_differences(ignore_index):
    """causal_lm against transformers' own ForCausalLMLoss (torch autograd, float64) and float64
    central differences; positions whose next label is ignored (and the last) get exactly no gradient."""
    rng = np.random.default_rng(9)
    shape = (3, 5, 7)
    x = (rng.standard_normal(shape) * 2).astype(np.float32)
    labels = rng.integers(0, shape[2], shape[:2])
    labels[0, 2] = labels[1, :2] = ignore_index
    options = {} if ignore_index == -100 else {"ignore_index": ignore_index}
    training = build_training_graph(_additive_model(shape), loss="causal_lm", loss_options=options)
    assert [d.dim_value for d in next(i for i in training.model.graph.input if i.name == "labels").type.tensor_type.shape.dim] == [3, 5]
    y, value, x_grad = _outputs(training, ["y", "loss", "x_grad"], {"x": x, "labels": labels})
    y64 = y.astype(np.float64)
    assert abs(value - _causal_lm64(y64, labels, ignore_index)) <= 1e-6 * max(1.0, abs(value))
    h, expected = 1e-6, np.zeros_like(y64)
    for index in np.ndindex(y64.shape):
        shift = np.zeros_like(y64)
        shift[index] = h
        expected[index] = (_causal_lm64(y64 + shift, labels, ignore_index)
                           - _causal_lm64(y64 - shift, labels, ignore_index)) / (2 * h)
    np.testing.assert_allclose(x_grad, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    assert not x_grad[:, -1].any() and not x_grad[0, 1].any() and not x_grad[1, :1].any()

    torch = pytest.importorskip("torch")
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    y_torch = torch.tensor(y64, requires_grad=True)
    reference = loss_utils.ForCausalLMLoss(y_torch, torch.tensor(labels), shape[2], ignore_index=ignore_index)
    reference.backward()
    assert abs(value - reference.item()) <= 1e-6 * max(1.0, abs(reference.item()))
    np.testing.assert_allclose(x_grad, y_torch.grad.numpy(), rtol=0, atol=1e-6 * np.abs(y_torch.grad.numpy()).max())


def test_causal_lm_needs_logits_of_rank_3():
    with pytest.raises(ValueError, match=r"causal_lm needs logits of rank 3 \(\[batch, sequence, vocabulary\]\)"):
        build_training_graph(examples.mlp(), loss="causal_lm")
