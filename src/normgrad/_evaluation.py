"""The :class:`normgrad.train.Trainer`'s evaluation: the loss and forward outputs of a batch
in eval mode with the current state, and no update.

:class:`Evaluation`, a part of the Trainer, runs the evaluation graph (the one exported
beside the step graph, or one built from it: :func:`normgrad.graphs.step_graph.build_eval_graph`),
checked against the step graph's state and data inputs, in a session made on first use.
:class:`EvalResult` is what it returns."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence

import numpy as np
import onnx

from normgrad._batches import BatchFeeds
from normgrad._session import GraphSession, TrainerSession
from normgrad._step_graph import StepGraph, load_graph, np_dtype
from normgrad.errors import TrainerError

__all__ = ["Evaluation", "EvalResult"]


@dataclasses.dataclass
class EvalResult:
    """What :meth:`Trainer.evaluate` returns: the loss and the requested forward outputs
    (``{name: array}``) in eval mode, with the trainer's current state."""

    loss: float
    outputs: Dict[str, np.ndarray]


class Evaluation:
    """The evaluation of a Trainer.

    Args:
        graph: the step graph.
        source: its evaluation graph (None: built from the step graph when first needed).
        session: the trainer's sessions (their options, its runs).
        feeds: the checks of its batches.
    """

    def __init__(self, graph: StepGraph, source: Optional[onnx.ModelProto], session: TrainerSession,
                 feeds: BatchFeeds):
        self._graph, self._source, self._session, self._feeds = graph, source, session, feeds
        self._part: Optional[GraphSession] = None

    def evaluate(self, state, batch: Sequence, named: Dict[str, object],
                 outputs: Optional[Sequence[str]] = None) -> EvalResult:
        """The loss and forward outputs (``outputs``; default: all that the evaluation graph
        computes) of a batch in eval mode with ``state`` (a
        :class:`normgrad._state.TrainerState`), which it does not change.

        Raises:
            TrainerError: an evaluation graph that does not fit the step graph, an output it
                does not compute, a batch the step graph cannot take.
        """
        part = self._evaluation_part()
        available = [o for o in part.outputs if o != "loss"]
        names = available if outputs is None else ([outputs] if isinstance(outputs, str) else list(outputs))
        for name in names:
            if name not in available:
                raise TrainerError(f"output {name!r} is not computed by the evaluation graph; it computes "
                                   f"{', '.join(map(repr, available)) or 'none'}")
        feeds = self._feeds.feeds(batch, named, whole=True)
        fetched = dict.fromkeys(names)
        loss = self._session.run(part, state, {name: value for name, value in feeds.items() if name in part.inputs},
                                 fetched=fetched)
        return EvalResult(loss=loss, outputs=fetched)

    def _evaluation_part(self) -> GraphSession:
        if self._part is None:
            from normgrad.graphs import step_graph

            source, step_model, expected = self._source, self._graph.model, self._graph.expected
            if source is None:
                model = step_graph.build_eval_graph(step_model)
            else:
                model = source if isinstance(source, onnx.ModelProto) else load_graph(source)
            step_inputs = {i.name: i for i in step_model.graph.input}
            for info in model.graph.input:
                if info.name in expected:
                    dims = tuple(d.dim_value for d in info.type.tensor_type.shape.dim)
                    if (np_dtype(info), dims) != expected[info.name]:
                        raise TrainerError(f"evaluation graph input {info.name!r} is {np_dtype(info)} {list(dims)}; "
                                           f"the step graph's state tensor is {expected[info.name][0]} "
                                           f"{list(expected[info.name][1])}")
                elif info.name not in self._graph.data_inputs:
                    raise TrainerError(f"evaluation graph input {info.name!r} is neither a data input nor a state "
                                       "tensor of the step graph: not this step graph's evaluation graph")
                elif np_dtype(info) != np_dtype(step_inputs[info.name]):
                    raise TrainerError(f"evaluation graph input {info.name!r} is {np_dtype(info)}; the step graph's "
                                       f"is {np_dtype(step_inputs[info.name])}: not this step graph's evaluation graph")
            if "loss" not in {o.name for o in model.graph.output}:
                raise TrainerError("the evaluation graph has no 'loss' output")
            self._part = self._session.new_session(model, {})
        return self._part
