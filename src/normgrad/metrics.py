"""Evaluation over a whole validation set, and the metrics :func:`normgrad.loop.fit` reports.

A metric is a plain function ``f(outputs, labels) -> float`` of a forward output (e.g. the
logits) and the labels of the whole validation set: :func:`accuracy`,
:func:`top_k_accuracy`, :func:`f1_macro`, :func:`f1_micro`, :func:`perplexity`, or one's own. The class axis of ``outputs`` is
axis 1 (ONNX's and torch's cross-entropy layout, ``[N, C]`` or ``[N, C, d1, ...]``) or the
last axis (``[N, T, C]``, a language model's logits), whichever leaves the labels' shape;
labels below 0 (torch's ``ignore_index`` -100) are left out.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Mapping, Optional

import numpy as np

from normgrad.errors import TrainerError

__all__ = ["Metric", "accuracy", "top_k_accuracy", "f1_macro", "f1_micro", "perplexity", "evaluate", "named_batch"]

Metric = Callable[[np.ndarray, np.ndarray], float]


def _scores(outputs: np.ndarray, labels: np.ndarray):
    """``outputs`` as [samples, C] and the labels flat, the ignored (< 0) left out."""
    outputs, labels = np.asarray(outputs), np.asarray(labels)
    if outputs.ndim == labels.ndim + 1 and outputs.shape[:1] + outputs.shape[2:] == labels.shape:
        scores = np.moveaxis(outputs, 1, -1)
    elif outputs.ndim == labels.ndim + 1 and outputs.shape[:-1] == labels.shape:
        scores = outputs
    else:
        raise TrainerError(f"a classification metric takes outputs [N, C, ...] or [..., C] with labels of the other "
                           f"axes; got outputs {list(outputs.shape)} and labels {list(labels.shape)}")
    scores, labels = scores.reshape(-1, scores.shape[-1]), labels.reshape(-1)
    kept = labels >= 0
    if not kept.any():
        raise TrainerError("every label is ignored (< 0): no sample to score")
    return scores[kept], labels[kept].astype(np.int64)


def accuracy(outputs: np.ndarray, labels: np.ndarray) -> float:
    """The fraction of samples whose highest-scoring class is the label."""
    scores, labels = _scores(outputs, labels)
    return float(np.mean(scores.argmax(axis=1) == labels))


def top_k_accuracy(k: int) -> Metric:
    """A metric: the fraction of samples whose label is among the ``k`` highest-scoring
    classes (ties with the k-th score counted in)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise TrainerError(f"top_k_accuracy takes an integer k >= 1, got {k!r}")

    def top_k(outputs: np.ndarray, labels: np.ndarray) -> float:
        scores, labels = _scores(outputs, labels)
        label_scores = scores[np.arange(len(labels)), labels]
        return float(np.mean((scores > label_scores[:, None]).sum(axis=1) < k))

    top_k.__name__ = f"top{k}_accuracy"
    return top_k


def _f1_counts(outputs: np.ndarray, labels: np.ndarray):
    """Per class, of the classes that are a label or a prediction: true positives, false
    positives, false negatives of the highest-scoring class."""
    scores, labels = _scores(outputs, labels)
    predicted = scores.argmax(axis=1)
    classes = np.union1d(labels, predicted)
    true_positives = np.array([np.sum((predicted == c) & (labels == c)) for c in classes], np.float64)
    false_positives = np.array([np.sum((predicted == c) & (labels != c)) for c in classes], np.float64)
    false_negatives = np.array([np.sum((predicted != c) & (labels == c)) for c in classes], np.float64)
    return true_positives, false_positives, false_negatives


def f1_macro(outputs: np.ndarray, labels: np.ndarray) -> float:
    """The F1 score of each class (2 TP / (2 TP + FP + FN), of the highest-scoring class),
    averaged over the classes that are a label or a prediction: scikit-learn's
    ``f1_score(labels, predictions, average="macro")``."""
    tp, fp, fn = _f1_counts(outputs, labels)
    return float(np.mean(2 * tp / (2 * tp + fp + fn)))


def f1_micro(outputs: np.ndarray, labels: np.ndarray) -> float:
    """The F1 score of the counts summed over the classes: scikit-learn's ``f1_score(labels,
    predictions, average="micro")`` (for one label per sample, the accuracy)."""
    tp, fp, fn = (counts.sum() for counts in _f1_counts(outputs, labels))
    return float(2 * tp / (2 * tp + fp + fn))


def perplexity(outputs: np.ndarray, labels: np.ndarray) -> float:
    """exp of the mean cross-entropy of the logits ``outputs`` at the labels (float64)."""
    scores, labels = _scores(outputs, labels)
    scores = scores.astype(np.float64)
    top = scores.max(axis=1, keepdims=True)
    log_normalizer = top[:, 0] + np.log(np.exp(scores - top).sum(axis=1))
    return float(np.exp(np.mean(log_normalizer - scores[np.arange(len(labels)), labels])))


def named_batch(trainer, batch) -> Dict[str, np.ndarray]:
    """A batch as :meth:`Trainer.step` takes it (a tuple or list in ``trainer.data_inputs``
    order, a dict, or one array) -> ``{input name: array}``."""
    if isinstance(batch, Mapping):
        return {name: np.asarray(value) for name, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        if len(batch) > len(trainer.data_inputs):
            raise TrainerError(f"a batch holds {len(trainer.data_inputs)} arrays ({', '.join(trainer.data_inputs)}); "
                               f"got {len(batch)}")
        return {name: np.asarray(value) for name, value in zip(trainer.data_inputs, batch)}
    return {trainer.data_inputs[0]: np.asarray(batch)}


def evaluate(trainer, batches: Iterable, metrics: Optional[Mapping[str, Metric]] = None, *, output: Optional[str] = None,
             labels: str = "labels", prefix: str = "val_") -> Dict[str, float]:
    """The loss and ``metrics`` of a whole validation set, evaluated batch by batch with
    :meth:`Trainer.evaluate` (eval mode, no update): ``{prefix + "loss": ..., prefix + name:
    ...}``. The loss is the mean of the batches' losses weighted by their sizes (axis 0);
    each metric is computed once, on ``output`` (default: the loss's forward output, e.g.
    the logits) and the ``labels`` input of every batch concatenated along axis 0. On a
    data-parallel trainer each rank passes its shard of the validation set and gets the
    record of all the shards together (concatenated in rank order)."""
    metrics = dict(metrics or {})
    if metrics and output is None:
        output = getattr(trainer, "_loss_metadata", {}).get("output")
        if output is None:
            raise TrainerError("evaluate: name the forward output the metrics take (output=...); the step graph's "
                               "loss names none")
    total, count = 0.0, 0
    outputs, label_values = [], []
    for batch in batches:
        named = named_batch(trainer, batch)
        if metrics and labels not in named:
            raise TrainerError(f"evaluate: the metrics need the batch input {labels!r}; the batch has "
                               f"{', '.join(map(repr, named))}")
        result = trainer.evaluate(named, outputs=[output] if metrics else [])
        size = len(next(iter(named.values())))
        total += result.loss * size
        count += size
        if metrics:
            outputs.append(result.outputs[output])
            label_values.append(named[labels])
    from_every_rank = getattr(trainer, "from_every_rank", None)
    if from_every_rank is not None:  # a data-parallel trainer: each rank evaluated its shard
        shards = from_every_rank((total, count, outputs, label_values), "the evaluation")
        total, count = sum(shard[0] for shard in shards), sum(shard[1] for shard in shards)
        outputs = [array for shard in shards for array in shard[2]]
        label_values = [array for shard in shards for array in shard[3]]
    if count == 0:
        raise TrainerError("evaluate: the validation batches yielded no batch")
    record = {prefix + "loss": total / count}
    if metrics:
        all_outputs, all_labels = np.concatenate(outputs), np.concatenate(label_values)
        for name, metric in metrics.items():
            record[prefix + name] = float(metric(all_outputs, all_labels))
    return record
