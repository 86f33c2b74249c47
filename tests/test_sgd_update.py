"""SGDUpdate and GatedUpdate: the float64 reference against torch.optim.SGD's step, every
backend (C++, Python, function body) against the reference and the kernels bitwise against
each other, thread-count independence, in-place buffers, skipped updates alike on every
backend, and errors that name the input."""

from __future__ import annotations

import numpy as np
import pytest

import _update_checks

from _helpers import cpp_available
from normgrad.ops import NormgradInputError, gated_update, harness, sgd_update

BACKENDS = ["functions", "python"] + (["cpp"] if cpp_available() else [])
SHAPES = [(3, 70001), (4, 3, 3, 3), (5,), ()]
"""Several chunks of the C++ loop, a convolution weight, a bias, a scalar parameter."""


def _inputs(shape=(3, 70001), seed=0, lr=0.05, momentum=0.9, dampening=0.25, weight_decay=0.01, grad_scale=0.5,
            first_step=False, nesterov=False):
    rng = np.random.default_rng(seed)
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name in ("param", "grad", "momentum_buffer")}
    scalars = {"lr": lr, "momentum": momentum, "one_minus_dampening": 1 - dampening, "weight_decay": weight_decay,
               "grad_scale": grad_scale}
    return {**tensors, **{k: np.array(v, np.float32) for k, v in scalars.items()},
            "first_step": np.array(first_step), "nesterov": np.array(nesterov), "applied": np.array(True)}


def _given(inputs, names):
    return {name: value for name, value in inputs.items() if name not in sgd_update.OPTIONAL or name in names}


TORCH_CASES = {
    "plain": dict(momentum=0.0, dampening=0.0, weight_decay=0.0),
    "weight_decay": dict(momentum=0.0, dampening=0.0, weight_decay=0.01),
    "momentum_dampening": dict(momentum=0.9, dampening=0.3, weight_decay=0.0),
    "nesterov": dict(momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True),
}


@pytest.mark.parametrize("first_step", [True, False])
@pytest.mark.parametrize("case", TORCH_CASES)
def test_reference_is_one_torch_step(case, first_step):
    """The first step (torch has no buffer yet: it takes the gradient) and a later one."""
    torch = pytest.importorskip("torch")
    options = TORCH_CASES[case]
    inputs = _inputs(shape=(5, 7), grad_scale=1.0, first_step=first_step, **{k: v for k, v in options.items()})
    param = torch.nn.Parameter(torch.from_numpy(inputs["param"].copy()))
    optimizer = torch.optim.SGD([param], lr=0.05, **options)
    if options["momentum"] and not first_step:
        optimizer.state[param]["momentum_buffer"] = torch.from_numpy(inputs["momentum_buffer"].copy())
    param.grad = torch.from_numpy(inputs["grad"].copy())
    optimizer.step()
    given = ["weight_decay", "first_step", "nesterov"] + (["momentum_buffer", "momentum", "one_minus_dampening"]
                                                          if options["momentum"] else [])
    result = sgd_update.reference(**_given(inputs, given))
    np.testing.assert_allclose(result.param_next, param.detach().numpy(), rtol=1e-6, atol=1e-7)
    if options["momentum"]:
        np.testing.assert_allclose(result.momentum_buffer_next, optimizer.state[param]["momentum_buffer"].numpy(),
                                   rtol=1e-6, atol=1e-7)


GIVEN = [(), ("weight_decay",), ("grad_scale",), ("momentum_buffer", "momentum"),
         ("momentum_buffer", "momentum", "one_minus_dampening", "first_step"),
         ("momentum_buffer", "momentum", "nesterov", "weight_decay"), ("momentum",), ("applied",), sgd_update.OPTIONAL]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("given", GIVEN, ids=lambda g: "+".join(g) or "required")
def test_backends_match_the_reference_and_the_kernels_each_other_bitwise(given, shape):
    """Each subset of the optional inputs: an omitted one is its SCALAR_IF_OMITTED on every backend."""
    inputs = _given(_inputs(shape=shape, nesterov=True), given)
    expected = sgd_update.reference(**inputs)
    explicit = {**{name: np.asarray(value, bool if isinstance(value, bool) else np.float32)
                   for name, value in sgd_update.SCALAR_IF_OMITTED.items() if name != "momentum_buffer"},
                "momentum_buffer": np.zeros(shape, np.float32), **inputs}
    assert all(a.tobytes() == b.tobytes() for a, b in zip(expected, sgd_update.reference(**explicit)))
    results = {b: harness.run(b, sgd_update.OP_TYPE, inputs) for b in BACKENDS}
    for backend, result in results.items():
        for name, value in zip(sgd_update.OUTPUTS, expected):
            scale = max(1.0, float(np.abs(value).max()))
            np.testing.assert_allclose(result[name], value, rtol=0, atol=2e-6 * scale, err_msg=f"{backend} {name}")
            # the kernels and the body are the contract's float32 ops: the same bits
            assert result[name].tobytes() == results["python"][name].tobytes(), f"{backend} {name}"


@pytest.mark.skipif(not cpp_available(), reason="needs the C++ library")
def test_kernel_is_thread_count_independent_and_updates_in_place():
    _update_checks.assert_thread_independent_and_in_place(sgd_update, _inputs(nesterov=True))


@pytest.mark.parametrize("skip", [
    {"applied": np.array(False)}, {"lr": np.float32("nan")}, {"lr": np.float32(-0.1)},
    {"momentum": np.float32("inf")}, {"momentum": np.float32(-0.5)}, {"weight_decay": np.float32(-1.0)},
    {"grad_scale": np.float32("-inf")}, {"one_minus_dampening": np.float32("nan")},
], ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_skipped_update_keeps_every_input_on_every_backend(skip):
    inputs = {**_inputs(shape=(3, 1001)), **{k: np.asarray(v) for k, v in skip.items()}}
    assert sgd_update.skip_reason(inputs)
    for backend in BACKENDS:
        result = harness.run(backend, sgd_update.OP_TYPE, inputs)
        for output, state in sgd_update.SPEC.kept.items():
            assert result[output].tobytes() == inputs[state].tobytes(), f"{backend} {output}"


def test_zero_momentum_keeps_the_buffer_as_torch_does():
    """torch.optim.SGD: ``if momentum != 0``; a momentum scheduled to 0 leaves the buffer alone."""
    inputs = _inputs(shape=(2, 9), momentum=0.0)
    for backend in BACKENDS:
        result = harness.run(backend, sgd_update.OP_TYPE, inputs)
        assert result["momentum_buffer_next"].tobytes() == inputs["momentum_buffer"].tobytes(), backend


@pytest.mark.parametrize("change, message", [
    (lambda d: d.__setitem__("grad", d["grad"][:, :5]), "input 'grad' must have the shape of 'param'"),
    (lambda d: d.__setitem__("momentum_buffer", d["momentum_buffer"][:1]), "input 'momentum_buffer' must have the shape"),
    (lambda d: d.__setitem__("grad", d["grad"].astype(np.float16)), "input 'grad' must be float32"),
    (lambda d: d.__setitem__("lr", np.ones(2, np.float32)), "input 'lr' must be a scalar"),
    (lambda d: d.__setitem__("nesterov", np.array(1.0, np.float32)), "input 'nesterov' must be bool"),
])
def test_bad_inputs_name_the_input(change, message):
    inputs = _inputs(shape=(2, 9))
    change(inputs)
    with pytest.raises(NormgradInputError, match=message):
        sgd_update.reference(**inputs)
    if cpp_available() and "nesterov" not in message:  # onnxruntime itself refuses a float for a bool input
        with pytest.raises(Exception, match=message):
            harness.run("cpp", sgd_update.OP_TYPE, inputs, static_shapes=False)


def test_required_inputs_are_required():
    inputs = _inputs(shape=(2, 3))
    del inputs["lr"]
    with pytest.raises(NormgradInputError, match="SGDUpdate: input 'lr' is required"):
        sgd_update.reference(**inputs)


@pytest.mark.parametrize("applied", [True, False])
def test_gated_update_selects_on_every_backend_and_in_place(applied):
    rng = np.random.default_rng(5)
    inputs = {"value": rng.standard_normal((70001,)).astype(np.float32),
              "update": rng.standard_normal((70001,)).astype(np.float32), "applied": np.array(applied)}
    expected = inputs["update"] if applied else inputs["value"]
    assert gated_update.reference(**inputs).value_next.tobytes() == expected.tobytes()
    for backend in BACKENDS:
        assert harness.run(backend, gated_update.OP_TYPE, inputs)["value_next"].tobytes() == expected.tobytes(), backend
    if cpp_available():
        buffers = harness.run_in_place(gated_update.OP_TYPE, inputs, gated_update.SPEC.kept, threads=2)
        assert buffers["value"].tobytes() == expected.tobytes()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_omitted_optional_output_is_left_off(backend):
    """Plain SGD's node names param_next alone (as Adam's names no max_exp_avg_sq_next): the
    schema's inference and every backend take it, param_next unchanged."""
    from normgrad.ops import adam_update

    inputs = _given(_inputs(shape=(4, 5)), ("weight_decay",))
    got = harness.run(backend, sgd_update.OP_TYPE, inputs, outputs=["param_next"])
    assert list(got) == ["param_next"]
    assert got["param_next"].tobytes() == sgd_update.python_kernel(**inputs).param_next.tobytes()
    rng = np.random.default_rng(1)
    adam = {name: rng.standard_normal((4, 5)).astype(np.float32) for name in adam_update.INPUTS[:4]}
    adam["exp_avg_sq"] = np.abs(adam["exp_avg_sq"])
    adam.update({name: np.array(value, np.float32) for name, value in zip(adam_update.INPUTS[4:10], (
        0.01, 0.5, 0.1, 0.999, 0.001, 1e-8))})
    got = harness.run(backend, adam_update.OP_TYPE, adam, outputs=list(adam_update.OUTPUTS[:3]))
    expected = adam_update.python_kernel(**adam)
    assert all(got[name].tobytes() == value.tobytes() for name, value in zip(adam_update.OUTPUTS[:3], expected))
