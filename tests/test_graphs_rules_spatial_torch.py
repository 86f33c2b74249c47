"""The spatial and data-movement rules against torch autograd: F.interpolate, F.pad,
nn.ConvTranspose2d, slicing, split, repeat, exported by both torch exporters; and a small
decoder exported once with dynamic image size, compared at two sizes."""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional

from _transformer_blocks import _distinct_parameters  # noqa: E402
from _torch_rule_checks import _Lambda, _assert_matches_torch, _compare  # noqa: E402


INTERPOLATIONS = [
    dict(scale_factor=2, mode="nearest"),
    dict(size=(9, 7), mode="nearest"),
    dict(scale_factor=2, mode="nearest-exact"),
    dict(scale_factor=2, mode="bilinear", align_corners=False),
    dict(scale_factor=2, mode="bilinear", align_corners=True),
    dict(size=(4, 9), mode="bilinear", align_corners=False),
    dict(size=(11, 3), mode="bilinear", align_corners=True),
    dict(scale_factor=0.5, mode="bilinear", align_corners=False, antialias=True),
    dict(scale_factor=2, mode="bicubic", align_corners=False),
    dict(scale_factor=1.5, mode="bicubic", align_corners=True),
]


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("kwargs", INTERPOLATIONS, ids=lambda k: "-".join(f"{v}" for v in k.values()))
def test_interpolate(kwargs, exporter):
    module = _Lambda(lambda x, conv: F.interpolate(conv(x), **kwargs), nn.Conv2d(2, 3, 1))
    _compare(module, (2, 2, 6, 4), exporter)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("mode, pads", [
    ("constant", (1, 2, 0, 3)), ("constant", (-1, 2, 1, -2)), ("reflect", (2, 1, 1, 2)),
    ("replicate", (3, 0, 1, 2)), ("circular", (1, 2, 2, 1)),
])
def test_pad(mode, pads, exporter):
    value = {"value": 0.5} if mode == "constant" else {}
    module = _Lambda(lambda x, conv: F.pad(conv(x), pads, mode=mode, **value), nn.Conv2d(2, 3, 1))
    _compare(module, (2, 2, 5, 4), exporter)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("kwargs", [
    dict(in_channels=4, out_channels=6, kernel_size=3),
    dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, output_padding=1),
    dict(in_channels=4, out_channels=6, kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), groups=2, dilation=(1, 2)),
    dict(in_channels=4, out_channels=4, kernel_size=4, stride=2, padding=1, groups=4, bias=False),
])
def test_conv_transpose(kwargs, exporter):
    _compare(nn.ConvTranspose2d(**kwargs), (2, 4, 5, 4), exporter)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("name, fn", [
    ("slices", lambda x: x[:, 1:, ::2] * 2 + x[:, :-1, -3:-1].sum(-1, keepdim=True)),
    ("flip", lambda x: torch.flip(x, dims=[1, 2]) * x),
    ("split", lambda x: torch.cat([p * (i + 1) for i, p in enumerate(torch.split(x, [1, 3, 1], dim=1))], 1)),
    ("chunk_unused", lambda x: x.chunk(3, dim=-1)[1] * 3),
    ("repeat", lambda x: x.repeat(2, 1, 3) * torch.arange(30.0).reshape(1, 1, 30)),
])
def test_data_movement(name, fn, exporter):
    module = _Lambda(lambda x, lin: fn(lin(x)), nn.Linear(3, 10))
    _compare(module, (2, 5, 3), exporter)


class _Decoder(nn.Module):
    """Conv (stride 2) → ConvTranspose → nearest and bilinear upsampling → reflect Pad →
    AvgPool → MaxPool → global average, on any image size."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1)
        self.mix = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x):
        h = torch.relu(self.down(x))
        a = self.up(h)
        b = F.interpolate(h, scale_factor=2, mode="nearest")
        z = self.mix(torch.cat([a, b], 1))
        z = F.interpolate(z, scale_factor=2, mode="bilinear", align_corners=False)
        z = F.avg_pool2d(F.pad(z, (1, 1, 2, 0), mode="reflect"), 3, stride=2, padding=1, count_include_pad=False)
        return F.max_pool2d(z, 2) + z.mean((2, 3), keepdim=True)


def test_decoder_exported_once_with_dynamic_image_size():
    """TorchScript export with symbolic N, H, W; the one training graph against torch
    autograd at two image sizes."""
    torch.manual_seed(0)
    module = _Decoder().train()
    _distinct_parameters(module)
    buffer = io.BytesIO()
    torch.onnx.export(module, (torch.randn(2, 3, 16, 16),), buffer, dynamo=False, opset_version=17,
                      do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "N", 2: "H", 3: "W"}, "y": {0: "N", 2: "h", 3: "w"}})
    forward = onnx.load_from_string(buffer.getvalue())
    assert [d.dim_param for d in forward.graph.input[0].type.tensor_type.shape.dim] == ["N", "", "H", "W"]
    for seed, shape in enumerate([(2, 3, 16, 12), (1, 3, 10, 14)]):
        rng = np.random.default_rng(seed)
        _assert_matches_torch(forward, module, rng.standard_normal(shape).astype(np.float32), rng)
