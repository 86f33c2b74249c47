"""The optimizer hyperparameters a step graph takes as scalar inputs, as the Trainer holds
them: :class:`Hyperparameters` is ``trainer.hyperparameters``, the mapping a torch-style
scheduler writes between steps (as torch's write ``optimizer.param_groups[g]["lr"]``)."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import MutableMapping
from typing import Callable, Dict, Iterator, Mapping, Optional

import numpy as np
import onnx

from normgrad.errors import TrainerError

from normgrad.graphs.optimizers import HYPERPARAMETER_INPUTS as NAMES

CHECKPOINT_METADATA = "normgrad.hyperparameters"
"""Checkpoint metadata key: JSON {name: value} of the hyperparameters the next step uses (those
that follow no schedule)."""

def _number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


class Hyperparameters(MutableMapping):
    """``{name: value}`` of the hyperparameters a step graph takes (a subset of :data:`NAMES`):
    reading a name gives the value the next step uses; assigning one (checked as the step
    graph's optimizer would: TrainerError for a bad value) sets it for every later step and
    replaces a schedule the name had. The names are fixed: none is added or removed.

    A name may instead follow a schedule, ``f(step) -> value`` of the 1-based step
    (``Trainer(lr=cosine(...))``), evaluated and checked at each step."""

    def __init__(self, kind: str, values: Mapping[str, float], options: Mapping[str, object],
                 next_step: Callable[[], int]):
        self._kind = kind
        self._values: Dict[str, float] = dict(values)
        self._schedules: Dict[str, Callable[[int], float]] = {}
        self._options = dict(options)  # the structural options the rules read (nesterov, momentum buffer)
        self._next_step = next_step
        self._unusable: Dict[str, str] = {}  # name -> why its value (set while deferring) cannot be used
        self._deferring = False

    def __getitem__(self, name: str) -> float:
        if name in self._schedules:
            return self.value(name, self._next_step())
        return self._values[name]

    def __setitem__(self, name: str, value) -> None:
        self._known(name)
        try:
            self._values[name] = self._check(name, value, f"hyperparameters[{name!r}] = {value!r}")
            self._unusable.pop(name, None)
        except TrainerError as error:
            if not (self._deferring and _number(value) and math.isfinite(float(value))):
                raise
            self._values[name], self._unusable[name] = float(value), str(error)
        self._schedules.pop(name, None)

    @contextlib.contextmanager
    def deferring_checks(self) -> Iterator[None]:
        """Inside, a finite value that breaks a rule is kept and refused when a step uses it,
        not when set: torch lets a scheduler compute a value no step uses (OneCycleLR's
        learning rate after the last step, just below 0 with ``anneal_strategy="linear"``)."""
        self._deferring, before = True, self._deferring
        try:
            yield
        finally:
            self._deferring = before

    def __delitem__(self, name: str) -> None:
        raise TrainerError(f"hyperparameter {name!r} cannot be removed: the step graph takes it at every step")

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Hyperparameters({ {name: self[name] for name in self} })"

    def set(self, name: str, value) -> None:
        """A number (as assigning it) or a schedule ``f(step) -> value``."""
        self._known(name)
        if callable(value):
            self._schedules[name] = value
        else:
            self[name] = value

    def schedule(self, name: str) -> Optional[Callable[[int], float]]:
        """The schedule ``name`` follows, or None for a constant value."""
        return self._schedules.get(name)

    def value(self, name: str, step: int) -> float:
        """The checked value of ``name`` at the 1-based ``step``."""
        if name in self._unusable:
            raise TrainerError(f"step {step} cannot use {name} {self._values[name]!r}: {self._unusable[name]}")
        if name not in self._schedules:
            return self._values[name]
        returned = self._schedules[name](step)
        return self._check(name, returned, f"the {name} schedule returned {returned!r} for step {step}")

    def restore(self, saved: Mapping[str, float]) -> None:
        """The values a checkpoint saved, for the names it has and that follow no schedule (a
        value no step may use, as a scheduler left it after the last step, refused when used)."""
        with self.deferring_checks():
            for name, value in saved.items():
                if name in self._values and name not in self._schedules:
                    self[name] = value

    def _known(self, name: str) -> None:
        if name not in self._values:
            has = ", ".join(self._values)
            why = ("its optimizer has none" if name in NAMES else "not an optimizer hyperparameter")
            raise TrainerError(f"the step graph ({self._kind}) takes no hyperparameter {name!r} ({why}); it takes {has}")

    def _check(self, name: str, value, what: str) -> float:
        """``value`` as a float, refused unless ``name`` may have it (the rules of
        :func:`normgrad.graphs.optimizers.check_hyperparameters`, with the other current values)."""
        from normgrad.graphs.optimizers import check_hyperparameters

        rule = ("a learning rate must be a finite number >= 0 that float32 holds" if name == "lr"
                else "max_grad_norm must be a number > 0 (inf: no clipping)" if name == "max_grad_norm"
                else f"{name} must be a finite number")
        if not _number(value):
            raise TrainerError(f"{what}; {rule}")
        try:
            number = float(value)
        except OverflowError:  # an int beyond float64
            raise TrainerError(f"{what}; {rule}") from None
        with np.errstate(over="ignore"):
            off = name == "max_grad_norm" and number == math.inf  # clip_grad_norm_'s max_norm=inf: no clipping
            if not (off or math.isfinite(number) and np.isfinite(np.float32(number))) or (name == "lr" and number < 0):
                raise TrainerError(f"{what}; {rule}")
        # a value kept for refusal when used (see deferring_checks) is no rule for the others
        values = {**{n: v for n, v in self._values.items() if n not in self._unusable}, name: number}
        options = {n: v for n, v in values.items() if n not in ("beta1", "beta2")}
        if "beta1" in values and "beta2" in values:
            options["betas"] = (values["beta1"], values["beta2"])
        try:
            check_hyperparameters(self._kind, **options, **self._options)
        except (TypeError, ValueError) as error:
            raise TrainerError(f"{what}: {error}") from None
        if name == "momentum" and number <= 0:
            raise TrainerError(f"{what}: the step graph keeps a momentum buffer (exported with momentum > 0), so "
                               "momentum must stay > 0 (export with momentum 0 for plain SGD)")
        return number

    def feeds(self, step: int, inputs: Mapping[str, onnx.ValueInfoProto]) -> Dict[str, np.ndarray]:
        """``{name: scalar array}`` for ``step``, in each input's dtype."""
        feeds = {}
        for name in self._values:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(inputs[name].type.tensor_type.elem_type)
            feeds[name] = np.array(self.value(name, step), dtype)
        return feeds

    def saved(self) -> str:
        """The checkpoint metadata value: the values the next step uses, of the names that follow
        no schedule (a schedule is code, given again on resume; saving must not call it past
        the steps its caller planned)."""
        return json.dumps({name: value for name, value in self._values.items() if name not in self._schedules})


def graph_defaults(model: onnx.ModelProto) -> Dict[str, float]:
    """{name: default} for every hyperparameter input of a step or optimizer graph: its
    export value (:func:`normgrad.graphs.optimizers.hyperparameter_values`), not rounded to
    a float32 input's dtype."""
    from normgrad.graphs.optimizers import hyperparameter_values

    return hyperparameter_values(model)


def from_checkpoint(metadata: Mapping[str, str]) -> Dict[str, float]:
    """The hyperparameter values a checkpoint saved ({} for one written before they were saved)."""
    text = metadata.get(CHECKPOINT_METADATA)
    if text is None:
        return {}
    try:
        saved = json.loads(text)
    except ValueError:
        saved = None
    if not isinstance(saved, dict) or not all(isinstance(k, str) and _number(v) for k, v in saved.items()):
        raise TrainerError(f"checkpoint metadata {CHECKPOINT_METADATA} must be a JSON object of numbers; got {text[:80]!r}")
    return saved
