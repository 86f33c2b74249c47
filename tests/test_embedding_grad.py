"""EmbeddingGrad: every backend (C++ kernel at any thread count, Python kernel, function body
on onnxruntime and on onnx's ReferenceEvaluator) adds the dy rows in increasing k, bitwise the
NumPy reference (np.add.at in dy's dtype) and close to a float64 truth; torch's nn.Embedding
gradient; bad inputs named; the step graphs use the operator by default and its standard-op
body in the ``--inline`` and portable forms, with the same bits at every thread count and
optimization level; a tied embedding's gradient is still one Gemm (GemmSumFusion)."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

import normgrad
from _helpers import bad_input_tests, cpp_available
from normgrad.graphs import build_step_graph, build_training_graph, rewrites
from normgrad.graphs.examples import model
from normgrad.graphs.optimizers import hyperparameter_feeds
from normgrad.graphs.rules import gather
from normgrad.ops import embedding_grad, harness
from normgrad.ops import python_kernels

BACKENDS = ["reference", "evaluator", "functions", "python"] + (["cpp"] if cpp_available() else [])
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")
LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL")
OP = embedding_grad.OP_TYPE

CASES = {  # name: (N, rows, trailing dims)
    "repeats": (40, 7, (5,)),
    "empty": (0, 6, (3,)),
    "rows never read": (3, 50, (4,)),
    "trailing dims": (25, 9, (2, 3)),
    "one column": (30, 4, (1,)),
    "rank 1": (20, 5, ()),
    "no rows": (0, 0, (3,)),
    "several blocks": (3000, 700, (130,)),  # past the C++ kernel's 65536-element blocks and its parallel threshold
}


def _inputs(n, rows, trailing, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    picked = rng.integers(0, max(rows // 2, 1), n)  # rows [rows/2, rows) never read
    return {"dy": rng.standard_normal((n, *trailing)).astype(dtype),
            "indices": picked.astype(np.int64).reshape((n,) + (1,) * len(trailing)),
            "shape": np.array([rows, *trailing], np.int64)}


def _truth(inputs):
    """float64 sums, written without np.add.at."""
    dy = inputs["dy"].astype(np.float64)
    out = np.zeros(tuple(inputs["shape"]), np.float64)
    for k, row in enumerate(inputs["indices"].reshape(-1)):
        out[row] += dy[k]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_every_backend_is_the_reference_and_close_to_float64(backend, case):
    inputs = _inputs(*CASES[case])
    out = harness.run(backend, OP, inputs)["ddata"]
    assert out.dtype == np.float32 and out.shape == tuple(inputs["shape"])
    np.testing.assert_array_equal(out, embedding_grad.reference(**inputs).ddata)
    np.testing.assert_allclose(out, _truth(inputs), rtol=1e-5, atol=1e-5)
    if inputs["dy"].size:
        assert (out[CASES[case][1] // 2 + 1:] == 0).all()  # rows no index names


@pytest.mark.parametrize("backend", ["reference", "functions", "evaluator"] + (["cpp"] if cpp_available() else []))
def test_float64_sums_in_k_order(backend):
    inputs = _inputs(200, 11, (6,), np.float64)
    out = harness.run(backend, OP, inputs)["ddata"]
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, embedding_grad.reference(**inputs).ddata)
    np.testing.assert_allclose(out, _truth(inputs), rtol=1e-12, atol=1e-12)


@needs_cpp
def test_cpp_kernel_is_bitwise_the_same_at_every_thread_count():
    inputs = _inputs(5000, 3000, (64,))  # 47 blocks of 65536 elements, past the parallel threshold
    inputs["indices"][:2000] = 17  # one row summed 2000 times: any other order would show
    reference = embedding_grad.reference(**inputs).ddata
    for threads in (1, 2, 4):
        np.testing.assert_array_equal(harness.run("cpp", OP, inputs, threads=threads)["ddata"], reference,
                                      err_msg=f"{threads} threads")


_BAD_INPUTS = {  # on inputs of 4 rows of dy [4, 3] into a table of 5 rows
    "index past the table": ("indices", np.array([[0], [5], [1], [1]]), "must hold row numbers in [0, rows) = [0, 5); "
                             "got 5 at position 1"),
    "negative index": ("indices", np.array([[0], [1], [-1], [1]]), "must hold row numbers in [0, rows) = [0, 5); got -1 "
                       "at position 2"),
    "int32 indices": ("indices", np.array([[0], [1], [2], [3]], np.int32), "must be int64; got int32"),
    "indices without the unit axis": ("indices", np.array([0, 1, 2, 3]), "must have shape [4, 1] (dy's first dim, then "
                                      "ones to dy's rank); got [4]"),
    "indices of another N": ("indices", np.array([[0], [1], [2]]), "must have shape [4, 1]"),
    "negative rows": ("shape", np.array([-2, 3]), "must have rows = shape[0] >= 0; got -2"),
    "shape of another width": ("shape", np.array([5, 4]), "must end with dy's dims [3]; got [5, 4]"),
    "shape of another rank": ("shape", np.array([5, 3, 1]), "must have shape [2] (dy's rank); got [3]"),
    "int32 shape": ("shape", np.array([5, 3], np.int32), "must be int64; got int32"),
    "int32 dy": ("dy", np.zeros((4, 3), np.int32), "must be float32 or float64; got int32"),
    "scalar dy": ("dy", np.array(1.0, np.float32), "must have rank >= 1"),
}


def _good():
    return {"dy": np.ones((4, 3), np.float32), "indices": np.array([[0], [1], [2], [1]]), "shape": np.array([5, 3])}


BAD = {case: ({**_good(), name: bad}, f"input '{name}' {rule}") for case, (name, bad, rule) in _BAD_INPUTS.items()}
test_cpp_bad_input_names_the_input, test_validate_names_the_input = bad_input_tests(embedding_grad, BAD)


def test_python_kernel_bad_index_logs_and_returns_nan():
    """The bridge cannot raise: the message names the input, the output is NaN."""
    inputs = {**_good(), "indices": np.array([[0], [7], [1], [1]])}
    out = harness.run("python", OP, inputs)["ddata"]
    assert np.isnan(out).all()
    assert "input 'indices' must hold row numbers in [0, rows)" in python_kernels.errors()[-1]


def test_function_body_is_the_rule_s_scatter_form():
    """The body the portable and inlined graphs hold: zeros, broadcast indices, one ScatterElements add."""
    body = embedding_grad.function_body()
    assert [n.op_type for n in body.node] == ["Constant", "CastLike", "Expand", "Shape", "Expand", "ScatterElements"]
    scatter = body.node[-1]
    assert {a.name: oh.get_attribute_value(a) for a in scatter.attribute} == {"axis": 0, "reduction": b"add"}


# -- the graphs --------------------------------------------------------------------------------

V, D, B, T = 300, 16, 4, 24  # a table past ONE_HOT_ROWS


def _embedding(tied=False):
    """ids [B, T] -> the rows of W [V, D]; tied: also logits = rows @ W^T (BERT's decoder)."""
    rng = np.random.default_rng(1)
    table = {"W": (rng.standard_normal((V, D)) * 0.5).astype(np.float32)}
    nodes = [oh.make_node("Gather", ["W", "ids"], ["rows"])]
    if tied:
        table["flat"] = np.array([-1, D], np.int64)
        nodes += [oh.make_node("Reshape", ["rows", "flat"], ["h"]), oh.make_node("Gemm", ["h", "W"], ["y"], transB=1)]
    else:
        nodes.append(oh.make_node("Identity", ["rows"], ["y"]))
    forward = model(nodes, {}, ["y"], table)
    forward.graph.input.append(oh.make_tensor_value_info("ids", onnx.TensorProto.INT64, [B, T]))
    return onnx.shape_inference.infer_shapes(forward)


def _ids(seed=0):
    ids = np.random.default_rng(seed).integers(0, V // 2, (B, T)).astype(np.int64)
    ids[0, :5] = 3  # repeats
    return ids


def _ops(graph):
    return collections.Counter(n.op_type for n in graph.node)


def test_the_rule_writes_the_operator_for_large_float32_tables_only():
    training = build_training_graph(_embedding()).model
    assert _ops(training.graph)[OP] == 1 and not _ops(training.graph)["ScatterElements"]
    grad = next(n.output[0] for n in training.graph.node if n.op_type == OP)
    declared = {v.name: v for v in training.graph.value_info}
    assert [d.dim_value for d in declared[grad].type.tensor_type.shape.dim] == [V, D]
    small = model([oh.make_node("Gather", ["W", "ids"], ["y"])], {}, ["y"], {"W": np.ones((gather.ONE_HOT_ROWS, 3),
                                                                                           np.float32)})
    small.graph.input.append(oh.make_tensor_value_info("ids", onnx.TensorProto.INT64, [5]))
    assert OP not in _ops(build_training_graph(small).model.graph)
    double = model([oh.make_node("Gather", ["W", "ids"], ["y"])], {}, ["y"], {"W": np.ones((V, 3))},
                   elem_type=onnx.TensorProto.DOUBLE)
    double.graph.input.append(oh.make_tensor_value_info("ids", onnx.TensorProto.INT64, [5]))
    ops = _ops(build_training_graph(double).model.graph)
    assert OP not in ops and ops["ScatterElements"] == 1


def _session(graph, kernels=None, threads=1, level="ORT_ENABLE_ALL", optimized=None):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    if optimized:
        options.optimized_model_filepath = str(optimized)
    if kernels:
        normgrad.session_options(kernels, options)
        graph = normgrad.prepare_for_python_kernels(graph) if kernels == "python" else graph
    return ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _forms(**options):
    """(default, inline, portable) step graphs of the embedding and the initial state."""
    default, initial = build_step_graph(build_training_graph(_embedding(**options), loss="mse"), "sgd")
    inline, _ = build_step_graph(build_training_graph(_embedding(**options), loss="mse", inline=True), "sgd")
    portable, _ = build_step_graph(build_training_graph(_embedding(**options), loss="mse"), "sgd", portable=True)
    return default, inline, portable, initial


def test_step_graph_forms_give_the_same_bits_at_every_level_and_thread_count():
    """The default step graph has one EmbeddingGrad (C++ and Python kernels, or the body
    onnxruntime inlines without them); --inline and the portable form have its body's
    standard ops instead; the updated table is bitwise the same everywhere, and the float64
    SGD step of the mse loss's gradient."""
    default, inline, portable, initial = _forms()
    assert _ops(default.graph)[OP] == 1
    for form in (inline, portable):
        ops = _ops(form.graph)
        assert OP not in ops and not any(f.name == OP for f in form.functions)
        assert ops["ScatterElements"] == 1 and ops["Expand"] >= _ops(default.graph)["Expand"] + 2
    expanded = rewrites.expand_operator(onnx.ModelProto.FromString(default.SerializeToString()), embedding_grad)
    others = _ops(default.graph) - collections.Counter([OP])
    assert _ops(expanded.graph) == others + collections.Counter(n.op_type for n in embedding_grad.function_body().node)
    ids, labels = _ids(), np.random.default_rng(2).standard_normal((B, T, D)).astype(np.float32)
    feeds = {**initial, "ids": ids, "labels": labels, "lr": np.array(0.5, np.float32), "step": np.array(1, np.float32)}
    runs = {}
    for name, graph in (("default", default), ("inline", inline), ("portable", portable)):
        graph_feeds = {**hyperparameter_feeds(graph), **feeds}
        kernel_choices = [None] + ((["cpp"] if cpp_available() else []) + ["python"] if graph is default else [])
        for kernels in kernel_choices:
            for threads in (1, 2):
                for level in LEVELS:
                    session = _session(graph, kernels, threads, level)
                    wanted = {i.name for i in session.get_inputs()}
                    runs[(name, kernels, threads, level)] = session.run(
                        ["W.next"], {k: v for k, v in graph_feeds.items() if k in wanted})[0]
    first = next(iter(runs.values()))
    for where, table in runs.items():
        np.testing.assert_array_equal(table, first, err_msg=str(where))
    dy = 2 * (initial["W"][ids].astype(np.float64) - labels) / labels.size
    grad = _truth({"dy": dy.reshape(-1, D), "indices": ids.reshape(-1, 1), "shape": np.array([V, D])})
    np.testing.assert_allclose(first, initial["W"] - 0.5 * grad, rtol=1e-6, atol=1e-7)


@needs_cpp
@pytest.mark.parametrize("level", LEVELS[1:])
def test_tied_embedding_gradient_is_one_gemm(tmp_path, level):
    """BERT ties its decoder to the word embedding: the table's gradient is the decoder's
    weight gradient (a Gemm) plus the scatter; onnxruntime's GemmSumFusion makes it one Gemm
    with the scatter as C once the scatter's shape is declared. The gradient matches the
    graph without the operator (the body inlined) and torch."""
    training, initial = build_training_graph(_embedding(tied=True))
    ids, table = _ids(), initial["W"]
    y_grad = np.random.default_rng(3).standard_normal((B * T, V)).astype(np.float32)
    feeds = {**initial, "ids": ids, "y_grad": y_grad}
    optimized = tmp_path / "optimized.onnx"
    ours = _session(training, "cpp", 1, level, optimized).run(["W_grad"], feeds)[0]
    graph = onnx.load(str(optimized))
    scatter = next(n.output[0] for n in graph.graph.node if n.op_type == OP)
    readers = [n for n in graph.graph.node if scatter in n.input]
    assert [n.op_type for n in readers] == ["Gemm"] and list(readers[0].input).index(scatter) == 2
    assert "Sum" not in _ops(graph.graph)
    plain = _session(training, None, 1, level).run(["W_grad"], feeds)[0]
    np.testing.assert_array_equal(ours, plain)
    torch = pytest.importorskip("torch")
    weight = torch.nn.Parameter(torch.tensor(table))
    rows = torch.nn.functional.embedding(torch.tensor(ids), weight)
    (rows.reshape(-1, D) @ weight.T).backward(torch.tensor(y_grad))
    np.testing.assert_allclose(ours, weight.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", [None, "python"] + (["cpp"] if cpp_available() else []))
def test_nn_embedding_gradient_is_torch_s(kernels):
    torch = pytest.importorskip("torch")
    training, initial = build_training_graph(_embedding())
    table, ids = initial["W"], _ids(5)
    y_grad = np.random.default_rng(4).standard_normal((B, T, D)).astype(np.float32)
    ours = _session(training, kernels).run(["W_grad"], {**initial, "ids": ids, "y_grad": y_grad})[0]
    embedding = torch.nn.Embedding(V, D)
    with torch.no_grad():
        embedding.weight.copy_(torch.tensor(table))
    embedding(torch.tensor(ids)).backward(torch.tensor(y_grad))
    np.testing.assert_allclose(ours, embedding.weight.grad.numpy(), rtol=1e-6, atol=1e-6)
