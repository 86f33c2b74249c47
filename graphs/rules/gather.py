"""Gather, GatherND (any batch_dims) and GatherElements: the gradient is a scatter-add of dy into zeros of the data's shape.

Indices may be negative (normalized first) and repeat (repeats accumulate: ``reduction="add"``,
opset 16, in an order independent of the thread count); Gather's indices may be scalars.
Along axis 0 of a float32 table the scatter-add is one ``normgrad:EmbeddingGrad`` node
(``normgrad.ops.embedding_grad``: its C++ kernel zero-fills the table and adds the rows,
about 5 times faster than onnxruntime's ScatterElements; its function body is that
ScatterElements form, which ``--inline`` and the portable form write instead).
The indices get no gradient. A Gather from a small float table (at most ``ONE_HOT_ROWS``
rows, axis 0) has its gradient as one GEMM of the indices' one-hot rows with dy instead.
A Gather of a weight whose torch nn.Embedding sets ``padding_idx`` or ``scale_grad_by_freq``
(metadata ``normgrad.embeddings`` of :func:`normgrad.torch.export`) first weighs dy's rows
as torch's embedding backward does.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.graphs.rules.registry import UnsupportedOperatorError, register
from normgrad.graphs.torch_exports import EmbeddingGradient
from normgrad.ops import DOMAIN, embedding_grad

__all__ = ["ONE_HOT_ROWS", "gather_gradient", "table_gradient", "gather_nd_gradient", "gather_elements_gradient"]


def _non_negative(ctx: GradientContext, indices: str, data: str, axis: int) -> str:
    """``indices`` as int64 with negative entries counted from the end of ``data``'s ``axis``."""
    indices = ctx.op("Cast", indices, to=onnx.TensorProto.INT64)
    size = ctx.op("Reshape", ctx.shape_of(data, start=axis, end=axis + 1), ctx.ints([]))  # a scalar
    zero = ctx.op("Constant", value=onnx.numpy_helper.from_array(np.asarray(0, np.int64)))
    return ctx.op("Where", ctx.op("Less", indices, zero), ctx.op("Add", indices, size), indices)


def _zeros(ctx: GradientContext, like: str, shape: str) -> str:
    return ctx.op("Expand", ctx.scalar(0.0, like), shape)


def _scatter_add_rows(ctx: GradientContext, data: str, rank: int, axis: int, flat: str, dy: str,
                      elem_type: Optional[int]) -> str:
    """Zeros shaped like ``data`` (of ``rank``, element type ``elem_type``) plus ``dy``
    scatter-added along ``axis`` at the 1-D non-negative ``flat`` indices; dy has data's axes
    with ``axis`` replaced by any index axes. Along axis 0 of a float32 table, one
    EmbeddingGrad node (whose function body is the ScatterElements form written otherwise)."""
    dy_shape = ctx.op("Concat", ctx.shape_of(data, end=axis), ctx.ints([-1]), ctx.shape_of(data, start=axis + 1), axis=0)
    dy = ctx.op("Reshape", dy, dy_shape)
    along_axis = [1] * axis + [-1] + [1] * (rank - axis - 1)
    indices = ctx.op("Reshape", flat, ctx.ints(along_axis))
    if axis == 0 and elem_type == onnx.TensorProto.FLOAT:
        return ctx.declare(ctx.op(embedding_grad.OP_TYPE, dy, indices, ctx.shape_of(data), domain=DOMAIN), data)
    indices = ctx.op("Expand", indices, ctx.shape_of(dy))
    zeros = _zeros(ctx, data, ctx.shape_of(data))
    return ctx.op("ScatterElements", zeros, indices, dy, axis=axis, reduction="add")


@register("Gather", min_opset=16)
def gather_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """ScatterElements(zeros, indices, dy, axis, reduction="add") with the indices flattened.

    dy has the data's axes before ``axis``, then the indices' axes, then the data's axes
    after ``axis``; it is reshaped to one axis for all index axes, and the flat indices are
    broadcast to its shape. (ScatterND would do without the broadcast, but onnxruntime's
    ScatterND sums repeated indices in an order that depends on the thread count.)
    """
    data, dy = node.input[0], grads[0]
    rank = ctx.rank(data, node)
    axis = attr(node, "axis", 0) % rank
    flat = ctx.op("Reshape", _non_negative(ctx, node.input[1], data, axis), ctx.ints([-1]))
    if rank != 2 or axis != 0:
        return [_scatter_add_rows(ctx, data, rank, axis, flat, dy, ctx.elem_type(data))]
    embedding = _embedding_of(ctx, data)
    if embedding is not None:
        dy = _embedding_lookup_dy(ctx, embedding, data, flat, dy)
    return [table_gradient(ctx, data, flat, dy)]


def table_gradient(ctx: GradientContext, table: str, flat: str, dy: str) -> str:
    """The gradient of 2-D ``table`` whose rows at the 1-D non-negative int64 indices ``flat``
    were read, given those rows' gradients ``dy`` (any shape with the rows' dim last): one GEMM
    of the indices' one-hot rows for a small float32 table, else a scatter-add."""
    rows = (ctx.static_shape(table) or [None])[0]
    if rows is not None and rows <= ONE_HOT_ROWS and ctx.elem_type(table) == onnx.TensorProto.FLOAT:
        return _one_hot_product(ctx, table, rows, flat, dy)
    return _scatter_add_rows(ctx, table, 2, 0, flat, dy, ctx.elem_type(table))


def _embedding_of(ctx: GradientContext, data: str) -> Optional[EmbeddingGradient]:
    """The nn.Embedding semantics of the weight ``data`` reads, through Identity and Cast
    (a tied or bfloat16 weight), or None."""
    while data not in ctx.embeddings:
        producer = ctx.producer(data)
        if producer is None or producer.op_type not in ("Identity", "Cast"):
            return None
        data = producer.input[0]
    return ctx.embeddings[data]


def _embedding_lookup_dy(ctx: GradientContext, embedding: EmbeddingGradient, data: str, flat: str, dy: str) -> str:
    """dy of an nn.Embedding lookup as rows [N, dim] (N: the ``flat`` indices), as torch's
    embedding backward weighs them: the rows reading ``padding_idx`` zero, and with
    ``scale_grad_by_freq`` each row divided by how many of the indices name its row."""
    dy = ctx.op("Reshape", dy, ctx.op("Concat", ctx.ints([-1]), ctx.shape_of(data, start=1), axis=0))
    if embedding.scale_grad_by_freq:
        ones = ctx.op("Expand", ctx.scalar(1.0, data), ctx.shape_of(flat))
        # integer counts below 2**24: exact in float32 whatever the order of the sum
        counts = ctx.op("ScatterElements", _zeros(ctx, data, ctx.shape_of(data, end=1)), flat, ones, axis=0,
                        reduction="add")
        dy = ctx.op("Div", dy, ctx.op("Unsqueeze", ctx.op("Gather", counts, flat), ctx.ints([1])))
    if embedding.padding_idx is not None:
        padding = ctx.op("Constant", value=onh.from_array(np.asarray(embedding.padding_idx, np.int64)))
        reads_padding = ctx.op("Unsqueeze", ctx.op("Equal", flat, padding), ctx.ints([1]))
        dy = ctx.op("Where", reads_padding, ctx.scalar(0.0, data), dy)
    return dy


ONE_HOT_ROWS = 64
"""Tables of at most this many rows (BERT's token types: 2) take their Gather gradient as
one GEMM: at [1024, 256] gradients, 0.13 against 1.8 ms for 2 rows, 0.7 against 2.0 for 64,
even at about 200 (onnxruntime 1.32, 1 thread)."""


def _one_hot_product(ctx: GradientContext, data: str, rows: int, flat: str, dy: str) -> str:
    """Gemm(OneHot(flat, rows), dy, transA=1): each row of the table the sum of the dy rows
    that read it, summed inside the GEMM, whose partition over threads splits the output and
    never the sum (the same bits at any thread count)."""
    on_off = ctx.op("Constant", value=onh.from_array(np.asarray([0.0, 1.0], np.float32)))
    one_hot = ctx.op("OneHot", flat, ctx.op("Constant", value=onh.from_array(np.asarray(rows, np.int64))), on_off,
                     axis=-1)
    dy = ctx.op("Reshape", dy, ctx.op("Concat", ctx.ints([-1]), ctx.shape_of(data, start=1), axis=0))
    return ctx.op("Gemm", one_hot, dy, transA=1)


@register("GatherND", min_opset=16)
def gather_nd_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """GatherND with k-tuples of indices is a Gather along axis 0 of the data viewed as
    [b0 * ... * d(batch_dims + k - 1), rest...] with flat row numbers, each tuple's row offset
    by its batch position (batch_dims leading axes shared by data and indices); its gradient is
    that Gather's, reshaped back. (Not ScatterND: see :func:`gather_gradient`.)"""
    data, indices, dy = node.input[0], node.input[1], grads[0]
    rank, index_shape = ctx.rank(data, node), ctx.shape(indices)
    if index_shape is None or not isinstance(index_shape[-1], int):
        raise UnsupportedOperatorError(
            f"{describe(node)}: GatherND needs a static rank and last dim of its indices for the gradient")
    batch_dims, k = attr(node, "batch_dims", 0), index_shape[-1]
    flat = _batch_positions(ctx, indices, batch_dims, len(index_shape) - 1) if batch_dims else None
    for j in range(k):
        component = ctx.op("Gather", indices, ctx.op("Constant", value=onh.from_array(np.asarray(j, np.int64))), axis=-1)
        component = _non_negative(ctx, component, data, batch_dims + j)
        flat = component if flat is None else ctx.op("Add", ctx.op("Mul", flat, ctx.op(
            "Reshape", ctx.shape_of(data, start=batch_dims + j, end=batch_dims + j + 1), ctx.ints([]))), component)
    rows = ctx.op("Reshape", data, ctx.op("Concat", ctx.ints([-1]), ctx.shape_of(data, start=batch_dims + k), axis=0))
    flat = ctx.op("Reshape", flat, ctx.ints([-1]))
    grad = _scatter_add_rows(ctx, rows, rank - batch_dims - k + 1, 0, flat, dy, ctx.elem_type(data))
    return [ctx.reshape_like(grad, data)]


def _batch_positions(ctx: GradientContext, indices: str, batch_dims: int, tuple_rank: int) -> str:
    """The row-major position of each index tuple's batch among the batch_dims leading axes,
    shaped [b0, ..., b(batch_dims-1), 1, ...] (``tuple_rank`` axes: the indices' less the last)."""
    batch_shape = ctx.shape_of(indices, end=batch_dims)
    zero, one = (ctx.op("Constant", value=onh.from_array(np.asarray(v, np.int64))) for v in (0, 1))
    count = ctx.op("ReduceProd", batch_shape, keepdims=0)
    shape = ctx.op("Concat", batch_shape, ctx.ints([1] * (tuple_rank - batch_dims)), axis=0)
    return ctx.op("Reshape", ctx.op("Range", zero, count, one), shape)


@register("GatherElements", min_opset=16)
def gather_elements_gradient(
    ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]
) -> List[Optional[str]]:
    """ScatterElements(zeros, indices, dy, axis, reduction="add")."""
    data, indices, dy = node.input[0], node.input[1], grads[0]
    axis = attr(node, "axis", 0) % ctx.rank(data, node)
    indices = _non_negative(ctx, indices, data, axis)
    zeros = _zeros(ctx, data, ctx.shape_of(data))
    return [ctx.op("ScatterElements", zeros, indices, dy, axis=axis, reduction="add")]
