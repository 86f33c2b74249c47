"""Issue 13 item 10: ``normgrad check`` calls correct gradients right and wrong ones wrong.

The forward is evaluated in float64 with every piecewise decision (ReLU masks, MaxPool
winners, ...) held at the one the float32 run made, the step is picked per gradient
(relative to the value's RMS), and a ReLU input within the step of 0 is reported as a kink
held, not as an error. Timing is printed by the command, never asserted.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from onnx import TensorProto, helper, numpy_helper

from normgrad import checkpoint
from normgrad.graphs import TrainingGraph, build_training_graph, examples
from normgrad.tools import check as check_tool, cli
from normgrad.tools.export import main as export_main

from _artifacts import two_layer_model_named
from _graph_models import two_layer_model


@pytest.fixture(scope="module")
def small_resnet18():
    """resnet18's layout (20 BatchNorms, 17 ReLUs, a MaxPool) at reduced widths, 64 px."""
    return build_training_graph(examples.resnet18(batch=2, size=64, widths=(8, 16, 32, 64)))


def _check_cli(training: TrainingGraph, folder, capsys, *args: str):
    """`normgrad check` on the model written with its weights as `normgrad export` writes
    them (the checkpoint beside it, which check reads)."""
    path = folder / "train.onnx"
    onnx.save(training.model, path)
    checkpoint.save(folder / "train.ckpt", training.weights)
    status = cli.main(["check", str(path), *args])
    out = capsys.readouterr().out
    lines = {line.split()[1]: line.split()[0] for line in out.splitlines() if line.startswith(("OK", "FAIL"))}
    return status, lines, out


def test_correct_resnet_passes_with_default_options(small_resnet18, tmp_path, capsys):
    status, lines, out = _check_cli(small_resnet18, tmp_path, capsys)
    assert len(lines) == 63 and set(lines.values()) == {"OK"}, out
    assert status == 0
    assert re.search(r"63/63 gradients within 0.001.*\(\d+\.\d s\)$", out.strip().splitlines()[-1]), out


def test_a_corrupted_backward_node_fails(small_resnet18, tmp_path, capsys):
    """The mask of one ReLU's gradient inverted (let through where its input is negative,
    blocked where positive): every gradient upstream of it FAILs, every one downstream stays OK.
    That ReLU follows a BatchNorm, so its mask is the BatchNorm ops' relu_output (the ReLU's
    output); fed the negated ReLU input instead, it is inverted."""
    wrong = onnx.ModelProto()
    wrong.CopyFrom(small_resnet18.model)
    relu_input, relu_output = "layer3.0.conv1.out", "layer3.0.conv1.relu"
    masked = [n for n in wrong.graph.node if n.domain == "normgrad" and n.input[-1] == relu_output]
    assert len(masked) == 2
    first = min(i for i, n in enumerate(wrong.graph.node) if n.domain == "normgrad" and n.input[-1] == relu_output)
    wrong.graph.node.insert(first, oh.make_node("Neg", [relu_input], ["inverted_mask"]))
    for node in masked:
        node.input[-1] = "inverted_mask"
    status, lines, out = _check_cli(small_resnet18._replace(model=wrong), tmp_path, capsys)
    assert status == 1
    assert lines["layer3.0.conv1.weight_grad"] == "FAIL" and lines["conv1.weight_grad"] == "FAIL", out
    for downstream in ("layer3.0.conv2.weight_grad", "layer4.1.conv2.weight_grad", "fc.weight_grad", "fc.bias_grad"):
        assert lines[downstream] == "OK", out


def test_a_gradient_off_by_one_percent_fails_alone(small_resnet18, tmp_path, capsys):
    wrong = onnx.ModelProto()
    wrong.CopyFrom(small_resnet18.model)
    target = "layer2.0.conv1.weight_grad"
    producer = next(n for n in wrong.graph.node if target in n.output)
    producer.output[list(producer.output).index(target)] = target + "/exact"
    wrong.graph.initializer.append(onh.from_array(np.asarray(1.01, np.float32), "off_by_one_percent"))
    wrong.graph.node.append(oh.make_node("Mul", [target + "/exact", "off_by_one_percent"], [target]))
    status, lines, out = _check_cli(small_resnet18._replace(model=wrong), tmp_path, capsys)
    assert status == 1
    assert [name for name, verdict in lines.items() if verdict == "FAIL"] == [target], out


def test_relu_input_within_the_step_of_its_kink_is_held_not_failed():
    """x has elements 1e-9 from 0, far inside the step (1e-6 x RMS): unheld central
    differences straddle the kink and are off by half the slope there; held, they agree."""
    forward = examples.model([oh.make_node("Relu", ["x"], ["r"]), oh.make_node("Mul", ["r", "w"], ["y"])],
                             {"x": (4, 8)}, ["y"], {"w": np.linspace(0.5, 2.0, 32, dtype=np.float32).reshape(4, 8)})
    training = build_training_graph(forward)
    feeds = check_tool.random_feeds(training)
    feeds["x"][:, :4] = np.float32(1e-9) * np.sign(feeds["x"][:, :4])
    feeds["y_grad"] = np.ones((4, 8), np.float32)
    checks = {c.wrt: c for c in check_tool.check_gradients(training, feeds=feeds, directions=2)}
    assert checks["x"].error < 1e-6 and checks["x"].kinks > 0
    assert checks["w"].error < 1e-6
    unheld = check_tool.forward_function(training)
    g = np.where(feeds["x"] > 0, feeds["w"], 0).astype(np.float64)
    v = np.random.default_rng(0).standard_normal(g.shape)
    h = 1e-6 * float(np.sqrt(np.mean(np.square(feeds["x"].astype(np.float64)))))
    numeric = (unheld({**feeds, "x": feeds["x"] + h * v}) - unheld({**feeds, "x": feeds["x"] - h * v})) / (2 * h)
    assert abs(numeric - np.sum(g * v)) / np.linalg.norm(g) > 1e-3  # what the old check called a FAIL


def test_dropout_masks_are_held():
    """A training-mode Dropout draws a new mask per run; check holds the graph's mask."""
    forward = examples.model(
        [oh.make_node("Dropout", ["x", "ratio", "training"], ["d"]), oh.make_node("Tanh", ["d"], ["y"])],
        {"x": (8, 16)}, ["y"],
        {"ratio": np.asarray(0.3, np.float32), "training": np.asarray(True)}, opset=15)
    checks = check_tool.check_gradients(build_training_graph(forward), directions=2)
    assert checks and max(c.error for c in checks) < 1e-5


def test_check_gradients_runs_at_the_training_graphs_weights():
    """check_gradients(TrainingGraph) feeds the TrainingGraph's weights: y = tanh(x * w), so
    dL/dx = y_grad * w * (1 - y^2) depends on w. The same check at weights 2w (given as the
    TrainingGraph's weights, or in feeds to the model alone) gives other analytic values,
    each equal to the float64 central differences at those weights, and both ways agree."""
    w = np.linspace(0.25, 1.5, 32, dtype=np.float32).reshape(4, 8)
    forward = examples.model([oh.make_node("Mul", ["x", "w"], ["xw"]), oh.make_node("Tanh", ["xw"], ["y"])],
                             {"x": (4, 8)}, ["y"], {"w": w})
    training = build_training_graph(forward)
    assert set(training.weights) == {"w"}
    assert "w" not in {t.name for t in training.model.graph.initializer}
    rng = np.random.default_rng(5)
    batch = {"x": rng.standard_normal((4, 8)).astype(np.float32), "y_grad": rng.standard_normal((4, 8)).astype(np.float32)}

    def analytic(checks):
        return {c.wrt: np.array(c.analytic) for c in checks}

    at_w = check_tool.check_gradients(training, feeds=batch, directions=2)
    doubled = TrainingGraph(training.model, {"w": 2 * w})
    at_2w = check_tool.check_gradients(doubled, feeds=batch, directions=2)
    fed_2w = check_tool.check_gradients(training.model, feeds={**batch, "w": 2 * w}, directions=2)
    for checks in (at_w, at_2w, fed_2w):
        assert {c.wrt for c in checks} == {"x", "w"}
        assert max(c.error for c in checks) < 1e-6, checks
    # the truth the finite differences are taken of: f(x, w) = sum(tanh(x w) y_grad) in float64
    f = check_tool.forward_function(training)
    x64, w64, dy = batch["x"].astype(np.float64), w.astype(np.float64), batch["y_grad"].astype(np.float64)
    assert f(batch) == pytest.approx(float(np.sum(np.tanh(x64 * w64) * dy)), rel=1e-12)
    assert f({**batch, "w": 2 * w}) == pytest.approx(float(np.sum(np.tanh(x64 * 2 * w64) * dy)), rel=1e-12)
    np.testing.assert_array_equal(analytic(at_2w)["x"], analytic(fed_2w)["x"])
    np.testing.assert_array_equal(analytic(at_2w)["w"], analytic(fed_2w)["w"])
    # the same directions (same seed), other weights: the x gradient's values move
    assert np.all(np.abs(analytic(at_2w)["x"] - analytic(at_w)["x"]) > 1e-3 * np.abs(analytic(at_w)["x"]))


def test_check_says_a_step_graph_or_checkpoint_is_not_a_training_graph(forward_path, tmp_path, capsys):
    step = tmp_path / "s.onnx"
    assert cli.main(["export", str(forward_path), "-o", str(step), "--loss", "mse", "--optimizer", "sgd"]) == 0
    capsys.readouterr()
    assert cli.main(["check", str(step)]) == 1
    assert "step graph" in capsys.readouterr().err
    assert cli.main(["check", str(tmp_path / "s.ckpt")]) == 1
    assert "checkpoint" in capsys.readouterr().err


def _check(*arguments):
    from normgrad.tools import cli

    return cli.main(["check", *map(str, arguments)])


def test_check_refuses_an_input_beyond_memory_in_one_line(tmp_path, capsys):
    from normgrad.graphs import build_training_graph

    model = two_layer_model()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2**40
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 2**40
    onnx.save(build_training_graph(model, loss="mse").model, tmp_path / "t.onnx")
    assert _check(tmp_path / "t.onnx") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "input 'x'" in err and "memory" in err


def test_check_refuses_another_models_checkpoint(tmp_path, capsys):
    onnx.save(two_layer_model(), tmp_path / "a.onnx")
    onnx.save(two_layer_model_named(("w1", "v2")), tmp_path / "b.onnx")
    for name in ("a", "b"):
        assert export_main([str(tmp_path / f"{name}.onnx"), "-o", str(tmp_path / f"{name}_train.onnx"), "--loss",
                            "mse"]) == 0
    assert _check(tmp_path / "a_train.onnx") == 0
    capsys.readouterr()
    assert _check(tmp_path / "a_train.onnx", "--checkpoint", tmp_path / "b_train.ckpt") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'v2' is no input" in err
    state = checkpoint.load(tmp_path / "a_train.ckpt").tensors
    checkpoint.save(tmp_path / "partial.ckpt", {"w1": state["w1"]})
    assert _check(tmp_path / "a_train.onnx", "--checkpoint", tmp_path / "partial.ckpt") == 1
    assert "no tensor for weight 'w2'" in capsys.readouterr().err


def test_a_zero_size_weight_passes_the_gradient_check(tmp_path, capsys):
    """y = Concat(x @ v, w) with w of shape [4, 0]: its gradient is empty, trivially right
    (main reported FAIL rel.err nan and exit 1); v's is still checked."""
    rng = np.random.default_rng(19)
    v = numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32), "v")
    w = numpy_helper.from_array(np.zeros((4, 0), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "v"], ["h"]), helper.make_node("Concat", ["h", "w"], ["y"], axis=1)]
    graph = helper.make_graph(nodes, "empty_weight", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], [v, w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, tmp_path / "m.onnx")
    assert export_main([str(tmp_path / "m.onnx"), "-o", str(tmp_path / "t.onnx"), "--loss", "mse"]) == 0
    assert _check(tmp_path / "t.onnx") == 0
    out = capsys.readouterr().out
    assert "OK   w_grad" in out and "OK   v_grad" in out and "nan" not in out
    # a zero-size weight whose output is empty: the loss (a mean over no element) is NaN, so
    # no finite difference means anything, but the empty gradients are still trivially right
    w = numpy_helper.from_array(np.zeros((32, 0), np.float32), "w")
    b = numpy_helper.from_array(np.zeros((0,), np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    graph = helper.make_graph(nodes, "empty_output", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 0])], [w, b])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), tmp_path / "e.onnx")
    assert export_main([str(tmp_path / "e.onnx"), "-o", str(tmp_path / "e_train.onnx"), "--loss", "mse"]) == 0
    _check(tmp_path / "e_train.onnx")
    out = capsys.readouterr().out
    assert "OK   w_grad" in out and "OK   b_grad" in out


def _zero_size_weights_model(output_columns: int) -> onnx.ModelProto:
    """y = Concat(x @ v, x @ w + b) with w [32, 0] and b [0]; v [32, output_columns], so y
    is empty for output_columns 0."""
    rng = np.random.default_rng(19)
    weights = [onh.from_array(rng.standard_normal((32, output_columns)).astype(np.float32), "v"),
               onh.from_array(np.zeros((32, 0), np.float32), "w"), onh.from_array(np.zeros(0, np.float32), "b")]
    nodes = [oh.make_node("MatMul", ["x", "v"], ["h"]), oh.make_node("MatMul", ["x", "w"], ["e"]),
             oh.make_node("Add", ["e", "b"], ["eb"]), oh.make_node("Concat", ["h", "eb"], ["y"], axis=1)]
    graph = oh.make_graph(nodes, "zero_size", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 32])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, output_columns])], weights)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


def test_zero_size_weights_pass_as_empty_and_the_others_are_still_checked(tmp_path, capsys):
    status, lines, out = _check_cli(build_training_graph(_zero_size_weights_model(8), loss="mse"), tmp_path, capsys)
    assert status == 0 and lines == {"x_grad": "OK", "v_grad": "OK", "w_grad": "OK", "b_grad": "OK"}, out
    assert re.search(r"^OK   w_grad +empty: a zero-size tensor, nothing to compare$", out, re.M), out
    assert re.search(r"^OK   v_grad +rel\.err \d", out, re.M) and "nan" not in out, out


def test_a_loss_of_an_empty_output_needs_zero_gradients(tmp_path, capsys):
    """mse of a [4, 0] output is a mean over no element: NaN, whatever x is. x's gradient
    (non-empty) must be exactly zero: it passes; made non-zero, it fails."""
    training = build_training_graph(_zero_size_weights_model(0), loss="mse")
    status, lines, out = _check_cli(training, tmp_path, capsys)
    assert status == 0 and set(lines.values()) == {"OK"} and "nan" not in out, out
    assert "rel.err 0.00e+00" in out and "the loss reads no element (output y is empty)" in out, out
    wrong = onnx.ModelProto()
    wrong.CopyFrom(training.model)
    producer = next(n for n in wrong.graph.node if "x_grad" in n.output)
    producer.output[list(producer.output).index("x_grad")] = "x_grad/exact"
    wrong.graph.node.append(oh.make_node("Add", ["x_grad/exact", "x"], ["x_grad"]))
    status, lines, out = _check_cli(training._replace(model=wrong), tmp_path, capsys)
    assert status == 1 and lines == {"x_grad": "FAIL", "v_grad": "OK", "w_grad": "OK", "b_grad": "OK"}, out


def test_float64_evaluation_of_an_eval_mode_batch_norm_training_graph():
    """An eval-mode (frozen) BatchNorm's backward omits the per-channel sums (BatchNormReduceBackward
    with input_g=0): the float64 evaluation runs it, and gives onnxruntime's float32 values."""
    import onnxruntime as ort

    from normgrad.ops import api
    from normgrad.tools.corpus import float64_outputs

    from _graph_models import batch_norm_parameters, model
    from _helpers import cpp_available

    node = oh.make_node("BatchNormalization", ["x", "s", "t", "m", "v"], ["y"], epsilon=1e-3)
    training = build_training_graph(model([node], {"x": (4, 3, 5, 3)}, ["y"], batch_norm_parameters(3, seed=5),
                                          opset=15), loss="mse")
    reduce = [n for n in training.model.graph.node if n.op_type == "BatchNormReduceBackward"]
    assert reduce and not any(reduce[0].output[:2])
    rng = np.random.default_rng(0)
    initializers = {t.name for t in training.model.graph.initializer}
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in training.model.graph.input if i.name not in initializers}
    expected = float64_outputs(training.model, feeds)
    options = ort.SessionOptions()
    api.session_options("cpp" if cpp_available() else "python", options)
    session = ort.InferenceSession(training.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for name, value in zip([o.name for o in session.get_outputs()], session.run(None, feeds)):
        np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5)
