"""Transformer blocks exported by torch and trained against torch autograd, shared by the rule tests that
run them; skips without torch."""

from __future__ import annotations

import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from normgrad.graphs import build_training_graph

torch = pytest.importorskip("torch")
nn = torch.nn


def _distinct_parameters(module, seed=0):
    """Distinct random values for every parameter, so that no exporter can merge two of them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            offset = 1.0 if "norm" in name.lower() and name.endswith("weight") else 0.0
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3 + offset)


def _export(module, args, exporter, input_names, output_names):
    """The model as ``exporter`` writes it; a skip quoting the exporter's own error if it cannot."""
    try:
        if exporter == "torchscript":
            buffer = io.BytesIO()
            torch.onnx.export(module, args, buffer, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                              do_constant_folding=False, input_names=input_names, output_names=output_names, opset_version=17)
            return onnx.load_from_string(buffer.getvalue())
        program = torch.onnx.export(module, args, dynamo=True, opset_version=18, input_names=input_names,
                                    output_names=output_names, optimize=False, verbose=False)
    except Exception as error:  # e.g. the dynamo exporter needs onnxscript
        pytest.skip(f"the {exporter} exporter cannot export the model: {type(error).__name__}: {error}")
    return program.model_proto


def _run_training(forward, feeds, seeds, extra_outputs=(), training=None):
    """The training graph's outputs by name (forward outputs, gradients and ``extra_outputs``)
    and its trainable weights' names; ``training``: the TrainingGraph already built from ``forward``."""
    model, weights = build_training_graph(forward) if training is None else training
    for name in extra_outputs:
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    feeds = {**weights, **feeds, **{f"{name}_grad": seed for name, seed in seeds.items()}}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return dict(zip(names, session.run(None, feeds))), set(weights)


def _assert_gradients_match(results, weights, module, extra=None):
    """Every parameter (each a trainable weight of its own name) and ``extra`` against torch
    autograd, to 1e-4 of the largest gradient."""
    expected = dict(extra or {})
    for name, param in module.named_parameters():
        assert name in weights, (name, sorted(weights))
        expected[name] = param.grad.numpy()
    largest = max(np.abs(grad).max() for grad in expected.values())
    for name, grad in expected.items():
        error = np.abs(results[f"{name}_grad"] - grad).max()
        assert error < 1e-4 * largest, (name, error, largest)


def _llama_config(hidden=32):
    """Eager attention: with the default (sdpa), the TorchScript exporter cannot export
    LlamaModel's causal mask (no symbolic for ``aten::diff``)."""
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=100, max_position_embeddings=16, attention_dropout=0.0,
        attn_implementation="eager",
    )


class _LlamaBlock(nn.Module):
    """A Llama decoder layer (RMSNorm, rotary attention with grouped KV heads, SiLU-gated MLP)
    and the final RMSNorm, on hidden states (so the input's gradient is compared too)."""

    def __init__(self):
        super().__init__()
        from transformers.models.llama import modeling_llama

        config = _llama_config()
        torch.manual_seed(0)
        self.rotary = modeling_llama.LlamaRotaryEmbedding(config)
        self.layer = modeling_llama.LlamaDecoderLayer(config, 0)
        self.norm = modeling_llama.LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden):
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        out = self.layer(hidden, attention_mask=None, position_ids=positions,
                         position_embeddings=self.rotary(hidden, positions))
        return self.norm(out[0] if isinstance(out, tuple) else out)
