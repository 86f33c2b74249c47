"""ScatterElements: gradients to the data and the updates for every reduction.

Reductions (``y`` the output, ``p`` a position some updates ``u_j`` are scattered to):

- ``none``: the data gets dy with the written positions zeroed; an update gets dy at its
  position if it is the last one written there in index order (row-major over the index
  tensor), zero if a later update overwrote it. ONNX leaves repeated positions undefined;
  onnxruntime's ScatterElements and ScatterND (at any thread count) and ONNX's reference
  implementation all keep the last one, and the gradient follows what the forward computed.
  The last writer is found with a ScatterElements ``max`` of the updates' ordinals, skipped
  where the indices are constant and distinct.
- ``add``: dy to the data; dy gathered at each update's position.
- ``mul``: dy times the product of the updates to the data; ``dy * data * (product of the
  other updates at p)`` to each update, the product taken without dividing by a zero update
  (an update gets zero when another update at p is zero).
- ``max`` / ``min``: torch's ``scatter_reduce(amax/amin, include_self=True)`` rule: dy split
  evenly among the data element and the updates equal to ``y[p]``.

Every sum over repeated positions is a ScatterElements ``add`` or ``mul`` (onnxruntime adds
them in index order whatever the thread count); indices may be negative (onnxruntime's
ScatterElements and GatherElements take them as they are). The indices get no gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.graphs.rules import UnsupportedOperatorError, register
from normgrad.graphs.rules._scatter import flat_positions

__all__ = ["Scatter", "scatter_gradients", "scatter_elements_gradient", "distinct_keys", "reads"]


@dataclasses.dataclass(frozen=True)
class Scatter:
    """A ScatterElements as its gradient sees it (the values may be emitted reshapes).

    Attributes:
        data, indices, updates, output: value names of its inputs and output.
        axis: the non-negative scatter axis.
        reduction: ONNX's ``reduction`` attribute.
        like: a forward value of the data's element type.
        distinct: whether no two updates go to the same position (known before run time).
        wants_data, wants_updates: which gradients to compute.
    """

    data: str
    indices: str
    updates: str
    output: str
    axis: int
    reduction: str
    like: str
    distinct: bool
    wants_data: bool
    wants_updates: bool


Gradients = Tuple[Optional[str], Optional[str]]


def _gathered(ctx: GradientContext, s: Scatter, value: str) -> str:
    """``value`` (shaped like the data) read at each update's position."""
    return ctx.op("GatherElements", value, s.indices, axis=s.axis)


def _scattered(ctx: GradientContext, s: Scatter, into: str, values: str, reduction: str) -> str:
    return ctx.op("ScatterElements", into, s.indices, values, axis=s.axis, reduction=reduction)


def _filled(ctx: GradientContext, value: float, like: str, shape_of: str) -> str:
    return ctx.op("Expand", ctx.scalar(value, like), ctx.shape_of(shape_of))


def _none(ctx: GradientContext, s: Scatter, dy: str) -> Gradients:
    d_data = _scattered(ctx, s, dy, _filled(ctx, 0.0, s.like, s.updates), "none") if s.wants_data else None
    if not s.wants_updates:
        return d_data, None
    d_updates = _gathered(ctx, s, dy)
    if not s.distinct:
        ordinals = flat_positions(ctx, s.updates)
        unwritten = ctx.op("Expand", ctx.op("Constant", value=onh.from_array(np.asarray(-1, np.int64))),
                           ctx.shape_of(s.data))
        last = _scattered(ctx, s, unwritten, ordinals, "max")
        kept = ctx.op("Equal", _gathered(ctx, s, last), ordinals)
        d_updates = ctx.op("Where", kept, d_updates, ctx.scalar(0.0, s.like))
    return d_data, d_updates


def _add(ctx: GradientContext, s: Scatter, dy: str) -> Gradients:
    return (dy if s.wants_data else None), (_gathered(ctx, s, dy) if s.wants_updates else None)


def _mul(ctx: GradientContext, s: Scatter, dy: str) -> Gradients:
    d_data = d_updates = None
    if s.wants_data:
        product = _scattered(ctx, s, _filled(ctx, 1.0, s.like, s.data), s.updates, "mul")
        d_data = ctx.op("Mul", dy, product)
    if s.wants_updates:
        zero = ctx.op("Equal", s.updates, ctx.scalar(0.0, s.like))
        own_zeros = ctx.op("CastLike", zero, s.updates)
        zeros_at = _scattered(ctx, s, _filled(ctx, 0.0, s.like, s.data), own_zeros, "add")
        nonzero = ctx.op("Where", zero, ctx.scalar(1.0, s.like), s.updates)
        product = _scattered(ctx, s, s.data, nonzero, "mul")  # data times the nonzero updates at p
        share = ctx.op("Div", _gathered(ctx, s, ctx.op("Mul", dy, product)), nonzero)
        # the other updates at p are nonzero exactly when p's zero count is this update's own
        others_nonzero = ctx.op("Equal", _gathered(ctx, s, zeros_at), own_zeros)
        d_updates = ctx.op("Where", others_nonzero, share, ctx.scalar(0.0, s.like))
    return d_data, d_updates


def _extreme(ctx: GradientContext, s: Scatter, dy: str) -> Gradients:
    data_wins = ctx.op("CastLike", ctx.op("Equal", s.data, s.output), s.data)
    update_wins = ctx.op("CastLike", ctx.op("Equal", s.updates, _gathered(ctx, s, s.output)), s.updates)
    winners = _scattered(ctx, s, data_wins, update_wins, "add")
    share = ctx.op("Div", dy, winners)
    d_data = ctx.op("Mul", share, data_wins) if s.wants_data else None
    d_updates = ctx.op("Mul", _gathered(ctx, s, share), update_wins) if s.wants_updates else None
    return d_data, d_updates


_REDUCTIONS: Dict[str, Callable[[GradientContext, Scatter, str], Gradients]] = {
    "none": _none, "add": _add, "mul": _mul, "max": _extreme, "min": _extreme}


def scatter_gradients(ctx: GradientContext, node: onnx.NodeProto, s: Scatter, dy: str) -> Gradients:
    """The gradients (data, updates) of the ScatterElements ``s`` (the form of ``node``) for dy
    shaped like its data; None where not wanted.

    Raises:
        UnsupportedOperatorError: a reduction ONNX does not define.
    """
    if s.reduction not in _REDUCTIONS:
        raise UnsupportedOperatorError(
            f"{describe(node)}: reduction '{s.reduction}' has no gradient rule (none, add, mul, max and min have)")
    return _REDUCTIONS[s.reduction](ctx, s, dy)


def reads(reduction: str, distinct: bool, wants_updates: bool) -> Tuple[bool, bool]:
    """Whether the gradients of a ScatterElements with ``reduction`` read (its data, its output)."""
    extreme = reduction in ("max", "min")
    return extreme or reduction == "mul" or (reduction == "none" and wants_updates and not distinct), extreme


def distinct_keys(keys: np.ndarray) -> bool:
    """Whether the rows of 2-D int array ``keys`` are pairwise different."""
    return len(np.unique(keys, axis=0)) == len(keys)


def _constant_distinct(ctx: GradientContext, node: onnx.NodeProto, axis: int) -> bool:
    """Whether the indices are constant and no two of them name the same position of the data."""
    indices, shape = ctx.constant(node.input[1]), ctx.shape(node.input[0])
    if indices is None or shape is None:
        return False
    indices = indices.astype(np.int64)
    if np.any(indices < 0):
        if not isinstance(shape[axis], int):
            return False
        indices = indices % shape[axis]
    coordinates = np.indices(indices.shape)
    coordinates[axis] = indices
    return distinct_keys(coordinates.reshape(len(indices.shape), -1).T)


@register("ScatterElements", inputs=(0, 2), min_opset=18)
def scatter_elements_gradient(
    ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]
) -> List[Optional[str]]:
    """The data's and the updates' gradients by the reduction (module docstring)."""
    data = node.input[0]
    axis = attr(node, "axis", 0) % ctx.rank(data, node)
    reduction = attr(node, "reduction", "none")
    scatter = Scatter(data, node.input[1], node.input[2], node.output[0], axis, reduction, data,
                      distinct=reduction == "none" and _constant_distinct(ctx, node, axis),
                      wants_data=ctx.needs_grad(data), wants_updates=ctx.needs_grad(node.input[2]))
    d_data, d_updates = scatter_gradients(ctx, node, scatter, grads[0])
    return [d_data, None, d_updates]
