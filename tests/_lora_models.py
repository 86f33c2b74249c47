"""Tiny random transformers causal LMs wrapped by peft LoRA, for the LoRA and external-data tests; skips
without torch, transformers and peft."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _gpt2():
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config), ["c_attn", "c_proj", "c_fc"]


FAMILIES = {"llama": _llama, "gpt2": _gpt2}


def _peft_model(family):
    torch.manual_seed(0)
    base, targets = FAMILIES[family]()
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=family == "gpt2")
    return peft.get_peft_model(base, config), base_state


def _fresh_base(family, base_state):
    base, _ = FAMILIES[family]()
    base.load_state_dict(base_state)
    return base.eval()


def _torch_name(onnx_name: str) -> str:
    assert onnx_name.startswith("model."), onnx_name
    return onnx_name[len("model."):]
