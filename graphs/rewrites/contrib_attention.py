"""onnxruntime's ``com.microsoft`` Attention and MultiHeadAttention (what its transformer
optimizer, ``onnxruntime.transformers.optimizer.optimize_model``, writes for BERT and GPT-2)
become their standard-ONNX computation as onnxruntime's CPU kernels do it: projections, scaled
scores plus the mask's bias, Softmax, the weighted sum of the values (:func:`attentions`).
The existing rules then differentiate them, and onnx shape inference, which knows no
``com.microsoft`` schema, gives every later value its shape. Training form only: a past state
(KV cache), rotary inside Attention or the scores as an output is refused in one line naming
the node and the input or attribute; a mask form onnxruntime's CPU kernel has no branch for
(a 4-D Megatron mask) too.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.graphs.context import UnsupportedOperatorError, attr, describe
from normgrad.graphs.rewrites._graph import (RewriteContext, axis_length, expand_contrib_nodes, int64_scalar,
                                             value_dims)
from normgrad.ops.node_writer import NodeWriter

__all__ = ["attentions", "apply", "MASK_FILTER_VALUE", "OP_TYPES"]

MASK_FILTER_VALUE = -10000.0
"""The bias onnxruntime adds to a masked key's score unless ``mask_filter_value`` says otherwise."""


def _refuse(node: onnx.NodeProto, what: str) -> None:
    raise UnsupportedOperatorError(
        f"{describe(node)} (domain com.microsoft): {what}; normgrad differentiates it in training form only "
        "(no past state, no rotary inside, the attention output alone)")


def _input(node: onnx.NodeProto, index: int) -> Optional[str]:
    return node.input[index] if len(node.input) > index and node.input[index] else None


def _heads(w: NodeWriter, x: str, num_heads: int, key: bool = False) -> str:
    """[B, S, N*H] as [B, N, S, H] (a key as [B, N, H, S], the scores' right operand)."""
    split = w.op("Reshape", x, w.ints([0, 0, num_heads, -1]))
    return w.op("Transpose", split, perm=[0, 2, 3, 1] if key else [0, 2, 1, 3])


def _masked_keys(w: NodeWriter, node: onnx.NodeProto, mask: str, rank: int, q: str, t: str) -> str:
    """Which keys ``mask`` hides, as booleans broadcasting to the scores [B, N, S, T]: key
    lengths [B] (or end and start positions [2B]), a 0/1 mask [B, T] or [B, S, T]."""
    if rank == 1:
        batch = w.shape_of(q, start=0, end=1)
        positions = w.unsqueeze(w.op("Range", int64_scalar(w, 0), t, int64_scalar(w, 1)), [0])
        lengths = w.op("Cast", mask, to=onnx.TensorProto.INT64)
        # [ends, starts] or [ends]: padded with zeros, the starts (or none) follow the ends
        padded = w.op("Concat", lengths, w.op("ConstantOfShape", batch, value=onh.from_array(np.zeros(1, np.int64))),
                      axis=0)
        ends = w.unsqueeze(w.op("Slice", padded, w.ints([0]), batch), [1])
        starts = w.unsqueeze(w.op("Slice", padded, batch, w.op("Add", batch, batch)), [1])
        hidden = w.op("Or", w.op("GreaterOrEqual", positions, ends), w.op("Less", positions, starts))
        return w.unsqueeze(hidden, [1, 2])
    if rank in (2, 3):
        kept = w.op("Greater", mask, w.op("CastLike", int64_scalar(w, 0), mask))
        return w.unsqueeze(w.op("Not", kept), [1, 2] if rank == 2 else [1])
    _refuse(node, f"its mask '{mask}' has rank {rank} (onnxruntime's CPU kernel takes ranks 1, 2 and 3)")


def _causal(w: NodeWriter, q: str, t: str) -> str:
    """[S, T] booleans: key j after query i (no past state: position i is i)."""
    rows = w.unsqueeze(w.op("Range", int64_scalar(w, 0), axis_length(w, q, 2), int64_scalar(w, 1)), [1])
    columns = w.unsqueeze(w.op("Range", int64_scalar(w, 0), t, int64_scalar(w, 1)), [0])
    return w.op("Less", rows, columns)


def _attend(w: NodeWriter, node: onnx.NodeProto, types, q: str, k: str, v: str, head_size: Optional[int],
            mask: Optional[str], biases: List[str]) -> None:
    """Writes node's output 0 = heads of Softmax(scale q k + bias) v merged, [B, S, N*Hv], from
    q [B, N, S, H], k [B, N, H, T], v [B, N, T, Hv]."""
    scale = attr(node, "scale", 0.0)
    if scale:
        factor = w.scalar(scale, node.input[0])
    elif head_size:
        factor = w.scalar(1.0 / np.sqrt(np.float32(head_size)), node.input[0])
    else:
        size = w.op("CastLike", w.shape_of(q, start=3, end=4), q)
        factor = w.op("Reciprocal", w.op("Sqrt", size))
    scores = w.op("Mul", w.op("MatMul", q, k), factor)
    t = axis_length(w, k, 3)
    hidden = None
    if mask is not None:
        rank = len(value_dims(types, mask) or [])
        if not rank:
            _refuse(node, f"the rank of its mask '{mask}' is unknown")
        hidden = _masked_keys(w, node, mask, rank, q, t)
    bias = None
    if hidden is not None:
        filtered = w.scalar(attr(node, "mask_filter_value", MASK_FILTER_VALUE), node.input[0])
        bias = w.op("Where", hidden, filtered, w.scalar(0.0, node.input[0]))
    if attr(node, "unidirectional", 0):
        # the kernel sets a later key's bias to the lowest float, over the mask's
        lowest = w.scalar(float(np.finfo(np.float32).min), node.input[0])
        bias = w.op("Where", _causal(w, q, t), lowest, bias if bias is not None else w.scalar(0.0, node.input[0]))
    if bias is not None:
        scores = w.op("Add", scores, bias)
    for bias in biases:
        scores = w.op("Add", scores, bias)
    weighted = w.op("MatMul", w.op("Softmax", scores, axis=-1), v)
    w.op("Reshape", w.op("Transpose", weighted, perm=[0, 2, 1, 3]), w.ints([0, 0, -1]), outputs=[node.output[0]])


def _attention(w: NodeWriter, node: onnx.NodeProto, types) -> None:
    """com.microsoft Attention: input [B, S, D_in] times the packed weights [D_in, Dq+Dk+Dv]
    plus the packed bias, heads, masks (mask_index, unidirectional, attention_bias)."""
    for index, name in ((4, "past"), (6, "past_sequence_length")):
        if _input(node, index):
            _refuse(node, f"its input {index} ({name}) is given")
    if attr(node, "do_rotary", 0):
        _refuse(node, "do_rotary is set")
    x, weights = node.input[0], node.input[1]
    num_heads = attr(node, "num_heads", 0)
    columns = (value_dims(types, weights) or [None, None])[-1]
    sizes = list(attr(node, "qkv_hidden_sizes", [])) or ([columns // 3] * 3 if columns else None)
    if not sizes:
        _refuse(node, f"the shape of its weights '{weights}' is unknown and qkv_hidden_sizes is not set")
    qkv = w.op("MatMul", x, weights)
    if _input(node, 2):
        qkv = w.op("Add", qkv, node.input[2])
    bounds = np.cumsum([0] + sizes)
    q, k, v = (w.op("Slice", qkv, w.ints([bounds[i]]), w.ints([bounds[i + 1]]), w.ints([-1])) for i in range(3))
    q4, k4, v4 = _heads(w, q, num_heads), _heads(w, k, num_heads), _heads(w, v, num_heads)
    if len(node.output) > 1 and node.output[1]:  # present: [2, B, N, T, H], the keys and values
        w.op("Concat", w.unsqueeze(k4, [0]), w.unsqueeze(v4, [0]), axis=0, outputs=[node.output[1]])
    key = w.op("Transpose", k4, perm=[0, 1, 3, 2])
    biases = [_input(node, 5)] if _input(node, 5) else []
    _attend(w, node, types, q4, key, v4, sizes[0] // num_heads, _input(node, 3), biases)


def _biased(w: NodeWriter, node: onnx.NodeProto, value: str, begin: int, end: Optional[int]) -> str:
    """``value`` plus node's bias[begin:end] (``value`` itself without a bias)."""
    if not _input(node, 3):
        return value
    part = w.op("Slice", node.input[3], w.ints([begin]), w.ints([end if end is not None else np.iinfo(np.int64).max]))
    return w.op("Add", value, part)


def _multi_head_attention(w: NodeWriter, node: onnx.NodeProto, types) -> None:
    """com.microsoft MultiHeadAttention: query [B, S, D] with key and value [B, T, D] (or
    [B, N, T, H] already in heads, without bias); bias, key_padding_mask, attention_bias,
    unidirectional. The packed forms are refused: onnxruntime's CPU kernel runs neither."""
    for index, name in ((6, "past_key"), (7, "past_value"), (8, "past_sequence_length"), (9, "cache_indirection")):
        if _input(node, index):
            _refuse(node, f"its input {index} ({name}) is given")
    if len(node.output) > 3 and any(node.output[3:]):
        _refuse(node, "its attention scores output (output 3) is used")
    query, key, value = node.input[0], _input(node, 1), _input(node, 2)
    num_heads = attr(node, "num_heads", 0)
    q_dims, k_dims = value_dims(types, query), value_dims(types, key) if key else None
    if q_dims is None or (key and k_dims is None):
        _refuse(node, f"the rank of its query or key ('{query}', '{key}') is unknown")
    head_size = q_dims[-1] // num_heads if q_dims[-1] else None
    if len(q_dims) == 3 and len(k_dims or []) == 3 and value and None not in (q_dims[-1], k_dims[-1]):
        q4 = _heads(w, _biased(w, node, query, 0, q_dims[-1]), num_heads)
        k4 = _heads(w, _biased(w, node, key, q_dims[-1], q_dims[-1] + k_dims[-1]), num_heads)
        v4 = _heads(w, _biased(w, node, value, q_dims[-1] + k_dims[-1], None), num_heads)
    elif len(q_dims) == 3 and len(k_dims or []) == 4 and value and not _input(node, 3):
        q4, k4, v4 = _heads(w, query, num_heads), key, value
    else:  # packed QKV [B, S, N, 3, H] and KV [B, T, N, 2, H]: onnxruntime's CPU kernel refuses them
        _refuse(node, f"its query/key/value of ranks {len(q_dims)}/{len(k_dims or [])}/"
                f"{'given' if value else 'absent'}{' with bias' if _input(node, 3) else ''} are a form normgrad "
                "does not cover (query, key and value [B, S, D], or key and value [B, N, T, H] without bias)")
    for index, present in ((1, k4), (2, v4)):
        if len(node.output) > index and node.output[index]:
            w.op("Identity", present, outputs=[node.output[index]])
    biases = [_input(node, 5)] if _input(node, 5) else []
    _attend(w, node, types, q4, w.op("Transpose", k4, perm=[0, 1, 3, 2]), v4, head_size, _input(node, 4), biases)


_EXPANSIONS = {"Attention": _attention, "MultiHeadAttention": _multi_head_attention}
OP_TYPES = tuple(_EXPANSIONS)
"""The com.microsoft operators this pass writes as standard ONNX."""


def attentions(model: onnx.ModelProto, context: RewriteContext) -> int:
    """Rewrites, in place, every com.microsoft Attention and MultiHeadAttention of ``model``'s
    main graph into standard ONNX (see the module docstring); returns how many.

    Raises:
        UnsupportedOperatorError: a node in a form it does not cover (past state, rotary, ...).
    """
    return expand_contrib_nodes(model, context, OP_TYPES,
                                lambda w, node, types: _EXPANSIONS[node.op_type](w, node, types))


def apply(model: onnx.ModelProto, context: RewriteContext) -> int:
    """The builder's pass: :func:`attentions`."""
    return attentions(model, context)
