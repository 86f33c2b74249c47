"""Runs a Trainer over saved batches; imported by tests/test_train.py and run as a script
by the Python of another onnxruntime (NORMGRAD_OLD_ORT_PYTHON), so both runtimes train the
same way:

    python _train_runner.py STEP.onnx START.ckpt BATCHES.npz OUT_FOLDER [ACCUMULATION]

BATCHES.npz holds ``x``, ``labels`` (one row per step) and ``lr`` (per step). Writes
OUT_FOLDER/final.ckpt (the state after the last step), OUT_FOLDER/losses.npy and
OUT_FOLDER/inference.onnx.
"""

import os
import sys

import numpy as np


def run(step_path, checkpoint_path, batches_path, out, accumulation=1):
    from normgrad.train import Trainer

    batches = np.load(batches_path)
    lrs = batches["lr"]
    trainer = Trainer(step_path, checkpoint_path, lr=lambda step: float(lrs[step - 1]), accumulation=accumulation)
    losses = [trainer.step(x, labels) for x, labels in zip(batches["x"][trainer.step_count:],
                                                            batches["labels"][trainer.step_count:])]
    trainer.save(os.path.join(out, "final.ckpt"))
    np.save(os.path.join(out, "losses.npy"), np.array(losses))
    trainer.export_inference_model(os.path.join(out, "inference.onnx"))
    return trainer


if __name__ == "__main__":
    run(*sys.argv[1:5], *(int(a) for a in sys.argv[5:]))
    import onnxruntime

    print(onnxruntime.__version__)
