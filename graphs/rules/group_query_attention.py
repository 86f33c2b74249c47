"""com.microsoft GroupQueryAttention in training: no KV cache (past absent or zero-length),
query with key and value or packed QKV, rotary from its cos/sin caches (``do_rotary``, either
layout, partial rotary), K/V heads shared by groups of query heads (``kv_num_heads``), a
causal mask, ``local_window_size`` and ``softcap``. ``present_*`` get no gradient.

The forward node stays (onnxruntime's kernel); the backward recomputes the attention
probabilities from the node's inputs in standard ops (the memory of one layer's [B, heads, S,
S] scores, as the forward's own) and differentiates them by hand. The rotary embedding is
y = x * C + perm(x) * S with perm an involution (swap the halves, or the pairs when
interleaved), so its transpose is dx = dy * C + perm(dy * S).

onnxruntime's versions differ in the local window: 1.32's query at i sees the keys j with
i - local_window_size < j <= i, older CPU kernels one key more (i - local_window_size <= j).
The backward asks the runtime that runs it: a GroupQueryAttention node on constants
(onnxruntime folds it at load) tells whether the oldest key of a window-size + 1 prefix is seen.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext, UnsupportedOperatorError, attr, describe
from normgrad.graphs.rules._contrib import TypeOf, input_type, with_last_dim
from normgrad.graphs.rules.registry import register

__all__ = ["group_query_attention_gradient"]

_QUERY, _KEY, _VALUE, _PAST_KEY, _PAST_VALUE = range(5)
_COS, _SIN = 7, 8
_UNCOVERED_INPUTS = {9: "position_ids", 10: "attention_bias", 11: "head_sink"}


def _output_types(node: onnx.NodeProto, type_of: TypeOf) -> List[Optional[onnx.TypeProto]]:
    """The output: the query's type with its last dim num_heads * head_size (present: unknown)."""
    query = input_type(node, type_of, _QUERY)
    dims = query.tensor_type.shape.dim if query is not None and query.tensor_type.HasField("shape") else []
    if not dims or not dims[-1].HasField("dim_value"):
        return [None] * len(node.output)
    heads, kv_heads = attr(node, "num_heads", 0), attr(node, "kv_num_heads", 0)
    packed = _packed(node)
    width = dims[-1].dim_value * heads // (heads + 2 * kv_heads) if packed else dims[-1].dim_value
    return [with_last_dim(query, width)] + [None] * (len(node.output) - 1)


@register("GroupQueryAttention", inputs=(_QUERY, _KEY, _VALUE), outputs=(0,), contrib=True,
          output_types=_output_types)
def group_query_attention_gradient(ctx: GradientContext, node: onnx.NodeProto,
                                   grads: List[Optional[str]]) -> List[Optional[str]]:
    """dQ, dK, dV (or the packed QKV's gradient) of the attention output's gradient."""
    heads, kv_heads, head_size = _check(ctx, node)
    groups = heads // kv_heads
    packed = _packed(node)
    q, k, v = (ctx.op("Split", node.input[_QUERY], ctx.ints([heads * head_size, kv_heads * head_size,
                                                              kv_heads * head_size]), axis=-1, outputs=3)
               if packed else node.input[_QUERY:_VALUE + 1])
    q = ctx.op("Reshape", q, ctx.ints([0, 0, heads, head_size]))  # [B, S, H, D]
    k, v = (ctx.op("Reshape", x, ctx.ints([0, 0, kv_heads, head_size])) for x in (k, v))
    rotary = _rotary_tables(ctx, node, q, head_size) if attr(node, "do_rotary", 0) else None
    if rotary is not None:
        q, k = (_rotate(ctx, x, rotary) for x in (q, k))
    q = ctx.op("Transpose", ctx.op("Reshape", q, ctx.ints([0, 0, kv_heads, groups, head_size])),
               perm=[0, 2, 3, 1, 4])  # [B, G, r, S, D]
    k, v = (ctx.unsqueeze(ctx.op("Transpose", x, perm=[0, 2, 1, 3]), [2]) for x in (k, v))  # [B, G, 1, S, D]
    probabilities, tanh = _probabilities(ctx, node, q, k, head_size)
    dy = ctx.op("Transpose", ctx.op("Reshape", grads[0], ctx.ints([0, 0, kv_heads, groups, head_size])),
                perm=[0, 2, 3, 1, 4])
    dv = ctx.op("MatMul", ctx.op("Transpose", probabilities, perm=[0, 1, 2, 4, 3]), dy)
    dp = ctx.op("MatMul", dy, ctx.op("Transpose", v, perm=[0, 1, 2, 4, 3]))
    row = ctx.reduce("ReduceSum", ctx.op("Mul", dp, probabilities), [-1], keepdims=True)
    ds = ctx.op("Mul", probabilities, ctx.op("Sub", dp, row))
    if tanh is not None:
        ds = ctx.op("Mul", ds, ctx.op("Sub", ctx.scalar(1.0, node.input[_QUERY]), ctx.op("Mul", tanh, tanh)))
    ds = ctx.op("Mul", ds, ctx.scalar(_scale(node, head_size), node.input[_QUERY]))
    dq = ctx.op("MatMul", ds, k)
    dk = ctx.op("MatMul", ctx.op("Transpose", ds, perm=[0, 1, 2, 4, 3]), q)
    dq = ctx.op("Reshape", ctx.op("Transpose", dq, perm=[0, 3, 1, 2, 4]), ctx.ints([0, 0, heads, head_size]))
    dk, dv = (ctx.op("Transpose", ctx.reduce("ReduceSum", x, [2], keepdims=False), perm=[0, 2, 1, 3]) for x in (dk, dv))
    if rotary is not None:
        dq, dk = (_rotate(ctx, x, rotary, transposed=True) for x in (dq, dk))
    dq, dk, dv = (ctx.op("Reshape", x, ctx.ints([0, 0, -1])) for x in (dq, dk, dv))
    result: List[Optional[str]] = [None] * len(node.input)
    if packed:
        result[_QUERY] = ctx.op("Concat", dq, dk, dv, axis=-1)
    else:
        result[_QUERY:_VALUE + 1] = [dq, dk, dv]
    return result


def _check(ctx: GradientContext, node: onnx.NodeProto) -> Tuple[int, int, int]:
    """(num_heads, kv_num_heads, head_size) of a node the rule covers.

    Raises:
        UnsupportedOperatorError: naming what the rule does not cover.
    """
    for index, name in _UNCOVERED_INPUTS.items():
        if len(node.input) > index and node.input[index]:
            raise UnsupportedOperatorError(f"{describe(node)}: input {name} is set; the GroupQueryAttention rule "
                                           f"covers positions 0..S-1 (no past), no attention bias, no head sink")
    if attr(node, "smooth_softmax", 0):
        raise UnsupportedOperatorError(f"{describe(node)}: smooth_softmax=1; the GroupQueryAttention rule covers "
                                       "the plain softmax")
    if attr(node, "local_window_size", -1) == 0:
        raise UnsupportedOperatorError(f"{describe(node)}: local_window_size=0 attends to nothing")
    for index in (_PAST_KEY, _PAST_VALUE):
        if len(node.input) > index and node.input[index] and not _empty(ctx, node.input[index]):
            raise UnsupportedOperatorError(
                f"{describe(node)}: its past ('{node.input[index]}') is not empty; GroupQueryAttention trains without "
                f"a KV cache (normgrad export drops past_key_values.* / present.*)")
    heads, kv_heads = attr(node, "num_heads", 0), attr(node, "kv_num_heads", 0)
    shape = ctx.shape(node.input[_QUERY])
    width = shape[-1] if shape else None
    packed = _packed(node)
    if not isinstance(width, int) or not heads or not kv_heads or heads % kv_heads:
        raise UnsupportedOperatorError(f"{describe(node)}: the query's last dimension is unknown or the heads "
                                       f"({heads}, {kv_heads} KV) do not group")
    return heads, kv_heads, width // (heads + 2 * kv_heads if packed else heads)


def _packed(node: onnx.NodeProto) -> bool:
    """Whether the query input holds Q, K and V (no key input)."""
    return len(node.input) <= _KEY or not node.input[_KEY]


def _empty(ctx: GradientContext, name: str) -> bool:
    """Whether a past input is a zero-length past (a constant or a static shape of length 0)."""
    value = ctx.constant(name)
    shape = value.shape if value is not None else ctx.shape(name)
    return shape is not None and len(shape) == 4 and shape[2] == 0


def _scale(node: onnx.NodeProto, head_size: int) -> float:
    return attr(node, "scale", 0.0) or head_size ** -0.5


def _probabilities(ctx: GradientContext, node: onnx.NodeProto, q: str, k: str,
                   head_size: int) -> Tuple[str, Optional[str]]:
    """The softmax probabilities [B, G, r, S, S] of scaled (and soft-capped) scores under the
    causal (and local window) mask; and the softcap's tanh, None without one."""
    like = node.input[_QUERY]
    scores = ctx.op("Mul", ctx.op("MatMul", q, ctx.op("Transpose", k, perm=[0, 1, 2, 4, 3])),
                    ctx.scalar(_scale(node, head_size), like))
    softcap, tanh = attr(node, "softcap", 0.0), None
    if softcap > 0:
        tanh = ctx.op("Tanh", ctx.op("Div", scores, ctx.scalar(softcap, like)))
        scores = ctx.op("Mul", tanh, ctx.scalar(softcap, like))
    length = ctx.op("Shape", like, start=1, end=2)
    positions = ctx.op("Range", _int(ctx, 0), ctx.op("Squeeze", length), _int(ctx, 1))
    rows, cols = ctx.unsqueeze(positions, [1]), ctx.unsqueeze(positions, [0])
    allowed = ctx.op("Not", ctx.op("Greater", cols, rows))
    window = attr(node, "local_window_size", -1)
    if window > 0:
        first = ctx.op("Sub", rows, ctx.op("Add", _int(ctx, window), _window_extra(ctx, window)))
        allowed = ctx.op("And", allowed, ctx.op("Greater", cols, first))
    lowest = ctx.scalar(float(np.finfo(np.float32).min), like)
    return ctx.op("Softmax", ctx.op("Where", allowed, scores, lowest), axis=-1), tanh


def _window_extra(ctx: GradientContext, window: int) -> str:
    """1 (int64) where the runtime's GroupQueryAttention with ``local_window_size=window`` lets
    a query see window + 1 keys, 0 where window: the last query of window + 1 positions,
    attending evenly (zero queries and keys), reads a value only the first key holds."""
    length = window + 1
    zeros = np.zeros((1, length, 8), np.float32)
    values = zeros.copy()
    values[0, 0, 0] = 1.0
    inputs = [ctx.op("Constant", value=onh.from_array(x)) for x in (zeros, zeros, values)]
    inputs += ["", "", ctx.op("Constant", value=onh.from_array(np.asarray([length - 1], np.int32))),
               ctx.op("Constant", value=onh.from_array(np.asarray([length], np.int32)))]
    output = ctx.op("GroupQueryAttention", *inputs, domain="com.microsoft", num_heads=1, kv_num_heads=1,
                    local_window_size=window, outputs=3)[0]
    seen = ctx.op("Slice", output, ctx.ints([0, length - 1, 0]), ctx.ints([1, length, 1]))
    zero = ctx.op("Constant", value=onh.from_array(np.asarray(0.0, np.float32)))
    return ctx.op("Cast", ctx.op("Greater", ctx.op("Reshape", seen, ctx.ints([])), zero), to=onnx.TensorProto.INT64)


def _int(ctx: GradientContext, value: int) -> str:
    return ctx.op("Constant", value=onh.from_array(np.asarray(value, np.int64)))


def _rotary_tables(ctx: GradientContext, node: onnx.NodeProto, q: str, head_size: int) -> Tuple[str, str, str]:
    """(C, S [S, 1, D], perm [D]) of the rotary embedding y = x * C + perm(x) * S at positions 0..S-1."""
    cos_cache, sin_cache = node.input[_COS], node.input[_SIN]
    cache_shape = ctx.shape(cos_cache)
    half = cache_shape[-1] if cache_shape else None
    if not isinstance(half, int) or 2 * half > head_size:
        raise UnsupportedOperatorError(f"{describe(node)}: the width of cos_cache ('{cos_cache}') is unknown or "
                                       f"over half the head size {head_size}")
    rotary = 2 * half
    length = ctx.op("Shape", node.input[_QUERY], start=1, end=2)
    cos, sin = (ctx.op("Slice", x, ctx.ints([0]), length, ctx.ints([0])) for x in (cos_cache, sin_cache))
    negative = ctx.op("Neg", sin)
    if attr(node, "rotary_interleaved", 0):
        pairs = lambda a, b: ctx.op("Reshape", ctx.op("Concat", ctx.unsqueeze(a, [-1]), ctx.unsqueeze(b, [-1]), axis=-1),
                                    ctx.ints([0, rotary]))
        c, s = pairs(cos, cos), pairs(negative, sin)
        perm = [i ^ 1 for i in range(rotary)]
    else:
        c, s = ctx.op("Concat", cos, cos, axis=-1), ctx.op("Concat", negative, sin, axis=-1)
        perm = [*range(half, rotary), *range(half)]
    if rotary < head_size:
        pads = ctx.ints([0, 0, 0, head_size - rotary])
        c = ctx.op("Pad", c, pads, ctx.scalar(1.0, cos_cache))
        s = ctx.op("Pad", s, pads, ctx.scalar(0.0, cos_cache))
        perm += range(rotary, head_size)
    c, s = (ctx.op("CastLike", ctx.unsqueeze(x, [1]), q) for x in (c, s))
    return c, s, ctx.ints(perm)


def _rotate(ctx: GradientContext, x: str, tables: Tuple[str, str, str], transposed: bool = False) -> str:
    """x * C + perm(x) * S, or its transpose dx = x * C + perm(x * S)."""
    c, s, perm = tables
    if transposed:
        return ctx.op("Add", ctx.op("Mul", x, c), ctx.op("Gather", ctx.op("Mul", x, s), perm, axis=-1))
    return ctx.op("Add", ctx.op("Mul", x, c), ctx.op("Mul", ctx.op("Gather", x, perm, axis=-1), s))
