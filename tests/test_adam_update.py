"""AdamUpdate: the float64 reference against torch.optim's single step, every backend against
the reference and bitwise against each other, thread-count independence, in-place buffers,
and errors that name the input or attribute."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from conftest import cpp_available
from normgrad.ops import NormgradInputError, adam_update, harness

ATTRIBUTES = {"beta2": 0.999, "one_minus_beta1": 0.1, "one_minus_beta2": 0.001, "epsilon": 1e-8}


def _inputs(shape=(3, 70001), seed=0, step=3, lr=1e-2, weight_decay=0.01, grad_scale=0.5):
    rng = np.random.default_rng(seed)
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name in adam_update.INPUTS[:4]}
    tensors["exp_avg_sq"] = np.abs(tensors["exp_avg_sq"]) * 1e-2
    scalars = {"param_scale": 1 - lr * weight_decay, "step_size": lr / (1 - 0.9**step),
               "correction2_sqrt": np.sqrt(1 - 0.999**step), "grad_scale": grad_scale}
    return {**tensors, **{k: np.array(v, np.float32) for k, v in scalars.items()}}


def test_reference_is_one_torch_adamw_step():
    torch = pytest.importorskip("torch")
    inputs = _inputs(shape=(5, 7), weight_decay=0.01, grad_scale=1.0)
    param = torch.nn.Parameter(torch.from_numpy(inputs["param"].copy()))
    optimizer = torch.optim.AdamW([param], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    state = optimizer.state[param]
    state["step"] = torch.tensor(2.0)  # torch increments it to 3, the step of _inputs
    state["exp_avg"] = torch.from_numpy(inputs["exp_avg"].copy())
    state["exp_avg_sq"] = torch.from_numpy(inputs["exp_avg_sq"].copy())
    param.grad = torch.from_numpy(inputs["grad"].copy())
    optimizer.step()
    result = adam_update.reference(**inputs, **ATTRIBUTES)
    np.testing.assert_allclose(result.param_next, param.detach().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(result.exp_avg_next, state["exp_avg"].numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(result.exp_avg_sq_next, state["exp_avg_sq"].numpy(), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("given", [(), ("param_scale",), ("grad_scale",), ("param_scale", "grad_scale")])
def test_backends_match_the_reference_and_the_kernels_each_other_bitwise(given):
    """Each subset of the optional inputs: an omitted one is no operation on every backend."""
    inputs = {name: value for name, value in _inputs().items() if name not in adam_update.OPTIONAL or name in given}
    attributes = ATTRIBUTES
    expected = adam_update.reference(**inputs, **attributes)
    if "grad_scale" not in given:  # omitted is multiplying by 1
        assert all(a.tobytes() == b.tobytes() for a, b in zip(expected, adam_update.reference(
            **inputs, grad_scale=np.float32(1), **attributes)))
    backends = ["functions", "python"] + (["cpp"] if cpp_available() else [])
    results = {b: harness.run(b, adam_update.OP_TYPE, inputs, attributes=attributes) for b in backends}
    for backend, result in results.items():
        for name, value in zip(adam_update.OUTPUTS, expected):
            np.testing.assert_allclose(result[name], value, rtol=2e-6, atol=1e-7, err_msg=f"{backend} {name}")
            # the kernels compute the contract's float32 sequence exactly (onnxruntime 1.19.2
            # runs the inlined body's division chain 1 ulp off in a few percent of elements)
            if backend != "functions":
                assert result[name].tobytes() == results["python"][name].tobytes(), f"{backend} {name}"


@pytest.mark.skipif(not cpp_available(), reason="needs the C++ library")
def test_kernel_is_thread_count_independent_and_updates_in_place():
    import onnxruntime as ort

    inputs = _inputs()
    model = harness.node_model(adam_update.OP_TYPE, inputs, attributes=ATTRIBUTES)
    first = harness.run_model(model, inputs, "cpp", threads=1)
    for threads in (2, 3, 7):
        again = harness.run_model(model, inputs, "cpp", threads=threads)
        assert all(again[n].tobytes() == first[n].tobytes() for n in adam_update.OUTPUTS)
    session = harness.make_session(model, "cpp", threads=2)
    binding = session.io_binding()
    buffers = {name: ort.OrtValue.ortvalue_from_numpy(value.copy()) for name, value in inputs.items()}
    for name, value in buffers.items():
        binding.bind_ortvalue_input(name, value)
    for output, state in zip(adam_update.OUTPUTS, ("param", "exp_avg", "exp_avg_sq")):
        binding.bind_ortvalue_output(output, buffers[state])  # each output over its input
    session.run_with_iobinding(binding)
    for output, state in zip(adam_update.OUTPUTS, ("param", "exp_avg", "exp_avg_sq")):
        assert buffers[state].numpy().tobytes() == first[output].tobytes(), output


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


@pytest.mark.skipif(not cpp_available(), reason="needs the C++ library")
def test_attribute_of_the_wrong_type_is_named():
    inputs = _inputs(shape=(2, 3))
    model = harness.node_model(adam_update.OP_TYPE, inputs, attributes=ATTRIBUTES)
    node = model.graph.node[0]
    for attribute in node.attribute:
        if attribute.name == "epsilon":
            attribute.CopyFrom(onnx.helper.make_attribute("epsilon", 1))  # INT where FLOAT is required
    with pytest.raises(Exception, match="attribute 'epsilon' must be of type FLOAT; got INT"):
        harness.run_model(model, inputs, "cpp")
    with pytest.raises(NormgradInputError, match="attribute 'epsilon' must be a finite float >= 0"):
        adam_update.reference(**inputs, epsilon=float("nan"))


def test_float64_evaluation_keeps_the_float_attributes():
    """The corpus tool's float64 evaluator (what the OpenVINO training tests compare with)
    runs the node by the reference with its float attributes intact."""
    from normgrad.tools.corpus import float64_outputs

    inputs = _inputs(shape=(4, 5))
    attributes = {"beta2": 0.99, "one_minus_beta1": 0.2, "one_minus_beta2": 0.01, "epsilon": 1e-6}
    model = harness.node_model(adam_update.OP_TYPE, inputs, attributes=attributes)
    got = float64_outputs(model, inputs)
    expected = adam_update.reference(**{k: v.astype(np.float64) for k, v in inputs.items()}, **attributes)
    for name, value in zip(adam_update.OUTPUTS, expected):
        assert got[name].dtype == np.float64
        np.testing.assert_allclose(got[name], value, rtol=1e-12, atol=0)
