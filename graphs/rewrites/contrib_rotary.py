"""onnxruntime's ``com.microsoft`` RotaryEmbedding becomes its standard-ONNX computation as
onnxruntime's CPU kernel does it (:func:`rotary_embeddings`): per head, the first
rotary_embedding_dim channels rotated by the cos/sin caches' rows at the position ids (halves
``x1 cos - x2 sin, x2 cos + x1 sin``, or even/odd pairs when interleaved), the others passed
through. The halves form is the exporters' ``x cos + Concat(-x2, x1) sin``, which
:mod:`~normgrad.graphs.rewrites.rotate_half` then fuses into ``normgrad:RotateHalfEmbedding``.
The caches are constants, as they are to the kernel: a cache initializer nothing else reads
becomes a Constant node (no gradient, not trained). ``scale`` is not applied (onnxruntime's
kernel does not apply it either). Packed batching is refused by name.
"""

from __future__ import annotations

import onnx
import onnx.helper as oh

from normgrad.graphs.context import UnsupportedOperatorError, attr, describe
from normgrad.graphs.rewrites._graph import (CONTRIB_DOMAIN, RewriteContext, axis_length, expand_contrib_nodes,
                                             int64_scalar, value_dims)
from normgrad.ops.node_writer import NodeWriter

__all__ = ["rotary_embeddings", "apply", "OP_TYPES"]

OP_TYPES = ("RotaryEmbedding",)
"""The com.microsoft operators this pass writes as standard ONNX."""
_CACHES = (2, 3)
"""RotaryEmbedding's cos_cache and sin_cache inputs."""


def _refuse(node: onnx.NodeProto, what: str) -> None:
    raise UnsupportedOperatorError(f"{describe(node)} (domain com.microsoft): {what}")


def _rotated(w: NodeWriter, x: str, cos: str, sin: str, half: int, interleaved: bool) -> str:
    """The rotary channels ``x`` [..., 2 half] rotated by ``cos``, ``sin`` [..., half]."""
    if interleaved:
        pairs = w.op("Reshape", x, w.ints([0, 0, 0, half, 2]))
        even, odd = (w.op("Gather", pairs, int64_scalar(w, i), axis=4) for i in (0, 1))
        new_even = w.op("Sub", w.op("Mul", even, cos), w.op("Mul", odd, sin))
        new_odd = w.op("Add", w.op("Mul", odd, cos), w.op("Mul", even, sin))
        stacked = w.op("Concat", w.unsqueeze(new_even, [4]), w.unsqueeze(new_odd, [4]), axis=4)
        return w.op("Reshape", stacked, w.ints([0, 0, 0, 2 * half]))
    first = w.op("Slice", x, w.ints([0]), w.ints([half]), w.ints([3]))
    second = w.op("Slice", x, w.ints([half]), w.ints([2 * half]), w.ints([3]))
    full_cos, full_sin = (w.op("Concat", c, c, axis=3) for c in (cos, sin))
    rotation = w.op("Concat", w.op("Neg", second), first, axis=3)
    return w.op("Add", w.op("Mul", x, full_cos), w.op("Mul", rotation, full_sin))


def _rotary_embedding(w: NodeWriter, node: onnx.NodeProto, types) -> None:
    """Writes node's output from input [B, S, N*H] or [B, N, S, H], position_ids [B, S] (or
    one offset: positions offset..offset+S-1) and the caches [max positions, rotary dim / 2]."""
    if attr(node, "is_packed_batching", 0):
        _refuse(node, "is_packed_batching is set; normgrad covers the padded batch form only")
    x, position_ids, cos_cache, sin_cache = node.input[:4]
    x_dims, cache_dims, id_dims = value_dims(types, x), value_dims(types, cos_cache), value_dims(types, position_ids)
    if x_dims is None or len(x_dims) not in (3, 4) or not cache_dims or cache_dims[-1] is None or id_dims is None:
        _refuse(node, f"the rank of its input '{x}' or position_ids, or the width of its cos_cache, is unknown")
    half = attr(node, "rotary_embedding_dim", 0) // 2 or cache_dims[-1]
    num_heads = attr(node, "num_heads", 0)
    if len(x_dims) == 3:
        if num_heads and x_dims[-1] is None:
            _refuse(node, f"the hidden size of its input '{x}' is unknown")
        head_size = x_dims[-1] // num_heads if num_heads else 2 * half
        view, sequence_axis = w.op("Reshape", x, w.ints([0, 0, -1, head_size])), 1  # [B, S, N, H]
    else:
        head_size, view, sequence_axis = x_dims[-1], x, 2  # [B, N, S, H]
    if len(id_dims) != 2:  # one offset
        start = w.op("Squeeze", w.op("Reshape", position_ids, w.ints([1])), w.ints([0]))
        end = w.op("Add", start, w.op("CastLike", axis_length(w, x, sequence_axis), start))
        position_ids = w.unsqueeze(w.op("Range", start, end, w.op("CastLike", int64_scalar(w, 1), start)), [0])
    head_axis = 2 if len(x_dims) == 3 else 1
    cos, sin = (w.unsqueeze(w.op("Gather", cache, position_ids, axis=0), [head_axis])
                for cache in (cos_cache, sin_cache))
    if 2 * half == head_size:
        rotated = _rotated(w, view, cos, sin, half, attr(node, "interleaved", 0))
    else:
        rotary = w.op("Slice", view, w.ints([0]), w.ints([2 * half]), w.ints([3]))
        passed = w.op("Slice", view, w.ints([2 * half]), w.ints([head_size]), w.ints([3]))
        rotated = w.op("Concat", _rotated(w, rotary, cos, sin, half, attr(node, "interleaved", 0)), passed, axis=3)
    w.op("Reshape", rotated, w.shape_of(x), outputs=[node.output[0]])


def _caches_as_constants(model: onnx.ModelProto) -> None:
    """Turns each cache initializer only RotaryEmbedding nodes read (and no graph input
    feeds) into a Constant node: constants to the kernel, never trained."""
    graph = model.graph
    rotary = [n for n in graph.node if n.domain == CONTRIB_DOMAIN and n.op_type in OP_TYPES]
    caches = {n.input[i] for n in rotary for i in _CACHES if len(n.input) > i}
    others = {name for n in graph.node if n not in rotary for name in n.input}
    others |= {i.name for i in graph.input} | {o.name for o in graph.output}
    moved = [t for t in graph.initializer if t.name in caches and t.name not in others]
    for tensor in reversed(moved):
        graph.node.insert(0, oh.make_node("Constant", [], [tensor.name], value=tensor))
    kept = [t for t in graph.initializer if t.name not in {m.name for m in moved}]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def rotary_embeddings(model: onnx.ModelProto, context: RewriteContext) -> int:
    """Rewrites, in place, every com.microsoft RotaryEmbedding of ``model``'s main graph into
    standard ONNX (see the module docstring); returns how many.

    Raises:
        UnsupportedOperatorError: a node in a form it does not cover.
    """
    if not any(n.domain == CONTRIB_DOMAIN and n.op_type in OP_TYPES for n in model.graph.node):
        return 0
    _caches_as_constants(model)
    return expand_contrib_nodes(model, context, OP_TYPES, _rotary_embedding)


def apply(model: onnx.ModelProto, context: RewriteContext) -> int:
    """The builder's pass: :func:`rotary_embeddings`."""
    return rotary_embeddings(model, context)
