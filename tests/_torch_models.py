"""torch models for the model-family tests, built in code.

torchvision does not import beside the CPU torch here (its package index only has a CUDA
build) and timm's layers import torchvision, so the torchvision architectures are written
out with the same block structure as torchvision's definitions: the CNNs in
``normgrad.tools._torch_cnns`` (which ``normgrad bench --train`` times too), re-exported
here, and VisionTransformer (patch conv, class token, position embedding,
nn.MultiheadAttention); the tests shrink their width and depth for CI time.
transformers' BERT and diffusers' UNet2DModel / AutoencoderKL come from tiny configs.
Random weights only; nothing is downloaded.
"""

from __future__ import annotations

from typing import Dict, Sequence

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from normgrad.graphs.builder import training_graph_parts
from normgrad.tools._torch_cnns import (  # noqa: F401 (re-exported)
    ConvNeXt, DenseNet, EfficientNet, MobileNetV2, MobileNetV3, ResNet, ShuffleNetV2)


# VisionTransformer -----------------------------------------------------------------------


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: LayerNorm, nn.MultiheadAttention, residual, LayerNorm, MLP
    (Linear, GELU, Dropout, Linear, Dropout), residual."""

    def __init__(self, heads, hidden, mlp, dropout=0.0, attention_dropout=0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(hidden, heads, dropout=attention_dropout, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(hidden, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp), nn.GELU(), nn.Dropout(dropout), nn.Linear(mlp, hidden), nn.Dropout(dropout))

    def forward(self, x):
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = self.dropout(y) + x
        return x + self.mlp(self.ln_2(x))


class VisionTransformer(nn.Module):
    """torchvision.models.VisionTransformer: patch conv, class token, position embedding,
    encoder blocks, final LayerNorm, linear head on the class token."""

    def __init__(self, image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10):
        super().__init__()
        self.patch_size, self.hidden_dim = patch_size, hidden_dim
        self.conv_proj = nn.Conv2d(3, hidden_dim, patch_size, patch_size)
        seq_length = (image_size // patch_size) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_dim))
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, hidden_dim).normal_(std=0.02))
        self.dropout = nn.Dropout(0.0)
        self.layers = nn.Sequential(*[EncoderBlock(num_heads, hidden_dim, mlp_dim) for _ in range(num_layers)])
        self.ln = nn.LayerNorm(hidden_dim, eps=1e-6)
        self.heads = nn.Linear(hidden_dim, num_classes)

    def forward(self, x):
        n = x.shape[0]
        x = self.conv_proj(x).reshape(n, self.hidden_dim, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        x = self.ln(self.layers(self.dropout(x + self.pos_embedding)))
        return self.heads(x[:, 0])


# A classifier with nn.Dropout in training mode ---------------------------------------------


class DropoutClassifier(nn.Module):
    def __init__(self, p=0.3):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(16, 32), nn.Dropout(p), nn.Linear(32, 5)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


# recurrent networks and the operator tail (issue 21) ----------------------------------------


class RecurrentClassifier(nn.Module):
    """A 2-layer bidirectional nn.LSTM or nn.GRU over [N, T, F] (batch first), the last step's
    features to class scores."""

    def __init__(self, kind="LSTM", features=6, hidden=8, classes=4, layers=2):
        super().__init__()
        self.rnn = getattr(nn, kind)(features, hidden, num_layers=layers, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class PixelShuffleSR(nn.Module):
    """ESPCN-style super-resolution: convolutions to r*r*C channels, nn.PixelShuffle(r)."""

    def __init__(self, channels=3, width=8, r=2):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, width, 3, padding=1), nn.Tanh(),
                                  nn.Conv2d(width, channels * r * r, 3, padding=1))
        self.shuffle = nn.PixelShuffle(r)

    def forward(self, x):
        return self.shuffle(self.body(x))


class PReLUMish(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act1 = nn.Linear(16, 12), nn.PReLU(12)
        self.conv, self.act2 = nn.Conv1d(1, 3, 3, padding=1), nn.PReLU()
        self.fc2, self.act3, self.fc3 = nn.Linear(36, 10), nn.Mish(), nn.Linear(10, 5)

    def forward(self, x):
        h = self.act1(self.fc1(x))
        h = self.act2(self.conv(h.unsqueeze(1))).flatten(1)
        return self.fc3(self.act3(self.fc2(h)))


class CumsumPositions(nn.Module):
    """Position ids from the cumulative sum of the padding mask (as transformers' RoBERTa
    computes them), and a causal running mean of the embeddings (a float cumsum)."""

    def __init__(self, vocab=50, dim=8, positions=16):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(positions, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, input_ids):
        mask = (input_ids != 0).long()
        position_ids = torch.cumsum(mask, dim=1) * mask
        h = self.tokens(input_ids) + self.positions(position_ids)
        steps = torch.arange(1, input_ids.shape[1] + 1, dtype=h.dtype).unsqueeze(-1)
        return self.head(torch.cumsum(h, dim=1) / steps)


class EmbeddingBagRecommender(nn.Module):
    """Sum-pooled user and item bags (nn.EmbeddingBag, offsets form) scored by an MLP."""

    def __init__(self, users=30, items=40, dim=8):
        super().__init__()
        self.users, self.items = nn.EmbeddingBag(users, dim, mode="sum"), nn.EmbeddingBag(items, dim, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, user_ids, user_offsets, item_ids, item_offsets):
        return self.mlp(torch.cat([self.users(user_ids, user_offsets), self.items(item_ids, item_offsets)], dim=1))


# transformers BERT, diffusers UNet2DModel and AutoencoderKL --------------------------------


class DecomposedLayerNorm(nn.Module):
    """nn.LayerNorm written out (ReduceMean, Sub, Mul, Sqrt, Div, ...), for exports before a
    LayerNormalization gradient rule exists."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.bias, self.eps = norm.weight, norm.bias, norm.eps

    def forward(self, x):
        centred = x - x.mean(-1, keepdim=True)
        return centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + self.eps) * self.weight + self.bias


class BertEncoder(nn.Module):
    """transformers.BertModel (hidden 32, 2 layers, 2 heads, vocab 100, dropout p = 0) ->
    (last hidden state, pooled output)."""

    def __init__(self, layer_norm="nn"):
        super().__init__()
        import transformers

        config = transformers.BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
            max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        self.bert = transformers.BertModel(config)
        if layer_norm == "decomposed":
            for child in list(self.bert.modules()):
                for attribute, sub in list(child.named_children()):
                    if isinstance(sub, nn.LayerNorm):
                        setattr(child, attribute, DecomposedLayerNorm(sub))

    def forward(self, input_ids):
        out = self.bert(input_ids=input_ids)
        return out.last_hidden_state, out.pooler_output


class UNet(nn.Module):
    """diffusers.UNet2DModel, tiny: 32 px, channels (16, 32), one ResNet layer per block, an
    attention block at the lower resolution, GroupNorm of 8 groups -> the predicted noise."""

    def __init__(self):
        super().__init__()
        import diffusers

        self.unet = diffusers.UNet2DModel(
            sample_size=32, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
            down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            norm_num_groups=8, attention_head_dim=8,
        )

    def forward(self, sample, timestep):
        return self.unet(sample, timestep).sample


class VAE(nn.Module):
    """diffusers.AutoencoderKL, tiny: channels (16, 32), one layer per block, 4 latent
    channels, GroupNorm of 8 groups; encode, take the posterior's mode, decode."""

    def __init__(self):
        super().__init__()
        import diffusers

        self.vae = diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1, latent_channels=4,
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8,
        )

    def forward(self, sample):
        return self.vae(sample, sample_posterior=False).sample


TINY_DECODER = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    intermediate_size=32, vocab_size=50, max_position_embeddings=16)
"""A one-layer transformers decoder config: hidden 16, 2 query heads sharing 1 key/value head, vocab 50."""


def mixtral():
    """transformers.MixtralForCausalLM (TINY_DECODER; 4 experts, 2 per token) -> logits."""
    import transformers

    from normgrad.torch import causal_lm_logits

    config = transformers.MixtralConfig(**TINY_DECODER, num_local_experts=4, num_experts_per_tok=2)
    return causal_lm_logits(transformers.MixtralForCausalLM(config))


def qwen2_moe():
    """transformers.Qwen2MoeForCausalLM (TINY_DECODER; 4 experts of 16, 2 per token, a shared
    expert of 32 behind its sigmoid gate) -> logits."""
    import transformers

    from normgrad.torch import causal_lm_logits

    config = transformers.Qwen2MoeConfig(**TINY_DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=32)
    return causal_lm_logits(transformers.Qwen2MoeForCausalLM(config))


class FNetEncoder(nn.Module):
    """transformers.FNetModel (hidden 16, 1 layer, vocab 50 with padding token 0, dropout p = 0;
    token mixing by torch.fft.fftn, not the TPU matrices) -> (last hidden state, pooled output)."""

    def __init__(self):
        super().__init__()
        import transformers

        config = transformers.FNetConfig(hidden_size=16, num_hidden_layers=1, intermediate_size=32, vocab_size=50,
                                         max_position_embeddings=16, hidden_dropout_prob=0.0, pad_token_id=0,
                                         use_tpu_fourier_optimizations=False)
        self.fnet = transformers.FNetModel(config)

    def forward(self, input_ids):
        out = self.fnet(input_ids=input_ids)
        return out.last_hidden_state, out.pooler_output


def run_training_graph(training, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Every output of ``training`` (a TrainingGraph or a model) by name, run in onnxruntime
    with ``feeds`` plus the weights' values ``training`` carries."""
    model, weights = training_graph_parts(training)
    feeds = {**weights, **feeds}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


class LastHiddenState(nn.Module):
    """A transformers base model ``make(transformers)`` -> its last hidden state; the inputs
    are passed as the keywords ``inputs`` name (its dropout probabilities set to 0 by ``make``)."""

    def __init__(self, make, inputs: Sequence[str] = ("input_ids",)):
        super().__init__()
        import transformers

        self.model, self.inputs = make(transformers), tuple(inputs)

    def forward(self, *values):
        return self.model(**dict(zip(self.inputs, values))).last_hidden_state


def longformer() -> LastHiddenState:
    """transformers.LongformerModel (hidden 32, 1 layer, 2 heads, attention window 4): its
    sliding-window attention writes its band matrices by slice assignment (ScatterND). Its
    default config: ``normgrad.torch.export`` sets ``onnx_export`` for the export (overlapping
    chunks by ``unfold``, not ``as_strided``, which torch's TorchScript exporter writes wrongly)."""
    return LastHiddenState(lambda t: t.LongformerModel(t.LongformerConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        max_position_embeddings=64, attention_window=[4], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))


def swinv2() -> LastHiddenState:
    """transformers.Swinv2Model (image 32, patch 4, embed 16, depths (1, 1), window 4): the
    shifted-window attention mask is written by slice assignment."""
    return LastHiddenState(lambda t: t.Swinv2Model(t.Swinv2Config(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)), ("pixel_values",))


def rwkv() -> LastHiddenState:
    """transformers.RwkvModel (hidden 32, 2 layers, context 16): its CPU time-mixing loop
    writes each step's output with ``out[:, t] = ...``."""
    return LastHiddenState(lambda t: t.RwkvModel(t.RwkvConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
        context_length=16)))


def funnel() -> LastHiddenState:
    """transformers.FunnelBaseModel (d_model 32, 2 blocks of 1 layer, 2 heads): pooling between blocks."""
    return LastHiddenState(lambda t: t.FunnelBaseModel(t.FunnelConfig(
        vocab_size=100, block_sizes=[1, 1], d_model=32, n_head=2, d_head=16, d_inner=64, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0)))
