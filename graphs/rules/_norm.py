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

__all__ = ["as_float32", "float32_scalar", "statistics"]


def as_float32(ctx: GradientContext, name: str, like: str) -> str:
    """``name`` (whose type is that of forward value ``like``) as float32."""
    if ctx.elem_type(like) == onnx.TensorProto.FLOAT:
        return name
    return ctx.op("Cast", name, to=onnx.TensorProto.FLOAT)


def float32_scalar(ctx: GradientContext, value: float) -> str:
    """A float32 scalar Constant."""
    return ctx.op("Constant", value=onh.from_array(np.asarray(value, np.float32)))


def statistics(ctx: GradientContext, view: str, axes: Sequence[int], epsilon: float) -> Tuple[str, str]:
    """The biased mean and 1 / sqrt(var + epsilon) of float32 ``view`` over ``axes`` (dropped)."""
    mean_kept = ctx.reduce("ReduceMean", view, axes, keepdims=True)
    centred = ctx.op("Sub", view, mean_kept)
    var = ctx.reduce("ReduceMean", ctx.op("Mul", centred, centred), axes, keepdims=False)
    mean = ctx.op("Squeeze", mean_kept, ctx.ints(axes))
    rstd = ctx.op("Reciprocal", ctx.op("Sqrt", ctx.op("Add", var, float32_scalar(ctx, epsilon))))
    return mean, rstd
