"""torch's TorchScript GroupNorm: Reshape → InstanceNormalization → Reshape → Mul → Add.

``torch.onnx.export(..., dynamo=False)`` writes ``nn.GroupNorm(G, C)`` on x [N, C, *] as

    v = Reshape(x, [0, G, -1])                  # [N, G, C/G * spatial]
    n = InstanceNormalization(v, ones(G), zeros(G))   # Constant nodes
    r = Reshape(n, Shape(x))
    y = Add(Mul(r, w), b)                       # w, b: Unsqueeze(weight / bias) to [C, 1, ...],
                                                # folded [C, 1, ...] initializers, or Constant
                                                # ones/zeros [1, 1, ...] without affine

Node by node, the gradient is a ``GroupNormalizationGrad`` with gamma = ones plus a Mul
and two ReduceSum passes over the data for the affine. Here the whole chain becomes one
``GroupNormalizationGrad`` on the view [N, G, C/G, spatial] with gamma = w reshaped to
[1, G, C/G, 1] (no broadcast copy), as the opset-21 GroupNormalization rule does; dgamma
and dbeta come from its optional outputs, reshaped to the shapes of w and b (from there the
Unsqueeze rules carry them to the parameters).

Matched strictly, else the general rules apply: every node in the default domain; the
first Reshape's target a fixed [0 | N, G, -1] (or a static shape equal to [N, G, -1]) with
C a static multiple of G; the InstanceNormalization scale/bias fixed all-ones/all-zeros of
length G (a Constant, or an initializer that needs no gradient); the second Reshape's
target ``Shape(x)`` or a static shape equal to x's; w and b of static shapes that
broadcast along the channel axis only ([C, 1, ...] or all ones, rank at most x's); and each
intermediate value read by the next node of the chain only, once, and not a graph output
(otherwise it would need its own gradient).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import onnx

from normgrad.graphs.context import FLOAT_ELEM_TYPES, GradientContext, attr
from normgrad.graphs.patterns.registry import GraphView, Match, register
from normgrad.graphs.rules._norm import as_float32, statistics
from normgrad.ops import DOMAIN

__all__ = ["PATTERN", "match_torch_group_norm"]

PATTERN = "torch_group_norm"


def _is(node: Optional[onnx.NodeProto], op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _groups(ctx: GradientContext, reshape: onnx.NodeProto, x_shape: Sequence) -> Optional[int]:
    """G if ``reshape`` turns x into [N, G, prod(x.shape[1:])], else None."""
    if len(reshape.input) < 2:
        return None
    target = ctx.constant(reshape.input[1])
    if target is not None:
        target = np.asarray(target).reshape(-1)
        if target.dtype != np.int64 or target.size != 3 or target[1] <= 0:
            return None
        batch, groups, rest = (int(v) for v in target)
        allowzero = attr(reshape, "allowzero", 0)
        batch_ok = (batch == 0 and not allowzero) or (isinstance(x_shape[0], int) and batch == x_shape[0])
        rest_ok = rest == -1 or (all(isinstance(d, int) for d in x_shape[1:]) and rest * groups == int(np.prod(x_shape[1:])))
        return groups if batch_ok and rest_ok else None
    out_shape = ctx.static_shape(reshape.output[0])
    if out_shape is None or len(out_shape) != 3 or not all(isinstance(d, int) for d in x_shape):
        return None
    batch, groups, rest = out_shape
    if batch != x_shape[0] or groups <= 0 or groups * rest != int(np.prod(x_shape[1:])):
        return None
    return groups


def _restores_shape(view: GraphView, ctx: GradientContext, reshape: onnx.NodeProto, x: str) -> bool:
    """Whether ``reshape`` gives back x's shape: target Shape(x), or equal static shapes."""
    if len(reshape.input) < 2:
        return False
    shape_node = view.producer.get(reshape.input[1])
    if (
        _is(shape_node, "Shape")
        and shape_node.input[0] == x
        and attr(shape_node, "start", 0) == 0
        and attr(shape_node, "end", None) is None
    ):
        return True
    x_shape, out_shape = ctx.static_shape(x), ctx.static_shape(reshape.output[0])
    return x_shape is not None and out_shape is not None and x_shape == out_shape


def _affine_kind(ctx: GradientContext, name: str, rank: int, channels: int) -> Optional[str]:
    """"channel" for a static shape [C, 1, ...] aligned with x's axis 1, "scalar" for all
    ones (rank at most x's), None otherwise."""
    shape = ctx.static_shape(name)
    if shape is None or len(shape) > rank:
        return None
    lead, kind = rank - len(shape), "scalar"
    for i, dim in enumerate(shape):
        if dim == 1:
            continue
        if lead + i == 1 and dim == channels:
            kind = "channel"
            continue
        return None
    return kind


def _fixed_filled(ctx: GradientContext, name: str, fill: float, groups: int) -> bool:
    if not name or ctx.needs_grad(name):
        return False
    value = ctx.constant(name)
    return value is not None and value.shape == (groups,) and bool(np.all(value == fill))


@register(PATTERN)
def match_torch_group_norm(view: GraphView, ctx: GradientContext, add: onnx.NodeProto) -> Optional[Match]:
    """The chain ending at ``add``, or None."""
    if not _is(add, "Add") or len(add.input) != 2:
        return None
    for mul_index in (0, 1):
        mul = view.producer.get(add.input[mul_index])
        if _is(mul, "Mul") and len(mul.input) == 2 and view.only_consumer(mul.output[0], add):
            for reshape_index in (0, 1):
                found = _match_chain(view, ctx, add, mul, add.input[1 - mul_index], reshape_index)
                if found is not None:
                    return found
    return None


def _match_chain(
    view: GraphView, ctx: GradientContext, add: onnx.NodeProto, mul: onnx.NodeProto, bias: str, reshape_index: int
) -> Optional[Match]:
    back = view.producer.get(mul.input[reshape_index])
    weight = mul.input[1 - reshape_index]
    if not _is(back, "Reshape") or not view.only_consumer(back.output[0], mul):
        return None
    norm = view.producer.get(back.input[0])
    if not _is(norm, "InstanceNormalization") or len(norm.input) != 3 or not view.only_consumer(norm.output[0], back):
        return None
    grouped = view.producer.get(norm.input[0])
    if not _is(grouped, "Reshape") or not view.only_consumer(grouped.output[0], norm):
        return None
    x = grouped.input[0]
    x_shape = ctx.shape(x)
    if ctx.elem_type(x) not in FLOAT_ELEM_TYPES or x_shape is None or len(x_shape) < 2:
        return None
    channels = x_shape[1]
    groups = _groups(ctx, grouped, x_shape)
    if not isinstance(channels, int) or channels <= 0 or groups is None or channels % groups:
        return None
    if not (_fixed_filled(ctx, norm.input[1], 1.0, groups) and _fixed_filled(ctx, norm.input[2], 0.0, groups)):
        return None
    if not _restores_shape(view, ctx, back, x):
        return None
    rank = len(x_shape)
    weight_kind, bias_kind = _affine_kind(ctx, weight, rank, channels), _affine_kind(ctx, bias, rank, channels)
    if weight_kind is None or bias_kind is None:
        return None
    epsilon = attr(norm, "epsilon", 1e-5)

    def gradient(ctx: GradientContext, dy: str) -> List[Tuple[str, str]]:
        return _gradient(ctx, dy, x, weight, bias, groups, epsilon, weight_kind, bias_kind)

    return Match(PATTERN, add, [add, mul, back, norm, grouped], gradient)


def _gradient(
    ctx: GradientContext, dy: str, x: str, weight: str, bias: str, groups: int, epsilon: float,
    weight_kind: str, bias_kind: str,
) -> List[Tuple[str, str]]:
    """dx, dw, db of y = w * group_norm(x) + b through one GroupNormalizationGrad."""
    if not any(ctx.needs_grad(name) for name in (x, weight, bias)):
        return []
    x_shape = ctx.shape(x)
    per_group = x_shape[1] // groups
    if all(isinstance(d, int) for d in x_shape):
        view_dims = [x_shape[0], groups, per_group, int(np.prod(x_shape[2:], dtype=np.int64))]
    else:
        view_dims = [0, groups, per_group, -1]
    want_weight, want_bias = ctx.needs_grad(weight), ctx.needs_grad(bias)
    # gamma per channel, [1, G, C/G, 1], whenever a per-channel gradient is wanted from it
    per_channel = weight_kind == "channel" or (want_bias and bias_kind == "channel")
    gamma_dims = [1, groups, per_group, 1] if per_channel else [1, 1, 1, 1]
    gamma = ctx.op("Reshape", as_float32(ctx, weight, weight), ctx.ints([1, 1, 1, 1] if weight_kind == "scalar" else gamma_dims))
    if per_channel and weight_kind == "scalar":
        gamma = ctx.op("Expand", gamma, ctx.ints(gamma_dims))  # C values, not a copy of x
    view_shape = ctx.ints(view_dims)
    grouped = ctx.op("Reshape", as_float32(ctx, x, x), view_shape)
    mean, rstd = statistics(ctx, grouped, [2, 3], epsilon)
    outputs = [ctx.fresh("dx"), ctx.fresh("dgamma") if want_weight else "", ctx.fresh("dbeta") if want_bias else ""]
    ctx.op(
        "GroupNormalizationGrad",
        grouped,
        ctx.op("Reshape", as_float32(ctx, dy, x), view_shape),
        gamma,
        mean,
        rstd,
        outputs=outputs,
        domain=DOMAIN,
    )
    result: List[Tuple[str, str]] = []
    if ctx.needs_grad(x):
        result.append((x, ctx.op("CastLike", ctx.reshape_like(outputs[0], x), x)))
    for name, kind, grad in ((weight, weight_kind, outputs[1]), (bias, bias_kind, outputs[2])):
        if grad:
            if per_channel and kind == "scalar":
                grad = ctx.reduce("ReduceSum", grad, None, keepdims=False)
            result.append((name, ctx.op("CastLike", ctx.op("Reshape", grad, ctx.ints(ctx.static_shape(name))), name)))
    return result
