"""Issue 24 (and issue 19's probes): one hyperparameter check for the CLI, the Python API and
the AdamUpdate kernels, refusing what torch.optim refuses; names the training graph gives
that never collide with forward values; fresh names in linear time; one-line CLI errors."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import normgrad
from normgrad.graphs import build_optimizer_graph, build_training_graph, examples
from normgrad.graphs import context as graph_context
from normgrad.ops import DOMAIN, IR_VERSION, adam_update
from normgrad.tools import cli

from conftest import cpp_available

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


# ------------------------------------------------------------------ 7: AdamUpdate's kernels


BAD_SCALARS = [{"epsilon": NAN}, {"beta2": INF}, {"one_minus_beta1": -0.5}, {"one_minus_beta2": -INF}]
"""Hyperparameters breaking AdamUpdate's rule (they are its inputs: no checker can see them)."""


def _adam_inputs(value=1.0, **scalars):
    inputs = {n: np.full([4] if n in adam_update.INPUTS[:4] else [], value, np.float32) for n in adam_update.INPUTS[:10]}
    inputs.update({name: np.array(v, np.float32) for name, v in scalars.items()})
    return inputs


@pytest.mark.parametrize("scalars", BAD_SCALARS, ids=lambda d: next(iter(d)))
@pytest.mark.parametrize("backend", ["reference", "functions", "python", "cpp"])
def test_adam_update_skips_broken_hyperparameters_on_every_backend(scalars, backend):
    """Issue 30 item 5: the kernels and the function body (Trainer(kernels=None)) all skip an
    update whose hyperparameters break the rule: every output is its input, never NaN weights."""
    from normgrad.ops import harness

    if backend == "cpp" and not cpp_available():
        pytest.skip("C++ library not built")
    inputs = _adam_inputs(**scalars)
    inputs["grad"] = np.arange(4, dtype=np.float32)
    result = (dict(zip(adam_update.OUTPUTS, adam_update.reference(**inputs))) if backend == "reference"
              else harness.run(backend, adam_update.OP_TYPE, inputs))
    for output, state in zip(adam_update.OUTPUTS, ("param", "exp_avg", "exp_avg_sq")):
        assert result[output].tobytes() == inputs[state].tobytes(), output


@pytest.mark.skipif(not cpp_available(), reason="C++ library not built")
def test_adam_update_kernel_takes_valid_hyperparameters():
    from normgrad.ops import harness

    inputs = _adam_inputs(0.5, epsilon=0.0, beta2=0.0, one_minus_beta1=1.0)
    got = harness.run("cpp", adam_update.OP_TYPE, inputs)
    expected = adam_update.reference(**inputs)
    assert not adam_update.skip_reason(inputs)
    for name, truth in zip(adam_update.OUTPUTS, expected):
        np.testing.assert_allclose(got[name], truth, rtol=1e-6)


# ------------------------------------------------------------------ 8, 13: generated names never collide


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


# ------------------------------------------------------------------ 16: fresh names in linear time


def _chain_of_unnamed_nodes(count):
    nodes = [helper.make_node("Tanh", ["x" if i == 0 else f"v{i - 1}"], [f"v{i}"]) for i in range(count)]
    nodes.append(helper.make_node("Mul", [f"v{count - 1}", "w"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                              [numpy_helper.from_array(np.ones(3, np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=IR_VERSION)


def test_fresh_names_probe_a_constant_number_of_names_per_node(monkeypatch):
    probes = {"count": 0}

    class CountingSet(set):
        def __contains__(self, item):
            probes["count"] += 1
            return set.__contains__(self, item)

    original = graph_context.GradientContext.__init__

    def counting_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._used = CountingSet(self._used)

    monkeypatch.setattr(graph_context.GradientContext, "__init__", counting_init)
    per_node = []
    for count in (200, 800):
        probes["count"] = 0
        build_training_graph(_chain_of_unnamed_nodes(count), loss="mse")
        per_node.append(probes["count"] / count)
    assert per_node[1] < 1.2 * per_node[0], per_node  # quadratic probing: 4 times as many per node


# ------------------------------------------------------------------ 23: clear messages, consistent exit statuses


def test_freezing_everything_with_an_optimizer_is_a_usage_error(forward_path, tmp_path, capsys):
    code = cli.main(["export", str(forward_path), "-o", str(tmp_path / "s.onnx"), "--loss", "mse", "--optimizer", "sgd",
                     "--freeze", "*"])
    err = capsys.readouterr().err
    assert code == 2 and "--freeze" in err and "build_optimizer_graph" not in err
    assert os.listdir(tmp_path) == []


def test_check_says_a_step_graph_or_checkpoint_is_not_a_training_graph(forward_path, tmp_path, capsys):
    step = tmp_path / "s.onnx"
    assert cli.main(["export", str(forward_path), "-o", str(step), "--loss", "mse", "--optimizer", "sgd"]) == 0
    capsys.readouterr()
    assert cli.main(["check", str(step)]) == 1
    assert "step graph" in capsys.readouterr().err
    assert cli.main(["check", str(tmp_path / "s.ckpt")]) == 1
    assert "checkpoint" in capsys.readouterr().err


# ------------------------------------------------------------------ 17: export memory


def test_training_graph_is_built_with_one_copy_of_the_model(monkeypatch):
    """Each copy of a 10^6-node model costs gigabytes: the builder copies the caller's model
    once (it must not change it) and nothing else (add_functions used to copy it again)."""
    import copy

    copies = []
    real = copy.deepcopy

    def counting(value, *args, **kwargs):
        if isinstance(value, onnx.ModelProto):
            copies.append(len(value.graph.node))
        return real(value, *args, **kwargs)

    monkeypatch.setattr(copy, "deepcopy", counting)
    build_training_graph(_chain_of_unnamed_nodes(50), loss="mse")
    assert len(copies) == 1, copies
