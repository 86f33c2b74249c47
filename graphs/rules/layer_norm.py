"""LayerNormalization (opset 17+) and RMSNormalization (opset 23), through normgrad
``LayerNormalizationGrad`` and ``RMSNormalizationGrad``.

LayerNormalization: the forward node's optional Mean and InvStdDev outputs are added when
the model omits them, so the backward reads the statistics the forward computed instead of
recomputing them. RMSNormalization-23 has no statistics output: its 1 / sqrt(mean(x²) + eps)
is computed beside it (one pass over x, in float32).

The grad ops run in x's type when that is float, float16 or bfloat16 (float32 statistics
for the 16-bit types, as LayerNormalization's default stash type writes them); a double x
goes through float32 and back. The scale is passed as it is (any shape that varies along the
normalised axes only, the ops' contract), so its gradient comes back in its own shape; a
bias of the scale's shape takes its gradient from the op, any other from a sum of dy.

:func:`row_norm_gradient` is shared with the patterns for the chains exporters write for
these layers (:mod:`normgrad.graphs.patterns.layer_norm_chain`, ``rms_norm_chain``).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import onnx

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.graphs.rules.registry import UnsupportedOperatorError, register
from normgrad.graphs.rules._norm import float32_scalar, inv_rms
from normgrad.ops import DOMAIN

__all__ = ["NATIVE_TYPES", "row_norm_gradient", "layer_norm_gradient", "rms_norm_gradient"]

NATIVE_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})
"""The element types T of x, dy and scale that the grad ops take as they are."""


def _to_type(ctx: GradientContext, name: str, elem_type: Optional[int], to: int) -> str:
    """``name`` (of element type ``elem_type``; None: unknown) cast to ``to`` unless it has it."""
    return name if elem_type == to else ctx.op("Cast", name, to=to)


def _back_to(ctx: GradientContext, grad: str, compute_type: int, like: str) -> str:
    """``grad`` (of ``compute_type``) in the element type of forward value ``like``."""
    return grad if ctx.elem_type(like) == compute_type else ctx.op("CastLike", grad, like)


def row_norm_gradient(
    ctx: GradientContext,
    op_type: str,
    dy: str,
    dy_like: str,
    x: str,
    scale: Optional[str],
    stats: Sequence[Tuple[str, Optional[str]]],
    axis: int,
    bias: Optional[str] = None,
) -> Tuple[str, Optional[str], Optional[str]]:
    """Emits ``op_type`` (LayerNormalizationGrad or RMSNormalizationGrad) for
    y = normalise(x over axes >= axis) * scale (+ bias).

    Args:
        dy: the gradient of y, typed like forward value ``dy_like``.
        x: the forward input (float type).
        scale: the forward scale, or None for none (a scalar one is passed).
        stats: the per-row statistics (mean and inv_std_dev, or inv_rms), x's shape with the
            dims >= axis set to 1, each with a forward value of its element type (None: of
            the grad op's statistics type, as LayerNormalization writes them). Statistics of
            one type, x's or float32, are passed as they are; others are cast to float32.
        bias: the forward bias of a LayerNorm, if its gradient is wanted.

    Returns:
        dx (x's type), and dscale and dbias in their forward types where wanted, else None.
    """
    x_type = ctx.elem_type(x)
    compute = x_type if x_type in NATIVE_TYPES else onnx.TensorProto.FLOAT
    want_scale = scale is not None and ctx.needs_grad(scale)
    want_bias = bias is not None and ctx.needs_grad(bias)
    bias_from_op = want_bias and scale is not None and ctx.static_shape(bias) is not None and ctx.static_shape(bias) == ctx.static_shape(scale)
    if scale is None:
        scale_operand = ctx.scalar(1.0, x) if compute == x_type else float32_scalar(ctx, 1.0)
    else:
        scale_operand = _to_type(ctx, scale, ctx.elem_type(scale), compute)
    types = [ctx.elem_type(like) if like else None for _, like in stats]
    known = set(types) - {None}
    names = [name for name, _ in stats]
    if compute != x_type or len(known) > 1 or not known <= {compute, onnx.TensorProto.FLOAT}:
        # a double x's, a chain's in double, or a mean in x's type beside a float32 inv_std
        names = [n if t == onnx.TensorProto.FLOAT else ctx.op("Cast", n, to=onnx.TensorProto.FLOAT) for n, t in zip(names, types)]
    outputs = [ctx.fresh("dx"), ctx.fresh("dscale") if want_scale else ""]
    if op_type == "LayerNormalizationGrad":
        outputs.append(ctx.fresh("dbias") if bias_from_op else "")
    ctx.op(
        op_type,
        _to_type(ctx, dy, ctx.elem_type(dy_like), compute),
        _to_type(ctx, x, x_type, compute),
        scale_operand,
        *names,
        outputs=outputs,
        domain=DOMAIN,
        axis=axis,
    )
    dx = _back_to(ctx, outputs[0], compute, x)
    dscale = _back_to(ctx, outputs[1], compute, scale) if want_scale else None
    dbias = None
    if bias_from_op:
        dbias = _back_to(ctx, outputs[2], compute, bias)
    elif want_bias:
        dbias = ctx.sum_to(dy, dy_like, bias)
    return dx, dscale, dbias


def _optional_input(node: onnx.NodeProto, index: int) -> Optional[str]:
    return node.input[index] if len(node.input) > index and node.input[index] else None


@register("LayerNormalization", inputs=(0, 1, 2), outputs=None)
def layer_norm_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Gradients of X, Scale and B, from the forward's own Mean and InvStdDev."""
    if any(grads[1:]):
        raise UnsupportedOperatorError(
            f"{describe(node)}: a gradient flows into its Mean or InvStdDev output; only Y's gradient is supported"
        )
    x, scale, bias = node.input[0], node.input[1], _optional_input(node, 2)
    mean = ctx.ensure_output(node, 1, "mean")
    inv_std_dev = ctx.ensure_output(node, 2, "inv_std_dev")
    dx, dscale, dbias = row_norm_gradient(
        ctx, "LayerNormalizationGrad", grads[0], x, x, scale, [(mean, None), (inv_std_dev, None)], attr(node, "axis", -1), bias
    )
    return [dx, dscale, dbias][: len(node.input)]


@register("RMSNormalization", inputs=(0, 1))
def rms_norm_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Gradients of X and scale; 1 / sqrt(mean(x²) + epsilon) recomputed in float32."""
    if any(grads[1:]):
        raise UnsupportedOperatorError(
            f"{describe(node)}: a gradient flows into its InvStdDev output; only Y's gradient is supported"
        )
    x, scale = node.input[:2]
    rank = ctx.rank(x, node)
    axis = attr(node, "axis", -1) % rank
    stats = [(inv_rms(ctx, x, list(range(axis, rank)), attr(node, "epsilon", 1e-5)), None)]
    dx, dscale, _ = row_norm_gradient(ctx, "RMSNormalizationGrad", grads[0], x, x, scale, stats, axis)
    return [dx, dscale]
