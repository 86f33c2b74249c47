"""Block-quantized weights packed as onnxruntime's MatMulNBits reads them, their float64
dequantization (NumPy, independent of the rule; the bench's torch side uses it too), and
one-node MatMulNBits models."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.ops import IR_VERSION
from normgrad.tools._matmul_nbits import dequantize_matmul_nbits  # noqa: F401  (the tests' float64 truth)


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """``bits``-bit values along the last axis packed into bytes, low bits first."""
    if bits == 8:
        return values.astype(np.uint8)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def quantized_weight(rng, n: int, k: int, bits: int, block_size: int, zero_points: Optional[str]):
    """Random packed B [N, blocks, blob], scales [N * blocks], zero points (None, "uint8" packed
    or "float") and the float64 weight [N, K] they stand for: (q - zp) * scale per block."""
    blocks = -(-k // block_size)
    q = rng.integers(0, 2 ** bits, (n, blocks, block_size))
    scales = (rng.uniform(0.5, 1.5, (n, blocks)) * rng.choice([-1, 1], (n, blocks)) / 2 ** bits).astype(np.float32)
    if zero_points is None:
        zp, zp_tensor = np.full((n, blocks), 2 ** (bits - 1)), None
    elif zero_points == "uint8":
        per_row = -(-blocks * bits // 8)
        zp = rng.integers(0, 2 ** bits, (n, per_row * 8 // bits))
        zp_tensor = _pack(zp, bits).reshape(-1)
        zp = zp[:, :blocks]
    else:
        zp = rng.uniform(0, 2 ** bits - 1, (n, blocks)).astype(np.float32)
        zp_tensor = zp.reshape(-1)
    weight = ((q - zp.astype(np.float64)[..., None]) * scales.astype(np.float64)[..., None]).reshape(n, -1)[:, :k]
    return _pack(q, bits), scales.reshape(-1), zp_tensor, weight


def matmul_nbits_model(a_shape: Tuple[int, ...], n: int, bits: int, block_size: int, zero_points: Optional[str] = None,
                       bias: bool = False, seed: int = 0) -> Tuple[onnx.ModelProto, np.ndarray, Dict[str, np.ndarray]]:
    """Y = MatMulNBits(a, B, scales[, zero_points][, bias]) (accuracy_level 0: float math);
    returns the model, the float64 weight [N, K] and the bias (when given) by name."""
    rng = np.random.default_rng(seed)
    k = a_shape[-1]
    packed, scales, zp, weight = quantized_weight(rng, n, k, bits, block_size, zero_points)
    inits = [onh.from_array(packed, "w_q"), onh.from_array(scales, "w_scales")]
    inputs = ["a", "w_q", "w_scales", "", "", ""]
    if zp is not None:
        inits.append(onh.from_array(zp, "w_zp"))
        inputs[3] = "w_zp"
    extra = {}
    if bias:
        extra["bias"] = rng.standard_normal(n).astype(np.float32)
        inits.append(onh.from_array(extra["bias"], "bias"))
        inputs[5] = "bias"
    while not inputs[-1]:
        inputs.pop()
    node = oh.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                        block_size=block_size, accuracy_level=0)
    graph = oh.make_graph([node], "matmul_nbits", [oh.make_tensor_value_info("a", onnx.TensorProto.FLOAT, a_shape)],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, (*a_shape[:-1], n))], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)],
                          ir_version=IR_VERSION)
    return model, weight, extra
