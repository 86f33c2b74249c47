"""The tiny transformers/diffusers blocks of the trainer matrix, their batches and the reference steps at each
optimization level; skips without torch and transformers."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import normgrad
from normgrad.graphs.optimizers import hyperparameter_feeds
from normgrad.graphs.rewrites import DROPOUT_SEED_INPUT

import _torch_models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
LEVELS = {
    "disable_all": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


class _First(torch.nn.Module):
    """A transformers model called with one keyword input, returning its first output."""

    def __init__(self, model, input_name):
        super().__init__()
        self.model, self.input_name = model, input_name

    def forward(self, inputs):
        return self.model(**{self.input_name: inputs})[0]


def _bert():
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=50, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return _First(transformers.BertModel(config, add_pooling_layer=False), "input_ids"), _tokens


def _gpt2():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50, n_positions=16, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return _First(transformers.GPT2Model(config), "input_ids"), _tokens


def _vit():
    config = transformers.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)
    return _First(transformers.ViTModel(config, add_pooling_layer=False), "pixel_values"), _images(16)


class _LlamaBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from transformers.models.llama import modeling_llama

        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, vocab_size=50,
                                          max_position_embeddings=16, attn_implementation="eager")
        self.rotary = modeling_llama.LlamaRotaryEmbedding(config)
        self.layer = modeling_llama.LlamaDecoderLayer(config, 0)

    def forward(self, hidden):
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        out = self.layer(hidden, attention_mask=None, position_ids=positions,
                         position_embeddings=self.rotary(hidden, positions))
        return out[0] if isinstance(out, tuple) else out


def _llama():
    return _LlamaBlock(), lambda rng, n: rng.standard_normal((n, 6, 32)).astype(np.float32)


def _resnet():
    return _torch_models.ResNet(layers=(1, 1, 1, 1), width=4, num_classes=4), _images(32)


class _UNetBlock(torch.nn.Module):
    """diffusers' UNet down block with attention (ResNet + GroupNorm + self-attention) at a
    fixed time embedding."""

    def __init__(self):
        super().__init__()
        from diffusers.models.unets.unet_2d_blocks import AttnDownBlock2D

        self.block = AttnDownBlock2D(
            in_channels=8, out_channels=16, temb_channels=8, num_layers=1, resnet_groups=4, attention_head_dim=8,
            downsample_type=None)

    def forward(self, sample):
        return self.block(sample, torch.zeros(sample.shape[0], 8))[0]


def _unet():
    pytest.importorskip("diffusers")
    return _UNetBlock(), lambda rng, n: rng.standard_normal((n, 8, 8, 8)).astype(np.float32)


def _tokens(rng, n):
    """Token 0 is BERT's padding_idx, which the ONNX export loses (its row would get a gradient)."""
    return rng.integers(1, 50, (n, 6)).astype(np.int64)


def _images(size):
    return lambda rng, n: rng.standard_normal((n, 3, size, size)).astype(np.float32)


def _frozen(forward_model: onnx.ModelProto):
    """Attention key biases: their gradient is zero in exact arithmetic (softmax ignores a
    constant added along a row), so Adam would amplify rounding noise into lr-sized steps."""
    return [t.name for t in forward_model.graph.initializer if t.name.endswith(("key.bias", "to_k.bias"))]


MODELS = {"bert": _bert, "gpt2": _gpt2, "vit": _vit, "llama": _llama, "resnet": _resnet, "unet": _unet}
BATCH = 4


def _forward(name, folder):
    """(module, make_input(rng, n), the exported forward ModelProto); distinct random weights."""
    module, make_input = MODELS[name]()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter_name, parameter in module.named_parameters():
            offset = 1.0 if "norm" in parameter_name.lower() and parameter_name.endswith("weight") else 0.0
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2 + offset)
    module.train()
    example = torch.tensor(make_input(np.random.default_rng(0), BATCH))
    from normgrad import torch as normgrad_torch

    forward = normgrad_torch.export(module, (example,), folder / f"{name}.onnx", input_names=["x"], output_names=["y"],
                                    dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    with torch.no_grad():
        output_shape = tuple(module(example).shape[1:])
    return module, make_input, forward, output_shape


def _batch(make_input, output_shape, seed, n=BATCH):
    rng = np.random.default_rng(seed)
    return {"x": make_input(rng, n), "labels": rng.standard_normal((n,) + output_shape).astype(np.float32)}


def _session_options(level):
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    return options


def _reference_steps(step, initial, batches, lr, level):
    """session.run of the step graph itself, its NAME.next outputs fed back as the next state."""
    state_map = json.loads({e.key: e.value for e in step.metadata_props}["normgrad.state"])
    session = ort.InferenceSession(step.SerializeToString(), normgrad.session_options("cpp", _session_options(level)),
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    # a step graph with Dropout (even p = 0) takes the seed of its masks; the Trainer feeds the graph's default, 0
    seed = {DROPOUT_SEED_INPUT: np.array(0, np.int64)} if DROPOUT_SEED_INPUT in {i.name for i in session.get_inputs()} else {}
    state = dict(initial)
    for number, batch in enumerate(batches, 1):
        feeds = {**hyperparameter_feeds(step), **batch, **state, **seed, "lr": np.array(lr, np.float32), "step": np.array(number, np.float32)}
        outputs = dict(zip(names, session.run(None, feeds)))
        state = {name: outputs[next_name] for name, next_name in state_map.items()}
    return state


def _assert_state_close(actual, expected, what, tolerance):
    for name, value in expected.items():
        scale = max(float(np.abs(value).max()), 1e-30)
        error = float(np.abs(actual[name] - value).max())
        assert error <= tolerance * scale, (
            f"{what}: state tensor {name!r} differs by {error:.3g}, more than {tolerance} of its scale {scale:.3g}")
