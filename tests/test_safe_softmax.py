"""SafeSoftmax (ops/safe_softmax.py): the float64 reference against torch's ``_safe_softmax`` and
the standard ops' form; the C++ kernel (both loops, 1/2/4 threads, bitwise), the Python
kernel and the function body against the reference, zeroed rows included; bad inputs named;
the builder's rewrite of torch's safe softmax chain (only that chain: float32, last axis, the
Softmax read by the IsNaN and the Where alone, a 0 constant), with the attention mask's Add
before it inside BiasSafeSoftmax (bitwise Add then SafeSoftmax); the step graph against its
``--inline`` form at every optimization level; the gradient of fully masked rows 0 as torch's,
in the default and the ``--inline`` graph; ``--portable`` writes the standard ops again."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest

import normgrad
from _helpers import (assert_step_matches_inline, cpp_available, cpp_error, cpp_results_by_loop_and_threads,
                      step_outputs)
from normgrad.graphs import build_step_graph, build_training_graph
from normgrad.graphs.optimizers import hyperparameter_feeds
from normgrad.graphs.portable import as_exported, make_portable
from normgrad.ops import DOMAIN, NormgradInputError, bias_safe_softmax, harness, safe_softmax, softmax_grad
from _attention_graphs import _attention, _ops

OP = safe_softmax.OP_TYPE
BIAS_OP = bias_safe_softmax.OP_TYPE
KERNELS = ["python"] + (["cpp"] if cpp_available() else [])
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")
SHAPES = [(0,), (1,), (7,), (3, 8), (2, 3, 33), (4, 0), (2, 0, 5), (5, 128), (3, 300), (2, 1000)]
"""Empty, one element, rows shorter than a lane group, one group, a tail, one and more than
one of the row code's 256-element blocks."""
ULPS = 4
"""Kernel error bound against the float64 softmax, in float32 ulps of each value (exp's
2e-7, the float32 scale and product), plus the rounding of the float32 x - max, which exp
turns into a relative error of |x - max| ulps; values below float32's smallest normal may be
0 (exp(x - max) below 2^-126 is 0 in the kernel and in onnxruntime's Softmax). The C++
kernel's softmax is not onnxruntime's bits, and neither is within less of the float64 one."""


def _scores(shape, seed=0, spread=4.0):
    """Random scores with the special rows where the shape allows: every entry -inf (a fully
    masked row), one NaN, one +inf, all but one -inf, a huge spread."""
    x = (np.random.default_rng(seed).standard_normal(shape) * spread).astype(np.float32)
    rows = x.reshape(-1, shape[-1]) if x.size else x.reshape(0, 1)
    if rows.shape[0] >= 6 and rows.shape[1] >= 2:
        rows[0] = -np.inf
        rows[1, rows.shape[1] // 2] = np.nan
        rows[2, -1] = np.inf
        rows[3, 1:] = -np.inf
        rows[4, 0] = -80.0
        rows[4, -1] = 80.0
    return x


def _softmax_isnan_where(x: np.ndarray) -> np.ndarray:
    """The standard ops' form in float64 (Softmax, IsNaN, Where), written from the definitions."""
    x = x.astype(np.float64)
    with np.errstate(invalid="ignore"):
        e = np.exp(x - x.max(axis=-1, keepdims=True, initial=-np.inf))
        s = e / e.sum(axis=-1, keepdims=True)
    return np.where(np.isnan(s), 0.0, s)


def _assert_close(x, y):
    truth = _softmax_isnan_where(x)
    assert y.dtype == np.float32 and y.shape == x.shape and not np.isnan(y).any()
    with np.errstate(invalid="ignore"):
        shift = np.abs(x.astype(np.float64) - x.max(axis=-1, keepdims=True, initial=-np.inf))
    bound = (ULPS + np.nan_to_num(shift, posinf=0.0)) * np.finfo(np.float32).eps * truth + np.finfo(np.float32).tiny
    assert np.all(np.abs(y.astype(np.float64) - truth) <= bound)


def test_reference_is_the_standard_form_and_torchs_safe_softmax():
    """The standard ops' form in float64 (every special row), and torch's ``_safe_softmax``
    where the two agree by definition (no NaN or +inf score: torch zeroes fully masked rows
    only)."""
    x = _scores((3, 4, 9))
    np.testing.assert_array_equal(safe_softmax.reference(x.astype(np.float64)).y, _softmax_isnan_where(x))
    torch = pytest.importorskip("torch")
    finite_or_masked = x.reshape(-1, 9)[[0, 3, 4, 5, 6, 7, 8]]
    expected = torch._safe_softmax(torch.tensor(finite_or_masked, dtype=torch.float64), -1).numpy()
    np.testing.assert_allclose(safe_softmax.reference(finite_or_masked.astype(np.float64)).y, expected, rtol=1e-14, atol=0)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_match_the_reference(backend, shape):
    x = _scores(shape)
    _assert_close(x, harness.run(backend, OP, {"x": x}, threads=1)["y"])


@pytest.mark.parametrize("backend", ["functions", "evaluator"])
@pytest.mark.parametrize("shape", [(1,), (3, 8), (2, 3, 33), (3, 300)])
def test_function_body_matches_the_reference(backend, shape):
    x = _scores(shape, seed=2)
    _assert_close(x, harness.run(backend, OP, {"x": x})["y"])


@needs_cpp
def test_zeroed_rows_and_the_others():
    """Rows with a NaN or +inf score or every score -inf are 0 whole; the others sum to 1 and
    keep their zeros where a score is -inf."""
    x = _scores((7, 40), seed=5)
    y = harness.run("cpp", OP, {"x": x})["y"]
    assert not y[:3].any()
    assert (y[3, 1:] == 0).all() and y[3, 0] == 1
    np.testing.assert_allclose(y[3:].astype(np.float64).sum(axis=-1), 1.0, rtol=1e-6)


_RUN_CPP = """
import sys, numpy as np
from normgrad.ops import harness
rng = np.random.default_rng(4)
x = (rng.standard_normal((8, 4, 64, 131)) * 3).astype(np.float32)
x[0, 0, :5] = -np.inf
x[1, 2, 7, 3] = np.nan
np.save(sys.argv[1], harness.run("cpp", "SafeSoftmax", {"x": x}, threads=int(sys.argv[2]))["y"])
"""


@needs_cpp
def test_cpp_loops_bitwise_at_every_thread_count(tmp_path):
    """The portable loop (NORMGRAD_KERNELS=generic) and the AVX2 one at 1, 2 and 4 threads:
    the same bits."""
    results = cpp_results_by_loop_and_threads(tmp_path, _RUN_CPP)
    first = results["generic", 1]
    assert not first[0, 0, :5].any() and not first[1, 2, 7].any() and first.any()
    for where, value in results.items():
        assert value.tobytes() == first.tobytes(), where


BAD = {
    "x scalar": ({"x": np.zeros((), np.float32)}, "input 'x' must have rank >= 1 (rows along the last axis); got a scalar"),
    "x float16": ({"x": np.zeros(3, np.float16)}, "input 'x' must be float32; got float16"),
}


@needs_cpp
@pytest.mark.parametrize("case", BAD)
def test_cpp_bad_input_names_the_input(case):
    feeds, rule = BAD[case]
    message = cpp_error(OP, feeds)
    # onnxruntime may refuse a float16 input itself (no kernel of that type) before ours runs
    assert f"{OP}: {rule}" in message or (case == "x float16" and "float16" in message), message


@pytest.mark.parametrize("case", BAD)
def test_validate_names_the_input(case):
    feeds, rule = BAD[case]
    with pytest.raises(NormgradInputError, match=re.escape(f"{OP}: {rule}")):
        safe_softmax.reference(**feeds)


# ----------------------------------------------------------------------------- BiasSafeSoftmax

BIAS_SHAPES = [((2, 3, 4, 33), (2, 1, 4, 33)), ((2, 3, 4, 33), (4, 33)), ((2, 3, 4, 33), (33,)),
               ((2, 3, 4, 33), (1, 1, 1, 33)), ((2, 3, 4, 33), (2, 3, 4, 33)), ((3, 300), (1, 300)),
               ((8, 1, 5, 128), (8, 1, 1, 128)), ((0, 4, 7), (4, 7)), ((3, 0), (0,))]
"""x and a bias over its leading axes: an attention mask per sample, one for every row, one
per position, x's own shape, rows of the row code's blocks; empty."""


def _bias(shape, x_shape, seed=1):
    """A mask-like bias: random, with -inf that fully masks some of x's rows where it can."""
    bias = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if bias.ndim >= 2 and bias.shape[-2] >= 2 and bias.size:
        bias.reshape(-1, bias.shape[-2], bias.shape[-1])[0, 1] = -np.inf
    return bias


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("shapes", BIAS_SHAPES)
def test_bias_kernels_match_the_reference(backend, shapes):
    """The float32 sum x + bias (as the Add rounds it) through the safe softmax, zeroed rows
    included: the reference is SafeSoftmax's of that sum."""
    x_shape, bias_shape = shapes
    x, bias = _scores(x_shape, seed=3), _bias(bias_shape, x_shape)
    expected = bias_safe_softmax.reference(x.astype(np.float64), bias.astype(np.float64)).y
    y = harness.run(backend, BIAS_OP, {"x": x, "bias": bias}, threads=1)["y"]
    _assert_close(x + bias, y)
    np.testing.assert_allclose(y, expected, rtol=ULPS * 4 * np.finfo(np.float32).eps, atol=1e-6)


@needs_cpp
@pytest.mark.parametrize("shapes", BIAS_SHAPES)
def test_bias_kernel_is_add_then_safe_softmax_bitwise(shapes):
    """The C++ kernel adds the bias in float32 in each pass: the bits of SafeSoftmax of the Add's sum."""
    x_shape, bias_shape = shapes
    x, bias = _scores(x_shape, seed=4), _bias(bias_shape, x_shape, seed=2)
    fused = harness.run("cpp", BIAS_OP, {"x": x, "bias": bias})["y"]
    assert fused.tobytes() == harness.run("cpp", OP, {"x": x + bias})["y"].tobytes()


@pytest.mark.parametrize("backend", ["functions", "evaluator"])
def test_bias_function_body_matches_the_reference(backend):
    x, bias = _scores((2, 3, 4, 33), seed=5), _bias((2, 1, 4, 33), (2, 3, 4, 33))
    _assert_close(x + bias, harness.run(backend, BIAS_OP, {"x": x, "bias": bias})["y"])


_RUN_BIAS_CPP = """
import sys, numpy as np
from normgrad.ops import harness
rng = np.random.default_rng(4)
x = (rng.standard_normal((8, 4, 64, 131)) * 3).astype(np.float32)
bias = rng.standard_normal((8, 1, 64, 131)).astype(np.float32)
bias[0, 0, :5] = -np.inf
np.save(sys.argv[1], harness.run("cpp", "BiasSafeSoftmax", {"x": x, "bias": bias}, threads=int(sys.argv[2]))["y"])
"""


@needs_cpp
def test_bias_cpp_loops_bitwise_at_every_thread_count(tmp_path):
    results = cpp_results_by_loop_and_threads(tmp_path, _RUN_BIAS_CPP)
    first = results["generic", 1]
    assert not first[0, :, :5].any() and first.any()
    for where, value in results.items():
        assert value.tobytes() == first.tobytes(), where


BIAS_RULE = "input 'bias' must have rank <= x's, x's last axis and every other axis 1 or x's"
BAD_BIAS = {
    "bias along the rows": ((2, 3, 5), (2, 3, 1), "float32"),
    "bias of a higher rank": ((3, 5), (2, 3, 5), "float32"),
    "bias axis neither 1 nor x's": ((2, 3, 5), (2, 2, 5), "float32"),
    "bias scalar": ((2, 3, 5), (), "float32"),
    "bias float64": ((2, 3, 5), (3, 5), "float64"),
}


def _bad_bias_feeds(case):
    x_shape, bias_shape, dtype = BAD_BIAS[case]
    return {"x": np.zeros(x_shape, np.float32), "bias": np.zeros(bias_shape, dtype)}


@pytest.mark.parametrize("case", BAD_BIAS)
def test_bias_validate_names_the_input(case):
    rule = "input 'bias' must have the type of 'x'" if case == "bias float64" else BIAS_RULE
    with pytest.raises(NormgradInputError, match=re.escape(f"{BIAS_OP}: {rule}")):
        bias_safe_softmax.reference(**_bad_bias_feeds(case))


@needs_cpp
@pytest.mark.parametrize("case", [c for c in BAD_BIAS if c != "bias float64"])
def test_bias_cpp_bad_input_names_the_input(case):
    message = cpp_error(BIAS_OP, _bad_bias_feeds(case))
    assert f"{BIAS_OP}: {BIAS_RULE}" in message, message


# ----------------------------------------------------------------------------- the rewrite


def _variant(case: str) -> onnx.ModelProto:
    """The safe-softmax attention of test_softmax_grad, changed as ``case`` says."""
    if case == "float64":
        return _attention(onnx.TensorProto.DOUBLE)
    if case == "middle axis":
        return _attention(axis=1)
    model = _attention(axis=2 if case == "axis rank - 1" else -1)
    graph = model.graph
    where = next(n for n in graph.node if n.op_type == "Where")
    add = next(n for n in graph.node if n.op_type == "Add")
    if case == "nonzero branch":
        graph.initializer.append(onh.from_array(np.ones((), np.float32), "one"))
        where.input[1] = "one"
    elif case == "zero a trained initializer":
        graph.initializer.append(onh.from_array(np.zeros((), np.float32), "trained_zero"))
        where.input[1] = "trained_zero"
    elif case == "branches swapped":
        where.input[1], where.input[2] = where.input[2], where.input[1]
    elif case == "softmax read elsewhere":
        graph.node.append(oh.make_node("Identity", ["p"], ["p_copy"]))
        graph.output.append(oh.make_tensor_value_info("p_copy", onnx.TensorProto.FLOAT, None))
    elif case == "isnan a graph output":
        graph.output.append(oh.make_tensor_value_info("nan", onnx.TensorProto.BOOL, None))
    elif case == "no mask":
        graph.node.remove(add)
        next(n for n in graph.node if n.op_type == "Softmax").input[0] = "s0"
    elif case == "mask first":
        add.input[0], add.input[1] = add.input[1], add.input[0]
    elif case == "sum read elsewhere":
        graph.node.append(oh.make_node("Identity", ["scores"], ["scores_copy"]))
        graph.output.append(oh.make_tensor_value_info("scores_copy", onnx.TensorProto.FLOAT, None))
    elif case in ("mask along the rows", "mask of a full row"):
        mask = next(t for t in graph.initializer if t.name == "mask")
        shape = (5, 1) if case == "mask along the rows" else (3, 5, 5)
        mask.CopyFrom(onh.from_array(np.full(shape, 0.5, np.float32), "mask"))
    return model


@pytest.mark.parametrize("case, rewritten", [
    ("last axis", BIAS_OP), ("axis rank - 1", BIAS_OP), ("mask first", BIAS_OP), ("mask of a full row", BIAS_OP),
    ("no mask", OP), ("sum read elsewhere", OP), ("mask along the rows", OP), ("float64", None),
    ("middle axis", None), ("nonzero branch", None), ("branches swapped", None), ("softmax read elsewhere", None),
    ("isnan a graph output", None), ("zero a trained initializer", None)])
def test_which_chains_become_the_operator(case, rewritten):
    """Only torch's chain over the last axis of a float32 x; elsewhere the standard ops stay
    (and the float32 last-axis Softmax's gradient is SoftmaxGrad still). The mask's Add goes
    inside (BiasSafeSoftmax) when it is read by the Softmax alone and the mask has the scores'
    last axis, its other axes 1 or theirs. A 0 the builder trains (a float initializer) keeps
    the Where and gets its gradient."""
    training = build_training_graph(_variant(case), loss="mse")
    ops = training.model.graph.node
    if case == "zero a trained initializer":
        assert "trained_zero_grad" in {o.name for o in training.model.graph.output}
    weights = next(n for n in ops if "weights" in n.output)
    op_types = [n.op_type for n in ops]
    forward_adds = [n for n in ops if n.op_type == "Add" and "scores" in n.output]
    if rewritten == BIAS_OP:
        assert (weights.domain, weights.op_type) == (DOMAIN, BIAS_OP) and sorted(weights.input) == ["mask", "s0"]
        assert not forward_adds and OP not in op_types
    elif rewritten == OP:
        assert (weights.domain, weights.op_type, list(weights.input)) == (DOMAIN, OP, ["s0" if case == "no mask" else "scores"])
        assert len(forward_adds) == (0 if case == "no mask" else 1) and BIAS_OP not in op_types
    else:
        assert weights.op_type == "Where" and OP not in op_types and BIAS_OP not in op_types
        assert [op_types.count(op) for op in ("Softmax", "IsNaN")] == [1, 1]
    if rewritten:
        assert "Softmax" not in op_types and "IsNaN" not in op_types
    assert sum(n.op_type == softmax_grad.OP_TYPE for n in ops) == (0 if case in ("float64", "middle axis") else 1)


def _masked_attention() -> onnx.ModelProto:
    """The attention with a padding mask that hides every key of the second sample: its rows
    are fully masked (every score -inf)."""
    model = _attention()
    mask = next(t for t in model.graph.initializer if t.name == "mask")
    values = np.zeros((3, 5, 5), np.float32)
    values[1] = -np.inf
    mask.CopyFrom(onh.from_array(values, "mask"))
    return model


def _feeds(step, initial, seed=7):
    rng = np.random.default_rng(seed)
    return {**hyperparameter_feeds(step), **initial, "x": rng.standard_normal((3, 5, 6)).astype(np.float32),
            "labels": rng.standard_normal((3, 5, 6)).astype(np.float32), "lr": np.array(0.1, np.float32),
            "step": np.array(1, np.float32)}


@pytest.mark.parametrize("masked", [False, True])
def test_step_graph_matches_the_inline_form(masked):
    """At every optimization level, with the C++ and Python kernels and with the bodies
    onnxruntime inlines, the updated weights match the ``--inline`` form's (Softmax, IsNaN,
    Where and the SoftmaxGrad's standard ops) to float32 rounding, finite with fully masked
    rows too; the C++ kernels' step is bitwise the same at 1, 2 and 4 threads."""
    forward = _masked_attention() if masked else _attention()
    step, initial = build_step_graph(build_training_graph(forward, loss="mse"), "adamw")
    inline, _ = build_step_graph(build_training_graph(forward, loss="mse", inline=True), "adamw")
    assert _ops(step).count(BIAS_OP) == 1 and OP not in _ops(step) and not _ops(inline)
    assert [_ops(inline, "").count(op) for op in ("Softmax", "IsNaN")] == [1, 1]
    feeds = _feeds(step, initial)
    expected = step_outputs(inline, feeds, None, "ORT_DISABLE_ALL")
    weights = [name + ".next" for name in ("w_q", "w_k", "w_v", "w_o")]
    assert all(np.isfinite(expected[name]).all() for name in weights)
    assert_step_matches_inline(step, inline, feeds, weights)


@pytest.mark.parametrize("inline", [False, True])
def test_fully_masked_rows_gradient_matches_torch(inline):
    """The loss and x's and every weight's gradient (the mask's too, as a learned bias) through
    the attention with a fully masked sample are torch's (``_safe_softmax``: 0 on those rows, forward and backward), in
    the default graph (SafeSoftmax, SoftmaxGrad) and the ``--inline`` one (their standard
    ops: the SoftmaxGrad body of y = 0 is 0 too)."""
    torch = pytest.importorskip("torch")
    forward = _masked_attention()
    training = build_training_graph(forward, loss="mse", inline=inline)
    assert (BIAS_OP in _ops(training.model)) != inline
    weights = {i.name: torch.tensor(onh.to_array(i), requires_grad=i.name != "zero") for i in forward.graph.initializer}
    rng = np.random.default_rng(8)
    x, labels = (rng.standard_normal((3, 5, 6)).astype(np.float32) for _ in range(2))
    options = ort.SessionOptions()
    if cpp_available() and not inline:
        normgrad.session_options("cpp", options)
    session = ort.InferenceSession(training.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    results = dict(zip(names, session.run(None, training.feeds({"x": x, "labels": labels}))))
    xt = torch.tensor(x, requires_grad=True)
    scores = (xt @ weights["w_q"]) @ (xt @ weights["w_k"]).transpose(1, 2) + weights["mask"]
    p = torch._safe_softmax(scores, -1)
    y = p @ (xt @ weights["w_v"]) @ weights["w_o"]
    loss = torch.mean((y - torch.tensor(labels)) ** 2)
    loss.backward()
    assert not p[1].detach().any() and torch.isfinite(xt.grad).all()
    np.testing.assert_allclose(results["loss"], loss.item(), rtol=1e-5)
    expected = {"x": xt.grad, **{name: weights[name].grad for name in ("w_q", "w_k", "w_v", "w_o", "mask")}}
    for name, grad in expected.items():
        got = results[_gradient_output(training, name)]
        np.testing.assert_allclose(got, grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def _gradient_output(training, name: str) -> str:
    """The output holding ``name``'s gradient (the training graph's metadata)."""
    import json

    gradient_of = json.loads(next(p.value for p in training.model.metadata_props if p.key == "normgrad.gradients"))
    return next(grad for grad, source in gradient_of.items() if source == name)


def test_portable_form_writes_the_standard_ops():
    """``--portable`` writes the body (Add, Softmax, IsNaN, Where); ``normgrad export``'s default
    form keeps the operator (the expansion is a costly rewrite)."""
    step, _ = build_step_graph(build_training_graph(_attention(), loss="mse"), "adamw")
    portable, _ = make_portable(step)
    assert not {OP, BIAS_OP} & set(_ops(portable))
    assert [_ops(portable, "").count(op) for op in ("Softmax", "IsNaN")] == [1, 1]
    exported, _ = as_exported(step)
    assert BIAS_OP in _ops(exported)


@pytest.mark.slow
@pytest.mark.parametrize("inline", [False, True])
def test_bert_with_a_fully_masked_sample_matches_torch(inline, tmp_path):
    """transformers' BertModel (the model-family test's) with an attention_mask of all zeros
    for one sample and padding in the other, through the TorchScript exporter: the MSE loss
    and the gradient of every parameter are torch autograd's. The graph makes the masked
    sample's attention rows NaN before the Where (every score -inf), which the step graph
    turned into NaN gradients before SafeSoftmax. (The dynamo exporter's graph of this model
    already differs from torch's forward on the masked sample, by 0.02 in onnxruntime without
    normgrad, its softmax rows finite: nothing there to compare.)"""
    exporter = "torchscript"
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import json

    from _graph_models import run_training

    import normgrad.torch

    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

    class Bert(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = transformers.BertModel(config)

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    torch.manual_seed(0)
    module = Bert().train()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 100, (2, 8)).astype(np.int64)
    mask = np.ones((2, 8), np.int64)
    mask[0] = 0
    mask[1, 6:] = 0
    labels = rng.standard_normal((2, 8, 32)).astype(np.float32)
    forward = normgrad.torch.export(module, (torch.tensor(ids), torch.tensor(mask)), tmp_path / "bert.onnx",
                                    exporter=exporter, input_names=["input_ids", "attention_mask"], output_names=["y"])
    softmaxes = [n.output[0] for n in forward.graph.node if n.op_type == "Softmax"]
    probe = onnx.ModelProto()
    probe.CopyFrom(forward)
    probe.graph.output.extend(oh.make_empty_tensor_value_info(name) for name in softmaxes)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    probabilities = session.run(softmaxes, {"input_ids": ids, "attention_mask": mask})
    assert all(np.isnan(p[0]).all() and not np.isnan(p[1]).any() for p in probabilities)

    training = build_training_graph(forward, loss="mse", inline=inline)
    assert bool({OP, BIAS_OP} & set(_ops(training.model))) != inline
    results = run_training(training, {"input_ids": ids, "attention_mask": mask, "labels": labels})
    loss = torch.mean((module(torch.tensor(ids), torch.tensor(mask)) - torch.tensor(labels)) ** 2)
    module.zero_grad()
    loss.backward()
    np.testing.assert_allclose(results["loss"], loss.item(), rtol=1e-4)  # the model-family test's tolerance
    gradient_of = json.loads(next(p.value for p in training.model.metadata_props if p.key == "normgrad.gradients"))
    trained = {source: grad for grad, source in gradient_of.items()}
    expected = {name: p.grad.numpy() for name, p in module.named_parameters() if p.grad is not None}
    assert sorted(expected) == sorted(trained)
    largest = max(float(np.abs(g).max()) for g in expected.values())
    for name, grad in expected.items():
        assert np.isfinite(results[trained[name]]).all(), name
        np.testing.assert_allclose(results[trained[name]], grad, rtol=1e-4, atol=1e-4 * largest, err_msg=name)
