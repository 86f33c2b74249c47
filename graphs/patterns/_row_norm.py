"""What the LayerNorm and RMSNorm chain patterns share: matching the chain, and the checks of
its normalised axes, epsilon and the scale that follows."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import numpy as np
import onnx

from normgrad.graphs.context import FLOAT_ELEM_TYPES, GradientContext, attr
from normgrad.graphs.patterns.registry import GraphView
from normgrad.graphs.patterns._declarative import Binding, ChainPattern

__all__ = ["RowNormChain", "match_row_norm", "casts_to_float", "normalised_axis", "fixed_epsilon", "broadcasts_along", "keeps_shape", "float_input"]


@dataclasses.dataclass
class RowNormChain:
    """A matched chain normalising ``x`` over the axes >= ``axis``, times ``w`` if not None."""

    bound: Dict[str, Binding]
    nodes: List[onnx.NodeProto]
    x: str
    w: Optional[str]
    axis: int


def match_row_norm(
    view: GraphView, ctx: GradientContext, anchor: onnx.NodeProto, chain: ChainPattern, anchors: Sequence[str], moment: str
) -> Optional[RowNormChain]:
    """``chain`` ending at ``anchor`` (one of the op types ``anchors``), with its variables
    ``x``, ``eps``, optional ``w`` and ``scaled`` (the product by w) checked: x of a float type
    and known rank, the ReduceMean producing variable ``moment`` over trailing axes, eps one
    fixed value, w broadcasting along the normalised axes only, the product of x's shape."""
    if anchor.op_type not in anchors or anchor.domain not in ("", "ai.onnx") or not {"ReduceMean", "Sqrt"} <= view.op_types:
        return None
    found = chain.match(view, ctx, anchor)
    if found is None:
        return None
    bound, nodes = found
    x, w = bound["x"], bound.get("w")
    x_shape = ctx.shape(x)
    if not float_input(ctx, x) or not x_shape:
        return None
    axis = normalised_axis(view, ctx, view.producer[bound[moment]], len(x_shape))
    if axis is None or not fixed_epsilon(ctx, bound["eps"], len(x_shape)):
        return None
    if w is not None and not (broadcasts_along(ctx, w, x, axis) and keeps_shape(ctx, bound["scaled"], x)):
        return None
    return RowNormChain(bound, nodes, x, w, axis)


def normalised_axis(view: GraphView, ctx: GradientContext, reduce_mean: onnx.NodeProto, rank: int) -> Optional[int]:
    """``a`` if ``reduce_mean`` averages over the axes a, ..., rank - 1 keeping them as 1s
    (the statistics shape of LayerNormalization with axis a), else None."""
    if attr(reduce_mean, "keepdims", 1) != 1:
        return None
    if len(reduce_mean.input) > 1 and reduce_mean.input[1]:
        axes = view.static_value(ctx, reduce_mean.input[1])
        if axes is None:
            return None
    else:
        axes = attr(reduce_mean, "axes", None)
    if axes is None or np.size(axes) == 0:
        if attr(reduce_mean, "noop_with_empty_axes", 0):
            return None
        axes = list(range(rank))  # no axes: every axis
    normalised: List[int] = sorted({int(a) % rank for a in np.ravel(axes)})
    return normalised[0] if normalised == list(range(normalised[0], rank)) else None


def fixed_epsilon(ctx: GradientContext, name: str, rank: int) -> bool:
    """Whether ``name`` is one value that needs no gradient (the backward reads the
    statistics the chain computed, so the value itself does not matter)."""
    shape = ctx.shape(name)
    return not ctx.needs_grad(name) and shape is not None and len(shape) <= rank and all(d == 1 for d in shape)


def broadcasts_along(ctx: GradientContext, name: str, x: str, axis: int) -> bool:
    """Whether ``name`` broadcasts to x's shape varying only along the axes >= ``axis``
    (the grad ops' contract for the scale)."""
    shape, x_shape = ctx.shape(name), ctx.shape(x)
    if shape is None or x_shape is None or len(shape) > len(x_shape) or not float_input(ctx, name):
        return False
    lead = len(x_shape) - len(shape)
    for i, dim in enumerate(shape):
        if dim == 1:
            continue
        if lead + i < axis or dim is None or dim != x_shape[lead + i]:
            return False
    return True


def keeps_shape(ctx: GradientContext, value: str, x: str) -> bool:
    """Whether ``value`` (the output of an affine step) has x's shape: its other operand
    broadcast into x, not x into something larger."""
    shape, x_shape = ctx.shape(value), ctx.shape(x)
    return shape is not None and shape == x_shape and None not in shape


def casts_to_float(view: GraphView, name: Optional[str]) -> bool:
    """Whether the Cast producing ``name`` (None: no Cast) casts to a float type."""
    return name is None or attr(view.producer[name], "to", 0) in FLOAT_ELEM_TYPES


def float_input(ctx: GradientContext, name: str) -> bool:
    return ctx.elem_type(name) in FLOAT_ELEM_TYPES
