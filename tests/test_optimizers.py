"""Optimizer graphs against torch.optim and clip_grad_norm_, 20 steps on fixed gradients; the options
torch.optim refuses refused alike by the Python API and `normgrad export` (one line, exit 2)."""

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from normgrad.graphs import examples
from normgrad.graphs.optimizers import build_optimizer_graph, hyperparameter_feeds, next_name, optimizer_state_names
from normgrad.tools import cli

torch = pytest.importorskip("torch")

SHAPES = {"conv.weight": (4, 3, 3, 3), "fc.bias": (5,)}

CASES = [
    ("sgd", dict(momentum=0.9)),
    ("sgd", dict(momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("sgd", dict(momentum=0.8, dampening=0.3, weight_decay=0.05, max_grad_norm=0.5)),
    ("sgd", dict()),
    ("sgd", dict(weight_decay=0.01)),
    ("adamw", dict(weight_decay=0.1, max_grad_norm=1.0)),
    ("adam", dict(weight_decay=0.01, amsgrad=True, betas=(0.8, 0.99), eps=1e-6)),
    ("adamw", dict(weight_decay=0.1, amsgrad=True, max_grad_norm=1.0)),
    ("adamw", dict()),  # torch's default weight decay (0.01) on both sides
    ("adam", dict()),
]


@pytest.mark.parametrize("kind,options", CASES)
def test_matches_torch_optim(kind, options):
    rng = np.random.default_rng(0)
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    model = build_optimizer_graph(SHAPES, kind, **options)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    state = dict(params)
    for n, s in SHAPES.items():
        for name in optimizer_state_names(n, kind, options.get("momentum", 0.0), options.get("amsgrad", False)):
            state[name] = np.zeros(s, np.float32)

    tensors = {n: torch.tensor(v, requires_grad=True) for n, v in params.items()}
    torch_options = {k: v for k, v in options.items() if k != "max_grad_norm"}
    optimizer = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind](
        list(tensors.values()), lr=0.05, **torch_options)
    outputs = [o.name for o in session.get_outputs()]
    for step in range(1, 21):
        lr = 0.05 * (1 - step / 40)
        for group in optimizer.param_groups:
            group["lr"] = lr
        grads = {n: (rng.standard_normal(s) * 3).astype(np.float32) for n, s in SHAPES.items()}
        for n, t in tensors.items():
            t.grad = torch.tensor(grads[n])
        if "max_grad_norm" in options:
            torch.nn.utils.clip_grad_norm_(list(tensors.values()), options["max_grad_norm"])
        optimizer.step()
        feeds = {**hyperparameter_feeds(model), **state, **{f"{n}_grad": g for n, g in grads.items()},
                 "lr": np.array(lr, np.float32), "step": np.array(step, np.float32)}
        result = dict(zip(outputs, session.run(None, feeds)))
        state = {name: result[next_name(name)] for name in state}
    for n, t in tensors.items():
        expected = t.detach().numpy()
        np.testing.assert_allclose(state[n], expected, rtol=0, atol=1e-5 * np.abs(expected).max())
        for key, value in optimizer.state[t].items():
            if key == "step":
                continue
            expected = value.numpy()
            np.testing.assert_allclose(state[f"{n}.{key}"], expected, rtol=0,
                                       atol=1e-5 * max(np.abs(expected).max(), 1e-30))


def test_bad_hyperparameters():
    with pytest.raises(ValueError, match="not one of"):
        build_optimizer_graph(SHAPES, "lamb")
    with pytest.raises(ValueError, match="nesterov"):
        build_optimizer_graph(SHAPES, "sgd", nesterov=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        build_optimizer_graph(SHAPES, "adam", max_grad_norm=0)


def test_step_graph_of_an_mlp_matches_torch():
    from normgrad.graphs import build_training_graph, examples
    from normgrad.graphs.step_graph import build_step_graph

    forward = examples.mlp()
    model, initial = build_step_graph(build_training_graph(forward, loss="cross_entropy"), "sgd", momentum=0.9)
    assert not {t.name for t in model.graph.initializer} & {"w1", "b1", "w2", "b2"}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    import json
    meta = {e.key: json.loads(e.value) for e in model.metadata_props}
    assert meta["normgrad.data_inputs"] == ["x", "labels"]
    w = {n: torch.tensor(initial[n], requires_grad=True) for n in ("w1", "b1", "w2", "b2")}
    optimizer = torch.optim.SGD(list(w.values()), lr=0.1, momentum=0.9)
    rng = np.random.default_rng(1)
    state = dict(initial)
    outputs = [o.name for o in session.get_outputs()]
    for step in range(1, 6):
        x = rng.standard_normal((7, 5)).astype(np.float32)
        labels = rng.integers(0, 3, 7)
        optimizer.zero_grad()
        logits = torch.tanh(torch.tensor(x) @ w["w1"] + w["b1"]) @ w["w2"] + w["b2"]
        torch_loss = torch.nn.functional.cross_entropy(logits, torch.tensor(labels))
        torch_loss.backward()
        optimizer.step()
        result = dict(zip(outputs, session.run(None, {**hyperparameter_feeds(model), **state, "x": x, "labels": labels,
                                                     "lr": np.array(0.1, np.float32), "step": np.array(step, np.float32)})))
        assert abs(result["loss"] - torch_loss.item()) <= 1e-5 * abs(torch_loss.item())
        state = {name: result[meta["normgrad.state"][name]] for name in state}
    for n, t in w.items():
        expected = t.detach().numpy()
        np.testing.assert_allclose(state[n], expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_cli_writes_step_graph_and_checkpoint(tmp_path, capsys):
    import onnx
    from normgrad import checkpoint
    from normgrad.graphs import examples
    from normgrad.tools import export as export_tool

    source = tmp_path / "mlp.onnx"
    onnx.save(examples.mlp(), str(source))
    target = tmp_path / "mlp_step.onnx"
    assert export_tool.main([str(source), "-o", str(target), "--loss", "cross_entropy", "--optimizer", "adamw",
                             "--amsgrad", "--max-grad-norm", "1"]) == 0
    model = onnx.load(str(target))
    state = checkpoint.load(tmp_path / "mlp_step.ckpt")
    inputs = {i.name: i for i in model.graph.input}
    assert set(state.tensors) == set(inputs) - {"x", "labels", "step", *hyperparameter_feeds(model)}
    assert not set(state.tensors) & {t.name for t in model.graph.initializer}
    w1 = {t.name: t for t in examples.mlp().graph.initializer}["w1"]
    assert state.tensors["w1"].tobytes() == onnx.numpy_helper.to_array(w1).tobytes()
    with pytest.raises(SystemExit) as usage:
        export_tool.main([str(source), "-o", str(tmp_path / "x.onnx"), "--optimizer", "sgd"])
    assert usage.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as usage:  # a nonsense option is a usage error (docs/reference/errors.md)
        export_tool.main([str(source), "-o", str(tmp_path / "x.onnx"), "--loss", "mse", "--optimizer", "sgd", "--nesterov"])
    assert usage.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert not (tmp_path / "x.onnx").exists() and not (tmp_path / "x.ckpt").exists()


def test_cli_old_clip_flag_is_a_deprecated_alias(tmp_path, capsys):
    import onnx
    from normgrad.graphs import examples
    from normgrad.tools import export as export_tool

    source = tmp_path / "mlp.onnx"
    onnx.save(examples.mlp(), str(source))
    common = [str(source), "--loss", "cross_entropy", "--optimizer", "sgd", "--momentum", "0.9"]
    assert export_tool.main([*common, "-o", str(tmp_path / "new.onnx"), "--max-grad-norm", "0.5"]) == 0
    capsys.readouterr()
    assert export_tool.main([*common, "-o", str(tmp_path / "old.onnx"), "--clip-grad-norm", "0.5"]) == 0
    assert capsys.readouterr().err == "normgrad export: warning: --clip-grad-norm is deprecated; use --max-grad-norm\n"
    new, old = (onnx.load(str(tmp_path / f"{name}.onnx")) for name in ("new", "old"))
    assert new.SerializeToString(deterministic=True) == old.SerializeToString(deterministic=True)
    assert hyperparameter_feeds(new)["max_grad_norm"] == 0.5
    assert "--clip-grad-norm" not in " ".join(export_tool._parser().format_help().split())


def test_frozen_weights_get_no_gradient_and_stay_bitwise(tmp_path):
    import json
    import onnx
    from normgrad import checkpoint
    from normgrad.graphs import examples
    from normgrad.tools import export as export_tool

    source = tmp_path / "mlp.onnx"
    forward = examples.mlp()
    onnx.save(forward, str(source))
    target = tmp_path / "head.onnx"
    assert export_tool.main([str(source), "-o", str(target), "--loss", "cross_entropy", "--optimizer", "sgd",
                             "--momentum", "0.9", "--trainable", "*2"]) == 0
    model = onnx.load(str(target))
    meta = {e.key: json.loads(e.value) for e in model.metadata_props}
    assert meta["normgrad.parameters"] == ["w2", "b2"]
    values = {o for n in model.graph.node for o in n.output}
    assert not {"w1_grad", "b1_grad"} & values
    assert not any(n.op_type == "Gemm" for n in model.graph.node[4:])  # no backward through the frozen Gemm
    initial = {t.name: onnx.numpy_helper.to_array(t) for t in forward.graph.initializer}
    kept = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    assert kept["w1"].tobytes() == initial["w1"].tobytes() and kept["b1"].tobytes() == initial["b1"].tobytes()
    state = checkpoint.load(tmp_path / "head.ckpt").tensors
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    outputs = [o.name for o in session.get_outputs()]
    feeds = {**hyperparameter_feeds(model), **state, "x": rng.standard_normal((4, 5)).astype(np.float32),
             "labels": np.array([0, 1, 2, 1]),
             "lr": np.array(0.1, np.float32), "step": np.array(1, np.float32)}
    result = dict(zip(outputs, session.run(None, feeds)))
    assert not np.array_equal(result["w2.next"], state["w2"])
    with pytest.raises(ValueError, match="'nope' matches no float initializer"):
        from normgrad.graphs.builder import frozen_parameters
        frozen_parameters(forward, ["nope"])


NAN, INF = float("nan"), float("inf")

# (kind, options): torch.optim refuses every one (ValueError, or TypeError for another optimizer's option)
REFUSED_BY_TORCH = [
    ("adam", {"eps": NAN}), ("adam", {"eps": -1e-8}), ("adamw", {"weight_decay": NAN}), ("adam", {"weight_decay": -0.1}),
    ("adam", {"betas": (1.5, 0.999)}), ("adamw", {"betas": (0.9, 1.0)}), ("adam", {"betas": (NAN, 0.999)}),
    ("adam", {"betas": (0.9, -0.1)}), ("sgd", {"momentum": -0.9}), ("sgd", {"weight_decay": -1.0}),
    ("sgd", {"nesterov": True}), ("sgd", {"nesterov": True, "momentum": 0.9, "dampening": 0.1}),
    ("sgd", {"betas": (0.5, 0.9)}), ("sgd", {"eps": 1e-6}), ("sgd", {"amsgrad": True}),
    ("adam", {"momentum": 0.9}), ("adamw", {"nesterov": True}), ("adam", {"dampening": 0.1}),
]
# torch lets these through to NaN weights; refused here
REFUSED_HERE_ONLY = [("sgd", {"momentum": NAN}), ("sgd", {"weight_decay": NAN}), ("sgd", {"dampening": NAN}),
                     ("adam", {"eps": INF})]
ACCEPTED = [("adam", {"eps": 0.0}), ("sgd", {"momentum": 0.9, "nesterov": True}), ("adamw", {"weight_decay": 0.0}),
            ("adam", {"betas": (0.0, 0.0)})]


def _torch_error(kind, options):
    torch = pytest.importorskip("torch")
    constructor = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    try:
        constructor([torch.nn.Parameter(torch.zeros(2))], **{"lr": 0.1, **options})
    except (ValueError, TypeError) as error:
        return type(error)
    return None


@pytest.mark.parametrize("kind, options", REFUSED_BY_TORCH + ACCEPTED)
def test_python_api_refuses_what_torch_refuses(kind, options):
    expected = _torch_error(kind, options)
    if expected is None:
        build_optimizer_graph({"w": [2]}, kind, **options)
    else:
        with pytest.raises(expected) as raised:
            build_optimizer_graph({"w": [2]}, kind, **options)
        assert list(options)[0] in str(raised.value) or "nesterov" in str(raised.value)


@pytest.mark.parametrize("kind, options", REFUSED_HERE_ONLY)
def test_python_api_refuses_non_finite_values_torch_lets_through(kind, options):
    with pytest.raises(ValueError, match=list(options)[0]):
        build_optimizer_graph({"w": [2]}, kind, **options)


def test_negative_lr_is_refused_as_torch_does():
    from normgrad.graphs.optimizers import check_hyperparameters

    assert _torch_error("sgd", {"lr": -0.1}) is ValueError
    with pytest.raises(ValueError, match="lr"):
        check_hyperparameters("sgd", lr=-0.1)
    with pytest.raises(ValueError, match="lr"):
        check_hyperparameters("adam", lr=NAN)


def _cli_argument(name, value):
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag]
    if isinstance(value, tuple):
        return [flag] + [repr(v) for v in value]
    return [flag, repr(value)]


@pytest.fixture(scope="module")
def forward_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("forward") / "mlp.onnx"
    onnx.save(examples.mlp(), str(path))
    return path


@pytest.mark.parametrize("kind, options", [case for case in REFUSED_BY_TORCH + REFUSED_HERE_ONLY
                                           if not (case[0] == "sgd" and case[1].get("nesterov") and len(case[1]) == 1)])
def test_cli_refuses_nonsense_options_in_one_line_exit_2(kind, options, forward_path, tmp_path, capsys):
    arguments = [a for name, value in options.items() for a in _cli_argument(name, value)]
    output = tmp_path / "step.onnx"
    code = cli.main(["export", str(forward_path), "-o", str(output), "--loss", "mse", "--optimizer", kind] + arguments)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and list(options)[-1].replace("_", "-") in err
    assert os.listdir(tmp_path) == []


def test_cli_refuses_nesterov_without_momentum(forward_path, tmp_path, capsys):
    code = cli.main(["export", str(forward_path), "-o", str(tmp_path / "s.onnx"), "--loss", "mse", "--optimizer", "sgd",
                             "--nesterov"])
    assert code == 2 and "nesterov" in capsys.readouterr().err


def test_cli_refuses_optimizer_options_without_optimizer(forward_path, tmp_path, capsys):
    code = cli.main(["export", str(forward_path), "-o", str(tmp_path / "t.onnx"), "--momentum", "0.9"])
    assert code == 2 and "--optimizer" in capsys.readouterr().err


def test_cli_accepts_eps_zero_as_torch_does(forward_path, tmp_path):
    assert _torch_error("adam", {"eps": 0.0}) is None
    assert cli.main(["export", str(forward_path), "-o", str(tmp_path / "s.onnx"), "--loss", "mse", "--optimizer", "adam",
                             "--eps", "0"]) == 0


def test_freezing_everything_with_an_optimizer_is_a_usage_error(forward_path, tmp_path, capsys):
    code = cli.main(["export", str(forward_path), "-o", str(tmp_path / "s.onnx"), "--loss", "mse", "--optimizer", "sgd",
                     "--freeze", "*"])
    err = capsys.readouterr().err
    assert code == 2 and "--freeze" in err and "build_optimizer_graph" not in err
    assert os.listdir(tmp_path) == []
