"""Tiny LLMs written by onnxruntime-genai's model builder (int4 MatMulNBits, GroupQueryAttention
with a KV cache, SimplifiedLayerNormalization): a random-weight transformers model and a word-level
tokenizer saved to a folder, then ``python -m onnxruntime_genai.models.builder`` offline."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np

VOCABULARY = 256


def build_tiny_llama(folder: pathlib.Path, precision: str = "int4") -> pathlib.Path:
    """Builds a Llama (hidden 64, 2 layers, 4 heads, 2 KV heads, vocabulary 256) with the genai
    builder in ``folder``; returns the path of its model.onnx (external data beside it)."""
    import torch
    import transformers

    from normgrad.tools.bench_train import save_word_tokenizer

    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=VOCABULARY, intermediate_size=128, max_position_embeddings=128)
    torch.manual_seed(0)
    hf_folder, out = folder / "hf", folder / "genai"
    transformers.LlamaForCausalLM(config).save_pretrained(hf_folder)
    save_word_tokenizer(hf_folder, VOCABULARY)
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder), "-o", str(out),
                    "-p", precision, "-e", "cpu", "-c", str(folder / "cache")], check=True, capture_output=True)
    return out / "model.onnx"


def causal_lm_loss(logits: np.ndarray, labels: np.ndarray, ignore_index: int = -100) -> float:
    """transformers' causal-LM loss in float64: position t predicts label t + 1."""
    logits, targets = logits[:, :-1].astype(np.float64), labels[:, 1:]
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    kept = targets != ignore_index
    picked = np.take_along_axis(log_probs, np.where(kept, targets, 0)[..., None], -1)[..., 0]
    return float(-(picked * kept).sum() / kept.sum())
