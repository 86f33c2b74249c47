"""AdamUpdate: the float64 reference against torch.optim's single step, every backend against
the reference and bitwise against each other, thread-count independence, in-place buffers,
skipped updates (applied false, a hyperparameter such as epsilon NaN) alike on every backend,
and errors that name the input."""

from __future__ import annotations

import numpy as np
import pytest

from normgrad.ops import NormgradInputError, adam_update, harness

import _update_checks
from _helpers import cpp_available

HYPERPARAMETERS = {"one_minus_beta1": 0.1, "beta2": 0.999, "one_minus_beta2": 0.001, "epsilon": 1e-8}
BACKENDS = ["functions", "python"] + (["cpp"] if cpp_available() else [])


def _inputs(shape=(3, 70001), seed=0, step=3, lr=1e-2, weight_decay=0.01, grad_scale=0.5, l2=0.1):
    rng = np.random.default_rng(seed)
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name in adam_update.INPUTS[:4]}
    tensors["exp_avg_sq"] = np.abs(tensors["exp_avg_sq"]) * 1e-2
    tensors["max_exp_avg_sq"] = np.abs(rng.standard_normal(shape)).astype(np.float32) * 1e-2  # above the next half the time
    scalars = {"step_size": lr / (1 - 0.9**step), "correction2_sqrt": np.sqrt(1 - 0.999**step), **HYPERPARAMETERS,
               "param_scale": 1 - lr * weight_decay, "grad_scale": grad_scale, "weight_decay": l2}
    return {**{k: v for k, v in tensors.items() if k != "max_exp_avg_sq"},
            **{k: np.array(v, np.float32) for k, v in scalars.items()}, "applied": np.array(True),
            "max_exp_avg_sq": tensors["max_exp_avg_sq"]}


def _without(inputs, *names):
    return {name: value for name, value in inputs.items() if name not in names}


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("optimizer_name", ["AdamW", "Adam"])
def test_reference_is_one_torch_step(optimizer_name, amsgrad):
    """AdamW's decoupled weight decay through param_scale, Adam's L2 weight decay through
    weight_decay, amsgrad's running maximum through max_exp_avg_sq."""
    torch = pytest.importorskip("torch")
    unused = ["weight_decay" if optimizer_name == "AdamW" else "param_scale"] + ([] if amsgrad else ["max_exp_avg_sq"])
    inputs = _without(_inputs(shape=(5, 7), weight_decay=0.01, grad_scale=1.0, l2=0.01), *unused)
    param = torch.nn.Parameter(torch.from_numpy(inputs["param"].copy()))
    optimizer = getattr(torch.optim, optimizer_name)([param], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                                     amsgrad=amsgrad)
    state = optimizer.state[param]
    state["step"] = torch.tensor(2.0)  # torch increments it to 3, the step of _inputs
    state["exp_avg"] = torch.from_numpy(inputs["exp_avg"].copy())
    state["exp_avg_sq"] = torch.from_numpy(inputs["exp_avg_sq"].copy())
    if amsgrad:
        state["max_exp_avg_sq"] = torch.from_numpy(inputs["max_exp_avg_sq"].copy())
    param.grad = torch.from_numpy(inputs["grad"].copy())
    optimizer.step()
    result = adam_update.reference(**inputs)
    np.testing.assert_allclose(result.param_next, param.detach().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(result.exp_avg_next, state["exp_avg"].numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(result.exp_avg_sq_next, state["exp_avg_sq"].numpy(), rtol=1e-6, atol=1e-9)
    if amsgrad:
        np.testing.assert_allclose(result.max_exp_avg_sq_next, state["max_exp_avg_sq"].numpy(), rtol=1e-6, atol=1e-9)
        assert (inputs["max_exp_avg_sq"] > result.exp_avg_sq_next).any() and (
            inputs["max_exp_avg_sq"] < result.exp_avg_sq_next).any()  # both sides of the maximum taken


@pytest.mark.parametrize("given", [(), ("param_scale",), ("grad_scale",), ("param_scale", "grad_scale"), ("weight_decay",),
                                   ("grad_scale", "weight_decay"), ("applied",), ("max_exp_avg_sq",),
                                   ("max_exp_avg_sq", "param_scale", "grad_scale"), adam_update.OPTIONAL])
def test_backends_match_the_reference_and_the_kernels_each_other_bitwise(given):
    """Each subset of the optional inputs: an omitted one is no operation on every backend."""
    inputs = {name: value for name, value in _inputs().items() if name not in adam_update.OPTIONAL or name in given}
    expected = adam_update.reference(**inputs)
    if "grad_scale" not in given:  # omitted is multiplying by 1
        assert all(a.tobytes() == b.tobytes() for a, b in zip(expected, adam_update.reference(
            **inputs, grad_scale=np.float32(1))))
    if "max_exp_avg_sq" not in given:  # omitted is zeros: no amsgrad, its output exp_avg_sq_next
        assert all(a.tobytes() == b.tobytes() for a, b in zip(expected, adam_update.reference(
            **inputs, max_exp_avg_sq=np.zeros_like(inputs["param"]))))
        assert expected.max_exp_avg_sq_next.tobytes() == expected.exp_avg_sq_next.tobytes()
    if "weight_decay" not in given:  # omitted is no L2 term, as 0 is (torch: if weight_decay != 0)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(expected, adam_update.reference(
            **inputs, weight_decay=np.float32(0))))
    results = {b: harness.run(b, adam_update.OP_TYPE, inputs) for b in BACKENDS}
    for backend, result in results.items():
        for name, value in zip(adam_update.OUTPUTS, expected):
            # within 2e-6 of the tensor's scale: an element that is a small difference of larger
            # terms (param * scale - update) carries the terms' rounding, not its own
            scale = max(1.0, float(np.abs(value).max()))
            np.testing.assert_allclose(result[name], value, rtol=0, atol=2e-6 * scale, err_msg=f"{backend} {name}")
            # the kernels compute the contract's float32 sequence exactly (onnxruntime 1.19.2
            # runs the inlined body's division chain 1 ulp off in a few percent of elements)
            if backend != "functions":
                assert result[name].tobytes() == results["python"][name].tobytes(), f"{backend} {name}"


@pytest.mark.skipif(not cpp_available(), reason="needs the C++ library")
def test_kernel_is_thread_count_independent_and_updates_in_place():
    _update_checks.assert_thread_independent_and_in_place(adam_update, _inputs())


@pytest.mark.parametrize("change, message", [
    (lambda d: d.__setitem__("grad", d["grad"][:, :5]), "input 'grad' must have the shape of 'param'"),
    (lambda d: d.__setitem__("exp_avg", d["exp_avg"].astype(np.float16)), "input 'exp_avg' must be float32"),
    (lambda d: d.__setitem__("step_size", np.ones(2, np.float32)), "input 'step_size' must be a scalar"),
])
def test_bad_inputs_name_the_input(change, message):
    inputs = _inputs(shape=(2, 9))
    change(inputs)
    with pytest.raises(NormgradInputError, match=message):
        adam_update.reference(**inputs)
    if cpp_available():
        with pytest.raises(Exception, match=message):
            harness.run("cpp", adam_update.OP_TYPE, inputs, static_shapes=False)


@pytest.mark.parametrize("skip", [
    {"applied": np.array(False)}, {"epsilon": np.float32("nan")}, {"epsilon": np.float32(-1e-8)},
    {"one_minus_beta1": np.float32("inf")}, {"beta2": np.float32(-0.5)}, {"step_size": np.float32("nan")},
    {"grad_scale": np.float32("-inf")}, {"weight_decay": np.float32("nan")},
], ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_skipped_update_keeps_every_input_on_every_backend(skip):
    """applied false, or a scalar breaking the rule (issue 30 item 5: epsilon NaN would make every
    weight NaN): each backend, the function body included, gives the inputs back bitwise."""
    inputs = {**_inputs(shape=(3, 1001)), **{k: np.asarray(v) for k, v in skip.items()}}
    assert adam_update.skip_reason(inputs)
    for backend in BACKENDS:
        result = harness.run(backend, adam_update.OP_TYPE, inputs)
        for output, state in adam_update.SPEC.kept.items():
            assert result[output].tobytes() == inputs[state].tobytes(), f"{backend} {output}"


@pytest.mark.skipif(not cpp_available(), reason="needs the C++ library")
def test_skipped_update_in_place_writes_nothing():
    inputs = {**_inputs(shape=(2, 3001)), "epsilon": np.array(np.nan, np.float32)}
    buffers = harness.run_in_place(adam_update.OP_TYPE, inputs, adam_update.SPEC.kept, threads=2)
    for state in adam_update.SPEC.kept.values():
        assert buffers[state].tobytes() == inputs[state].tobytes(), state


def test_applied_must_be_bool():
    inputs = {**_inputs(shape=(2, 3)), "applied": np.array(1.0, np.float32)}
    with pytest.raises(NormgradInputError, match="input 'applied' must be bool; got float32"):
        adam_update.reference(**inputs)
    if cpp_available():
        with pytest.raises(Exception):  # onnxruntime refuses the type against the schema
            harness.run("cpp", adam_update.OP_TYPE, inputs, static_shapes=False)


def test_float64_evaluation_takes_the_scalar_inputs():
    """The corpus tool's float64 evaluator (what the OpenVINO training tests compare with)
    runs the node by the reference with its hyperparameter inputs."""
    from normgrad.tools.corpus import float64_outputs

    inputs = {**_inputs(shape=(4, 5)), **{k: np.array(v, np.float32) for k, v in
                                          {"beta2": 0.99, "one_minus_beta1": 0.2, "one_minus_beta2": 0.01, "epsilon": 1e-6}.items()}}
    model = harness.node_model(adam_update.OP_TYPE, inputs)
    got = float64_outputs(model, inputs)
    expected = adam_update.reference(**{k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in inputs.items()})
    for name, value in zip(adam_update.OUTPUTS, expected):
        assert got[name].dtype == np.float64
        np.testing.assert_allclose(got[name], value, rtol=1e-12, atol=0)


NAN, INF = float("nan"), float("inf")


BAD_SCALARS = [{"epsilon": NAN}, {"beta2": INF}, {"one_minus_beta1": -0.5}, {"one_minus_beta2": -INF}]
"""Hyperparameters breaking AdamUpdate's rule (they are its inputs: no checker can see them)."""


def _adam_inputs(value=1.0, **scalars):
    inputs = {n: np.full([4] if n in adam_update.INPUTS[:4] else [], value, np.float32) for n in adam_update.INPUTS[:10]}
    inputs.update({name: np.array(v, np.float32) for name, v in scalars.items()})
    return inputs


@pytest.mark.parametrize("scalars", BAD_SCALARS, ids=lambda d: next(iter(d)))
@pytest.mark.parametrize("backend", ["reference", "functions", "python", "cpp"])
def test_adam_update_skips_broken_hyperparameters_on_every_backend(scalars, backend):
    """Issue 30 item 5: the kernels and the function body (Trainer(kernels=None)) all skip an
    update whose hyperparameters break the rule: every output is its input, never NaN weights."""
    from normgrad.ops import harness

    if backend == "cpp" and not cpp_available():
        pytest.skip("C++ library not built")
    inputs = _adam_inputs(**scalars)
    inputs["grad"] = np.arange(4, dtype=np.float32)
    result = (dict(zip(adam_update.OUTPUTS, adam_update.reference(**inputs))) if backend == "reference"
              else harness.run(backend, adam_update.OP_TYPE, inputs))
    for output, state in zip(adam_update.OUTPUTS, ("param", "exp_avg", "exp_avg_sq")):
        assert result[output].tobytes() == inputs[state].tobytes(), output


@pytest.mark.skipif(not cpp_available(), reason="C++ library not built")
def test_adam_update_kernel_takes_valid_hyperparameters():
    from normgrad.ops import harness

    inputs = _adam_inputs(0.5, epsilon=0.0, beta2=0.0, one_minus_beta1=1.0)
    got = harness.run("cpp", adam_update.OP_TYPE, inputs)
    expected = adam_update.reference(**inputs)
    assert not adam_update.skip_reason(inputs)
    for name, truth in zip(adam_update.OUTPUTS, expected):
        np.testing.assert_allclose(got[name], truth, rtol=1e-6)
