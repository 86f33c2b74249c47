"""SoftmaxCrossEntropy: every backend (C++ kernel, Python kernel, function body on
onnxruntime and on onnx's ReferenceEvaluator) against a float64 NumPy cross-entropy written
here, float64 finite differences and torch's ``cross_entropy`` and autograd; the C++ loops
bitwise at 1, 2 and 4 threads and between the AVX2 and portable lanes; bad inputs named; the
cross_entropy and causal_lm step graphs use the operator, their portable and inline forms
the standard ops, all agreeing at every optimization level."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

import normgrad
from _helpers import OPTIMIZATION_LEVELS as LEVELS, cpp_available
from normgrad.graphs import build_step_graph, build_training_graph, examples
from normgrad.graphs.inline import inline_normgrad
from normgrad.graphs.optimizers import hyperparameter_feeds
from normgrad.graphs.portable import make_portable
from normgrad.ops import DOMAIN, IR_VERSION, ONNX_OPSET, OPSET_VERSION, NormgradInputError, harness, python_kernels
from normgrad.ops import softmax_cross_entropy as sce
from normgrad.ops._common import tensor_type
from _softmax_cross_entropy_cases import CASES, _case, _compare, _truth

OP = sce.OP_TYPE
BACKENDS = ["reference", "evaluator", "functions", "python"] + (["cpp"] if cpp_available() else [])
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASES)
def test_every_backend_matches_float64(backend, name):
    x, labels, attributes, ignore = _case(name)
    if backend == "python" and name == "large C":
        x, labels = x[:8], labels[:8]
    out = harness.run(backend, OP, {"logits": x, "labels": labels}, attributes=attributes)
    _compare(np.asarray(out["loss"]), out["dlogits"], x, labels, ignore)


def test_all_ignored_is_nan_as_the_standard_op_form_and_torch_loss():
    """Every sample ignored: loss 0 / 0 (torch's too) and every gradient entry NaN (the
    standard-op form's weight valid / count; torch's gradient is 0 there)."""
    x, labels, attributes, _ = _case("all ignored")
    for backend in BACKENDS:
        out = harness.run(backend, OP, {"logits": x, "labels": labels}, attributes=attributes)
        assert np.isnan(out["loss"]).all() and np.isnan(out["dlogits"]).all(), backend
    torch = pytest.importorskip("torch")
    assert torch.isnan(torch.nn.functional.cross_entropy(torch.tensor(x), torch.tensor(labels)))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("cpp", "functions")])
@pytest.mark.parametrize("name", ["odd", "ignore -100", "far apart"])
def test_gradient_matches_finite_differences(backend, name):
    x, labels, attributes, ignore = _case(name, seed=3)
    x, labels = x[:6, :9], np.minimum(labels[:6], 8) if ignore is None else np.where(labels[:6] == ignore, ignore,
                                                                                      labels[:6] % 9)
    grad = harness.run(backend, OP, {"logits": x, "labels": labels}, attributes=attributes)["dlogits"]
    x64, h = x.astype(np.float64), 1e-5 * max(1.0, np.abs(x).max() / 100)
    expected = np.zeros_like(x64)
    for index in np.ndindex(x.shape):
        step = np.zeros_like(x64)
        step[index] = h
        expected[index] = (_truth(x64 + step, labels, ignore)[0] - _truth(x64 - step, labels, ignore)[0]) / (2 * h)
    np.testing.assert_allclose(grad, expected, rtol=0, atol=1e-6 * max(1.0, np.abs(expected).max()))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("cpp", "python", "functions")])
@pytest.mark.parametrize("name", ["odd", "ignore -100", "ignore a class", "far apart", "-inf"])
def test_matches_torch_cross_entropy_and_autograd(backend, name):
    torch = pytest.importorskip("torch")
    x, labels, attributes, ignore = _case(name, seed=4)
    out = harness.run(backend, OP, {"logits": x, "labels": labels}, attributes=attributes)
    logits = torch.tensor(x.astype(np.float64), requires_grad=True)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(labels), ignore_index=-100 if ignore is None else ignore)
    loss.backward()
    if torch.isfinite(loss):
        assert abs(out["loss"].item() - loss.item()) <= 2e-6 * max(1.0, abs(loss.item()))
    else:
        assert out["loss"].item() == loss.item()
    np.testing.assert_allclose(out["dlogits"], logits.grad.numpy(), rtol=2e-5, atol=1e-6 / len(labels))


_RUN_CPP = """
import sys, numpy as np
from normgrad.ops import harness
rng = np.random.default_rng(0)
x = (rng.standard_normal((70, 4099)) * 4).astype(np.float32)
labels = rng.integers(0, 4099, 70)
labels[::5] = -100
out = harness.run("cpp", "SoftmaxCrossEntropy", {"logits": x, "labels": labels}, attributes={"ignore_index": -100},
                  threads=int(sys.argv[2]))
np.save(sys.argv[1], np.concatenate([out["dlogits"].ravel(), np.atleast_1d(out["loss"])]))
"""


@needs_cpp
def test_cpp_lanes_and_thread_counts_give_the_same_bits(tmp_path):
    """The portable lanes (NORMGRAD_KERNELS=generic) and the AVX2 ones at 1, 2 and 4 threads,
    and on onnxruntime 1.19.2 (NORMGRAD_OLD_ORT_PYTHON): bitwise the same loss and gradient (a
    row length with a tail after the lane groups)."""
    results = {}
    old_python = os.environ.get("NORMGRAD_OLD_ORT_PYTHON")  # the library loaded by onnxruntime 1.19.2 too
    for kernels in ("generic", "auto") + (("auto on onnxruntime 1.19.2",) if old_python else ()):
        env = {name: value for name, value in os.environ.items() if name != "NORMGRAD_KERNELS"}
        if kernels == "generic":
            env["NORMGRAD_KERNELS"] = "generic"
        python = old_python if kernels.endswith("1.19.2") else sys.executable
        for threads in (1, 2, 4):
            path = tmp_path / f"{kernels.split()[0]}_{len(kernels)}_{threads}.npy"
            process = subprocess.run([python, "-c", _RUN_CPP, str(path), str(threads)], env=env,
                                     capture_output=True, text=True, timeout=600)
            assert process.returncode == 0, process.stderr[-3000:]
            results[kernels, threads] = np.load(path)
    first = results["generic", 1]
    for key, value in results.items():
        np.testing.assert_array_equal(value.view(np.uint32), first.view(np.uint32), err_msg=str(key))
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((70, 4099)) * 4).astype(np.float32)
    labels = rng.integers(0, 4099, 70)
    labels[::5] = -100
    _compare(first[-1], first[:-1].reshape(x.shape), x, labels, -100)


def _node_model(feeds, attributes):
    """A SoftmaxCrossEntropy model without onnx's type checks (which would refuse bad types first)."""
    node = oh.make_node(OP, list(feeds), ["loss", "dlogits"], domain=DOMAIN, **attributes)
    graph = oh.make_graph([node], OP, [oh.make_tensor_value_info(name, tensor_type(value.dtype), list(value.shape))
                                       for name, value in feeds.items()],
                          [oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in ("loss", "dlogits")])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", ONNX_OPSET), oh.make_opsetid(DOMAIN, OPSET_VERSION)],
                         ir_version=IR_VERSION)


_X = np.zeros((3, 4), np.float32)
_LABELS = np.array([0, 3, 1])
BAD = {
    "label too large": ({"labels": np.array([0, 4, 1])}, {}, "labels", "must hold class indices in [0, 4); got 4 at row 1"),
    "label negative": ({"labels": np.array([0, 1, -1])}, {}, "labels", "must hold class indices in [0, 4); got -1 at row 2"),
    "label -100 not ignored": ({"labels": np.array([-100, 1, 1])}, {"ignore_index": 2}, "labels",
                               "must hold class indices in [0, 4) or ignore_index 2; got -100 at row 0"),
    "labels int32": ({"labels": _LABELS.astype(np.int32)}, {}, "labels", "must be int64; got int32"),
    "labels too few": ({"labels": _LABELS[:2]}, {}, "labels", "must have shape [3] (one label per row of 'logits'); got [2]"),
    "logits rank 3": ({"logits": np.zeros((3, 4, 1), np.float32)}, {}, "logits", "must have rank 2"),
    "logits float64": ({"logits": _X.astype(np.float16)}, {}, "logits", "must be float32; got float16"),
}


@needs_cpp
@pytest.mark.parametrize("case", BAD)
def test_cpp_bad_input_names_the_input(case):
    changed, attributes, name, rule = BAD[case]
    feeds = {"logits": _X, "labels": _LABELS, **changed}
    options = ort.SessionOptions()
    normgrad.session_options("cpp", options)
    session = ort.InferenceSession(_node_model(feeds, attributes).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    with pytest.raises(Exception) as error:
        session.run(None, feeds)
    assert f"{OP}: input '{name}' {rule}" in str(error.value)


@pytest.mark.parametrize("case", BAD)
def test_validate_names_the_input(case):
    changed, attributes, name, rule = BAD[case]
    with pytest.raises(NormgradInputError) as error:
        sce.reference(**{"logits": _X, "labels": _LABELS, **changed}, **attributes)
    assert f"{OP}: input '{name}' {rule}" in str(error.value)


def test_python_kernel_bad_label_logs_and_gives_nan():
    out = harness.run("python", OP, {"logits": _X, "labels": np.array([0, 9, 1])})
    assert np.isnan(out["dlogits"]).all() and np.isnan(out["loss"]).all()
    assert "input 'labels' must hold class indices in [0, 4)" in python_kernels.errors()[-1]


# -- the step graphs ------------------------------------------------------------------------------


def _additive(shape):
    """y = x + b: the loss's gradient with respect to y is x's."""
    bias = np.linspace(-1, 1, shape[-1]).astype(np.float32)
    return examples.model([oh.make_node("Add", ["x", "b"], ["y"])], {"x": shape}, ["y"], {"b": bias})


STEP_CASES = {
    "cross_entropy": ((12, 37), "cross_entropy", {}),
    "cross_entropy ignore_index": ((12, 37), "cross_entropy", {"ignore_index": 5}),
    "causal_lm": ((3, 6, 37), "causal_lm", {}),
}


def _ops(model):
    return [(n.domain, n.op_type) for n in model.graph.node]


@pytest.mark.parametrize("case", STEP_CASES)
def test_step_graph_forms_agree_at_every_level(case):
    """The default step graph holds the operator (C++ and Python kernels; its function body
    without kernels), the portable and --inline forms the standard ops; every form at every
    optimization level gives the float64 loss and the gradient it steps with."""
    shape, loss, options = STEP_CASES[case]
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    labels = rng.integers(0, shape[-1], shape[:-1])
    if options:
        labels.flat[::4] = options["ignore_index"]
    forms = {}
    for form in ("default", "portable", "inline"):
        training = build_training_graph(_additive(shape), loss=loss, loss_options=options,
                                        portable=form == "portable", inline=form == "inline")
        forms[form] = build_step_graph(training, "sgd", portable=form == "portable")
    # y's bias Add goes into the cross_entropy loss node (tests/test_bias_softmax_cross_entropy.py)
    op = OP if loss == "causal_lm" else "BiasSoftmaxCrossEntropy"
    assert (DOMAIN, op) in _ops(forms["default"][0])
    for form in ("portable", "inline"):
        assert not any(domain == DOMAIN and op in (OP, "BiasSoftmaxCrossEntropy") for domain, op in _ops(forms[form][0])), form
        assert not any(f.name in (OP, "BiasSoftmaxCrossEntropy") for f in forms[form][0].functions), form
    logits = x + np.linspace(-1, 1, shape[-1]).astype(np.float32)
    if loss == "causal_lm":
        flat, targets = logits.reshape(-1, shape[-1]), np.pad(labels[:, 1:], ((0, 0), (0, 1)), constant_values=-100)
        expected_loss, expected_grad = _truth(flat, targets.reshape(-1), -100)
        expected_grad = expected_grad.reshape(shape)
    else:
        expected_loss, expected_grad = _truth(logits, labels, options.get("ignore_index"))
    expected_b = expected_grad.reshape(-1, shape[-1]).sum(axis=0)
    lr = np.float32(0.5)
    runs = [("default", k) for k in ("cpp", "python", None)] + [("portable", None), ("inline", None)]
    for (form, kernels) in runs:
        if kernels == "cpp" and not cpp_available():
            continue
        step, initial = forms[form]
        for level in LEVELS:
            options_ = ort.SessionOptions()
            options_.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
            if kernels:
                normgrad.session_options(kernels, options_)
                model = normgrad.prepare_for_python_kernels(step) if kernels == "python" else step
            else:
                model = normgrad.add_functions(step)
            session = ort.InferenceSession(model.SerializeToString(), options_, providers=["CPUExecutionProvider"])
            feeds = {**hyperparameter_feeds(step), **initial, "x": x, "labels": labels, "lr": np.array(lr, np.float32),
                     "step": np.array(1, np.float32)}
            names = {i.name for i in session.get_inputs()}
            value, b_next = session.run(["loss", "b.next"], {k: v for k, v in feeds.items() if k in names})
            where = f"{form} {kernels} {level}"
            assert abs(float(value) - expected_loss) <= 2e-6 * max(1.0, abs(expected_loss)), where
            np.testing.assert_allclose((initial["b"] - b_next) / lr, expected_b, rtol=0, atol=2e-6, err_msg=where)


def test_label_smoothing_rank_3_and_float64_keep_the_standard_ops():
    """Only float32 [N, C] logits without label smoothing get the operator (the others'
    values: tests/test_losses.py)."""
    cases = [(_additive((6, 5)), {"label_smoothing": 0.1}), (_additive((4, 5, 3)), {}),
             (examples.model([oh.make_node("Add", ["x", "b"], ["y"])], {"x": (6, 5)}, ["y"],
                             {"b": np.zeros(5, np.float64)}, elem_type=onnx.TensorProto.DOUBLE), {})]
    for forward, options in cases:
        training = build_training_graph(forward, loss="cross_entropy", loss_options=options)
        assert not any(op == OP for _, op in _ops(training.model))
        assert any(op == "Softmax" for _, op in _ops(training.model))


def _over_the_logits_model(bias: bool, shape):
    """x @ I (exact) -> [Bias]SoftmaxCrossEntropy -> gradient @ I: the logits are computed
    by a node and read by the loss alone, and the gradient is declared with their shape, so
    onnxruntime may write the gradient over them (the kernel's may_reuse)."""
    rows, classes = shape
    op, inputs = ("BiasSoftmaxCrossEntropy", ["logits", "labels", "bias"]) if bias else (OP, ["logits", "labels"])
    nodes = [oh.make_node("MatMul", ["x", "eye"], ["logits"]),
             oh.make_node(op, inputs, ["loss", "dlogits"] + (["dbias"] if bias else []), domain=DOMAIN,
                          ignore_index=-100),
             oh.make_node("MatMul", ["dlogits", "eye"], ["dx"])]
    inputs_info = [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["rows", classes]),
                   oh.make_tensor_value_info("labels", onnx.TensorProto.INT64, ["rows"])]
    inputs_info += [oh.make_tensor_value_info("bias", onnx.TensorProto.FLOAT, [classes])] if bias else []
    outputs = [oh.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, []),
               oh.make_tensor_value_info("dx", onnx.TensorProto.FLOAT, ["rows", classes])]
    outputs += [oh.make_tensor_value_info("dbias", onnx.TensorProto.FLOAT, [classes])] if bias else []
    eye = onnx.numpy_helper.from_array(np.eye(classes, dtype=np.float32), "eye")
    graph = oh.make_graph(nodes, "over_the_logits", inputs_info, outputs, [eye],
                          value_info=[oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["rows", classes])
                                      for name in ("logits", "dlogits")])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", ONNX_OPSET), oh.make_opsetid(DOMAIN, OPSET_VERSION)],
                         ir_version=IR_VERSION)


@needs_cpp
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("level", LEVELS)
def test_cpp_gradient_written_over_the_logits_is_right(bias, level):
    """Where onnxruntime lets the gradient take the logits' buffer (each row's label logit is
    read before the row is overwritten): the float64 truth, and the same bits as a run where
    the logits are also a graph output (so kept)."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((33, 300)) * 3).astype(np.float32)
    labels = rng.integers(0, 300, 33)
    labels[::4] = -100
    b = (rng.standard_normal(300) * 2).astype(np.float32)
    feeds = {"x": x, "labels": labels, **({"bias": b} if bias else {})}
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    normgrad.session_options("cpp", options)
    model = _over_the_logits_model(bias, x.shape)
    reused = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)
    model.graph.output.append(oh.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["rows", 300]))
    kept = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)
    for got, want in zip(reused, kept):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    _compare(reused[0], reused[1], x + b if bias else x, labels, -100)


@pytest.mark.parametrize("shape", [(3, 6, 37), ("batch", "sequence", 37)], ids=["static", "symbolic"])
def test_causal_lm_declares_the_gradient_with_the_logits_shape(shape):
    """The [tokens, vocabulary] matrix the loss reads and its gradient carry one declared
    shape: onnxruntime then lets the gradient take the logits' buffer."""
    training = build_training_graph(_additive(shape), loss="causal_lm")
    declared = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
                for v in training.model.graph.value_info}
    (node,) = [n for n in training.model.graph.node if n.op_type == OP]
    assert declared[node.input[0]] == declared[node.output[1]] == ["causal_lm_tokens", 37]
