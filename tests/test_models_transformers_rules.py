"""Whole transformer-family models through torch's exporters: a classifier with nn.Dropout in
training mode, and (transformers, tiny configs, random weights) a BERT encoder, a ViT and a
Llama decoder block, their LayerNorm/RMSNorm gradients on normgrad's LayerNormalizationGrad /
RMSNormalizationGrad; gradients against torch autograd."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from normgrad.graphs import build_training_graph, supported_op_types
from normgrad.graphs.patterns import _declarative

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
nn = torch.nn

import _torch_models  # noqa: E402  (DecomposedLayerNorm, shared with the model-family tests)
from _transformer_blocks import (_LlamaBlock, _assert_gradients_match, _distinct_parameters, _export, _llama_config, _run_training)


class _Classifier(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 16), nn.Dropout(p), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_classifier_with_training_mode_dropout_matches_torch_given_the_mask(exporter, p):
    """The mask is read from the ONNX Dropout's mask output; torch autograd then runs with
    that very mask (nn.Dropout's output replaced by x * mask / (1 - p))."""
    torch.manual_seed(0)
    module = _Classifier(p).train()
    _distinct_parameters(module)
    x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    forward = _export(module, (torch.tensor(x),), exporter, ["x"], ["y"])
    dropouts = [n for n in forward.graph.node if n.op_type == "Dropout"]
    if exporter == "dynamo" and p == 0.0 and not dropouts:
        pass  # the dynamo exporter drops a p = 0 Dropout: the classifier is still compared
    else:
        assert len(dropouts) == 1
    dy = np.random.default_rng(1).standard_normal((16, 3)).astype(np.float32)
    mask_name = []
    if dropouts:
        while len(dropouts[0].output) < 2:
            dropouts[0].output.append("")
        dropouts[0].output[1] = dropouts[0].output[1] or "dropout_mask"
        mask_name = [dropouts[0].output[1]]
    results, weights = _run_training(forward, {"x": x}, {"y": dy}, mask_name)
    mask = results[mask_name[0]] if mask_name else np.ones((16, 16), bool)
    if p:
        assert 0.1 < 1 - mask.mean() < 0.5
    handle = module.drop.register_forward_hook(lambda m, inputs, out: inputs[0] * torch.tensor(mask) / (1 - p))
    xt = torch.tensor(x, requires_grad=True)
    y = module(xt)
    handle.remove()
    y.backward(torch.tensor(dy))
    np.testing.assert_allclose(results["y"], y.detach().numpy(), rtol=1e-5, atol=1e-5)
    _assert_gradients_match(results, weights, module, {"x": xt.grad.numpy()})


class _Outputs(nn.Module):
    """A transformers model called with one keyword input, returning the named outputs."""

    def __init__(self, model, input_name, output_names):
        super().__init__()
        self.model, self.input_name, self.output_names = model, input_name, output_names

    def forward(self, inputs):
        out = self.model(**{self.input_name: inputs})
        return tuple(getattr(out, name) for name in self.output_names)


def _tiny_bert(layer_norm):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    bert = transformers.BertModel(config)
    if layer_norm == "decomposed":
        for name, child in list(bert.named_modules()):
            for attribute, sub in list(child.named_children()):
                if isinstance(sub, nn.LayerNorm):
                    setattr(child, attribute, _torch_models.DecomposedLayerNorm(sub))
    return _Outputs(bert, "input_ids", ("last_hidden_state", "pooler_output"))


def _tiny_vit():
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return _Outputs(transformers.ViTModel(config), "pixel_values", ("last_hidden_state", "pooler_output"))


def _check_model(module, inputs, exporter, input_name, output_names, grad_op, norms):
    """Exports ``module`` (training mode, distinct parameter values) with ``exporter``, asserts
    ``norms`` ``grad_op`` nodes in its training graph, and its outputs and the gradients of
    every parameter (and of a float input) against torch autograd; returns the training
    graph's {op type: count}."""
    module = module.train()
    _distinct_parameters(module)
    inputs_t = torch.tensor(inputs, requires_grad=inputs.dtype.kind == "f")
    outputs = module(inputs_t)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    rng = np.random.default_rng(1)
    seeds = {name: rng.standard_normal(tuple(out.shape)).astype(np.float32) for name, out in zip(output_names, outputs)}
    torch.autograd.backward(list(outputs), [torch.tensor(seeds[name]) for name in output_names])
    forward = _export(module, (torch.tensor(inputs),), exporter, [input_name], list(output_names))
    training = build_training_graph(forward)
    ops = collections.Counter(node.op_type for node in training.model.graph.node)
    assert ops[grad_op] == norms, ops
    results, weights = _run_training(forward, {input_name: inputs}, seeds, training=training)
    for name, out in zip(output_names, outputs):
        np.testing.assert_allclose(results[name], out.detach().numpy(), rtol=1e-4, atol=1e-4)
    extra = {input_name: inputs_t.grad.numpy()} if inputs_t.grad is not None else {}
    _assert_gradients_match(results, weights, module, extra)
    return ops


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("layer_norm", ["decomposed", "nn"])
def test_tiny_bert_matches_torch(exporter, layer_norm):
    """BertModel (hidden 32, 2 layers, 2 heads, vocab 100, dropout p = 0 in training mode):
    embedding Gathers, attention, GELU (Erf), pooler Tanh, and 5 LayerNorms, each one
    LayerNormalizationGrad: nn.LayerNorm through the LayerNormalization rule, the written-out
    one through the chain pattern (node by node without onnxscript)."""
    ids = np.random.default_rng(0).integers(0, 100, (2, 8)).astype(np.int64)
    ids[0, :3] = 7  # a repeated token: its embedding row sums three gradients
    fused = layer_norm == "nn" or _declarative.AVAILABLE
    _check_model(_tiny_bert(layer_norm), ids, exporter, "input_ids", ("hidden", "pooled"),
                 "LayerNormalizationGrad", 5 if fused else 0)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_tiny_vit_matches_torch(exporter):
    """ViTModel (32 px, patch 8, hidden 32, 2 layers, 2 heads): patch Conv, class token
    Concat, position embeddings, 5 LayerNormalizations, pooler; the gradient of the image too."""
    pixels = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    _check_model(_tiny_vit(), pixels, exporter, "pixel_values", ("hidden", "pooled"), "LayerNormalizationGrad", 5)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("whole", [False, True], ids=["block", "LlamaModel"])
def test_llama_matches_torch(exporter, whole):
    """A Llama decoder block (LlamaDecoderLayer + final LlamaRMSNorm; hidden 32, 2 heads, 1
    KV head) on hidden states, and a whole one-layer LlamaModel (token embedding, causal mask)
    on token ids: the three RMSNorms, written by both exporters as x * rsqrt(mean(x²) + eps)
    * w with Casts to float32, each one RMSNormalizationGrad (the chain pattern); the gated
    MLP's silu(gate) * up one SiLUMul, differentiated as one SwiGLUGrad."""
    if "Slice" not in supported_op_types():
        pytest.skip("rotary embeddings slice q and k: no Slice gradient rule on this branch yet")
    rng = np.random.default_rng(0)
    if whole:
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        module = _Outputs(transformers.LlamaModel(_llama_config()), "input_ids", ("last_hidden_state",))
        inputs = rng.integers(0, 100, (2, 8)).astype(np.int64)
    else:
        module, inputs = _LlamaBlock(), rng.standard_normal((2, 8, 32)).astype(np.float32)
    norms = 3 if _declarative.AVAILABLE else 0
    ops = _check_model(module, inputs, exporter, "input_ids" if whole else "hidden", ("y",), "RMSNormalizationGrad",
                       norms)
    assert (ops["SiLUMul"], ops["SwiGLUGrad"], ops["Sigmoid"]) == (1, 1, 0), ops


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("family", ["Mistral", "Qwen2"])
def test_gated_silu_families_match_torch(exporter, family):
    """One-layer MistralModel and Qwen2Model (Llama's layout: RMSNorm, rotary attention with
    grouped KV heads, Qwen2 with q/k/v biases; the same SiLU-gated MLP) on token ids: their
    outputs and every parameter's gradient against torch autograd, the gated unit one
    SiLUMul differentiated as one SwiGLUGrad."""
    if "Slice" not in supported_op_types():
        pytest.skip("rotary embeddings slice q and k: no Slice gradient rule on this branch yet")
    transformers = pytest.importorskip("transformers")
    llama = _llama_config().to_dict()
    options = {key: llama[key] for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                           "num_attention_heads", "num_key_value_heads", "vocab_size",
                                           "max_position_embeddings", "attention_dropout")}
    config = getattr(transformers, f"{family}Config")(**options, attn_implementation="eager")
    torch.manual_seed(0)
    module = _Outputs(getattr(transformers, f"{family}Model")(config), "input_ids", ("last_hidden_state",))
    inputs = np.random.default_rng(0).integers(0, 100, (2, 8)).astype(np.int64)
    norms = 3 if _declarative.AVAILABLE else 0
    ops = _check_model(module, inputs, exporter, "input_ids", ("y",), "RMSNormalizationGrad", norms)
    assert (ops["SiLUMul"], ops["SwiGLUGrad"], ops["Sigmoid"]) == (1, 1, 0), ops


class _Seq2SeqLogits(nn.Module):
    """A transformers encoder-decoder's logits from input_ids and decoder_input_ids."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, decoder_input_ids):
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False).logits


def _seq2seq(transformers, family):
    """A tiny random ``family`` model (d_model 16, one layer each side, vocab 64, no dropout)
    and its pad token."""
    if family == "T5":
        config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                                       num_heads=2, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                                       decoder_start_token_id=0, attn_implementation="eager")
        return transformers.T5ForConditionalGeneration(config), 0
    pad = {"Pegasus": 0, "Bart": 1}[family]
    config = getattr(transformers, f"{family}Config")(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=pad, bos_token_id=2, eos_token_id=3,
        decoder_start_token_id=pad)
    return getattr(transformers, f"{family}ForConditionalGeneration")(config), pad


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("family", ["Pegasus", "Bart", "T5"])
def test_seq2seq_with_padding_matches_torch_on_every_tensor(exporter, family, tmp_path):
    """Pegasus and BART (nn.Embedding with padding_idx, its weight shared by both embeddings
    and the tied LM head) and T5 (no padding_idx), through normgrad.torch.export, on ids
    holding the pad token (Pegasus's decoder start token): every parameter's gradient, the
    padding row of the shared embedding included, against torch autograd to 1e-4 of the
    tensor's own largest |gradient|. A gradient that is zero in exact arithmetic (the key
    projections' bias: softmax ignores a shift of a query's scores) is rounding noise in
    both, compared to 1e-10 of the model's largest gradient instead."""
    transformers = pytest.importorskip("transformers")
    import normgrad.torch

    torch.manual_seed(0)
    model, pad = _seq2seq(transformers, family)
    module = _Seq2SeqLogits(model).train()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, (2, 6)).astype(np.int64)
    ids[:, -2:] = pad
    decoder_ids = rng.integers(0, 64, (2, 5)).astype(np.int64)
    decoder_ids[:, 0] = decoder_ids[1, -1] = pad
    forward = normgrad.torch.export(module, (torch.tensor(ids), torch.tensor(decoder_ids)), tmp_path / "m.onnx",
                                    exporter=exporter, input_names=["input_ids", "decoder_input_ids"],
                                    output_names=["logits"])
    initializer_of = {name: init for init, name in json.loads(
        next(p.value for p in forward.metadata_props if p.key == "normgrad.torch_parameters")).items()}
    logits = module(torch.tensor(ids), torch.tensor(decoder_ids))
    seed = rng.standard_normal(tuple(logits.shape)).astype(np.float32)
    logits.backward(torch.tensor(seed))
    results, _ = _run_training(forward, {"input_ids": ids, "decoder_input_ids": decoder_ids}, {"logits": seed})
    np.testing.assert_allclose(results["logits"], logits.detach().numpy(), rtol=1e-4, atol=1e-4)
    expected = {name: p.grad.numpy() for name, p in module.named_parameters() if p.requires_grad}
    largest = max(np.abs(grad).max() for grad in expected.values())
    shared = module.model.get_input_embeddings()
    assert shared.padding_idx == (None if family == "T5" else pad)
    shared_name = next(name for name, p in module.named_parameters() if p is shared.weight)
    assert np.abs(expected[shared_name][pad]).max() > 0  # the tied LM head's gradient reaches the padding row
    for name, grad in expected.items():
        error = np.abs(results[f"{initializer_of[name]}_grad"] - grad).max()
        assert error <= 1e-4 * max(np.abs(grad).max(), 1e-6 * largest), (name, error, np.abs(grad).max())
