"""``normgrad train``: train one's own step graph on arrays, or (no STEP) a small CNN on
scikit-learn's bundled digits in plain onnxruntime.

``normgrad train STEP.onnx --data train.npz [--eval val.npz]`` trains a step graph written by
``normgrad export --optimizer`` (initial state: ``STEP.ckpt`` beside it) with
:func:`normgrad.loop.fit`: epochs of shuffled batches, evaluation with metrics, early stopping,
a torch scheduler, checkpoints in ``--checkpoint-dir`` (``--resume`` continues from the
latest), logs (CSV, TensorBoard, PNG) and the inference model in ``--out``. The arrays
(``.npz``, or ``NAME.npy`` / ``NAME=FILE.npy`` files) are named as the graph's data inputs.

Without STEP (also ``normgrad demo train``), the built-in example, the whole path of the
README's walk-through with nothing downloaded: a forward ONNX model
built in code (:func:`normgrad.graphs.examples.digits_cnn`: Conv-BatchNorm-ReLU-MaxPool
twice, then Gemm), its step graph (cross-entropy loss, AdamW), and
:class:`normgrad.train.Trainer` with a cosine schedule; after each epoch the inference
model (BatchNorm in inference mode, running statistics) is scored on held-out digits.
Writes the step graph, the final checkpoint, the inference model and a PNG of the loss and
accuracy curves to ``--out``. Needs the ``train`` extra (scikit-learn; tqdm and matplotlib
are used when installed).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from normgrad.tools._train_step import (_STEP_ONLY, DEFAULT_BATCH_SIZE, HelpFormatter, _add_step_arguments,
                                        _train_step_graph, check_arrays, load_arrays, parse_scheduler, session_options)
from normgrad.tools.cli import (ArgumentParser, CommandError, apply_config, non_negative_int, positive_float,
                                positive_int)

__all__ = ["main", "load_digits", "accuracy", "load_arrays", "check_arrays", "parse_scheduler"]


def load_digits(seed: int, test_fraction: float = 0.2):
    """scikit-learn's 1797 8x8 digits as float32 [N, 1, 8, 8] in [0, 1] and int64 labels,
    split at random (``seed``) into train and test sets."""
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    images = (data.images / 16.0).astype(np.float32)[:, None]
    labels = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    test = order[: int(round(len(labels) * test_fraction))]
    train = order[len(test):]
    return images[train], labels[train], images[test], labels[test]


def accuracy(model, images: np.ndarray, labels: np.ndarray) -> float:
    """The fraction of ``images`` an inference model (ModelProto) classifies as ``labels``."""
    import onnxruntime

    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {session.get_inputs()[0].name: images})
    return float(np.mean(logits.argmax(axis=1) == labels))


def _plot(losses: List[float], steps_per_epoch: int, accuracies: List[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from normgrad.util.files import write_bytes_atomic

    figure, (left, right) = plt.subplots(1, 2, figsize=(8, 3), dpi=90)
    steps = np.arange(1, len(losses) + 1)
    left.plot(steps, losses, color="#9ecae1", linewidth=0.8, label="step")
    epoch_means = np.array(losses).reshape(-1, steps_per_epoch).mean(axis=1)
    left.plot(np.arange(1, len(epoch_means) + 1) * steps_per_epoch, epoch_means, color="#08519c", marker="o",
              markersize=3, label="epoch mean")
    left.set(xlabel="optimizer step", ylabel="cross-entropy loss", yscale="log", title="training loss")
    left.legend(frameon=False)
    epochs = np.arange(1, len(accuracies) + 1)
    right.plot(epochs, np.array(accuracies) * 100, color="#a63603", marker="o", markersize=3)
    right.axhline(95, color="gray", linestyle=":", linewidth=1)
    right.set(xlabel="epoch", ylabel="accuracy (%)", title="held-out accuracy (inference model)")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    write_bytes_atomic(path, buffer.getvalue())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``normgrad train``; returns the exit code (1: bad data or options, a
    file it cannot read or write, scikit-learn missing for the demo; 2: usage)."""
    parser = ArgumentParser(prog="normgrad train", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("step", nargs="?", metavar="STEP", help="a step graph (normgrad export --optimizer); "
                        "none: the digits demo")
    parser.add_argument("--epochs", type=positive_int, default=12, help="passes over the training data")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="samples per optimizer step; a STEP exported with a fixed batch takes that batch, the "
                        f"remainder of each epoch left out (default: {DEFAULT_BATCH_SIZE})")
    parser.add_argument("--lr", type=positive_float, default=argparse.SUPPRESS,
                        help="learning rate (default: the step graph's; for the digits demo 0.003, the peak of its "
                        "cosine schedule)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="the shuffling (and the demo's weights and data split)")
    parser.add_argument("--out", default="normgrad-train", help="folder for the logs, plot and models")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="onnxruntime's intra-op threads (default: onnxruntime's, one per core)")
    parser.add_argument("--config", metavar="FILE", help="the options from a .toml, .yaml or .json file: each flag by "
                        "its name (batch-size = 64, betas = [0.9, 0.99], resume = true; step = the STEP graph); "
                        "flags on the command line override it")
    _add_step_arguments(parser)
    try:
        apply_config(parser, argv)
    except CommandError as error:
        print(f"normgrad train: {error}", file=sys.stderr)
        return 1
    args = parser.parse_args(argv)
    for flag, folder in (("--out", args.out), ("--checkpoint-dir", args.checkpoint_dir)):
        if folder is not None and os.path.exists(folder) and not os.path.isdir(folder):  # refused before training
            print(f"normgrad train: {flag} {folder} is a file, not a folder", file=sys.stderr)
            return 1
    if args.step is not None:
        return _train_step_graph(parser, args)
    return _train_digits(parser, args)


def _train_digits(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The digits demo: a small CNN on scikit-learn's digits, its step graph, a cosine schedule."""
    given = [flag for flag, default in _STEP_ONLY.items() if getattr(args, flag.lstrip("-").replace("-", "_")) != default]
    if given:
        parser.error(f"{given[0]} needs a STEP graph (the digits demo takes --epochs, --batch-size, --lr, --seed, --out)")
    args.lr = getattr(args, "lr", 3e-3)
    args.batch_size = args.batch_size or DEFAULT_BATCH_SIZE
    try:
        images, labels, test_images, test_labels = load_digits(args.seed)
    except ImportError:
        print("normgrad train: needs scikit-learn for its bundled digits: pip install 'normgrad[train]'", file=sys.stderr)
        return 1
    import normgrad.train as train
    from normgrad.util.files import save_model_atomic
    from normgrad.graphs import build_step_graph, build_training_graph, examples

    started = time.perf_counter()
    forward = examples.digits_cnn(seed=args.seed)
    step_model, initial = build_step_graph(build_training_graph(forward, loss="cross_entropy"), "adamw",
                                           weight_decay=1e-4)
    steps_per_epoch = len(labels) // args.batch_size
    if steps_per_epoch < 1:
        parser.error(f"--batch-size {args.batch_size} exceeds the {len(labels)} training images")
    total = steps_per_epoch * args.epochs
    warmup = min(steps_per_epoch, total - 1)
    trainer = train.Trainer(step_model, initial, lr=train.cosine(args.lr, total, warmup_steps=warmup),
                            session_options=session_options(args.threads, step_model))
    print(f"training the digits CNN with AdamW: lr {args.lr:g} (the peak of a cosine schedule after {warmup} warm-up "
          f"steps), weight_decay {trainer.hyperparameters['weight_decay']:g}; batch size {args.batch_size}, "
          f"{args.epochs} epochs", flush=True)
    try:
        from tqdm import tqdm

        progress = tqdm(total=total, unit="step", desc="normgrad train", leave=True)
    except ImportError:
        progress = None
        print("(tqdm is not installed: one line per epoch instead of a progress bar)")
    rng = np.random.default_rng(args.seed + 1)
    losses: List[float] = []
    accuracies: List[float] = []
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(labels))
        for k in range(steps_per_epoch):
            batch = order[k * args.batch_size:(k + 1) * args.batch_size]
            losses.append(trainer.step(images[batch], labels[batch]))
            if progress is not None:
                progress.update(1)
        accuracies.append(accuracy(trainer.inference_model(), test_images, test_labels))
        summary: Dict[str, str] = {"epoch": str(epoch), "loss": f"{np.mean(losses[-steps_per_epoch:]):.4f}",
                                   "test accuracy": f"{accuracies[-1]:.1%}"}
        if progress is not None:
            progress.set_postfix(summary)
        else:
            print("  ".join(f"{key} {value}" for key, value in summary.items()))
    if progress is not None:
        progress.close()
    elapsed = time.perf_counter() - started
    try:
        os.makedirs(args.out, exist_ok=True)
        paths = {name: os.path.join(args.out, name) for name in
                 ("digits_step.onnx", "digits.ckpt", "digits_inference.onnx", "digits_training.png")}
        save_model_atomic(step_model, paths["digits_step.onnx"])
        trainer.save(paths["digits.ckpt"])
        trainer.export_inference_model(paths["digits_inference.onnx"])
        try:
            _plot(losses, steps_per_epoch, accuracies, paths["digits_training.png"])
        except ImportError:
            del paths["digits_training.png"]
            print("(matplotlib is not installed: no PNG of the curves)")
    except OSError as error:
        print(f"normgrad train: cannot write to {args.out}: {error.strerror or error}", file=sys.stderr)
        return 1
    print(f"{len(labels)} training / {len(test_labels)} test digits, {total} AdamW steps of {args.batch_size} in "
          f"{elapsed:.1f} s: test accuracy {accuracies[-1]:.1%} (best {max(accuracies):.1%}), "
          f"final loss {np.mean(losses[-steps_per_epoch:]):.4f}")
    print(f"wrote {', '.join(paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
