"""Optimizer hyperparameters at run time (issue 34): ``trainer.hyperparameters``, the mapping
a torch-style scheduler writes between steps, and ``Trainer(lr=..., weight_decay=..., ...)``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from normgrad.train import Trainer, TrainerError
from test_trainer_trust import _mse_batch, _options, _step


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
    assert dict(trainer.hyperparameters) == {"lr": 0.5}


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
