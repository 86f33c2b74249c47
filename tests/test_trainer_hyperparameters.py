"""Optimizer hyperparameters at run time (issue 34): ``trainer.hyperparameters``, the mapping
a torch-style scheduler writes between steps, and ``Trainer(lr=..., weight_decay=..., ...)``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from normgrad.graphs import build_step_graph, build_training_graph
from normgrad.train import Trainer, TrainerError
from normgrad.graphs.optimizers import hyperparameter_feeds
from _trainer_graphs import _linear_tanh_linear, _mse_batch, _options, _step


def _states_equal(a, b):
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_assigned_learning_rate_is_the_next_steps():
    """Writing hyperparameters["lr"] between steps gives bitwise the run of a schedule with the same values."""
    step, initial = _step("mse", "sgd", momentum=0.9)
    values = [0.05, 0.02, 0.1, 0.001]
    written = Trainer(step, initial, session_options=_options())
    scheduled = Trainer(step, initial, lr=lambda k: values[k - 1], session_options=_options())
    for k, value in enumerate(values, 1):
        written.hyperparameters["lr"] = value
        assert written.hyperparameters["lr"] == value
        assert scheduled.hyperparameters["lr"] == value  # a schedule's value for the next step
        batch = _mse_batch(seed=k)
        assert written.step(**batch) == scheduled.step(**batch)
        assert _states_equal(written.state_dict(), scheduled.state_dict())


def test_assignment_replaces_a_schedule():
    step, initial = _step("mse", "sgd")
    trainer = Trainer(step, initial, lr=lambda k: 0.1 * k, session_options=_options())
    assert trainer.lr() == pytest.approx(0.1) and trainer.lr(3) == pytest.approx(0.3)
    trainer.hyperparameters["lr"] = 0.5
    assert trainer.lr(3) == 0.5 and trainer.schedule(7) == 0.5
    assert dict(trainer.hyperparameters) == {"lr": 0.5, "weight_decay": 0.0, "max_grad_norm": np.inf}


@pytest.mark.parametrize("value", [None, float("nan"), float("inf"), -0.1, 1e39, 10**400, "0.1", True])
def test_bad_assignments_are_refused(value):
    step, initial = _step("mse", "sgd")
    trainer = Trainer(step, initial, lr=0.01, session_options=_options())
    with pytest.raises(TrainerError, match=r"hyperparameters\['lr'\] = .*a learning rate must be a finite number >= 0"):
        trainer.hyperparameters["lr"] = value
    assert trainer.hyperparameters["lr"] == 0.01


def test_names_are_fixed():
    step, initial = _step("mse", "adam")
    trainer = Trainer(step, initial, session_options=_options())
    with pytest.raises(TrainerError, match="takes no hyperparameter 'momentum' .its optimizer has none"):
        trainer.hyperparameters["momentum"] = 0.9
    with pytest.raises(TrainerError, match="takes no hyperparameter 'gamma' .not an optimizer hyperparameter"):
        trainer.hyperparameters["gamma"] = 0.9
    with pytest.raises(TrainerError, match="cannot be removed"):
        del trainer.hyperparameters["lr"]
    with pytest.raises(TrainerError, match="takes no hyperparameter 'momentum'"):
        Trainer(step, initial, momentum=0.9, session_options=_options())


def test_checkpoint_keeps_the_values_and_resume_is_bitwise(tmp_path):
    step, initial = _step("mse", "adamw")
    straight = Trainer(step, initial, session_options=_options())
    stopped = Trainer(step, initial, session_options=_options())
    for trainer in (straight, stopped):
        trainer.hyperparameters["lr"] = 0.0123
        for k in range(2):
            trainer.step(**_mse_batch(seed=k))
    stopped.save(tmp_path / "s.ckpt")
    resumed = Trainer(step, tmp_path / "s.ckpt", session_options=_options())
    assert resumed.hyperparameters["lr"] == 0.0123
    for k in range(2, 4):
        assert straight.step(**_mse_batch(seed=k)) == resumed.step(**_mse_batch(seed=k))
    assert _states_equal(straight.state_dict(), resumed.state_dict())
    # an explicit argument wins over the checkpoint's value
    assert Trainer(step, tmp_path / "s.ckpt", lr=0.5, session_options=_options()).hyperparameters["lr"] == 0.5


def test_learning_rate_defaults_to_the_graphs():
    step, initial = _step("mse", "sgd")
    trainer = Trainer(step, initial, session_options=_options())
    assert math.isclose(trainer.hyperparameters["lr"], 1e-3, rel_tol=1e-7)


# -- against torch.optim, with the same param_group edits mid-run -----------------------------------

# (kind, export options, {step: {hyperparameter: value}}): each change is made before that step,
# in trainer.hyperparameters and in torch's param_groups
CHANGES = {
    "sgd_weight_decay": ("sgd", {}, {4: {"weight_decay": 0.2}, 8: {"lr": 0.02, "weight_decay": 0.05}}),
    "sgd_momentum": ("sgd", dict(momentum=0.9, dampening=0.1, weight_decay=0.01),
                     {3: {"momentum": 0.5, "dampening": 0.3}, 6: {"weight_decay": 0.1, "momentum": 0.95, "dampening": 0.0}}),
    "sgd_nesterov": ("sgd", dict(momentum=0.9, nesterov=True), {4: {"momentum": 0.6, "weight_decay": 0.05}}),
    "adam": ("adam", {}, {3: {"beta1": 0.8, "beta2": 0.99}, 5: {"eps": 1e-4, "weight_decay": 0.1}, 8: {"beta1": 0.95}}),
    "adamw": ("adamw", dict(no_weight_decay=["*.bias"]),
              {3: {"beta1": 0.5, "beta2": 0.9, "weight_decay": 0.3}, 6: {"eps": 1e-3, "lr": 0.05}}),
    "adam_amsgrad": ("adam", dict(amsgrad=True), {3: {"beta2": 0.9, "weight_decay": 0.1}, 6: {"eps": 1e-5}}),
    "adamw_amsgrad": ("adamw", dict(amsgrad=True, weight_decay=0.1), {4: {"beta1": 0.7, "weight_decay": 0.0}}),
    "sgd_clip": ("sgd", dict(momentum=0.9, max_grad_norm=1.0), {3: {"max_grad_norm": 0.05}, 7: {"max_grad_norm": 5.0}}),
    "adamw_clip": ("adamw", dict(max_grad_norm=0.5), {4: {"max_grad_norm": 0.01, "beta2": 0.95}}),
    # graphs exported without clipping take the norm at run time (+inf: off, torch's max_norm=inf too)
    "sgd_clip_at_run_time": ("sgd", dict(momentum=0.9), {2: {"max_grad_norm": 0.05}, 6: {"max_grad_norm": float("inf")}}),
    "adamw_clip_at_run_time": ("adamw", {}, {1: {"max_grad_norm": 0.02}, 7: {"max_grad_norm": float("inf")}}),
}
STEPS = 10


def _torch_trajectory(torch, kind, options, changes, initial, lr):
    names = ["a.weight", "a.bias", "b.weight", "b.bias"]
    params = {n: torch.nn.Parameter(torch.from_numpy(initial[n].copy())) for n in names}
    decayed = [n for n in names if not n.endswith(".bias") or "no_weight_decay" not in options]
    groups = [{"params": [params[n] for n in decayed]},
              {"params": [params[n] for n in names if n not in decayed], "weight_decay": 0.0}]
    torch_options = {k: v for k, v in options.items() if k not in ("no_weight_decay", "max_grad_norm")}
    optimizer = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind](
        [g for g in groups if g["params"]], lr=lr, **torch_options)  # torch's defaults are the graphs'
    max_norm = options.get("max_grad_norm")
    trajectory = []
    for k in range(1, STEPS + 1):
        for name, value in changes.get(k, {}).items():
            if name == "max_grad_norm":
                max_norm = value
            for group in optimizer.param_groups:
                if name in ("beta1", "beta2"):
                    betas = list(group["betas"])
                    betas[name == "beta2"] = value
                    group["betas"] = tuple(betas)
                elif name != "weight_decay" or group is optimizer.param_groups[0]:
                    group[name] = value
        batch = _mse_batch(seed=k)
        x, labels = (torch.from_numpy(batch[n]) for n in ("x", "labels"))
        hidden = torch.tanh(x @ params["a.weight"].T + params["a.bias"])
        loss = torch.nn.functional.mse_loss(hidden @ params["b.weight"].T + params["b.bias"], labels)
        optimizer.zero_grad()
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
        optimizer.step()
        trajectory.append({n: p.detach().numpy().copy() for n, p in params.items()})
    return trajectory


@pytest.mark.parametrize("case", list(CHANGES))
@pytest.mark.parametrize("split", [False, True], ids=["step", "accumulation"])
def test_hyperparameter_changes_mid_run_follow_torch(case, split):
    torch = pytest.importorskip("torch")
    kind, options, changes = CHANGES[case]
    training = build_training_graph(_linear_tanh_linear(), loss="mse")
    step, initial = build_step_graph(training, kind, **options)
    lr = 0.01
    trainer = Trainer(step, initial, lr=lr, session_options=_options(), accumulation=2 if split else 1)
    expected = _torch_trajectory(torch, kind, options, changes, initial, lr)
    for k in range(1, STEPS + 1):
        for name, value in changes.get(k, {}).items():
            trainer.hyperparameters[name] = value
        batch = _mse_batch(seed=k)
        if split:  # two micro-batches of a batch twice as large average to the same gradient
            batch = {n: np.concatenate([v, v]) for n, v in batch.items()}
        trainer.step(**batch)
        state = trainer.state_dict()
        for name, value in expected[k - 1].items():
            np.testing.assert_allclose(state[name], value, rtol=2e-5, atol=2e-6, err_msg=f"{case} step {k} {name}")


def test_hyperparameters_as_trainer_arguments_and_schedules():
    """Trainer(betas=(schedule, number), eps=..., weight_decay=...) is the same run as assigning
    the same values to trainer.hyperparameters before each step, bitwise."""
    step, initial = _step("mse", "adamw")
    beta1 = lambda k: 0.9 - 0.01 * k  # noqa: E731
    given = Trainer(step, initial, betas=(beta1, 0.95), eps=1e-6, weight_decay=0.2, session_options=_options())
    written = Trainer(step, initial, session_options=_options())
    assert given.hyperparameters["beta1"] == pytest.approx(0.89)
    for k in range(1, 5):
        written.hyperparameters.update(beta1=beta1(k), beta2=0.95, eps=1e-6, weight_decay=0.2)
        assert given.step(**_mse_batch(seed=k)) == written.step(**_mse_batch(seed=k))
    assert _states_equal(given.state_dict(), written.state_dict())


@pytest.mark.parametrize("name, value, message", [
    ("beta1", 1.0, r"betas\[0\] must be in \[0, 1\)"), ("beta2", -0.1, r"betas\[1\] must be in \[0, 1\)"),
    ("eps", float("nan"), "eps must be a finite number"), ("eps", -1e-8, "eps must be finite and >= 0"),
    ("weight_decay", None, "weight_decay must be a finite number"), ("weight_decay", True, "weight_decay must be a finite"),
])
def test_bad_adam_values_are_refused(name, value, message):
    step, initial = _step("mse", "adam")
    trainer = Trainer(step, initial, session_options=_options())
    before = dict(trainer.hyperparameters)
    with pytest.raises(TrainerError, match=message):
        trainer.hyperparameters[name] = value
    assert dict(trainer.hyperparameters) == before
    if value is None:  # Trainer(weight_decay=None): the checkpoint's or graph's value
        return
    with pytest.raises(TrainerError, match=message):
        Trainer(step, initial, **({"betas": (value, 0.999)} if name == "beta1" else {"betas": (0.9, value)} if name == "beta2"
                                  else {name: value}), session_options=_options()).step(**_mse_batch())



def test_bad_sgd_values_are_refused():
    step, initial = _step("mse", "sgd", momentum=0.9, nesterov=True)
    trainer = Trainer(step, initial, session_options=_options())
    with pytest.raises(TrainerError, match="nesterov needs momentum > 0 and dampening 0"):
        trainer.hyperparameters["dampening"] = 0.1
    step, initial = _step("mse", "sgd", momentum=0.9)
    trainer = Trainer(step, initial, session_options=_options())
    with pytest.raises(TrainerError, match="momentum must stay > 0"):
        trainer.hyperparameters["momentum"] = 0.0
    with pytest.raises(TrainerError, match="the momentum schedule returned -1 for step 1"):
        Trainer(step, initial, momentum=lambda k: -1, session_options=_options()).step(**_mse_batch())


# -- issue 30 item 5: epsilon NaN fed to a step graph, on every backend --------------------------

@pytest.mark.parametrize("backend", ["cpp", "functions", "inline"])
def test_step_graph_fed_nan_epsilon_keeps_every_weight(backend):
    """A step graph run by a plain session (no Trainer check in between) with eps=NaN: the C++
    kernel, the function bodies (Trainer(kernels=None), other runtimes) and the inlined graph
    all leave the parameters and moments unchanged instead of NaN."""
    import json

    import onnxruntime as ort

    import normgrad
    from _helpers import cpp_available

    if backend == "cpp" and not cpp_available():
        pytest.skip("needs the C++ library")
    training = build_training_graph(_linear_tanh_linear(), loss="mse", inline=backend == "inline")
    step, initial = build_step_graph(training, "adamw", weight_decay=0.1)
    options = normgrad.session_options("cpp", _options()) if backend == "cpp" else _options()
    session = ort.InferenceSession(step.SerializeToString(), options, providers=["CPUExecutionProvider"])
    state_map = json.loads({e.key: e.value for e in step.metadata_props}["normgrad.state"])
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(None, {**hyperparameter_feeds(step), **_mse_batch(), **initial,
                                                 "lr": np.array(0.01, np.float32),
                                                 "step": np.array(1, np.float32), "eps": np.array(np.nan)})))
    for name, next_name in state_map.items():
        assert outputs[next_name].tobytes() == initial[name].tobytes(), name


def test_inline_step_graph_takes_the_hyperparameters():
    """--inline (standard domains only): the same hyperparameter inputs, the same run as the
    step graph with normgrad's kernels, changes mid-run included."""
    runs = []
    for inline in (False, True):
        training = build_training_graph(_linear_tanh_linear(), loss="mse", inline=inline)
        step, initial = build_step_graph(training, "adam", weight_decay=0.01)
        trainer = Trainer(step, initial, lr=0.01, session_options=_options())
        assert list(trainer.hyperparameters) == ["lr", "weight_decay", "beta1", "beta2", "eps", "max_grad_norm"]
        for k in range(1, 5):
            if k == 3:
                trainer.hyperparameters.update(beta1=0.5, eps=1e-3, weight_decay=0.2)
            trainer.step(**_mse_batch(seed=k))
        runs.append(trainer.state_dict())
    for name, value in runs[0].items():
        np.testing.assert_allclose(runs[1][name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_exported_step_graph_keeps_its_defaults(tmp_path):
    """normgrad export records the export values (no initializer: weights and hyperparameters
    are pure inputs); the Trainer starts from them (as given, not rounded to an input's
    float32) and hyperparameter_feeds gives them in each input's dtype."""
    import onnx

    from normgrad.graphs.optimizers import hyperparameter_feeds, hyperparameter_values
    from normgrad.tools import export as export_tool

    onnx.save(_linear_tanh_linear(), tmp_path / "net.onnx")
    assert export_tool.main([str(tmp_path / "net.onnx"), "-o", str(tmp_path / "step.onnx"), "--loss", "mse",
                             "--optimizer", "sgd", "--momentum", "0.9", "--dampening", "0.25",
                             "--weight-decay", "0.1"]) == 0
    step = onnx.load(str(tmp_path / "step.onnx"))
    assert not {i.name for i in step.graph.input} & {t.name for t in step.graph.initializer}
    feeds = hyperparameter_feeds(step)
    assert {k: (v.dtype, float(v)) for k, v in feeds.items()} == {
        "lr": (np.float32, float(np.float32(1e-3))), "weight_decay": (np.float64, 0.1), "momentum": (np.float64, 0.9),
        "dampening": (np.float64, 0.25), "max_grad_norm": (np.float64, np.inf)}  # +inf: no clipping
    assert hyperparameter_values(step) == {"lr": 1e-3, "weight_decay": 0.1, "momentum": 0.9, "dampening": 0.25,
                                           "max_grad_norm": np.inf}
    trainer = Trainer(step, tmp_path / "step.ckpt", session_options=_options())
    assert dict(trainer.hyperparameters) == hyperparameter_values(step)
