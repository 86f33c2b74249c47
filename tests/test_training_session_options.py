"""The Trainer's default session options (memory patterns off: docs/explanation/performance.md
has the measurements) and a user's own options kept as given."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from normgrad.graphs import build_step_graph, build_training_graph, examples
from normgrad.train import Trainer


def _step():
    return build_step_graph(build_training_graph(examples.mlp(), loss="mse"), "adamw")


def _batch():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((4, 5)).astype(np.float32), "labels": rng.standard_normal((4, 3)).astype(np.float32)}


def test_default_options_turn_memory_patterns_off_and_train_as_the_defaults_of_onnxruntime():
    step, initial = _step()
    trainer = Trainer(step, initial, lr=0.01)
    assert not trainer._step_part.session.get_session_options().enable_mem_pattern
    own = Trainer(step, initial, lr=0.01, session_options=ort.SessionOptions())
    assert own._step_part.session.get_session_options().enable_mem_pattern
    batch = _batch()
    for _ in range(3):
        assert trainer.step(**batch) == own.step(**batch)
    for name, value in own.state_dict().items():
        np.testing.assert_array_equal(trainer.state_dict()[name], value)
