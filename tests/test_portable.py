"""Portable training graphs (``normgrad export --portable``, ``make_portable``) on the CPU
provider: the same values as the graphs they come from, and the structure that lets
OpenVINO run them (``tests/test_openvino*.py`` run them there)."""

from __future__ import annotations


import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

import normgrad
from normgrad import checkpoint
from normgrad.graphs import build_step_graph, build_training_graph, examples
from normgrad.graphs.builder import training_graph_with_stored_weights
from normgrad.graphs.portable import make_portable
from normgrad.ops import harness
from normgrad.tools import export as export_tool
from normgrad.graphs.optimizers import hyperparameter_feeds

from _providers import CPU, run
from _corpus_cases import CASES, MANIFEST, TOLERANCE, assert_matches, load_case

TRAINING_CASES = [c for c in CASES if MANIFEST[c]["kind"] == "training"]


def _constant_values(graph: onnx.GraphProto) -> set:
    return {t.name for t in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}


def assert_portable(model: onnx.ModelProto) -> None:
    graph = model.graph
    inputs = {i.name for i in graph.input}
    assert not inputs & {t.name for t in graph.initializer}, "an input is also an initializer"
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    used = [i.name in read for i in graph.input]
    assert used == sorted(used, reverse=True), "an unused input before a used one"
    ops = {node.op_type for node in graph.node}
    assert not ops & {"OneHot", "GroupNormalization"}, ops
    assert not any(n.op_type == "BatchNormalization" and any(a.name == "training_mode" and a.i for a in n.attribute)
                   for n in graph.node)
    constants = _constant_values(graph)
    readers = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for node in graph.node:
        if node.op_type == "ConvTranspose" and node.input[1] in constants:
            assert readers[node.input[1]] == 1, f"ConvTranspose weight {node.input[1]} is shared"


@pytest.mark.parametrize("name", TRAINING_CASES)
def test_portable_corpus_case_on_cpu(name):
    model, inputs, expected = load_case(name)
    portable, moved = make_portable(model)
    assert_portable(portable)
    initializers = {t.name: onh.to_array(t) for t in model.graph.initializer}
    stored_weights = {i.name for i in model.graph.input} & set(initializers)
    assert set(moved) == stored_weights and all(np.array_equal(moved[k], initializers[k]) for k in moved)
    assert bool(moved) == name.endswith("_stored_weights"), "only the _stored_weights cases store weights"
    assert [o.name for o in portable.graph.output] == [o.name for o in model.graph.output]
    actual = run(portable, inputs, CPU)
    assert_matches(actual, expected, TOLERANCE[("training", MANIFEST[name]["dtype"])], f"portable {name}")


@pytest.mark.parametrize("axis", [-1, 0, 1, 2])
@pytest.mark.parametrize("index_type", [onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.FLOAT])
def test_onehot_rewrite_equals_onehot(axis, index_type):
    """Negative indices count from depth; out-of-range ones give all-off rows; any index type."""
    indices = np.array([[0, 3, -1], [-4, 2, 7]]).astype(onnx.helper.tensor_dtype_to_np_dtype(index_type))
    out_shape = [2, 3]
    out_shape.insert(axis if axis >= 0 else 3 + axis, 4)
    graph = oh.make_graph(
        [oh.make_node("OneHot", ["indices", "depth", "values"], ["y"], axis=axis)], "onehot",
        [oh.make_tensor_value_info("indices", index_type, [2, 3])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, out_shape)],
        initializer=[onh.from_array(np.array([4.0], np.float32), "depth"),
                     onh.from_array(np.array([-2.0, 5.0], np.float32), "values")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 10
    portable, _ = make_portable(model)
    assert "OneHot" not in {n.op_type for n in portable.graph.node}
    want, got = run(model, {"indices": indices}, CPU)["y"], run(portable, {"indices": indices}, CPU)["y"]
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_conv_transpose_gets_its_own_constant_weight():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 3, 3, 3)).astype(np.float32)
    nodes = [
        oh.make_node("Constant", [], ["wc"], value=onh.from_array(w)),
        oh.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        oh.make_node("ConvTranspose", ["d", "w"], ["t"], pads=[1, 1, 1, 1]),
        oh.make_node("Conv", ["x", "wc"], ["c2"], pads=[1, 1, 1, 1]),
        oh.make_node("ConvTranspose", ["d", "wc"], ["t2"], pads=[1, 1, 1, 1]),
    ]
    model = examples.model(nodes, {"x": (1, 3, 5, 5), "d": (1, 3, 5, 5)}, ["c", "t", "c2", "t2"], {"w": w})
    portable, moved = make_portable(model)
    assert not moved
    assert_portable(portable)
    assert len(portable.graph.initializer) == 2
    feeds = {n: rng.standard_normal((1, 3, 5, 5)).astype(np.float32) for n in ("x", "d")}
    want, got = run(model, feeds, CPU), run(portable, feeds, CPU)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_unused_inputs_last():
    model = examples.model([oh.make_node("Sub", ["a", "b"], ["y"])], {"c": (3,), "a": (3,), "b": (3,)}, ["y"])
    portable, _ = make_portable(model)
    assert [i.name for i in portable.graph.input] == ["a", "b", "c"]


def test_input_a_function_body_ignores_goes_last():
    """BatchNormReduceBackward's body does not read `weight`: read by that node alone, it is
    unused once onnxruntime inlines the body, so it moves behind the inputs after it."""
    rng = np.random.default_rng(4)
    inputs = {"grad_out": rng.standard_normal((2, 3, 4)).astype(np.float32),
              "input": rng.standard_normal((2, 3, 4)).astype(np.float32),
              "mean": np.zeros(3, np.float32), "invstd": np.ones(3, np.float32),
              "weight": np.ones(3, np.float32), "relu_output": rng.standard_normal((2, 3, 4)).astype(np.float32)}
    model = normgrad.add_functions(harness.node_model("BatchNormReduceBackward", inputs))
    assert [i.name for i in model.graph.input][-2:] == ["weight", "relu_output"]
    portable, _ = make_portable(model)
    assert [i.name for i in portable.graph.input] == ["grad_out", "input", "mean", "invstd", "relu_output", "weight"]
    want, got = run(model, inputs, CPU), run(portable, inputs, CPU)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_group_normalization_expanded():
    """The GroupNormalization the gradient rule writes against its expanded ONNX body."""
    forward = examples.group_norm_block()
    stored = training_graph_with_stored_weights(forward)
    assert "GroupNormalization" in {n.op_type for n in stored.graph.node}
    portable, weights = build_training_graph(forward, portable=True)
    assert_portable(portable)
    rng = np.random.default_rng(3)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in portable.graph.input if i.name not in weights}
    feeds.update(weights)
    want, got = run(stored, feeds, CPU), run(portable, feeds, CPU)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def _transformer_feeds(model, weights, seed=5):
    rng = np.random.default_rng(seed)
    feeds = {**weights, "x": rng.standard_normal((3, 4, 8)).astype(np.float32),
             "labels": rng.standard_normal((3, 4, 8)).astype(np.float32)}
    return {k: v for k, v in feeds.items() if k in {i.name for i in model.graph.input}}


def test_layer_norm_statistics_beside():
    """The portable form reads no LayerNormalization statistics output (OpenVINO takes Y
    only), and gives the default form's values; the default form keeps reading them (faster
    on the CPU provider: tools/bench_portable.py)."""
    forward = examples.transformer_block(dropout=0.0)
    default, weights = build_training_graph(forward, loss="mse")
    portable, _ = build_training_graph(forward, loss="mse", portable=True)
    assert_portable(portable)
    norms = lambda model: [list(n.output) for n in model.graph.node if n.op_type == "LayerNormalization"]  # noqa: E731
    assert all(len(outputs) == 3 for outputs in norms(default)) and norms(default)
    assert all(len(outputs) == 1 for outputs in norms(portable)) and len(norms(portable)) == len(norms(default))
    feeds = _transformer_feeds(default, weights)
    want, got = run(default, feeds, CPU), run(portable, feeds, CPU)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_portable_training_graph_seeds_dropout():
    """Training-mode Dropout in the portable training graph is the step graph's seeded mask
    (OpenVINO refuses training-mode Dropout): no Dropout node, a ``dropout_seed`` input; the
    same seed gives bitwise the same outputs, another seed another mask; the gradients match
    float64 finite differences (forward and backward share the mask)."""
    from normgrad.tools.check import check_gradients

    forward = examples.transformer_block(dropout=0.1)
    portable, weights = build_training_graph(forward, loss="mse", portable=True)
    assert "Dropout" not in {n.op_type for n in portable.graph.node}
    assert {"dropout_seed", "step"} <= {i.name for i in portable.graph.input}
    feeds = {**_transformer_feeds(portable, weights), "step": np.array(1, np.float32)}
    first, again, other = (run(portable, {**feeds, "dropout_seed": np.array(seed, np.int64)}, CPU) for seed in (1, 1, 2))
    assert all(np.array_equal(first[k], again[k]) for k in first)
    assert not np.array_equal(first["y"], other["y"])
    later = run(portable, {**feeds, "dropout_seed": np.array(1, np.int64), "step": np.array(2, np.float32)}, CPU)
    assert not np.array_equal(first["y"], later["y"])
    checks = check_gradients(portable, {**feeds, "dropout_seed": np.array(1, np.int64)}, directions=2)
    worst = max(checks, key=lambda c: c.error)
    # 0.022 without Dropout (b1: this float32 graph's finite differences); a backward mask other
    # than the forward's is off by the dropped share of the gradient, 0.1 and more
    assert worst.error < 0.05, worst


def test_step_graph_draws_its_own_dropout_masks(tmp_path):
    """A step graph is built from the training graph before the seeded-Dropout rewrite
    (``export --portable --optimizer`` does so); one built from a portable training graph
    is refused by name, never left with the training graph's masks."""
    forward = examples.transformer_block(dropout=0.1)
    with pytest.raises(ValueError, match="step"):
        build_step_graph(build_training_graph(forward, loss="mse", portable=True), "sgd")
    onnx.save(forward, str(tmp_path / "block.onnx"))
    assert export_tool.main([str(tmp_path / "block.onnx"), "-o", str(tmp_path / "step.onnx"), "--loss", "mse",
                             "--optimizer", "sgd", "--portable"]) == 0
    step = onnx.load(str(tmp_path / "step.onnx"))
    assert "Dropout" not in {n.op_type for n in step.graph.node}
    assert not [n for n in step.graph.node if n.op_type == "LayerNormalization" and any(n.output[1:])]


def test_training_mode_batch_norm_refused():
    nodes = [oh.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], training_mode=1)]
    ones = np.ones(2, np.float32)
    model = examples.model(nodes, {"x": (2, 2, 3)}, ["y"], {"s": ones, "b": ones, "m": ones, "v": ones})
    with pytest.raises(ValueError, match="BatchNormalization with training_mode=1 is not portable"):
        make_portable(model)


def test_step_graph_portable_same_step():
    training = build_training_graph(examples.resnet_block(), loss="mse")
    plain, state = build_step_graph(training, "adamw", weight_decay=0.01)
    portable, portable_state = build_step_graph(training, "adamw", portable=True, weight_decay=0.01)
    assert_portable(portable)
    assert portable_state.keys() == state.keys()
    rng = np.random.default_rng(4)
    feeds = {**state, "x": rng.standard_normal((2, 4, 5, 5)).astype(np.float32),
             "labels": rng.standard_normal((2, 4, 5, 5)).astype(np.float32),
             "lr": np.array(0.01, np.float32), "step": np.array(1, np.float32)}
    assert not [i.name for i in portable.graph.input if i.type.tensor_type.elem_type == onnx.TensorProto.DOUBLE]
    want = run(plain, {**hyperparameter_feeds(plain), **feeds}, CPU)
    got = run(portable, {**hyperparameter_feeds(portable), **feeds}, CPU)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def _adam_trajectory_error(torch, kind, options, model, steps):
    """max over ``steps`` AdamW/Adam steps (same gradients) of |w - torch's w| / max |torch's w - w0|."""
    import json

    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(500).astype(np.float32)
    grads = [(rng.standard_normal(500) * (0.1 + rng.random())).astype(np.float32) for _ in range(steps)]
    parameter = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    optimizer = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]([parameter], **options)
    import onnxruntime as ort

    session = ort.InferenceSession(normgrad.add_functions(model).SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in session.get_outputs()]
    state_names = json.loads({p.key: p.value for p in model.metadata_props}["normgrad.state"])
    state = {name: w0.copy() if name == "w" else np.zeros(500, np.float32) for name in state_names}
    worst = 0.0
    for k, grad in enumerate(grads, start=1):
        parameter.grad = torch.from_numpy(grad.copy())
        optimizer.step()
        want = parameter.detach().numpy()
        out = dict(zip(outputs, session.run(None, {**hyperparameter_feeds(model), **state, "w_grad": grad,
                                                   "step": np.array(k, np.float32)})))
        state = {name: out[state_names[name]] for name in state}
        worst = max(worst, float(np.abs(state["w"] - want).max() / np.abs(want - w0).max()))
    return worst


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_portable_float32_hyperparameters_follow_torch(kind):
    """The portable form's float32 hyperparameters and bias corrections (``-expm1(t log b)``):
    200 steps within 5e-5 of torch.optim's displacement, as close as the default float64
    form (measured 3.0e-5 at lr 1e-3 for both; float32 ``1 - b**t`` gave 1.2e-4)."""
    torch = pytest.importorskip("torch")
    from normgrad.graphs.optimizers import build_optimizer_graph

    options = dict(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
    default = build_optimizer_graph({"w": [500]}, kind, **options)
    portable, _ = make_portable(default)
    assert {i.name: i.type.tensor_type.elem_type for i in portable.graph.input if i.name in hyperparameter_feeds(
        default)} == {name: onnx.TensorProto.FLOAT for name in hyperparameter_feeds(default)}
    assert {n.op_type for n in portable.graph.node} >= {"Tanh", "Log"} and "Pow" not in {n.op_type for n in portable.graph.node}
    assert _adam_trajectory_error(torch, kind, options, default, 200) <= 5e-5
    assert _adam_trajectory_error(torch, kind, options, portable, 200) <= 5e-5


def test_cli_export_portable_writes_weights(tmp_path, capsys):
    source, target, ckpt = tmp_path / "block.onnx", tmp_path / "train.onnx", tmp_path / "train.ckpt"
    forward = examples.style_transfer_block()
    onnx.save(forward, source)
    assert export_tool.main([str(source), "-o", str(target), "--loss", "mse", "--portable"]) == 0
    assert str(ckpt) in capsys.readouterr().out
    written = onnx.load(str(target))
    assert_portable(written)
    weights = checkpoint.load(ckpt).tensors
    initializers = {t.name: onh.to_array(t) for t in forward.graph.initializer}
    assert set(weights) == set(initializers)
    assert all(np.array_equal(weights[k], initializers[k]) for k in weights)
    assert export_tool.main([str(source), "-o", str(tmp_path / "step.onnx"), "--loss", "mse", "--portable",
                             "--optimizer", "sgd"]) == 0
    assert_portable(onnx.load(str(tmp_path / "step.onnx")))


def test_trainer_feeds_the_portable_step_graphs_float32_hyperparameters():
    """The Trainer feeds a portable step graph's float32 hyperparameter inputs (their export
    values, not float32-rounded ones, are what it reports), and its steps are a plain
    session's fed ``hyperparameter_feeds``."""
    from normgrad.train import Trainer

    training = build_training_graph(examples.mlp(), loss="cross_entropy")
    step, state = build_step_graph(training, "adamw", portable=True, weight_decay=0.01, betas=(0.9, 0.999))
    trainer = Trainer(step, state, lr=0.01, kernels=None)
    assert trainer.hyperparameters["beta2"] == 0.999 and trainer.hyperparameters["weight_decay"] == 0.01
    rng = np.random.default_rng(2)
    batches = [{"x": rng.standard_normal((4, 5)).astype(np.float32), "labels": rng.integers(0, 3, 4)} for _ in range(3)]
    losses = [trainer.step(**batch) for batch in batches]
    import json

    names = json.loads({p.key: p.value for p in step.metadata_props}["normgrad.state"])
    plain = dict(state)
    for k, batch in enumerate(batches, start=1):
        out = run(step, {**hyperparameter_feeds(step), **plain, **batch, "lr": np.array(0.01, np.float32),
                         "step": np.array(k, np.float32)}, CPU)
        assert out["loss"] == np.float32(losses[k - 1])
        plain = {name: out[names[name]] for name in plain}
    for name, value in trainer.state_dict().items():
        np.testing.assert_array_equal(value, plain[name], err_msg=name)
