"""Checks the LayerNorm and RMSNorm chain patterns share: the normalised axes, epsilon, and
the operands of the affine that follows."""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx

from normgrad.graphs.context import FLOAT_ELEM_TYPES, GradientContext, attr
from normgrad.graphs.patterns import GraphView

__all__ = ["normalised_axis", "fixed_epsilon", "broadcasts_along", "keeps_shape", "float_input"]


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


def float_input(ctx: GradientContext, name: str) -> bool:
    return ctx.elem_type(name) in FLOAT_ELEM_TYPES
