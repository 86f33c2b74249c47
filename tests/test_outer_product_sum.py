"""OuterProductSum: every backend (C++ kernel on each of its paths and at any thread count,
Python kernel, function body on onnxruntime and on onnx's ReferenceEvaluator) is the float64
product aᵀ b; the C++ kernel gives the same bits on every path (AVX-512, AVX2, the portable
std::fma loop) and thread count; bad inputs named; the weight gradients of large float32
products are one in the default step graph and a Gemm with transA in the ``--inline`` form,
with the float64 gradient and the same bits at every optimization level and thread count."""

from __future__ import annotations

import collections
import functools
import os
import subprocess
import sys

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

import normgrad
from _helpers import bad_input_tests, cpp_available
from normgrad.graphs import build_training_graph, context
from normgrad.graphs.examples import model
from normgrad.ops import harness, outer_product_sum, python_kernels

BACKENDS = ["reference", "evaluator", "functions", "python"] + (["cpp"] if cpp_available() else [])
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")
LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL")
OP = outer_product_sum.OP_TYPE

SHAPES = {  # (T, M, N): the register tiles (14 x 32, 6 x 16, 4 x 8), their edges, the blocks
    "tiles": (64, 84, 96),
    "edges": (13, 29, 37),
    "one row": (1, 5, 7),
    "no rows": (0, 6, 9),
    "empty": (5, 0, 3),
    "depth blocks": (300, 30, 70),
    "column blocks": (20, 15, 2100),
    "y past the cache, b packed whole": (40, 8300, 64),
}


def _operands(shape, seed=0):
    t, m, n = shape
    rng = np.random.default_rng(seed)
    return rng.standard_normal((t, m)).astype(np.float32), rng.standard_normal((t, n)).astype(np.float32)


def _assert_float64_product(y, a, b):
    truth = a.astype(np.float64).T @ b.astype(np.float64)
    assert y.dtype == np.float32 and y.shape == truth.shape
    scale = np.abs(a).astype(np.float64).T @ np.abs(b).astype(np.float64)  # the rounding errors' bound
    assert (np.abs(y - truth) <= 2 ** -22 * (a.shape[0] + 1) * scale + 1e-30).all()


@functools.lru_cache(maxsize=None)
def _gemm_takes_no_rows() -> bool:
    """Whether this onnxruntime's Gemm takes K = 0 (1.19.2 refuses it: gemm_helper's K_ > 0)."""
    graph = oh.make_graph([oh.make_node("Gemm", ["a", "b"], ["y"], transA=1)], "g",
                          [oh.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [0, 2]) for n in "ab"],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 2])])
    session = ort.InferenceSession(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)],
                                                 ir_version=8).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    try:
        session.run(None, {"a": np.zeros((0, 2), np.float32), "b": np.zeros((0, 2), np.float32)})
    except Exception:  # onnxruntime's own error type
        return False
    return True


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SHAPES)
def test_every_backend_is_the_float64_product(backend, case):
    if backend == "functions" and SHAPES[case][0] == 0 and not _gemm_takes_no_rows():
        pytest.skip(f"onnxruntime {ort.__version__}'s Gemm (the function body) refuses K = 0")
    a, b = _operands(SHAPES[case])
    _assert_float64_product(harness.run(backend, OP, {"a": a, "b": b})["y"], a, b)


@pytest.mark.parametrize("backend", ["reference", "functions", "evaluator"] + (["cpp"] if cpp_available() else []))
def test_float64(backend):
    """Float64 graphs (the gradient checks run training graphs in float64) get the float64 product."""
    a, b = (v.astype(np.float64) for v in _operands(SHAPES["edges"]))
    y = harness.run(backend, OP, {"a": a, "b": b})["y"]
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, a.T @ b, rtol=1e-13, atol=1e-13)


_PATH_SCRIPT = """
import sys, numpy as np
from normgrad.ops import harness
rng = np.random.default_rng(1)
for t, m, n in [(300, 290, 75), (40, 8300, 64), (20, 15, 2100)]:
    a, b = rng.standard_normal((t, m)).astype(np.float32), rng.standard_normal((t, n)).astype(np.float32)
    for threads in (1, 2, 4):
        np.save(f"{sys.argv[1]}_{m}_{threads}.npy", harness.run("cpp", "OuterProductSum", {"a": a, "b": b},
                                                                threads=threads)["y"])
"""


@needs_cpp
def test_cpp_kernel_gives_the_same_bits_on_every_path_and_thread_count(tmp_path):
    """Each element is one chain of fused multiply-adds over T, whatever the blocking: the
    AVX-512 tile, the AVX2 tile (NORMGRAD_KERNELS=avx2) and the portable loop
    (NORMGRAD_KERNELS=generic; subprocesses, since the library reads it once) agree bit for
    bit at 1, 2 and 4 threads."""
    for path in ("default", "avx2", "generic"):
        env = {k: v for k, v in os.environ.items() if k != "NORMGRAD_KERNELS"}
        if path != "default":
            env["NORMGRAD_KERNELS"] = path
        done = subprocess.run([sys.executable, "-c", _PATH_SCRIPT, str(tmp_path / path)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    for m in (290, 8300, 15):
        first = np.load(tmp_path / f"default_{m}_1.npy")
        for path in ("default", "avx2", "generic"):
            for threads in (1, 2, 4):
                np.testing.assert_array_equal(np.load(tmp_path / f"{path}_{m}_{threads}.npy"), first,
                                              err_msg=f"M {m}, {path}, {threads} threads")


BAD = {
    "a rank 3": ({"a": np.zeros((2, 3, 4), np.float32), "b": np.zeros((2, 3), np.float32)},
                 "input 'a' must have rank 2 ([T, M]); got shape [2, 3, 4]"),
    "b rank 1": ({"a": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.float32)},
                 "input 'b' must have rank 2 ([T, N]); got shape [2]"),
    "int32": ({"a": np.zeros((2, 3), np.int32), "b": np.zeros((2, 3), np.int32)},
              "input 'a' must be float32 or float64; got int32"),
    "types differ": ({"a": np.zeros((2, 3), np.float32), "b": np.zeros((2, 3), np.float64)},
                     "input 'b' must have a's type float32; got float64"),
    "rows differ": ({"a": np.zeros((2, 3), np.float32), "b": np.zeros((4, 3), np.float32)},
                    "inputs 'a' [T, M] and 'b' [T, N] must have the same number of rows T; "
                    "got shapes [2, 3] and [4, 3]"),
}


test_cpp_bad_input_names_the_input, test_validate_names_the_input = bad_input_tests(outer_product_sum, BAD)


def test_python_kernel_bad_input_logs_and_returns_nan():
    """The bridge cannot raise: the message names the inputs, the output is NaN."""
    feeds = {"a": np.zeros((2, 3), np.float32), "b": np.zeros((4, 5), np.float32)}
    out = harness.run("python", OP, feeds, static_shapes=False)["y"]
    assert np.isnan(out).all()
    assert "must have the same number of rows T" in python_kernels.errors()[-1]


def test_function_body_and_shape_inference():
    body = outer_product_sum.function_body()
    assert [(n.op_type, [(a.name, oh.get_attribute_value(a)) for a in n.attribute]) for n in body.node] == \
        [("Gemm", [("transA", 1)])]
    graph = oh.make_graph([oh.make_node(OP, ["a", "b"], ["y"], domain=normgrad.ops.DOMAIN)], "t",
                          [oh.make_tensor_value_info("a", onnx.TensorProto.FLOAT, ["t", 3]),
                           oh.make_tensor_value_info("b", onnx.TensorProto.FLOAT, ["t", "n"])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    forward = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18),
                                                  oh.make_opsetid(normgrad.ops.DOMAIN, normgrad.ops.OPSET_VERSION)])
    dims = onnx.shape_inference.infer_shapes(forward, strict_mode=True).graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == [3, "n"]
    forward.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 4
    forward.graph.input[1].type.tensor_type.shape.dim[0].dim_value = 5
    with pytest.raises(Exception, match="same number of rows T"):
        onnx.shape_inference.infer_shapes(forward, strict_mode=True)


# -- the weight gradients ---------------------------------------------------------------------

FORMS = {  # name: (rows t, out, in); the weight gradient is P^T Q with P [t, m], Q [t, n]
    "square": (512, 256, 256),
    "vocabulary head": (256, 2048, 32),
    "wide": (4096, 128, 64),
    "small": (64, 32, 32),
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
def test_weight_gradients_are_the_float64_gradient_everywhere(form, matmul):
    """The default training graph's weight gradient is one OuterProductSum from
    WEIGHT_GRADIENT_OUTER_PRODUCT_MACS multiply-adds on; it is x^T dY (float64 truth), bitwise
    the same at every optimization level and 1, 2 and 4 threads for each kernel choice; the
    --inline graph (onnxruntime's own Gemm transA) agrees."""
    rows, out, inn = FORMS[form]
    forward, weights = _linear(rows, out, inn, matmul)
    (name, weight), = weights.items()
    training, initial = build_training_graph(forward)
    inline, _ = build_training_graph(forward, inline=True)
    large = rows * out * inn >= context.WEIGHT_GRADIENT_OUTER_PRODUCT_MACS
    assert _ops(training.graph)[(normgrad.ops.DOMAIN, OP)] == (1 if large else 0)
    assert not any(n.op_type == OP for n in inline.graph.node) and not inline.functions
    rng = np.random.default_rng(2)
    x = rng.standard_normal([d.dim_value for d in forward.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)
    y_grad = rng.standard_normal((*x.shape[:-1], out)).astype(np.float32)
    feeds = {**initial, "x": x, "y_grad": y_grad}
    x2, dy2 = x.reshape(-1, inn), y_grad.reshape(-1, out)
    a, b = (x2, dy2) if matmul else (dy2, x2)  # the gradient is a^T b
    for kernels in [None, "python"] + (["cpp"] if cpp_available() else []):
        runs = {(threads, level): _session(training, kernels, threads, level).run([f"{name}_grad"], feeds)[0]
                for threads in (1, 2, 4) for level in LEVELS}
        first = next(iter(runs.values()))
        for where, grad in runs.items():
            np.testing.assert_array_equal(grad, first, err_msg=f"{kernels} kernels, {where}")
        assert first.shape == weight.shape
        _assert_float64_product(first, a, b)
    _assert_float64_product(_session(inline).run([f"{name}_grad"], feeds)[0], a, b)


def test_the_threshold_the_element_type_and_alpha():
    """Below WEIGHT_GRADIENT_OUTER_PRODUCT_MACS multiply-adds, for float64 or under a Gemm's
    alpha, a Gemm with transA."""
    rows, out, inn = FORMS["square"]
    assert rows * out * inn >= context.WEIGHT_GRADIENT_OUTER_PRODUCT_MACS > 128 * out * inn
    assert _ops(build_training_graph(_linear(128, out, inn)[0]).model.graph)[(normgrad.ops.DOMAIN, OP)] == 0
    double = model([oh.make_node("Gemm", ["x", "W"], ["y"], transB=1)], {"x": [rows, inn]}, ["y"],
                   {"W": np.ones((out, inn))}, elem_type=onnx.TensorProto.DOUBLE)
    assert _ops(build_training_graph(double).model.graph)[(normgrad.ops.DOMAIN, OP)] == 0
    scaled = model([oh.make_node("Gemm", ["x", "W"], ["y"], transB=1, alpha=0.5)], {"x": [rows, inn]}, ["y"],
                   {"W": np.ones((out, inn), np.float32)})
    graph = build_training_graph(scaled).model.graph
    assert _ops(graph)[(normgrad.ops.DOMAIN, OP)] == 0
    assert any(n.op_type == "Gemm" and any(a.name == "alpha" for a in n.attribute) for n in graph.node)
