"""Training graphs of whole models: blocks, losses, backends, the CLI, torch's exporters."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import normgrad
from normgrad import checkpoint
from normgrad.graphs import TrainingGraph, build_training_graph
from normgrad.ops import IR_VERSION
from normgrad.tools import check as check_tool, cli, export as export_tool
from normgrad.train import Trainer, TrainerError

from _artifacts import LABELS, X, export_sgd, killed_by_hook, two_layer_model_named
from _graph_models import group_norm_block, instance_norm_block, mlp, resnet_block, two_layer_model

TOLERANCE = 1e-4

BLOCKS = {
    "resnet_train": lambda: resnet_block(training=1),
    "resnet_eval": lambda: resnet_block(training=0),
    "resnet_opset9": lambda: resnet_block(training=1, opset=9),
    "resnet_opset14": lambda: resnet_block(training=1, opset=14),
    "group_norm_21": lambda: group_norm_block(opset=21),
    "group_norm_18": lambda: group_norm_block(opset=18),
    "instance_norm": instance_norm_block,
}


def _options(backend: str):
    if backend == "functions":
        return None
    try:
        return normgrad.session_options(backend)
    except FileNotFoundError:
        pytest.skip("normgrad C++ library not built")


def _assert_close(training: TrainingGraph, backend: str = "functions") -> None:
    checks = check_tool.check_gradients(training, session_options=_options(backend), directions=2)
    worst = max(checks, key=lambda c: c.error)
    assert worst.error < TOLERANCE, worst


@pytest.mark.parametrize("name", sorted(BLOCKS))
@pytest.mark.parametrize("inline", [False, True])
def test_block_gradients(name, inline):
    training = build_training_graph(BLOCKS[name](), inline=inline)
    model = training.model
    assert model.ir_version == 10
    domains = {o.domain for o in model.opset_import}
    if inline:
        assert "normgrad" not in domains and not model.functions
        assert all(node.domain in ("", "ai.onnx") for node in model.graph.node)
    elif "norm" in name:
        assert "normgrad" in domains and model.functions
    _assert_close(training)


@pytest.mark.parametrize("name", ["resnet_train", "resnet_eval", "group_norm_21", "instance_norm"])
def test_block_gradients_cpp_kernels(name):
    _assert_close(build_training_graph(BLOCKS[name]()), backend="cpp")


def test_training_graph_contract():
    forward = resnet_block(training=1)
    training, weights = build_training_graph(forward)
    inputs = [i.name for i in training.graph.input]
    outputs = [o.name for o in training.graph.output]
    trainable = [t.name for t in forward.graph.initializer if t.name[0] not in "mv"]  # initializer order
    assert sorted(trainable) == ["b1", "s1", "s2", "t1", "t2", "w1", "w2"]
    assert inputs == ["x"] + trainable + ["y_grad"]
    assert outputs == ["y", "x_grad"] + [f"{n}_grad" for n in trainable]
    # the weights are pure inputs, their values the forward's; the running statistics stay initializers
    stored = {t.name for t in training.graph.initializer}
    assert stored >= {"m1", "v1", "m2", "v2"} and not stored & set(trainable)
    assert list(weights) == trainable
    initial = {t.name: onnx.numpy_helper.to_array(t) for t in forward.graph.initializer}
    assert all(np.array_equal(weights[n], initial[n]) and weights[n].dtype == initial[n].dtype for n in trainable)
    assert training.opset_import[0].domain == "" and training.opset_import[0].version == 15
    onnx.checker.check_model(training, full_check=True)
    ops = {n.op_type for n in training.graph.node}
    assert {"BatchNormReduceBackward", "BatchNormElemtBackward"} <= ops


def test_opset_raised_to_16_for_max_pool():
    import onnx.helper as oh

    from _graph_models import model

    forward = model([oh.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2])], {"x": (1, 2, 4, 4)}, ["y"], opset=15)
    assert build_training_graph(forward).model.opset_import[0].version == 16


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
@pytest.mark.parametrize("inline", [False, True])
def test_mlp_with_loss(loss, inline):
    training = build_training_graph(mlp(), loss=loss, inline=inline)
    assert [i.name for i in training.model.graph.input][-1] == "labels"
    assert "loss" in [o.name for o in training.model.graph.output]
    _assert_close(training)
    feeds = check_tool.random_feeds(training, seed=3)
    session = ort.InferenceSession(training.model.SerializeToString())
    y, value = session.run(["y", "loss"], feeds)
    y = y.astype(np.float64)
    if loss == "mse":
        expected = np.mean((y - feeds["labels"]) ** 2)
    else:
        log_p = y - y.max(1, keepdims=True)
        log_p -= np.log(np.exp(log_p).sum(1, keepdims=True))
        expected = -np.mean(log_p[np.arange(len(y)), feeds["labels"]])
    assert value.shape == () and np.isclose(value, expected, rtol=1e-5)


def test_cli_export_and_check(tmp_path, capsys):
    source, target = tmp_path / "block.onnx", tmp_path / "train.onnx"
    onnx.save(group_norm_block(), source)
    assert export_tool.main([str(source), "-o", str(target)]) == 0
    assert check_tool.main([str(target), "--directions", "1"]) == 0
    out = capsys.readouterr().out
    assert "gamma_grad" in out and "5/5 gradients" in out
    assert export_tool.main([str(source), "-o", str(target), "--loss", "mse", "--inline"]) == 0
    assert check_tool.main([str(target), "--directions", "1"]) == 0


def test_cli_export_reports_unsupported_operator(tmp_path, capsys):
    import onnx.helper as oh

    from _graph_models import model

    forward = model([oh.make_node("Acos", ["x"], ["y"], name="wave")], {"x": (2, 3)}, ["y"])
    onnx.save(forward, tmp_path / "acos.onnx")
    assert export_tool.main([str(tmp_path / "acos.onnx"), "-o", str(tmp_path / "out.onnx")]) == 1
    assert "Acos" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ torch
def _torch_modules(torch):
    nn = torch.nn

    class ResBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(4, 4, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(4)
            self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(4)

        def forward(self, x):
            return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + x)

    class GroupBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 6, 3, padding=1, stride=2)
            self.norm = nn.GroupNorm(3, 6)
            self.inorm = nn.InstanceNorm2d(6, affine=True)
            self.head = nn.Linear(6, 5)

        def forward(self, x):
            h = self.norm(self.conv(x))
            h = h * torch.sigmoid(h)
            h = self.inorm(h)
            h = nn.functional.max_pool2d(h, 2)
            return self.head(h.mean(dim=(2, 3)))

    return {"resnet": (ResBlock, (2, 4, 6, 6)), "groupnorm": (GroupBlock, (2, 3, 8, 8))}


def _randomise(torch, module):
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(torch.randn_like(param) * 0.5 + (1.0 if name.endswith("norm.weight") or "bn" in name and name.endswith("weight") else 0.0))


def _compare_with_autograd(torch, module, shape, forward: onnx.ModelProto, backend="functions", inline=False):
    training, weights = build_training_graph(forward, inline=inline)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    xt = torch.tensor(x, requires_grad=True)
    out = module(xt)
    dy = rng.standard_normal(tuple(out.shape)).astype(np.float32)
    out.backward(torch.tensor(dy))
    input_name = forward.graph.input[0].name
    output_name = forward.graph.output[0].name
    feeds = {**weights, input_name: x, f"{output_name}_grad": dy}
    options = _options(backend) or ort.SessionOptions()
    session = ort.InferenceSession(training.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in training.graph.output]
    results = dict(zip(names, session.run(None, feeds)))
    np.testing.assert_allclose(results[output_name], out.detach().numpy(), rtol=1e-4, atol=1e-5)
    expected = {input_name: xt.grad.numpy()}
    params = dict(module.named_parameters())
    for name, param in params.items():
        if name in weights:
            expected[name] = param.grad.numpy()
    assert len(expected) > 2, f"parameters not found among the weights {sorted(weights)}"
    largest = max(np.abs(grad).max() for grad in expected.values())
    for name, grad in expected.items():
        got = results[f"{name}_grad"]
        # relative to the gradient's own scale; a gradient that is zero in exact arithmetic
        # (a conv bias before BatchNorm) is judged against 1e-2 of the largest one
        scale = max(np.abs(grad).max(), 1e-2 * largest)
        assert np.abs(got - grad).max() / scale < 2e-5, (name, np.abs(got - grad).max(), scale)
    return training


@pytest.mark.parametrize("name", ["resnet", "groupnorm"])
@pytest.mark.parametrize("backend, inline", [("functions", False), ("functions", True), ("cpp", False)])
def test_torchscript_export_matches_autograd(tmp_path, name, backend, inline):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    cls, shape = _torch_modules(torch)[name]
    module = cls().train()
    _randomise(torch, module)
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(
        module, (torch.randn(shape),), str(path), dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
        do_constant_folding=False, input_names=["x"], output_names=["y"], opset_version=17,
    )
    _compare_with_autograd(torch, module, shape, onnx.load(str(path)), backend, inline)


def test_dynamo_export_group_norm_matches_autograd(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    cls, shape = _torch_modules(torch)["groupnorm"]
    module = cls().eval()  # GroupNorm/InstanceNorm behave the same in eval; no BatchNorm here
    _randomise(torch, module)
    try:
        program = torch.onnx.export(module, (torch.randn(shape),), dynamo=True, opset_version=21)
    except Exception as error:  # the dynamo exporter needs onnxscript; offline it may be missing
        pytest.skip(f"dynamo exporter unavailable: {type(error).__name__}: {error}")
    forward = program.model_proto
    assert any(n.op_type == "GroupNormalization" for n in forward.graph.node)
    _compare_with_autograd(torch, module, shape, forward)


@pytest.mark.parametrize("command", ["export", "check"])
@pytest.mark.parametrize("problem", ["missing", "not_onnx", "folder"])
def test_cli_unreadable_model_is_one_line(tmp_path, capsys, command, problem):
    path = tmp_path / "model.onnx"
    if problem == "not_onnx":
        path.write_text("not a model")
    elif problem == "folder":
        path.mkdir()
    args = [str(path), "-o", str(tmp_path / "out.onnx")] if command == "export" else [str(path)]
    tool = export_tool if command == "export" else check_tool
    assert tool.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"normgrad {command}: ") and str(path) in err and "Traceback" not in err
    assert err.count("\n") == 1 and "[Errno" not in err


def test_cli_export_unwritable_output(tmp_path, capsys):
    onnx.save(mlp(), tmp_path / "mlp.onnx")
    assert export_tool.main([str(tmp_path / "mlp.onnx"), "-o", str(tmp_path / "no" / "such" / "dir.onnx")]) == 1
    assert "cannot write" in capsys.readouterr().err


def test_cli_check_refuses_a_forward_model(tmp_path, capsys):
    onnx.save(mlp(), tmp_path / "mlp.onnx")
    assert check_tool.main([str(tmp_path / "mlp.onnx")]) == 1
    assert "not a training graph written by normgrad" in capsys.readouterr().err


def _shape_arithmetic_model():
    """x [2, 3, 4] -> Reshape to [2, 12] with the target computed as TorchScript writes
    nn.MultiheadAttention's: Concat(Slice(Shape(x), 0, Mod(1, 3)), [-1]) -> Gather row 1 ->
    times a float Constant 2."""
    c = lambda name, value: oh.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.asarray(value), name))  # noqa: E731
    nodes = [
        c("one", np.array([1], np.int64)), c("three", np.array([3], np.int64)), c("zero", np.array([0], np.int64)),
        c("minus_one", np.array([-1], np.int64)), c("row", np.array(1, np.int64)), c("two", np.array(2.0, np.float32)),
        oh.make_node("Mod", ["one", "three"], ["end"]),
        oh.make_node("Shape", ["x"], ["shape"]),
        oh.make_node("Slice", ["shape", "zero", "end"], ["lead"]),
        oh.make_node("Concat", ["lead", "minus_one"], ["target"], axis=0),
        oh.make_node("Reshape", ["x", "target"], ["flat"]),
        oh.make_node("Gather", ["flat", "row"], ["picked"], axis=0),
        oh.make_node("Mul", ["picked", "two"], ["y"]),
    ]
    graph = oh.make_graph(nodes, "shape_arithmetic", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=10)


def test_integer_shape_arithmetic_on_constants_is_folded_so_shapes_are_known():
    """Without folding, onnx shape inference cannot follow Mod into the Slice, Reshape's
    output has no rank, and the Gather rule cannot be written."""
    from normgrad.graphs import rewrites

    model = _shape_arithmetic_model()
    assert not onnx.shape_inference.infer_shapes(model, data_prop=True).graph.output[0].type.tensor_type.HasField("shape")
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    rewrites.fold_integer_constants(folded)
    ops = [n.op_type for n in folded.graph.node]
    assert ops.count("Mod") == 0 and ops.count("Mul") == 1 and ops.count("Shape") == 1  # float and x-dependent nodes stay
    training = build_training_graph(model)
    assert [o.name for o in training.model.graph.output] == ["y", "x_grad"]
    _assert_close(training)


def test_batch_norm_relu_backward_is_fused():
    """BN -> Relu (BN output read by the Relu alone): the BatchNorm backward ops take the
    Relu's gradient and output (relu_output) and no Relu gradient is written; BN -> Add
    keeps the plain ops. Gradients checked against finite differences on both runtimes."""
    training = build_training_graph(resnet_block(training=1))
    bn_ops = [n for n in training.model.graph.node  # the backward's (the forward's variance is a reduce op too)
              if n.op_type in ("BatchNormReduceBackward", "BatchNormElemtBackward") and n.name.startswith("grad/")]
    masked = [n for n in bn_ops if n.input[-1] == "r1"]  # the Relu output, never its input n1
    assert len(bn_ops) == 4 and len(masked) == 2
    # the other BatchNorm's ops are fed the scalar 1 (no mask): one function body per op type
    assert all(n.input[-1].endswith("relu_output_omitted") for n in bn_ops if n not in masked)
    assert not any("n1" in n.input for n in training.model.graph.node if n.op_type in ("Greater", "Where", "Mul"))
    _assert_close(training, backend="cpp")
    _assert_close(training)


@pytest.mark.parametrize("backend", ["cpp", "functions"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_batch_norm_relu_gradients_float64_truth(backend, dtype):
    """BatchNormalization (training) -> Relu in float32 and float16, fused: x, scale and bias
    gradients against BatchNorm + ReLU backward written out in float64 NumPy."""
    from _graph_models import model

    rng = np.random.default_rng(0)
    params = {"s": rng.uniform(0.5, 1.5, 4), "t": rng.standard_normal(4), "m": np.zeros(4), "v": np.ones(4)}
    nodes = [oh.make_node("BatchNormalization", ["x", "s", "t", "m", "v"], ["n", "rm", "rv"], training_mode=1, epsilon=1e-5),
             oh.make_node("Relu", ["n"], ["y"])]
    elem_type = oh.np_dtype_to_tensor_dtype(np.dtype(dtype))
    forward = model(nodes, {"x": (2, 4, 5, 5)}, ["y"], {k: v.astype(dtype) for k, v in params.items()}, opset=15,
                    elem_type=elem_type)
    training, weights = build_training_graph(forward)
    relu_output = {"y"} | {n.output[0] for n in training.graph.node if n.op_type == "Cast" and list(n.input) == ["y"]}
    assert sum(n.input[-1] in relu_output for n in training.graph.node if n.domain == "normgrad") == 2  # fused
    if backend == "cpp":
        _options("cpp")  # skips without the library
    session = normgrad.inference_session(training, backend=backend, providers=["CPUExecutionProvider"])
    x = (rng.standard_normal((2, 4, 5, 5)) * 2 + 1).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {**weights, "x": x, "y_grad": dy})))
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    s, t = (params[k].astype(dtype).astype(np.float64).reshape(1, -1, 1, 1) for k in ("s", "t"))
    invstd = 1 / np.sqrt(x64.var(axis=(0, 2, 3), keepdims=True) + 1e-5)
    xhat = (x64 - x64.mean(axis=(0, 2, 3), keepdims=True)) * invstd
    g = np.where(s * xhat + t > 0, dy64, 0.0)
    truth = {"s_grad": (g * xhat).sum(axis=(0, 2, 3)), "t_grad": g.sum(axis=(0, 2, 3)),
             "x_grad": s * invstd * (g - g.mean(axis=(0, 2, 3), keepdims=True)
                                     - xhat * (g * xhat).mean(axis=(0, 2, 3), keepdims=True))}
    tolerance = 1e-5 if dtype == np.float32 else 4e-3
    for name, want in truth.items():
        assert got[name].dtype == dtype, name
        error = np.abs(got[name].astype(np.float64) - want).max() / np.abs(want).max()
        assert error < tolerance, (name, error)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_cli_export_files_honour_the_umask(tmp_path, umask):
    """The step graph, its checkpoint and evaluation graph get the mode open() gives a new
    file under the umask (they were mkstemp's 0600 whatever the umask)."""
    onnx.save(mlp(), tmp_path / "mlp.onnx")
    previous = os.umask(umask)
    try:
        with open(tmp_path / "by_open", "wb"):
            pass
        assert export_tool.main([str(tmp_path / "mlp.onnx"), "-o", str(tmp_path / "step.onnx"), "--loss", "mse",
                                 "--optimizer", "adamw"]) == 0
    finally:
        os.umask(previous)
    expected = os.stat(tmp_path / "by_open").st_mode & 0o7777
    assert expected == 0o666 & ~umask
    for name in ("step.onnx", "step.ckpt", "step.eval.onnx"):
        assert os.stat(tmp_path / name).st_mode & 0o7777 == expected, name


def _step_set():
    from normgrad.graphs import build_step_graph

    return build_step_graph(build_training_graph(mlp(), loss="cross_entropy"), "adamw", weight_decay=0.01)


def test_save_artifacts_writes_step_eval_and_checkpoint(tmp_path):
    from normgrad import checkpoint
    from normgrad.artifacts import save_artifacts
    from normgrad.graphs.step_graph import build_eval_graph

    step, initial = _step_set()
    saved = save_artifacts(tmp_path / "s.onnx", step, initial)
    assert (saved.graph, saved.checkpoint, saved.eval_graph) == (
        str(tmp_path / "s.onnx"), str(tmp_path / "s.ckpt"), str(tmp_path / "s.eval.onnx"))
    assert onnx.load(saved.graph).SerializeToString(deterministic=True) == step.SerializeToString(deterministic=True)
    written_eval = onnx.load(saved.eval_graph).SerializeToString(deterministic=True)
    assert written_eval == build_eval_graph(step).SerializeToString(deterministic=True)
    state = checkpoint.load(saved.checkpoint).tensors
    assert sorted(state) == sorted(initial)
    for name, value in initial.items():
        assert np.array_equal(state[name], value), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.ckpt", "s.eval.onnx", "s.onnx"]


def test_save_artifacts_failure_writes_nothing_and_keeps_the_old_set(tmp_path, monkeypatch):
    from normgrad import checkpoint
    from normgrad.artifacts import save_artifacts

    step, initial = _step_set()
    old = {name: f"old {name}".encode() for name in ("s.onnx", "s.eval.onnx", "s.ckpt")}
    for name, data in old.items():
        (tmp_path / name).write_bytes(data)

    def full_disk(path, tensors, **options):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "stage", full_disk)
    with pytest.raises(OSError) as raised:
        save_artifacts(tmp_path / "s.onnx", step, initial)
    assert raised.value.filename == str(tmp_path / "s.ckpt")  # names the file of the set that failed
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == old  # no new file, no temporary, none replaced


def test_save_artifacts_refuses_aliases_and_missing_folders(tmp_path):
    from normgrad.util.files import PathAliasError
    from normgrad.artifacts import save_artifacts

    step, initial = _step_set()
    with pytest.raises(PathAliasError, match="are one file"):
        save_artifacts(tmp_path / "s.onnx", step, initial, checkpoint=tmp_path / "s.eval.onnx")
    with pytest.raises(FileNotFoundError, match="no folder"):
        save_artifacts(tmp_path / "missing" / "s.onnx", step, initial)
    assert not any(tmp_path.iterdir())


def _capturing_model(op_type: str) -> onnx.ModelProto:
    """y = F(x) + b, where F is an If/Loop/Scan whose body reads x from the outer scope only."""
    TP = onnx.TensorProto
    const = lambda name, value: helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(value))
    if op_type == "If":
        then = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["t"])], "then", [],
                                 [helper.make_tensor_value_info("t", TP.FLOAT, [3])])
        other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                                  [helper.make_tensor_value_info("e", TP.FLOAT, [3])])
        nodes = [const("c", np.array(True)),
                 helper.make_node("If", ["c"], ["u"], then_branch=then, else_branch=other, name="branch")]
    elif op_type == "Loop":
        body = helper.make_graph(
            [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["v_in", "x"], ["v_out"])],
            "body",
            [helper.make_tensor_value_info("i", TP.INT64, []), helper.make_tensor_value_info("cond_in", TP.BOOL, []),
             helper.make_tensor_value_info("v_in", TP.FLOAT, [3])],
            [helper.make_tensor_value_info("cond_out", TP.BOOL, []), helper.make_tensor_value_info("v_out", TP.FLOAT, [3])],
        )
        nodes = [const("trips", np.array(2, np.int64)), const("go", np.array(True)), const("v0", np.zeros(3, np.float32)),
                 helper.make_node("Loop", ["trips", "go", "v0"], ["u"], body=body, name="branch")]
    else:
        body = helper.make_graph(
            [helper.make_node("Add", ["s_in", "x"], ["s_out"]), helper.make_node("Identity", ["e_in"], ["e_out"])],
            "body",
            [helper.make_tensor_value_info("s_in", TP.FLOAT, [3]), helper.make_tensor_value_info("e_in", TP.FLOAT, [])],
            [helper.make_tensor_value_info("s_out", TP.FLOAT, [3]), helper.make_tensor_value_info("e_out", TP.FLOAT, [])],
        )
        nodes = [const("s0", np.zeros(3, np.float32)), const("seq", np.arange(2, dtype=np.float32)),
                 helper.make_node("Scan", ["s0", "seq"], ["u", "scanned"], body=body, num_scan_inputs=1, name="branch")]
    nodes.append(helper.make_node("Add", ["u", "b"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [3])],
                              initializer=[onnx.numpy_helper.from_array(np.ones(3, np.float32), "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=normgrad.ops.IR_VERSION)


@pytest.mark.parametrize("op_type", ["If", "Loop", "Scan"])
def test_gradient_through_captures_is_refused(op_type):
    from normgrad.graphs import UnsupportedOperatorError, build_training_graph

    with pytest.raises(UnsupportedOperatorError, match=f"operator {op_type} \\({op_type} node 'branch'\\)"):
        build_training_graph(_capturing_model(op_type))


def test_check_fails_a_graph_that_ignores_captures(monkeypatch):
    """A training graph built as before (captures unseen: x_grad = 0) is called wrong by check."""
    from normgrad.graphs import build_training_graph, builder
    from normgrad.tools import check as check_tool

    monkeypatch.setattr(builder, "subgraph_captures", lambda node: [])
    wrong = build_training_graph(_capturing_model("If"))
    checks = {c.wrt: c for c in check_tool.check_gradients(wrong, directions=2)}
    assert checks["x"].analytic == [0.0, 0.0] and min(abs(n) for n in checks["x"].numeric) > 1e-3
    assert checks["x"].error > 0.5  # FAIL
    assert checks["b"].error < 1e-6


# ------------------------------------------------------------- nothing to differentiate


@pytest.mark.parametrize("op_type", ["ArgMax", "Shape"])
def test_model_without_differentiable_output_is_refused(op_type, tmp_path, capsys):
    from normgrad.graphs import build_training_graph
    from normgrad.tools import cli

    node = helper.make_node(op_type, ["x"], ["y"], **({"axis": 1} if op_type == "ArgMax" else {}))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.INT64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=normgrad.ops.IR_VERSION)
    with pytest.raises(ValueError, match="no output of the model is differentiable.*y \\(int64\\)"):
        build_training_graph(model)
    onnx.save(model, tmp_path / "m.onnx")
    assert cli.main(["export", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "t.onnx")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no output of the model is differentiable" in err
    assert not (tmp_path / "t.onnx").exists()


def test_failed_export_keeps_the_trained_checkpoint(forward_path, tmp_path, capsys):
    trained = tmp_path / "trained.ckpt"
    checkpoint.save(trained, {"w1": np.full((5, 6), 7.0, np.float32)}, {"normgrad.step": "1000"})
    before = trained.read_bytes()
    code = cli.main(["export", str(forward_path), "-o", str(tmp_path / "missing" / "step.onnx"), "--loss", "mse",
                             "--optimizer", "sgd", "--checkpoint", str(trained)])
    assert code == 1
    assert trained.read_bytes() == before
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing" in err


def test_export_refuses_one_path_for_graph_and_checkpoint(forward_path, tmp_path, capsys):
    target = tmp_path / "X"
    code = cli.main(["export", str(forward_path), "-o", str(target), "--loss", "mse", "--optimizer", "sgd",
                             "--checkpoint", str(target)])
    assert code == 2
    assert not target.exists()
    assert "--checkpoint" in capsys.readouterr().err


def test_export_writes_neither_file_when_the_checkpoint_cannot_be_written(forward_path, tmp_path, monkeypatch):
    output, ckpt = tmp_path / "step.onnx", tmp_path / "step.ckpt"
    output.write_bytes(b"old graph")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "stage", full_disk)
    code = cli.main(["export", str(forward_path), "-o", str(output), "--loss", "mse", "--optimizer", "sgd"])
    assert code == 1
    assert output.read_bytes() == b"old graph"
    assert sorted(os.listdir(tmp_path)) == ["mlp.onnx", "step.onnx"]  # no temporary left


def test_export_names_the_checkpoint_when_its_folder_is_missing(forward_path, tmp_path, capsys):
    code = cli.main(["export", str(forward_path), "-o", str(tmp_path / "step.onnx"), "--loss", "mse", "--optimizer",
                             "sgd", "--checkpoint", str(tmp_path / "nowhere" / "c.ckpt")])
    err = capsys.readouterr().err
    assert code == 1 and "checkpoint" in err and "nowhere" in err and "step.onnx" not in err
    assert not (tmp_path / "step.onnx").exists()


def _model_with_output(name):
    nodes = [helper.make_node("Mul", ["x", "W"], ["h"]), helper.make_node("Identity", ["h"], [name])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 3])],
                              [numpy_helper.from_array(np.ones(3, np.float32), "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=IR_VERSION)


@pytest.mark.parametrize("name, loss", [("W_grad", None), ("W_grad", "mse"), ("x_grad", "mse"), ("loss", "mse")])
def test_a_forward_value_named_like_a_gradient_or_the_loss_is_refused(name, loss):
    with pytest.raises(ValueError, match=f"already has a value named '{name}'"):
        build_training_graph(_model_with_output(name), loss=loss)


def test_cli_refuses_a_forward_output_named_loss(tmp_path, capsys):
    onnx.save(_model_with_output("loss"), str(tmp_path / "m.onnx"))
    code = cli.main(["export", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "s.onnx"), "--loss", "mse", "--optimizer", "sgd"])
    err = capsys.readouterr().err
    assert code == 1 and "'loss'" in err and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]


def test_gradient_outputs_are_the_gradients():
    """The README's loop reads outputs[f"{name}_grad"]: the gradient, against float64 finite differences."""
    training = build_training_graph(_model_with_output("y"), loss="mse")
    session = ort.InferenceSession(training.model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    labels = np.zeros((2, 3), np.float32)
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, training.feeds({"x": x, "labels": labels}))))
    w = np.ones(3)
    loss = lambda w: np.mean((x.astype(np.float64) * w) ** 2)  # noqa: E731
    step = 1e-6
    numeric = [(loss(w + step * e) - loss(w - step * e)) / (2 * step) for e in np.eye(3)]
    np.testing.assert_allclose(got["W_grad"], numeric, rtol=1e-4)


def _trained_checkpoint(step_path, ckpt_path):
    trainer = Trainer(step_path, ckpt_path, lr=0.1, kernels=None)
    for _ in range(3):
        trainer.step(X, LABELS)
    trainer.save(ckpt_path)
    return ckpt_path.read_bytes()


def test_an_export_failing_at_its_graph_keeps_the_trained_checkpoint(tmp_path, capsys):
    """-o names a folder: exit 1 naming it, and the trained t.ckpt is byte for byte the same
    (main replaced it with fresh initial weights first)."""
    onnx.save(two_layer_model(), tmp_path / "forward.onnx")
    assert export_sgd(tmp_path / "forward.onnx", tmp_path / "t.onnx") == 0
    trained = _trained_checkpoint(tmp_path / "t.onnx", tmp_path / "t.ckpt")
    os.remove(tmp_path / "t.onnx")
    (tmp_path / "t.onnx").mkdir()
    capsys.readouterr()
    assert export_sgd(tmp_path / "forward.onnx", tmp_path / "t.onnx") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "t.onnx" in err and "folder" in err
    assert (tmp_path / "t.ckpt").read_bytes() == trained


@pytest.mark.parametrize("kill_at", [1, 2, 3, 4])
def test_a_killed_export_leaves_the_old_set_or_the_new_one(tmp_path, kill_at):
    """export --optimizer killed at each rename (journal, step graph, evaluation graph,
    checkpoint): after normgrad's recovery (what the Trainer runs when it loads) the step
    graph, evaluation graph and checkpoint are bytewise the old set (with the trained
    checkpoint) or the new one (as an export into a fresh folder writes it)."""
    onnx.save(two_layer_model(1.0), tmp_path / "forward.onnx")
    onnx.save(two_layer_model(2.0), tmp_path / "forward2.onnx")
    new_options = ("--momentum", "0.9")
    (tmp_path / "fresh").mkdir()
    assert export_sgd(tmp_path / "forward2.onnx", tmp_path / "fresh" / "t.onnx", *new_options) == 0
    assert export_sgd(tmp_path / "forward.onnx", tmp_path / "t.onnx") == 0
    trained = _trained_checkpoint(tmp_path / "t.onnx", tmp_path / "t.ckpt")
    names = ("t.onnx", "t.eval.onnx", "t.ckpt")
    old = {name: (tmp_path / name).read_bytes() for name in names}
    new = {name: (tmp_path / "fresh" / name).read_bytes() for name in names}
    assert old["t.onnx"] != new["t.onnx"] and old["t.ckpt"] != new["t.ckpt"]
    killed_by_hook("""
        from normgrad.tools.export import main
        main([sys.argv[3], "-o", sys.argv[4], "--loss", "mse", "--optimizer", "sgd", "--momentum", "0.9"])
    """, "os.rename", kill_at, tmp_path / "forward2.onnx", tmp_path / "t.onnx")
    trainer = Trainer(tmp_path / "t.onnx", tmp_path / "t.ckpt", lr=0.1, kernels=None)  # recovers first
    files = {name: (tmp_path / name).read_bytes() for name in names}
    assert files in (old, new)
    assert trainer.step_count == (3 if files == old else 0)
    assert files == (old if kill_at == 1 else new)  # the journal's rename is the commit point
    assert not [n for n in os.listdir(tmp_path) if n.endswith("normgrad-commit")]
    trainer.step(X, LABELS)
    assert export_sgd(tmp_path / "forward.onnx", tmp_path / "t.onnx") == 0  # the next write clears the leftovers
    assert sorted(os.listdir(tmp_path)) == ["forward.onnx", "forward2.onnx", "fresh", "t.ckpt", "t.eval.onnx",
                                            "t.onnx"]
    assert trained != (tmp_path / "t.ckpt").read_bytes()


def test_export_refuses_the_checkpoint_over_its_evaluation_graph(tmp_path, capsys):
    """--checkpoint s.eval.onnx is the evaluation graph export writes: exit 2, nothing written."""
    onnx.save(two_layer_model(), tmp_path / "forward.onnx")
    code = export_sgd(tmp_path / "forward.onnx", tmp_path / "s.onnx", "--checkpoint", str(tmp_path / "s.eval.onnx"))
    assert code == 2
    assert "evaluation graph" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["forward.onnx"]


def test_export_refuses_an_output_hard_linked_to_the_input(tmp_path, capsys):
    onnx.save(two_layer_model(), tmp_path / "forward.onnx")
    os.link(tmp_path / "forward.onnx", tmp_path / "alias.onnx")
    before = (tmp_path / "forward.onnx").read_bytes()
    assert export_sgd(tmp_path / "forward.onnx", tmp_path / "alias.onnx") == 2
    assert "input model" in capsys.readouterr().err
    assert (tmp_path / "forward.onnx").read_bytes() == before


def test_export_refuses_an_output_that_is_the_input_data_file(tmp_path, capsys):
    onnx.save(two_layer_model(), tmp_path / "forward.onnx", save_as_external_data=True, location="w.bin",
              size_threshold=0)
    before = (tmp_path / "w.bin").read_bytes()
    assert export_sgd(tmp_path / "forward.onnx", tmp_path / "w.bin") == 2
    assert "data file of the input model" in capsys.readouterr().err
    assert (tmp_path / "w.bin").read_bytes() == before


def test_a_weight_missing_from_training_graph_weights_is_refused():
    from normgrad.graphs import build_step_graph, build_training_graph
    from normgrad.graphs.builder import TrainingGraph

    training = build_training_graph(two_layer_model(), loss="mse")
    weights = dict(training.weights)
    del weights["w1"]
    with pytest.raises(ValueError, match="no value for the trainable weight 'w1'"):
        build_step_graph(TrainingGraph(training.model, weights), "sgd")
    weights = {**training.weights, "w1": np.ones((32, 31), np.float32)}
    with pytest.raises(ValueError, match=r"weights\['w1'\] has shape \[32, 31\]; the training graph's input 'w1' is \[32, 32\]"):
        build_step_graph(TrainingGraph(training.model, weights), "sgd")
    step, state = build_step_graph(training, "sgd")  # the intact pair builds, with both weights trained
    assert sorted(state) == ["w1", "w2"]


@pytest.mark.parametrize("names, kind", [(("W1", "W1.exp_avg"), "adam"), (("W1", "W1.next"), "sgd"),
                                         (("W1", "W1.momentum_buffer"), "sgd-momentum")])
def test_a_weight_named_like_an_optimizer_state_is_refused(names, kind):
    from normgrad.graphs import build_step_graph, build_training_graph

    options = {"momentum": 0.9} if kind == "sgd-momentum" else {}
    training = build_training_graph(two_layer_model_named(names), loss="mse")
    with pytest.raises(ValueError, match=f"value named '{names[1]}', the name the .* step gives a state tensor of "
                                         "weight 'W1'"):
        build_step_graph(training, kind.split("-")[0], **options)


@pytest.mark.parametrize("name", ["grad_scale", "normgrad.applied", "normgrad.loss", "dropout_micro_batch"])
def test_a_weight_named_like_a_trainer_value_is_one_trainer_error(tmp_path, name):
    onnx.save(two_layer_model_named(("w1", name)), tmp_path / "forward.onnx")
    assert export_sgd(tmp_path / "forward.onnx", tmp_path / "s.onnx") == 0
    with pytest.raises(TrainerError, match=f"value named '{name}', a name the trainer gives"):
        Trainer(tmp_path / "s.onnx", tmp_path / "s.ckpt", kernels=None, accumulation=2)
