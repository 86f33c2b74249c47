"""LayerNormalizationGrad and RMSNormalizationGrad on every backend, against the float64
reference, float64 central finite differences of the forward, and torch autograd."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from _helpers import assert_close

from normgrad.ops import harness
from normgrad.ops import layer_normalization_grad as lng
from normgrad.ops import rms_normalization_grad as rmsg

EPS = 1e-5
BF16 = ml_dtypes.bfloat16
OPS = {"layer": lng, "rms": rmsg}
# (x shape, axis, scale shape): torch's normalized_shape weights, a scale broadcast over the
# normalised axes, leading 1s, axis 0 (one row), odd sizes that exercise vector tails.
CASES = [
    ((4, 6), -1, (6,)),
    ((2, 3, 37), -1, (37,)),
    ((2, 3, 5), -2, (3, 5)),
    ((2, 3, 5), 1, (5,)),
    ((2, 3, 5), -2, (1, 3, 1)),
    ((3, 17), 0, (3, 17)),
    ((2, 2, 3, 70), 2, (1, 1, 3, 70)),
    ((1, 9), -1, (1,)),
]
DTYPES = [(np.float32, np.float32), (np.float16, np.float16), (np.float16, np.float32), (BF16, BF16), (BF16, np.float32)]


def forward(kind, x, scale, bias, axis):
    """The float64 forward layer, statistics from x."""
    axes = tuple(range(axis % x.ndim, x.ndim))
    if kind == "layer":
        centred = x - x.mean(axes, keepdims=True)
        return centred / np.sqrt((centred**2).mean(axes, keepdims=True) + EPS) * scale + bias
    return x / np.sqrt((x**2).mean(axes, keepdims=True) + EPS) * scale


def make_inputs(kind, x_shape, axis, scale_shape, seed=0, dtype=np.float32, stats_dtype=None, offset=0.5):
    """Inputs in ``dtype`` whose statistics are those of the rounded x, in ``stats_dtype``."""
    stats_dtype = dtype if stats_dtype is None else stats_dtype
    rng = np.random.default_rng(seed)
    x = rng.normal(offset, 2.0, size=x_shape).astype(dtype)
    x64 = x.astype(np.float64)
    axes = tuple(range(axis % len(x_shape), len(x_shape)))
    inputs = {"dy": rng.normal(size=x_shape).astype(dtype), "x": x, "scale": rng.normal(1.0, 0.5, size=scale_shape).astype(dtype)}
    if not x.size:
        stats = np.zeros(x_shape[: axis % len(x_shape)] + (1,) * len(axes))
        mean, rstd = stats, stats + 1
    elif kind == "layer":
        mean = x64.mean(axes, keepdims=True)
        rstd = 1 / np.sqrt(x64.var(axes, keepdims=True) + EPS)
    else:
        rstd = 1 / np.sqrt((x64**2).mean(axes, keepdims=True) + EPS)
    if kind == "layer":
        inputs.update(mean=mean.astype(stats_dtype), inv_std_dev=rstd.astype(stats_dtype))
    else:
        inputs.update(inv_rms=rstd.astype(stats_dtype))
    return inputs


@pytest.mark.parametrize("kind", OPS)
@pytest.mark.parametrize("x_shape,axis,scale_shape", CASES, ids=str)
def test_matches_reference(backend, kind, x_shape, axis, scale_shape):
    module = OPS[kind]
    inputs = make_inputs(kind, x_shape, axis, scale_shape, seed=len(x_shape) + axis)
    expected = module.reference(**inputs, axis=axis)
    actual = harness.run(backend, module.OP_TYPE, inputs, attributes={"axis": axis})
    for name, value in zip(module.OUTPUTS, expected):
        assert_close(actual[name], value, what=name)


@pytest.mark.parametrize("kind", OPS)
@pytest.mark.parametrize("t,u", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_pair(backend, kind, t, u):
    if backend == "python" and (t, u) != (np.float32, np.float32):
        pytest.skip("the Python bridge is float32 only")
    module = OPS[kind]
    inputs = make_inputs(kind, (3, 4, 21), -1, (21,), seed=3, dtype=t, stats_dtype=u)
    expected = module.reference(**inputs)
    actual = harness.run(backend, module.OP_TYPE, inputs)
    for name, value in zip(module.OUTPUTS, expected):
        assert actual[name].dtype == np.dtype(t), name
        assert_close(actual[name], value, dtype=t, what=name)


@pytest.mark.parametrize("kind", OPS)
@pytest.mark.parametrize("x_shape,axis,scale_shape", [((2, 3, 4), -1, (4,)), ((2, 3, 4), -2, (3, 4)), ((3, 2, 3), 1, (1, 3))], ids=str)
def test_gradients_match_finite_differences(kind, x_shape, axis, scale_shape):
    """dx, dscale, dbias are the derivatives of sum(dy * forward(x)), statistics recomputed."""
    module = OPS[kind]
    rng = np.random.default_rng(11)
    args = {"x": rng.normal(size=x_shape), "scale": rng.normal(1.0, 0.5, size=scale_shape), "bias": rng.normal(size=scale_shape)}
    dy = rng.normal(size=x_shape)
    inputs = make_inputs(kind, x_shape, axis, scale_shape, dtype=np.float64)
    inputs.update(x=args["x"], dy=dy, scale=args["scale"])
    axes = tuple(range(axis % len(x_shape), len(x_shape)))
    if kind == "layer":
        inputs["mean"] = args["x"].mean(axes, keepdims=True)
        inputs["inv_std_dev"] = 1 / np.sqrt(args["x"].var(axes, keepdims=True) + EPS)
    else:
        inputs["inv_rms"] = 1 / np.sqrt((args["x"] ** 2).mean(axes, keepdims=True) + EPS)
    result = module.reference(**inputs, axis=axis)._asdict()

    def numeric(wrt, h=1e-6):
        grad = np.zeros_like(args[wrt])
        for index in np.ndindex(grad.shape):
            values = []
            for step in (h, -h):
                moved = {k: v.copy() for k, v in args.items()}
                moved[wrt][index] += step
                values.append((dy * forward(kind, moved["x"], moved["scale"], moved["bias"], axis)).sum())
            grad[index] = (values[0] - values[1]) / (2 * h)
        return grad

    np.testing.assert_allclose(result["dx"], numeric("x"), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(result["dscale"], numeric("scale"), rtol=1e-6, atol=1e-7)
    if kind == "layer":
        np.testing.assert_allclose(result["dbias"], numeric("bias"), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("normalised_dims", [1, 2], ids=["axis-1", "axis-2"])
@pytest.mark.parametrize("kind", OPS)
def test_matches_torch_autograd(backend, kind, normalised_dims, affine):
    torch = pytest.importorskip("torch")
    module = OPS[kind]
    shape = (2, 5, 6, 7)
    normalized_shape = shape[-normalised_dims:]
    layer_type = torch.nn.LayerNorm if kind == "layer" else torch.nn.RMSNorm
    layer = layer_type(normalized_shape, eps=EPS, elementwise_affine=affine).double()
    generator = torch.Generator().manual_seed(4)
    if affine:
        with torch.no_grad():
            for parameter in layer.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
    x = torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(shape, generator=generator, dtype=torch.float64)
    layer(x).backward(dy)
    axis = -normalised_dims
    inputs = make_inputs(kind, shape, axis, normalized_shape)
    inputs.update(x=x.detach().numpy().astype(np.float32), dy=dy.numpy().astype(np.float32))
    inputs.update({k: v for k, v in make_inputs(kind, shape, axis, normalized_shape).items() if k not in ("x", "dy", "scale")})
    axes = tuple(range(len(shape) - normalised_dims, len(shape)))
    x64 = inputs["x"].astype(np.float64)
    if kind == "layer":
        inputs["mean"] = x64.mean(axes, keepdims=True).astype(np.float32)
        inputs["inv_std_dev"] = (1 / np.sqrt(x64.var(axes, keepdims=True) + EPS)).astype(np.float32)
    else:
        inputs["inv_rms"] = (1 / np.sqrt((x64**2).mean(axes, keepdims=True) + EPS)).astype(np.float32)
    weight = layer.weight.detach().numpy() if affine else np.ones(normalized_shape)
    inputs["scale"] = weight.astype(np.float32)
    actual = harness.run(backend, module.OP_TYPE, inputs, attributes={"axis": axis})
    assert_close(actual["dx"], x.grad.numpy(), what="dx")
    if affine:
        assert_close(actual["dscale"], layer.weight.grad.numpy(), what="dscale")
        if kind == "layer":
            assert_close(actual["dbias"], layer.bias.grad.numpy(), what="dbias")


@pytest.mark.parametrize("kind", OPS)
@pytest.mark.parametrize("x_shape,axis", [((0, 5), -1), ((3, 0), -1), ((2, 0, 4), -1), ((2, 0, 4), 1)], ids=str)
def test_empty_input(backend, kind, x_shape, axis):
    module = OPS[kind]
    scale_shape = x_shape[axis % len(x_shape):]
    inputs = make_inputs(kind, x_shape, axis, scale_shape)
    actual = harness.run(backend, module.OP_TYPE, inputs, attributes={"axis": axis})
    assert actual["dx"].shape == x_shape
    for name in module.OUTPUTS[1:]:
        np.testing.assert_array_equal(actual[name], np.zeros(scale_shape, np.float32))


@pytest.mark.parametrize("kind,wanted", [("layer", ["dx"]), ("layer", ["dx", "dbias"]), ("layer", ["dx", "dscale"]), ("rms", ["dx"])], ids=str)
def test_optional_outputs(backend, kind, wanted):
    if backend == "python":
        pytest.skip("the Python bridge needs every output named")
    module = OPS[kind]
    inputs = make_inputs(kind, (3, 4, 9), -1, (9,), seed=7)
    expected = module.reference(**inputs)._asdict()
    actual = harness.run(backend, module.OP_TYPE, inputs, outputs=wanted)
    assert sorted(actual) == sorted(wanted)
    for name in wanted:
        assert_close(actual[name], expected[name], what=name)


@pytest.mark.parametrize("kind", OPS)
def test_deterministic_across_thread_counts(backend, kind):
    module = OPS[kind]
    # Enough rows that the kernels split dx and the scale sums into several blocks.
    inputs = make_inputs(kind, (613, 200), -1, (200,), seed=9)
    runs = [harness.run(backend, module.OP_TYPE, inputs, threads=threads) for threads in (1, 2, 3, 7)]
    for run in runs[1:]:
        for name in module.OUTPUTS:
            np.testing.assert_array_equal(runs[0][name], run[name])

