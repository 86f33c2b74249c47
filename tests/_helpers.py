"""Helpers the test modules share: whether the C++ library is built, closeness checks against
float64 truths, operator inputs, the bad-input tests of an operator module, step graphs run at
every optimization level and thread count."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

import normgrad
from normgrad.ops import harness

# Relative tolerance per dtype, scaled by the magnitude of the expected values.
TOLERANCE = {np.dtype(np.float32): 2e-5, np.dtype(np.float16): 2e-3, np.dtype(ml_dtypes.bfloat16): 1.6e-2}


def cpp_available() -> bool:
    try:
        normgrad.library_path()
    except FileNotFoundError:
        if os.environ.get("NORMGRAD_REQUIRE_CPP") == "1":
            raise
        return False
    return True


def cpp_error(op_type: str, feeds: dict) -> str:
    """The error message of the C++ kernel of ``op_type`` run on ``feeds`` (by input name), in
    a one-node model without onnx's type checks (which would refuse bad types first)."""
    import onnx
    import onnx.helper as oh
    import onnxruntime as ort

    from normgrad.ops import DOMAIN, IR_VERSION, ONNX_OPSET, OPSET_VERSION, operator
    from normgrad.ops._common import tensor_type

    outputs = list(operator(op_type).OUTPUTS)
    node = oh.make_node(op_type, list(feeds), outputs, domain=DOMAIN)
    graph = oh.make_graph([node], op_type, [oh.make_tensor_value_info(name, tensor_type(value.dtype), list(value.shape))
                                            for name, value in feeds.items()],
                          [onnx.ValueInfoProto(name=name) for name in outputs])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", ONNX_OPSET), oh.make_opsetid(DOMAIN, OPSET_VERSION)],
                          ir_version=IR_VERSION)
    options = ort.SessionOptions()
    normgrad.session_options("cpp", options)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception) as error:
        session.run(None, feeds)
    return str(error.value)


def bad_input_tests(module, bad: dict):
    """The bad-input tests of an operator's test module, to assign at its top level: its C++
    kernel and its ``reference`` (``validate``) fail with "OP_TYPE: rule", naming the input.
    ``bad``: {case: (feeds by input name, rule)}."""
    from normgrad.ops import NormgradInputError

    op = module.OP_TYPE

    @pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")
    @pytest.mark.parametrize("case", bad)
    def test_cpp_bad_input_names_the_input(case):
        feeds, rule = bad[case]
        assert f"{op}: {rule}" in cpp_error(op, feeds)

    @pytest.mark.parametrize("case", bad)
    def test_validate_names_the_input(case):
        feeds, rule = bad[case]
        with pytest.raises(NormgradInputError) as error:
            module.reference(**feeds)
        assert f"{op}: {rule}" in str(error.value)

    return test_cpp_bad_input_names_the_input, test_validate_names_the_input


def assert_close(actual: np.ndarray, expected: np.ndarray, dtype=np.float32, what: str = "") -> None:
    """Asserts ``actual`` matches the float64 truth within ``dtype``'s tolerance."""
    actual = np.asarray(actual)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    expected64 = np.asarray(expected, dtype=np.float64)
    scale = max(1.0, float(np.abs(expected64).max())) if expected64.size else 1.0
    error = float(np.abs(actual.astype(np.float64) - expected64).max()) if expected64.size else 0.0
    assert error <= TOLERANCE[np.dtype(dtype)] * scale, f"{what}: max error {error:.3g} at scale {scale:.3g}"


def batch_norm_inputs(shape, t=np.float32, u=None, seed=0, offset=0.0) -> dict:
    """BatchNorm inputs for a random x of ``shape``: its batch statistics, a random dy and
    weight; grad_out/input in ``t``, the per-channel tensors in ``u`` (``t`` when None)."""
    u = t if u is None else u
    rng = np.random.default_rng(seed)
    x = rng.normal(offset, 1.0, size=shape)
    axes = (0,) + tuple(range(2, len(shape)))
    mean = x.mean(axis=axes) if x.size else np.zeros(shape[1])
    var = x.var(axis=axes) if x.size else np.ones(shape[1])
    return {
        "grad_out": rng.normal(size=shape).astype(t),
        "input": x.astype(t),
        "mean": mean.astype(u),
        "invstd": (1.0 / np.sqrt(var + 1e-5)).astype(u),
        "weight": rng.normal(size=shape[1]).astype(u),
    }


def run_all(backend: str, op_type: str, inputs: dict, **kwargs) -> dict:
    return harness.run(backend, op_type, inputs, **kwargs)


def with_relu_output(inputs: dict, seed: int = 0) -> dict:
    """``inputs`` plus ``relu_output`` y = max(z, 0) for a random z (a third of y exactly 0),
    with grad_out NaN or inf wherever y is 0: the fused ReLU backward must give exactly 0 there."""
    rng = np.random.default_rng(seed)
    dy = inputs["grad_out"]
    y = np.maximum(rng.normal(size=dy.shape) - 0.4, 0.0).astype(dy.dtype)
    blocked = y.astype(np.float64) <= 0
    poison = np.where(rng.random(dy.shape) < 0.5, np.nan, np.inf)
    return {**inputs, "grad_out": np.where(blocked, poison, dy.astype(np.float64)).astype(dy.dtype), "relu_output": y}


def relu_masked_truth(inputs: dict) -> dict:
    """The same inputs without ``relu_output``, grad_out masked explicitly: the definition
    of the fused input, for the references to be checked against."""
    y = inputs["relu_output"]
    masked = np.where(y.astype(np.float64) > 0, inputs["grad_out"].astype(np.float64), 0.0)
    return {**{k: v for k, v in inputs.items() if k != "relu_output"}, "grad_out": masked.astype(inputs["grad_out"].dtype)}


def cpp_results_by_loop_and_threads(tmp_path, script: str) -> dict:
    """{(NORMGRAD_KERNELS "generic" or "auto", threads 1/2/4): the array ``script`` saves}:
    ``script`` runs in a fresh process with the output path and the thread count as its
    arguments (the baseline loop and the dispatched AVX2 one, each at every thread count)."""
    import subprocess
    import sys

    results = {}
    for kernels in ("generic", "auto"):
        env = {name: value for name, value in os.environ.items() if name != "NORMGRAD_KERNELS"}
        if kernels == "generic":
            env["NORMGRAD_KERNELS"] = "generic"
        for threads in (1, 2, 4):
            path = tmp_path / f"{kernels}_{threads}.npy"
            process = subprocess.run([sys.executable, "-c", script, str(path), str(threads)], env=env, cwd=tmp_path,
                                     capture_output=True, text=True, timeout=600)
            assert process.returncode == 0, process.stderr[-3000:]
            results[kernels, threads] = np.load(path)
    return results


def assert_cpp_bits_everywhere(tmp_path, script: str) -> None:
    """The arrays ``script`` saves (:func:`cpp_results_by_loop_and_threads`) agree bit for bit
    on the baseline and the dispatched loop at 1, 2 and 4 threads."""
    results = cpp_results_by_loop_and_threads(tmp_path, script)
    first = results["generic", 1]
    for key, result in results.items():
        np.testing.assert_array_equal(result, first, err_msg=str(key))


def zeros(*shape, dtype=np.float32) -> np.ndarray:
    """np.zeros(shape, dtype): the bad-input tables' arrays."""
    return np.zeros(shape, dtype)


OPTIMIZATION_LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL")


def step_outputs(model, feeds: dict, kernels, level: str, threads: int = 1) -> dict:
    """{output name: value} of one run of ``model`` in onnxruntime at optimization ``level``
    (a GraphOptimizationLevel name), with normgrad's ``kernels`` ("cpp", "python") or, None,
    the function bodies onnxruntime inlines."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    options.intra_op_num_threads = threads
    if kernels:
        normgrad.session_options(kernels, options)
        model = normgrad.prepare_for_python_kernels(model) if kernels == "python" else model
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {i.name: feeds[i.name] for i in model.graph.input})))


def assert_step_matches_inline(step, inline, feeds: dict, names) -> None:
    """The default ``step`` graph's outputs ``names`` match its ``--inline`` form's (run
    unoptimized) with the C++ kernels, the Python kernels and the inlined bodies at every
    optimization level, and with the C++ kernels its outputs are the same bits at 1, 2 and 4
    threads."""
    expected = step_outputs(inline, feeds, None, "ORT_DISABLE_ALL")
    for kernels in (["cpp"] if cpp_available() else []) + ["python", None]:
        for level in OPTIMIZATION_LEVELS:
            got = step_outputs(step, feeds, kernels, level)
            for name in names:
                np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{kernels} {level} {name}")
    if cpp_available():
        outputs = [step_outputs(step, feeds, "cpp", "ORT_ENABLE_ALL", threads) for threads in (1, 2, 4)]
        for other in outputs[1:]:
            for name in outputs[0]:
                assert other[name].tobytes() == outputs[0][name].tobytes(), name


def run_in_tests_folder(code: str, *args: str, env=None, timeout: float = 900):
    """Runs Python ``code`` with ``args`` in a fresh process whose current folder is tests/ (so
    it imports the test modules), ``env`` added to the environment; the CompletedProcess."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})), cwd=os.path.dirname(os.path.abspath(__file__)))


def old_runtime_python() -> str:
    """The Python of the oldest supported onnxruntime (``NORMGRAD_OLD_ORT_PYTHON``, normgrad
    installed there); the test is skipped when it is not set."""
    python = os.environ.get("NORMGRAD_OLD_ORT_PYTHON")
    if not python:
        pytest.skip("set NORMGRAD_OLD_ORT_PYTHON to a Python with onnxruntime 1.19.2 and normgrad installed")
    return python
