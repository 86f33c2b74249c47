"""RotateHalfEmbedding (ops/rotate_half_embedding.py): the float64 reference against
transformers' ``apply_rotary_pos_emb`` and torch autograd; the C++ kernel (both loops, 1/2/4
threads), the Python kernel and the function body bitwise the float32 standard ops' bits, in
both modes and every broadcast form; bad inputs named; the builder's rewrite of the rotary
chain (only that chain); the step graph against its ``--inline`` form at every optimization
level; the training graph's outputs bitwise the node-by-node graph's (the rewrite off), also
where cos and sin need gradients; ``--portable`` writes the standard ops again."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest

import normgrad
from _helpers import assert_step_matches_inline, cpp_available, cpp_error, cpp_results_by_loop_and_threads, step_outputs
from normgrad.graphs import build_step_graph, build_training_graph, rewrites
from normgrad.graphs.optimizers import hyperparameter_feeds
from normgrad.graphs.portable import make_portable
from normgrad.ops import DOMAIN, NormgradInputError, harness, rotate_half_embedding

OP = rotate_half_embedding.OP_TYPE
KERNELS = ["python"] + (["cpp"] if cpp_available() else [])
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")
FORMS = [
    ((8, 4, 16, 64), (1, 1, 16, 64), (1, 1, 16, 64)),  # Llama's [batch, heads, seq, dim], dynamo's layout
    ((2, 16, 4, 64), (1, 16, 1, 64), (16, 1, 64)),  # [batch, seq, heads, dim]; sin of lower rank
    ((3, 5, 10), (3, 5, 10), (10,)),  # cos of x's shape; sin one row
    ((2, 7, 2), (2, 1, 2), (1, 7, 2)),  # the smallest pair; each broadcast along another axis
    ((4, 6), (6,), (6,)),
    ((2, 0, 8), (1, 8), (8,)),  # empty
]
"""(x, cos, sin) shapes."""


def _inputs(shapes, seed=0, dtype=np.float32):
    """x, cos and sin of ``shapes``; cos and sin random (their halves unequal)."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape in zip(("x", "cos", "sin"), shapes)}


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def test_reference_is_transformers_rotary_embedding_and_its_transpose():
    """Forward: transformers' Llama ``apply_rotary_pos_emb`` (torch float64); transposed:
    torch autograd's gradient of x through it, for cos and sin whose halves differ."""
    torch = pytest.importorskip("torch")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    values = _inputs(((2, 3, 5, 8), (2, 5, 8), (2, 5, 8)), dtype=np.float64)
    x = torch.tensor(values["x"], requires_grad=True)
    cos, sin = torch.tensor(values["cos"]), torch.tensor(values["sin"])
    q, _ = llama.apply_rotary_pos_emb(x, x.detach(), cos, sin, unsqueeze_dim=1)
    forward = rotate_half_embedding.reference(values["x"], values["cos"][:, None], values["sin"][:, None]).y
    np.testing.assert_allclose(forward, q.detach().numpy(), rtol=1e-14, atol=1e-15)
    dy = np.random.default_rng(3).standard_normal(q.shape)
    q.backward(torch.tensor(dy))
    dx = rotate_half_embedding.reference(dy, values["cos"][:, None], values["sin"][:, None], transposed=1).y
    np.testing.assert_allclose(dx, x.grad.numpy(), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("transposed", [0, 1])
def test_reference_is_the_standard_form(transposed):
    """float64: the definitions written out (r(x) = [-x2, x1], r^T(z) = [z2, -z1])."""
    values = _inputs(FORMS[1], dtype=np.float64)
    x, cos, sin = values["x"], values["cos"], values["sin"]
    if transposed:
        z = x * sin
        expected = x * cos + np.concatenate([z[..., 32:], -z[..., :32]], axis=-1)
    else:
        expected = x * cos + _rotate_half(x) * sin
    np.testing.assert_array_equal(rotate_half_embedding.reference(x, cos, sin, transposed).y, expected)


@pytest.mark.parametrize("transposed", [0, 1])
@pytest.mark.parametrize("backend", KERNELS + ["functions", "evaluator"])
@pytest.mark.parametrize("shapes", FORMS)
def test_kernels_and_body_are_the_standard_ops_bits(backend, shapes, transposed):
    """Every backend gives the float32 reference's bits (the standard nodes' operations in
    their order), within float32 rounding of the float64 truth."""
    values = _inputs(shapes, seed=len(shapes[0]))
    got = harness.run(backend, OP, values, attributes={"transposed": transposed}, threads=1)["y"]
    expected = rotate_half_embedding.reference(**values, transposed=transposed).y
    assert got.dtype == np.float32 and got.shape == shapes[0]
    assert got.tobytes() == expected.tobytes()
    truth = rotate_half_embedding.reference(**{k: v.astype(np.float64) for k, v in values.items()}, transposed=transposed).y
    np.testing.assert_allclose(got, truth, rtol=1e-6, atol=1e-6)


def test_transposed_mode_is_the_adjoint():
    """<T(a), b> = <a, F(b)> in float64, cos and sin of x's shape: the transposed mode is
    the forward's transpose."""
    values = _inputs(((3, 4, 10),) * 3, seed=4, dtype=np.float64)
    a, b = np.random.default_rng(5).standard_normal((2, 3, 4, 10))
    cos, sin = values["cos"], values["sin"]
    left = np.sum(rotate_half_embedding.reference(a, cos, sin, transposed=1).y * b)
    right = np.sum(a * rotate_half_embedding.reference(b, cos, sin).y)
    np.testing.assert_allclose(left, right, rtol=1e-12)


_RUN_CPP = """
import sys, numpy as np
from normgrad.ops import harness
rng = np.random.default_rng(4)
x = rng.standard_normal((8, 4, 128, 64)).astype(np.float32)
cos, sin = rng.standard_normal((2, 1, 128, 64)).astype(np.float32)
outputs = [harness.run("cpp", "RotateHalfEmbedding", {"x": x, "cos": cos, "sin": sin}, attributes={"transposed": t},
                       threads=int(sys.argv[2]))["y"] for t in (0, 1)]
np.save(sys.argv[1], np.stack(outputs))
"""


@needs_cpp
def test_cpp_loops_bitwise_at_every_thread_count(tmp_path):
    """The portable loop (NORMGRAD_KERNELS=generic) and the AVX2 one at 1, 2 and 4 threads:
    the same bits, both modes."""
    results = cpp_results_by_loop_and_threads(tmp_path, _RUN_CPP)
    first = results["generic", 1]
    assert np.isfinite(first).all() and first.any()
    for where, value in results.items():
        assert value.tobytes() == first.tobytes(), where


def _bad(x=(3, 8), cos=(8,), sin=(8,), dtype=np.float32, sin_dtype=None):
    return {"x": np.zeros(x, dtype), "cos": np.zeros(cos, dtype), "sin": np.zeros(sin, sin_dtype or dtype)}


BAD = {
    "x scalar": (_bad(x=()), "input 'x' must have rank >= 1 (the rotated pairs along the last axis); got a scalar"),
    "x odd last axis": (_bad(x=(3, 7), cos=(7,), sin=(7,)),
                        "input 'x' must have an even last axis (its two halves are rotated); got shape [3, 7]"),
    "cos last axis": (_bad(cos=(4,)), "input 'cos' must have x's last axis 8 as its last axis; got shape [4]"),
    "sin scalar": (_bad(sin=()), "input 'sin' must have x's last axis 8 as its last axis; got shape []"),
    "cos rank": (_bad(cos=(1, 1, 8)), "input 'cos' must broadcast to x's shape [3, 8]: rank 3 exceeds the rank of 'x' (2)"),
    "sin dim": (_bad(x=(3, 4, 8), sin=(2, 1, 8)),
                "input 'sin' must broadcast to x's shape [3, 4, 8]: dim 2 is neither 1 nor the matching dim 3 of 'x'"),
    "x float16": (_bad(dtype=np.float16), "input 'x' must be float32; got float16"),
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
        rotate_half_embedding.reference(**feeds)


def test_validate_names_a_mismatched_type_and_a_bad_mode():
    with pytest.raises(NormgradInputError, match=re.escape(f"{OP}: input 'sin' must have x's type float32; got float64")):
        rotate_half_embedding.reference(**_bad(sin_dtype=np.float64))
    with pytest.raises(NormgradInputError, match=re.escape(f"{OP}: attribute 'transposed' must be 0 or 1; got 2")):
        rotate_half_embedding.reference(**_bad(), transposed=2)


def test_shape_inference_rejects_an_odd_last_axis():
    node = oh.make_node(OP, ["x", "cos", "sin"], ["y"], domain=DOMAIN)
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 5]),
                                        oh.make_tensor_value_info("cos", onnx.TensorProto.FLOAT, [5]),
                                        oh.make_tensor_value_info("sin", onnx.TensorProto.FLOAT, [5])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(DOMAIN, 1)])
    with pytest.raises(Exception, match="must have an even last axis"):
        onnx.shape_inference.infer_shapes(model, strict_mode=True)


def _both_modes() -> onnx.ModelProto:
    """y = RotateHalfEmbedding(x, cos, sin) (the attribute omitted: 0), z = its transposed
    mode of y: one function body serves both."""
    nodes = [oh.make_node(OP, ["x", "cos", "sin"], ["y"], domain=DOMAIN),
             oh.make_node(OP, ["y", "cos", "sin"], ["z"], domain=DOMAIN, transposed=1)]
    graph = oh.make_graph(nodes, "modes", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 4, 6]),
                                           oh.make_tensor_value_info("cos", onnx.TensorProto.FLOAT, [4, 6]),
                                           oh.make_tensor_value_info("sin", onnx.TensorProto.FLOAT, [1, 6])],
                          [oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [3, 4, 6]) for name in "yz"])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(DOMAIN, 1)], ir_version=8)


@pytest.mark.parametrize("form", ["function bodies", "inline", "portable"])
def test_one_body_serves_both_modes(form):
    """With a transposed node in the graph, the body reads the attribute (a node omitting it
    gets its default written out for onnx's inliner): onnx's checker passes the model with
    its bodies, and onnxruntime running the bodies, ``--inline`` and the portable expansion
    all give the reference's bits for both nodes."""
    from normgrad.graphs.inline import inline_normgrad
    from normgrad.graphs.rewrites import expand_operator

    model = _both_modes()
    if form == "function bodies":
        model = normgrad.add_functions(model)
        onnx.checker.check_model(onnx.shape_inference.infer_shapes(model, strict_mode=True), full_check=True)
    elif form == "inline":
        model = inline_normgrad(model)
    else:
        model = expand_operator(model, rotate_half_embedding)
    assert OP not in _ops(model) or form == "function bodies"
    values = _inputs(((3, 4, 6), (4, 6), (1, 6)), seed=9)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y, z = session.run(["y", "z"], values)
    expected_y = rotate_half_embedding.reference(**values).y
    assert y.tobytes() == expected_y.tobytes()
    assert z.tobytes() == rotate_half_embedding.reference(expected_y, values["cos"], values["sin"], 1).y.tobytes()


# ----------------------------------------------------------------------------- the rewrite

BATCH, SEQ, HEADS, DIM, HIDDEN = 2, 5, 2, 8, 12


def _attention_rotary(case: str = "dynamo") -> onnx.ModelProto:
    """h [2, 5, 12] -> q = h @ w_q as [batch, heads, seq, dim] (TorchScript layout: [batch,
    seq, heads, dim]) with Llama's rotary embedding as torch's exporters write it: x1, x2 two
    Slices of the last axis, Concat(Neg(x2), x1), Add(Mul(q, cos), Mul(that, sin)); cos and
    sin from constant positions and inv_freq (an initializer, trainable, in "trained
    frequencies"); the output q's rotation. ``case`` changes the chain."""
    f = onnx.TensorProto.FLOAT
    torchscript = case == "torchscript"
    heads_first = [BATCH, HEADS, SEQ, DIM]
    shape = [BATCH, SEQ, HEADS, DIM] if torchscript else heads_first
    nodes, inits = [], []

    def const(name, value):
        nodes.append(oh.make_node("Constant", [], [name], value=onh.from_array(np.asarray(value), name)))
        return name

    rng = np.random.default_rng(0)
    inits.append(onh.from_array((rng.standard_normal((HIDDEN, HEADS * DIM)) / 3).astype(np.float32), "w_q"))
    inv_freq = (1.0 / 100.0 ** (np.arange(0, DIM, 2) / DIM)).astype(np.float32)
    if case == "trained frequencies":
        inits.append(onh.from_array(inv_freq, "inv_freq"))
    else:
        const("inv_freq", inv_freq)
    const("positions", np.arange(SEQ, dtype=np.float32).reshape(SEQ, 1))
    nodes.append(oh.make_node("Mul", ["positions", "inv_freq"], ["freqs"]))
    nodes.append(oh.make_node("Concat", ["freqs", "freqs"], ["emb"], axis=-1))
    cos_axes = const("cos_axes", np.array([0, 2] if torchscript else [0, 1], np.int64))
    for fn in ("Cos", "Sin"):
        nodes.append(oh.make_node(fn, ["emb"], [fn.lower() + "_row"]))
        nodes.append(oh.make_node("Unsqueeze", [fn.lower() + "_row", cos_axes], [fn.lower()]))
    const("q_shape", np.array([BATCH, SEQ, HEADS, DIM], np.int64))
    nodes.append(oh.make_node("MatMul", ["h", "w_q"], ["q_flat"]))
    nodes.append(oh.make_node("Reshape", ["q_flat", "q_shape"], ["q_heads"]))
    if torchscript:
        nodes.append(oh.make_node("Identity", ["q_heads"], ["q"]))
    else:
        nodes.append(oh.make_node("Transpose", ["q_heads"], ["q"], perm=[0, 2, 1, 3]))
    half = DIM // 2
    axis = -1 if case != "axis 3" else 3
    for name, (start, end) in (("x1", (0, half)), ("x2", (half, 2**63 - 1))):
        nodes.append(oh.make_node("Slice", ["q", const(f"{name}_start", [start]), const(f"{name}_end", [end]),
                                            const(f"{name}_axis", [axis])], [name]))
    nodes.append(oh.make_node("Neg", ["x2"], ["neg"]))
    concat = ["x1", "neg"] if case == "halves not rotated" else ["neg", "x1"]
    nodes.append(oh.make_node("Concat", concat, ["rotated"], axis=-1))
    sin_product = ["sin", "rotated"] if case == "operands swapped" else ["rotated", "sin"]
    cos_product = ["cos", "q"] if case == "operands swapped" else ["q", "cos"]
    nodes.append(oh.make_node("Mul", sin_product, ["q_sin"]))
    nodes.append(oh.make_node("Mul", cos_product, ["q_cos"]))
    nodes.append(oh.make_node("Add", ["q_sin", "q_cos"] if case == "operands swapped" else ["q_cos", "q_sin"], ["y"]))
    outputs = [oh.make_tensor_value_info("y", f, shape)]
    if case == "concat a graph output":
        outputs.append(oh.make_tensor_value_info("rotated", f, shape))
    graph = oh.make_graph(nodes, "rotary", [oh.make_tensor_value_info("h", f, [BATCH, SEQ, HIDDEN])], outputs, inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=8)


CHAIN = {"x1", "x2", "neg", "rotated", "q_sin", "q_cos"}
"""The chain's intermediates in :func:`_attention_rotary`."""


def _ops(model, domain=DOMAIN):
    return [n.op_type for n in model.graph.node if n.domain == domain]


@pytest.mark.parametrize("case, rewritten", [
    ("dynamo", True), ("torchscript", True), ("axis 3", True), ("operands swapped", True),
    ("trained frequencies", True), ("halves not rotated", False), ("concat a graph output", False)])
def test_which_chains_become_the_operator(case, rewritten):
    """The exporters' chain in either layout and operand order, cos and sin broadcasting;
    elsewhere the standard ops stay. Its gradient of q is the operator's transposed mode."""
    training = build_training_graph(_attention_rotary(case), loss="mse")
    nodes = training.model.graph.node
    fused = [n for n in nodes if (n.domain, n.op_type) == (DOMAIN, OP)]
    if rewritten:
        assert len(fused) == 2 and list(fused[0].input) == ["q", "cos", "sin"] and fused[0].output[0] == "y"
        assert [onnx.helper.get_attribute_value(a) for n in fused for a in n.attribute] == [0, 1]
        assert list(fused[1].input[1:]) == ["cos", "sin"]
        assert not CHAIN & {name for n in nodes for name in n.output}
    else:
        assert not fused and CHAIN <= {name for n in nodes for name in n.output}


def _feeds(model, initial=None, seed=7):
    rng = np.random.default_rng(seed)
    typed = {v.name: v for v in [*model.graph.input, *model.graph.output]}
    labels = typed["labels"] if "labels" in typed else typed["y"]
    feeds = {"h": rng.standard_normal((BATCH, SEQ, HIDDEN)).astype(np.float32),
             "labels": rng.standard_normal([d.dim_value for d in labels.type.tensor_type.shape.dim]).astype(np.float32)}
    if initial is not None:
        feeds.update(hyperparameter_feeds(model), **initial, lr=np.array(0.1, np.float32), step=np.array(1, np.float32))
    return feeds


def test_step_graph_matches_the_inline_form():
    """At every optimization level, with the C++ and Python kernels and with the bodies
    onnxruntime inlines, the updated weight matches the ``--inline`` form's; the C++
    kernels' step is bitwise the same at 1, 2 and 4 threads."""
    forward = _attention_rotary()
    step, initial = build_step_graph(build_training_graph(forward, loss="mse"), "adamw")
    inline, _ = build_step_graph(build_training_graph(forward, loss="mse", inline=True), "adamw")
    assert _ops(step).count(OP) == 2 and not _ops(inline)
    assert_step_matches_inline(step, inline, _feeds(step, initial), ["w_q.next"])


def _outputs(training, kernels):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if kernels:
        normgrad.session_options(kernels, options)
    session = ort.InferenceSession(training.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = _feeds(training.model)
    results = session.run(None, training.feeds(feeds))
    return dict(zip([o.name for o in session.get_outputs()], results))


@pytest.mark.parametrize("case", ["dynamo", "torchscript", "trained frequencies"])
@pytest.mark.parametrize("form", ["cpp", "inline"])
def test_training_graph_is_bitwise_the_node_by_node_one(case, form, monkeypatch):
    """The forward output, the loss and every gradient (w_q's; inv_freq's where it is
    trained: cos's and sin's gradients, the Mul rule's products) are the bits of the graph
    without the rewrite, with the C++ kernels and in the ``--inline`` form."""
    if form == "cpp" and not cpp_available():
        pytest.skip("the C++ library is not built")
    forward = _attention_rotary(case)
    fused = build_training_graph(forward, loss="mse", inline=form == "inline")
    monkeypatch.setattr(rewrites.rotate_half, "apply", lambda model, context: 0)
    node_by_node = build_training_graph(forward, loss="mse")
    assert OP not in _ops(node_by_node.model) and (OP in _ops(fused.model)) == (form == "cpp")
    expected = _outputs(node_by_node, None)
    got = _outputs(fused, "cpp" if form == "cpp" else None)
    assert sorted(got) == sorted(expected)
    assert ("inv_freq_grad" in got) == (case == "trained frequencies")
    for name, value in expected.items():
        assert got[name].tobytes() == value.tobytes(), name


def test_gradients_match_torch():
    """The loss and the gradients of w_q and of the trained inv_freq are torch autograd's
    through transformers' ``apply_rotary_pos_emb``."""
    torch = pytest.importorskip("torch")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    forward = _attention_rotary("trained frequencies")
    results = _outputs(build_training_graph(forward, loss="mse"), "cpp" if cpp_available() else "python")
    weights = {i.name: torch.tensor(onh.to_array(i), requires_grad=True) for i in forward.graph.initializer}
    feeds = _feeds(forward)
    freqs = torch.arange(SEQ, dtype=torch.float32)[:, None] * weights["inv_freq"]
    emb = torch.cat([freqs, freqs], dim=-1)[None]
    q = (torch.tensor(feeds["h"]) @ weights["w_q"]).reshape(BATCH, SEQ, HEADS, DIM).transpose(1, 2)
    y, _ = llama.apply_rotary_pos_emb(q, q, emb.cos(), emb.sin(), unsqueeze_dim=1)
    loss = torch.mean((y - torch.tensor(feeds["labels"])) ** 2)
    loss.backward()
    np.testing.assert_allclose(results["loss"], loss.item(), rtol=1e-6)
    for name in ("w_q", "inv_freq"):
        np.testing.assert_allclose(results[name + "_grad"], weights[name].grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_portable_form_writes_the_standard_ops():
    """``--portable`` writes the bodies: the forward's Split, Neg, Concat, Mul, Mul, Add."""
    step, _ = build_step_graph(build_training_graph(_attention_rotary(), loss="mse"), "adamw")
    portable, _ = make_portable(step)
    assert OP not in _ops(portable) and "Neg" in _ops(portable, "")


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_llama_block_exports_use_the_operator_bitwise(exporter, monkeypatch):
    """transformers' LlamaDecoderLayer (test_models_transformers_rules' block: 2 heads, 1 KV
    head) as each exporter writes it: q's and k's rotary embeddings become the operator
    (two forward nodes, two transposed), and every output of the training graph (the
    block's output, every gradient) is the bits of the graph without the rewrite."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from _transformer_blocks import _export, _LlamaBlock

    torch.manual_seed(0)
    module = _LlamaBlock().train()
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((2, 8, 32)).astype(np.float32)
    forward = _export(module, (torch.tensor(hidden),), exporter, ["hidden"], ["y"])
    fused = build_training_graph(forward)
    modes = [onnx.helper.get_attribute_value(a) for n in fused.model.graph.node if (n.domain, n.op_type) == (DOMAIN, OP)
             for a in n.attribute if a.name == "transposed"]
    assert sorted(modes) == [0, 0, 1, 1]
    monkeypatch.setattr(rewrites.rotate_half, "apply", lambda model, context: 0)
    node_by_node = build_training_graph(forward)
    assert OP not in _ops(node_by_node.model)
    batch = {"hidden": hidden, "y_grad": rng.standard_normal((2, 8, 32)).astype(np.float32)}
    kernels = "cpp" if cpp_available() else "python"
    results = []
    for training in (fused, node_by_node):
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        normgrad.session_options(kernels, options)
        model = normgrad.prepare_for_python_kernels(training.model) if kernels == "python" else training.model
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        results.append(dict(zip([o.name for o in session.get_outputs()], session.run(None, training.feeds(batch)))))
    assert sorted(results[0]) == sorted(results[1])
    for name, value in results[1].items():
        assert results[0][name].tobytes() == value.tobytes(), name
