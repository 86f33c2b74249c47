"""Resize (opsets 11-19; Upsample and Resize-10 arrive converted, see ``rewrites``): modes
nearest, linear and cubic, every coordinate_transformation_mode but tf_crop_and_resize,
scales or sizes (constant or computed), ``axes``, antialias.

Resize is separable and linear in its input: along each resized axis k, y = A_k x with a
matrix A_k [out_k, in_k] that depends only on the sizes, the scale and the attributes. The
gradient contracts dy with A_k along each such axis. A_k^T is built in the graph by the very
same Resize applied to an identity matrix [in_k, in_k] along its second axis (scale 1 on
the first), so it matches onnxruntime's forward weights whatever the mode, for any image
size. Where the forward is a plain nearest repeat (an integral constant scale s whose
coordinates round each output j to j // s: asymmetric with floor, half_pixel or
pytorch_half_pixel with round_prefer_*), dy is summed over a [in_k, s] view instead.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.graphs.rules.registry import UnsupportedOperatorError, register

__all__ = ["resize_gradient"]

_KEPT_ATTRIBUTES = ("mode", "coordinate_transformation_mode", "cubic_coeff_a", "exclude_outside",
                    "extrapolation_value", "nearest_mode", "antialias")


def _size_entries(ctx: GradientContext, name: str) -> Optional[list]:
    """The entries of int64 1-D value ``name`` as far as the graph fixes them: an int, or
    ``(value, k)`` for dim k of ``value`` read with Shape; None if not even the length is known."""
    constant = ctx.constant(name)
    if constant is not None:
        return [int(v) for v in np.asarray(constant).reshape(-1)]
    node = ctx.producer(name)
    if node is None:
        return None
    if node.op_type == "Cast":
        return _size_entries(ctx, node.input[0])
    if node.op_type == "Concat":
        parts = [_size_entries(ctx, part) for part in node.input]
        return None if any(p is None for p in parts) else [e for p in parts for e in p]
    if node.op_type == "Shape":
        shape = ctx.shape(node.input[0])
        if shape is None:
            return None
        dims = list(range(len(shape)))[slice(attr(node, "start", 0), attr(node, "end", None))]
        return [(node.input[0], k) for k in dims]
    if node.op_type == "Slice" and len(node.input) >= 3:
        data = _size_entries(ctx, node.input[0])
        bounds = [ctx.constant(i) if i else None for i in node.input[1:5]]
        if data is None or any(b is None for b in bounds[:2]) or any(
            i and b is None for i, b in zip(node.input[3:5], bounds[2:])
        ):
            return None
        axes, steps = bounds[2] if len(bounds) > 2 else None, bounds[3] if len(bounds) > 3 else None
        if axes is not None and [int(a) for a in np.reshape(axes, -1)] not in ([0], [-1]):
            return None
        step = 1 if steps is None else int(np.reshape(steps, -1)[0])
        start, end = (int(np.reshape(b, -1)[0]) for b in bounds[:2])
        return data[slice(start, end, step)]
    return None


def _unchanged(ctx: GradientContext, x: str, axis: int, scale, size) -> bool:
    """Whether the forward provably leaves ``axis`` as it is (scale 1 or the same size)."""
    if scale is not None:
        return scale == 1
    dim = ctx.shape(x)[axis]
    return size == (x, axis) or (isinstance(dim, int) and size == dim)


def _interpolation(ctx: GradientContext, node: onnx.NodeProto, axis: int, scale_or_size: Tuple[str, str]) -> str:
    """A_k^T [in_k, out_k]: the node's Resize applied to an identity along its second axis."""
    x = node.input[0]
    n = ctx.shape_of(x, start=axis, end=axis + 1)
    blank = ctx.op("ConstantOfShape", ctx.op("Concat", n, n, axis=0), value=onh.from_array(np.zeros(1, np.float32)))
    elem_type = ctx.elem_type(x)
    eye = ctx.op("EyeLike", blank, dtype=elem_type) if elem_type else ctx.op("CastLike", ctx.op("EyeLike", blank), x)
    kind, value = scale_or_size
    if kind == "scales":  # float32, as Resize's scales always are
        inputs = [eye, "", ctx.op("Concat", ctx.op("Constant", value=onh.from_array(np.ones(1, np.float32))), value, axis=0)]
    else:
        inputs = [eye, "", "", ctx.op("Concat", n, value, axis=0)]
    attrs = {name: attr(node, name, None) for name in _KEPT_ATTRIBUTES}
    return ctx.op("Resize", *inputs, **attrs)


def _contract(ctx: GradientContext, grad: str, matrix: str, axis: int, rank: int) -> str:
    """``grad`` with its ``axis`` (out_k) contracted against ``matrix`` [in_k, out_k]."""
    if axis == rank - 2:
        return ctx.op("MatMul", matrix, grad)
    if axis == rank - 1:
        return ctx.op("MatMul", grad, ctx.op("Transpose", matrix, perm=[1, 0]))
    perm = list(range(rank))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    moved = ctx.op("MatMul", ctx.op("Transpose", grad, perm=perm), ctx.op("Transpose", matrix, perm=[1, 0]))
    return ctx.op("Transpose", moved, perm=perm)


def _is_repeat(node: onnx.NodeProto, scale) -> bool:
    """Whether nearest with integral ``scale`` maps output j to input j // scale."""
    if attr(node, "mode", "nearest") != "nearest" or scale is None or scale < 1 or scale != int(scale):
        return False
    coordinates = attr(node, "coordinate_transformation_mode", "half_pixel")
    rounding = attr(node, "nearest_mode", "round_prefer_floor")
    if coordinates == "asymmetric":
        return rounding == "floor"
    return coordinates in ("half_pixel", "pytorch_half_pixel") and rounding.startswith("round_prefer")


@register("Resize")
def resize_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dy contracted with A_k along each resized axis; nearest repeats summed over [in_k, s] views."""
    x, dy = node.input[0], grads[0]
    rank = ctx.rank(x, node)
    if attr(node, "coordinate_transformation_mode", "half_pixel") == "tf_crop_and_resize":
        raise UnsupportedOperatorError(f"{describe(node)}: Resize with coordinate_transformation_mode "
                                       "tf_crop_and_resize is not supported")
    scales = node.input[2] if len(node.input) > 2 and node.input[2] else None
    sizes = node.input[3] if len(node.input) > 3 and node.input[3] else None
    if scales is not None and ctx.constant(scales) is not None and ctx.constant(scales).size == 0:
        scales = None  # opset 11's placeholder when sizes are given
    if sizes is not None and attr(node, "keep_aspect_ratio_policy", "stretch") != "stretch":
        raise UnsupportedOperatorError(f"{describe(node)}: Resize with sizes and keep_aspect_ratio_policy "
                                       f"{attr(node, 'keep_aspect_ratio_policy', '')} is not supported")
    if scales is None and sizes is None:
        raise UnsupportedOperatorError(f"{describe(node)}: Resize without scales or sizes")
    axes = [a % rank for a in attr(node, "axes", range(rank))]
    constant_scales = ctx.constant(scales) if scales is not None else None
    entries = _size_entries(ctx, sizes) if sizes is not None else None
    repeats = {}
    contracted = []
    shifts = attr(node, "coordinate_transformation_mode", "half_pixel") == "tf_half_pixel_for_nn"  # even at scale 1
    for j, axis in enumerate(axes):
        scale = float(np.reshape(constant_scales, -1)[j]) if constant_scales is not None else None
        size = entries[j] if entries is not None and len(entries) == len(axes) else None
        if not shifts and _unchanged(ctx, x, axis, scale, size):
            continue
        if _is_repeat(node, scale):
            repeats[axis] = int(scale)
            continue
        position = ctx.ints([j])
        source = ("scales", ctx.op("Slice", scales, position, ctx.ints([j + 1]))) if scales is not None else (
            "sizes", ctx.op("Slice", sizes, position, ctx.ints([j + 1])))
        contracted.append((axis, source))
    dx = dy
    for axis, source in contracted:
        dx = _contract(ctx, dx, _interpolation(ctx, node, axis, source), axis, rank)
    if repeats:
        pieces = []
        for axis in range(rank):
            pieces.append(ctx.shape_of(x, start=axis, end=axis + 1))
            if axis in repeats:
                pieces.append(ctx.ints([repeats[axis]]))
        grouped = ctx.op("Reshape", dx, ctx.op("Concat", *pieces, axis=0))
        summed_axes = [axis + 1 + sorted(repeats).index(axis) for axis in sorted(repeats)]
        dx = ctx.reduce("ReduceSum", grouped, summed_axes, keepdims=False)
    return [dx]
