"""normgrad.schedules' torch-named schedulers against torch.optim.lr_scheduler's own: the
same arguments, the same calls, 300 steps, the learning rate (and OneCycleLR's beta1 or
momentum) equal at float32 rounding at every step."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from normgrad import schedules
from normgrad.train import TrainerError

torch = pytest.importorskip("torch")
lr_scheduler = torch.optim.lr_scheduler

STEPS = 300


class HyperparameterHolder:
    """What a scheduler drives: an object with a ``hyperparameters`` mapping, as a Trainer."""

    def __init__(self, **values):
        self.hyperparameters = {name: float(value) for name, value in values.items()}


def _pair(optimizer: str, lr: float = 0.1):
    parameter = torch.nn.Parameter(torch.zeros(2))
    if optimizer == "sgd":
        return torch.optim.SGD([parameter], lr=lr, momentum=0.9), HyperparameterHolder(lr=lr, momentum=0.9, weight_decay=0.0)
    return (torch.optim.AdamW([parameter], lr=lr, betas=(0.9, 0.999)),
            HyperparameterHolder(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01))


def _torch_values(optimizer) -> dict:
    group = optimizer.param_groups[0]
    values = {"lr": group["lr"]}
    if "betas" in group:
        values["beta1"] = group["betas"][0]
    if "momentum" in group:
        values["momentum"] = group["momentum"]
    return values


def _assert_same(ours: HyperparameterHolder, optimizer, step: int, what: str) -> None:
    for name, expected in _torch_values(optimizer).items():
        actual = ours.hyperparameters[name]
        assert np.float32(actual) == np.float32(expected), f"{what} step {step}: {name} {actual!r} != torch's {expected!r}"


SIMPLE = [
    ("StepLR", dict(step_size=30, gamma=0.5)),
    ("MultiStepLR", dict(milestones=[20, 90, 90, 200], gamma=0.3)),
    ("ConstantLR", dict(factor=0.25, total_iters=40)),
    ("LinearLR", dict(start_factor=0.05, end_factor=0.9, total_iters=120)),
    ("ExponentialLR", dict(gamma=0.99)),
    ("CosineAnnealingLR", dict(T_max=70, eta_min=1e-4)),
    ("CosineAnnealingWarmRestarts", dict(T_0=17, T_mult=1, eta_min=1e-3)),
    ("CosineAnnealingWarmRestarts", dict(T_0=10, T_mult=2)),
    ("OneCycleLR", dict(max_lr=0.5, total_steps=STEPS)),
    ("OneCycleLR", dict(max_lr=0.5, epochs=10, steps_per_epoch=30, pct_start=0.25, anneal_strategy="linear",
                        three_phase=True, base_momentum=0.8, max_momentum=0.97)),
]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("name,arguments", SIMPLE, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SIMPLE)])
def test_scheduler_matches_torch(name, arguments, optimizer):
    theirs, ours = _pair(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_scheduler = getattr(lr_scheduler, name)(theirs, **arguments)
        scheduler = getattr(schedules, name)(ours, **arguments)
        _assert_same(ours, theirs, 0, name)
        for step in range(1, STEPS + (0 if name == "OneCycleLR" else 1)):
            theirs.step()
            torch_scheduler.step()
            scheduler.step()
            _assert_same(ours, theirs, step, name)
            assert scheduler.get_last_lr() == [ours.hyperparameters["lr"]]
            assert np.float32(scheduler.get_last_lr()[0]) == np.float32(torch_scheduler.get_last_lr()[0])
    if name == "OneCycleLR":  # the betas (or momentum) moved, with torch's
        assert ours.hyperparameters["beta1" if optimizer == "adamw" else "momentum"] != 0.9


def test_onecycle_past_total_steps_refused():
    ours = HyperparameterHolder(lr=0.1, beta1=0.9)
    scheduler = schedules.OneCycleLR(ours, max_lr=1.0, total_steps=3)
    scheduler.step()
    scheduler.step()
    scheduler.step()
    with pytest.raises(TrainerError, match="total_steps is 3"):
        scheduler.step()


def _sequential(optimizer, module):
    warmup = module.LinearLR(optimizer, start_factor=0.1, total_iters=25)
    middle = module.StepLR(optimizer, step_size=20, gamma=0.7)
    cosine = module.CosineAnnealingLR(optimizer, T_max=60, eta_min=1e-3)
    return module.SequentialLR(optimizer, [warmup, middle, cosine], milestones=[25, 150])


def _chained(optimizer, module):
    return module.ChainedScheduler([module.ExponentialLR(optimizer, gamma=0.995),
                                    module.MultiStepLR(optimizer, milestones=[50, 100, 250], gamma=0.5),
                                    module.CosineAnnealingWarmRestarts(optimizer, T_0=40)])


@pytest.mark.parametrize("build", [_sequential, _chained])
def test_composed_schedulers_match_torch(build):
    theirs, ours = _pair("adamw", lr=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_scheduler = build(theirs, lr_scheduler)
        scheduler = build(ours, schedules)
        _assert_same(ours, theirs, 0, build.__name__)
        for step in range(1, STEPS + 1):
            theirs.step()
            torch_scheduler.step()
            scheduler.step()
            _assert_same(ours, theirs, step, build.__name__)
            assert np.float32(scheduler.get_last_lr()[0]) == np.float32(torch_scheduler.get_last_lr()[0])


@pytest.mark.parametrize("arguments", [dict(patience=3, factor=0.5, cooldown=2, min_lr=1e-3),
                                       dict(mode="max", patience=5, threshold=0.05, threshold_mode="abs", factor=0.2)])
def test_reduce_on_plateau_matches_torch(arguments):
    """A scripted validation loss: improving, then plateaus and noise."""
    rng = np.random.default_rng(0)
    metric = np.concatenate([np.linspace(2.0, 1.0, 60), 1.0 + 0.02 * rng.standard_normal(240)])
    if arguments.get("mode") == "max":
        metric = -metric
    theirs, ours = _pair("sgd", lr=0.5)
    torch_scheduler = lr_scheduler.ReduceLROnPlateau(theirs, **arguments)
    scheduler = schedules.ReduceLROnPlateau(ours, **arguments)
    changes = 0
    for step, value in enumerate(metric.tolist(), 1):
        before = ours.hyperparameters["lr"]
        torch_scheduler.step(value)
        scheduler.step(value)
        _assert_same(ours, theirs, step, "ReduceLROnPlateau")
        assert scheduler.get_last_lr() == torch_scheduler.get_last_lr()
        changes += ours.hyperparameters["lr"] != before
    assert changes >= 2  # the script exercises the reductions


@pytest.mark.parametrize("build", [
    lambda t, m: m.OneCycleLR(t, max_lr=0.4, total_steps=STEPS, three_phase=True),
    _sequential,
    lambda t, m: m.CosineAnnealingWarmRestarts(t, T_0=7, T_mult=3),
    lambda t, m: m.ReduceLROnPlateau(t, patience=2),
], ids=["onecycle", "sequential", "warm-restarts", "plateau"])
def test_state_dict_round_trip(build):
    """Stopped at step 120, state_dict through JSON into a fresh scheduler on a fresh
    holder (with the saved hyperparameters): the remaining steps equal an uninterrupted run's."""
    def advance(scheduler, step):
        scheduler.step(2.0 / step) if isinstance(scheduler, schedules.ReduceLROnPlateau) else scheduler.step()

    whole = HyperparameterHolder(lr=0.1, beta1=0.9)
    reference = build(whole, schedules)
    first = HyperparameterHolder(lr=0.1, beta1=0.9)
    interrupted = build(first, schedules)
    for step in range(1, 121):
        advance(reference, step)
        advance(interrupted, step)
    saved = json.loads(json.dumps(interrupted.state_dict()))
    resumed_holder = HyperparameterHolder(**first.hyperparameters)
    resumed = build(resumed_holder, schedules)
    resumed.load_state_dict(saved)
    resumed_holder.hyperparameters.update(first.hyperparameters)
    for step in range(121, STEPS):
        advance(reference, step)
        advance(resumed, step)
        assert resumed_holder.hyperparameters == whole.hyperparameters, step
        assert resumed.get_last_lr() == reference.get_last_lr()


def test_bad_arguments_refused():
    holder = HyperparameterHolder(lr=0.1, weight_decay=0.0)
    with pytest.raises(TrainerError, match="no hyperparameter 'beta1'"):
        schedules.StepLR(holder, step_size=3, hyperparameter="beta1")
    with pytest.raises(TrainerError, match=r"needs beta1 \(Adam, AdamW\) or momentum \(SGD\)"):
        schedules.OneCycleLR(holder, max_lr=1.0, total_steps=10)
    with pytest.raises(TrainerError, match="step_size must be an integer >= 1"):
        schedules.StepLR(holder, step_size=0)
    with pytest.raises(TrainerError, match="ReduceLROnPlateau"):
        schedules.SequentialLR(holder, [schedules.ReduceLROnPlateau(holder)], milestones=[])
    with pytest.raises(TrainerError, match="hyperparameters mapping"):
        schedules.StepLR(object(), step_size=3)


def test_schedules_another_hyperparameter():
    """hyperparameter="weight_decay": torch's StepLR arithmetic on the weight decay; lr untouched."""
    holder = HyperparameterHolder(lr=0.1, weight_decay=0.04)
    scheduler = schedules.StepLR(holder, step_size=10, gamma=0.5, hyperparameter="weight_decay")
    for step in range(1, 35):
        scheduler.step()
        assert holder.hyperparameters["weight_decay"] == pytest.approx(0.04 * 0.5 ** (step // 10), rel=1e-12)
        assert holder.hyperparameters["lr"] == 0.1


def test_scheduler_drives_a_trainer_as_torch_drives_its_optimizer():
    """A real Trainer with torch's OneCycleLR/SequentialLR call pattern (step, then
    scheduler.step()): bitwise the run of a Trainer given torch's learning rates as a
    schedule function; a Trainer whose lr is a function refuses a scheduler."""
    from normgrad.train import Trainer
    from _trainer_graphs import _mse_batch, _options, _step

    step_graph, initial = _step("mse", "adamw")
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([parameter], lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_scheduler = _sequential(optimizer, lr_scheduler)
        torch_lrs = []
        for _ in range(40):
            torch_lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            torch_scheduler.step()
    driven = Trainer(step_graph, initial, lr=0.01, session_options=_options())
    scheduler = _sequential(driven, schedules)
    reference = Trainer(step_graph, initial, lr=lambda k: torch_lrs[k - 1], session_options=_options())
    for k in range(1, 41):
        batch = _mse_batch(seed=k)
        assert driven.step(**batch) == reference.step(**batch)
        scheduler.step()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(driven.state_dict().values(), reference.state_dict().values()))
    with pytest.raises(TrainerError, match="cannot both drive lr"):
        schedules.StepLR(reference, step_size=3)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_onecycle_cycles_a_trainers_beta1_or_momentum(optimizer):
    """OneCycleLR on a real Trainer moves lr and beta1 (momentum) as torch's moves its
    optimizer's: bitwise the run of a Trainer given torch's values as schedule functions."""
    from normgrad.train import Trainer
    from _trainer_graphs import _mse_batch, _options, _step

    options = {"momentum": 0.9} if optimizer == "sgd" else {}
    step_graph, initial = _step("mse", optimizer, **options)
    driven = Trainer(step_graph, initial, lr=0.01, session_options=_options())
    name = "beta1" if optimizer == "adamw" else "momentum"
    if name not in list(driven.hyperparameters):
        pytest.skip(f"the step graph takes no {name} input (hyperparameters as step inputs not merged)")
    theirs, _ = _pair(optimizer, lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_scheduler = lr_scheduler.OneCycleLR(theirs, max_lr=0.05, total_steps=30)
        values = []
        for _ in range(30):
            values.append(_torch_values(theirs))
            theirs.step()
            torch_scheduler.step()
    scheduler = schedules.OneCycleLR(driven, max_lr=0.05, total_steps=30)
    functions = {"lr": lambda k: values[k - 1]["lr"]}
    if optimizer == "adamw":
        functions["betas"] = (lambda k: values[k - 1]["beta1"], 0.999)
    else:
        functions["momentum"] = lambda k: values[k - 1]["momentum"]
    reference = Trainer(step_graph, initial, session_options=_options(), **functions)
    for k in range(1, 30):
        batch = _mse_batch(seed=k)
        assert driven.step(**batch) == reference.step(**batch)
        scheduler.step()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(driven.state_dict().values(), reference.state_dict().values()))


# (name, arguments, our message, what torch does with them: refuses when "made", fails at a later
# step ("run": a ZeroDivisionError or TypeError mid-training), or "accepts" and runs with a
# meaningless value)
BAD = [
    ("StepLR", dict(step_size=0), "StepLR step_size must be an integer >= 1, got 0", "run"),
    ("StepLR", dict(step_size=2.5), "StepLR step_size must be an integer >= 1, got 2.5", "accepts"),
    ("StepLR", dict(step_size=3, gamma="0.5"), "StepLR gamma must be a finite number >= 0, got '0.5'", "run"),
    ("MultiStepLR", dict(milestones=["a"]), r"MultiStepLR milestones\[0\] must be an integer >= 0, got 'a'", "accepts"),
    ("MultiStepLR", dict(milestones=5), "MultiStepLR milestones must be a list of integers >= 0", "made"),
    ("MultiStepLR", dict(milestones=[3, -1]), r"milestones\[1\] must be an integer >= 0, got -1", "accepts"),
    ("ConstantLR", dict(factor=0, total_iters=1), r"ConstantLR factor must be in \(0, 1\]", "run"),
    ("ConstantLR", dict(factor=1.5), r"ConstantLR factor must be in \(0, 1\]", "made"),
    ("ConstantLR", dict(total_iters="3"), "ConstantLR total_iters must be an integer >= 1, got '3'", "accepts"),
    ("LinearLR", dict(start_factor=0), r"LinearLR start_factor must be in \(0, 1\]", "made"),
    ("LinearLR", dict(total_iters=0), "LinearLR total_iters must be an integer >= 1, got 0", "accepts"),
    ("ExponentialLR", dict(gamma=None), "ExponentialLR gamma must be a finite number >= 0, got None", "run"),
    ("ExponentialLR", dict(gamma=float("nan")), "ExponentialLR gamma must be a finite number >= 0, got nan", "accepts"),
    ("CosineAnnealingLR", dict(T_max=0), "CosineAnnealingLR T_max must be an integer >= 1, got 0", "run"),
    ("CosineAnnealingLR", dict(T_max=10, eta_min="0"), "CosineAnnealingLR eta_min must be a finite number", "run"),
    ("CosineAnnealingWarmRestarts", dict(T_0=5, T_mult=0), "T_mult must be an integer >= 1, got 0", "made"),
    ("OneCycleLR", dict(max_lr=0.01, total_steps=2, pct_start=0.5),
     r"OneCycleLR\(total_steps=2, pct_start=0.5\): its warm-up phase has no steps", "made"),
    ("OneCycleLR", dict(max_lr=0.01, total_steps=10, pct_start=1.0), "its annealing phase has no steps", "run"),
    ("OneCycleLR", dict(max_lr=0.01, total_steps=10, pct_start=0.55, three_phase=True),
     "its annealing phase has no steps", "run"),
    ("OneCycleLR", dict(max_lr=0.01, total_steps=10, cycle_momentum="yes"),
     "OneCycleLR cycle_momentum must be True or False, got 'yes'", "run"),
    ("OneCycleLR", dict(max_lr="1", total_steps=10), "OneCycleLR max_lr must be a finite number >= 0, got '1'", "made"),
    ("OneCycleLR", dict(max_lr=0.01, total_steps=10, anneal_strategy="lin"),
     "OneCycleLR anneal_strategy must be one of 'cos', 'linear', got 'lin'", "made"),
    ("ReduceLROnPlateau", dict(patience="2"), "ReduceLROnPlateau patience must be an integer >= 0, got '2'", "run"),
    ("ReduceLROnPlateau", dict(cooldown=1.5), "ReduceLROnPlateau cooldown must be an integer >= 0, got 1.5", "accepts"),
    ("ReduceLROnPlateau", dict(mode="avg"), "ReduceLROnPlateau mode must be one of 'min', 'max', got 'avg'", "made"),
    ("ReduceLROnPlateau", dict(eps="1"), "ReduceLROnPlateau eps must be a finite number >= 0, got '1'", "run"),
]


def _torch_outcome(name, arguments, steps=12) -> str:
    theirs, _ = _pair("sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            scheduler = getattr(lr_scheduler, name)(theirs, **arguments)
        except (ValueError, TypeError, ZeroDivisionError):
            return "made"
        try:
            for _ in range(steps):
                theirs.step()
                scheduler.step(1.0) if name == "ReduceLROnPlateau" else scheduler.step()
        except (ValueError, TypeError, ZeroDivisionError):
            return "run"
    return "accepts"


@pytest.mark.parametrize("name,arguments,message,torch_outcome", BAD,
                         ids=[f"{n}-{'-'.join(a)}-{i}" for i, (n, a, _, _) in enumerate(BAD)])
def test_every_argument_is_checked_when_the_scheduler_is_made(name, arguments, message, torch_outcome):
    """A bad argument is a ValueError naming the scheduler, the argument and the rule, when
    the scheduler is made (before any training); torch's refuses the same values when made,
    or fails on them mid-run, or runs on with a meaningless value."""
    _, ours = _pair("sgd")
    with pytest.raises(ValueError, match=message):
        getattr(schedules, name)(ours, **arguments)
    assert _torch_outcome(name, arguments) == torch_outcome


EDGES = [  # the limits of the rules, which torch's runs through: accepted, torch's values
    ("ConstantLR", dict(factor=1.0, total_iters=3)),
    ("LinearLR", dict(start_factor=1.0, end_factor=0.0, total_iters=4)),
    ("MultiStepLR", dict(milestones=(0, 3, 3))),
    ("MultiStepLR", dict(milestones=[])),
    ("OneCycleLR", dict(max_lr=0.5, total_steps=3)),  # the warm-up ends before step 0: it starts annealing
    ("OneCycleLR", dict(max_lr=0.5, total_steps=8, pct_start=0.0)),
    ("OneCycleLR", dict(max_lr=0.5, total_steps=8, pct_start=0.5, three_phase=True)),
]


@pytest.mark.parametrize("name,arguments", EDGES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(EDGES)])
def test_arguments_at_the_limits_are_accepted_with_torchs_values(name, arguments):
    theirs, ours = _pair("adamw")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_scheduler = getattr(lr_scheduler, name)(theirs, **arguments)
        scheduler = getattr(schedules, name)(ours, **arguments)
        for step in range(1, arguments.get("total_steps", 9)):
            theirs.step()
            torch_scheduler.step()
            scheduler.step()
            _assert_same(ours, theirs, step, name)


def test_reduce_on_plateau_patience_zero_matches_torch():
    theirs, ours = _pair("sgd")
    torch_scheduler = lr_scheduler.ReduceLROnPlateau(theirs, patience=0, cooldown=0)
    scheduler = schedules.ReduceLROnPlateau(ours, patience=0, cooldown=0)
    for step, value in enumerate([3.0, 2.0, 2.0, 2.5, 1.0, 1.0], 1):
        torch_scheduler.step(value)
        scheduler.step(value)
        _assert_same(ours, theirs, step, "ReduceLROnPlateau")


def test_sequential_milestones_checked():
    _, ours = _pair("adamw")
    first, second = schedules.ConstantLR(ours, factor=0.5, total_iters=2), schedules.ExponentialLR(ours, gamma=0.9)
    with pytest.raises(ValueError, match=r"SequentialLR milestones\[0\] must be an integer >= 0, got 'a'"):
        schedules.SequentialLR(ours, [first, second], milestones=["a"])
    with pytest.raises(ValueError, match="SequentialLR milestones must be a list"):
        schedules.SequentialLR(ours, [first, second], milestones=3)
