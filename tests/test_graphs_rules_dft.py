"""DFT's gradient (opset 17 and 20 forms; forward, inverse, onesided, dft_length; real and
complex signals) against torch autograd of torch.fft and float64 central finite differences."""

from __future__ import annotations

import numpy as np
import onnx.helper as oh
import pytest

from normgrad.graphs import UnsupportedOperatorError, build_training_graph
from normgrad.tools.check import check_gradients

from _graph_models import model, run_training

SHAPE = (2, 5, 3)
"""x is SHAPE + (1,) real or SHAPE + (2,) complex, with the signal length set at the axis."""


def _dft_model(opset, complex_input, axis, inverse=0, onesided=0, length=None, signal=None):
    """One DFT node along ``axis`` (an attribute before opset 20, else a constant input
    counted from the back) of a signal of ``signal`` elements (default: SHAPE's)."""
    shape = list(SHAPE) + [2 if complex_input else 1]
    shape[axis] = signal or shape[axis]
    initializers = {}
    inputs = ["x", "n" if length is not None else ""]
    if length is not None:
        initializers["n"] = np.asarray(length, np.int64)
    attrs = dict(inverse=inverse, onesided=onesided)
    if opset >= 20:
        initializers["axis"] = np.asarray(axis - len(shape), np.int64)
        inputs.append("axis")
    else:
        attrs["axis"] = axis
    return model([oh.make_node("DFT", inputs, ["y"], **attrs)], {"x": shape}, ["y"], initializers=initializers,
                 opset=opset)


def _torch_dft(torch, x, axis, inverse, onesided, length):
    """torch.fft's counterpart of the DFT node, in ONNX's layout ([..., 2] complex, [..., 1] real)."""
    signal = torch.view_as_complex(x) if x.shape[-1] == 2 else x[..., 0]
    if onesided:
        transform = torch.fft.irfft if inverse else torch.fft.rfft
    else:
        transform = torch.fft.ifft if inverse else torch.fft.fft
    y = transform(signal, n=length, dim=axis)
    return torch.view_as_real(y.resolve_conj()) if y.is_complex() else y.unsqueeze(-1)


CASES = [  # (complex input, inverse, onesided, dft_length, signal length)
    (False, 0, 0, None, None), (False, 1, 0, None, None), (True, 0, 0, None, None), (True, 1, 0, None, None),
    (False, 0, 0, 8, None), (True, 1, 0, 2, None),  # x zero-padded, truncated
    (False, 0, 1, None, None), (False, 0, 1, 4, None), (False, 0, 1, 7, None),  # rfft
    (True, 1, 1, 6, 4), (True, 1, 1, 7, 4), (True, 1, 1, None, 4),  # irfft: x of n//2 + 1 bins
]


@pytest.mark.parametrize("opset", [17, 20])
@pytest.mark.parametrize("axis", [1, 2])
@pytest.mark.parametrize("complex_input, inverse, onesided, length, signal", CASES)
def test_dft_matches_torch(opset, axis, complex_input, inverse, onesided, length, signal):
    torch = pytest.importorskip("torch")
    forward = _dft_model(opset, complex_input, axis, inverse, onesided, length, signal)
    rng = np.random.default_rng(0)
    x = rng.standard_normal([d.dim_value for d in forward.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)
    x_torch = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = _torch_dft(torch, x_torch, axis, inverse, onesided, length)
    dy = rng.standard_normal(tuple(y.shape)).astype(np.float32)
    y.backward(torch.tensor(dy, dtype=torch.float64))
    results = run_training(build_training_graph(forward), {"x": x, "y_grad": dy})
    np.testing.assert_allclose(results["y"], y.detach().numpy(), rtol=0, atol=1e-5 * float(y.detach().abs().max()))
    np.testing.assert_allclose(results["x_grad"], x_torch.grad.numpy(), rtol=0,
                               atol=1e-5 * float(x_torch.grad.abs().max()))


@pytest.mark.parametrize("opset", [17, 20])
@pytest.mark.parametrize("complex_input, inverse, onesided, length, signal", [
    (True, 0, 0, None, None), (False, 1, 0, 7, None), (True, 0, 0, 3, None), (False, 0, 1, 6, None)])
def test_dft_finite_differences(opset, complex_input, inverse, onesided, length, signal):
    checks = check_gradients(build_training_graph(_dft_model(opset, complex_input, 1, inverse, onesided, length, signal)),
                             directions=2)
    assert checks, "no gradient outputs"
    worst = max(checks, key=lambda c: c.error)
    assert worst.error < 1e-4, worst


def test_dft_chain_like_fftn_finite_differences():
    """Two DFTs (torch.fft.fftn over two axes, real part) feeding a MatMul with a weight."""
    nodes = [oh.make_node("DFT", ["x"], ["f1"], axis=2), oh.make_node("DFT", ["f1"], ["f2"], axis=1),
             oh.make_node("MatMul", ["f2", "w"], ["y"])]
    w = np.random.default_rng(1).standard_normal((2, 2)).astype(np.float32)
    checks = check_gradients(build_training_graph(model(nodes, {"x": (2, 4, 3, 1)}, ["y"], {"w": w}, opset=17)),
                             directions=2)
    assert {c.wrt for c in checks} == {"x", "w"}
    worst = max(checks, key=lambda c: c.error)
    assert worst.error < 1e-4, worst


def test_irfft_of_other_bin_counts_is_refused_by_name():
    """onnxruntime's inverse onesided DFT reads x as numpy's irfft only with n//2 + 1 bins."""
    forward = _dft_model(17, True, 1, inverse=1, onesided=1, length=5, signal=4)
    with pytest.raises(UnsupportedOperatorError, match=r"DFT node .*needs 3 bins.*not 4"):
        build_training_graph(forward)


def test_computed_axis_is_refused_by_name():
    nodes = [oh.make_node("Shape", ["x"], ["shape"]), oh.make_node("Size", ["shape"], ["rank"]),
             oh.make_node("Sub", ["rank", "three"], ["axis"]), oh.make_node("DFT", ["x", "", "axis"], ["y"])]
    forward = model(nodes, {"x": (2, 5, 1)}, ["y"], {"three": np.asarray(3, np.int64)}, opset=20)
    with pytest.raises(UnsupportedOperatorError, match="DFT node .*constant axis"):
        build_training_graph(forward)


@pytest.mark.slow
def test_torch_fft_functions_as_the_dynamo_exporter_writes_them(tmp_path):
    """fft, ifft (zero-padded), rfft (truncated), irfft of a complex input and fftn's real
    part, exported together by torch's dynamo exporter: every output and both inputs'
    gradients as torch's."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    import normgrad.torch

    class Transforms(torch.nn.Module):
        def forward(self, x, z):
            spectrum = torch.view_as_complex(z)
            return (torch.view_as_real(torch.fft.fft(x, dim=1)), torch.view_as_real(torch.fft.ifft(x, n=8, dim=2).resolve_conj()),
                    torch.view_as_real(torch.fft.rfft(x, n=5, dim=1)), torch.fft.irfft(spectrum, n=6, dim=1),
                    torch.fft.fftn(x, dim=(1, 2)).real)

    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((2, 6, 4)).astype(np.float32),
            "z": rng.standard_normal((2, 4, 3, 2)).astype(np.float32)}
    names = [f"y{i}" for i in range(5)]
    forward = normgrad.torch.export(Transforms(), tuple(torch.tensor(v) for v in data.values()), tmp_path / "fft.onnx",
                                    exporter="dynamo", input_names=list(data), output_names=names)
    assert sum(n.op_type == "DFT" for n in forward.graph.node) == 6
    tensors = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in data.items()}
    outputs = Transforms()(*tensors.values())
    seeds = {f"{name}_grad": rng.standard_normal(tuple(y.shape)).astype(np.float32) for name, y in zip(names, outputs)}
    torch.autograd.backward(list(outputs), [torch.tensor(s, dtype=torch.float64) for s in seeds.values()])
    results = run_training(build_training_graph(forward), {**data, **seeds})
    for name, y in zip(names, outputs):
        np.testing.assert_allclose(results[name], y.detach().numpy(), rtol=0, atol=1e-5 * float(y.detach().abs().max()))
    for name, value in tensors.items():
        np.testing.assert_allclose(results[f"{name}_grad"], value.grad.numpy(), rtol=0,
                                   atol=1e-5 * float(value.grad.abs().max()), err_msg=name)
