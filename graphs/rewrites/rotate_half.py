"""The rotary position embedding of Llama and its relatives, ``x * cos + Concat(-x2, x1) * sin``
(x1, x2 the halves of x's last axis, a Split after
:func:`normgrad.graphs.rewrites.tiling_slices.tiling_slices_as_split`), becomes one
``normgrad:RotateHalfEmbedding``: one pass instead of six, the same bits
(:func:`rotate_half_embeddings`).
"""

from __future__ import annotations

from typing import Dict

import onnx
import onnx.helper as oh

from normgrad.graphs.context import attr
from normgrad.graphs.rewrites._graph import RewriteContext, constant_values, float32_dims, replace_chains, value_readers
from normgrad.ops import DOMAIN, rotate_half_embedding

__all__ = ["rotate_half_embeddings", "apply"]


def _rotate_half_parts(graph, node, producer, readers, outputs, dims):
    """(x, cos, sin, the chain's nodes) of ``node`` = Add(Mul(x, cos), Mul(Concat(Neg(x2), x1), sin))
    with (x1, x2) = Split(x) into the halves of its last axis, float32, every intermediate
    read by the chain alone and not a graph output; else None."""
    def standard(n, op_type):
        return n is not None and n.op_type == op_type and n.domain in ("", "ai.onnx")

    def only_for(value, reader):
        return value not in outputs and readers[value] == [reader]

    if not standard(node, "Add") or len(node.input) != 2:
        return None
    for direct, rotated in (tuple(node.input), tuple(reversed(node.input))):
        product, rotation = producer.get(direct), producer.get(rotated)
        if not (standard(product, "Mul") and standard(rotation, "Mul")) or product is rotation:
            continue
        for concat_out, sin in (tuple(rotation.input), tuple(reversed(rotation.input))):
            concat = producer.get(concat_out)
            if not standard(concat, "Concat") or len(concat.input) != 2:
                continue
            neg, split = producer.get(concat.input[0]), producer.get(concat.input[1])
            if not standard(neg, "Neg") or not standard(split, "Split") or producer.get(neg.input[0]) is not split \
                    or list(split.output) != [concat.input[1], neg.input[0]]:
                continue
            x = split.input[0]
            if x not in product.input or len(set(product.input)) != 2:
                continue
            cos = product.input[1] if product.input[0] == x else product.input[0]
            x_dims = dims.get(x)
            if x_dims is None or not x_dims or not isinstance(x_dims[-1], int) or x_dims[-1] % 2:
                continue
            last = len(x_dims) - 1
            if attr(split, "axis", 0) not in (-1, last) or attr(concat, "axis", None) not in (-1, last):
                continue
            if len(split.input) > 1 and split.input[1]:
                sizes = constant_values(graph, split.input[1])
                if sizes is None or sizes.tolist() != [x_dims[-1] // 2] * 2:
                    continue
            if not all(_broadcasts_exactly(dims.get(v), x_dims) for v in (cos, sin)):
                continue
            chain = [split, neg, concat, rotation, product]
            if not (only_for(split.output[0], concat) and only_for(split.output[1], neg)
                    and only_for(neg.output[0], concat) and only_for(concat_out, rotation)
                    and only_for(rotated, node) and only_for(direct, node)):
                continue
            return x, cos, sin, chain
    return None


def _broadcasts_exactly(shape, x_dims) -> bool:
    """Whether a value of ``shape`` surely broadcasts to x's dims without enlarging them, its
    last axis x's (each dim 1, or x's: the same int or the same symbol)."""
    if shape is None or not shape or len(shape) > len(x_dims) or shape[-1] != x_dims[-1]:
        return False
    return all(dim == 1 or (dim is not None and dim == x_dim) for dim, x_dim in zip(reversed(shape), reversed(x_dims)))


def rotate_half_embeddings(model: onnx.ModelProto) -> int:
    """Rewrites, in place, the rotary position embedding ``Add(Mul(x, cos), Mul(Concat(Neg(x2),
    x1), sin))``, (x1, x2) = Split(x) into the two halves of its last axis, x, cos and sin
    float32, cos and sin broadcasting to x's shape, into one ``normgrad:RotateHalfEmbedding(x,
    cos, sin)`` writing the Add's output, where the Split's, Neg's, Concat's and Muls' outputs
    are read by the chain alone and are not graph outputs (any operand order of the Muls and
    the Add); returns how many. Needs the inferred types (after :func:`tiling_slices_as_split`,
    which makes torch's two Slices the Split where x's last axis is static: the halves are
    known equal only then)."""
    graph = model.graph
    dims = float32_dims(graph)
    producer = {output: node for node in graph.node for output in node.output}
    readers = value_readers(graph)
    outputs = {o.name for o in graph.output}
    replaced: Dict[int, list] = {}
    sizes = set()
    for node in graph.node:
        parts = _rotate_half_parts(graph, node, producer, readers, outputs, dims)
        if parts is None:
            continue
        x, cos, sin, chain = parts
        fused = oh.make_node(rotate_half_embedding.OP_TYPE, [x, cos, sin], [node.output[0]], name=node.name,
                             domain=DOMAIN, transposed=0)
        replaced[id(node)] = [fused]
        replaced.update((id(n), []) for n in chain)
        sizes.update(chain[0].input[1:])
    return replace_chains(model, replaced, sizes)


def apply(model: onnx.ModelProto, context: RewriteContext) -> int:
    """:func:`rotate_half_embeddings`."""
    return rotate_half_embeddings(model)
