"""MatrixTranspose: every backend (C++ kernel at any thread count and on both its lanes, Python
kernel, function body on onnxruntime and on onnx's ReferenceEvaluator) is NumPy's transpose;
bad inputs named; the weight gradients of large float32 products read it in the default step
graph (in the form ``GradientContext.weight_gradient`` picks by shape) and its Transpose in the
``--inline`` and portable forms, with the float64 gradient and the same bits at every
optimization level and thread count."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

import normgrad
from conftest import cpp_available, cpp_error
from normgrad.graphs import build_training_graph, context
from normgrad.graphs.examples import model
from normgrad.ops import NormgradInputError, harness, matrix_transpose, python_kernels

BACKENDS = ["reference", "evaluator", "functions", "python"] + (["cpp"] if cpp_available() else [])
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")
LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL")
OP = matrix_transpose.OP_TYPE

SHAPES = {  # the C++ kernel's 8 x 8 register blocks, their edges, its 64-row thread blocks
    "blocks": (64, 64),
    "edges": (13, 7),
    "one row": (1, 37),
    "one column": (29, 1),
    "empty": (0, 5),
    "past the parallel threshold": (130, 1030),
    "ragged": (1001, 333),
}


def _x(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SHAPES)
def test_every_backend_is_numpy_s_transpose(backend, case):
    x = _x(SHAPES[case])
    y = harness.run(backend, OP, {"x": x})["y"]
    assert y.dtype == np.float32 and y.shape == x.shape[::-1]
    np.testing.assert_array_equal(y, x.T)


@pytest.mark.parametrize("backend", ["reference", "functions", "evaluator"] + (["cpp"] if cpp_available() else []))
def test_float64(backend):
    x = _x((67, 45), np.float64)
    y = harness.run(backend, OP, {"x": x})["y"]
    assert y.dtype == np.float64
    np.testing.assert_array_equal(y, x.T)


@needs_cpp
def test_cpp_kernel_at_every_thread_count_and_on_both_lanes():
    """The AVX2 blocks and the portable loop (NORMGRAD_KERNELS=generic, in a subprocess since
    the library reads it once) copy the same values at 1, 2 and 4 threads."""
    x = _x(SHAPES["ragged"])
    for threads in (1, 2, 4):
        np.testing.assert_array_equal(harness.run("cpp", OP, {"x": x}, threads=threads)["y"], x.T,
                                      err_msg=f"{threads} threads")
    script = ("import numpy as np; from normgrad.ops import harness; "
              "x = np.random.default_rng(0).standard_normal((1001, 333)).astype(np.float32); "
              "assert (harness.run('cpp', 'MatrixTranspose', {'x': x}, threads=2)['y'] == x.T).all(); print('same')")
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "NORMGRAD_KERNELS": "generic"},
                          capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "same", done.stderr[-2000:]


BAD = {
    "rank 3": (np.zeros((2, 3, 4), np.float32), "must have rank 2 ([M, N]); got shape [2, 3, 4]"),
    "rank 1": (np.zeros(5, np.float32), "must have rank 2 ([M, N]); got shape [5]"),
    "int32": (np.zeros((2, 3), np.int32), "must be float32 or float64; got int32"),
}


@needs_cpp
@pytest.mark.parametrize("case", BAD)
def test_cpp_bad_input_names_the_input(case):
    bad, rule = BAD[case]
    assert f"{OP}: input 'x' {rule}" in cpp_error(OP, {"x": bad})


@pytest.mark.parametrize("case", BAD)
def test_validate_names_the_input(case):
    bad, rule = BAD[case]
    with pytest.raises(NormgradInputError) as error:
        matrix_transpose.reference(bad)
    assert f"{OP}: input 'x' {rule}" in str(error.value)


def test_python_kernel_bad_input_logs_and_returns_nan():
    """The bridge cannot raise: the message names the input, the output is NaN."""
    out = harness.run("python", OP, {"x": np.zeros((2, 3, 4), np.float32)}, static_shapes=False)["y"]
    assert np.isnan(out).all()
    assert "input 'x' must have rank 2" in python_kernels.errors()[-1]


def test_function_body_and_shape_inference():
    body = matrix_transpose.function_body()
    assert [(n.op_type, [oh.get_attribute_value(a) for a in n.attribute]) for n in body.node] == \
        [("Transpose", [[1, 0]])]
    graph = oh.make_graph([oh.make_node(OP, ["x"], ["y"], domain=normgrad.ops.DOMAIN)], "t",
                          [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, "n"])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    forward = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18),
                                                  oh.make_opsetid(normgrad.ops.DOMAIN, normgrad.ops.OPSET_VERSION)])
    dims = onnx.shape_inference.infer_shapes(forward, strict_mode=True).graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["n", 3]


# -- the weight gradients ---------------------------------------------------------------------

FORMS = {  # name: (rows t, out, in); the weight gradient is P^T Q with P [t, m], Q [t, n]
    "square": (512, 256, 256),
    "vocabulary head": (256, 2048, 32),
    "wide": (4096, 128, 64),
    "narrow": (1024, 256, 128),
    "small": (64, 32, 32),
}
TRANSPOSES = {  # (form, matmul): MatrixTranspose nodes (GradientContext.weight_gradient's rule)
    # Gemm(x, W, transB=1): dW [out, in] = dY^T x, m = out, n = in
    ("square", False): 1,  # m <= n: P^T
    ("vocabulary head", False): 2,  # m >= 8 n: (Q^T P)^T
    ("wide", False): 0,  # n < m < 8 n: Gemm transA
    ("small", False): 0,  # below the threshold
    # MatMul(x3, V): dV [in, out] = x^T dY, m = in, n = out
    ("square", True): 1, ("vocabulary head", True): 1, ("small", True): 0,
    ("narrow", False): 0,  # n < m < 8 n
    # m <= n, but a plain product of fewer than 256 rows and 512 columns: Gemm transA
    ("wide", True): 0, ("narrow", True): 0,
}


def _linear(rows, out, inn, matmul=False):
    """y = x W^T (Gemm, transB=1), or with matmul y = x3 @ V for a 3-D x3 (GPT-2's Conv1D:
    V [in, out], the weight gradient x^T dY)."""
    rng = np.random.default_rng(1)
    if matmul:
        weights = {"V": (rng.standard_normal((inn, out)) / np.sqrt(inn)).astype(np.float32)}
        forward = model([oh.make_node("MatMul", ["x", "V"], ["y"])], {"x": [4, rows // 4, inn]}, ["y"], weights)
    else:
        weights = {"W": (rng.standard_normal((out, inn)) / np.sqrt(inn)).astype(np.float32)}
        forward = model([oh.make_node("Gemm", ["x", "W"], ["y"], transB=1)], {"x": [rows, inn]}, ["y"], weights)
    return forward, weights


def _ops(graph):
    return collections.Counter((n.domain, n.op_type) for n in graph.node)


def _session(graph, kernels=None, threads=1, level="ORT_ENABLE_ALL"):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    if kernels:
        normgrad.session_options(kernels, options)
        graph = normgrad.prepare_for_python_kernels(graph) if kernels == "python" else graph
    return ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("matmul", [False, True], ids=["gemm", "matmul"])
def test_weight_gradient_forms_are_the_float64_gradient_everywhere(form, matmul):
    """Which operands the default training graph transposes follows the shape; the weight's
    gradient is x^T dY (float64 truth) and bitwise the same at every optimization level,
    1, 2 and 4 threads and kernel choice; the --inline graph (onnxruntime's own Gemm transA) agrees."""
    rows, out, inn = FORMS[form]
    forward, weights = _linear(rows, out, inn, matmul)
    (name, weight), = weights.items()
    training, initial = build_training_graph(forward)
    inline, _ = build_training_graph(forward, inline=True)
    transposes = [n for n in training.graph.node if n.op_type == OP]
    assert len(transposes) == TRANSPOSES[(form, matmul)]
    assert not any(n.op_type == OP for n in inline.graph.node) and not inline.functions
    rng = np.random.default_rng(2)
    x = rng.standard_normal([d.dim_value for d in forward.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)
    y_grad = rng.standard_normal((*x.shape[:-1], out)).astype(np.float32)
    feeds = {**initial, "x": x, "y_grad": y_grad}
    truth = x.reshape(-1, inn).astype(np.float64).T @ y_grad.reshape(-1, out).astype(np.float64)
    truth = truth if matmul else truth.T
    runs = {}
    for kernels in [None, "python"] + (["cpp"] if cpp_available() else []):
        for threads in (1, 2, 4):
            for level in LEVELS:
                runs[(kernels, threads, level)] = _session(training, kernels, threads, level).run(
                    [f"{name}_grad"], feeds)[0]
    first = next(iter(runs.values()))
    for where, grad in runs.items():
        np.testing.assert_array_equal(grad, first, err_msg=str(where))
    assert first.shape == weight.shape
    np.testing.assert_allclose(first, truth, rtol=1e-4, atol=1e-4)
    plain = _session(inline).run([f"{name}_grad"], feeds)[0]
    np.testing.assert_allclose(first, plain, rtol=1e-5, atol=1e-5)


def test_the_threshold_and_the_element_type():
    """Below WEIGHT_GRADIENT_TRANSPOSED_MACS multiply-adds, or for float64, no copy."""
    rows, out, inn = FORMS["square"]
    assert rows * out * inn >= context.WEIGHT_GRADIENT_TRANSPOSED_MACS > 128 * out * inn
    assert _ops(build_training_graph(_linear(128, out, inn)[0]).model.graph)[(normgrad.ops.DOMAIN, OP)] == 0
    double = model([oh.make_node("Gemm", ["x", "W"], ["y"], transB=1)], {"x": [rows, inn]}, ["y"],
                   {"W": np.ones((out, inn))}, elem_type=onnx.TensorProto.DOUBLE)
    assert _ops(build_training_graph(double).model.graph)[(normgrad.ops.DOMAIN, OP)] == 0
