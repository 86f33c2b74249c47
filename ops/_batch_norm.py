"""Checks shared by the BatchNorm operators: dy and x of one shape, per-channel vectors [C]."""

from __future__ import annotations

from typing import Mapping, Optional

import numpy as np

from normgrad.ops import _common
from normgrad.ops._common import NormgradInputError

__all__ = ["MIN_RANK", "MAX_RANK", "validate", "infer"]

MIN_RANK, MAX_RANK = 2, 8


def validate(op: str, grad_out, input, per_channel: Mapping[str, Optional[object]]):
    """Checks ``grad_out``/``input`` and the per-channel vectors (None ones are skipped).

    Returns:
        ``(dy, x, arrays)`` with ``arrays`` the given vectors by name, as arrays.

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
    return dy, x, arrays


def infer(ctx, op: str, per_channel: Mapping[int, str]):
    """Shape inference checks of ``grad_out`` (input 0), ``input`` (input 1) and the
    per-channel inputs (index -> name).

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
    return x_type, x_dims, channels
