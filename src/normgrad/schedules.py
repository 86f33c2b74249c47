"""Schedules of the learning rate (and the step graph's other hyperparameters).

Two kinds: plain Python functions of the 1-based optimizer step that return the learning
rate for that step (``Trainer(lr=...)`` takes one, or a number): :func:`constant`,
:func:`linear_warmup`, :func:`cosine`; and torch's scheduler classes by torch's names and
semantics (:class:`StepLR`, :class:`OneCycleLR`, :class:`ReduceLROnPlateau`, ...), which
set ``trainer.hyperparameters`` as torch's set ``optimizer.param_groups``. A trainer's
learning rate is driven by one of the two: a scheduler object refuses a trainer whose
``lr`` is a function."""

from __future__ import annotations

import bisect
import copy
import math
import numbers
import weakref
from typing import Any, Callable, Dict, Iterator, List, Mapping, MutableMapping, Optional, Sequence

from normgrad.errors import TrainerError

__all__ = ["Schedule", "constant", "linear_warmup", "cosine", "LRScheduler", "StepLR", "MultiStepLR", "ConstantLR",
           "LinearLR", "ExponentialLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts", "OneCycleLR",
           "SequentialLR", "ChainedScheduler", "ReduceLROnPlateau"]

Schedule = Callable[[int], float]


def constant(lr: float) -> Schedule:
    """lr at every step."""
    return lambda step: float(lr)


def linear_warmup(lr: float, warmup_steps: int) -> Schedule:
    """lr * step / warmup_steps for the first ``warmup_steps`` steps, then lr."""
    if warmup_steps < 1:
        raise TrainerError(f"warmup_steps must be >= 1, got {warmup_steps}")
    return lambda step: float(lr) * min(1.0, step / warmup_steps)


def cosine(lr: float, total_steps: int, warmup_steps: int = 0, min_lr: float = 0.0) -> Schedule:
    """Linear warmup over ``warmup_steps`` (if any), then cosine decay from lr to ``min_lr``
    at ``total_steps`` (min_lr after it): min_lr + (lr - min_lr) (1 + cos(pi t)) / 2, with t
    the fraction of the decay steps done."""
    if total_steps <= warmup_steps:
        raise TrainerError(f"total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps})")

    def schedule(step: int) -> float:
        if step <= warmup_steps:
            return float(lr) * step / warmup_steps
        done = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return float(min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * done)))

    return schedule


# -- torch's schedulers ----------------------------------------------------------------------
#
# Each mirrors torch.optim.lr_scheduler's class of the same name, argument for argument, with
# the trainer in place of the optimizer: ``scheduler = StepLR(trainer, step_size=30)`` sets
# ``trainer.hyperparameters["lr"]`` as torch's sets ``optimizer.param_groups[0]["lr"]``, with
# torch's arithmetic (its chainable forms on ``step()``, its closed forms where SequentialLR
# jumps), so the values are torch's. The trainer has one parameter group: ``get_last_lr()``
# is a one-element list, as torch's is for one group. ``hyperparameter=`` schedules another
# hyperparameter of the step graph (e.g. ``"weight_decay"``) the same way.

_INITIAL: "weakref.WeakKeyDictionary[object, Dict[str, float]]" = weakref.WeakKeyDictionary()
"""Per trainer, each scheduled hyperparameter's value when its first scheduler was made
(torch's ``param_group["initial_lr"]``, shared by the schedulers of one optimizer)."""


def _hyperparameters(trainer, name: str) -> MutableMapping[str, float]:
    values = getattr(trainer, "hyperparameters", None)
    if not isinstance(values, MutableMapping):
        raise TrainerError(f"a scheduler drives a Trainer (an object with a hyperparameters mapping); got {type(trainer).__name__}")
    if name not in list(values):  # (not `in values`: that evaluates a schedule function)
        raise TrainerError(f"the step graph has no hyperparameter {name!r} to schedule; it has "
                           f"{', '.join(map(repr, values)) or 'none'}")
    schedule_of = getattr(values, "schedule", None)  # Trainer.hyperparameters: a name's f(step), if it has one
    if callable(schedule_of) and schedule_of(name) is not None:
        raise TrainerError(f"the Trainer's {name} is a schedule function (Trainer({name}=f)); a scheduler object and a "
                           f"function cannot both drive {name}: give the Trainer a number and let the scheduler move it")
    return values


class LRScheduler:
    """torch's ``LRScheduler``: the base class. Making one sets the hyperparameter to its
    value at epoch 0 (torch's initial step); :meth:`step` moves it to the next epoch's."""

    def __init__(self, trainer, *, hyperparameter: str = "lr"):
        _check_hyperparameter_name(type(self).__name__, hyperparameter)
        self.trainer = trainer
        self.hyperparameter = hyperparameter
        values = _hyperparameters(trainer, hyperparameter)
        initial = _INITIAL.setdefault(trainer, {})
        initial.setdefault(hyperparameter, float(values[hyperparameter]))
        self.base_lrs = [initial[hyperparameter]]
        self.last_epoch = -1
        self._is_initial = False
        self._initial_step()

    def _initial_step(self) -> None:
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    @property
    def _lr(self) -> float:
        return float(self.trainer.hyperparameters[self.hyperparameter])

    def _set(self, name: str, value: float) -> None:
        self.trainer.hyperparameters[name] = float(value)

    def get_lr(self) -> List[float]:
        """The next value (torch's chainable form, from the current one)."""
        raise NotImplementedError

    def get_last_lr(self) -> List[float]:
        """The value the last :meth:`step` set, as a one-element list (torch's, for one group)."""
        return list(self._last_lr)

    def step(self) -> None:
        """Moves to the next epoch (or step, however often it is called): sets the
        hyperparameter to that epoch's value."""
        self._step_count += 1
        self._update_lr()

    def _update_lr(self, epoch: Optional[int] = None) -> None:
        if epoch is None:
            self.last_epoch += 1
            values = self.get_lr()
        else:
            self.last_epoch = epoch
            values = self._get_closed_form_lr() if hasattr(self, "_get_closed_form_lr") else self.get_lr()
        self._set(self.hyperparameter, values[0])
        self._last_lr = [self._lr]

    def state_dict(self) -> Dict[str, Any]:
        """Everything but the trainer (plain JSON-able values), as torch's."""
        return {key: value for key, value in self.__dict__.items() if key != "trainer"}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s values. As in torch, the hyperparameter itself is
        not set (it is the trainer's: :func:`normgrad.loop.fit` restores both)."""
        self.__dict__.update(copy.deepcopy(dict(state_dict)))


class StepLR(LRScheduler):
    """torch's ``StepLR``: multiplied by ``gamma`` every ``step_size`` epochs."""

    def __init__(self, trainer, step_size: int, gamma: float = 0.1, **kwargs):
        _check_int("StepLR step_size", step_size)
        self.step_size, self.gamma = step_size, _check_number("StepLR gamma", gamma)
        super().__init__(trainer, **kwargs)

    def get_lr(self) -> List[float]:
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return [self._lr]
        return [self._lr * self.gamma]

    def _get_closed_form_lr(self) -> List[float]:
        return [base * self.gamma ** (self.last_epoch // self.step_size) for base in self.base_lrs]


class MultiStepLR(LRScheduler):
    """torch's ``MultiStepLR``: multiplied by ``gamma`` at each milestone epoch (twice at a
    milestone given twice)."""

    def __init__(self, trainer, milestones: Sequence[int], gamma: float = 0.1, **kwargs):
        self.milestones = sorted(_check_milestones(f"{type(self).__name__} milestones", milestones))
        self.gamma = _check_number(f"{type(self).__name__} gamma", gamma)
        super().__init__(trainer, **kwargs)

    def get_lr(self) -> List[float]:
        count = self.milestones.count(self.last_epoch)
        return [self._lr * self.gamma ** count] if count else [self._lr]

    def _get_closed_form_lr(self) -> List[float]:
        return [base * self.gamma ** bisect.bisect_right(self.milestones, self.last_epoch) for base in self.base_lrs]


class ConstantLR(LRScheduler):
    """torch's ``ConstantLR``: multiplied by ``factor`` until epoch ``total_iters``."""

    def __init__(self, trainer, factor: float = 1.0 / 3, total_iters: int = 5, **kwargs):
        if not 0 < _check_number("ConstantLR factor", factor) <= 1:
            raise TrainerError(f"ConstantLR factor must be in (0, 1] (at total_iters the lr is divided by it), "
                               f"got {factor!r}")
        _check_int("ConstantLR total_iters", total_iters)
        self.factor, self.total_iters = factor, total_iters
        super().__init__(trainer, **kwargs)

    def get_lr(self) -> List[float]:
        if self.last_epoch == 0:
            return [self._lr * self.factor]
        if self.last_epoch != self.total_iters:
            return [self._lr]
        return [self._lr * (1.0 / self.factor)]

    def _get_closed_form_lr(self) -> List[float]:
        return [base * (self.factor + (self.last_epoch >= self.total_iters) * (1 - self.factor)) for base in self.base_lrs]


class LinearLR(LRScheduler):
    """torch's ``LinearLR``: the factor goes linearly from ``start_factor`` to ``end_factor``
    over ``total_iters`` epochs."""

    def __init__(self, trainer, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5, **kwargs):
        if not 0 < _check_number("LinearLR start_factor", start_factor) <= 1:
            raise TrainerError(f"LinearLR start_factor must be in (0, 1], got {start_factor!r}")
        if not 0 <= _check_number("LinearLR end_factor", end_factor) <= 1:
            raise TrainerError(f"LinearLR end_factor must be in [0, 1], got {end_factor!r}")
        _check_int("LinearLR total_iters", total_iters)
        self.start_factor, self.end_factor, self.total_iters = start_factor, end_factor, total_iters
        super().__init__(trainer, **kwargs)

    def get_lr(self) -> List[float]:
        if self.last_epoch == 0:
            return [self._lr * self.start_factor]
        if self._is_initial or self.last_epoch > self.total_iters:
            return [self._lr]
        change = self.end_factor - self.start_factor
        return [self._lr * (1.0 + change / (self.total_iters * self.start_factor + (self.last_epoch - 1) * change))]

    def _get_closed_form_lr(self) -> List[float]:
        change = self.end_factor - self.start_factor
        return [base * (self.start_factor + change * min(self.total_iters, self.last_epoch) / self.total_iters)
                for base in self.base_lrs]


class ExponentialLR(LRScheduler):
    """torch's ``ExponentialLR``: multiplied by ``gamma`` every epoch."""

    def __init__(self, trainer, gamma: float, **kwargs):
        self.gamma = _check_number(f"{type(self).__name__} gamma", gamma)
        super().__init__(trainer, **kwargs)

    def get_lr(self) -> List[float]:
        return [self._lr] if self._is_initial else [self._lr * self.gamma]

    def _get_closed_form_lr(self) -> List[float]:
        return [base * self.gamma ** self.last_epoch for base in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """torch's ``CosineAnnealingLR``: eta_min + (base - eta_min) (1 + cos(pi t / T_max)) / 2,
    in torch's chainable form (which goes on past T_max, back up)."""

    def __init__(self, trainer, T_max: int, eta_min: float = 0.0, **kwargs):
        _check_int("CosineAnnealingLR T_max", T_max)
        self.T_max, self.eta_min = T_max, _check_number("CosineAnnealingLR eta_min", eta_min)
        super().__init__(trainer, **kwargs)

    def get_lr(self) -> List[float]:
        t, period = self.last_epoch, self.T_max
        if self._is_initial:
            return [self._lr]
        if self._step_count == 1 and t > 0:
            return [self.eta_min + (base - self.eta_min) * (1 + math.cos(t * math.pi / period)) / 2 for base in self.base_lrs]
        if (t - 1 - period) % (2 * period) == 0:
            return [self._lr + (base - self.eta_min) * (1 - math.cos(math.pi / period)) / 2 for base in self.base_lrs]
        return [(1 + math.cos(math.pi * t / period)) / (1 + math.cos(math.pi * (t - 1) / period))
                * (self._lr - self.eta_min) + self.eta_min]

    def _get_closed_form_lr(self) -> List[float]:
        return [self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2
                for base in self.base_lrs]


class CosineAnnealingWarmRestarts(LRScheduler):
    """torch's ``CosineAnnealingWarmRestarts``: cosine annealing restarted after ``T_0``
    epochs, each period ``T_mult`` times the last."""

    def __init__(self, trainer, T_0: int, T_mult: int = 1, eta_min: float = 0.0, **kwargs):
        _check_int("CosineAnnealingWarmRestarts T_0", T_0)
        _check_int("CosineAnnealingWarmRestarts T_mult", T_mult)
        self.T_0, self.T_i, self.T_mult = T_0, T_0, T_mult
        self.eta_min = _check_number("CosineAnnealingWarmRestarts eta_min", eta_min)
        self.T_cur = -1
        super().__init__(trainer, **kwargs)

    def get_lr(self) -> List[float]:
        return [self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * self.T_cur / self.T_i)) / 2
                for base in self.base_lrs]

    def step(self) -> None:
        self._step_count += 1
        if self.last_epoch < 0:
            self.T_cur = 0
            self.last_epoch = 0
        else:
            self.last_epoch += 1
            self.T_cur += 1
            if self.T_cur >= self.T_i:
                self.T_cur %= self.T_i
                self.T_i *= self.T_mult
        self._set(self.hyperparameter, self.get_lr()[0])
        self._last_lr = [self._lr]


class OneCycleLR(LRScheduler):
    """torch's ``OneCycleLR`` (called once per optimizer step): the learning rate rises from
    ``max_lr / div_factor`` to ``max_lr`` over ``pct_start`` of ``total_steps`` (or ``epochs
    * steps_per_epoch``) and anneals to ``initial / final_div_factor``; with
    ``cycle_momentum``, beta1 (Adam, AdamW) or momentum (SGD) cycles the other way between
    ``max_momentum`` and ``base_momentum``."""

    def __init__(self, trainer, max_lr: float, total_steps: Optional[int] = None, epochs: Optional[int] = None,
                 steps_per_epoch: Optional[int] = None, pct_start: float = 0.3, anneal_strategy: str = "cos",
                 cycle_momentum: bool = True, base_momentum: float = 0.85, max_momentum: float = 0.95,
                 div_factor: float = 25.0, final_div_factor: float = 1e4, three_phase: bool = False, **kwargs):
        if total_steps is None:
            if epochs is None or steps_per_epoch is None:
                raise TrainerError("OneCycleLR needs total_steps, or epochs and steps_per_epoch")
            _check_int("OneCycleLR epochs", epochs)
            _check_int("OneCycleLR steps_per_epoch", steps_per_epoch)
            total_steps = epochs * steps_per_epoch
        _check_int("OneCycleLR total_steps", total_steps)
        for option, value in (("max_lr", max_lr), ("base_momentum", base_momentum), ("max_momentum", max_momentum)):
            _check_number(f"OneCycleLR {option}", value)
        for option, value in (("div_factor", div_factor), ("final_div_factor", final_div_factor)):
            if _check_number(f"OneCycleLR {option}", value) == 0:
                raise TrainerError(f"OneCycleLR {option} must be > 0, got {value!r}")
        if not 0 <= _check_number("OneCycleLR pct_start", pct_start) <= 1:
            raise TrainerError(f"OneCycleLR pct_start must be between 0 and 1, got {pct_start!r}")
        _check_choice("OneCycleLR anneal_strategy", anneal_strategy, ("cos", "linear"))
        _check_bool("OneCycleLR cycle_momentum", cycle_momentum)
        _check_bool("OneCycleLR three_phase", three_phase)
        self.total_steps, self.anneal_strategy, self.cycle_momentum = total_steps, anneal_strategy, cycle_momentum
        name = kwargs.get("hyperparameter", "lr")
        self.values = {"initial": max_lr / div_factor, "max": float(max_lr),
                       "min": max_lr / div_factor / final_div_factor,
                       "max_momentum": float(max_momentum), "base_momentum": float(base_momentum)}
        up, down = float(pct_start * total_steps) - 1, float(2 * pct_start * total_steps) - 2
        self.phases = ([[up, "initial", "max", "max_momentum", "base_momentum"],
                        [down, "max", "initial", "base_momentum", "max_momentum"],
                        [total_steps - 1, "initial", "min", "max_momentum", "max_momentum"]] if three_phase else
                       [[up, "initial", "max", "max_momentum", "base_momentum"],
                        [total_steps - 1, "max", "min", "base_momentum", "max_momentum"]])
        _check_phases(self.phases, total_steps, pct_start)
        values = _hyperparameters(trainer, name)
        self.momentum = None
        if cycle_momentum:
            self.momentum = next((m for m in ("beta1", "momentum") if m in list(values)), None)
            if self.momentum is None:
                raise TrainerError("OneCycleLR(cycle_momentum=True) needs beta1 (Adam, AdamW) or momentum (SGD) among "
                                   f"the step graph's hyperparameters, which are {', '.join(map(repr, values))}; "
                                   "pass cycle_momentum=False to cycle the learning rate only")
            _hyperparameters(trainer, self.momentum)
            values[self.momentum] = float(max_momentum)
        _INITIAL.setdefault(trainer, {})[name] = self.values["initial"]
        super().__init__(trainer, **kwargs)

    def _anneal(self, start: float, end: float, pct: float) -> float:
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def get_lr(self) -> List[float]:
        step = self.last_epoch
        if step > self.total_steps:
            raise TrainerError(f"OneCycleLR stepped {step} times; its total_steps is {self.total_steps}")
        start = 0.0
        for i, (end, lr_from, lr_to, momentum_from, momentum_to) in enumerate(self.phases):
            if step <= end or i == len(self.phases) - 1:
                pct = (step - start) / (end - start)
                if self.momentum is not None:
                    self._set(self.momentum, self._anneal(self.values[momentum_from], self.values[momentum_to], pct))
                return [self._anneal(self.values[lr_from], self.values[lr_to], pct)]
            start = end
        raise AssertionError("unreachable")


class SequentialLR(LRScheduler):
    """torch's ``SequentialLR``: ``schedulers[i]`` from milestone ``i - 1`` on (each started
    afresh, at its epoch 0, on reaching its milestone)."""

    def __init__(self, trainer, schedulers: Sequence[LRScheduler], milestones: Sequence[int]):
        _check_schedulers(self, trainer, schedulers)
        milestones = _check_milestones("SequentialLR milestones", milestones)
        if len(milestones) != len(schedulers) - 1:
            raise TrainerError(f"SequentialLR takes one milestone fewer than schedulers; got {len(schedulers)} "
                               f"schedulers and {len(milestones)} milestones")
        if milestones != sorted(milestones):
            raise TrainerError(f"SequentialLR milestones must be in increasing order, got {milestones!r}")
        self.trainer, self._schedulers, self._milestones = trainer, list(schedulers), milestones
        self.hyperparameter = schedulers[0].hyperparameter
        self.last_epoch = 0
        self._set(self.hyperparameter, _INITIAL[trainer][self.hyperparameter])
        for scheduler in _leaves(self):
            scheduler.last_epoch -= 1
        first = self._schedulers[bisect.bisect_right(self._milestones, 0)]
        first._initial_step()
        self._last_lr = first.get_last_lr()

    def step(self) -> None:
        self.last_epoch += 1
        index = bisect.bisect_right(self._milestones, self.last_epoch)
        scheduler = self._schedulers[index]
        if index > 0 and self._milestones[index - 1] == self.last_epoch:
            scheduler._update_lr(0)
        else:
            scheduler.step()
        self._last_lr = scheduler.get_last_lr()

    def state_dict(self) -> Dict[str, Any]:
        state = {key: value for key, value in self.__dict__.items() if key not in ("trainer", "_schedulers")}
        return {**copy.deepcopy(state), "_schedulers": [s.state_dict() for s in self._schedulers]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = dict(state_dict)
        inner = state.pop("_schedulers")
        self.__dict__.update(copy.deepcopy(state))
        for scheduler, saved in zip(self._schedulers, inner):
            scheduler.load_state_dict(saved)


class ChainedScheduler(SequentialLR):
    """torch's ``ChainedScheduler``: every scheduler's :meth:`step` at each step, their
    factors compounding."""

    def __init__(self, schedulers: Sequence[LRScheduler], trainer=None):
        trainer = trainer if trainer is not None else (schedulers[0].trainer if schedulers else None)
        _check_schedulers(self, trainer, schedulers)
        self.trainer, self._schedulers = trainer, list(schedulers)
        self.hyperparameter = schedulers[0].hyperparameter
        self._last_lr = [self._lr]

    def step(self) -> None:
        for scheduler in self._schedulers:
            scheduler.step()
        self._last_lr = [self._lr]


class ReduceLROnPlateau(LRScheduler):
    """torch's ``ReduceLROnPlateau``: ``step(metric)`` after each evaluation; after more than
    ``patience`` evaluations without an improvement beyond ``threshold`` the value is
    multiplied by ``factor`` (not below ``min_lr``), then ``cooldown`` evaluations pass
    before counting again."""

    def __init__(self, trainer, mode: str = "min", factor: float = 0.1, patience: int = 10, threshold: float = 1e-4,
                 threshold_mode: str = "rel", cooldown: int = 0, min_lr: float = 0.0, eps: float = 1e-8,
                 *, hyperparameter: str = "lr"):
        for option, value in (("threshold", threshold), ("min_lr", min_lr), ("eps", eps)):
            _check_number(f"ReduceLROnPlateau {option}", value)
        if _check_number("ReduceLROnPlateau factor", factor) >= 1.0:
            raise TrainerError(f"ReduceLROnPlateau factor must be < 1, got {factor!r}")
        _check_choice("ReduceLROnPlateau mode", mode, ("min", "max"))
        _check_choice("ReduceLROnPlateau threshold_mode", threshold_mode, ("rel", "abs"))
        _check_int("ReduceLROnPlateau patience", patience, minimum=0)
        _check_int("ReduceLROnPlateau cooldown", cooldown, minimum=0)
        _check_hyperparameter_name("ReduceLROnPlateau", hyperparameter)
        _hyperparameters(trainer, hyperparameter)
        self.trainer, self.hyperparameter = trainer, hyperparameter
        self.mode, self.factor, self.patience, self.threshold = mode, factor, patience, threshold
        self.threshold_mode, self.cooldown, self.min_lr, self.eps = threshold_mode, cooldown, min_lr, eps
        self.last_epoch = 0
        self._last_lr = [self._lr]
        self.best = math.inf if mode == "min" else -math.inf
        self.cooldown_counter = 0
        self.num_bad_epochs = 0

    def _is_better(self, value: float) -> bool:
        if self.mode == "min":
            return value < (self.best * (1.0 - self.threshold) if self.threshold_mode == "rel" else self.best - self.threshold)
        return value > (self.best * (self.threshold + 1.0) if self.threshold_mode == "rel" else self.best + self.threshold)

    def step(self, metrics: float) -> None:  # type: ignore[override]
        """One evaluation's monitored value (e.g. the validation loss)."""
        current = float(metrics)
        self.last_epoch += 1
        if self._is_better(current):
            self.best, self.num_bad_epochs = current, 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs > self.patience:
            old = self._lr
            new = max(old * self.factor, self.min_lr)
            if old - new > self.eps:
                self._set(self.hyperparameter, new)
            self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        self._last_lr = [self._lr]


def _check_number(name: str, value, minimum: float = 0.0) -> float:
    """``value`` as a float, refused unless a finite number >= ``minimum`` (not a bool): a
    scheduler's factors and bounds are checked when it is made, not at its first step."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < minimum:
        raise TrainerError(f"{name} must be a finite number >= {minimum:g}, got {value!r}")
    return float(value)


def _check_int(name: str, value, minimum: int = 1) -> int:
    """``value``, refused unless an integer >= ``minimum`` (not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise TrainerError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TrainerError(f"{name} must be True or False, got {value!r}")


def _check_choice(name: str, value, choices: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise TrainerError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _check_hyperparameter_name(kind: str, name) -> None:
    if not isinstance(name, str):
        raise TrainerError(f"{kind} hyperparameter must be a name (a string), got {name!r}")


def _check_milestones(name: str, milestones) -> List[int]:
    """``milestones`` as a list, refused unless a list or tuple of integers >= 0."""
    if not isinstance(milestones, (list, tuple)):
        raise TrainerError(f"{name} must be a list of integers >= 0 (epochs), got {milestones!r}")
    return [_check_int(f"{name}[{i}]", m, minimum=0) for i, m in enumerate(milestones)]


def _check_phases(phases: Sequence[list], total_steps: int, pct_start: float) -> None:
    """Refuses a OneCycleLR phase of no width that a step reaches (torch's divides by its
    width): the first when pct_start * total_steps is 1, the last when it ends where the
    one before does (pct_start 1; three_phase: 2 pct_start total_steps = total_steps + 1)."""
    names = ["warm-up", "cool-down", "annealing"] if len(phases) == 3 else ["warm-up", "annealing"]
    start = 0.0
    for i, (end, *_) in enumerate(phases):
        reached = i == 0 or i == len(phases) - 1  # a middle phase of no width is passed over
        if end == start and reached:
            raise TrainerError(f"OneCycleLR(total_steps={total_steps}, pct_start={pct_start!r}): its {names[i]} phase "
                               f"has no steps (it starts and ends at step {end:g}); choose pct_start and total_steps "
                               f"with pct_start * total_steps != 1" + (" and pct_start < 1" if len(phases) == 2 else
                                                                        " and 2 * pct_start * total_steps != total_steps + 1"))
        start = end


def _check_schedulers(owner, trainer, schedulers: Sequence[LRScheduler]) -> None:
    kind = type(owner).__name__
    if not schedulers:
        raise TrainerError(f"{kind} needs at least one scheduler")
    for i, scheduler in enumerate(schedulers):
        if isinstance(scheduler, ReduceLROnPlateau):
            raise TrainerError(f"{kind} cannot hold ReduceLROnPlateau (schedulers[{i}]): its step takes the metric")
        if scheduler.trainer is not trainer:
            raise TrainerError(f"{kind}: schedulers[{i}] drives another trainer")
        if scheduler.hyperparameter != schedulers[0].hyperparameter:
            raise TrainerError(f"{kind}: schedulers[{i}] schedules {scheduler.hyperparameter!r}, "
                               f"schedulers[0] {schedulers[0].hyperparameter!r}")


def _leaves(scheduler) -> Iterator[LRScheduler]:
    for inner in getattr(scheduler, "_schedulers", ()):
        yield from (_leaves(inner) if hasattr(inner, "_schedulers") else [inner])
