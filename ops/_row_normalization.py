"""What LayerNormalizationGrad and RMSNormalizationGrad share: ``x`` seen as rows at ``axis``.

ONNX LayerNormalization and RMSNormalization normalise over the axes >= ``axis``: ``x`` of
shape [d0, ..., d(r-1)] is R = d0 * ... * d(axis-1) rows of D = d(axis) * ... * d(r-1)
values. Per-row statistics are shaped as LayerNormalization-17 writes its optional Mean
and InvStdDev outputs, [d0, ..., d(axis-1), 1, ..., 1], in the stash type U (T or float).

``scale`` may take any shape that broadcasts to ``x`` by NumPy rules and varies only along
the normalised axes: dims aligned with axes < ``axis`` must be 1. That admits torch's
``normalized_shape`` weights (x.shape[axis:]), ONNX's broadcasting of a smaller scale over
the normalised axes (e.g. [D] against axis -2), and leading 1s; it refuses a scale that
differs per row, which ONNX's unidirectional broadcasting would allow but no torch layer
writes. Scale gradients take the scale's shape: summed over the rows and over the axes
along which the scale was broadcast.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import onnx
import onnx.parser
from onnx.defs import OpSchema

import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError

__all__ = ["ATTRIBUTES", "stats_shape", "validate", "rows", "gradients", "schema", "function_body"]

ATTRIBUTES = {"axis": -1}
"""As ONNX LayerNormalization and RMSNormalization: the first normalised axis."""


def _normalised_axis(op: str, axis, rank: int) -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise NormgradInputError(f"{op}: attribute 'axis' must be an int; got {axis!r}")
    if not -rank <= axis < rank:
        raise NormgradInputError(
            f"{op}: attribute 'axis' must be in [-r, r) for 'x' of rank r = {rank}; got {axis}"
        )
    return int(axis) % rank


def stats_shape(x_shape: Sequence, axis: int) -> list:
    """The shape of the per-row statistics: x's shape with the dims >= ``axis`` set to 1."""
    return list(x_shape[:axis]) + [1] * (len(x_shape) - axis)


def _scale_error(scale_shape: Sequence, x_shape: Sequence, axis: int) -> str | None:
    problem = _common.broadcast_error(scale_shape, x_shape)
    if problem:
        return problem
    lead = len(x_shape) - len(scale_shape)
    for i, dim in enumerate(scale_shape):
        if lead + i < axis and isinstance(dim, int) and dim != 1:
            return f"dim {i} ({dim}) lies on axis {lead + i} < axis {axis}, where the scale must be 1"
    return None


def validate(op: str, dy, x, scale, stats: Mapping[str, object], axis):
    """Checks the inputs of a row-normalisation gradient.

    Returns:
        ``(dy, x, scale, stats, axis)``: arrays, the statistics as a list in the order
        given, ``axis`` made non-negative.

    Raises:
        NormgradInputError: naming the offending input or attribute and the rule it broke.
    """
    x = _common.as_float_array(op, "x", x)
    if x.ndim == 0:
        raise NormgradInputError(f"{op}: input 'x' must have rank >= 1; got a scalar")
    axis = _normalised_axis(op, axis, x.ndim)
    dy = _common.as_float_array(op, "dy", dy)
    _common.check_same_shape(op, "dy", dy, "x", x)
    scale = _common.as_float_array(op, "scale", scale)
    if scale.dtype != x.dtype:
        raise NormgradInputError(f"{op}: input 'scale' must have the dtype of 'x' ({x.dtype}); got {scale.dtype}")
    problem = _scale_error(scale.shape, x.shape, axis)
    if problem:
        raise NormgradInputError(
            f"{op}: input 'scale' {list(scale.shape)} must broadcast to 'x' {list(x.shape)} along the "
            f"normalised axes >= {axis} only: {problem}"
        )
    arrays = []
    expected = stats_shape(x.shape, axis)
    for name, value in stats.items():
        array = _common.as_float_array(op, name, value)
        _common.check_vector(op, name, array, expected, "x's shape with the dims >= axis set to 1")
        if array.dtype not in (x.dtype, np.dtype(np.float32)):
            raise NormgradInputError(
                f"{op}: input '{name}' must be float32 or the dtype of 'x' ({x.dtype}); got {array.dtype}"
            )
        if arrays and array.dtype != arrays[0].dtype:
            first = next(iter(stats))
            raise NormgradInputError(
                f"{op}: input '{name}' must have the dtype of '{first}' ({arrays[0].dtype}); got {array.dtype}"
            )
        arrays.append(array)
    return dy, x, scale, arrays, axis


def rows(dy, x, scale, stats, axis):
    """Float64 [R, D] views of x and g = dy * scale, and each statistic as [R, 1]."""
    n_rows = int(np.prod(x.shape[:axis], dtype=np.int64))
    shape = (n_rows, int(np.prod(x.shape[axis:], dtype=np.int64)))
    x2 = x.astype(np.float64).reshape(shape)
    g2 = (dy.astype(np.float64) * scale.astype(np.float64)).reshape(shape)
    return x2, g2, [s.astype(np.float64).reshape(n_rows, 1) for s in stats]


def gradients(dy, x, scale, x_hat, g, rstd, layer_norm: bool) -> tuple:
    """The outputs, in x's dtype, from float64 [R, D] views x_hat and g = dy * scale and the
    [R, 1] rstd, with mean_D the mean over a row:

        dx = rstd * (g - mean_D(g) - x_hat * mean_D(g * x_hat))   (LayerNorm)
        dx = rstd * (g - x_hat * mean_D(g * x_hat))               (RMSNorm)

    then dscale = sum(dy * x_hat) and, for LayerNorm, dbias = sum(dy), each over the rows
    and scale's broadcast axes."""
    dx = g
    if g.size:
        dx = g - x_hat * (g * x_hat).mean(-1, keepdims=True)
        if layer_norm:
            dx -= g.mean(-1, keepdims=True)
        dx *= rstd
    dy64 = dy.astype(np.float64)
    outputs = [dx.reshape(x.shape), _common.sum_to_shape(dy64 * x_hat.reshape(x.shape), scale.shape)]
    if layer_norm:
        outputs.append(_common.sum_to_shape(dy64, scale.shape))
    return tuple(value.astype(x.dtype) for value in outputs)


def infer(ctx, op: str, inputs: Sequence[str]) -> None:
    """Type and shape inference for inputs (dy, x, scale, *stats) and outputs
    (dx, then the scale-shaped gradients)."""
    axis = _common.attribute_int(ctx, "axis", ATTRIBUTES["axis"])
    x_type = _common.input_tensor_type(ctx, 1)
    x_dims = _common.known_dims(x_type)
    if x_dims is not None:
        if not x_dims:
            raise NormgradInputError(f"{op}: input 'x' must have rank >= 1; got a scalar")
        axis = _normalised_axis(op, axis, len(x_dims))
        dy_dims = _common.known_dims(_common.input_tensor_type(ctx, 0))
        if dy_dims is not None and not _common.dims_compatible(x_dims, dy_dims):
            raise NormgradInputError(f"{op}: input 'dy' must have the shape of 'x' {x_dims}; got {dy_dims}")
    scale_type = _common.input_tensor_type(ctx, 2)
    scale_dims = _common.known_dims(scale_type)
    if x_dims is not None and scale_dims is not None:
        problem = _scale_error(scale_dims, x_dims, axis)
        if problem:
            raise NormgradInputError(
                f"{op}: input 'scale' {scale_dims} must broadcast to 'x' {x_dims} along the normalised "
                f"axes >= {axis} only: {problem}"
            )
    for index, name in enumerate(inputs[3:], start=3):
        dims = _common.known_dims(_common.input_tensor_type(ctx, index))
        if dims is not None and x_dims is not None and not _common.dims_compatible(dims, stats_shape(x_dims, axis)):
            raise NormgradInputError(
                f"{op}: input '{name}' must have shape {stats_shape(x_dims, axis)} (x's shape with the dims "
                f">= axis set to 1); got {dims}"
            )
    if x_type is not None:
        ctx.set_output_type(0, _common.make_output_type(x_type.elem_type, x_dims))
    if scale_type is not None:
        for index in range(1, ctx.get_num_outputs()):
            if ctx.has_output(index):
                ctx.set_output_type(index, _common.make_output_type(scale_type.elem_type, scale_dims))


def schema(op: str, doc: str, forward: str, statistics: Mapping[str, str], outputs: Sequence[str]) -> OpSchema:
    """The schema of a row-normalisation gradient: inputs (dy, x, scale, *statistics),
    outputs (dx, *scale-shaped gradients), attribute ``axis``, inference :func:`infer`."""
    param = OpSchema.FormalParameter
    optional = OpSchema.FormalParameterOption.Optional
    inputs = ("dy", "x", "scale", *statistics)
    return _common.make_schema(
        op,
        doc,
        inputs=[
            param("dy", "T", f"Gradient of the {forward} output; shape of x."),
            param("x", "T", f"{forward} input, rank >= 1."),
            param("scale", "T", "Scale; broadcasts to x along the axes >= axis only."),
            *(param(name, "U", f"{text}: x's shape with the dims >= axis set to 1.") for name, text in statistics.items()),
        ],
        outputs=[
            param("dx", "T", "Gradient of x."),
            *(param(name, "T", f"Gradient of a {name[1:]} shaped like scale.", param_option=optional) for name in outputs[1:]),
        ],
        type_docs={"T": "Element type of dy, x, scale.", "U": f"Element type of {' and '.join(statistics)}: T or float."},
        infer=lambda ctx: infer(ctx, op, inputs),
        attributes=[OpSchema.Attribute("axis", onnx.helper.make_attribute("axis", ATTRIBUTES["axis"]), "First normalised axis.")],
    )


STATIC_SUM_AXES_OF = (1, 2)
"""(x, scale) input positions: with scale's dims and x's rank known, ``function_body``
takes its reduction axes as constants (``sum_axes``, :func:`_common.static_sum_axes`)."""


def function_body(op: str, inputs: Sequence[str], outputs: Sequence[str], opset: int, sum_axes=None) -> onnx.FunctionProto:
    """The operator in standard ONNX ops (float32 arithmetic): LayerNorm's gradient when the
    inputs include ``mean``, RMSNorm's otherwise (see :func:`gradients`).

    Outputs a node does not name are pruned by the runtime.
    """
    rstd_name = inputs[-1]
    layer_norm = "mean" in inputs
    if layer_norm:
        x_hat = """
            mean_f = Cast <to = 1> (mean)
            mu = Reshape <allowzero = 1> (mean_f, rows_1)
            x_centred = Sub (x2, mu)
            x_hat = Mul (x_centred, rstd)"""
    else:
        x_hat = "x_hat = Mul (x2, rstd)"
    sums = [("dscale", "dy_x_hat"), ("dbias", "dyf")][: len(outputs) - 1]
    return onnx.parser.parse_function(
        f"""
        <domain: "{_common.DOMAIN}", opset_import: ["" : {opset}]>
        {op} <axis: int = {ATTRIBUTES["axis"]}> ({", ".join(inputs)}) => ({", ".join(outputs)})
        {{
            xf = Cast <to = 1> (x)
            dyf = Cast <to = 1> (dy)
            scalef = Cast <to = 1> (scale)
            rstd_f = Cast <to = 1> ({rstd_name})
            x_shape = Shape (x)
            lead = Shape <end: int = @axis> (x)
            tail = Shape <start: int = @axis> (x)
            one_int = Constant <value_ints = [1]> ()
            lead_1 = Concat <axis = 0> (one_int, lead)
            n_rows = ReduceProd <keepdims = 1> (lead_1)
            d = ReduceProd <keepdims = 1> (tail)
            rows_d = Concat <axis = 0> (n_rows, d)
            rows_1 = Concat <axis = 0> (n_rows, one_int)
            x2 = Reshape <allowzero = 1> (xf, rows_d)
            g_full = Mul (dyf, scalef)
            g = Reshape <allowzero = 1> (g_full, rows_d)
            rstd = Reshape <allowzero = 1> (rstd_f, rows_1)
            last = Constant <value_ints = [-1]> ()
            d_cast = Cast <to = 1> (d)
            one_float = Constant <value_float = 1.0> ()
            d_float = Max (d_cast, one_float)
            {x_hat}
            {_common.normalization_grad_body("rstd", "d_float", layer_norm, "scale", "scalef", sums, sum_axes)}
        }}
        """
    )
