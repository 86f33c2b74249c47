"""GroupNormalizationGrad: the input gradient of GroupNorm, plus optional scale/bias gradients.

CANN ops-nn ``GroupNormalizationGrad``; torch ``native_group_norm_backward``.

Inputs:
    x (T): the GroupNorm input, rank 3..8, viewed as [N, G, M] with M = prod(shape[2:]).
    dy (T): the gradient of the GroupNorm output; shape of ``x``.
    gamma (T): the scale, in any shape that broadcasts to ``x`` by NumPy rules: the full
        shape of ``x`` (as in CANN) or e.g. [1, G, C/G, 1] against x shaped
        [N, G, C/G, H*W], so nobody has to materialise a broadcast copy.
    mean (U): [N, G], the per-group mean.
    rstd (U): [N, G], the per-group 1 / sqrt(var + eps).

Outputs:
    dx (T): shape of ``x``.
    dgamma (T, optional): gamma's shape; the sum of dy * x_hat over gamma's broadcast axes.
    dbeta (T, optional): gamma's shape; the sum of dy over gamma's broadcast axes.

With x_hat = (x - mean) * rstd, g = dy * gamma and mean_M the mean over a group:

    dx = rstd * (g - mean_M(g) - x_hat * mean_M(g * x_hat))

That is the gradient of y = gamma * x_hat + beta. **CANN's formula is not**: its page and
kernel compute dx = rstd / M * gamma * (M * dy - s1 - x_hat * s2), with
s1 = sum(dy * gamma), s2 = sum(dy * gamma * x_hat), which agrees with the gradient only
where gamma is 1 everywhere. :func:`cann_formula` keeps it for comparison.

T is float, float16 or bfloat16; U is T or float.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import onnx
import onnx.parser
from onnx.defs import OpSchema

import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError

__all__ = [
    "OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_SHAPE_FROM", "Result",
    "validate", "reference", "cann_formula", "schema", "function_body",
]

OP_TYPE = "GroupNormalizationGrad"
INPUTS = ("x", "dy", "gamma", "mean", "rstd")
OUTPUTS = ("dx", "dgamma", "dbeta")
ATTRIBUTES: dict = {}
_MIN_RANK, _MAX_RANK = 3, 8
OUTPUT_SHAPE_FROM = {"dx": ("x", None), "dgamma": ("gamma", None), "dbeta": ("gamma", None)}
"""Each output's shape as (input, axis): input.shape[axis], or the whole shape for None."""


class Result(NamedTuple):
    """The outputs, all computed by the reference."""

    dx: np.ndarray
    dgamma: Optional[np.ndarray]
    dbeta: Optional[np.ndarray]


def validate(x, dy, gamma, mean, rstd):
    """Checks the inputs against the contract.

    Returns:
        The inputs as arrays, in the order given.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    x = _common.as_float_array(OP_TYPE, "x", x)
    _common.check_rank(OP_TYPE, "x", x, _MIN_RANK, _MAX_RANK)
    dy = _common.as_float_array(OP_TYPE, "dy", dy)
    _common.check_same_shape(OP_TYPE, "dy", dy, "x", x)
    gamma = _common.as_float_array(OP_TYPE, "gamma", gamma)
    if gamma.dtype != x.dtype:
        raise NormgradInputError(f"{OP_TYPE}: input 'gamma' must have the dtype of 'x' ({x.dtype}); got {gamma.dtype}")
    problem = _common.broadcast_error(gamma.shape, x.shape)
    if problem:
        raise NormgradInputError(
            f"{OP_TYPE}: input 'gamma' {list(gamma.shape)} must broadcast to the shape of 'x' "
            f"{list(x.shape)}: {problem}"
        )
    stats = []
    for name, value in (("mean", mean), ("rstd", rstd)):
        array = _common.as_float_array(OP_TYPE, name, value)
        _common.check_vector(OP_TYPE, name, array, x.shape[:2], "[N, G] = x.shape[:2]")
        if array.dtype not in (x.dtype, np.dtype(np.float32)):
            raise NormgradInputError(
                f"{OP_TYPE}: input '{name}' must be float32 or the dtype of 'x' ({x.dtype}); got {array.dtype}"
            )
        stats.append(array)
    if stats[1].dtype != stats[0].dtype:
        raise NormgradInputError(
            f"{OP_TYPE}: input 'rstd' must have the dtype of 'mean' ({stats[0].dtype}); got {stats[1].dtype}"
        )
    return x, dy, gamma, stats[0], stats[1]


def _normalised(x, dy, gamma, mean, rstd):
    """Float64 views [N, G, M] of x_hat, dy * gamma and the per-group rstd."""
    n, groups = x.shape[:2]
    grouped = (n, groups, -1) if x.size else (n, groups, 0)
    rstd64 = rstd.astype(np.float64)[..., None]
    x_hat = (x.astype(np.float64).reshape(grouped) - mean.astype(np.float64)[..., None]) * rstd64
    g = (dy.astype(np.float64) * gamma.astype(np.float64)).reshape(grouped)
    return x_hat, g, rstd64


def reference(x, dy, gamma, mean, rstd) -> Result:
    """The operator in float64 NumPy: the truth every other implementation is tested against.

    Returns:
        A :class:`Result` in T (``x``'s dtype).
    """
    x, dy, gamma, mean, rstd = validate(x, dy, gamma, mean, rstd)
    x_hat, g, rstd64 = _normalised(x, dy, gamma, mean, rstd)
    if x_hat.shape[-1]:
        dx = rstd64 * (g - g.mean(-1, keepdims=True) - x_hat * (g * x_hat).mean(-1, keepdims=True))
    else:
        dx = g
    dy64 = dy.astype(np.float64)
    dgamma = _common.sum_to_shape(dy64 * x_hat.reshape(x.shape), gamma.shape)
    dbeta = _common.sum_to_shape(dy64, gamma.shape)
    return Result(dx.reshape(x.shape).astype(x.dtype), dgamma.astype(x.dtype), dbeta.astype(x.dtype))


def cann_formula(x, dy, gamma, mean, rstd) -> np.ndarray:
    """dx as CANN's page and kernel compute it, in float64. Not the gradient; kept for tests."""
    x, dy, gamma, mean, rstd = validate(x, dy, gamma, mean, rstd)
    x_hat, g, rstd64 = _normalised(x, dy, gamma, mean, rstd)
    gamma_full = np.broadcast_to(gamma.astype(np.float64), x.shape).reshape(x_hat.shape)
    dy3 = dy.astype(np.float64).reshape(x_hat.shape)
    m = x_hat.shape[-1]
    s1 = g.sum(-1, keepdims=True)
    s2 = (g * x_hat).sum(-1, keepdims=True)
    return (rstd64 / m * gamma_full * (m * dy3 - s1 - x_hat * s2)).reshape(x.shape)


def _infer(ctx) -> None:
    x_type = _common.input_tensor_type(ctx, 0)
    x_dims = _common.known_dims(x_type)
    if x_dims is not None and not _MIN_RANK <= len(x_dims) <= _MAX_RANK:
        raise NormgradInputError(f"{OP_TYPE}: input 'x' must have rank 3..8; got rank {len(x_dims)}")
    dy_dims = _common.known_dims(_common.input_tensor_type(ctx, 1))
    if x_dims is not None and dy_dims is not None and not _common.dims_compatible(x_dims, dy_dims):
        raise NormgradInputError(f"{OP_TYPE}: input 'dy' must have the shape of 'x' {x_dims}; got {dy_dims}")
    gamma_type = _common.input_tensor_type(ctx, 2)
    gamma_dims = _common.known_dims(gamma_type)
    if x_dims is not None and gamma_dims is not None:
        problem = _common.broadcast_error(gamma_dims, x_dims)
        if problem:
            raise NormgradInputError(f"{OP_TYPE}: input 'gamma' {gamma_dims} must broadcast to 'x' {x_dims}: {problem}")
    for index in (3, 4):
        dims = _common.known_dims(_common.input_tensor_type(ctx, index))
        expected = x_dims[:2] if x_dims is not None else [None, None]
        if dims is not None and not _common.dims_compatible(dims, expected):
            raise NormgradInputError(
                f"{OP_TYPE}: input '{INPUTS[index]}' must have shape [N, G] = x.shape[:2] {expected}; got {dims}"
            )
    if x_type is not None:
        ctx.set_output_type(0, _common.make_output_type(x_type.elem_type, x_dims))
    if gamma_type is not None:
        for index in (1, 2):
            if ctx.has_output(index):
                ctx.set_output_type(index, _common.make_output_type(gamma_type.elem_type, gamma_dims))


def schema() -> OpSchema:
    """The ONNX schema, with type and shape inference."""
    param = OpSchema.FormalParameter
    optional = OpSchema.FormalParameterOption.Optional
    return _common.make_schema(
        OP_TYPE,
        __doc__,
        inputs=[
            param("x", "T", "GroupNorm input, rank 3..8, viewed as [N, G, M]."),
            param("dy", "T", "Gradient of the GroupNorm output; shape of x."),
            param("gamma", "T", "Scale, any shape that broadcasts to x."),
            param("mean", "U", "Per-group mean, [N, G]."),
            param("rstd", "U", "Per-group 1/sqrt(var + eps), [N, G]."),
        ],
        outputs=[
            param("dx", "T", "Gradient of x."),
            param("dgamma", "T", "Gradient of gamma, gamma's shape.", param_option=optional),
            param("dbeta", "T", "Gradient of beta, gamma's shape.", param_option=optional),
        ],
        type_docs={"T": "Element type of x, dy, gamma.", "U": "Element type of mean and rstd: T or float."},
        infer=_infer,
    )


STATIC_SUM_AXES_OF = (0, 2)
"""(x, gamma) input positions: with gamma's dims and x's rank known, ``function_body``
takes its reduction axes as constants (``sum_axes``, :func:`_common.static_sum_axes`)."""


def function_body(opset: int = _common.ONNX_OPSET, sum_axes=None) -> onnx.FunctionProto:
    """The operator in standard ONNX ops (float32 arithmetic), for runtimes without a kernel;
    ``sum_axes``: the reduction axes to gamma's shape, when known at export.

    Outputs a node does not name are pruned by the runtime.
    """
    return onnx.parser.parse_function(
        f"""
        <domain: "{_common.DOMAIN}", opset_import: ["" : {opset}]>
        {OP_TYPE} (x, dy, gamma, mean, rstd) => (dx, dgamma, dbeta)
        {{
            xf = Cast <to = 1> (x)
            dyf = Cast <to = 1> (dy)
            gammaf = Cast <to = 1> (gamma)
            muf = Cast <to = 1> (mean)
            rstdf = Cast <to = 1> (rstd)
            x_shape = Shape (x)
            n_g = Shape <end = 2> (x)
            group_dims = Shape <start = 2> (x)
            m = ReduceProd <keepdims = 1> (group_dims)
            ngm = Concat <axis = 0> (n_g, m)
            last = Constant <value_ints = [-1]> ()
            mu3 = Unsqueeze (muf, last)
            rstd3 = Unsqueeze (rstdf, last)
            x3 = Reshape <allowzero = 1> (xf, ngm)
            centred = Sub (x3, mu3)
            x_hat = Mul (centred, rstd3)
            g_full = Mul (dyf, gammaf)
            g = Reshape <allowzero = 1> (g_full, ngm)
            m_cast = Cast <to = 1> (m)
            one_float = Constant <value_float = 1.0> ()
            m_float = Max (m_cast, one_float)
            {_common.normalization_grad_body("rstd3", "m_float", True, "gamma", "gammaf", [("dgamma", "dy_x_hat"), ("dbeta", "dyf")], sum_axes)}
        }}
        """
    )
