"""``com.microsoft`` EmbedLayerNormalization, BERT's embeddings as onnxruntime's transformer
optimizer fuses them: s = word[input_ids] + position[position_ids] (+ segment[segment_ids]),
y = LayerNorm(s over the hidden axis) * gamma + beta.

Inputs: input_ids [B, S] (int32), segment_ids? [B, S], word_embedding [V, H],
position_embedding [P, H], segment_embedding? [G, H], gamma [H], beta? [H], mask? [B, S],
position_ids? ([B, S] or [1, S]; absent: 0 .. S-1 in every row). Outputs: y [B, S, H],
mask_index [B] (int32: no gradient) and embedding_sum? (s, whose gradient joins s's).

The backward reads s from the forward's embedding_sum output (added where the model omits
it), recomputes its row statistics in float32 and takes ds through ``LayerNormalizationGrad``;
each table's gradient is ds's rows added at the rows the lookup read
(:func:`normgrad.graphs.rules.gather.table_gradient`, Gather's).
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules._contrib import TypeOf, input_type
from normgrad.graphs.rules._norm import as_float32, statistics
from normgrad.graphs.rules.gather import table_gradient
from normgrad.graphs.rules.layer_norm import row_norm_gradient
from normgrad.graphs.rules.registry import UnsupportedOperatorError, register

__all__ = ["embed_layer_norm_gradient"]

_IDS, _SEGMENT_IDS, _WORD, _POSITION, _SEGMENT, _GAMMA, _BETA, _MASK, _POSITION_IDS = range(9)
_SUM_OUTPUT = 2
EPSILON = 1e-12
"""EmbedLayerNormalization's default epsilon (its schema's)."""


def _output_types(node: onnx.NodeProto, type_of: TypeOf) -> List[Optional[onnx.TypeProto]]:
    """y and embedding_sum [B, S, H] in the tables' type; mask_index [B] int32."""
    ids, word = input_type(node, type_of, _IDS), input_type(node, type_of, _WORD)
    if ids is None or word is None or not ids.tensor_type.HasField("shape") or not word.tensor_type.HasField("shape"):
        return [None] * len(node.output)
    ids_dims, word_dims = ids.tensor_type.shape.dim, word.tensor_type.shape.dim
    y = onnx.TypeProto()
    y.tensor_type.elem_type = word.tensor_type.elem_type
    y.tensor_type.shape.dim.extend(list(ids_dims) + list(word_dims[1:]))
    mask = onnx.TypeProto()
    mask.tensor_type.elem_type = onnx.TensorProto.INT32
    mask.tensor_type.shape.dim.extend(list(ids_dims[:1]))
    return [y, mask, y][: len(node.output)]


def _optional(node: onnx.NodeProto, index: int) -> Optional[str]:
    return node.input[index] if len(node.input) > index and node.input[index] else None


def _flat_indices(ctx: GradientContext, indices: str, like: str) -> str:
    """``indices`` (int32, broadcast to the shape of ``like``) as 1-D int64."""
    indices = ctx.op("Expand", ctx.op("Cast", indices, to=onnx.TensorProto.INT64), ctx.shape_of(like))
    return ctx.op("Reshape", indices, ctx.ints([-1]))


def _positions(ctx: GradientContext, node: onnx.NodeProto) -> str:
    """The position of each token: position_ids, else 0 .. S-1 along each row of input_ids."""
    ids = node.input[_IDS]
    given = _optional(node, _POSITION_IDS)
    if given is not None:
        return _flat_indices(ctx, given, ids)
    length = ctx.op("Reshape", ctx.shape_of(ids, start=1, end=2), ctx.ints([]))
    zero, one = (ctx.op("Constant", value=onh.from_array(np.asarray(v, np.int64))) for v in (0, 1))
    return _flat_indices(ctx, ctx.op("Range", zero, length, one), ids)


@register("EmbedLayerNormalization", inputs=(_WORD, _POSITION, _SEGMENT, _GAMMA, _BETA), outputs=None, contrib=True,
          output_types=_output_types)
def embed_layer_norm_gradient(ctx: GradientContext, node: onnx.NodeProto,
                              grads: List[Optional[str]]) -> List[Optional[str]]:
    """Gradients of the three embedding tables, gamma and beta."""
    if len(grads) > 1 and grads[1]:
        raise UnsupportedOperatorError(f"a gradient flows into the mask_index output of {node.name or node.op_type}")
    y, gamma, beta = node.output[0], node.input[_GAMMA], _optional(node, _BETA)
    total = ctx.same_type(ctx.ensure_output(node, _SUM_OUTPUT, "embedding_sum"), y)
    parts = [grads[_SUM_OUTPUT]] if len(grads) > _SUM_OUTPUT and grads[_SUM_OUTPUT] else []
    result: List[Optional[str]] = [None] * len(node.input)
    if grads[0]:
        stats = statistics(ctx, as_float32(ctx, total, total), [-1], attr(node, "epsilon", EPSILON), keepdims=True)
        ds, result[_GAMMA], dbeta = row_norm_gradient(ctx, "LayerNormalizationGrad", grads[0], y, total, gamma,
                                                      [(value, None) for value in stats], -1, beta)
        if beta is not None:
            result[_BETA] = dbeta
        parts.insert(0, ds)
    ds = ctx.sum_all(parts)
    lookups = [(_WORD, lambda: _flat_indices(ctx, node.input[_IDS], node.input[_IDS])),
               (_POSITION, lambda: _positions(ctx, node)),
               (_SEGMENT, lambda: _flat_indices(ctx, node.input[_SEGMENT_IDS], node.input[_IDS]))]
    for index, indices in lookups:
        table = _optional(node, index)
        if table is not None and ctx.needs_grad(table):
            result[index] = table_gradient(ctx, table, indices(), ds)
    return result
