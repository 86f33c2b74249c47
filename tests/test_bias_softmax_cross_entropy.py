"""BiasSoftmaxCrossEntropy (ops/bias_softmax_cross_entropy.py): every backend against the
float64 cross-entropy of logits + bias (tests/test_softmax_cross_entropy.py's) and dlogits'
float64 column sums; loss and dlogits bitwise what Add then SoftmaxCrossEntropy give on the
same backend; torch's cross_entropy and autograd for both inputs; the C++ loops bitwise at 1,
2 and 4 threads; bad inputs named; the step graphs: a bias Add before a cross_entropy loss
goes into the loss node (no Add over [N, C], no ReduceSum for the bias), only when nothing
else reads it, and the step matches the previous graph's and torch's."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx.helper as oh
import onnxruntime as ort
import onnx.numpy_helper as onh
import pytest

from _helpers import OPTIMIZATION_LEVELS as LEVELS
from _helpers import cpp_available, cpp_error, cpp_results_by_loop_and_threads, step_outputs
from normgrad.graphs import build_step_graph, build_training_graph, examples, losses
from normgrad.graphs.optimizers import hyperparameter_feeds
from normgrad.graphs.portable import make_portable
from normgrad.ops import DOMAIN, NormgradInputError, bias_softmax_cross_entropy, harness
from _softmax_cross_entropy_cases import CASES, _case, _truth
from _softmax_cross_entropy_cases import _compare as _compare_plain

OP = bias_softmax_cross_entropy.OP_TYPE
PLAIN = "SoftmaxCrossEntropy"
KERNELS = ["python"] + (["cpp"] if cpp_available() else [])
BACKENDS = ["reference", "evaluator", "functions"] + KERNELS
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")


def _bias(classes, seed=0, spread=2.0):
    return (np.random.default_rng(seed + 100).standard_normal(classes) * spread).astype(np.float32)


def _run(backend, x, labels, bias, attributes, threads=None):
    return harness.run(backend, OP, {"logits": x, "labels": labels, "bias": bias}, attributes=attributes,
                       threads=threads)


def _compare(out, x, labels, bias, ignore):
    """loss and dlogits as tests/test_softmax_cross_entropy.py's float64 truth of x + bias
    (added in float32, as the Add); dbias as the float64 column sums of that truth."""
    _compare_plain(np.asarray(out["loss"]), out["dlogits"], x + bias, labels, ignore)
    expected_grad = _truth(x + bias, labels, ignore)[1]
    assert out["dbias"].shape == bias.shape and out["dbias"].dtype == np.float32
    with np.errstate(invalid="ignore"):
        expected_dbias = expected_grad.sum(axis=0)
    # each column sum within the float32 rounding of its terms' magnitudes
    np.testing.assert_allclose(out["dbias"], expected_dbias, rtol=0,
                               atol=1e-6 * np.abs(expected_grad).sum(axis=0).max(initial=0) + 1e-7, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASES)
def test_every_backend_matches_float64(backend, name):
    x, labels, attributes, ignore = _case(name)
    if backend == "python" and name == "large C":
        x, labels = x[:8], labels[:8]
    bias = _bias(x.shape[1])
    _compare(_run(backend, x, labels, bias, attributes), x, labels, bias, ignore)


@pytest.mark.parametrize("backend", ["functions"] + KERNELS)
@pytest.mark.parametrize("name", ["odd", "large C", "far apart", "nan", "+inf", "-inf", "ignore -100", "all ignored"])
def test_loss_and_dlogits_are_bitwise_add_then_softmax_cross_entropy(backend, name):
    """The same backend's SoftmaxCrossEntropy of the float32 x + bias: the same bits, NaN
    rows included (a NaN logit gives a NaN loss, which the trust gate rejects, as before)."""
    x, labels, attributes, _ = _case(name, seed=5)
    if backend == "python" and name == "large C":
        x, labels = x[:8], labels[:8]
    bias = _bias(x.shape[1], seed=5)
    ours = _run(backend, x, labels, bias, attributes)
    plain = harness.run(backend, PLAIN, {"logits": x + bias, "labels": labels}, attributes=attributes)
    for name_ in ("loss", "dlogits"):
        assert np.asarray(ours[name_]).tobytes() == np.asarray(plain[name_]).tobytes(), name_
    if name in ("nan", "+inf"):
        assert np.isnan(ours["loss"]).all() and np.isnan(ours["dlogits"][3]).all() and np.isnan(ours["dbias"]).all()


@pytest.mark.parametrize("backend", ["functions"] + KERNELS)
@pytest.mark.parametrize("name", ["odd", "ignore -100", "ignore a class", "-inf"])
def test_matches_torch_cross_entropy_and_autograd(backend, name):
    torch = pytest.importorskip("torch")
    x, labels, attributes, ignore = _case(name, seed=6)
    bias = _bias(x.shape[1], seed=6)
    out = _run(backend, x, labels, bias, attributes)
    logits = torch.tensor(x.astype(np.float64), requires_grad=True)
    b = torch.tensor(bias.astype(np.float64), requires_grad=True)
    loss = torch.nn.functional.cross_entropy(logits + b, torch.tensor(labels),
                                             ignore_index=-100 if ignore is None else ignore)
    loss.backward()
    if torch.isfinite(loss):
        assert abs(out["loss"].item() - loss.item()) <= 2e-6 * max(1.0, abs(loss.item()))
    else:
        assert out["loss"].item() == loss.item()
    np.testing.assert_allclose(out["dlogits"], logits.grad.numpy(), rtol=2e-5, atol=1e-6 / len(labels))
    np.testing.assert_allclose(out["dbias"], b.grad.numpy(), rtol=2e-5, atol=1e-6)


def test_reference_bias_gradient_is_finite_differences():
    """d loss / d bias of the reference by central float64 differences."""
    rng = np.random.default_rng(7)
    x, labels, bias = rng.standard_normal((6, 5)), rng.integers(0, 5, 6), rng.standard_normal(5)
    loss = lambda b: bias_softmax_cross_entropy.reference(x, labels, b).loss  # noqa: E731
    step = 1e-6
    numeric = [(loss(bias + step * e) - loss(bias - step * e)) / (2 * step) for e in np.eye(5)]
    np.testing.assert_allclose(bias_softmax_cross_entropy.reference(x, labels, bias).dbias, numeric, rtol=1e-7,
                               atol=1e-9)


_RUN_CPP = """
import sys, numpy as np
from normgrad.ops import harness
rng = np.random.default_rng(0)
x = (rng.standard_normal((101, 4099)) * 4).astype(np.float32)
bias = rng.standard_normal(4099).astype(np.float32)
labels = rng.integers(0, 4099, 101)
labels[::5] = -100
out = harness.run("cpp", "BiasSoftmaxCrossEntropy", {"logits": x, "labels": labels, "bias": bias},
                  attributes={"ignore_index": -100}, threads=int(sys.argv[2]))
np.save(sys.argv[1], np.concatenate([out["dlogits"].ravel(), out["dbias"], np.atleast_1d(out["loss"])]))
"""


@needs_cpp
def test_cpp_lanes_and_thread_counts_give_the_same_bits(tmp_path):
    """The portable lanes and the AVX2 ones at 1, 2 and 4 threads: bitwise the same loss,
    dlogits and dbias (101 rows: four blocks of rows and a short one; a row tail)."""
    results = cpp_results_by_loop_and_threads(tmp_path, _RUN_CPP)
    first = results["generic", 1]
    for where, value in results.items():
        assert value.tobytes() == first.tobytes(), where
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((101, 4099)) * 4).astype(np.float32)
    bias = rng.standard_normal(4099).astype(np.float32)
    labels = rng.integers(0, 4099, 101)
    labels[::5] = -100
    out = {"dlogits": first[:x.size].reshape(x.shape), "dbias": first[x.size:-1], "loss": first[-1]}
    _compare(out, x, labels, bias, -100)


_X, _LABELS, _B = np.zeros((3, 4), np.float32), np.array([0, 3, 1]), np.zeros(4, np.float32)
BAD = {
    "bias too short": ({"bias": np.zeros(3, np.float32)}, "bias",
                       "must have shape [4] (one value per column of 'logits'); got [3]"),
    "bias rank 2": ({"bias": np.zeros((1, 4), np.float32)}, "bias", "must have rank 1"),
    "label too large": ({"labels": np.array([0, 4, 1])}, "labels", "must hold class indices in [0, 4); got 4 at row 1"),
    "logits rank 3": ({"logits": np.zeros((3, 4, 1), np.float32)}, "logits", "must have rank 2"),
}


@needs_cpp
@pytest.mark.parametrize("case", BAD)
def test_cpp_bad_input_names_the_input(case):
    changed, name, rule = BAD[case]
    message = cpp_error(OP, {"logits": _X, "labels": _LABELS, "bias": _B, **changed})
    assert f"{OP}: input '{name}' {rule}" in message, message


@pytest.mark.parametrize("case", BAD)
def test_validate_names_the_input(case):
    changed, name, rule = BAD[case]
    if case == "bias rank 2":
        rule = "must have shape [4] (one value per column of 'logits'); got [1, 4]"
    with pytest.raises(NormgradInputError, match=re.escape(f"{OP}: input '{name}' {rule}")):
        bias_softmax_cross_entropy.reference(**{"logits": _X, "labels": _LABELS, "bias": _B, **changed})


# -- the step graphs ------------------------------------------------------------------------------


def _head(shape=(3, 4, 6), classes=11, reshaped=True, trainable_bias=True, extra_reader=False, seed=0):
    """h = x W; y = h + b (as [B, S, C]), then Reshape to [B * S, C] (``reshaped``), the model output."""
    rng = np.random.default_rng(seed)
    inits = {"w": (rng.standard_normal((shape[-1], classes)) * 0.5).astype(np.float32),
             "b": (rng.standard_normal(classes)).astype(np.float32)}
    nodes = [oh.make_node("MatMul", ["x", "w"], ["h"]), oh.make_node("Add", ["h", "b"], ["z"])]
    outputs = ["y"]
    if reshaped:
        inits["rows"] = np.array([-1, classes], np.int64)
        nodes.append(oh.make_node("Reshape", ["z", "rows"], ["y"]))
    else:
        nodes[-1].output[0] = "y"
    if extra_reader:  # the biased value read by another output too
        nodes.append(oh.make_node("Relu", ["z"], ["other"]))
        outputs.append("other")
    model = examples.model(nodes, {"x": shape}, outputs, inits)
    if not trainable_bias:  # a constant bias: not a weight
        b = next(i for i in model.graph.initializer if i.name == "b")
        model.graph.initializer.remove(b)
        model.graph.node.insert(0, oh.make_node("Constant", [], ["b"], value=b))
    return model


def _ops(model, domain=None):
    return [n.op_type for n in model.graph.node if domain is None or n.domain == domain]


def _step(forward, absorbed=True, **options):
    if absorbed:
        return build_step_graph(build_training_graph(forward, loss="cross_entropy", **options), "sgd")
    original = losses.bias_add_before
    losses.bias_add_before = lambda *args: None
    try:
        return build_step_graph(build_training_graph(forward, loss="cross_entropy", **options), "sgd")
    finally:
        losses.bias_add_before = original


def _feeds(step, initial, shape, classes, seed=1, ignore=None):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, int(np.prod(shape[:-1])))
    if ignore is not None:
        labels[::3] = ignore
    return {**hyperparameter_feeds(step), **initial, "x": rng.standard_normal(shape).astype(np.float32),
            "labels": labels, "lr": np.array(0.5, np.float32), "step": np.array(1, np.float32)}


@pytest.mark.parametrize("ignore", [None, 2])
def test_step_graph_absorbs_the_bias_and_matches_the_previous_graph(ignore):
    """One BiasSoftmaxCrossEntropy, no Add and no ReduceSum left in the default step graph;
    at every optimization level, with each kernel choice, the loss and updated weights match
    the graph without the absorption (bitwise the C++ kernel's loss; to float32 rounding the
    weights: the bias's sum is blocked differently) and the C++ step is bitwise the same at 1, 2 and 4 threads."""
    shape, classes = (3, 4, 6), 11
    options = {} if ignore is None else {"loss_options": {"ignore_index": ignore}}
    step, initial = _step(_head(), **options)
    previous, _ = _step(_head(), absorbed=False, **options)
    assert _ops(step, DOMAIN).count(OP) == 1 and PLAIN not in _ops(step)
    assert "Add" not in _ops(step, "") and "ReduceSum" not in _ops(step, "")
    assert "Add" in _ops(previous, "") and "ReduceSum" in _ops(previous, "")
    feeds = _feeds(step, initial, shape, classes, ignore=ignore)
    expected = step_outputs(previous, feeds, "cpp" if cpp_available() else None, "ORT_DISABLE_ALL")
    assert np.isfinite(expected["loss"]) and all(np.isfinite(v).all() for v in expected.values())
    for kernels in KERNELS + [None]:
        for level in LEVELS:
            got = step_outputs(step, feeds, kernels, level)
            where = f"{kernels} {level}"
            if kernels == "cpp":  # the same kernel on the same float32 logits + bias
                assert got["loss"].tobytes() == expected["loss"].tobytes(), where
            np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-6, err_msg=where)
            for name in ("w.next", "b.next"):
                np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-7, err_msg=f"{where} {name}")
    if cpp_available():
        outputs = [step_outputs(step, feeds, "cpp", "ORT_ENABLE_ALL", threads) for threads in (1, 2, 4)]
        for other in outputs[1:]:
            for name in outputs[0]:
                assert other[name].tobytes() == outputs[0][name].tobytes(), name


def test_step_matches_torch():
    """The loss and both weights' gradients (SGD, lr 1) are torch's."""
    torch = pytest.importorskip("torch")
    shape, classes = (3, 4, 6), 11
    forward = _head()
    step, initial = _step(forward)
    feeds = {**_feeds(step, initial, shape, classes), "lr": np.array(1.0, np.float32)}
    got = step_outputs(step, feeds, "cpp" if cpp_available() else "python", "ORT_ENABLE_ALL")
    inits = {i.name: torch.tensor(onh.to_array(i), requires_grad=True) for i in forward.graph.initializer
             if i.name in ("w", "b")}
    logits = (torch.tensor(feeds["x"]) @ inits["w"] + inits["b"]).reshape(-1, classes)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(feeds["labels"]))
    loss.backward()
    assert abs(float(got["loss"]) - loss.item()) <= 1e-6 * max(1.0, loss.item())
    for name in ("w", "b"):
        np.testing.assert_allclose(initial[name] - got[name + ".next"], inits[name].grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["not reshaped", "constant bias"])
def test_other_heads_absorbed(case):
    """An Add that is the output itself; a bias that is a constant, not a weight (its
    gradient unused): both absorbed, and the weight's update matches the previous graph."""
    forward = _head((12, 6), reshaped=False) if case == "not reshaped" else _head(trainable_bias=False)
    shape = (12, 6) if case == "not reshaped" else (3, 4, 6)
    step, initial = _step(forward)
    previous, _ = _step(forward, absorbed=False)
    assert OP in _ops(step) and "Add" not in _ops(step, "")
    feeds = _feeds(step, initial, shape, 11)
    expected = step_outputs(previous, feeds, None, "ORT_ENABLE_ALL")
    for kernels in KERNELS + [None]:
        got = step_outputs(step, feeds, kernels, "ORT_ENABLE_ALL")
        np.testing.assert_allclose(got["w.next"], expected["w.next"], rtol=1e-6, atol=1e-7, err_msg=str(kernels))


def test_bias_add_read_elsewhere_keeps_todays_graph():
    """The biased value read by another output: the Add stays and the loss reads its result."""
    training = build_training_graph(_head(extra_reader=True), loss="cross_entropy")
    assert OP not in _ops(training.model) and PLAIN in _ops(training.model)


def test_training_graph_keeps_the_forward_add_for_its_output():
    """The training graph still outputs the biased logits (its Add stays; the step graph,
    which does not output them, drops it); the exported forward model is untouched."""
    forward = _head()
    before = forward.SerializeToString()
    training = build_training_graph(forward, loss="cross_entropy")
    assert forward.SerializeToString() == before
    assert OP in _ops(training.model) and "Add" in _ops(training.model, "")
    assert "y" in [o.name for o in training.model.graph.output]


def test_portable_and_inline_forms_are_standard_ops():
    """``--portable`` writes the body (Add, SoftmaxCrossEntropy's standard ops, ReduceSum over
    axis 0); ``--inline`` the same; both step like the default form."""
    forward = _head()
    step, initial = _step(forward)
    portable, _ = make_portable(step)
    inline, _ = build_step_graph(build_training_graph(forward, loss="cross_entropy", inline=True), "sgd")
    feeds = _feeds(step, initial, (3, 4, 6), 11)
    expected = step_outputs(step, feeds, None, "ORT_ENABLE_ALL")
    for form in (portable, inline):
        assert not {OP, PLAIN} & set(_ops(form, DOMAIN)) and "Add" in _ops(form) and "ReduceSum" in _ops(form)
        # (the portable form's weight_decay is float32)
        got = step_outputs(form, {**feeds, **{k: v for k, v in hyperparameter_feeds(form).items() if k != "lr"}}, None,
                           "ORT_ENABLE_ALL")
        for name in expected:
            np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


# -- exported heads ------------------------------------------------------------------------------


def _torch_head(kind):
    """A tiny transformers BertForMaskedLM (its decoder bias tied to cls.predictions.bias) whose logits are flattened to [N, vocabulary] (as
    the bench's), or a plain classifier Linear(16, 7) with bias."""
    import torch

    torch.manual_seed(0)
    if kind == "classifier":
        return torch.nn.Linear(16, 7), torch.randn(8, 16), 7
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=8, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    model = transformers.BertForMaskedLM(config).train()
    with torch.no_grad():  # a bias far from zero, so its gradient's path shows
        model.cls.predictions.decoder.bias.add_(torch.randn(50))

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            logits = self.model(input_ids=input_ids).logits
            return logits.reshape(-1, logits.shape[-1])

    return Logits(), torch.randint(0, 50, (2, 8)), 50


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("kind", ["bert", "classifier"])
def test_exported_heads_match_torch(kind, exporter, tmp_path):
    """BERT's masked-LM head (MatMul, Add of the decoder bias, Reshape) from both exporters:
    the default step graph's loss node reads the decoder bias and no Add does; a Linear with
    bias (one Gemm with C from both exporters, nothing to absorb) keeps SoftmaxCrossEntropy.
    Either way the loss and every weight's gradient are torch's."""
    torch = pytest.importorskip("torch")

    import normgrad.torch
    from _graph_models import run_training

    module, x, classes = _torch_head(kind)
    forward = normgrad.torch.export(module, (x,), tmp_path / "forward.onnx", exporter=exporter, input_names=["x"],
                                    output_names=["logits"])
    training = build_training_graph(forward, loss="cross_entropy")
    step, _ = build_step_graph(training, "sgd")
    torch_names = json.loads(next(p.value for p in forward.metadata_props if p.key == "normgrad.torch_parameters"))
    absorbed = kind == "bert"  # both exporters write the classifier as one Gemm with C
    assert (OP in _ops(step)) == absorbed and (PLAIN in _ops(step)) != absorbed, _ops(step)
    if absorbed:  # the node reads the decoder's bias, which no Add reads any more
        (bias,) = [name for name, torch_name in torch_names.items() if torch_name.endswith(("decoder.bias", "predictions.bias"))]
        (node,) = [n for n in step.graph.node if n.op_type == OP]
        assert node.input[2] == bias and not any(n.op_type == "Add" and bias in n.input for n in step.graph.node)
    labels = np.random.default_rng(0).integers(0, classes, x.shape[0] * (x.shape[1] if kind == "bert" else 1))
    results = run_training(training, {"x": x.numpy(), "labels": labels})
    module.zero_grad()
    loss = torch.nn.functional.cross_entropy(module(x), torch.tensor(labels))
    loss.backward()
    assert abs(float(results["loss"]) - loss.item()) <= 1e-5 * max(1.0, loss.item())
    gradient_of = json.loads(next(p.value for p in training.model.metadata_props if p.key == "normgrad.gradients"))
    parameters = dict(module.named_parameters())
    # (some gradients are 0 but for rounding, attention's key bias: measured against the largest)
    largest = max(float(p.grad.abs().max()) for p in parameters.values() if p.grad is not None)
    compared = 0
    weights = {grad_name: source for grad_name, source in gradient_of.items() if source in torch_names}  # not x's
    for grad_name, source in weights.items():
        expected = parameters[torch_names[source]].grad.numpy()
        got = results[grad_name]
        assert got.shape == expected.shape, source
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * largest,
                                   err_msg=f"{source} ({torch_names[source]})")
        compared += 1
    assert compared == len(parameters) >= 2


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_outputs_inference_and_eval_models_keep_the_biased_logits(accumulation):
    """The step graph does not compute the logits, its forward tail (metadata) does where
    they are asked for: ``Trainer.step(outputs=["logits"])`` (one step graph or gradient +
    optimizer graphs; the steps before the first one asking run none of the tail),
    ``evaluate`` and the inference model give the forward's logits, the inference model
    with its Add of the trained bias."""
    from normgrad.graphs.step_graph import build_eval_graph, build_inference_model, forward_outputs
    from normgrad.train import Trainer, TrainerError

    forward = _head(("N", 3, 6))
    step, initial = _step(forward)
    assert "y" not in {o for n in step.graph.node for o in n.output} and forward_outputs(step) == ["y"]
    assert OP in _ops(step)
    trainer = Trainer(step, initial, lr=0.1, accumulation=accumulation)
    rng = np.random.default_rng(3)
    x, labels = rng.standard_normal((4, 3, 6)).astype(np.float32), rng.integers(0, 11, 12)

    def logits(weights):
        return (x @ weights["w"] + weights["b"]).reshape(-1, 11)

    # the trainer's session for steps not asking for the logits runs no Add; the one that does
    # replaces it at the first step asking for them
    forward_part = (lambda: trainer._gradient) if accumulation > 1 else (lambda: trainer._step_part)
    lean = forward_part()
    assert "y" not in lean.outputs
    # one step graph: its Add reads b, which the update must not overwrite in place first (split:
    # the optimizer's session updates b after the gradients' has read it)
    assert ("b" in trainer._in_place) == (accumulation > 1)
    loss = trainer.step(x, labels)
    assert np.isfinite(loss) and forward_part() is lean
    before = trainer.state_dict()
    result = trainer.step(x, labels, outputs=["y"])
    assert "y" in forward_part().outputs and forward_part() is not lean
    np.testing.assert_allclose(result.outputs["y"], logits(before), rtol=1e-5, atol=1e-6)
    after = trainer.state_dict()
    assert not np.array_equal(after["b"], before["b"])
    inference = build_inference_model(step, after)
    assert "Add" in _ops(inference)
    session = ort.InferenceSession(inference.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], logits(after), rtol=1e-5, atol=1e-6)
    assert [o.name for o in build_eval_graph(step).graph.output] == ["loss", "y"]
    evaluated = trainer.evaluate(x, labels, outputs=["y"])
    np.testing.assert_allclose(evaluated.outputs["y"], logits(after), rtol=1e-5, atol=1e-6)
    labels[3] = 11  # the trainer still knows C (from the tail's output shape): its own message, state unchanged
    with pytest.raises(TrainerError, match=re.escape("batch input 'labels' holds 11; cross_entropy labels must be "
                                                     "class indices 0..10")):
        trainer.step(x, labels)
    np.testing.assert_array_equal(trainer.state_dict()["b"], after["b"])
    labels[3], x[1, 2, 0] = 0, np.nan  # a NaN logit row: NaN loss and bias gradient, the trust gate refuses the step
    with pytest.raises(TrainerError, match="not finite"):
        Trainer(step, after, lr=0.1, accumulation=accumulation, nonfinite="raise").step(x, labels)
