"""Checks of the fused backward patterns against their unfused graphs, shared by the pattern tests."""

from __future__ import annotations

import collections

import onnx

from normgrad.graphs import TrainingGraph, build_training_graph, patterns
from normgrad.tools.check import check_gradients


TOLERANCE = 1e-4


def _backward_ops(forward: onnx.ModelProto, training: TrainingGraph) -> collections.Counter:
    """Op types of the nodes the exporter appended (the forward nodes come first)."""
    return collections.Counter(n.op_type for n in training.model.graph.node[len(forward.graph.node):])


def _check(training: TrainingGraph) -> None:
    checks = check_gradients(training, directions=2)
    assert checks, "no gradient outputs"
    worst = max(checks, key=lambda c: c.error)
    assert worst.error < TOLERANCE, worst


def _unfused(forward: onnx.ModelProto, only=None, **kwargs) -> TrainingGraph:
    """The training graph the per-node rules alone write (``only``: the names of the patterns
    to leave out; all when None)."""
    saved = list(patterns.registry._PATTERNS)
    patterns.registry._PATTERNS[:] = [(name, matcher) for name, matcher in saved if only is not None and name not in only]
    try:
        return build_training_graph(forward, **kwargs)
    finally:
        patterns.registry._PATTERNS[:] = saved
