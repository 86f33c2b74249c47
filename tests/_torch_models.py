"""torch models for the model-family tests, built in code.

torchvision does not import beside the CPU torch here (its package index only has a CUDA
build) and timm's layers import torchvision, so the torchvision architectures are written
out with the same block structure as torchvision's definitions, at reduced width and depth
for CI time: ResNet (BasicBlock), MobileNetV3 (InvertedResidual, SE with Hardsigmoid,
Hardswish), EfficientNet (MBConv, SiLU, SE, stochastic depth off), DenseNet (dense layers
concatenated, transitions), ConvNeXt (depthwise 7x7, LayerNorm, GELU, layer scale) and
VisionTransformer (patch conv, class token, position embedding, nn.MultiheadAttention).
transformers' BERT and diffusers' UNet2DModel / AutoencoderKL come from tiny configs.
Random weights only; nothing is downloaded.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Sequence

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn
from torch.nn import functional as F

from normgrad.graphs.builder import training_graph_parts


def make_divisible(value: float, divisor: int = 8) -> int:
    """torchvision's _make_divisible: round to a multiple of divisor, losing at most 10%."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def conv_norm_act(cin, cout, kernel, stride=1, groups=1, norm=nn.BatchNorm2d, act=nn.ReLU):
    """torchvision's Conv2dNormActivation: Conv (no bias) -> norm -> activation."""
    layers: List[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False), norm(cout)]
    if act is not None:
        layers.append(act(inplace=True) if act in (nn.ReLU, nn.Hardswish, nn.SiLU) else act())
    return nn.Sequential(*layers)


# ResNet-18 -------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    """torchvision.models.resnet18's structure: 7x7/2 stem, 3x3/2 max pool, four stages of two
    BasicBlocks (1x1/2 conv + BN shortcut where the shape changes), global pool, fc."""

    def __init__(self, layers=(2, 2, 2, 2), width=64, num_classes=10):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], 2)
        self.layer3 = self._make_layer(width * 4, layers[2], 2)
        self.layer4 = self._make_layer(width * 8, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8, num_classes)

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# MobileNetV3-small -----------------------------------------------------------------------


class SqueezeExcitation(nn.Module):
    """torchvision.ops.SqueezeExcitation: pool -> 1x1 conv -> act -> 1x1 conv -> gate -> scale."""

    def __init__(self, channels, squeeze, activation=nn.ReLU, scale_activation=nn.Sigmoid):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = activation()
        self.scale_activation = scale_activation()

    def forward(self, x):
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class InvertedResidual(nn.Module):
    """MobileNetV3's block: 1x1 expand (if wider), depthwise kxk, SE (Hardsigmoid gate), 1x1 project."""

    def __init__(self, cin, kernel, expanded, cout, use_se, activation, stride):
        super().__init__()
        norm = functools.partial(nn.BatchNorm2d, eps=0.001, momentum=0.01)
        act = nn.Hardswish if activation == "HS" else nn.ReLU
        self.use_res_connect = stride == 1 and cin == cout
        layers: List[nn.Module] = []
        if expanded != cin:
            layers.append(conv_norm_act(cin, expanded, 1, norm=norm, act=act))
        layers.append(conv_norm_act(expanded, expanded, kernel, stride, groups=expanded, norm=norm, act=act))
        if use_se:
            layers.append(SqueezeExcitation(expanded, make_divisible(expanded // 4), scale_activation=nn.Hardsigmoid))
        layers.append(conv_norm_act(expanded, cout, 1, norm=norm, act=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        y = self.block(x)
        return y + x if self.use_res_connect else y


MOBILENET_V3_SMALL = [  # torchvision's table: in, kernel, expanded, out, SE, activation, stride
    (16, 3, 16, 16, True, "RE", 2), (16, 3, 72, 24, False, "RE", 2), (24, 3, 88, 24, False, "RE", 1),
    (24, 5, 96, 40, True, "HS", 2), (40, 5, 240, 40, True, "HS", 1), (40, 5, 240, 40, True, "HS", 1),
    (40, 5, 120, 48, True, "HS", 1), (48, 5, 144, 48, True, "HS", 1), (48, 5, 288, 96, True, "HS", 2),
    (96, 5, 576, 96, True, "HS", 1), (96, 5, 576, 96, True, "HS", 1),
]


class MobileNetV3(nn.Module):
    """torchvision.models.mobilenet_v3_small (width_mult scales every channel count)."""

    def __init__(self, width_mult=1.0, num_classes=10, dropout=0.2):
        super().__init__()
        norm = functools.partial(nn.BatchNorm2d, eps=0.001, momentum=0.01)
        adjust = lambda channels: make_divisible(channels * width_mult)  # noqa: E731
        layers: List[nn.Module] = [conv_norm_act(3, adjust(16), 3, 2, norm=norm, act=nn.Hardswish)]
        for cin, kernel, expanded, cout, use_se, activation, stride in MOBILENET_V3_SMALL:
            layers.append(InvertedResidual(adjust(cin), kernel, adjust(expanded), adjust(cout), use_se, activation, stride))
        last_in = adjust(96)
        layers.append(conv_norm_act(last_in, 6 * last_in, 1, norm=norm, act=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(6 * last_in, adjust(1024)), nn.Hardswish(inplace=True), nn.Dropout(dropout, inplace=True),
            nn.Linear(adjust(1024), num_classes),
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# EfficientNet-B0 -------------------------------------------------------------------------


class MBConv(nn.Module):
    """EfficientNet's block: 1x1 expand + SiLU, depthwise kxk + SiLU, SE (SiLU, sigmoid gate),
    1x1 project; residual where the shape is kept (stochastic depth off: the identity)."""

    def __init__(self, expand_ratio, kernel, stride, cin, cout):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        expanded = make_divisible(cin * expand_ratio)
        layers: List[nn.Module] = []
        if expanded != cin:
            layers.append(conv_norm_act(cin, expanded, 1, act=nn.SiLU))
        layers.append(conv_norm_act(expanded, expanded, kernel, stride, groups=expanded, act=nn.SiLU))
        layers.append(SqueezeExcitation(expanded, max(1, cin // 4), activation=functools.partial(nn.SiLU, inplace=True)))
        layers.append(conv_norm_act(expanded, cout, 1, act=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        y = self.block(x)
        return y + x if self.use_res_connect else y


EFFICIENTNET_B0 = [  # expand ratio, kernel, stride, in, out, layers
    (1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
    (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1),
]


class EfficientNet(nn.Module):
    """torchvision.models.efficientnet_b0 with every channel count times width_mult and each
    stage's depth capped at max_layers."""

    def __init__(self, width_mult=1.0, max_layers=None, num_classes=10, dropout=0.2):
        super().__init__()
        adjust = lambda channels: make_divisible(channels * width_mult)  # noqa: E731
        layers: List[nn.Module] = [conv_norm_act(3, adjust(32), 3, 2, act=nn.SiLU)]
        for expand_ratio, kernel, stride, cin, cout, repeats in EFFICIENTNET_B0:
            stage = []
            for i in range(min(repeats, max_layers or repeats)):
                stage.append(MBConv(expand_ratio, kernel, stride if i == 0 else 1, adjust(cin) if i == 0 else adjust(cout), adjust(cout)))
            layers.append(nn.Sequential(*stage))
        layers.append(conv_norm_act(adjust(320), 4 * adjust(320), 1, act=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(dropout, inplace=True), nn.Linear(4 * adjust(320), num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# DenseNet-121 ----------------------------------------------------------------------------


class DenseLayer(nn.Module):
    """BN-ReLU-1x1 conv (bn_size * growth) - BN-ReLU-3x3 conv (growth) on the concatenation of
    every earlier feature map."""

    def __init__(self, cin, growth, bn_size):
        super().__init__()
        self.norm1, self.relu1 = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2, self.relu2 = nn.BatchNorm2d(bn_size * growth), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, 1, 1, bias=False)

    def forward(self, features: List[torch.Tensor]):
        bottleneck = self.conv1(self.relu1(self.norm1(torch.cat(features, 1))))
        return self.conv2(self.relu2(self.norm2(bottleneck)))


class DenseBlock(nn.ModuleDict):
    def __init__(self, layers, cin, growth, bn_size):
        super().__init__()
        for i in range(layers):
            self.add_module(f"denselayer{i + 1}", DenseLayer(cin + i * growth, growth, bn_size))

    def forward(self, x):
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNet(nn.Module):
    """torchvision.models.densenet121's structure (7x7/2 stem + max pool, dense blocks joined by
    BN-ReLU-1x1 conv-2x2 average pool transitions, final BN, ReLU, global pool, linear)."""

    def __init__(self, growth=32, blocks=(6, 12, 24, 16), init_features=64, bn_size=4, num_classes=10):
        super().__init__()
        features = nn.Sequential()
        features.add_module("conv0", nn.Conv2d(3, init_features, 7, 2, 3, bias=False))
        features.add_module("norm0", nn.BatchNorm2d(init_features))
        features.add_module("relu0", nn.ReLU(inplace=True))
        features.add_module("pool0", nn.MaxPool2d(3, 2, 1))
        channels = init_features
        for i, layers in enumerate(blocks):
            features.add_module(f"denseblock{i + 1}", DenseBlock(layers, channels, growth, bn_size))
            channels += layers * growth
            if i != len(blocks) - 1:
                features.add_module(f"transition{i + 1}", nn.Sequential(
                    nn.BatchNorm2d(channels), nn.ReLU(inplace=True), nn.Conv2d(channels, channels // 2, 1, bias=False),
                    nn.AvgPool2d(2, 2)))
                channels //= 2
        features.add_module("norm5", nn.BatchNorm2d(channels))
        self.features = features
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x):
        out = F.adaptive_avg_pool2d(F.relu(self.features(x)), (1, 1))
        return self.classifier(torch.flatten(out, 1))


# ConvNeXt-tiny ---------------------------------------------------------------------------


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (permute, layer_norm, permute back)."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class CNBlock(nn.Module):
    """ConvNeXt block: depthwise 7x7, channels-last LayerNorm, Linear 4x, GELU, Linear, layer
    scale, residual (stochastic depth off)."""

    def __init__(self, dim, layer_scale=1e-6):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, 7, padding=3, groups=dim), Permute([0, 2, 3, 1]), nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), Permute([0, 3, 1, 2]),
        )
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)

    def forward(self, x):
        return self.layer_scale * self.block(x) + x


class Permute(nn.Module):
    def __init__(self, dims: Sequence[int]):
        super().__init__()
        self.dims = list(dims)

    def forward(self, x):
        return torch.permute(x, self.dims)


class ConvNeXt(nn.Module):
    """torchvision.models.convnext_tiny's structure: 4x4/4 patchify stem + LayerNorm2d, stages
    of CNBlocks joined by LayerNorm2d + 2x2/2 conv, global pool, LayerNorm2d, flatten, linear."""

    def __init__(self, dims=(96, 192, 384, 768), depths=(3, 3, 9, 3), num_classes=10):
        super().__init__()
        norm = functools.partial(LayerNorm2d, eps=1e-6)
        layers: List[nn.Module] = [nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), norm(dims[0]))]
        for i, (dim, depth) in enumerate(zip(dims, depths)):
            layers.append(nn.Sequential(*[CNBlock(dim) for _ in range(depth)]))
            if i + 1 < len(dims):
                layers.append(nn.Sequential(norm(dim), nn.Conv2d(dim, dims[i + 1], 2, 2)))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(norm(dims[-1]), nn.Flatten(1), nn.Linear(dims[-1], num_classes))

    def forward(self, x):
        return self.classifier(self.avgpool(self.features(x)))


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
    sliding-window attention writes its band matrices by slice assignment (ScatterND).
    ``onnx_export``: overlapping chunks by ``unfold``, not ``as_strided`` (which torch's
    TorchScript exporter writes wrongly: its forward differs from torch's)."""
    return LastHiddenState(lambda t: t.LongformerModel(t.LongformerConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        max_position_embeddings=64, attention_window=[4], onnx_export=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))


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
