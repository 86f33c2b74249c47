"""com.microsoft MatMulNBits, onnxruntime's block-quantized MatMul (what onnxruntime-genai's
builder writes for an int4 or int8 LLM): Y = A @ dequant(B)^T (+ bias).

The packed weight, its scales and zero points are frozen: they get no gradient, only A (and a
float bias) do. dA = dY @ dequant(B), dequantized in the backward node by node, as onnxruntime
dequantizes it (``matmul_nbits.cc``): B [N, k_blocks, blob] holds ``bits``-bit unsigned values
low bits first; W[n, k] = (q[n, k] - zp[n, b]) * scale[n, b] with b = k // block_size (or
``g_idx[k]``), zp packed like B when uint8, 2^(bits-1) when absent, a float when given as one.
onnxruntime frees each dequantized weight after its product: one layer's float32 weight is
alive at a time, never the model's.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext, UnsupportedOperatorError, attr, describe
from normgrad.graphs.rules.registry import register

__all__ = ["matmul_nbits_gradient", "dequantized_weight"]

_A, _B, _SCALES, _ZERO_POINTS, _G_IDX, _BIAS = range(6)


@register("MatMulNBits", inputs=(_A, _BIAS), contrib=True)
def matmul_nbits_gradient(ctx: GradientContext, node: onnx.NodeProto,
                          grads: List[Optional[str]]) -> List[Optional[str]]:
    """dA = dY @ dequant(B) (B frozen); dbias = dY summed over A's leading axes."""
    a, dy, y = node.input[_A], grads[0], node.output[0]
    result: List[Optional[str]] = [None] * len(node.input)
    if ctx.needs_grad(a):
        weight = dequantized_weight(ctx, node)  # [N, K]
        flat = ctx.op("Flatten", dy, axis=-1)
        result[_A] = ctx.reshape_like(ctx.op("MatMul", flat, weight), a)
    if len(node.input) > _BIAS and ctx.needs_grad(node.input[_BIAS]):
        result[_BIAS] = ctx.sum_to(dy, y, node.input[_BIAS])
    return result


def dequantized_weight(ctx: GradientContext, node: onnx.NodeProto) -> str:
    """The float weight W [N, K] of MatMulNBits ``node``, written in standard ops (elementwise,
    exact: the same float32 products onnxruntime's dequantization makes).

    Raises:
        UnsupportedOperatorError: bits other than 4 or 8.
    """
    k, n = attr(node, "K", 0), attr(node, "N", 0)
    bits, block_size = attr(node, "bits", 4), attr(node, "block_size", 0)
    if bits not in (4, 8):
        raise UnsupportedOperatorError(f"{describe(node)}: bits={bits}; the MatMulNBits rule covers bits 4 and 8")
    blocks = -(-k // block_size)
    like = node.input[_SCALES]
    packed = ctx.op("Cast", node.input[_B], to=ctx.elem_type(like))  # [N, blocks, blob] bytes as floats
    quantized = _unpacked(ctx, packed, bits, like, [n, blocks * block_size])  # [N, blocks * block_size]
    scales = ctx.op("Reshape", node.input[_SCALES], ctx.ints([n, blocks]))
    zero_points = _zero_points(ctx, node, bits, n, blocks, like)  # [N, blocks]
    g_idx = node.input[_G_IDX] if len(node.input) > _G_IDX and node.input[_G_IDX] else None
    if g_idx is None:  # per block: [N, blocks, block_size] against [N, blocks, 1]
        grouped = ctx.op("Reshape", quantized, ctx.ints([n, blocks, block_size]))
        centred = ctx.op("Sub", grouped, ctx.unsqueeze(zero_points, [2]))
        weight = ctx.op("Mul", centred, ctx.unsqueeze(scales, [2]))
        weight = ctx.op("Reshape", weight, ctx.ints([n, blocks * block_size]))
        return weight if blocks * block_size == k else ctx.op("Slice", weight, ctx.ints([0]), ctx.ints([k]),
                                                              ctx.ints([1]))
    quantized = ctx.op("Slice", quantized, ctx.ints([0]), ctx.ints([k]), ctx.ints([1]))
    groups = ctx.op("Cast", g_idx, to=onnx.TensorProto.INT64)
    centred = ctx.op("Sub", quantized, ctx.op("Gather", zero_points, groups, axis=1))
    return ctx.op("Mul", centred, ctx.op("Gather", scales, groups, axis=1))


def _unpacked(ctx: GradientContext, packed: str, bits: int, like: str, shape: List[int]) -> str:
    """The ``bits``-bit values of bytes ``packed`` (as floats), low bits first, reshaped to ``shape``."""
    if bits == 8:
        return ctx.op("Reshape", packed, ctx.ints(shape))
    high = ctx.op("Floor", ctx.op("Div", packed, ctx.scalar(16.0, like)))
    low = ctx.op("Sub", packed, ctx.op("Mul", high, ctx.scalar(16.0, like)))
    pairs = ctx.op("Concat", ctx.unsqueeze(low, [-1]), ctx.unsqueeze(high, [-1]), axis=-1)
    return ctx.op("Reshape", pairs, ctx.ints(shape))


def _zero_points(ctx: GradientContext, node: onnx.NodeProto, bits: int, n: int, blocks: int, like: str) -> str:
    """The zero points as floats [N, blocks]: unpacked from uint8, as given when float, or the default 2^(bits-1)."""
    name = node.input[_ZERO_POINTS] if len(node.input) > _ZERO_POINTS else ""
    if not name:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(ctx.elem_type(like))
        return ctx.op("Constant", value=onh.from_array(np.full((n, blocks), 2 ** (bits - 1), dtype)))
    if ctx.elem_type(name) != onnx.TensorProto.UINT8:
        return ctx.op("Reshape", name, ctx.ints([n, blocks]))
    per_row = -(-blocks * bits // 8)
    packed = ctx.op("Reshape", ctx.op("Cast", name, to=ctx.elem_type(like)), ctx.ints([n, per_row]))
    unpacked = _unpacked(ctx, packed, bits, like, [n, per_row * 8 // bits])
    if per_row * 8 // bits == blocks:
        return unpacked
    return ctx.op("Slice", unpacked, ctx.ints([0]), ctx.ints([blocks]), ctx.ints([1]))
