"""onnxruntime's ``com.microsoft`` Attention, MultiHeadAttention and RotaryEmbedding
(graphs/rewrites/contrib_attention.py, contrib_rotary.py): their standard-ONNX form against
onnxruntime's own kernels, their gradients against float64 central finite differences and torch
autograd, the forms they refuse, and tiny BERT / GPT-2 models fused by onnxruntime's transformer
optimizer training as the unfused model does."""

from __future__ import annotations

import copy
from typing import Dict

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

from normgrad.graphs import UnsupportedOperatorError, build_training_graph
from normgrad.graphs.rewrites import RewriteContext, contrib_attention, contrib_rotary
from normgrad.tools.check import check_gradients, random_feeds

from _rule_checks import TOLERANCE

MS = "com.microsoft"
F, I32, I64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT32, onnx.TensorProto.INT64


def _model(node: onnx.NodeProto, feeds: Dict[str, np.ndarray], weights: Dict[str, np.ndarray]) -> onnx.ModelProto:
    """``node`` alone: ``feeds`` as graph inputs, ``weights`` as initializers."""
    inputs = [oh.make_tensor_value_info(n, oh.np_dtype_to_tensor_dtype(v.dtype), v.shape) for n, v in feeds.items()]
    inits = [onnx.numpy_helper.from_array(v, n) for n, v in weights.items()]
    outputs = [oh.make_empty_tensor_value_info(name) for name in node.output if name]
    graph = oh.make_graph([node], "contrib", inputs, outputs, inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, feeds: Dict[str, np.ndarray]) -> list:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _expanded(model: onnx.ModelProto) -> onnx.ModelProto:
    expanded = copy.deepcopy(model)
    for rewrite in (contrib_attention, contrib_rotary):
        rewrite.apply(expanded, RewriteContext(opset=17))
    assert not any(n.domain == MS for n in expanded.graph.node)
    return expanded


def _assert_matches_onnxruntime(model: onnx.ModelProto, feeds: Dict[str, np.ndarray]) -> None:
    """The standard-ONNX form's outputs are onnxruntime's kernel's (to rounding)."""
    for expected, actual in zip(_run(model, feeds), _run(_expanded(model), feeds)):
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-6)


_BATCH_BIAS = "does not broadcast an attention_bias of batch 1 over the batch (batch 0 alone is right)"
_ORT_1_19_DIFFERS = {
    ("Attention", "attention_bias, scale, mask_filter_value"): _BATCH_BIAS,
    ("MultiHeadAttention", "attention_bias"): _BATCH_BIAS,
    ("MultiHeadAttention", "key lengths"): "misapplies a key_padding_mask of key lengths [B] when S != T",
    ("MultiHeadAttention", "key padding mask"): "misapplies a key_padding_mask [B, T] when S != T (even a row of ones)",
}
"""(op, case): how onnxruntime 1.19's CPU kernels (measured on 1.19.2) compute other values than
the expansion, which follows 1.32's (docs/reference/gradient-rules.md; 1.20 added the broadcast)."""


def _skip_where_the_kernel_differs(op_type: str, case: str) -> None:
    version = tuple(int(part) for part in ort.__version__.split(".")[:2])
    if (op_type, case) in _ORT_1_19_DIFFERS and version < (1, 20):
        pytest.skip(f"onnxruntime {ort.__version__}'s {op_type} {_ORT_1_19_DIFFERS[op_type, case]}")


def _assert_finite_differences(model: onnx.ModelProto, feeds: Dict[str, np.ndarray], wrt) -> None:
    training = build_training_graph(model)
    checks = check_gradients(training, feeds={**random_feeds(training.model, 0), **feeds}, directions=2)
    assert sorted(c.wrt for c in checks) == sorted(wrt)
    worst = max(checks, key=lambda c: c.error)
    assert worst.error < TOLERANCE, worst


# --------------------------------------------------------------------------- Attention
def _attention(batch=2, length=5, hidden=12, heads=3, mask=None, sizes=None, attention_bias=False, seed=0, **attrs):
    """(model, feeds) of one Attention: x [B, S, hidden] fed, packed weights and bias initializers."""
    rng = np.random.default_rng(seed)
    total = sum(sizes) if sizes else 3 * hidden
    feeds = {"x": rng.standard_normal((batch, length, hidden)).astype(np.float32)}
    inputs = ["x", "w", "b", ""]
    if mask is not None:
        feeds["mask"], inputs[3] = mask, "mask"
    if attention_bias:
        feeds["attention_bias"] = rng.standard_normal((1, heads, length, length)).astype(np.float32)
        inputs += ["", "attention_bias"]
    weights = {"w": (rng.standard_normal((hidden, total)) * 0.5).astype(np.float32),
               "b": rng.standard_normal(total).astype(np.float32)}
    if sizes:
        attrs["qkv_hidden_sizes"] = sizes
    node = oh.make_node("Attention", inputs, ["y"], domain=MS, num_heads=heads, **attrs)
    return _model(node, feeds, weights), feeds


_PADDING = np.array([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], np.int32)
_ATTENTION_CASES = {
    "no mask": {},
    "unidirectional": dict(unidirectional=1),
    "key lengths": dict(mask=np.array([3, 5], np.int32)),
    "key ends and starts": dict(mask=np.array([4, 5, 1, 0], np.int32)),
    "2-D mask": dict(mask=_PADDING),
    "2-D mask, unidirectional": dict(mask=_PADDING, unidirectional=1),
    "3-D mask": dict(mask=(np.random.default_rng(3).random((2, 5, 5)) > 0.3).astype(np.int32)),
    "odd head sizes": dict(hidden=10, heads=2, sizes=[6, 6, 14]),
    "attention_bias, scale, mask_filter_value": dict(mask=_PADDING, attention_bias=True, scale=0.3,
                                                      mask_filter_value=-300.0),
}


@pytest.mark.parametrize("case", list(_ATTENTION_CASES))
def test_attention_matches_onnxruntime_and_finite_differences(case):
    model, feeds = _attention(**_ATTENTION_CASES[case])
    wrt = ["x", "w", "b"] + (["attention_bias"] if "attention_bias" in feeds else [])
    _assert_finite_differences(model, feeds, wrt)
    _skip_where_the_kernel_differs("Attention", case)
    _assert_matches_onnxruntime(model, feeds)


def test_attention_gradients_match_torch_autograd():
    """x, weights and bias gradients of a 2-D-masked unidirectional Attention against torch's
    autograd of the same attention in float64 (no query sees no key: the kernel's -10000 for a
    padded key and lowest float for a later one differ on such rows alone)."""
    torch = pytest.importorskip("torch")
    padding = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], np.int32)
    model, feeds = _attention(mask=padding, unidirectional=1, hidden=12, heads=3, seed=4)
    training = build_training_graph(model)
    seed = np.random.default_rng(5).standard_normal((2, 5, 12)).astype(np.float32)
    names = [o.name for o in training.model.graph.output]
    results = dict(zip(names, _run(training.model, {**training.feeds(feeds), "y_grad": seed})))
    x, w, b = (torch.tensor(v, dtype=torch.float64, requires_grad=True)
               for v in (feeds["x"], training.weights["w"], training.weights["b"]))
    q, k, v = (t.reshape(2, 5, 3, 4).transpose(1, 2) for t in (x @ w + b).split(12, dim=-1))
    hidden = torch.tensor(padding == 0)[:, None, None, :] | torch.ones(5, 5, dtype=torch.bool).triu(1)
    scores = q @ k.transpose(-1, -2) / 2.0 + hidden * -10000.0
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, 12)
    y.backward(torch.tensor(seed, dtype=torch.float64))
    for name, tensor in (("x", x), ("w", w), ("b", b)):
        np.testing.assert_allclose(results[f"{name}_grad"], tensor.grad.numpy(), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ MultiHeadAttention
def _multi_head_attention(shapes, heads=3, bias=False, outputs=("y",), seed=0, **attrs):
    """(model, feeds) of one MultiHeadAttention; ``shapes``: {input name: shape or an int array}."""
    rng = np.random.default_rng(seed)
    feeds = {name: value if isinstance(value, np.ndarray) else rng.standard_normal(value).astype(np.float32)
             for name, value in shapes.items()}
    order = ["query", "key", "value", "bias", "key_padding_mask", "attention_bias"]
    inputs = [name if name in feeds or (name == "bias" and bias) else "" for name in order]
    while not inputs[-1]:
        inputs.pop()
    weights = {}
    if bias:
        width = sum(feeds[n].shape[-1] for n in ("query", "key", "value"))
        weights["bias"] = rng.standard_normal(width).astype(np.float32)
    node = oh.make_node("MultiHeadAttention", inputs, list(outputs), domain=MS, num_heads=heads, **attrs)
    return _model(node, feeds, weights), feeds


_MHA_CASES = {
    "separate, value width of its own": dict(shapes=dict(query=(2, 4, 12), key=(2, 6, 12), value=(2, 6, 15))),
    "bias, present outputs": dict(shapes=dict(query=(2, 4, 12), key=(2, 6, 12), value=(2, 6, 12)), bias=True,
                                  outputs=("y", "present_key", "present_value")),
    "unidirectional": dict(shapes=dict(query=(2, 5, 12), key=(2, 5, 12), value=(2, 5, 12)), bias=True,
                           unidirectional=1),
    "key lengths": dict(shapes=dict(query=(2, 4, 12), key=(2, 6, 12), value=(2, 6, 12),
                                    key_padding_mask=np.array([3, 6], np.int32))),
    "key padding mask": dict(shapes=dict(query=(2, 4, 12), key=(2, 6, 12), value=(2, 6, 12),
                                         key_padding_mask=np.array([[1] * 4 + [0] * 2, [1] * 6], np.int32))),
    "attention_bias": dict(shapes=dict(query=(2, 4, 12), key=(2, 6, 12), value=(2, 6, 12),
                                       attention_bias=(1, 3, 4, 6))),
    "key and value in heads": dict(shapes=dict(query=(2, 4, 12), key=(2, 3, 6, 4), value=(2, 3, 6, 4))),
    "odd head size": dict(shapes=dict(query=(1, 3, 10), key=(1, 4, 10), value=(1, 4, 10)), heads=2, bias=True),
}


@pytest.mark.parametrize("case", list(_MHA_CASES))
def test_multi_head_attention_matches_onnxruntime_and_finite_differences(case):
    model, feeds = _multi_head_attention(**_MHA_CASES[case])
    wrt = [n for n, v in feeds.items() if v.dtype == np.float32] + (["bias"] if _MHA_CASES[case].get("bias") else [])
    _assert_finite_differences(model, feeds, wrt)
    _skip_where_the_kernel_differs("MultiHeadAttention", case)
    _assert_matches_onnxruntime(model, feeds)


# ------------------------------------------------------------------- RotaryEmbedding
def _rotary(shape, position_ids, half, heads=0, seed=0, **attrs):
    """(model, feeds) of one RotaryEmbedding with cos/sin cache initializers of 16 positions."""
    rng = np.random.default_rng(seed)
    angles = rng.standard_normal((16, half))
    feeds = {"x": rng.standard_normal(shape).astype(np.float32), "position_ids": position_ids}
    weights = {"cos_cache": np.cos(angles).astype(np.float32), "sin_cache": np.sin(angles).astype(np.float32)}
    if heads:
        attrs["num_heads"] = heads
    node = oh.make_node("RotaryEmbedding", ["x", "position_ids", "cos_cache", "sin_cache"], ["y"], domain=MS, **attrs)
    return _model(node, feeds, weights), feeds


_POSITIONS = np.array([[0, 1, 2, 3, 4], [7, 3, 9, 15, 0]], np.int64)
_ROTARY_CASES = {
    "[B, S, N*H], halves": dict(shape=(2, 5, 24), position_ids=_POSITIONS, half=4, heads=3),
    "[B, S, N*H], interleaved": dict(shape=(2, 5, 24), position_ids=_POSITIONS, half=4, heads=3, interleaved=1),
    "[B, N, S, H], halves": dict(shape=(2, 3, 5, 8), position_ids=_POSITIONS, half=4),
    "[B, N, S, H], interleaved": dict(shape=(2, 3, 5, 8), position_ids=_POSITIONS, half=4, interleaved=1),
    "one position offset": dict(shape=(2, 5, 24), position_ids=np.array([3], np.int64), half=4, heads=3),
    "partial rotary dim": dict(shape=(2, 5, 24), position_ids=_POSITIONS, half=2, heads=3, rotary_embedding_dim=4),
    "partial, interleaved": dict(shape=(2, 5, 24), position_ids=_POSITIONS, half=2, heads=3, rotary_embedding_dim=4,
                                 interleaved=1),
    "scale, which onnxruntime's kernel does not apply": dict(shape=(2, 5, 24), position_ids=_POSITIONS, half=4,
                                                             heads=3, scale=2.0),
}


@pytest.mark.parametrize("case", list(_ROTARY_CASES))
def test_rotary_embedding_matches_onnxruntime_and_finite_differences(case):
    """The caches are constants: the input alone gets a gradient."""
    model, feeds = _rotary(**_ROTARY_CASES[case])
    _assert_matches_onnxruntime(model, feeds)
    _assert_finite_differences(model, feeds, ["x"])


def test_rotary_embedding_halves_become_rotate_half_embedding_and_match_torch():
    """The halves form is fused into normgrad:RotateHalfEmbedding; x's gradient against torch's
    autograd of the rotation in float64."""
    torch = pytest.importorskip("torch")
    model, feeds = _rotary(**_ROTARY_CASES["[B, N, S, H], halves"])
    training = build_training_graph(model)
    assert "RotateHalfEmbedding" in {n.op_type for n in training.model.graph.node}
    assert set(training.weights) == set()
    seed = np.random.default_rng(1).standard_normal(feeds["x"].shape).astype(np.float32)
    grads = dict(zip([o.name for o in training.model.graph.output],
                     _run(training.model, {**training.feeds(feeds), "y_grad": seed})))
    cos_cache, sin_cache = (onnx.numpy_helper.to_array(t) for t in model.graph.initializer)
    x = torch.tensor(feeds["x"], dtype=torch.float64, requires_grad=True)
    cos, sin = (torch.tensor(c[_POSITIONS], dtype=torch.float64)[:, None] for c in (cos_cache, sin_cache))
    x1, x2 = x[..., :4], x[..., 4:]
    y = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    y.backward(torch.tensor(seed, dtype=torch.float64))
    np.testing.assert_allclose(grads["x_grad"], x.grad.numpy(), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- refusals
_REFUSED = {
    "Attention with a past state": (
        lambda: _model(oh.make_node("Attention", ["x", "w", "b", "", "past"], ["y"], domain=MS, num_heads=2,
                                    name="attn"),
                       {"x": np.zeros((1, 2, 4), np.float32), "past": np.zeros((2, 1, 2, 1, 2), np.float32)},
                       {"w": np.zeros((4, 12), np.float32), "b": np.zeros(12, np.float32)}),
        "Attention node 'attn'.*input 4 \\(past\\)"),
    "Attention with rotary inside": (
        lambda: _model(oh.make_node("Attention", ["x", "w", "b"], ["y"], domain=MS, num_heads=2, do_rotary=1,
                                    name="attn"),
                       {"x": np.zeros((1, 2, 4), np.float32)},
                       {"w": np.zeros((4, 12), np.float32), "b": np.zeros(12, np.float32)}),
        "Attention node 'attn'.*do_rotary"),
    "Attention with a 4-D mask": (
        lambda: _model(oh.make_node("Attention", ["x", "w", "b", "mask"], ["y"], domain=MS, num_heads=2, name="attn"),
                       {"x": np.zeros((1, 2, 4), np.float32), "mask": np.ones((1, 1, 2, 2), np.int32)},
                       {"w": np.zeros((4, 12), np.float32), "b": np.zeros(12, np.float32)}),
        "Attention node 'attn'.*mask 'mask' has rank 4"),
    "MultiHeadAttention with packed QKV": (
        lambda: _model(oh.make_node("MultiHeadAttention", ["qkv"], ["y"], domain=MS, num_heads=2, name="mha"),
                       {"qkv": np.zeros((1, 2, 2, 3, 2), np.float32)}, {}),
        "MultiHeadAttention node 'mha'.*ranks 5/0/absent"),
    "MultiHeadAttention with a past key": (
        lambda: _model(oh.make_node("MultiHeadAttention", ["q", "k", "v", "", "", "", "pk"], ["y"], domain=MS,
                                    num_heads=2, name="mha"),
                       {n: np.zeros((1, 2, 4), np.float32) for n in ("q", "k", "v")}
                       | {"pk": np.zeros((1, 2, 1, 2), np.float32)}, {}),
        "MultiHeadAttention node 'mha'.*input 6 \\(past_key\\)"),
    "RotaryEmbedding with packed batching": (
        lambda: _model(oh.make_node("RotaryEmbedding", ["x", "p", "c", "s"], ["y"], domain=MS, is_packed_batching=1,
                                    name="rope"),
                       {"x": np.zeros((1, 2, 4), np.float32), "p": np.zeros((1, 2), np.int64)},
                       {"c": np.zeros((4, 2), np.float32), "s": np.zeros((4, 2), np.float32)}),
        "RotaryEmbedding node 'rope'.*is_packed_batching"),
}


@pytest.mark.parametrize("case", list(_REFUSED))
def test_uncovered_forms_are_refused_in_one_line(case):
    make, pattern = _REFUSED[case]
    with pytest.raises(UnsupportedOperatorError, match=pattern) as raised:
        build_training_graph(make())
    assert "\n" not in str(raised.value)


# ------------------------------------------------------------- fused models, end to end
def _transformer(kind: str, folder, scalars: bool = False):
    """A tiny transformers BERT or GPT-2 (distinct random parameters, eager attention) exported
    by torch; its path. With ``scalars``, its hidden state is multiplied by a 0-d parameter
    ``logit_scale`` and divided by a 0-d ``temperature`` (CLIP's learned scale and temperature)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from _transformer_blocks import _distinct_parameters

    if kind == "bert":
        config = transformers.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=24, vocab_size=40, max_position_embeddings=16,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                         attn_implementation="eager")
        model = transformers.BertModel(config)
    else:
        config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=40, n_positions=16, use_cache=False,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
        model = transformers.GPT2Model(config)
    model.eval()
    _distinct_parameters(model)

    class LastHiddenState(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model
            if scalars:
                self.logit_scale = torch.nn.Parameter(torch.tensor(1.5))
                self.temperature = torch.nn.Parameter(torch.tensor(0.7))

        def forward(self, input_ids, attention_mask):
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return hidden * self.logit_scale / self.temperature if scalars else hidden

    path = str(folder / f"{kind}.onnx")
    names = ["input_ids", "attention_mask"]
    example = (torch.zeros((2, 6), dtype=torch.int64), torch.ones((2, 6), dtype=torch.int64))
    torch.onnx.export(LastHiddenState(), example, path, input_names=names, output_names=["hidden"], opset_version=17,
                      dynamic_axes={n: {0: "batch", 1: "sequence"} for n in names}, dynamo=False)
    return path


def _adamw_losses(model: onnx.ModelProto, batches):
    """The trained tensors ({name: element count}) with the default trainable set (no
    ``frozen``), and three AdamW steps' losses."""
    from normgrad.graphs import build_step_graph
    from normgrad.train import Trainer

    training = build_training_graph(model, loss="mse")
    step, initial = build_step_graph(training, "adamw")
    trainer = Trainer(step, initial, lr=1e-2)
    return {name: value.size for name, value in training.weights.items()}, [trainer.step(batch) for batch in batches]


def _padded_batches(count: int = 3) -> list:
    """Right-padded batches of 3 sequences of 6 tokens (vocabulary 40) and [3, 6, 16] labels."""
    rng = np.random.default_rng(1)
    batches = []
    for _ in range(count):
        mask = np.ones((3, 6), np.int64)
        mask[0, 4:], mask[2, 2:] = 0, 0
        batches.append({"input_ids": rng.integers(0, 40, (3, 6)), "attention_mask": mask,
                        "labels": rng.standard_normal((3, 6, 16)).astype(np.float32)})
    return batches


_FUSED_FORMS = {
    "bert, Attention, key lengths": ("bert", {}, "Attention"),
    "bert, Attention, 2-D mask": ("bert", {"attention_mask_format": 2}, "Attention"),
    "bert, MultiHeadAttention": ("bert", {"use_multi_head_attention": True}, "MultiHeadAttention"),
    "gpt2": ("gpt2", {}, None),
}


@pytest.mark.slow
@pytest.mark.parametrize("form", list(_FUSED_FORMS))
def test_fused_transformer_trains_as_unfused(form, tmp_path):
    """Fused by onnxruntime's optimizer (``optimize_model(model_type=...)``, CPU), the model gives
    the unfused model's AdamW losses over 3 steps, right-padded batches. onnxruntime's GPT-2
    fusion finds no attention in current transformers' exports (its causal mask is written
    another way): that model's attention stays unfused."""
    pytest.importorskip("transformers")
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    kind, options, attention = _FUSED_FORMS[form]
    path = _transformer(kind, tmp_path)
    fusion = FusionOptions(kind)
    for name, value in options.items():
        setattr(fusion, name, value)
    fused = optimize_model(path, model_type=kind, num_heads=2, hidden_size=16, use_gpu=False,
                           optimization_options=fusion).model
    fused_ops = {n.op_type for n in fused.graph.node if n.domain == MS}
    assert attention is None or attention in fused_ops, fused_ops
    constants = [t.name for t in fused.graph.initializer if not t.dims and t.data_type == F]
    assert attention is not None or constants  # GPT-2: the attention scale and mask fill became initializers
    batches = _padded_batches()
    unfused_trained, expected = _adamw_losses(onnx.load(path), batches)
    trained, losses = _adamw_losses(fused, batches)
    assert not set(constants) & set(trained)
    # the same parameters: by name where the optimizer kept them; Attention's packed Q/K/V
    # weights and biases in place of the three it packed
    kept = set(trained) & set(unfused_trained)
    assert set(trained) - kept <= {f"Attention_{i}_qkv_{kind}" for i in range(2) for kind in ("weight", "bias")}
    assert sum(trained.values()) == sum(unfused_trained.values())
    np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_fused_model_trains_its_0d_parameters(tmp_path):
    """A 0-d parameter (CLIP's logit_scale, a temperature) of a model fused by onnxruntime's
    optimizer trains by default, as unfused, while the Constant nodes the optimizer turned into
    0-d initializers (the attention scale, the mask fill) stay constants."""
    pytest.importorskip("transformers")
    from onnxruntime.transformers.optimizer import optimize_model

    path = _transformer("gpt2", tmp_path, scalars=True)
    fused = optimize_model(path, model_type="gpt2", num_heads=2, hidden_size=16, use_gpu=False).model
    batches = _padded_batches()
    unfused_trained, expected = _adamw_losses(onnx.load(path), batches)
    trained, losses = _adamw_losses(fused, batches)
    assert {"logit_scale", "temperature"} <= set(trained)
    assert trained == unfused_trained
    np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-5)
