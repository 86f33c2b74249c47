"""Helpers the normalization rules share: float32 views and recomputed statistics.

normgrad nodes are always emitted in float32 (their function bodies compute in float32
anyway); values of other float types are cast on the way in and out.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext

__all__ = ["as_float32", "float32_scalar", "statistics", "inv_rms"]


def as_float32(ctx: GradientContext, name: str, like: str) -> str:
    """``name`` (whose type is that of forward value ``like``) as float32."""
    if ctx.elem_type(like) == onnx.TensorProto.FLOAT:
        return name
    return ctx.op("Cast", name, to=onnx.TensorProto.FLOAT)


def float32_scalar(ctx: GradientContext, value: float) -> str:
    """A float32 scalar Constant."""
    return ctx.op("Constant", value=onh.from_array(np.asarray(value, np.float32)))


def statistics(ctx: GradientContext, view: str, axes: Sequence[int], epsilon: float,
               keepdims: bool = False) -> Tuple[str, str]:
    """The biased mean and 1 / sqrt(var + epsilon) of float32 ``view`` over ``axes`` (dropped
    unless ``keepdims``)."""
    mean_kept = ctx.reduce("ReduceMean", view, axes, keepdims=True)
    centred = ctx.op("Sub", view, mean_kept)
    var = ctx.reduce("ReduceMean", ctx.op("Mul", centred, centred), axes, keepdims=keepdims)
    mean = mean_kept if keepdims else ctx.op("Squeeze", mean_kept, ctx.ints(axes))
    rstd = ctx.op("Reciprocal", ctx.op("Sqrt", ctx.op("Add", var, float32_scalar(ctx, epsilon))))
    return mean, rstd


def inv_rms(ctx: GradientContext, x: str, axes: Sequence[int], epsilon: float) -> str:
    """1 / sqrt(mean(x²) + epsilon) over ``axes`` (kept) of forward value ``x``, in float32."""
    x32 = as_float32(ctx, x, x)
    mean_square = ctx.reduce("ReduceMean", ctx.op("Mul", x32, x32), axes, keepdims=True)
    return ctx.op("Reciprocal", ctx.op("Sqrt", ctx.op("Add", mean_square, float32_scalar(ctx, epsilon))))
