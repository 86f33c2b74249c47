"""A gradient rule alone against float64 central finite differences: the check the rule tests share."""

from __future__ import annotations

import onnx
import onnx.helper as oh

from normgrad.graphs import build_training_graph
from normgrad.tools.check import check_gradients


TOLERANCE = 1e-4


def _check(forward: onnx.ModelProto, tolerance: float = TOLERANCE, **kwargs) -> None:
    training = build_training_graph(forward, **kwargs)
    checks = check_gradients(training, directions=2)
    assert checks, "no gradient outputs"
    worst = max(checks, key=lambda c: c.error)
    assert worst.error < tolerance, worst


def _node(op_type, inputs, **attrs):
    return oh.make_node(op_type, list(inputs), ["y"], **attrs)
