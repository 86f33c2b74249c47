"""AllReduce on one process: reference, validation, schema, every backend (the identity when no
communicator is configured), the kernel's configuration entry point, and the data-parallel /
synchronized-BatchNorm graphs, which on one process compute exactly the plain graph.
The multi-rank checks are in test_mpi.py."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

import normgrad
from _helpers import cpp_available
from normgrad import mpi
from normgrad.graphs import build_step_graph, build_training_graph, data_parallel, examples
from normgrad.ops import NormgradInputError, all_reduce, harness

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64]
ELEM = {np.float32: onnx.TensorProto.FLOAT, np.float16: onnx.TensorProto.FLOAT16,
        ml_dtypes.bfloat16: onnx.TensorProto.BFLOAT16, np.float64: onnx.TensorProto.DOUBLE}


def test_reference_sums_the_ranks_in_float64_rounded_once():
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=(3, 4)).astype(np.float16) for _ in range(3)]
    expected = (parts[0].astype(np.float64) + parts[1].astype(np.float64) + parts[2].astype(np.float64)).astype(np.float16)
    np.testing.assert_array_equal(all_reduce.reference(*parts).output, expected)
    one = rng.normal(size=(5,)).astype(np.float32)
    assert all_reduce.reference(one).output.tobytes() == one.tobytes()


@pytest.mark.parametrize("bad, message", [
    ((np.zeros(3, np.int32),), "input 'input' must be float32, float16, bfloat16 or float64; got int32"),
    ((np.zeros(3, np.float32), np.zeros(4, np.float32)), "input 'input of rank 1' must have the shape of 'input' [3]; got [4]"),
    ((np.zeros(3, np.float32), np.zeros(3, np.float16)), "input 'input of rank 1' must have the dtype of 'input'"),
])
def test_reference_names_the_bad_input(bad, message):
    with pytest.raises(NormgradInputError, match="AllReduce: " + message.replace("[", r"\[").replace("]", r"\]")):
        all_reduce.reference(*bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_schema_infers_the_input_type_and_shape(dtype):
    node = oh.make_node("AllReduce", ["a"], ["b"], domain=normgrad.DOMAIN)
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info("a", ELEM[dtype], ["N", 3])],
                          [onnx.ValueInfoProto(name="b")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(normgrad.DOMAIN, 1)], ir_version=10)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, check_type=True)
    onnx.checker.check_model(inferred, full_check=True)
    out = inferred.graph.output[0].type.tensor_type
    assert out.elem_type == ELEM[dtype]
    assert [d.dim_param or d.dim_value for d in out.shape.dim] == ["N", 3]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (2, 3, 5)])
def test_one_process_is_the_identity_on_every_backend(backend, dtype, shape):
    if backend == "python" and (dtype != np.float32 or shape == ()):
        pytest.skip("the Python bridge: float32 only, and rank-0 outputs come back as [1]")
    value = (np.random.default_rng(1).normal(size=shape) * 3).astype(dtype)
    got = harness.run(backend, "AllReduce", {"input": value})["output"]
    assert got.dtype == value.dtype and got.shape == value.shape
    assert got.tobytes() == value.tobytes()


@pytest.mark.skipif(not cpp_available(), reason="C++ library not built")
def test_cpp_kernel_rejects_an_integer_input():
    node = oh.make_node("AllReduce", ["a"], ["b"], domain=normgrad.DOMAIN)
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info("a", onnx.TensorProto.INT32, [3])],
                          [oh.make_tensor_value_info("b", onnx.TensorProto.INT32, [3])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(normgrad.DOMAIN, 1)], ir_version=10)
    with pytest.raises(Exception, match="AllReduce: input 'input' must be float32, float16, bfloat16 or float64; got int32"):
        session = ort.InferenceSession(model.SerializeToString(), normgrad.session_options("cpp"), providers=["CPUExecutionProvider"])
        session.run(None, {"a": np.zeros(3, np.int32)})


@pytest.mark.skipif(not cpp_available(), reason="C++ library not built")
def test_configuration_entry_point_refuses_bad_arguments():
    library = ctypes.CDLL(normgrad.library_path())
    configure = library.normgrad_mpi_configure
    configure.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    assert configure(6, 1, 1, None, 0, 0, 0, 2) == -1  # neither int nor pointer handles
    assert configure(8, None, 1, None, 0, 0, 0, 2) == -1  # no MPI_Alltoallv
    assert configure(8, 1, 1, None, 0, 0, 2, 2) == -1  # rank outside [0, size)
    assert mpi.configured_size() == 1  # refused calls changed nothing
    assert configure(0, None, None, None, 0, 0, 0, 1) == 0


def test_mpi_module_without_init_is_one_process():
    assert not mpi.initialized() and mpi.rank() == 0 and mpi.size() == 1
    weights = {"w": np.arange(3, dtype=np.float32)}
    copied = mpi.broadcast(weights)
    assert copied["w"].tobytes() == weights["w"].tobytes() and copied["w"] is not weights["w"]
    data = np.arange(10)
    np.testing.assert_array_equal(mpi.shard(data), data)
    np.testing.assert_array_equal(mpi.allreduce_array(data.astype(np.float32)), data)


# ----------------------------------------------------------------------- exported graphs


def _outputs(model, feeds, backend):
    options = normgrad.session_options("cpp") if backend == "cpp" else ort.SessionOptions()
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


@pytest.mark.parametrize("backend", ["functions", "cpp"])
def test_data_parallel_graph_on_one_process_is_the_plain_graph(backend):
    if backend == "cpp" and not cpp_available():
        pytest.skip("C++ library not built")
    model = examples.resnet_block(batch="N")
    plain, weights = build_training_graph(model, loss="mse")
    parallel, parallel_weights = build_training_graph(model, loss="mse", data_parallel=True, sync_batch_norm=True)
    assert parallel_weights.keys() == weights.keys()
    assert all(np.array_equal(parallel_weights[k], weights[k]) for k in weights)
    ops = [n.op_type for n in parallel.graph.node if n.domain == normgrad.DOMAIN]
    # one bucket for every gradient and the loss, 3 per BatchNorm (sum+count, squares, backward sums)
    assert ops.count("AllReduce") == 1 + 3 * 2
    meta = json.loads({p.key: p.value for p in parallel.metadata_props}[data_parallel.METADATA])
    assert meta["data_parallel"] and meta["sync_batch_norm"] and len(meta["buckets"]) == 1
    assert meta["buckets"][0]["members"] == ["w1", "w2", "b1", "s1", "t1", "s2", "t2", "loss"]
    rng = np.random.default_rng(0)
    feeds = {**weights, "x": rng.normal(size=(4, 4, 5, 5)).astype(np.float32),
             "labels": rng.normal(size=(4, 4, 5, 5)).astype(np.float32)}
    expected, got = _outputs(plain, feeds, backend), _outputs(parallel, feeds, backend)
    assert list(got) == list(expected)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_sync_batch_norm_alone_averages_no_gradient():
    training, _ = build_training_graph(examples.resnet_block(batch="N"), loss="mse", sync_batch_norm=True)
    meta = json.loads({p.key: p.value for p in training.metadata_props}[data_parallel.METADATA])
    assert meta == {"data_parallel": False, "sync_batch_norm": True, "buckets": []}
    assert sum(n.op_type == "AllReduce" for n in training.graph.node) == 3 * 2
    plain, _ = build_training_graph(examples.resnet_block(batch="N"), loss="mse")
    assert data_parallel.METADATA not in {p.key for p in plain.metadata_props}


def test_buckets_split_by_size_and_dtype():
    f, h = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    members = [data_parallel.Member("a", "a", f, [100]), data_parallel.Member("b", "b", h, [10]),
               data_parallel.Member("c", "c", f, [100]), data_parallel.Member("d", "d", f, [300])]
    buckets = data_parallel.plan_buckets(members, bucket_bytes=800)
    assert [[m.key for m in bucket] for bucket in buckets] == [["a", "c"], ["b"], ["d"]]


def test_step_graph_keeps_the_all_reduces():
    training = build_training_graph(examples.resnet_block(batch="N"), loss="mse", data_parallel=True, sync_batch_norm=True)
    step, _ = build_step_graph(training, "sgd", momentum=0.9)
    assert sum(n.op_type == "AllReduce" for n in step.graph.node) == 7


def test_usage_errors_of_the_data_parallel_options(tmp_path):
    with pytest.raises(ValueError, match="inline=True writes AllReduce as its function body"):
        build_training_graph(examples.resnet_block(), loss="mse", inline=True, sync_batch_norm=True)
    path = tmp_path / "block.onnx"
    onnx.save(examples.resnet_block(), path)
    result = subprocess.run([sys.executable, "-m", "normgrad.tools.cli", "export", str(path), "-o", str(tmp_path / "out.onnx"),
                             "--inline", "--data-parallel"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "--inline writes AllReduce as its function body" in result.stderr.strip().splitlines()[-1]
    for extra, message in ((["--bucket-mb", "1"], "--bucket-mb needs --data-parallel"),
                           (["--data-parallel", "--bucket-mb", "0"], "--bucket-mb must be a positive number; got 0.0")):
        result = subprocess.run([sys.executable, "-m", "normgrad.tools.cli", "export", str(path), "-o",
                                 str(tmp_path / "out.onnx"), *extra], capture_output=True, text=True)
        assert result.returncode == 2 and message in result.stderr, result.stderr


def test_cli_writes_a_data_parallel_step_graph(tmp_path):
    path = tmp_path / "block.onnx"
    onnx.save(examples.resnet_block(batch="N"), path)
    out = tmp_path / "step.onnx"
    result = subprocess.run([sys.executable, "-m", "normgrad.tools.cli", "export", str(path), "-o", str(out), "--loss", "mse",
                             "--optimizer", "sgd", "--data-parallel", "--sync-batch-norm", "--bucket-mb", "0.0001"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    step = onnx.load(out)
    meta = json.loads({p.key: p.value for p in step.metadata_props}[data_parallel.METADATA])
    # 0.0001 MiB = 104 bytes: w1 and w2 (576 bytes each) get buckets of their own, the rest share
    assert [b["members"] for b in meta["buckets"]] == [["w1"], ["w2"], ["b1", "s1", "t1", "s2", "t2", "loss"]]
    assert sum(n.op_type == "AllReduce" for n in step.graph.node) == 3 + 3 * 2
