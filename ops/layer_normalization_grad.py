"""LayerNormalizationGrad: the gradients of ONNX LayerNormalization (opset 17).

torch ``native_layer_norm_backward``; onnxruntime-training's com.microsoft
``LayerNormalizationGrad`` (training builds only).

The forward, over the axes >= ``axis`` (R rows of D values, see
:mod:`normgrad.ops._row_normalization`): y = (x - mean) * inv_std_dev * scale + bias.

Inputs:
    dy (T): the gradient of y; shape of ``x``.
    x (T): the LayerNormalization input, rank >= 1.
    scale (T): the LayerNormalization scale: x.shape[axis:] (torch's ``normalized_shape``),
        or any shape broadcasting to ``x`` that varies only along the axes >= ``axis``.
    mean (U): the per-row mean, as LayerNormalization-17's optional output ``Mean``:
        x's shape with the dims >= ``axis`` set to 1.
    inv_std_dev (U): the per-row 1 / sqrt(var + epsilon), as its output ``InvStdDev``;
        shape of ``mean``.

Attribute:
    axis (int, default -1): the first normalised axis, in [-r, r) for ``x`` of rank r.

Outputs:
    dx (T): shape of ``x``.
    dscale (T, optional): scale's shape; sum(dy * x_hat) over the rows and scale's broadcast axes.
    dbias (T, optional): scale's shape; sum(dy) likewise. (A bias shaped differently from the
        scale sums this further, or takes it from dy directly.)

With x_hat = (x - mean) * inv_std_dev, g = dy * scale and mean_D the mean over a row:

    dx = inv_std_dev * (g - mean_D(g) - x_hat * mean_D(g * x_hat))

the gradient of y with the statistics depending on x (epsilon enters only through
inv_std_dev). T is float, float16 or bfloat16; U is T or float (float32 for a float16 or
bfloat16 x under LayerNormalization's default ``stash_type``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import onnx
from onnx.defs import OpSchema

import normgrad.ops._common as _common
import normgrad.ops._row_normalization as _row_normalization

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_SHAPE_FROM", "Result", "validate", "reference", "schema", "function_body"]

OP_TYPE = "LayerNormalizationGrad"
INPUTS = ("dy", "x", "scale", "mean", "inv_std_dev")
OUTPUTS = ("dx", "dscale", "dbias")
ATTRIBUTES = dict(_row_normalization.ATTRIBUTES)
OUTPUT_SHAPE_FROM = {"dx": ("x", None), "dscale": ("scale", None), "dbias": ("scale", None)}
"""Each output's shape as (input, axis): input.shape[axis], or the whole shape for None."""


class Result(NamedTuple):
    """The outputs, all computed by the reference."""

    dx: np.ndarray
    dscale: Optional[np.ndarray]
    dbias: Optional[np.ndarray]


def validate(dy, x, scale, mean, inv_std_dev, *, axis=-1):
    """Checks the inputs against the contract.

    Returns:
        The inputs as arrays in the order given, then ``axis`` made non-negative.

    Raises:
        NormgradInputError: naming the offending input or attribute and the rule it broke.
    """
    dy, x, scale, (mean, inv_std_dev), axis = _row_normalization.validate(
        OP_TYPE, dy, x, scale, {"mean": mean, "inv_std_dev": inv_std_dev}, axis
    )
    return dy, x, scale, mean, inv_std_dev, axis


def reference(dy, x, scale, mean, inv_std_dev, *, axis=-1) -> Result:
    """The operator in float64 NumPy: the truth every other implementation is tested against.

    Returns:
        A :class:`Result` in T (``x``'s dtype).
    """
    dy, x, scale, mean, inv_std_dev, axis = validate(dy, x, scale, mean, inv_std_dev, axis=axis)
    x2, g, (mu, rstd) = _row_normalization.rows(dy, x, scale, (mean, inv_std_dev), axis)
    return Result(*_row_normalization.gradients(dy, x, scale, (x2 - mu) * rstd, g, rstd, layer_norm=True))


def schema() -> OpSchema:
    """The ONNX schema, with type and shape inference."""
    return _row_normalization.schema(OP_TYPE, __doc__, "LayerNormalization", {"mean": "Per-row mean", "inv_std_dev": "Per-row 1/sqrt(var + epsilon)"}, OUTPUTS)


STATIC_SUM_AXES_OF = _row_normalization.STATIC_SUM_AXES_OF


def function_body(opset: int = _common.ONNX_OPSET, sum_axes=None) -> onnx.FunctionProto:
    """The operator in standard ONNX ops (float32 arithmetic), for runtimes without a kernel;
    ``sum_axes``: the reduction axes to scale's shape, when known at export.

    Outputs a node does not name are pruned by the runtime.
    """
    return _row_normalization.function_body(OP_TYPE, INPUTS, OUTPUTS, opset, sum_axes)
