"""Trainer features against torch, on the newest onnxruntime and (NORMGRAD_OLD_ORT_PYTHON) on
1.19.2: weight-decay parameter groups (``--no-weight-decay``) against torch.optim with
param_groups over 20 steps, the forward outputs of each step against torch's train-mode
forward, ``Trainer.evaluate`` against ``model.eval()``, dict batches and the ``steps``
iterator, ``normgrad train --help`` defaults."""

import copy
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from _helpers import old_runtime_python

from normgrad.graphs import build_step_graph, build_training_graph, examples, optimizers, step_graph
from normgrad.train import EvalResult, StepResult, Trainer, TrainerError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _features_runner  # noqa: E402

STEPS = 20
RUNTIMES = ["current", "old"]


def _run(runtime, step_path, start, batches, out, accumulation=1):
    """_features_runner in this process or in the old-onnxruntime Python -> its results."""
    args = [str(step_path), str(start), str(batches), str(out), str(accumulation)]
    if runtime == "current":
        _features_runner.run(*args)
    else:
        python = old_runtime_python()
        process = subprocess.run([python, _features_runner.__file__] + args, capture_output=True, text=True, timeout=3600)
        assert process.returncode == 0, process.stderr[-3000:]
        assert process.stdout.split()[-1] == "1.19.2", process.stdout
    return dict(np.load(out))


# -- torch models ------------------------------------------------------------------------------

def _transformer_like(torch):
    """Token embedding, two LayerNorms, a residual MLP and a head over the mean token."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(6, 8)
            self.norm1 = torch.nn.LayerNorm(8)
            self.mlp = torch.nn.Linear(8, 8)
            self.norm2 = torch.nn.LayerNorm(8)
            self.head = torch.nn.Linear(8, 3)

        def forward(self, x):
            h = self.norm1(self.embed(x))
            h = h + torch.relu(self.mlp(h))
            return self.head(self.norm2(h).mean(1))

    torch.manual_seed(1)
    net = Net()
    with torch.no_grad():  # norm scales and biases away from 1 and 0, so that their decay shows
        for layer in (net.norm1, net.norm2):
            layer.weight.uniform_(0.5, 1.5)
            layer.bias.uniform_(-0.5, 0.5)
    return net, (4, 5, 6)


def _cnn(torch):
    """Conv (no bias: before BatchNorm it has gradient 0), BatchNorm, ReLU, Linear."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False)
            self.bn = torch.nn.BatchNorm2d(4)
            self.fc = torch.nn.Linear(4 * 5 * 5, 3)

        def forward(self, x):
            return self.fc(torch.flatten(torch.relu(self.bn(self.conv(x))), 1))

    torch.manual_seed(2)
    net = Net()
    with torch.no_grad():
        net.bn.weight.uniform_(0.5, 1.5)
        net.bn.bias.uniform_(-0.5, 0.5)
    return net, (4, 3, 5, 5)


MODELS = {"transformer": (_transformer_like, ["*.bias", "*norm*"]), "cnn": (_cnn, ["*.bias", "bn.*"])}
OPTIMIZERS = {  # CLI options, torch.optim class and keyword arguments
    "sgd": (["--optimizer", "sgd", "--momentum", "0.9", "--weight-decay", "0.1"], "SGD", dict(momentum=0.9)),
    "adam": (["--optimizer", "adam", "--weight-decay", "0.1"], "Adam", {}),
    "adamw": (["--optimizer", "adamw", "--weight-decay", "0.1"], "AdamW", {}),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch = pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("features")
    nets = {}
    for name, (build, _) in MODELS.items():
        net, shape = build(torch)
        path = folder / f"{name}.onnx"
        torch.onnx.export(net.train(), (torch.randn(*shape),), str(path), dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=["x"], output_names=["logits"], opset_version=17)
        nets[name] = (net, shape, path)
    return nets


def _export(folder, forward_path, options):
    from normgrad.tools import export as export_tool

    step_path = folder / "step.onnx"
    assert export_tool.main([str(forward_path), "-o", str(step_path), "--loss", "cross_entropy"] + options) == 0
    return step_path, folder / "step.ckpt"


def _batches(path, shape, steps=STEPS, seed=0, accumulation=1):
    rng = np.random.default_rng(seed)
    batch = (shape[0] * accumulation,) + shape[1:]
    data = dict(x=rng.standard_normal((steps,) + batch).astype(np.float32) * 2 + 0.5,
                labels=rng.integers(0, 3, (steps, batch[0])),
                lr=np.array([0.01 * (1 + k % 3) for k in range(steps)], np.float32),
                eval_x=rng.standard_normal(shape).astype(np.float32) * 2 + 0.5, eval_labels=rng.integers(0, 3, shape[0]))
    np.savez(path, **data)
    return data


def _torch_run(torch, net, optimizer_name, optimizer_options, patterns, data, weight_decay=0.1, accumulation=1):
    """20 torch.optim steps with param_groups (no weight decay on ``patterns``); returns the
    optimizer, the losses, each step's train-mode logits and the eval-mode loss and logits."""
    import fnmatch

    named = list(net.named_parameters())
    excluded = {n for n, _ in named if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    groups = [{"params": [p for n, p in named if n not in excluded], "weight_decay": weight_decay},
              {"params": [p for n, p in named if n in excluded], "weight_decay": 0.0}]
    optimizer = getattr(torch.optim, optimizer_name)(groups, lr=0.01, **optimizer_options)
    losses, logits = [], []
    net.train()
    for x, labels, lr in zip(data["x"], data["labels"], data["lr"]):
        for group in optimizer.param_groups:
            group["lr"] = float(lr)
        optimizer.zero_grad()
        total, outputs = 0.0, []
        for xm, lm in zip(np.split(x, accumulation), np.split(labels, accumulation)):
            out = net(torch.tensor(xm))
            loss = torch.nn.functional.cross_entropy(out, torch.tensor(lm)) / accumulation
            loss.backward()
            total += loss.item()
            outputs.append(out.detach().numpy())
        optimizer.step()
        losses.append(total)
        logits.append(np.concatenate(outputs))
    net.eval()
    with torch.no_grad():
        eval_logits = net(torch.tensor(data["eval_x"]))
        eval_loss = torch.nn.functional.cross_entropy(eval_logits, torch.tensor(data["eval_labels"])).item()
    return optimizer, np.array(losses), np.stack(logits), eval_loss, eval_logits.numpy()


def _assert_close(actual, expected, what, tolerance=1e-6):
    scale = max(np.abs(expected).max(), 1e-30)
    error = np.abs(actual - expected).max()
    assert error <= tolerance * scale, f"{what}: max |difference| {error:.3g} vs {tolerance:g} of its scale {scale:.3g}"


# -- parameter groups, step outputs, evaluate: against torch ---------------------------------------

@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_parameter_groups_outputs_and_evaluate_match_torch(exported, tmp_path, model, optimizer, runtime):
    """``--no-weight-decay`` globs as torch param_groups (weight_decay 0 for biases and norm
    parameters): every parameter within 1e-6 of its scale after 20 steps, every optimizer tensor
    within 2e-6 (float32 gradients summed in another order than torch's);
    the logits each step returns are torch's train-mode forward; ``evaluate`` is torch's
    ``model.eval()`` forward and loss, and changes no state."""
    torch = pytest.importorskip("torch")
    source, shape, forward_path = exported[model]
    patterns = MODELS[model][1]
    cli, torch_name, torch_options = OPTIMIZERS[optimizer]
    step_path, start = _export(tmp_path, forward_path, cli + ["--no-weight-decay"] + patterns)
    data = _batches(tmp_path / "batches.npz", shape)
    result = _run(runtime, step_path, start, tmp_path / "batches.npz", tmp_path / "out.npz")

    net = copy.deepcopy(source)
    torch_optimizer, losses, logits, eval_loss, eval_logits = _torch_run(torch, net, torch_name, torch_options,
                                                                         patterns, data)
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
    _assert_close(result["logits"], logits, "step logits", 1e-5)
    for name, p in net.named_parameters():
        _assert_close(result[f"state/{name}"], p.detach().numpy(), name)
        for key, value in torch_optimizer.state[p].items():
            if key != "step":  # a moment is the gradient's rounding averaged, not damped by the lr: 2e-6
                _assert_close(result[f"state/{name}.{key}"], value.numpy(), f"{name}.{key}", 2e-6)
    for name, buffer in net.named_buffers():
        if not name.endswith("num_batches_tracked"):
            _assert_close(result[f"state/{name}"], buffer.numpy(), name)
    np.testing.assert_allclose(result["eval_loss"], eval_loss, rtol=1e-5)
    _assert_close(result["eval_logits"], eval_logits, "eval logits", 1e-5)

    # the groups matter: torch decaying every parameter ends far outside the tolerance
    everything = copy.deepcopy(source)
    _torch_run(torch, everything, torch_name, torch_options, [], data)
    spread = max(np.abs(result[f"state/{name}"] - p.detach().numpy()).max() / np.abs(p.detach().numpy()).max()
                 for name, p in everything.named_parameters())
    assert spread > 1e-4


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_accumulation_rebuilds_the_parameter_groups(exported, tmp_path, runtime):
    """With accumulation the trainer runs the split graphs and rebuilds the optimizer from the
    step graph's metadata: AdamW with param_groups over 2 micro-batches per step is torch's
    ``(loss / 2).backward()`` twice; the step outputs are the micro-batches' logits concatenated."""
    torch = pytest.importorskip("torch")
    source, shape, forward_path = exported["transformer"]
    patterns = MODELS["transformer"][1]
    cli, torch_name, torch_options = OPTIMIZERS["adamw"]
    step_path, start = _export(tmp_path, forward_path, cli + ["--no-weight-decay"] + patterns)
    data = _batches(tmp_path / "batches.npz", shape, steps=8, accumulation=2)
    result = _run(runtime, step_path, start, tmp_path / "batches.npz", tmp_path / "out.npz", accumulation=2)
    net = copy.deepcopy(source)
    torch_optimizer, losses, logits, eval_loss, eval_logits = _torch_run(torch, net, torch_name, torch_options,
                                                                         patterns, data, accumulation=2)
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
    assert result["logits"].shape == logits.shape
    _assert_close(result["logits"], logits, "step logits", 1e-5)
    for name, p in net.named_parameters():
        _assert_close(result[f"state/{name}"], p.detach().numpy(), name)
    np.testing.assert_allclose(result["eval_loss"], eval_loss, rtol=1e-5)
    _assert_close(result["eval_logits"], eval_logits, "eval logits", 1e-5)


def test_evaluate_runs_dropout_off_and_batch_norm_on_running_statistics(tmp_path):
    """A CNN with BatchNorm and Dropout trained 5 steps: evaluate is torch's eval() forward and
    loss with the trainer's weights, deterministic, and differs from the train-mode output;
    the NAME.eval.onnx that export writes gives bitwise the same."""
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False)
            self.bn = torch.nn.BatchNorm2d(4)
            self.drop = torch.nn.Dropout(0.5)
            self.fc = torch.nn.Linear(4 * 5 * 5, 3)

        def forward(self, x):
            return self.fc(self.drop(torch.flatten(torch.relu(self.bn(self.conv(x))), 1)))

    torch.manual_seed(3)
    net = Net()
    torch.onnx.export(net.train(), (torch.randn(4, 3, 5, 5),), str(tmp_path / "net.onnx"), dynamo=False,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                      input_names=["x"], output_names=["logits"], opset_version=17)
    step_path, start = _export(tmp_path, tmp_path / "net.onnx", ["--optimizer", "sgd", "--momentum", "0.9"])
    assert (tmp_path / "step.eval.onnx").exists()
    trainer = Trainer(step_path, start, lr=0.05)
    rng = np.random.default_rng(4)
    for _ in range(5):
        trainer.step(rng.standard_normal((4, 3, 5, 5)).astype(np.float32), rng.integers(0, 3, 4))
    x, labels = rng.standard_normal((4, 3, 5, 5)).astype(np.float32), rng.integers(0, 3, 4)
    result = trainer.evaluate(x, labels)
    assert isinstance(result, EvalResult) and list(result.outputs) == ["logits"]
    state = trainer.state_dict()
    net.load_state_dict({name: torch.tensor(state[name]) for name, _ in net.state_dict().items()
                         if name in state}, strict=False)
    net.eval()
    with torch.no_grad():
        expected = net(torch.tensor(x))
        expected_loss = torch.nn.functional.cross_entropy(expected, torch.tensor(labels)).item()
    _assert_close(result.outputs["logits"], expected.numpy(), "eval logits", 1e-5)
    assert result.loss == pytest.approx(expected_loss, rel=1e-5)
    again = trainer.evaluate(x, labels)
    assert again.outputs["logits"].tobytes() == result.outputs["logits"].tobytes()  # no Dropout mask
    net.train()
    with torch.no_grad():
        train_mode = net.bn(net.conv(torch.tensor(x))).numpy()
        net.eval()
        eval_mode = net.bn(net.conv(torch.tensor(x))).numpy()
    assert np.abs(train_mode - eval_mode).max() > 1e-2  # running statistics are not the batch's
    written = Trainer(step_path, start, lr=0.05, eval_model=tmp_path / "step.eval.onnx")
    written.load(start)
    trainer.load(start)
    assert written.evaluate(x, labels).outputs["logits"].tobytes() == trainer.evaluate(x, labels).outputs["logits"].tobytes()


# -- without torch ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlp_step():
    training = build_training_graph(examples.mlp(), loss="cross_entropy")
    return build_step_graph(training, "adamw", weight_decay=0.1, no_weight_decay=["b*"])


def _xy(rng, n=4):
    return rng.standard_normal((n, 5)).astype(np.float32), rng.integers(0, 3, n)


def test_weight_decay_metadata_and_split_optimizer(mlp_step):
    """The step graph says which parameters decay; optimizer_options gives build_optimizer_graph
    the same groups (its metadata equal); a pattern matching nothing is an error."""
    step, _ = mlp_step
    metadata = {p.key: p.value for p in step.metadata_props}
    assert json.loads(metadata[optimizers.WEIGHT_DECAY_METADATA]) == {"w1": 0.1, "b1": 0.0, "w2": 0.1, "b2": 0.0}
    kind, options = optimizers.optimizer_options(step)
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in step.graph.input
              if i.name in ("w1", "b1", "w2", "b2")}
    rebuilt = {p.key: p.value for p in optimizers.build_optimizer_graph(shapes, kind, **options).metadata_props}
    assert rebuilt[optimizers.WEIGHT_DECAY_METADATA] == metadata[optimizers.WEIGHT_DECAY_METADATA]
    assert rebuilt["normgrad.optimizer"] == metadata["normgrad.optimizer"]
    with pytest.raises(ValueError, match="'\\*norm\\*' matches no trainable parameter"):
        optimizers.build_optimizer_graph(shapes, "sgd", weight_decay=0.1, no_weight_decay=["*norm*"])


def test_cli_no_weight_decay(tmp_path, capsys):
    from normgrad.tools import export as export_tool

    forward = tmp_path / "mlp.onnx"
    onnx.save(examples.mlp(), str(forward))
    out = tmp_path / "step.onnx"
    assert export_tool.main([str(forward), "-o", str(out), "--loss", "mse", "--optimizer", "adamw",
                             "--no-weight-decay", "b1", "b2"]) == 0
    assert "evaluation graph in" in capsys.readouterr().out
    metadata = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert json.loads(metadata[optimizers.WEIGHT_DECAY_METADATA]) == {"w1": 0.01, "b1": 0.0, "w2": 0.01, "b2": 0.0}
    evaluation = onnx.load(str(tmp_path / "step.eval.onnx"))
    assert [o.name for o in evaluation.graph.output] == ["loss", "y"]
    assert {i.name for i in evaluation.graph.input} == {"x", "labels", "w1", "b1", "w2", "b2"}
    assert export_tool.main([str(forward), "-o", str(tmp_path / "s2.onnx"), "--loss", "mse", "--optimizer", "sgd",
                             "--no-weight-decay", "*norm*"]) == 1
    assert "matches no trainable parameter" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        export_tool.main([str(forward), "-o", str(tmp_path / "s3.onnx"), "--loss", "mse", "--no-weight-decay", "b1"])
    assert exit.value.code == 2
    assert not (tmp_path / "s2.onnx").exists() and not (tmp_path / "s3.onnx").exists()


def test_cli_refuses_to_write_the_evaluation_graph_over_its_input(tmp_path, capsys):
    from normgrad.tools import export as export_tool

    forward = tmp_path / "net.eval.onnx"
    onnx.save(examples.mlp(), str(forward))
    before = forward.read_bytes()
    assert export_tool.main([str(forward), "-o", str(tmp_path / "net.onnx"), "--loss", "mse", "--optimizer", "sgd"]) == 2
    assert "the evaluation graph" in capsys.readouterr().err and forward.read_bytes() == before
    assert not (tmp_path / "net.onnx").exists()


@pytest.mark.parametrize("accumulation", [1, 2])
def test_batch_forms_and_steps_iterator_are_bitwise_step(mlp_step, accumulation):
    """Positional, keyword and dict batches, and steps() over a list for two epochs, take
    bitwise the same steps; step() still returns the float loss; outputs= returns a StepResult."""
    step, initial = mlp_step
    rng = np.random.default_rng(5)
    batches = [_xy(rng) for _ in range(3)]
    forms = [lambda t, x, y: t.step(x, y), lambda t, x, y: t.step(x=x, labels=y),
             lambda t, x, y: t.step({"x": x, "labels": y}), lambda t, x, y: t.step({"x": x}, labels=y)]
    trainers = [Trainer(step, initial, lr=0.01, accumulation=accumulation) for _ in range(len(forms) + 1)]
    losses = [[form(t, x, y) for _ in range(2) for x, y in batches] for form, t in zip(forms, trainers)]
    assert all(isinstance(loss, float) for loss in losses[0])
    results = list(trainers[-1].steps(batches, epochs=2))
    assert [r.epoch for r in results] == [1, 1, 1, 2, 2, 2] and [r.step for r in results] == list(range(1, 7))
    assert all(isinstance(r, StepResult) and r.outputs == {} for r in results)
    losses.append([r.loss for r in results])
    assert all(l == losses[0] for l in losses)
    states = [t.state_dict() for t in trainers]
    for state in states[1:]:
        assert all(state[name].tobytes() == states[0][name].tobytes() for name in state)


@pytest.mark.parametrize("level", ["ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL"])
def test_step_outputs_are_the_forward_before_the_update(mlp_step, level):
    """step(outputs=["y"]) returns the forward output of the weights before the update, and
    evaluate the forward and loss of the weights after it, at every graph optimization level
    (float64 NumPy reference)."""
    import onnxruntime as ort

    step, initial = mlp_step
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    trainer = Trainer(step, initial, lr=0.01, session_options=options)
    x, y = _xy(np.random.default_rng(6))
    forward = lambda w: np.tanh(x.astype(np.float64) @ w["w1"] + w["b1"]) @ w["w2"] + w["b2"]
    expected = forward(trainer.state_dict())
    result = trainer.step(x, y, outputs=["y"])
    np.testing.assert_allclose(result.outputs["y"], expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    logits = forward(trainer.state_dict())
    assert np.abs(logits - expected).max() > 1e-4  # the update changed the weights
    shifted = logits - logits.max(axis=1, keepdims=True)
    loss = np.mean(np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(y)), y])
    evaluation = trainer.evaluate(x, y)
    np.testing.assert_allclose(evaluation.outputs["y"], logits, rtol=0, atol=1e-5 * np.abs(logits).max())
    assert evaluation.loss == pytest.approx(loss, rel=1e-5)
    assert result.step == 1 and result.lr == pytest.approx(0.01) and trainer.step_count == 1
    assert trainer.step(x, y, outputs="y").outputs["y"].shape == (4, 3)
    assert trainer.step(x, y, outputs=[]).outputs == {}


def _forward_session(trainer):
    """The session a trainer's step runs its forward and backward in."""
    return trainer._gradient if trainer.split else trainer._step_part


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("case", ["mlp_mse", "mlp_cross_entropy", "cnn_batch_norm"])
def test_asking_for_forward_outputs_changes_no_step(case, accumulation):
    """The session a step runs in exposes no forward output (onnxruntime would keep each alive
    to the end of the run) until a step asks for one; a session exposing them then replaces it
    (the lean one is freed) and serves every later step. The output is the step graph's own
    (mse; the CNN's, with BatchNorm running statistics) or its forward tail's (cross_entropy: a
    bias Add the loss absorbed). Trainers asking at every step, from the third step on, and
    never take bitwise the same losses and states at every step; the outputs are bitwise those
    of the trainer asking from the first step and, for the MLP, the forward of the weights
    before each step (float64 NumPy). The in-place set, fixed at construction, holds for the
    session that replaced the lean one (the tail's Add reads b2: not in place)."""
    import gc
    import weakref

    rng = np.random.default_rng(9)
    if case == "cnn_batch_norm":
        forward, loss, name = examples.digits_cnn(classes=3, width=4), "cross_entropy", "logits"
        batches = [(rng.standard_normal((4, 1, 8, 8)).astype(np.float32), rng.integers(0, 3, 4)) for _ in range(5)]
    else:
        forward, loss, name = examples.mlp(), case[len("mlp_"):], "y"
        batches = [(x, y if loss == "cross_entropy" else rng.standard_normal((4, 3)).astype(np.float32))
                   for x, y in (_xy(rng) for _ in range(5))]
    step, initial = build_step_graph(build_training_graph(forward, loss=loss), "adamw")
    asking_from = [1, 3, None]
    trainers = [Trainer(step, initial, lr=0.05, accumulation=accumulation) for _ in asking_from]
    lean = [weakref.ref(_forward_session(t)) for t in trainers]
    assert all(name not in ref().outputs for ref in lean)
    tail_read = {"b2"} if loss == "cross_entropy" and case != "cnn_batch_norm" and accumulation == 1 else set()
    assert all(t._in_place == set(initial) - tail_read for t in trainers)
    outputs = [[], [], []]
    for number, batch in enumerate(batches, 1):
        losses = []
        for trainer, first, fetched in zip(trainers, asking_from, outputs):
            if first is None or number < first:
                losses.append(trainer.step(*batch))
                continue
            weights = trainer.state_dict()
            result = trainer.step(*batch, outputs=[name])
            losses.append(result.loss)
            fetched.append(result.outputs[name])
            if case != "cnn_batch_norm":
                x = batch[0].astype(np.float64)
                expected = np.tanh(x @ weights["w1"] + weights["b1"]) @ weights["w2"] + weights["b2"]
                np.testing.assert_allclose(result.outputs[name], expected, rtol=0, atol=1e-5 * np.abs(expected).max())
        assert losses[1] == losses[0] and losses[2] == losses[0], number
        states = [t.state_dict() for t in trainers]
        assert all(state[k].tobytes() == states[0][k].tobytes() for state in states[1:] for k in states[0]), number
        gc.collect()
        for trainer, first, ref in zip(trainers, asking_from, lean):
            asked = first is not None and number >= first
            assert (_forward_session(trainer) is ref()) != asked and (ref() is None) == asked, number
            assert (name in _forward_session(trainer).outputs) == asked
    assert [a.tobytes() for a in outputs[1]] == [a.tobytes() for a in outputs[0][2:]]
    for trainer in trainers:
        part = _forward_session(trainer)
        assert trainer._in_place == set(initial) - tail_read
        assert trainer._in_place & set(part.state) <= part.in_place


def test_a_failed_exposing_session_leaves_the_lean_one(mlp_step, monkeypatch):
    """When onnxruntime cannot make the session exposing the forward outputs, the step raises
    its error with the state and step count unchanged, and the trainer steps on as before
    (the lean session made again) and exposes them at the next step that asks."""
    step, initial = mlp_step
    trainer, reference = Trainer(step, initial, lr=0.01), Trainer(step, initial, lr=0.01)
    x, y = _xy(np.random.default_rng(10))
    assert trainer.step(x, y) == reference.step(x, y)
    before = trainer.state_dict()
    made = trainer._session.new_session

    def refusing(model, state):
        if "y" in {o.name for o in model.graph.output}:
            raise RuntimeError("no memory for it")
        return made(model, state)

    monkeypatch.setattr(trainer._session, "new_session", refusing)
    with pytest.raises(RuntimeError, match="no memory for it"):
        trainer.step(x, y, outputs=["y"])
    assert trainer.step_count == 1 and not trainer._session.exposed
    assert all(trainer.state_dict()[k].tobytes() == before[k].tobytes() for k in before)
    assert trainer.step(x, y) == reference.step(x, y) and "y" not in trainer._step_part.outputs
    monkeypatch.undo()
    result, expected = trainer.step(x, y, outputs=["y"]), reference.step(x, y, outputs=["y"])
    assert result.loss == expected.loss and result.outputs["y"].tobytes() == expected.outputs["y"].tobytes()
    assert all(trainer.state_dict()[k].tobytes() == reference.state_dict()[k].tobytes() for k in before)


def test_bad_outputs_batches_and_epochs(mlp_step):
    step, initial = mlp_step
    trainer = Trainer(step, initial, lr=0.01)
    x, y = _xy(np.random.default_rng(7))
    with pytest.raises(TrainerError, match="'logits' is not a forward output the step graph computes; it computes 'y'"):
        trainer.step(x, y, outputs=["logits"])
    with pytest.raises(TrainerError, match="'logits' is not computed by the evaluation graph"):
        trainer.evaluate(x, y, outputs=["logits"])
    with pytest.raises(TrainerError, match="'labels' given both in the dict and by keyword"):
        trainer.step({"x": x, "labels": y}, labels=y)
    with pytest.raises(TrainerError, match="unknown 'label'"):
        trainer.step({"x": x, "labels": y, "label": y})
    with pytest.raises(TrainerError, match="missing 'labels'"):
        trainer.evaluate({"x": x})
    with pytest.raises(TrainerError, match="epochs must be an integer >= 1"):
        next(trainer.steps([(x, y)], epochs=0))
    with pytest.raises(TrainerError, match="no batch in epoch 2 .*generator"):
        list(trainer.steps(((x, y) for _ in range(2)), epochs=2))
    assert trainer.step_count == 2  # the generator's two batches ran
    wrong = build_step_graph(build_training_graph(examples.mlp(), loss="mse"), "sgd")[0]
    trainer = Trainer(step, initial, lr=0.01, eval_model=step_graph.build_eval_graph(wrong))
    with pytest.raises(TrainerError, match="evaluation graph input 'labels' is float32; the step graph's is int64"):
        trainer.evaluate(x, y)
    other = build_step_graph(build_training_graph(examples.mlp_with_loss(), loss_output="total"), "sgd")[0]
    trainer = Trainer(step, initial, lr=0.01, eval_model=step_graph.build_eval_graph(other))
    with pytest.raises(TrainerError, match="evaluation graph input 'target' is neither a data input"):
        trainer.evaluate(x, y)


def test_evaluate_with_accumulation_takes_the_whole_batch(mlp_step):
    """evaluate does not split the batch into micro-batches; it equals an accumulation-1 trainer's."""
    step, initial = mlp_step
    rng = np.random.default_rng(8)
    x, y = _xy(rng, 6)
    one, three = Trainer(step, initial, accumulation=1), Trainer(step, initial, accumulation=3)
    a, b = one.evaluate(x, y), three.evaluate(x, y)
    assert a.loss == b.loss and a.outputs["y"].tobytes() == b.outputs["y"].tobytes()
    assert a.outputs["y"].shape == (6, 3)


@pytest.mark.parametrize("parallel", [dict(data_parallel=True), dict(data_parallel=True, sync_batch_norm=True)])
def test_evaluation_graph_of_a_data_parallel_step_graph_has_no_collective(parallel):
    """The loss of a --data-parallel step graph is averaged over the ranks in the gradient
    all-reduce: its evaluation graph takes this rank's loss instead, so a rank can evaluate
    alone (no AllReduce to wait in), bitwise as the evaluation graph of the plain step graph."""
    plain, initial = build_step_graph(build_training_graph(examples.resnet_block(), loss="mse"), "sgd")
    parallel_step, _ = build_step_graph(build_training_graph(examples.resnet_block(), loss="mse", **parallel), "sgd")
    assert "AllReduce" in {n.op_type for n in parallel_step.graph.node}
    evaluation = step_graph.build_eval_graph(parallel_step)
    assert "AllReduce" not in {n.op_type for n in evaluation.graph.node}
    x, y = np.random.default_rng(9).standard_normal((2, 2, 4, 5, 5)).astype(np.float32)
    a = Trainer(plain, initial).evaluate(x, y)
    b = Trainer(plain, initial, eval_model=evaluation).evaluate(x, y)
    assert a.loss == b.loss and a.outputs["y"].tobytes() == b.outputs["y"].tobytes()


def test_train_help_shows_defaults(capsys):
    from normgrad.tools import train as train_tool

    with pytest.raises(SystemExit) as exit:
        train_tool.main(["--help"])
    assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--epochs", "--batch-size", "--lr", "--seed", "--out"):
        described = text.split(option, 2)[2].split(" --")[0]  # the option's own help line (after the usage)
        assert "(default: " in described, (option, described)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
