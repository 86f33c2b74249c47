"""Tiny LLMs written by onnxruntime-genai's model builder (int4 MatMulNBits, GroupQueryAttention
with a KV cache, SimplifiedLayerNormalization): a random-weight transformers model and a word-level
tokenizer saved to a folder, then ``python -m onnxruntime_genai.models.builder`` offline."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np

VOCABULARY = 256


ARCHITECTURES = ("llama", "qwen2", "phi3")
"""The transformers families :func:`build_tiny_genai` builds: Llama, Qwen2 (q/k/v biases) and
Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``)."""


def tiny_config(architecture: str):
    """The transformers config of a tiny ``architecture`` (hidden 64, 2 layers, 4 heads, 2 KV
    heads, MLP 96, vocabulary 256; the tokenizer's special tokens; an lm_head of its own).

    The MLP is not 128: the builder takes any Linear with as many outputs as the vocabulary for
    the LM head (``has_lm_head``), and Phi-3's gate_up_proj would have 2 * 128 = 256."""
    import transformers

    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=VOCABULARY, intermediate_size=96, max_position_embeddings=128, bos_token_id=1,
                 eos_token_id=2, pad_token_id=None, tie_word_embeddings=False)
    configs = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "phi3": transformers.Phi3Config}
    if architecture == "phi3":  # the same context length: the builder's Phi-3 "mini" (no LongRoPE)
        sizes["original_max_position_embeddings"] = sizes["max_position_embeddings"]
    return configs[architecture](**sizes)


def build_tiny_genai(folder: pathlib.Path, architecture: str = "llama", precision: str = "int4") -> pathlib.Path:
    """Builds a tiny ``architecture`` (:data:`ARCHITECTURES`, :func:`tiny_config`) with random
    weights (seed 0) in ``folder / "hf"`` and the genai builder's ``precision`` model from it in
    ``folder / "genai"``; returns the path of its model.onnx (external data beside it)."""
    import torch
    import transformers

    from normgrad.tools.bench_train import save_word_tokenizer

    torch.manual_seed(0)
    hf_folder, out = folder / "hf", folder / "genai"
    transformers.AutoModelForCausalLM.from_config(tiny_config(architecture)).save_pretrained(hf_folder)
    save_word_tokenizer(hf_folder, VOCABULARY)
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder), "-o", str(out),
                    "-p", precision, "-e", "cpu", "-c", str(folder / "cache")], check=True, capture_output=True)
    return out / "model.onnx"


def build_tiny_llama(folder: pathlib.Path, precision: str = "int4") -> pathlib.Path:
    """:func:`build_tiny_genai` of a Llama."""
    return build_tiny_genai(folder, "llama", precision)


def causal_lm_loss(logits: np.ndarray, labels: np.ndarray, ignore_index: int = -100) -> float:
    """transformers' causal-LM loss in float64: position t predicts label t + 1."""
    logits, targets = logits[:, :-1].astype(np.float64), labels[:, 1:]
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    kept = targets != ignore_index
    picked = np.take_along_axis(log_probs, np.where(kept, targets, 0)[..., None], -1)[..., 0]
    return float(-(picked * kept).sum() / kept.sum())
