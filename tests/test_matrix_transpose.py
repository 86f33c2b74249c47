"""MatrixTranspose (which step graphs written before OuterProductSum hold): every backend (C++
kernel at any thread count and on both its lanes, Python kernel, function body on onnxruntime
and on onnx's ReferenceEvaluator) is NumPy's transpose; bad inputs named."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnx.helper as oh
import pytest

import normgrad
from _helpers import bad_input_tests, cpp_available
from normgrad.ops import harness, matrix_transpose, python_kernels

BACKENDS = ["reference", "evaluator", "functions", "python"] + (["cpp"] if cpp_available() else [])
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")
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
    "rank 3": ({"x": np.zeros((2, 3, 4), np.float32)}, "input 'x' must have rank 2 ([M, N]); got shape [2, 3, 4]"),
    "rank 1": ({"x": np.zeros(5, np.float32)}, "input 'x' must have rank 2 ([M, N]); got shape [5]"),
    "int32": ({"x": np.zeros((2, 3), np.int32)}, "input 'x' must be float32 or float64; got int32"),
}


test_cpp_bad_input_names_the_input, test_validate_names_the_input = bad_input_tests(matrix_transpose, BAD)


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
