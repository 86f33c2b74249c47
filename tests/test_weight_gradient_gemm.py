"""Weight gradients of 2-D weights as single GEMMs, and ``x @ W.T`` read in place.

The MatMul rule writes the gradients of a 2-D weight under a batched input as one Gemm over
the flattened leading axes (graphs/rules/matmul.py), and the exporters' ``MatMul(x,
Transpose(W))`` becomes a Gemm with ``transB=1`` (rewrites.transposed_weight_products).
Checked here: each rule against float64 finite differences, the graphs' shape (every 2-D
weight's gradient is a Gemm, no Transpose reads a weight), and 10 AdamW steps of tiny BERT,
GPT-2 and Llama blocks against the batched forms they replace, at every onnxruntime
optimization level (tests/test_trainer_matrix.py has them against torch)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from normgrad.graphs import build_step_graph, build_training_graph, rewrites
from normgrad.graphs.rules import matmul
from normgrad.tools.check import check_gradients

from _graph_models import model, weights


def _transposed_product(x_shape, w_shape, cast=False):
    """y = x @ Transpose(w) (w an initializer), optionally through a Cast as bfloat16 bases are."""
    nodes = [oh.make_node("Transpose", ["w"], ["wt"], perm=[1, 0])]
    if cast:
        nodes.append(oh.make_node("Cast", ["wt"], ["wt_cast"], to=onnx.TensorProto.FLOAT))
    nodes.append(oh.make_node("MatMul", ["x", "wt_cast" if cast else "wt"], ["y"]))
    return model(nodes, {"x": x_shape}, ["y"], weights(0, w=w_shape))


@pytest.mark.parametrize("x_shape", [(3, 4), (2, 3, 4), (2, 1, 3, 4), (4,)])
@pytest.mark.parametrize("cast", [False, True])
def test_transposed_weight_product_gradients(x_shape, cast):
    training = build_training_graph(_transposed_product(x_shape, (5, 4), cast))
    nodes = training.model.graph.node
    assert not [n for n in nodes if n.op_type == "Transpose" and "w" in n.input], "a Transpose still reads w"
    assert any(n.op_type == "Gemm" and oh.get_attribute_value(n.attribute[0]) == 1 for n in nodes if n.attribute)
    checks = check_gradients(training, directions=2)
    assert checks and max(c.error for c in checks) < 1e-4, max(checks, key=lambda c: c.error)


def test_batched_matmul_weight_gradient_is_one_gemm():
    training = build_training_graph(model([oh.make_node("MatMul", ["x", "w"], ["y"])], {"x": (2, 3, 4)}, ["y"],
                                          weights(0, w=(4, 5))))
    graph = training.model.graph
    producers = {o: n for n in graph.node for o in n.output}
    gradient = producers[producers["w_grad"].input[0]] if producers["w_grad"].op_type == "Identity" else producers["w_grad"]
    assert gradient.op_type == "Gemm"
    assert not [n for n in graph.node if n.op_type in ("ReduceSum", "Transpose")]
    checks = check_gradients(training, directions=2)
    assert checks and max(c.error for c in checks) < 1e-4



@pytest.mark.parametrize("level", ["basic", "all"])
def test_products_of_one_input_sum_their_dx_inside_the_gemms(tmp_path, level):
    """q, k and v read one h (as attention does): one Flatten of h, and h's gradient the
    Gemms' outputs added one at a time, which onnxruntime turns into Gemm C inputs (no Sum
    of them left in the graph it runs); gradients against float64 finite differences."""
    import onnxruntime as ort

    nodes = [oh.make_node("Mul", ["x", "s"], ["h"]), oh.make_node("Relu", ["h"], ["r"])]
    for name in "qkv":
        nodes += [oh.make_node("Transpose", [f"w{name}"], [f"w{name}t"], perm=[1, 0]),
                  oh.make_node("MatMul", ["h", f"w{name}t"], [name])]
    nodes += [oh.make_node("Add", ["q", "k"], ["qk"]), oh.make_node("Add", ["v", "r"], ["vr"]),
              oh.make_node("Add", ["qk", "vr"], ["y"])]
    forward = model(nodes, {"x": (2, 3, 4)}, ["y"], weights(0, s=(4,), wq=(4, 4), wk=(4, 4), wv=(4, 4)))
    training = build_training_graph(forward)
    graph = training.model.graph
    assert [n.input[0] for n in graph.node if n.op_type == "Flatten"] == ["h"]
    gemms = {n.output[0] for n in graph.node if n.op_type == "Gemm" and len(n.input) == 2}
    sums = [n for n in graph.node if n.op_type == "Sum" and set(n.input) & gemms]
    assert sums and all(len(n.input) == 2 for n in sums)
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, f"ORT_ENABLE_{level.upper()}")
    options.optimized_model_filepath = str(tmp_path / "running.onnx")
    ort.InferenceSession(training.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    running = onnx.load(tmp_path / "running.onnx").graph
    gemm_outputs = {n.output[0] for n in running.node if n.op_type == "Gemm"}
    assert not [n.name for n in running.node if n.op_type == "Sum" and set(n.input) & gemm_outputs]
    checks = check_gradients(training, directions=2)
    assert checks and max(c.error for c in checks) < 1e-4, max(checks, key=lambda c: c.error)

# -- tiny transformers: against the batched forms, every optimization level -----------------

STEPS = 10
LEVELS = ["disable_all", "basic", "extended", "all"]  # _matrix_models.LEVELS


def _matrix():
    """_matrix_models (the trainer matrix's tiny transformers and step helpers); skips without torch."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import _matrix_models

    return _matrix_models


def _batched_forms(monkeypatch):
    """The graphs as before this change: batched weight gradients, x @ Transpose(W) kept."""
    monkeypatch.setattr(matmul, "GEMM_ELEM_TYPES", frozenset())
    monkeypatch.setattr(rewrites.transposed_weights, "apply", lambda model, context: 0)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            made[name] = _matrix()._forward(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get


def _step_graph(forward_model):
    training = build_training_graph(forward_model, loss="mse", frozen=_matrix()._frozen(forward_model))
    return training, build_step_graph(training, "adamw", weight_decay=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_weight_gradients_are_gemms_reading_weights_in_place(exported, name):
    training, _ = _step_graph(exported(name)[2])
    graph = training.model.graph
    producers = {o: n for n in graph.node for o in n.output}
    matrices = [w for w, value in training.weights.items() if value.ndim == 2]
    assert matrices
    for weight in matrices:
        node = producers[f"{weight}_grad"]
        while node.op_type == "Identity":
            node = producers[node.input[0]]
        if "embed" in weight or "wte" in weight or "wpe" in weight:  # a Gather's gradient (+ a tied head's Gemm)
            continue
        assert node.op_type in ("Gemm", "OuterProductSum"), f"{weight}: its gradient comes from a {node.op_type}"
    reading = [n.name for n in graph.node if n.op_type == "Transpose" and set(n.input) & set(matrices)]
    assert not reading, f"Transposes of weights: {reading}"


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_ten_adamw_steps_as_the_batched_forms(exported, monkeypatch, name, level):
    _, make_input, forward_model, output_shape = exported(name)
    matrix = _matrix()
    batches = [matrix._batch(make_input, output_shape, seed) for seed in range(STEPS)]
    step, initial = _step_graph(forward_model)[1]
    state = matrix._reference_steps(step, initial, batches, 0.01, matrix.LEVELS[level])
    with monkeypatch.context() as patch:
        _batched_forms(patch)
        old_step, old_initial = _step_graph(forward_model)[1]
    # GPT-2's block (no LM head) already has its projections as Gemms: nothing to change there
    assert sum(n.op_type == "Gemm" for n in old_step.graph.node) <= sum(n.op_type == "Gemm" for n in step.graph.node)
    expected = matrix._reference_steps(old_step, old_initial, batches, 0.01, matrix.LEVELS[level])
    matrix._assert_state_close(state, expected, f"{name}/{level}, {STEPS} AdamW steps", 1e-5)
