"""Runs the Trainer features over saved batches; imported by tests/test_trainer_features.py
and run as a script by the Python of another onnxruntime (NORMGRAD_OLD_ORT_PYTHON), so both
runtimes are checked against the same torch reference:

    python _features_runner.py STEP.onnx START.ckpt BATCHES.npz OUT.npz [ACCUMULATION]

BATCHES.npz holds ``x``, ``labels`` (one row per step), ``lr`` (per step), ``eval_x`` and
``eval_labels``. Trains with :meth:`Trainer.steps` over dict batches, asking for the
forward output ``logits`` at every step, then evaluates one batch. Writes OUT.npz: the
losses, the step outputs ``logits`` [steps, batch, ...], ``state/NAME`` after the steps,
``eval_loss`` and ``eval_logits``; fails when evaluate changed any state tensor.
"""

import sys

import numpy as np


def run(step_path, checkpoint_path, batches_path, out_path, accumulation=1):
    from normgrad.train import Trainer

    batches = np.load(batches_path)
    lrs = batches["lr"]
    trainer = Trainer(step_path, checkpoint_path, lr=lambda step: float(lrs[step - 1]), accumulation=int(accumulation))
    feeds = [{"x": x, "labels": labels} for x, labels in zip(batches["x"], batches["labels"])]
    results = list(trainer.steps(feeds, outputs=["logits"]))
    assert [r.step for r in results] == list(range(1, len(feeds) + 1)), [r.step for r in results]
    state = trainer.state_dict()
    evaluation = trainer.evaluate({"x": batches["eval_x"], "labels": batches["eval_labels"]})
    after = trainer.state_dict()
    changed = [name for name in state if state[name].tobytes() != after[name].tobytes()]
    assert not changed and trainer.step_count == len(feeds), f"evaluate changed {changed}"
    np.savez(out_path, losses=np.array([r.loss for r in results]), logits=np.stack([r.outputs["logits"] for r in results]),
             eval_loss=np.array(evaluation.loss), eval_logits=evaluation.outputs["logits"],
             **{f"state/{name}": value for name, value in state.items()})
    return trainer


if __name__ == "__main__":
    run(*sys.argv[1:5], *sys.argv[5:])
    import onnxruntime

    print(onnxruntime.__version__)
