"""Shared by the BatchNorm operators: checks (dy and x of one shape, per-channel vectors [C])
and the fused ReLU backward (the optional ``relu_output`` input)."""

from __future__ import annotations

from typing import Mapping, Optional

import numpy as np

import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError

__all__ = ["MIN_RANK", "MAX_RANK", "RELU_OUTPUT", "RELU_OUTPUT_DOC", "validate", "infer", "relu_select", "relu_select_body"]

MIN_RANK, MAX_RANK = 2, 8

RELU_OUTPUT = "relu_output"
"""The optional trailing input of both operators: the fused ReLU backward."""
RELU_OUTPUT_DOC = """relu_output (T, optional): y, the output of the ReLU that follows the BatchNorm
        (y = max(BatchNorm output, 0)); shape of ``input``, or a scalar (one value for every
        element). Given, the operator uses g = (y > 0 ? grad_out : 0) wherever it reads
        grad_out, so grad_out is the gradient of the ReLU output and the ReLU backward needs
        no tensor of its own (cuDNN's fused BatchNorm-activation backward). A select, as
        torch's threshold_backward: where y <= 0 (and where y is NaN) g is exactly 0, even if
        grad_out is NaN or inf there. Absent: g = grad_out, bit for bit as without the input.
        The ReLU's output rather than its input: it stays alive anyway (the next layer's
        backward reads it), while the BatchNorm output can be freed after the forward."""


def validate(op: str, grad_out, input, per_channel: Mapping[str, Optional[object]], relu_output=None):
    """Checks ``grad_out``/``input``, the per-channel vectors (None ones are skipped) and
    ``relu_output`` (when given).

    Returns:
        ``(dy, x, arrays)`` with ``arrays`` the given vectors by name, and ``relu_output``
        under its name when given, as arrays.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    x = _common.as_float_array(op, "input", input)
    dy = _common.as_float_array(op, "grad_out", grad_out)
    _common.check_rank(op, "input", x, MIN_RANK, MAX_RANK)
    _common.check_same_shape(op, "grad_out", dy, "input", x)
    channels = x.shape[1]
    if channels == 0:
        raise NormgradInputError(f"{op}: input 'input' must have C = shape[1] >= 1; got shape {list(x.shape)}")
    arrays: dict = {}
    for name, value in per_channel.items():
        if value is None:
            continue
        array = _common.as_float_array(op, name, value)
        _common.check_vector(op, name, array, [channels], "C = input.shape[1]")
        first_name, first = next(iter(arrays.items()), (name, array))
        if array.dtype != first.dtype:
            raise NormgradInputError(
                f"{op}: input '{name}' must have the dtype of '{first_name}' ({first.dtype}); got {array.dtype}"
            )
        arrays[name] = array
    if relu_output is not None:
        y = _common.as_float_array(op, RELU_OUTPUT, relu_output)
        if y.ndim != 0 and y.shape != x.shape:
            raise NormgradInputError(
                f"{op}: input '{RELU_OUTPUT}' must have the shape of 'input' {list(x.shape)} or be a scalar; "
                f"got {list(y.shape)}"
            )
        if y.dtype != x.dtype:
            raise NormgradInputError(f"{op}: input '{RELU_OUTPUT}' must have the dtype of 'input' ({x.dtype}); got {y.dtype}")
        arrays[RELU_OUTPUT] = y
    return dy, x, arrays


def relu_select(dy: np.ndarray, relu_output: Optional[np.ndarray]) -> np.ndarray:
    """g = (relu_output > 0 ? dy : 0), exactly 0 where masked even for NaN/inf dy; ``dy``
    itself when ``relu_output`` is None."""
    if relu_output is None:
        return dy
    return np.where(relu_output > 0, dy, np.zeros((), dy.dtype))


def relu_select_body(dy_in: str, dy: str) -> str:
    """Function-body lines (ONNX text): float32 ``dy`` = (relu_output > 0 ? ``dy_in`` : 0),
    as :func:`relu_select` (``relu_output`` is the body's formal input)."""
    return f"""
            relu_zero = Constant <value = float {{0.0}}> ()
            relu_zero_like = CastLike (relu_zero, {RELU_OUTPUT})
            relu_passes = Greater ({RELU_OUTPUT}, relu_zero_like)
            {dy} = Where (relu_passes, {dy_in}, relu_zero)"""


def infer(ctx, op: str, per_channel: Mapping[int, str], relu_output_index: int):
    """Shape inference checks of ``grad_out`` (input 0), ``input`` (input 1), the
    per-channel inputs (index -> name) and ``relu_output`` (at ``relu_output_index``).

    Returns:
        ``(x_type, x_dims, channels)``; dims and channels may be None or symbolic.
    """
    x_type = _common.input_tensor_type(ctx, 1)
    x_dims = _common.known_dims(x_type)
    if x_dims is not None and not MIN_RANK <= len(x_dims) <= MAX_RANK:
        raise NormgradInputError(f"{op}: input 'input' must have rank {MIN_RANK}..{MAX_RANK}; got rank {len(x_dims)}")
    dy_dims = _common.known_dims(_common.input_tensor_type(ctx, 0))
    if x_dims is not None and dy_dims is not None and not _common.dims_compatible(x_dims, dy_dims):
        raise NormgradInputError(f"{op}: input 'grad_out' must have the shape of 'input' {x_dims}; got {dy_dims}")
    channels = x_dims[1] if x_dims is not None else None
    for index, name in per_channel.items():
        dims = _common.known_dims(_common.input_tensor_type(ctx, index))
        if dims is not None and (len(dims) != 1 or not _common.dims_compatible(dims, [channels])):
            raise NormgradInputError(
                f"{op}: input '{name}' must have shape [C] (C = input.shape[1] = {channels}); got {dims}"
            )
    y_dims = _common.known_dims(_common.input_tensor_type(ctx, relu_output_index))
    if x_dims is not None and y_dims and not _common.dims_compatible(x_dims, y_dims):
        raise NormgradInputError(
            f"{op}: input '{RELU_OUTPUT}' must have the shape of 'input' {x_dims} or be a scalar; got {y_dims}"
        )
    return x_type, x_dims, channels
