"""The Trainer's default session options (memory patterns and weight pre-packing off:
docs/explanation/performance.md has the measurements) and a user's own options kept as given."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from normgrad.graphs import build_step_graph, build_training_graph, examples
from normgrad._session import _config_entry
from normgrad.train import Trainer


def _step():
    return build_step_graph(build_training_graph(examples.mlp(), loss="mse"), "adamw")


def _batch():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((4, 5)).astype(np.float32), "labels": rng.standard_normal((4, 3)).astype(np.float32)}


def test_default_options_turn_memory_patterns_and_prepacking_off_and_train_as_the_defaults_of_onnxruntime():
    step, initial = _step()
    trainer = Trainer(step, initial, lr=0.01)
    options = trainer._step_part.session.get_session_options()
    assert not options.enable_mem_pattern
    assert _config_entry(options, "session.disable_prepacking") == "1"
    own = Trainer(step, initial, lr=0.01, session_options=ort.SessionOptions())
    assert own._step_part.session.get_session_options().enable_mem_pattern
    assert _config_entry(own._step_part.session.get_session_options(), "session.disable_prepacking") is None
    batch = _batch()
    for _ in range(3):
        assert trainer.step(**batch) == own.step(**batch)
    for name, value in own.state_dict().items():
        np.testing.assert_array_equal(trainer.state_dict()[name], value)
