"""com.microsoft MatMulNBits, onnxruntime's block-quantized MatMul (what onnxruntime-genai's
builder writes for an int4 or int8 LLM): Y = A @ dequant(B)^T (+ bias).

The packed weight, its scales and zero points are frozen: they get no gradient, only A (and a
float bias) do. dA = dY @ dequant(B), dequantized in the backward as onnxruntime dequantizes
(``matmul_nbits.cc``): B [N, k_blocks, blob] holds ``bits``-bit unsigned values low bits first;
W[n, k] = (q[n, k] - zp[n, b]) * scale[n, b] with b = k // block_size (or ``g_idx[k]``), zp
packed like B when uint8, 2^(bits-1) when absent, a float when given as one.

Memory, measured (4 bits, 32000 x 768, block 32, dY of 512 tokens, one thread, peak RSS of
the run over its feeds): the whole weight dequantized per node, +255 MiB; one product per
position in the byte (what this rule writes: [N, K/2] at a time), +58 MiB; the float32
MatMul of the unfused model, +166 MiB (its stored weight). onnxruntime frees each layer's
dequantized halves after their products.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext, UnsupportedOperatorError, attr, describe
from normgrad.graphs.rules._contrib import TypeOf, input_type, with_last_dim
from normgrad.graphs.rules.registry import register

__all__ = ["matmul_nbits_gradient", "input_gradient"]

_A, _B, _SCALES, _ZERO_POINTS, _G_IDX, _BIAS = range(6)


def _output_types(node: onnx.NodeProto, type_of: TypeOf) -> List[Optional[onnx.TypeProto]]:
    """Y: A's type with its last dim N."""
    return [with_last_dim(input_type(node, type_of, _A), attr(node, "N", 0))]


@register("MatMulNBits", inputs=(_A, _BIAS), contrib=True, output_types=_output_types)
def matmul_nbits_gradient(ctx: GradientContext, node: onnx.NodeProto,
                          grads: List[Optional[str]]) -> List[Optional[str]]:
    """dA = dY @ dequant(B) (B frozen); dbias = dY summed over A's leading axes."""
    a, dy, y = node.input[_A], grads[0], node.output[0]
    result: List[Optional[str]] = [None] * len(node.input)
    if ctx.needs_grad(a):
        result[_A] = ctx.reshape_like(input_gradient(ctx, node, ctx.op("Flatten", dy, axis=-1)), a)
    if len(node.input) > _BIAS and ctx.needs_grad(node.input[_BIAS]):
        result[_BIAS] = ctx.sum_to(dy, y, node.input[_BIAS])
    return result


ROWS_ELEMENTS = 1 << 22
"""Dequantized values of one part of the weight (at most 16 MiB of float32) made at a time: a
larger weight (a vocabulary head) is dequantized in chunks of rows, dA summed over them."""


def input_gradient(ctx: GradientContext, node: onnx.NodeProto, dy: str) -> str:
    """dY [T, N] @ dequant(B) [N, K] of MatMulNBits ``node``, one product per position of a
    value in its byte (4 bits: the low values, then the high ones, each [N, K/2]): no float
    copy of the whole weight is made, the columns are interleaved in the [T, K] result. A
    weight of more than :data:`ROWS_ELEMENTS` values per part goes in chunks of rows, their
    products summed (Qwen2-0.5B's tied head, 151936 x 896: 272 MB per part at once otherwise).

    Raises:
        UnsupportedOperatorError: bits other than 4 or 8.
    """
    k, n = attr(node, "K", 0), attr(node, "N", 0)
    bits, block_size = attr(node, "bits", 4), attr(node, "block_size", 0)
    if bits not in (4, 8):
        raise UnsupportedOperatorError(f"{describe(node)}: bits={bits}; the MatMulNBits rule covers bits 4 and 8")
    blocks, per_byte = -(-k // block_size), 8 // bits
    width = blocks * block_size // per_byte  # columns of one part
    like = node.input[_SCALES]
    scales = ctx.op("Reshape", like, ctx.ints([n, blocks]))
    zero_points = _zero_points(ctx, node, bits, n, blocks, like)
    per_block_zero_points = len(node.input) > _ZERO_POINTS and bool(node.input[_ZERO_POINTS])
    g_idx = node.input[_G_IDX] if len(node.input) > _G_IDX and node.input[_G_IDX] else None
    if g_idx is not None:  # [K] -> [blocks * block_size], the padding columns read group 0
        g_idx = ctx.op("Pad", ctx.op("Cast", g_idx, to=onnx.TensorProto.INT64),
                       ctx.ints([0, blocks * block_size - k]))
    rows = max(1, ROWS_ELEMENTS // width)
    # chunk bounds offset by a zero computed at run time: onnxruntime would otherwise fold the
    # slices of the (initializer) weight and scales into copies kept for the session
    zero = ctx.op("Reshape", ctx.op("Cast", _runtime_zero(ctx, dy), to=onnx.TensorProto.INT64), ctx.ints([1])) \
        if rows < n else None
    grad = None
    for first in range(0, n, rows):
        last = min(n, first + rows)

        def chunk(name: str, axis: int = 0) -> str:
            if zero is None:
                return name
            return ctx.op("Slice", name, ctx.op("Add", ctx.ints([first]), zero), ctx.ints([last]), ctx.ints([axis]))

        product = _chunk_product(ctx, chunk(dy, 1), _parts(ctx, chunk(node.input[_B]), bits, dy), chunk(scales),
                                 (chunk(zero_points) if per_block_zero_points else zero_points, per_block_zero_points),
                                 g_idx,
                                 (last - first, blocks, block_size, per_byte))
        grad = product if grad is None else ctx.op("Add", grad, product)
    return grad if blocks * block_size == k else ctx.op("Slice", grad, ctx.ints([0]), ctx.ints([k]), ctx.ints([1]))


def _chunk_product(ctx: GradientContext, dy: str, parts: List[str], scales: str, zero_points: Tuple[str, bool],
                   g_idx: Optional[str], shape: Tuple[int, int, int, int]) -> str:
    """dY [T, n] @ dequant [n, blocks * block_size] of ``n`` rows of the weight: ``parts`` its
    unpacked values [n, blocks, blob] (one per position in the byte), ``scales`` [n, blocks],
    ``zero_points`` ([n, blocks], True) or (a scalar, False); ``shape`` (n, blocks,
    block_size, values per byte)."""
    n, blocks, block_size, per_byte = shape
    width = blocks * block_size // per_byte
    zero_points, per_block_zero_points = zero_points
    products = []
    for part, values in enumerate(parts):
        if g_idx is None:  # per block: [n, blocks, blob] against [n, blocks, 1]
            centred = ctx.op("Sub", ctx.op("CastLike", values, scales),
                             ctx.unsqueeze(zero_points, [2]) if per_block_zero_points else zero_points)
            weight = ctx.op("Mul", centred, ctx.unsqueeze(scales, [2]))
        else:  # per column: the groups of columns part, part + per_byte, ...
            groups = ctx.op("Slice", g_idx, ctx.ints([part]), ctx.ints([blocks * block_size]), ctx.ints([0]),
                            ctx.ints([per_byte]))
            values = ctx.op("Reshape", ctx.op("CastLike", values, scales), ctx.ints([n, width]))
            centred = ctx.op("Sub", values, ctx.op("Gather", zero_points, groups, axis=1)
                             if per_block_zero_points else zero_points)
            weight = ctx.op("Mul", centred, ctx.op("Gather", scales, groups, axis=1))
        products.append(ctx.op("MatMul", dy, ctx.op("Reshape", weight, ctx.ints([n, width]))))
    if per_byte > 1:  # [T, width, per_byte] -> [T, blocks * block_size]
        products = [ctx.op("Reshape", ctx.op("Concat", *(ctx.unsqueeze(p, [-1]) for p in products), axis=-1),
                           ctx.ints([0, blocks * block_size]))]
    return products[0]


def _parts(ctx: GradientContext, packed: str, bits: int, runtime: str) -> List[str]:
    """The ``bits``-bit values of bytes ``packed`` (uint8), low bits first, one tensor per
    position in the byte. The bytes are first shifted by a zero computed from run-time value
    ``runtime`` (BitShift has uint8 kernels in every onnxruntime from 1.19.2 on): onnxruntime
    would otherwise constant-fold the dequantization
    of the (initializer) weight, keeping every layer's float weight alive for the session."""
    zero = ctx.op("Cast", _runtime_zero(ctx, runtime), to=onnx.TensorProto.UINT8)
    return _unpacked_bytes(ctx, ctx.op("BitShift", packed, zero, direction="RIGHT"), bits)


def _runtime_zero(ctx: GradientContext, runtime: str) -> str:
    """False [1, 1] computed from the first value of the 2-D run-time tensor ``runtime``."""
    first = ctx.op("Slice", runtime, ctx.ints([0, 0]), ctx.ints([1, 1]))
    return ctx.op("Less", first, first)


def _unpacked_bytes(ctx: GradientContext, packed: str, bits: int) -> List[str]:
    """The ``bits``-bit values of uint8 ``packed``, low bits first, one tensor per position in
    the byte (shifts only: onnxruntime's BitShift has a uint8 kernel since opset 11)."""
    if bits == 8:
        return [packed]
    four = ctx.op("Constant", value=onh.from_array(np.asarray(4, np.uint8)))
    low = ctx.op("BitShift", ctx.op("BitShift", packed, four, direction="LEFT"), four, direction="RIGHT")
    return [low, ctx.op("BitShift", packed, four, direction="RIGHT")]


def _zero_points(ctx: GradientContext, node: onnx.NodeProto, bits: int, n: int, blocks: int, like: str) -> str:
    """The zero points as floats [N, blocks] (unpacked from uint8, or as given when float), or
    the default 2^(bits-1) as a scalar."""
    name = node.input[_ZERO_POINTS] if len(node.input) > _ZERO_POINTS else ""
    if not name:
        return ctx.scalar(float(2 ** (bits - 1)), like)
    if ctx.elem_type(name) != onnx.TensorProto.UINT8:
        return ctx.op("Reshape", name, ctx.ints([n, blocks]))
    per_row = -(-blocks * bits // 8)
    packed = ctx.op("Reshape", name, ctx.ints([n, per_row, 1]))
    parts = ctx.op("Concat", *_unpacked_bytes(ctx, packed, bits), axis=-1)  # [N, per_row, values per byte]
    unpacked = ctx.op("Reshape", ctx.op("CastLike", parts, like), ctx.ints([n, -1]))
    return unpacked if per_row * 8 // bits == blocks else ctx.op("Slice", unpacked, ctx.ints([0]),
                                                                 ctx.ints([blocks]), ctx.ints([1]))
