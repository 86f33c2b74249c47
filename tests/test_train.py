"""normgrad.train.Trainer: 20 steps against torch.optim and torch's train mode, on the newest
onnxruntime and (NORMGRAD_OLD_ORT_PYTHON) on 1.19.2; resume, checkpoints, schedules,
gradient accumulation, the inference model."""

import copy
import json
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from normgrad import checkpoint
from normgrad.graphs import build_step_graph, build_training_graph, examples
from normgrad.train import Trainer, TrainerError, constant, cosine, linear_warmup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _train_runs import STEPS, _assert_close, _batches, _step_graph, _torch_steps, _train

RUNTIMES = ["current", "old"]


# -- against torch ---------------------------------------------------------------------------

def _torch_net(torch):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 6, 3, padding=1, bias=False)  # a bias before BatchNorm has gradient 0: Adam would amplify its rounding noise
            self.bn = torch.nn.BatchNorm2d(6)
            self.gn = torch.nn.GroupNorm(3, 6)
            self.fc = torch.nn.Linear(6 * 5 * 5, 4)

        def forward(self, x):
            return self.fc(torch.flatten(self.gn(torch.relu(self.bn(self.conv(x)))), 1))

    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():  # BatchNorm and GroupNorm affine parameters away from their 1/0 defaults
        for layer in (net.bn, net.gn):
            layer.weight.uniform_(0.5, 1.5)
            layer.bias.uniform_(-0.5, 0.5)
    return net


CASES = {
    "sgd": (["--optimizer", "sgd", "--momentum", "0.9", "--freeze", "fc.bias"],
            lambda torch, params: torch.optim.SGD(params, lr=0.05, momentum=0.9), None),
    "adamw": (["--optimizer", "adamw", "--weight-decay", "0.05", "--max-grad-norm", "1.0"],
              lambda torch, params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.05), 1.0),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch = pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("net")
    net = _torch_net(torch).train()
    path = folder / "net.onnx"
    torch.onnx.export(net, (torch.randn(4, 3, 5, 5),), str(path), dynamo=False,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                      input_names=["x"], output_names=["y"], opset_version=17)
    return net, path


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("kind", sorted(CASES))
def test_twenty_steps_match_torch(exported, tmp_path, kind, runtime):
    torch = pytest.importorskip("torch")
    source, forward_path = exported
    options, make_optimizer, clip = CASES[kind]
    step_path, start = _step_graph(tmp_path, forward_path, options)
    x, labels, lrs = _batches(tmp_path / "batches.npz", (4, 3, 5, 5), 4, lrs=cosine(0.05, STEPS, warmup_steps=3))
    state, losses, inference = _train(runtime, step_path, start, tmp_path / "batches.npz", tmp_path / "out")

    net = copy.deepcopy(source).train()
    frozen = {"fc.bias"} if "--freeze" in options else set()
    for name, p in net.named_parameters():
        p.requires_grad_(name not in frozen)
    optimizer, torch_losses = _torch_steps(torch, net, make_optimizer, clip, x, labels, lrs)
    np.testing.assert_allclose(losses, torch_losses, rtol=1e-4)
    tensors = state.tensors
    assert int(state.metadata["normgrad.step"]) == STEPS
    for name, p in net.named_parameters():
        if name in frozen:
            assert name not in tensors
            continue
        _assert_close(tensors[name], p.detach().numpy(), name)
        for key, value in optimizer.state[p].items():
            if key != "step":
                _assert_close(tensors[f"{name}.{key}"], value.numpy(), f"{name}.{key}")
    for name in ("bn.running_mean", "bn.running_var"):
        _assert_close(tensors[name], dict(net.named_buffers())[name].numpy(), name)
    initial = {t.name: t for t in onnx.load(str(forward_path)).graph.initializer}
    trained = {t.name: t for t in inference.graph.initializer}
    for name in frozen:  # frozen weights are bitwise what the forward model had
        assert trained[name].SerializeToString() == initial[name].SerializeToString()

    # the inference model (BatchNorm on running statistics) reproduces torch's eval mode
    net.eval()
    x_test = np.random.default_rng(9).standard_normal((4, 3, 5, 5)).astype(np.float32)
    expected = net(torch.tensor(x_test)).detach().numpy()
    session = ort.InferenceSession(inference.SerializeToString(), providers=["CPUExecutionProvider"])
    (actual,) = session.run(None, {"x": x_test})
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    # and differs from the batch-statistics output (so BatchNorm did switch to running statistics)
    assert np.abs(actual - net.train()(torch.tensor(x_test)).detach().numpy()).max() > 1e-3 * np.abs(expected).max()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_gradient_accumulation_matches_torch(exported, tmp_path, runtime):
    """AdamW with clipping, each step's batch of 8 as two micro-batches of 4 (the exported
    batch size): mean gradient, BatchNorm running statistics updated once per micro-batch."""
    torch = pytest.importorskip("torch")
    source, forward_path = exported
    options, make_optimizer, clip = CASES["adamw"]
    step_path, start = _step_graph(tmp_path, forward_path, options)
    steps = 8
    x, labels, lrs = _batches(tmp_path / "batches.npz", (8, 3, 5, 5), 4, steps=steps)
    state, losses, _ = _train(runtime, step_path, start, tmp_path / "batches.npz", tmp_path / "out", accumulation=2)
    net = copy.deepcopy(source).train()
    optimizer, torch_losses = _torch_steps(torch, net, make_optimizer, clip, x, labels, lrs, accumulation=2)
    np.testing.assert_allclose(losses, torch_losses, rtol=1e-4)
    for name, p in list(net.named_parameters()) + list(net.named_buffers()):
        if name.endswith("num_batches_tracked"):
            continue
        _assert_close(state.tensors[name], p.detach().numpy(), name)
    assert int(state.metadata["normgrad.step"]) == steps


# -- without torch: resume, checkpoints, schedules ------------------------------------------------

@pytest.fixture(scope="module")
def resnet_step(tmp_path_factory):
    """A ResNet block (Conv-BN-ReLU-Conv-BN + skip) with an MSE loss and AdamW with clipping."""
    folder = tmp_path_factory.mktemp("resnet")
    step, initial = build_step_graph(build_training_graph(examples.resnet_block(), loss="mse"), "adamw",
                                     weight_decay=0.1, max_grad_norm=1.0)
    onnx.save(step, str(folder / "step.onnx"))
    checkpoint.save(folder / "start.ckpt", initial)
    return folder / "step.onnx", folder / "start.ckpt", step, initial


def _resnet_batches(path, steps=STEPS):
    rng = np.random.default_rng(3)
    np.savez(path, x=rng.standard_normal((steps, 2, 4, 5, 5)).astype(np.float32),
             labels=rng.standard_normal((steps, 2, 4, 5, 5)).astype(np.float32),
             lr=np.array([linear_warmup(0.02, 5)(k) for k in range(1, steps + 1)], np.float32))


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_resume_after_step_10_is_bitwise_the_uninterrupted_run(resnet_step, tmp_path, runtime):
    step_path, start, _, _ = resnet_step
    _resnet_batches(tmp_path / "all.npz")
    batches = dict(np.load(tmp_path / "all.npz"))
    np.savez(tmp_path / "first10.npz", **{k: v[:10] for k, v in batches.items()})
    whole, whole_losses, whole_model = _train(runtime, step_path, start, tmp_path / "all.npz", tmp_path / "whole")
    _train(runtime, step_path, start, tmp_path / "first10.npz", tmp_path / "half")
    halfway = checkpoint.load(tmp_path / "half" / "final.ckpt")
    assert halfway.metadata["normgrad.step"] == "10"
    resumed, resumed_losses, resumed_model = _train(runtime, step_path, tmp_path / "half" / "final.ckpt",
                                                    tmp_path / "all.npz", tmp_path / "resumed")
    assert resumed_losses.tobytes() == whole_losses[10:].tobytes()
    assert set(resumed.tensors) == set(whole.tensors) and {"m1", "v2", "w1.exp_avg_sq"} <= set(whole.tensors)
    for name, value in whole.tensors.items():
        assert resumed.tensors[name].tobytes() == value.tobytes(), name
        assert not np.array_equal(value, halfway.tensors[name]), f"{name} did not change in steps 11-20"
    assert resumed_model.SerializeToString() == whole_model.SerializeToString()


def test_save_load_round_trip_is_bitwise(resnet_step, tmp_path):
    step_path, start, _, _ = resnet_step
    trainer = Trainer(step_path, start, lr=0.01)
    rng = np.random.default_rng(4)
    for _ in range(3):
        trainer.step(rng.standard_normal((2, 4, 5, 5)).astype(np.float32),
                     rng.standard_normal((2, 4, 5, 5)).astype(np.float32))
    trainer.save(tmp_path / "a.ckpt")
    other = Trainer(step_path, start)
    other.load(tmp_path / "a.ckpt")
    assert other.step_count == 3
    from_proto = Trainer(step_path, onnx.load(str(tmp_path / "a.ckpt")))  # the checkpoint as a ModelProto
    assert from_proto.step_count == 3
    before = trainer.state_dict()
    for loaded in (other.state_dict(), from_proto.state_dict()):
        assert all(before[n].tobytes() == loaded[n].tobytes() for n in before)


def test_split_graphs_are_bitwise_the_step_graph(resnet_step):
    """The path a data-parallel subclass takes (gradient graph, reduce_gradients, optimizer
    graph) gives bitwise the fused step graph's result when the reduction is the identity."""
    _, _, step, initial = resnet_step
    seen = []

    class Hooked(Trainer):
        def reduce_gradients(self, gradients):
            seen.append(sorted(gradients))
            return gradients

    fused, split = Trainer(step, initial, lr=0.01), Hooked(step, initial, lr=0.01)
    assert not fused.split and split.split
    rng = np.random.default_rng(5)
    for _ in range(4):
        x, t = rng.standard_normal((2, 2, 4, 5, 5)).astype(np.float32)
        assert fused.step(x, t) == split.step(x, labels=t)
    assert seen[0] == sorted(json.loads({p.key: p.value for p in step.metadata_props}["normgrad.parameters"]))
    a, b = fused.state_dict(), split.state_dict()
    assert all(a[n].tobytes() == b[n].tobytes() for n in a)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_in_place_state_is_bitwise_the_two_buffer_run(monkeypatch, clip):
    """Every state tensor shares one buffer for input and output: the trainer's finiteness
    gate makes every update wait for the loss and every gradient, so every backward read of a
    weight precedes its update, with or without clipping. Both ways give bitwise the same
    steps, fused and split (where the optimizer graph runs after the gradient graph)."""
    step, initial = build_step_graph(build_training_graph(examples.resnet_block(), loss="mse"), "adamw",
                                     weight_decay=0.1, max_grad_norm=clip)
    from normgrad.graphs import structure

    class Split(Trainer):
        def reduce_gradients(self, gradients):
            return gradients

    shared = [Trainer(step, initial, lr=0.01), Split(step, initial, lr=0.01)]
    assert shared[0]._in_place == set(initial)
    assert shared[1]._in_place == set(initial)
    monkeypatch.setattr(structure, "in_place_updates", lambda graph, state: set())
    separate = [Trainer(step, initial, lr=0.01), Split(step, initial, lr=0.01)]
    assert not separate[0]._in_place
    rng = np.random.default_rng(6)
    for _ in range(4):
        x, t = rng.standard_normal((2, 2, 4, 5, 5)).astype(np.float32)
        losses = [trainer.step(x, t) for trainer in shared + separate]
        assert len(set(losses)) == 1
    states = [trainer.state_dict() for trainer in shared + separate]
    assert all(state[n].tobytes() == states[0][n].tobytes() for state in states for n in states[0])


def test_in_place_updates_need_every_read_before_the_write():
    """A read after the write could run (a second reader that is no ancestor of the writer),
    a non-elementwise writer reading the value, or a broadcast read disqualify a buffer."""
    from onnx import helper

    from normgrad.graphs.structure import in_place_updates

    def updatable_in_place(graph, value, next_value):
        return in_place_updates(graph, {value: next_value}) == {value}

    def graph(nodes, shapes=None):
        shapes = shapes or {"s": [3], "s.next": [3]}
        return helper.make_graph(nodes, "g", [helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, shapes["s"]),
                                              helper.make_tensor_value_info("g", onnx.TensorProto.FLOAT, [3])],
                                 [helper.make_tensor_value_info("s.next", onnx.TensorProto.FLOAT, shapes["s.next"]),
                                  helper.make_tensor_value_info("other", onnx.TensorProto.FLOAT, None)])

    lerp = [helper.make_node("Sub", ["g", "s"], ["d"]), helper.make_node("Add", ["s", "d"], ["s.next"]),
            helper.make_node("Neg", ["g"], ["other"])]
    assert updatable_in_place(graph(lerp), "s", "s.next")
    late_reader = lerp[:2] + [helper.make_node("Neg", ["s"], ["other"])]
    assert not updatable_in_place(graph(late_reader), "s", "s.next")
    matmul_writer = [helper.make_node("MatMul", ["s", "g"], ["s.next"]), helper.make_node("Neg", ["g"], ["other"])]
    assert not updatable_in_place(graph(matmul_writer), "s", "s.next")
    broadcast = [helper.make_node("Add", ["s", "g"], ["s.next"]), helper.make_node("Neg", ["g"], ["other"])]
    assert not updatable_in_place(graph(broadcast, {"s": [1], "s.next": [3]}), "s", "s.next")
    type_only = lerp[:2] + [helper.make_node("CastLike", ["g", "s"], ["other"])]
    assert updatable_in_place(graph(type_only), "s", "s.next")


@pytest.mark.parametrize("change,message", [
    (lambda t: t.pop("w2.exp_avg"), "checkpoint has no tensor 'w2.exp_avg'"),
    (lambda t: t.__setitem__("bogus", np.zeros(3, np.float32)), "checkpoint has tensor 'bogus', which is not expected"),
    (lambda t: t.__setitem__("m1", np.zeros(5, np.float32)), r"checkpoint tensor 'm1' has shape \[5\], expected \[4\]"),
    (lambda t: t.__setitem__("w1", t["w1"].astype(np.float64)), "checkpoint tensor 'w1' has dtype float64"),
])
def test_mismatched_checkpoint_names_the_tensor(resnet_step, tmp_path, change, message):
    step_path, _, _, initial = resnet_step
    tensors = {k: v.copy() for k, v in initial.items()}
    change(tensors)
    checkpoint.save(tmp_path / "bad.ckpt", tensors)
    with pytest.raises(TrainerError, match=message):
        Trainer(step_path, tmp_path / "bad.ckpt")
    trainer = Trainer(step_path, initial)
    with pytest.raises(TrainerError, match=message):
        trainer.load(tmp_path / "bad.ckpt")


def test_crash_while_saving_keeps_the_previous_checkpoint(resnet_step, tmp_path, monkeypatch):
    step_path, start, _, _ = resnet_step
    trainer = Trainer(step_path, start, lr=0.01)
    target = tmp_path / "run.ckpt"
    trainer.save(target)
    good = target.read_bytes()
    rng = np.random.default_rng(6)
    trainer.step(rng.standard_normal((2, 4, 5, 5)).astype(np.float32), rng.standard_normal((2, 4, 5, 5)).astype(np.float32))
    real_fdopen = os.fdopen

    class HalfWritten:
        """A file that writes half of what it is given, then fails as a full disk would."""

        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            self.file.write(data[: len(data) // 2])
            self.file.flush()
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: HalfWritten(real_fdopen(fd, mode)))
    with pytest.raises(OSError, match="No space left"):
        trainer.save(target)
    monkeypatch.undo()
    assert target.read_bytes() == good
    assert sorted(os.listdir(tmp_path)) == ["run.ckpt"]  # no temporary file left behind
    assert checkpoint.load(target).metadata["normgrad.step"] == "0"


def test_bad_batches_and_options(resnet_step):
    step_path, start, step, initial = resnet_step
    trainer = Trainer(step, initial)
    x = np.zeros((2, 4, 5, 5), np.float32)
    with pytest.raises(TrainerError, match="takes 2 arrays"):
        trainer.step(x, x, x)
    with pytest.raises(TrainerError, match="missing 'labels'"):
        trainer.step(x)
    with pytest.raises(TrainerError, match="'x' given both"):
        trainer.step(x, x=x)
    with pytest.raises(TrainerError, match="batch input 'labels' must be float32"):
        trainer.step(x, np.zeros((2, 4, 5, 5), np.int64))
    with pytest.raises(TrainerError, match=r"'x' needs a first axis divisible by 3; got shape \[2, 4, 5, 5\]"):
        Trainer(step, initial, accumulation=3).step(x, x)
    with pytest.raises(TrainerError, match=r"'x' has shape \[3, 4, 5, 5\]; the step graph takes \[2, 4, 5, 5\]"):
        trainer.step(np.zeros((3, 4, 5, 5), np.float32), x)
    with pytest.raises(TrainerError, match=r"'x' \(each of the 2 micro-batches\) has shape \[1, 4, 5, 5\]"):
        Trainer(step, initial, accumulation=2).step(x, x)
    with pytest.raises(TrainerError, match="accumulation must be"):
        Trainer(step, initial, accumulation=0)
    with pytest.raises(TrainerError, match="not a step graph"):
        Trainer(examples.resnet_block(), initial)
    assert trainer.step_count == 0


def test_schedules():
    assert constant(0.1)(7) == 0.1
    warm = linear_warmup(0.1, 4)
    assert [warm(k) for k in (1, 2, 4, 9)] == pytest.approx([0.025, 0.05, 0.1, 0.1])
    decay = cosine(1.0, 12, warmup_steps=2, min_lr=0.1)
    assert decay(1) == pytest.approx(0.5) and decay(2) == pytest.approx(1.0)
    assert decay(7) == pytest.approx(0.55) and decay(12) == pytest.approx(0.1) and decay(20) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        cosine(1.0, 3, warmup_steps=3)


def test_loss_output_model_trains_and_serves_its_other_output(tmp_path):
    """A forward that computes its own loss: the step graph seeds it; the inference model serves y."""
    own = examples.mlp_with_loss()
    step, initial = build_step_graph(build_training_graph(own, loss_output="total"), "sgd")
    reference, reference_initial = build_step_graph(build_training_graph(examples.mlp(), loss="mse"), "sgd")
    a, b = Trainer(step, initial, lr=0.1), Trainer(reference, reference_initial, lr=0.1)
    assert a.data_inputs == ["x", "target"]
    rng = np.random.default_rng(7)
    for _ in range(3):
        x, t = rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
        assert a.step(x, t) == pytest.approx(b.step(x, t), rel=1e-6)
    inference = a.inference_model()
    assert [o.name for o in inference.graph.output] == ["y"] and [i.name for i in inference.graph.input] == ["x"]
    session = ort.InferenceSession(inference.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = ort.InferenceSession(b.inference_model().SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], expected.run(None, {"x": x})[0], rtol=0, atol=1e-5)


def test_digits_demo_reaches_95_percent(tmp_path, capsys):
    pytest.importorskip("sklearn")
    from normgrad.tools import train as train_tool

    assert train_tool.main(["--epochs", "4", "--out", str(tmp_path)]) == 0
    output = capsys.readouterr().out
    accuracy = float(output.rsplit("test accuracy ", 1)[1].split("%")[0])  # the summary line
    assert accuracy >= 95.0, output
    inference = onnx.load(str(tmp_path / "digits_inference.onnx"))
    assert not [n for n in inference.graph.node if n.domain not in ("", "ai.onnx")]
    images, labels, test_images, test_labels = train_tool.load_digits(0)
    assert abs(train_tool.accuracy(inference, test_images, test_labels) * 100 - accuracy) < 0.05


def test_function_bodies_and_kernels_train_alike():
    """kernels=None runs the function bodies the step graph carries instead of the C++ kernels.
    (SGD: Adam would amplify the rounding noise of b1's gradient, 0 up to rounding before BatchNorm.)"""
    step, initial = build_step_graph(build_training_graph(examples.resnet_block(), loss="mse"), "sgd", momentum=0.9)
    bodies, native = Trainer(step, initial, lr=0.01, kernels=None), Trainer(step, initial, lr=0.01)
    rng = np.random.default_rng(8)
    for _ in range(3):
        x, t = rng.standard_normal((2, 2, 4, 5, 5)).astype(np.float32)
        assert bodies.step(x, t) == pytest.approx(native.step(x, t), rel=1e-5)
    a, b = bodies.state_dict(), native.state_dict()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-5 * max(1.0, np.abs(b[name]).max()))


def test_inference_model_drops_dropout():
    """Training-mode Dropout in the forward: the inference model is deterministic and equals
    the network without it, with the trained weights."""
    params = {t.name: onnx.numpy_helper.to_array(t) for t in examples.mlp().graph.initializer}
    oh = onnx.helper
    nodes = [
        oh.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
        oh.make_node("Tanh", ["h"], ["a"]),
        oh.make_node("Constant", [], ["ratio"], value=onnx.numpy_helper.from_array(np.array(0.3, np.float32))),
        oh.make_node("Constant", [], ["training"], value=onnx.numpy_helper.from_array(np.array(True))),
        oh.make_node("Dropout", ["a", "ratio", "training"], ["dropped"]),
        oh.make_node("MatMul", ["dropped", "w2"], ["z"]),
        oh.make_node("Add", ["z", "b2"], ["y"]),
    ]
    forward = examples.model(nodes, {"x": ("N", 5)}, ["y"], params)
    step, initial = build_step_graph(build_training_graph(forward, loss="cross_entropy"), "sgd", momentum=0.9)
    trainer = Trainer(step, initial, lr=0.1)
    rng = np.random.default_rng(9)
    for _ in range(3):
        trainer.step(rng.standard_normal((6, 5)).astype(np.float32), rng.integers(0, 3, 6))
    inference = trainer.inference_model()
    assert "Dropout" not in {n.op_type for n in inference.graph.node}
    w = trainer.state_dict()
    x = rng.standard_normal((4, 5)).astype(np.float32)
    expected = np.tanh(x @ w["w1"] + w["b1"]) @ w["w2"] + w["b2"]
    session = ort.InferenceSession(inference.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], expected, rtol=0, atol=1e-5)
