"""The :class:`normgrad.train.Trainer`'s evaluation: the loss and forward outputs of a batch
in eval mode with the current state, and no update.

:class:`Evaluation`, a base of the Trainer, runs the evaluation graph (the one exported
beside the step graph, or one built from it: :func:`normgrad.graphs.step_graph.build_eval_graph`),
checked against the step graph's state and data inputs, in a session made on first use.
:class:`EvalResult` is what it returns."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence

import numpy as np
import onnx

from normgrad._batches import _unpack_dict
from normgrad._session import TrainerError, _load_step_graph, _np_dtype, _Part

__all__ = ["Evaluation", "EvalResult"]


@dataclasses.dataclass
class EvalResult:
    """What :meth:`Trainer.evaluate` returns: the loss and the requested forward outputs
    (``{name: array}``) in eval mode, with the trainer's current state."""

    loss: float
    outputs: Dict[str, np.ndarray]


class Evaluation:
    def evaluate(self, *batch, outputs: Optional[Sequence[str]] = None, **named) -> EvalResult:
        """The loss and forward outputs of a batch in eval mode (BatchNorm on its running
        statistics, Dropout off, as torch's ``model.eval()``) with the current state, and no
        update: no weight, optimizer tensor, running statistic or step count changes. The
        batch is given as to :meth:`step` (labels included), whole (not split into
        micro-batches). ``outputs``: the forward outputs to return (default: all that the
        evaluation graph computes)."""
        batch, named = _unpack_dict(batch, named)
        part = self._evaluation_part()
        available = [o for o in part.outputs if o != "loss"]
        names = available if outputs is None else ([outputs] if isinstance(outputs, str) else list(outputs))
        for name in names:
            if name not in available:
                raise TrainerError(f"output {name!r} is not computed by the evaluation graph; it computes "
                                   f"{', '.join(map(repr, available)) or 'none'}")
        feeds = self._batch(batch, named, whole=True)
        fetched = dict.fromkeys(names)
        loss = self._run(part, {name: value for name, value in feeds.items() if name in part.inputs}, fetched=fetched)
        return EvalResult(loss=loss, outputs=fetched)

    def _evaluation_part(self) -> _Part:
        if self._evaluation is None:
            from normgrad.graphs import step_graph

            source = self._eval_source
            if source is None:
                model = step_graph.build_eval_graph(self.step_model)
            else:
                model = source if isinstance(source, onnx.ModelProto) else _load_step_graph(source)
            step_inputs = {i.name: i for i in self.step_model.graph.input}
            for info in model.graph.input:
                if info.name in self._expected:
                    dims = tuple(d.dim_value for d in info.type.tensor_type.shape.dim)
                    if (_np_dtype(info), dims) != self._expected[info.name]:
                        raise TrainerError(f"evaluation graph input {info.name!r} is {_np_dtype(info)} {list(dims)}; "
                                           f"the step graph's state tensor is {self._expected[info.name][0]} "
                                           f"{list(self._expected[info.name][1])}")
                elif info.name not in self.data_inputs:
                    raise TrainerError(f"evaluation graph input {info.name!r} is neither a data input nor a state "
                                       "tensor of the step graph: not this step graph's evaluation graph")
                elif _np_dtype(info) != _np_dtype(step_inputs[info.name]):
                    raise TrainerError(f"evaluation graph input {info.name!r} is {_np_dtype(info)}; the step graph's "
                                       f"is {_np_dtype(step_inputs[info.name])}: not this step graph's evaluation graph")
            if "loss" not in {o.name for o in model.graph.output}:
                raise TrainerError("the evaluation graph has no 'loss' output")
            options, providers = self._session_arguments
            self._evaluation = _Part(self._ort, model, options, providers, {})
        return self._evaluation
