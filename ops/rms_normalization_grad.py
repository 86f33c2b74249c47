"""RMSNormalizationGrad: the gradients of ONNX RMSNormalization (opset 23).

torch ``nn.RMSNorm`` / ``F.rms_norm`` backward (through autograd); onnxruntime-training's
com.microsoft ``SimplifiedLayerNormalizationGrad`` (training builds only).

The forward, over the axes >= ``axis`` (R rows of D values, see
:mod:`normgrad.ops._row_normalization`): y = x * inv_rms * scale with
inv_rms = (mean(x^2) + epsilon)^-1/2 per row.

Inputs:
    dy (T): the gradient of y; shape of ``x``.
    x (T): the RMSNormalization input, rank >= 1.
    scale (T): x.shape[axis:], or any shape broadcasting to ``x`` that varies only along the
        axes >= ``axis`` (as LayerNormalizationGrad's).
    inv_rms (U): the per-row (mean(x^2) + epsilon)^-1/2: x's shape with the dims >= ``axis``
        set to 1 (RMSNormalization-23 has no output for it; compute it beside the forward).

Attribute:
    axis (int, default -1): the first normalised axis, in [-r, r) for ``x`` of rank r.

Outputs:
    dx (T): shape of ``x``.
    dscale (T, optional): scale's shape; sum(dy * x_hat) over the rows and scale's broadcast axes.

With x_hat = x * inv_rms, g = dy * scale and mean_D the mean over a row:

    dx = inv_rms * (g - x_hat * mean_D(g * x_hat))

T is float, float16 or bfloat16; U is T or float.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import onnx
from onnx.defs import OpSchema

import normgrad.ops._common as _common
import normgrad.ops._row_normalization as _row_normalization

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_SHAPE_FROM", "Result", "validate", "reference", "schema", "function_body"]

OP_TYPE = "RMSNormalizationGrad"
INPUTS = ("dy", "x", "scale", "inv_rms")
OUTPUTS = ("dx", "dscale")
ATTRIBUTES = dict(_row_normalization.ATTRIBUTES)
OUTPUT_SHAPE_FROM = {"dx": ("x", None), "dscale": ("scale", None)}
"""Each output's shape as (input, axis): input.shape[axis], or the whole shape for None."""


class Result(NamedTuple):
    """The outputs, all computed by the reference."""

    dx: np.ndarray
    dscale: Optional[np.ndarray]


def validate(dy, x, scale, inv_rms, *, axis=-1):
    """Checks the inputs against the contract.

    Returns:
        The inputs as arrays in the order given, then ``axis`` made non-negative.

    Raises:
        NormgradInputError: naming the offending input or attribute and the rule it broke.
    """
    dy, x, scale, (inv_rms,), axis = _row_normalization.validate(OP_TYPE, dy, x, scale, {"inv_rms": inv_rms}, axis)
    return dy, x, scale, inv_rms, axis


def reference(dy, x, scale, inv_rms, *, axis=-1) -> Result:
    """The operator in float64 NumPy: the truth every other implementation is tested against.

    Returns:
        A :class:`Result` in T (``x``'s dtype).
    """
    dy, x, scale, inv_rms, axis = validate(dy, x, scale, inv_rms, axis=axis)
    x2, g, (rstd,) = _row_normalization.rows(dy, x, scale, (inv_rms,), axis)
    return Result(*_row_normalization.gradients(dy, x, scale, x2 * rstd, g, rstd, layer_norm=False))


def schema() -> OpSchema:
    """The ONNX schema, with type and shape inference."""
    return _row_normalization.schema(OP_TYPE, __doc__, "RMSNormalization", {"inv_rms": "Per-row (mean(x^2) + epsilon)^-1/2"}, OUTPUTS)


STATIC_SUM_AXES_OF = _row_normalization.STATIC_SUM_AXES_OF


def function_body(opset: int = _common.ONNX_OPSET, sum_axes=None) -> onnx.FunctionProto:
    """The operator in standard ONNX ops (float32 arithmetic), for runtimes without a kernel;
    ``sum_axes``: the reduction axes to scale's shape, when known at export.

    Outputs a node does not name are pruned by the runtime.
    """
    return _row_normalization.function_body(OP_TYPE, INPUTS, OUTPUTS, opset, sum_axes)
