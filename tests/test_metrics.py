"""normgrad.metrics' F1 scores against scikit-learn's f1_score."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from normgrad import metrics

sklearn_metrics = pytest.importorskip("sklearn.metrics")


@pytest.mark.parametrize("shape,class_axis,classes_used", [((60, 5), 1, 5), ((8, 5, 6), 1, 3), ((4, 9, 7), -1, 7),
                                                           ((50, 12), 1, 4)])
def test_f1_macro_and_micro_match_scikit_learn(shape, class_axis, classes_used):
    """Class axis 1 or last, -100 labels ignored, classes that are neither a label nor a
    prediction left out of the macro average (as scikit-learn's), some classes only
    predicted, some only labels."""
    rng = np.random.default_rng(sum(shape) + classes_used)
    outputs = rng.standard_normal(shape).astype(np.float32)
    classes = shape[class_axis]
    label_shape = tuple(d for i, d in enumerate(shape) if i != class_axis % len(shape))
    labels = rng.integers(0, classes_used, label_shape)
    labels.flat[::7] = -100
    scores = np.moveaxis(outputs, class_axis, -1).reshape(-1, classes)
    kept = labels.reshape(-1) >= 0
    truth, predicted = labels.reshape(-1)[kept], scores[kept].argmax(axis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scikit-learn's warning for a class never predicted
        for average, metric in (("macro", metrics.f1_macro), ("micro", metrics.f1_micro)):
            expected = sklearn_metrics.f1_score(truth, predicted, average=average)
            assert metric(outputs, labels) == pytest.approx(expected, abs=1e-12), average
    assert metrics.f1_micro(outputs, labels) == pytest.approx(metrics.accuracy(outputs, labels), abs=1e-12)


def test_f1_of_perfect_and_wrong_predictions():
    labels = np.array([0, 1, 2, 2])
    perfect = np.eye(3)[labels]
    assert metrics.f1_macro(perfect, labels) == metrics.f1_micro(perfect, labels) == 1.0
    assert metrics.f1_macro(np.eye(3)[[1, 2, 0, 0]], labels) == 0.0
