"""The CNN architectures of torchvision written out in torch, block for block (torchvision
itself does not import beside the CPU torch of this project's machines): ResNet (BasicBlock),
MobileNetV2 and V3-small (inverted residuals, SE), ShuffleNetV2 (channel split and shuffle),
EfficientNet (MBConv), DenseNet and ConvNeXt. ``normgrad bench --train`` times them and the
model-family tests differentiate them; width and depth are parameters so both can shrink them.
Imported only where torch is wanted (it imports torch)."""

from __future__ import annotations

import functools
from typing import List, Sequence

import torch
from torch import nn
from torch.nn import functional as F


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


# MobileNetV2 -----------------------------------------------------------------------------


class InvertedResidualV2(nn.Module):
    """MobileNetV2's block: 1x1 expand + ReLU6 (if expand_ratio > 1), depthwise 3x3 + ReLU6,
    1x1 project, residual where the shape allows."""

    def __init__(self, cin, cout, stride, expand_ratio):
        super().__init__()
        hidden = int(round(cin * expand_ratio))
        self.use_res_connect = stride == 1 and cin == cout
        layers: List[nn.Module] = []
        if expand_ratio != 1:
            layers.append(conv_norm_act(cin, hidden, 1, act=nn.ReLU6))
        layers += [conv_norm_act(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6),
                   nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


MOBILENET_V2 = [  # torchvision's table: expand ratio, out, repeats, first stride
    (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1),
]


class MobileNetV2(nn.Module):
    """torchvision.models.mobilenet_v2 (width_mult scales every channel count)."""

    def __init__(self, width_mult=1.0, num_classes=10, dropout=0.2):
        super().__init__()
        cin, last = make_divisible(32 * width_mult), make_divisible(1280 * max(1.0, width_mult))
        layers: List[nn.Module] = [conv_norm_act(3, cin, 3, 2, act=nn.ReLU6)]
        for expand_ratio, channels, repeats, stride in MOBILENET_V2:
            cout = make_divisible(channels * width_mult)
            for i in range(repeats):
                layers.append(InvertedResidualV2(cin, cout, stride if i == 0 else 1, expand_ratio))
                cin = cout
        layers.append(conv_norm_act(cin, last, 1, act=nn.ReLU6))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


# ShuffleNetV2 ----------------------------------------------------------------------------


def channel_shuffle(x, groups: int):
    """torchvision's channel shuffle: [N, g*c, H, W] -> view [N, g, c, H, W], swap g and c."""
    n, channels, height, width = x.shape
    x = x.view(n, groups, channels // groups, height, width).transpose(1, 2).contiguous()
    return x.view(n, channels, height, width)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2's unit: stride 1 splits the channels in two and transforms one half
    (1x1, depthwise 3x3, 1x1); stride 2 transforms both branches; concat, then shuffle."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        half = cout // 2
        self.stride = stride
        self.branch1 = nn.Sequential()
        if stride > 1:
            self.branch1 = nn.Sequential(
                nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False), nn.BatchNorm2d(cin),
                conv_norm_act(cin, half, 1))
        branch_in = cin if stride > 1 else half
        self.branch2 = nn.Sequential(
            conv_norm_act(branch_in, half, 1),
            nn.Conv2d(half, half, 3, stride, 1, groups=half, bias=False), nn.BatchNorm2d(half),
            conv_norm_act(half, half, 1))

    def forward(self, x):
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


SHUFFLENET_V2_CHANNELS = {0.5: (24, 48, 96, 192, 1024), 1.0: (24, 116, 232, 464, 1024)}


class ShuffleNetV2(nn.Module):
    """torchvision.models.shufflenet_v2_x0_5 / x1_0 (stages of 4, 8, 4 units); ``channels``
    overrides the table to shrink it."""

    def __init__(self, width=0.5, num_classes=10, channels=None):
        super().__init__()
        stem, *stages, last = channels or SHUFFLENET_V2_CHANNELS[width]
        self.conv1 = conv_norm_act(3, stem, 3, 2)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers: List[nn.Module] = []
        cin = stem
        for repeats, cout in zip((4, 8, 4), stages):
            layers += [ShuffleUnit(cin if i == 0 else cout, cout, 2 if i == 0 else 1) for i in range(repeats)]
            cin = cout
        self.stages = nn.Sequential(*layers)
        self.conv5 = conv_norm_act(cin, last, 1)
        self.fc = nn.Linear(last, num_classes)

    def forward(self, x):
        return self.fc(self.conv5(self.stages(self.maxpool(self.conv1(x)))).mean((2, 3)))
