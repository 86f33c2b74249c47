"""com.microsoft MatMulNBits (onnxruntime's block-quantized MatMul): the packed weight is frozen,
dA = dY @ dequant(B) and dbias against float64 NumPy on an independently dequantized weight,
onnxruntime's forward against the same weight, and the unfused model (a MatMul on that weight)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from normgrad.graphs import build_training_graph
from normgrad.graphs.context import UnsupportedOperatorError

from _quantized_models import dequantize_matmul_nbits, matmul_nbits_model

ort = pytest.importorskip("onnxruntime")

CASES = [(bits, block_size, zero_points, k) for bits in (4, 8) for block_size in (16, 32, 64, 128, 256)
         for zero_points in (None, "uint8", "float") for k in (48, 100) if not (bits == 8 and zero_points == "float")]
"""(bits, block_size, zero points, K); onnxruntime's CPU kernel refuses 8 bits with float zero points."""


def _skip_unless_the_kernel_runs(bits, block_size, zero_points):
    """Skips where onnxruntime's MatMulNBits kernel refuses the form at session creation
    (onnxruntime 1.19.2's takes 4 bits only), decided by creating the session."""
    model, _, _ = matmul_nbits_model((1, 16), 8, bits, block_size, zero_points)
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # onnxruntime's own exception types differ across versions
        pytest.skip(f"onnxruntime {ort.__version__}'s MatMulNBits kernel refuses bits={bits}, "
                    f"block_size={block_size}, zero points {zero_points} at session creation")


def _run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _gradients(model, a, dy, weights=None):
    training = build_training_graph(model)
    return _run(training.model, {"a": a, "y_grad": dy, **training.weights, **(weights or {})}), training


@pytest.mark.parametrize("bits,block_size,zero_points,k", CASES)
def test_input_gradient_is_dy_times_the_dequantized_weight(bits, block_size, zero_points, k):
    _skip_unless_the_kernel_runs(bits, block_size, zero_points)
    model, weight, _ = matmul_nbits_model((2, 3, k), 24, bits, block_size, zero_points)
    rng = np.random.default_rng(1)
    a, dy = rng.standard_normal((2, 3, k)).astype(np.float32), rng.standard_normal((2, 3, 24)).astype(np.float32)
    forward = _run(model, {"a": a})["y"]
    np.testing.assert_allclose(forward, a.astype(np.float64) @ weight.T, rtol=1e-5, atol=1e-5)
    outputs, training = _gradients(model, a, dy)
    assert set(training.weights) == set(), "the packed weight, scales and zero points are frozen"
    np.testing.assert_allclose(outputs["a_grad"], dy.astype(np.float64) @ weight, rtol=1e-5, atol=1e-5)


def test_matches_the_unfused_matmul_and_a_finite_difference():
    model, weight, extra = matmul_nbits_model((4, 64), 40, 4, 32, "uint8", bias=True)
    rng = np.random.default_rng(2)
    a, dy = rng.standard_normal((4, 64)).astype(np.float32), rng.standard_normal((4, 40)).astype(np.float32)
    outputs, training = _gradients(model, a, dy)
    assert set(training.weights) == {"bias"}
    unfused = oh.make_graph(
        [oh.make_node("MatMul", ["a", "w"], ["p"]), oh.make_node("Add", ["p", "bias"], ["y"])], "unfused",
        [oh.make_tensor_value_info("a", onnx.TensorProto.FLOAT, (4, 64))],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, (4, 40))],
        [onh.from_array(weight.T.astype(np.float32), "w"), onh.from_array(extra["bias"], "bias")])
    expected, _ = _gradients(oh.make_model(unfused, opset_imports=[oh.make_opsetid("", 17)], ir_version=model.ir_version),
                             a, dy, {"w": weight.T.astype(np.float32)})
    np.testing.assert_allclose(outputs["a_grad"], expected["a_grad"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outputs["bias_grad"], dy.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)
    direction, h = rng.standard_normal(a.shape), 1e-2  # float64 central difference of <dy, y(a)>
    loss = lambda x: float((dy.astype(np.float64) * _run(model, {"a": x.astype(np.float32)})["y"]).sum())
    slope = (loss(a + h * direction) - loss(a - h * direction)) / (2 * h)
    assert slope == pytest.approx(float((outputs["a_grad"] * direction).sum()), rel=1e-3)


def test_g_idx_groups():
    model, weight, _ = matmul_nbits_model((3, 64), 8, 4, 16, "float")
    g_idx = np.random.default_rng(3).permutation(np.repeat(np.arange(4), 16)).astype(np.int32)
    # the same weight, with column k read through group g_idx[k]: scales/zp per (n, g_idx[k])
    scales = onh.to_array(next(t for t in model.graph.initializer if t.name == "w_scales")).reshape(8, 4)
    zp = onh.to_array(next(t for t in model.graph.initializer if t.name == "w_zp")).reshape(8, 4)
    q = weight / np.repeat(scales, 16, axis=1) + np.repeat(zp, 16, axis=1)
    regrouped = (q - zp[:, g_idx]) * scales[:, g_idx].astype(np.float64)
    model.graph.initializer.append(onh.from_array(g_idx, "g_idx"))
    node = model.graph.node[0]
    node.input.append("g_idx")
    rng = np.random.default_rng(4)
    a, dy = rng.standard_normal((3, 64)).astype(np.float32), rng.standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(model, {"a": a})["y"], a @ regrouped.T, rtol=1e-4, atol=1e-4)
    outputs, _ = _gradients(model, a, dy)
    np.testing.assert_allclose(outputs["a_grad"], dy.astype(np.float64) @ regrouped, rtol=1e-4, atol=1e-4)


def test_other_bit_widths_are_refused_by_name():
    model, _, _ = matmul_nbits_model((3, 64), 8, 4, 16)
    for attribute in model.graph.node[0].attribute:
        if attribute.name == "bits":
            attribute.i = 2
    with pytest.raises(UnsupportedOperatorError, match="bits=2"):
        build_training_graph(model)


def test_onnxruntime_keeps_no_float_copy_of_the_weight(tmp_path):
    """The dequantization reads a run-time value: onnxruntime's constant folding cannot turn
    it into a float32 initializer of the whole weight (kept for the session's lifetime)."""
    model, _, _ = matmul_nbits_model((4, 64), 40, 4, 16)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(build_training_graph(model).model.SerializeToString(), options,
                         providers=["CPUExecutionProvider"])
    optimized = onnx.load(options.optimized_model_filepath)
    sizes = [int(np.prod(t.dims)) for t in optimized.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    assert max(sizes) < 40 * 64 // 2, sizes


@pytest.mark.parametrize("zero_points,g_idx", [(None, False), ("uint8", False), ("float", False), ("float", True)])
def test_a_large_weight_is_dequantized_in_chunks_of_rows(monkeypatch, zero_points, g_idx):
    """Past ROWS_ELEMENTS values per part (here 5 rows of 32: 24 rows in 5 chunks, the last of
    4), dA is summed over chunks of rows: still dY @ dequant(B) in float64."""
    from normgrad.graphs.rules import matmul_nbits

    monkeypatch.setattr(matmul_nbits, "ROWS_ELEMENTS", 5 * 32)
    model, weight, _ = matmul_nbits_model((3, 64), 24, 4, 16, zero_points)
    if g_idx:  # groups by column: the same weight when g_idx[k] = k // block_size
        model.graph.initializer.append(onh.from_array(np.repeat(np.arange(4), 16).astype(np.int32), "g_idx"))
        model.graph.node[0].input.extend([""] * (4 - len(model.graph.node[0].input)) + ["g_idx"])
    rng = np.random.default_rng(5)
    a, dy = rng.standard_normal((3, 64)).astype(np.float32), rng.standard_normal((3, 24)).astype(np.float32)
    outputs, training = _gradients(model, a, dy)
    assert sum(n.op_type == "MatMul" for n in training.model.graph.node) == 5 * 2  # 5 chunks, 2 parts each
    np.testing.assert_allclose(outputs["a_grad"], dy.astype(np.float64) @ weight, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits, block_size, zero_points", [(4, 16, None), (4, 32, "uint8"), (4, 16, "float"),
                                                           (8, 32, None), (8, 16, "uint8")])
def test_dequantizing_a_node_gives_the_weight_it_was_packed_from(bits, block_size, zero_points):
    """The tests' NumPy dequantization of a MatMulNBits node (used for genai models) unpacks
    exactly what the packer packed, K not a multiple of the block."""
    model, weight, _ = matmul_nbits_model((2, 40), 24, bits, block_size, zero_points)
    initializers = {t.name: onh.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(dequantize_matmul_nbits(model.graph.node[0], initializers), weight)
