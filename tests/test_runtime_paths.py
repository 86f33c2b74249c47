"""Runtime paths: execution-provider assignment, failure modes, the onnxruntime API range.

(a) With several execution providers listed (AzureExecutionProvider, shipped in the CPU
    wheel, before CPUExecutionProvider): registered kernels put normgrad nodes on
    CPUExecutionProvider; with function bodies only, onnxruntime inlines them, the
    optimized model has no normgrad node left, and every standard node goes to a provider
    that has a kernel for it. Shown from profiling events (``args.provider``).
(b) A model using the normgrad domain with neither kernels nor function bodies: onnxruntime's
    own error names the op; ``normgrad.inference_session`` turns it into an error saying
    what to call.
(c) The C++ library asks onnxruntime for C API version N (``GetApi(N)``); a runtime that
    does not serve N gets an error status naming both versions instead of a crash, which
    ``tests/test_cpp_kernels.py::test_old_onnxruntime_gets_a_clear_error`` checks with a fake
    ``OrtApiBase``. Here: N must not exceed the API of the oldest supported onnxruntime
    (1.19.2 serves 1..19), and the library loads and runs in the runtime at hand (run this
    file under onnxruntime 1.19.2 too; set NORMGRAD_OLD_ORT_PYTHON to a Python with an old
    onnxruntime and normgrad to also check it from a subprocess).
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import onnx
import onnxruntime as ort
import pytest

import normgrad

from _helpers import cpp_available
from _corpus_cases import assert_matches, load_case

OLDEST_ORT = (1, 19, 2)
OLDEST_ORT_API = 19  # onnxruntime 1.19.x serves C API versions 1..19
MULTI_PROVIDERS = ["AzureExecutionProvider", "CPUExecutionProvider"]

MANIFEST_OPS = {  # the normgrad ops of the cases used here
    "node_GroupNormalizationGrad_float32": ["GroupNormalizationGrad"],
    "train_resnet_block": ["BatchNormElemtBackward", "BatchNormReduceBackward"],
    "node_LayerNormalizationGrad_float32": ["LayerNormalizationGrad"],
    "node_RMSNormalizationGrad_float32": ["RMSNormalizationGrad"],
}


needs_cpp = pytest.mark.skipif(not cpp_available(), reason="C++ library not built")


def _profiled_session(model: onnx.ModelProto, backend, tmp_path, tag: str):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / f"profile_{tag}")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / f"optimized_{tag}.onnx")
    return normgrad.inference_session(model, backend, options, providers=MULTI_PROVIDERS), options


def _node_providers(session) -> dict:
    """{op type: {providers}} from the profiling events of the runs so far."""
    with open(session.end_profiling()) as handle:
        events = json.load(handle)
    result: dict = {}
    for event in events:
        args = event.get("args", {})
        if event.get("cat") == "Node" and "provider" in args:
            result.setdefault(args["op_name"], set()).add(args["provider"])
    return result


def _without_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    del bare.functions[:]
    return bare


# ----------------------------------------------------------------------------- (a) providers


def test_azure_provider_is_available():
    assert "AzureExecutionProvider" in ort.get_available_providers()


@needs_cpp
@pytest.mark.parametrize("case", list(MANIFEST_OPS))
def test_kernels_run_on_cpu_provider(case, tmp_path):
    model, inputs, expected = load_case(case)
    session, _ = _profiled_session(model, "cpp", tmp_path, "cpp")
    assert session.get_providers() == MULTI_PROVIDERS
    assert_matches(dict(zip(expected, session.run(list(expected), inputs))), expected, 1e-4, case)
    providers = _node_providers(session)
    ours = {op for op in providers if op in normgrad.ops.OPERATORS}
    assert ours == set(MANIFEST_OPS[case]), providers
    for op in ours:
        assert providers[op] == {"CPUExecutionProvider"}, (op, providers[op])
    optimized = onnx.load(str(tmp_path / "optimized_cpp.onnx"))
    assert {n.op_type for n in optimized.graph.node if n.domain == normgrad.DOMAIN} == ours


@pytest.mark.parametrize("case", list(MANIFEST_OPS))
def test_function_bodies_inline_to_standard_ops(case, tmp_path):
    model, inputs, expected = load_case(case)
    session, options = _profiled_session(_without_functions(model), "functions", tmp_path, "functions")
    assert_matches(dict(zip(expected, session.run(list(expected), inputs))), expected, 1e-4, case)
    optimized = onnx.load(options.optimized_model_filepath)
    assert not [n for n in optimized.graph.node if n.domain == normgrad.DOMAIN]
    assert not list(optimized.functions)
    assert {n.domain for n in optimized.graph.node} <= {"", "ai.onnx", "com.microsoft", "com.microsoft.nchwc"}
    providers = _node_providers(session)
    assert providers and not set(providers) & set(normgrad.ops.OPERATORS)
    # The Azure provider claims none of them; each standard op landed on a provider.
    assert set().union(*providers.values()) == {"CPUExecutionProvider"}, providers


# ----------------------------------------------------------------------------- (b) failures


def test_onnxruntime_raw_error_names_the_op():
    model, _, _ = load_case("node_BatchNormReduceBackward_float32")
    with pytest.raises(Exception) as info:
        ort.InferenceSession(_without_functions(model).SerializeToString(), providers=["CPUExecutionProvider"])
    message = str(info.value)
    assert "normgrad:BatchNormReduceBackward" in message and "not a registered function/op" in message


def test_inference_session_says_what_to_register():
    model, _, _ = load_case("train_unet_block")
    with pytest.raises(normgrad.NormgradSessionError) as info:
        normgrad.inference_session(_without_functions(model), backend=None, providers=["CPUExecutionProvider"])
    message = str(info.value)
    # onnxruntime names the first unregistered node's op: one of the graph's normgrad ops
    assert any(n.op_type in message for n in model.graph.node if n.domain == normgrad.DOMAIN)
    assert "normgrad.session_options(" in message and "normgrad.add_functions(" in message
    assert "not a registered function/op" in str(info.value.__cause__)


def test_inference_session_unknown_op_of_our_domain():
    model, _, _ = load_case("node_BatchNormElemtBackward_float32")
    model = _without_functions(model)
    model.graph.node[0].op_type = "BatchNormBackwardTypo"
    with pytest.raises(normgrad.NormgradSessionError, match="not a normgrad operator"):
        normgrad.inference_session(model, backend=None, providers=["CPUExecutionProvider"])


def test_inference_session_python_backend_rejections_are_explained():
    model, _, _ = load_case("node_BatchNormElemtBackward_float16")
    with pytest.raises(normgrad.NormgradSessionError, match="Python kernels take float32 only"):
        normgrad.inference_session(model, backend="python", providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("case", [
    "node_BatchNormReduceBackward_float32_flags",  # weight and two outputs omitted
    "node_GroupNormalizationGrad_float32_full_gamma_dx_only",  # dgamma, dbeta omitted
])
def test_inference_session_python_backend_rewrites_omissions(case):
    model, inputs, expected = load_case(case)
    session = normgrad.inference_session(_without_functions(model), backend="python", providers=["CPUExecutionProvider"])
    assert_matches(dict(zip(expected, session.run(list(expected), inputs))), expected, 2e-5, "python")


def test_inference_session_passes_other_errors_through():
    with pytest.raises(Exception) as info:
        normgrad.inference_session(onnx.ModelProto(), backend=None)
    assert not isinstance(info.value, normgrad.NormgradSessionError)
    with pytest.raises(ValueError, match="backend"):
        normgrad.inference_session(onnx.ModelProto(), backend="cuda")


@pytest.mark.parametrize("backend", ["cpp", "python", "functions"])
@pytest.mark.parametrize("form", ["proto", "bytes", "path"])
def test_inference_session_backends_and_inputs(backend, form, tmp_path):
    if backend == "cpp" and not cpp_available():
        pytest.skip("C++ library not built")
    model, inputs, expected = load_case("node_GroupNormalizationGrad_float32")
    model = _without_functions(model)  # "functions" must attach them, kernels must not need them
    if form == "bytes":
        source = model.SerializeToString()
    elif form == "path":
        source = tmp_path / "model.onnx"
        onnx.save(model, str(source))
    else:
        source = model
    session = normgrad.inference_session(source, backend, providers=["CPUExecutionProvider"])
    assert_matches(dict(zip(expected, session.run(list(expected), inputs))), expected, 2e-5, backend)


# ----------------------------------------------------------------------------- (c) API range


def _required_api_version() -> int:
    with open(normgrad.library_path(), "rb") as handle:
        data = handle.read()
    match = re.search(rb"C API version (\d+)", data)
    assert match, "the library's error message naming its C API version is missing"
    return int(match.group(1))


@needs_cpp
def test_library_api_version_within_supported_range():
    """GetApi(N) with N <= 19: the library loads on onnxruntime 1.19.2, the oldest supported."""
    assert _required_api_version() <= OLDEST_ORT_API


@needs_cpp
def test_library_loads_in_this_runtime():
    version = tuple(int(p) for p in re.findall(r"\d+", ort.__version__)[:3])
    assert version >= OLDEST_ORT, f"onnxruntime {ort.__version__} is older than the supported range"
    model, inputs, expected = load_case("train_unet_block")
    session = normgrad.inference_session(model, "cpp", providers=["CPUExecutionProvider"])
    assert_matches(dict(zip(expected, session.run(list(expected), inputs))), expected, 1e-4, ort.__version__)


_SUBPROCESS = r"""
import sys, onnxruntime, normgrad
sys.path.insert(0, sys.argv[1])
from _corpus_cases import load_case, assert_matches
model, inputs, expected = load_case("train_unet_block")
session = normgrad.inference_session(model, "cpp", providers=["CPUExecutionProvider"])
assert_matches(dict(zip(expected, session.run(list(expected), inputs))), expected, 1e-4, "old runtime")
print(onnxruntime.__version__)
"""


@needs_cpp
def test_library_loads_in_other_runtime():
    python = os.environ.get("NORMGRAD_OLD_ORT_PYTHON")
    if not python:
        pytest.skip("set NORMGRAD_OLD_ORT_PYTHON to a Python with another onnxruntime and normgrad installed")
    tests = os.path.dirname(os.path.abspath(__file__))
    process = subprocess.run([python, "-c", _SUBPROCESS, tests], capture_output=True, text=True, timeout=1800)
    assert process.returncode == 0, process.stderr[-3000:]
    print("ran on onnxruntime", process.stdout.strip())
