"""The :class:`normgrad.train.Trainer`'s batches: what a step or an evaluation is given,
checked against the step graph before anything runs.

:class:`BatchFeeds`, a part of the Trainer, turns a batch (positional, by name, or one
dict: :func:`unpack_dict`) into the feeds of the step graph's data inputs, refusing
unknown or missing inputs, dtypes of another kind, shapes the graph does not take (per
micro-batch with accumulation), empty batches, disagreeing named dimensions and
cross_entropy labels outside 0..C-1, and checks the forward outputs a step is asked for."""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import onnx

from normgrad._step_graph import StepGraph, np_dtype
from normgrad.errors import TrainerError

__all__ = ["BatchFeeds", "unpack_dict"]


def unpack_dict(batch: Sequence, named: Mapping[str, object]) -> Tuple[Sequence, Dict[str, object]]:
    """A batch given as one dict ``{input name: array}`` -> the same inputs by name."""
    if len(batch) == 1 and isinstance(batch[0], Mapping):
        twice = sorted(set(batch[0]) & set(named))
        if twice:
            raise TrainerError(f"batch input {twice[0]!r} given both in the dict and by keyword")
        return (), {**batch[0], **named}
    return batch, dict(named)


class BatchFeeds:
    """The checks of a step graph's batches.

    Args:
        graph: the step graph.
        accumulation: micro-batches per optimizer step (each must have a shape the graph takes).
        forward_outputs: the forward outputs a step can return.
    """

    def __init__(self, graph: StepGraph, accumulation: int, forward_outputs: Sequence[str]):
        self.step_model, self.data_inputs, self.accumulation = graph.model, graph.data_inputs, accumulation
        self.forward_outputs = forward_outputs
        self._loss_metadata = graph.loss
        self._classes = self._class_count()

    def feeds(self, batch: Sequence, named: Mapping[str, object], whole: bool = False) -> Dict[str, np.ndarray]:
        """The checked feeds of a batch (arrays in ``data_inputs`` order, and by name);
        ``whole``: run at once (an evaluation), not split into ``accumulation`` micro-batches.

        Raises:
            TrainerError: a batch the step graph cannot take (names, dtypes, shapes, an empty
                batch, cross_entropy labels outside 0..C-1 or the ignore_index).
        """
        accumulation = 1 if whole else self.accumulation
        if len(batch) > len(self.data_inputs):
            raise TrainerError(f"step() takes {len(self.data_inputs)} arrays ({', '.join(self.data_inputs)}); "
                               f"got {len(batch)}")
        twice = sorted(set(self.data_inputs[:len(batch)]) & set(named))
        if twice:
            raise TrainerError(f"batch input {twice[0]!r} given both positionally and by name")
        named = {**dict(zip(self.data_inputs, batch)), **named}
        unknown = sorted(set(named) - set(self.data_inputs))
        missing = [n for n in self.data_inputs if n not in named]
        if unknown or missing:
            raise TrainerError(f"the batch must be {', '.join(self.data_inputs)}; "
                               + (f"missing {missing[0]!r}" if missing else f"unknown {unknown[0]!r}"))
        inputs = {i.name: i for i in self.step_model.graph.input}
        feeds, fed_shapes = {}, {}
        for name in self.data_inputs:
            value, dtype = np.asarray(named[name]), np_dtype(inputs[name])
            if value.dtype != dtype and value.dtype.kind != dtype.kind and not (value.dtype.kind in "iu" and dtype.kind in "iu"):
                raise TrainerError(f"batch input {name!r} must be {dtype} (or the same kind); got {value.dtype}")
            feeds[name] = np.ascontiguousarray(value, dtype)
            if accumulation > 1 and (value.ndim == 0 or value.shape[0] % accumulation):
                raise TrainerError(f"with accumulation {accumulation}, batch input {name!r} needs a first axis "
                                   f"divisible by {accumulation}; got shape {list(value.shape)}")
            fed = (value.shape[0] // accumulation,) + value.shape[1:] if accumulation > 1 else value.shape
            fed_shapes[name] = fed
            dims = [d.dim_value if d.HasField("dim_value") else None for d in inputs[name].type.tensor_type.shape.dim]
            if len(dims) != len(fed) or any(d is not None and d != f for d, f in zip(dims, fed)):
                micro = f" (each of the {accumulation} micro-batches)" if accumulation > 1 else ""
                wanted = [d if d is not None else "any" for d in dims]
                raise TrainerError(f"batch input {name!r}{micro} has shape {list(fed)}; the step graph takes {wanted}")
        self._check_batch(feeds, fed_shapes)
        return feeds

    def _check_batch(self, feeds: Mapping[str, np.ndarray], fed_shapes: Mapping[str, Tuple[int, ...]]) -> None:
        """Refuses, before anything runs, an empty batch, inputs that disagree (as each
        micro-batch feeds them: ``fed_shapes``) on a dimension the step graph names alike
        (``batch``; the graph may read one input's size for the other's,
        :mod:`normgrad.graphs.rewrites.input_shapes`), and cross_entropy labels outside 0..C-1
        (other than the loss's ignore_index)."""
        inputs = {i.name: i for i in self.step_model.graph.input}
        symbols: Dict[str, Tuple[str, int, int]] = {}
        for name, value in feeds.items():
            if value.size == 0:
                raise TrainerError(f"batch input {name!r} is empty (shape {list(value.shape)}); a step needs at least one sample")
            shape = fed_shapes[name]
            for axis, dim in enumerate(inputs[name].type.tensor_type.shape.dim):
                if dim.HasField("dim_param") and dim.dim_param and axis < len(shape):
                    first = symbols.setdefault(dim.dim_param, (name, axis, shape[axis]))
                    if first[2] != shape[axis]:
                        micro = " (each micro-batch)" if shape != value.shape else ""
                        raise TrainerError(
                            f"batch input {name!r}{micro} has {shape[axis]} along axis {axis} and {first[0]!r} "
                            f"{first[2]} along axis {first[1]}; the step graph names both {dim.dim_param!r}, so they must agree")
        loss = self._loss_metadata
        if loss.get("kind") != "cross_entropy" or "labels" not in feeds:
            return
        labels = feeds["labels"]
        ignore_index = (loss.get("options") or {}).get("ignore_index")
        valid = labels >= 0 if ignore_index is None else (labels >= 0) | (labels == ignore_index)
        if self._classes is not None:
            valid &= (labels < self._classes) | (labels == ignore_index if ignore_index is not None else False)
        if not valid.all():
            bad = labels[~valid].flat[0]
            allowed = f"0..{self._classes - 1}" if self._classes is not None else "non-negative"
            also = f" or the ignore_index {ignore_index}" if ignore_index is not None else ""
            raise TrainerError(f"batch input 'labels' holds {bad}; cross_entropy labels must be class indices {allowed}{also}")

    def _class_count(self) -> Optional[int]:
        """C of a cross_entropy loss: axis 1 of its forward output, where the step graph knows it."""
        if self._loss_metadata.get("kind") != "cross_entropy":
            return None
        output = self._loss_metadata.get("output")
        graph = self.step_model.graph
        if not any(info.name == output for info in graph.value_info):
            from normgrad.graphs.step_graph import expose_forward_outputs, forward_outputs

            try:
                # the output where only the forward tail computes it (a bias Add the loss absorbed)
                model = expose_forward_outputs(self.step_model, [output]) if output in forward_outputs(self.step_model) \
                    else self.step_model
                # data_prop: C through a Reshape to a Shape-computed size (the rewritten x @ W.T)
                graph = onnx.shape_inference.infer_shapes(model, data_prop=True).graph
            except Exception:  # a graph onnx cannot infer: labels are checked against 0 only
                return None
        for info in list(graph.value_info) + list(graph.output):
            if info.name == output:
                dims = info.type.tensor_type.shape.dim
                return dims[1].dim_value if len(dims) > 1 and dims[1].HasField("dim_value") else None
        return None

    def requested(self, outputs: Optional[Sequence[str]]) -> Dict[str, object]:
        """``{name: None}`` of the forward outputs a step is asked for (``outputs``: a name or names).

        Raises:
            TrainerError: a name that is not one of :attr:`forward_outputs`.
        """
        names = [outputs] if isinstance(outputs, str) else list(outputs or [])
        for name in names:
            if name not in self.forward_outputs:
                raise TrainerError(f"output {name!r} is not a forward output the step graph computes; it computes "
                                   f"{', '.join(map(repr, self.forward_outputs)) or 'none'}")
        return dict.fromkeys(names)
