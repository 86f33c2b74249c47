"""com.microsoft GroupQueryAttention without a KV cache: one-node models and an independent
torch float64 reference (rotary from the cos/sin caches at positions 0..S-1, K/V heads shared
by groups of query heads, causal mask, local window, softcap)."""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.ops import IR_VERSION

FLOAT = onnx.TensorProto.FLOAT


def rotary_caches(max_positions: int, rotary_dim: int, base: float = 10000.0):
    """cos and sin caches [max_positions, rotary_dim / 2] as onnxruntime-genai writes them."""
    inverse = 1.0 / base ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.outer(np.arange(max_positions), inverse)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def gqa_model(batch: int, seq: int, num_heads: int, kv_num_heads: int, head_size: int, packed: bool = False,
              rotary_dim: Optional[int] = None, interleaved: bool = False, past: bool = False, **attrs):
    """One GroupQueryAttention node over float inputs query (and key, value unless ``packed``),
    seqlens_k = seq - 1, total_sequence_length = seq, the cos/sin caches as initializers
    (``rotary_dim``: do_rotary), an empty past (``past``); returns the model and random feeds."""
    rng = np.random.default_rng(0)
    q_width, kv_width = num_heads * head_size, kv_num_heads * head_size
    widths = {"query": q_width + 2 * kv_width} if packed else {"query": q_width, "key": kv_width, "value": kv_width}
    feeds = {name: rng.standard_normal((batch, seq, width)).astype(np.float32) for name, width in widths.items()}
    inits = [onh.from_array(np.full(batch, seq - 1, np.int32), "seqlens_k"),
             onh.from_array(np.asarray([seq], np.int32), "total_sequence_length")]
    inputs = ["query", "" if packed else "key", "" if packed else "value", "", "", "seqlens_k", "total_sequence_length"]
    if past:
        empty = np.zeros((batch, kv_num_heads, 0, head_size), np.float32)
        inits += [onh.from_array(empty, "past_key"), onh.from_array(empty, "past_value")]
        inputs[3:5] = ["past_key", "past_value"]
    if rotary_dim:
        cos, sin = rotary_caches(2 * seq, rotary_dim)
        inits += [onh.from_array(cos, "cos_cache"), onh.from_array(sin, "sin_cache")]
        inputs += ["cos_cache", "sin_cache"]
        attrs.update(do_rotary=1, rotary_interleaved=int(interleaved))
    node = oh.make_node("GroupQueryAttention", inputs, ["y", "present_key", "present_value"], domain="com.microsoft",
                        num_heads=num_heads, kv_num_heads=kv_num_heads, **attrs)
    graph = oh.make_graph([node], "gqa", [oh.make_tensor_value_info(n, FLOAT, v.shape) for n, v in feeds.items()],
                          [oh.make_tensor_value_info("y", FLOAT, (batch, seq, q_width))], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)],
                          ir_version=IR_VERSION)
    return model, feeds


def _rotate(x, cos, sin, interleaved: bool):
    """Rotary embedding of x [B, S, heads, D] on its first 2 * cos.shape[-1] features."""
    import torch

    half = cos.shape[-1]
    rot, rest = x[..., :2 * half], x[..., 2 * half:]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated, rest), dim=-1)


def gqa_reference(model: onnx.ModelProto, feeds: Dict[str, np.ndarray], window_extra: int = 0):
    """The node's output and its input gradients under seed ``feeds["y_grad"]``, in torch
    float64 (autograd): {"y": ..., "query_grad": ..., ...}. A local window of
    ``local_window_size`` keys (onnxruntime 1.32's), + ``window_extra`` (older kernels: 1)."""
    import torch

    node = model.graph.node[0]
    attrs = {a.name: oh.get_attribute_value(a) for a in node.attribute}
    inits = {t.name: onh.to_array(t) for t in model.graph.initializer}
    heads, kv_heads = attrs["num_heads"], attrs["kv_num_heads"]
    names = [n for n in ("query", "key", "value") if n in feeds]
    tensors = {n: torch.tensor(feeds[n], dtype=torch.float64, requires_grad=True) for n in names}
    if len(names) == 1:
        width = tensors["query"].shape[-1] // (heads + 2 * kv_heads)
        q, k, v = torch.split(tensors["query"], [heads * width, kv_heads * width, kv_heads * width], dim=-1)
    else:
        q, k, v = (tensors[n] for n in names)
    batch, seq = q.shape[:2]
    q, k, v = q.reshape(batch, seq, heads, -1), k.reshape(batch, seq, kv_heads, -1), v.reshape(batch, seq, kv_heads, -1)
    if attrs.get("do_rotary", 0):
        cos, sin = (torch.tensor(inits[n][:seq], dtype=torch.float64) for n in ("cos_cache", "sin_cache"))
        q, k = (_rotate(x, cos, sin, bool(attrs.get("rotary_interleaved", 0))) for x in (q, k))
    k, v = (x.repeat_interleave(heads // kv_heads, dim=2).transpose(1, 2) for x in (k, v))
    q = q.transpose(1, 2)
    scores = q @ k.transpose(-1, -2) * (attrs.get("scale") or q.shape[-1] ** -0.5)
    if attrs.get("softcap", 0.0) > 0:
        scores = attrs["softcap"] * torch.tanh(scores / attrs["softcap"])
    rows, cols = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    allowed = cols <= rows
    if attrs.get("local_window_size", -1) >= 0:
        allowed &= cols > rows - attrs["local_window_size"] - window_extra
    scores = scores.masked_fill(~allowed, float("-inf"))
    y = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, seq, -1)
    y.backward(torch.tensor(feeds["y_grad"], dtype=torch.float64))
    return {"y": y.detach().numpy(), **{f"{n}_grad": t.grad.numpy() for n, t in tensors.items()}}


def unfused_model(batch: int, seq: int, num_heads: int, kv_num_heads: int, head_size: int, rotary: bool):
    """The same attention as :func:`gqa_model` (separate Q, K, V; full non-interleaved rotary
    when ``rotary``) in standard ONNX ops: Reshape, Transpose, Expand (K/V heads repeated),
    rotate-half Split/Neg/Concat, MatMul, a constant causal mask, Softmax."""
    groups, half = num_heads // kv_num_heads, head_size // 2
    cos, sin = rotary_caches(2 * seq, head_size)
    inits = [onh.from_array(np.concatenate([cos[:seq], cos[:seq]], -1)[None, None], "cos"),
             onh.from_array(np.concatenate([sin[:seq], sin[:seq]], -1)[None, None], "sin"),
             onh.from_array(np.triu(np.full((seq, seq), -np.inf, np.float32), 1), "mask"),
             onh.from_array(np.asarray(head_size ** -0.5, np.float32), "scale"),
             onh.from_array(np.asarray([batch, seq, num_heads, head_size], np.int64), "q_shape"),
             onh.from_array(np.asarray([batch, seq, kv_num_heads, head_size], np.int64), "kv_shape"),
             onh.from_array(np.asarray([batch, kv_num_heads, groups, seq, head_size], np.int64), "expanded"),
             onh.from_array(np.asarray([batch, num_heads, seq, head_size], np.int64), "heads"),
             onh.from_array(np.asarray([batch, seq, num_heads * head_size], np.int64), "out_shape"),
             onh.from_array(np.asarray([half, half], np.int64), "halves"),
             onh.from_array(np.asarray([2], np.int64), "axis2")]
    nodes = [oh.make_node("Reshape", ["query", "q_shape"], ["q4"]),
             oh.make_node("Transpose", ["q4"], ["q0"], perm=[0, 2, 1, 3])]
    for name in ("key", "value"):
        nodes += [oh.make_node("Reshape", [name, "kv_shape"], [f"{name}4"]),
                  oh.make_node("Transpose", [f"{name}4"], [f"{name}t"], perm=[0, 2, 1, 3]),
                  oh.make_node("Unsqueeze", [f"{name}t", "axis2"], [f"{name}u"]),
                  oh.make_node("Expand", [f"{name}u", "expanded"], [f"{name}e"]),
                  oh.make_node("Reshape", [f"{name}e", "heads"], [f"{name}0"])]
    for name in ("q", "key"):
        if rotary:
            nodes += [oh.make_node("Split", [f"{name}0", "halves"], [f"{name}_x1", f"{name}_x2"], axis=-1),
                      oh.make_node("Neg", [f"{name}_x2"], [f"{name}_neg"]),
                      oh.make_node("Concat", [f"{name}_neg", f"{name}_x1"], [f"{name}_rot"], axis=-1),
                      oh.make_node("Mul", [f"{name}0", "cos"], [f"{name}_c"]),
                      oh.make_node("Mul", [f"{name}_rot", "sin"], [f"{name}_s"]),
                      oh.make_node("Add", [f"{name}_c", f"{name}_s"], [f"{name}1"])]
        else:
            nodes.append(oh.make_node("Identity", [f"{name}0"], [f"{name}1"]))
    nodes += [oh.make_node("Transpose", ["key1"], ["kT"], perm=[0, 1, 3, 2]),
              oh.make_node("MatMul", ["q1", "kT"], ["raw"]), oh.make_node("Mul", ["raw", "scale"], ["scaled"]),
              oh.make_node("Add", ["scaled", "mask"], ["scores"]), oh.make_node("Softmax", ["scores"], ["p"], axis=-1),
              oh.make_node("MatMul", ["p", "value0"], ["o"]), oh.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              oh.make_node("Reshape", ["ot", "out_shape"], ["y"])]
    widths = {"query": num_heads * head_size, "key": kv_num_heads * head_size, "value": kv_num_heads * head_size}
    graph = oh.make_graph(nodes, "unfused", [oh.make_tensor_value_info(n, FLOAT, (batch, seq, w)) for n, w in widths.items()],
                          [oh.make_tensor_value_info("y", FLOAT, (batch, seq, num_heads * head_size))], inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=IR_VERSION)
