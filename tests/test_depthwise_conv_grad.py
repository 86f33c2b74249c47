"""DepthwiseConvGrad and DepthwiseConv (its forward): every backend (the C++ kernel, the
function body on onnxruntime beside the Python kernels and alone, onnx's ReferenceEvaluator)
against the float64 reference, which float64 finite differences of a direct convolution (the
direct convolution itself, for the forward) check; the C++ kernels' bits on every path and
thread count; bad inputs named; the Conv rule writes them for depthwise convs only, and a
MobileNet-style block's gradients match torch autograd with and without the kernels."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from _helpers import assert_cpp_bits_everywhere, bad_input_tests, cpp_available, zeros
from normgrad.graphs import build_training_graph
from normgrad.graphs.examples import model
from normgrad.ops import DOMAIN, depthwise_conv, depthwise_conv_grad, harness

OP = depthwise_conv_grad.OP_TYPE
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")

CASES = {  # name: (x shape [N, C, H, W], kernel, strides, pads [t, l, b, r], dilations)
    "3x3 same": ((2, 5, 7, 9), 3, [1, 1], [1, 1, 1, 1], [1, 1]),
    "3x3 rows past the lanes": ((2, 13, 6, 37), 3, [1, 1], [1, 1, 1, 1], [1, 1]),
    "1x1 maps": ((2, 17, 1, 1), 3, [1, 1], [1, 1, 1, 1], [1, 1]),
    "batch 1, stride 2, odd sizes": ((1, 9, 11, 21), 3, [2, 2], [1, 1, 1, 1], [1, 1]),
    "stride 2, no end pad": ((3, 6, 12, 19), 3, [2, 2], [0, 1, 0, 0], [1, 1]),
    "dilation 2, uneven pads": ((2, 3, 10, 23), 3, [1, 1], [2, 0, 1, 3], [2, 2]),
    "dilation 2, stride 2": ((1, 4, 13, 17), 3, [2, 1], [2, 2, 2, 2], [2, 2]),
    "5x5 stride 2": ((2, 11, 15, 14), 5, [2, 2], [2, 2, 2, 2], [1, 1]),
    "stride 3, short rows across groups": ((2, 5, 11, 29), 3, [3, 3], [1, 1, 1, 1], [1, 1]),
    "7x7 (ConvNeXt)": ((2, 7, 9, 26), 7, [1, 1], [3, 3, 3, 3], [1, 1]),
    "kernel wider than the map": ((1, 3, 2, 3), 5, [1, 1], [2, 2, 2, 2], [1, 1]),
    "1x1, pads past its reach": ((2, 5, 6, 7), 1, [1, 1], [1, 2, 0, 1], [1, 1]),
}


def _inputs(case, dtype=np.float32, seed=0):
    shape, k, strides, pads, dilations = CASES[case]
    rng = np.random.default_rng(seed)
    ho = depthwise_conv_grad.output_size(shape[2], k, strides[0], pads[0], pads[2], dilations[0])
    wo = depthwise_conv_grad.output_size(shape[3], k, strides[1], pads[1], pads[3], dilations[1])
    feeds = {"x": rng.standard_normal(shape), "w": rng.standard_normal((shape[1], 1, k, k)),
             "dy": rng.standard_normal((shape[0], shape[1], ho, wo))}
    attributes = {"group": shape[1], "strides": strides, "pads": pads, "dilations": dilations}
    return {name: value.astype(dtype) for name, value in feeds.items()}, attributes


def _direct_conv(x, w, strides, pads, dilations):
    """The depthwise Conv's output in float64, output pixel by output pixel."""
    n, c, h, width = x.shape
    k_h, k_w = w.shape[2:]
    padded = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    ho = depthwise_conv_grad.output_size(h, k_h, strides[0], pads[0], pads[2], dilations[0])
    wo = depthwise_conv_grad.output_size(width, k_w, strides[1], pads[1], pads[3], dilations[1])
    y = np.zeros((n, c, ho, wo))
    for i in range(ho):
        for j in range(wo):
            rows = i * strides[0] + dilations[0] * np.arange(k_h)
            columns = j * strides[1] + dilations[1] * np.arange(k_w)
            y[:, :, i, j] = (padded[:, :, rows][:, :, :, columns] * w[None, :, 0]).sum((2, 3))
    return y


@pytest.mark.parametrize("case", CASES)
def test_reference_is_the_finite_difference_gradient(case):
    """dx and dw are the float64 central differences of sum(conv(x, w) * dy) (exact up to
    rounding: the sum is linear in each)."""
    feeds, attributes = _inputs(case, np.float64)
    geometry = [attributes[name] for name in ("strides", "pads", "dilations")]
    dx, dw = depthwise_conv_grad.reference(**feeds, **attributes)
    rng = np.random.default_rng(1)
    for name, gradient in (("x", dx), ("w", dw)):
        for flat in rng.choice(gradient.size, size=min(gradient.size, 25), replace=False):
            index = np.unravel_index(flat, gradient.shape)
            values = {}
            for sign in (1, -1):
                moved = dict(feeds)
                moved[name] = feeds[name].copy()
                moved[name][index] += sign * 1e-3
                values[sign] = (_direct_conv(moved["x"], moved["w"], *geometry) * feeds["dy"]).sum()
            assert abs((values[1] - values[-1]) / 2e-3 - gradient[index]) < 1e-8, (name, index)


@pytest.mark.parametrize("case", CASES)
def test_every_backend_is_the_float64_gradient(backend, case):
    """float32 on every backend within the float32 rounding of sums of that many products
    (the bound from the reference of the absolute values)."""
    feeds, attributes = _inputs(case)
    outputs = harness.run(backend, OP, feeds, attributes=attributes)
    truth = depthwise_conv_grad.reference(**{k: v.astype(np.float64) for k, v in feeds.items()}, **attributes)
    scale = depthwise_conv_grad.reference(**{k: np.abs(v).astype(np.float64) for k, v in feeds.items()}, **attributes)
    terms = feeds["dy"].shape[0] * feeds["dy"].shape[2] * feeds["dy"].shape[3] + feeds["w"].size
    for name, exact, bound in zip(("dx", "dw"), truth, scale):
        result = np.asarray(outputs[name])
        assert result.dtype == np.float32 and result.shape == exact.shape, name
        assert (np.abs(result - exact) <= 2 ** -22 * terms * bound + 1e-30).all(), name


@pytest.mark.parametrize("backend", ["evaluator"] + (["cpp"] if cpp_available() else []))
@pytest.mark.parametrize("case", ["batch 1, stride 2, odd sizes", "dilation 2, uneven pads", "7x7 (ConvNeXt)"])
def test_float64(backend, case):
    """Float64 graphs (the gradient checks) get the float64 gradient (onnxruntime's CPU
    ConvTranspose, in the function body, is float32 only)."""
    feeds, attributes = _inputs(case, np.float64)
    outputs = harness.run(backend, OP, feeds, attributes=attributes)
    for name, exact in zip(("dx", "dw"), depthwise_conv_grad.reference(**feeds, **attributes)):
        assert outputs[name].dtype == np.float64
        np.testing.assert_allclose(outputs[name], exact, rtol=1e-12, atol=1e-12)


_PATH_SCRIPT = """
import sys, numpy as np
from normgrad.ops import harness
rng = np.random.default_rng(2)
results = []
for shape, k, stride, dilation in [((3, 40, 19, 45), 3, 1, 1), ((2, 24, 21, 33), 5, 2, 1), ((2, 16, 9, 30), 3, 1, 2)]:
    pad = (k - 1) * dilation // 2
    size = [(s + 2 * pad - (k - 1) * dilation - 1) // stride + 1 for s in shape[2:]]
    feeds = {"x": rng.standard_normal(shape).astype(np.float32),
             "w": rng.standard_normal((shape[1], 1, k, k)).astype(np.float32),
             "dy": rng.standard_normal((shape[0], shape[1], *size)).astype(np.float32)}
    out = harness.run("cpp", "DepthwiseConvGrad", feeds, threads=int(sys.argv[2]),
                      attributes={"group": shape[1], "strides": [stride] * 2, "pads": [pad] * 4, "dilations": [dilation] * 2})
    results += [out["dx"].ravel(), out["dw"].ravel()]
np.save(sys.argv[1], np.concatenate(results))
"""


@needs_cpp
def test_cpp_kernel_gives_the_same_bits_on_every_path_and_thread_count(tmp_path):
    """dx one fused multiply-add chain per element, dw eight lanes per tap added in a fixed
    tree: the AVX2 rows and the portable ones (NORMGRAD_KERNELS=generic) agree bit for bit at
    1, 2 and 4 threads (each channel whole on one thread)."""
    assert_cpp_bits_everywhere(tmp_path, _PATH_SCRIPT)


BAD = {
    "x rank 3": ({"x": zeros(1, 1, 4), "w": zeros(1, 1, 3, 3), "dy": zeros(1, 1, 2, 2)},
                 "input 'x' must have rank 4 ([N, C, H, W]); got shape [1, 1, 4]"),
    "int32": ({"x": zeros(1, 1, 4, 4, dtype=np.int32), "w": zeros(1, 1, 3, 3), "dy": zeros(1, 1, 2, 2)},
              "input 'x' must be float32 or float64; got int32"),
    "types differ": ({"x": zeros(1, 1, 4, 4), "w": zeros(1, 1, 3, 3, dtype=np.float64), "dy": zeros(1, 1, 2, 2)},
                     "input 'w' must have x's type float32; got float64"),
    "channel multiplier 2": ({"x": zeros(1, 1, 4, 4), "w": zeros(2, 1, 3, 3), "dy": zeros(1, 2, 2, 2)},
                             "input 'w' must be [C, 1, kh, kw] with x's C = 1; got shape [2, 1, 3, 3]"),
    "group is not C": ({"x": zeros(1, 2, 4, 4), "w": zeros(2, 1, 3, 3), "dy": zeros(1, 2, 2, 2)},
                       "attribute 'group' must equal x's channels 2; got 1"),
    "kernel past the input": ({"x": zeros(1, 1, 2, 4), "w": zeros(1, 1, 3, 3), "dy": zeros(1, 1, 1, 2)},
                              "the padded input [2, 4] must hold the dilated kernel of 'w' [1, 1, 3, 3]"),
    "dy not the output size": ({"x": zeros(2, 1, 4, 4), "w": zeros(1, 1, 3, 3), "dy": zeros(2, 1, 2, 3)},
                               "input 'dy' must have the Conv's output shape [2, 1, 2, 2]; got [2, 1, 2, 3]"),
}

test_cpp_bad_input_names_the_input, test_validate_names_the_input = bad_input_tests(depthwise_conv_grad, BAD)


@needs_cpp
def test_cpp_bad_attribute_names_it():
    feeds, attributes = _inputs("3x3 same")
    with pytest.raises(Exception, match=r"DepthwiseConvGrad: attribute 'strides' must be 2 integers >= 1; got \[1, 0\]"):
        harness.run("cpp", OP, feeds, attributes={**attributes, "strides": [1, 0]})
    with pytest.raises(Exception, match="attribute 'pads' must be 4 integers >= 0"):
        depthwise_conv_grad.reference(**feeds, **{**attributes, "pads": [1, 1]})


# -- DepthwiseConv, the forward ------------------------------------------------------------------


def _forward_inputs(case, dtype=np.float32, bias=True):
    feeds, attributes = _inputs(case, dtype)
    del feeds["dy"]
    if bias:
        feeds["b"] = np.random.default_rng(5).standard_normal(feeds["x"].shape[1]).astype(dtype)
    return feeds, attributes


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_forward_reference_is_the_direct_convolution(case, bias):
    feeds, attributes = _forward_inputs(case, np.float64, bias)
    geometry = [attributes[name] for name in ("strides", "pads", "dilations")]
    expected = _direct_conv(feeds["x"], feeds["w"], *geometry)
    if bias:
        expected += feeds["b"][None, :, None, None]
    np.testing.assert_allclose(depthwise_conv.reference(**feeds, **attributes).y, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_forward_every_backend_is_the_float64_output(backend, case, bias):
    """float32 on every backend (the function body: onnxruntime's and onnx's Conv) within the
    float32 rounding of sums of that many products, from the reference of the absolute values."""
    feeds, attributes = _forward_inputs(case, bias=bias)
    result = np.asarray(harness.run(backend, depthwise_conv.OP_TYPE, feeds, attributes=attributes)["y"])
    as64 = {k: v.astype(np.float64) for k, v in feeds.items()}
    exact = depthwise_conv.reference(**as64, **attributes).y
    bound = depthwise_conv.reference(**{k: np.abs(v) for k, v in as64.items()}, **attributes).y
    assert result.dtype == np.float32 and result.shape == exact.shape
    assert (np.abs(result - exact) <= 2 ** -22 * (feeds["w"][0].size + 1) * bound + 1e-30).all()


@pytest.mark.parametrize("backend", ["evaluator"] + (["cpp"] if cpp_available() else []))
@pytest.mark.parametrize("case", ["batch 1, stride 2, odd sizes", "dilation 2, uneven pads", "7x7 (ConvNeXt)"])
def test_forward_float64(backend, case):
    feeds, attributes = _forward_inputs(case, np.float64)
    y = harness.run(backend, depthwise_conv.OP_TYPE, feeds, attributes=attributes)["y"]
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, depthwise_conv.reference(**feeds, **attributes).y, rtol=1e-12, atol=1e-12)


_FORWARD_PATH_SCRIPT = """
import sys, numpy as np
from normgrad.ops import harness
rng = np.random.default_rng(2)
results = []
for shape, k, stride, dilation in [((3, 40, 19, 45), 3, 1, 1), ((2, 24, 21, 33), 5, 2, 1), ((2, 16, 9, 30), 7, 1, 2),
                                   ((2, 12, 4, 4), 7, 1, 1), ((2, 7, 11, 29), 3, 3, 1), ((1, 9, 6, 9), 3, 1, 1)]:
    pad = (k - 1) * dilation // 2
    feeds = {"x": rng.standard_normal(shape).astype(np.float32),
             "w": rng.standard_normal((shape[1], 1, k, k)).astype(np.float32),
             "b": rng.standard_normal(shape[1]).astype(np.float32)}
    out = harness.run("cpp", "DepthwiseConv", feeds, threads=int(sys.argv[2]),
                      attributes={"group": shape[1], "strides": [stride] * 2, "pads": [pad] * 4, "dilations": [dilation] * 2})
    results.append(out["y"].ravel())
np.save(sys.argv[1], np.concatenate(results))
"""


@needs_cpp
def test_forward_cpp_kernel_gives_the_same_bits_on_every_path_and_thread_count(tmp_path):
    """Each y one fused multiply-add chain over the taps: the AVX2 block and the portable one
    (NORMGRAD_KERNELS=generic) agree bit for bit at 1, 2 and 4 threads."""
    assert_cpp_bits_everywhere(tmp_path, _FORWARD_PATH_SCRIPT)


FORWARD_BAD = {
    "x rank 3": ({"x": zeros(1, 1, 4), "w": zeros(1, 1, 3, 3)}, "input 'x' must have rank 4 ([N, C, H, W]); got shape [1, 1, 4]"),
    "types differ": ({"x": zeros(1, 1, 4, 4), "w": zeros(1, 1, 3, 3, dtype=np.float64)},
                     "input 'w' must have x's type float32; got float64"),
    "channel multiplier 2": ({"x": zeros(1, 1, 4, 4), "w": zeros(2, 1, 3, 3)},
                             "input 'w' must be [C, 1, kh, kw] with x's C = 1; got shape [2, 1, 3, 3]"),
    "kernel past the input": ({"x": zeros(1, 1, 2, 4), "w": zeros(1, 1, 3, 3)},
                              "the padded input [2, 4] must hold the dilated kernel of 'w' [1, 1, 3, 3]"),
    "kernel rows past the limit": ({"x": zeros(1, 1, 70, 4), "w": zeros(1, 1, 65, 1)},
                                   "input 'w' must have at most 64 kernel rows; got shape [1, 1, 65, 1]"),
    "bias not [C]": ({"x": zeros(1, 1, 4, 4), "w": zeros(1, 1, 3, 3), "b": zeros(2)},
                     "input 'b' must be [C] = [1] of x's type float32; got float32 [2]"),
}

test_forward_cpp_bad_input_names_the_input, test_forward_validate_names_the_input = bad_input_tests(depthwise_conv,
                                                                                                      FORWARD_BAD)


# -- the Conv rule ------------------------------------------------------------------------------


def _conv_forward(channels, out_channels, group, elem_type=onnx.TensorProto.FLOAT):
    rng = np.random.default_rng(3)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
    weights = {"W": rng.standard_normal((out_channels, channels // group, 3, 3)).astype(dtype)}
    node = oh.make_node("Conv", ["x", "W"], ["y"], group=group, strides=[2, 2], pads=[1, 1, 1, 1])
    return model([node], {"x": [2, channels, 9, 9]}, ["y"], weights, elem_type=elem_type)


def _conv_model(channels, out_channels, group, frozen_weight=False, elem_type=onnx.TensorProto.FLOAT):
    forward = _conv_forward(channels, out_channels, group, elem_type)
    return build_training_graph(forward, frozen=["W"] if frozen_weight else ())


def _ops(graph):
    return collections.Counter(n.op_type for n in graph.node)


@pytest.mark.parametrize("elem_type", [onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE])
def test_depthwise_conv_gradient_is_one_operator(elem_type):
    graph = _conv_model(6, 6, 6, elem_type=elem_type).model.graph
    nodes = [n for n in graph.node if n.op_type == OP]
    assert len(nodes) == 1 and nodes[0].domain == DOMAIN
    assert {a.name: oh.get_attribute_value(a) for a in nodes[0].attribute} == \
        {"group": 6, "strides": [2, 2], "pads": [1, 1, 1, 1], "dilations": [1, 1]}
    assert "ConvTranspose" not in _ops(graph)
    forward = [n for n in graph.node if n.op_type == depthwise_conv.OP_TYPE]
    assert len(forward) == 1 and forward[0].domain == DOMAIN and "Conv" not in _ops(graph)
    assert [name for name in forward[0].input if name] == ["x", "W"] and forward[0].attribute == nodes[0].attribute


@pytest.mark.parametrize("case", ["frozen weight", "channel multiplier 2", "grouped"])
def test_other_grouped_convs_keep_the_graph_form(case):
    training = {"frozen weight": lambda: _conv_model(6, 6, 6, frozen_weight=True),
                "channel multiplier 2": lambda: _conv_model(4, 8, 4), "grouped": lambda: _conv_model(6, 6, 3)}[case]()
    ops = _ops(training.model.graph)
    assert OP not in ops and depthwise_conv.OP_TYPE not in ops and ops["ConvTranspose"] == 1 and ops["Conv"] >= 1


def test_inference_model_runs_the_depthwise_conv_as_a_conv():
    """The inference model of a step graph whose forward is a DepthwiseConv holds the Conv
    again (constant weights: onnxruntime's own path is the fast one), computing the direct
    convolution."""
    from normgrad.graphs import build_step_graph
    from normgrad.graphs.step_graph import build_inference_model

    step, state = build_step_graph(build_training_graph(_conv_forward(6, 6, 6), loss="mse"), "adamw")
    assert sum(n.op_type == depthwise_conv.OP_TYPE for n in step.graph.node) == 1
    inference = build_inference_model(step, state)
    assert not any(n.domain == DOMAIN for n in inference.graph.node) and not inference.functions
    assert [n.op_type for n in inference.graph.node] == ["Conv"]
    x = np.random.default_rng(6).standard_normal((2, 6, 9, 9)).astype(np.float32)
    y = harness.run_model(inference, {"x": x}, "functions")["y"]
    expected = _direct_conv(x.astype(np.float64), state["W"].astype(np.float64), [2, 2], [1, 1, 1, 1], [1, 1])
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["inline", "portable"])
def test_inline_and_portable_forms_are_standard_onnx_with_the_same_gradients(form):
    """``--inline`` and ``--portable`` write the function body: no normgrad node, the
    ConvTranspose and Conv of the graph form, dx and dW as the operator's."""
    from normgrad.graphs.portable import make_portable

    training = build_training_graph(_conv_forward(6, 6, 6))
    rewritten = (build_training_graph(_conv_forward(6, 6, 6), inline=True).model if form == "inline"
                 else make_portable(training.model)[0])
    assert not any(n.domain == DOMAIN for n in rewritten.graph.node)
    assert {"ConvTranspose", "Conv"} <= set(_ops(rewritten.graph))
    rng = np.random.default_rng(4)
    feeds = {**training.weights, "x": rng.standard_normal((2, 6, 9, 9)).astype(np.float32),
             "y_grad": rng.standard_normal((2, 6, 5, 5)).astype(np.float32)}
    expected = depthwise_conv_grad.reference(feeds["x"].astype(np.float64), feeds["W"].astype(np.float64),
                                             feeds["y_grad"].astype(np.float64), 6, [2, 2], [1, 1, 1, 1], [1, 1])
    outputs = harness.run_model(rewritten, feeds, "functions")
    np.testing.assert_allclose(outputs["x_grad"], expected.dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outputs["W_grad"], expected.dw, rtol=1e-5, atol=1e-5)


# -- a MobileNet-style block against torch autograd ---------------------------------------------


def _inverted_residual(torch):
    """MobileNetV2's block: 1x1 expand, 3x3 depthwise (stride 1, then 2 with odd sizes, then a
    dilated 5x5), ReLU6, 1x1 project, the residual."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.expand = nn.Conv2d(5, 13, 1, bias=False)
            self.depthwise = nn.Conv2d(13, 13, 3, padding=1, groups=13, bias=False)
            self.strided = nn.Conv2d(13, 13, 3, stride=2, padding=1, groups=13)
            self.dilated = nn.Conv2d(13, 13, 5, padding=4, dilation=2, groups=13, bias=False)
            self.norm = nn.BatchNorm2d(13)
            self.project = nn.Conv2d(13, 5, 1)

        def forward(self, x):
            h = nn.functional.relu6(self.norm(self.depthwise(self.expand(x))))
            h = nn.functional.relu6(self.dilated(self.strided(h)))
            return self.project(h) + x[:, :, ::2, ::2]

    return Block()


@pytest.mark.parametrize("backend", ["functions", "inline"] + (["cpp"] if cpp_available() else []))
def test_mobilenet_block_matches_torch_autograd(backend):
    torch = pytest.importorskip("torch")
    from _transformer_blocks import _assert_gradients_match, _distinct_parameters, _export

    torch.manual_seed(0)
    module = _inverted_residual(torch).train()
    _distinct_parameters(module, 0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 11, 11)).astype(np.float32)
    forward = _export(module, (torch.tensor(x),), "torchscript", ["x"], ["y"])
    training, weights = build_training_graph(forward, inline=backend == "inline")
    assert sum(n.op_type == OP for n in training.graph.node) == (0 if backend == "inline" else 3)
    assert sum(n.op_type == depthwise_conv.OP_TYPE for n in training.graph.node) == (0 if backend == "inline" else 3)
    xt = torch.tensor(x, requires_grad=True)
    y = module(xt)
    dy = rng.standard_normal(tuple(y.shape)).astype(np.float32)
    y.backward(torch.tensor(dy))
    feeds = {**weights, "x": x, "y_grad": dy}
    inputs = {i.name for i in training.graph.input}
    outputs = harness.run_model(training, {k: v for k, v in feeds.items() if k in inputs},
                                "functions" if backend == "inline" else backend)
    np.testing.assert_allclose(outputs["y"], y.detach().numpy(), rtol=1e-5, atol=1e-5)
    _assert_gradients_match(outputs, set(weights), module, {"x": xt.grad.numpy()})


def test_depthwise_convs_sharing_input_and_weight_run_forward_each_with_its_geometry():
    """Two depthwise Convs of the same x and w (dilation 1 and 2, as weight-sharing branches
    at several dilations): each forward DepthwiseConv has its own geometry, so the training
    graph's output and gradients are those of its standard form (``inline``)."""
    rng = np.random.default_rng(8)
    nodes = [oh.make_node("Conv", ["x", "W"], ["a"], group=4, pads=[1, 1, 1, 1]),
             oh.make_node("Conv", ["x", "W"], ["b"], group=4, pads=[2, 2, 2, 2], dilations=[2, 2]),
             oh.make_node("Add", ["a", "b"], ["y"])]
    forward = model(nodes, {"x": [2, 4, 9, 9]}, ["y"], {"W": rng.standard_normal((4, 1, 3, 3)).astype(np.float32)})
    training, weights = build_training_graph(forward)
    forwards = [n for n in training.graph.node if n.op_type == depthwise_conv.OP_TYPE]
    assert sorted(oh.get_attribute_value(a) for n in forwards for a in n.attribute if a.name == "dilations") == \
        [[1, 1], [2, 2]]
    standard, _ = build_training_graph(forward, inline=True)
    feeds = {**weights, "x": rng.standard_normal((2, 4, 9, 9)).astype(np.float32),
             "y_grad": rng.standard_normal((2, 4, 9, 9)).astype(np.float32)}
    backends = ["cpp"] if cpp_available() else ["functions"]
    expected = harness.run_model(standard, feeds, "functions")
    for backend in backends:
        outputs = harness.run_model(training, feeds, backend)
        for name in ("y", "x_grad", "W_grad"):  # float32 sums in two orders: within 1e-5 of each output's scale
            scale = np.abs(expected[name]).max()
            assert np.abs(outputs[name] - expected[name]).max() <= 1e-5 * scale, name
