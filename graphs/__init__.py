"""Training graphs: reverse-mode gradients of ONNX models, with normgrad operators for the
normalization layers.

* :func:`build_training_graph`: forward model -> forward + backward model
  (:class:`TrainingGraph`: the model, weights as pure inputs, and the weights' values).
* :func:`supported_op_types`: the op types the exporter can differentiate (or knows carry
  no gradient).
* :func:`build_step_graph`: a training graph with a loss + an optimizer graph = one step graph.
* :func:`build_optimizer_graph`: one torch.optim step (SGD, Adam, AdamW, optional
  global-norm clipping) as a model taking gradients as inputs.

A step graph, its evaluation graph and its checkpoint are written as one set by
:func:`normgrad.artifacts.save_artifacts` (the checkpoint is the training layer's format).
* :class:`UnsupportedOperatorError`: a gradient would flow through an op without a rule.
"""

from __future__ import annotations

from normgrad.graphs.builder import AnyTrainingGraph, TrainingGraph, build_training_graph
from normgrad.graphs.optimizers import build_optimizer_graph
from normgrad.graphs.step_graph import build_step_graph
from normgrad.graphs.rules import UnsupportedOperatorError, supported_op_types

__all__ = ["build_training_graph", "TrainingGraph", "AnyTrainingGraph", "build_optimizer_graph", "build_step_graph", "supported_op_types", "UnsupportedOperatorError"]
