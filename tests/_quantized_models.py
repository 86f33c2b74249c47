"""Block-quantized weights packed as onnxruntime's MatMulNBits reads them, with their float64
dequantization written independently of the rule (NumPy), and one-node MatMulNBits models."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.ops import IR_VERSION


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


def dequantize_matmul_nbits(node: onnx.NodeProto, initializers: Dict[str, np.ndarray]) -> np.ndarray:
    """The float64 weight [N, K] a MatMulNBits node multiplies by (Y = A @ W^T), from its packed
    B [N, blocks, blob], scales [N * blocks] and zero points (packed uint8, float, or none:
    2^(bits-1)) in ``initializers`` (name: array)."""
    attributes = {a.name: oh.get_attribute_value(a) for a in node.attribute}
    k, n, bits, block_size = attributes["K"], attributes["N"], attributes["bits"], attributes["block_size"]
    blocks = -(-k // block_size)
    packed = initializers[node.input[1]].reshape(n, blocks, -1)
    if bits == 8:
        q = packed.astype(np.float64)
    else:
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, blocks, -1).astype(np.float64)
    scales = initializers[node.input[2]].astype(np.float64).reshape(n, blocks)
    zp_name = node.input[3] if len(node.input) > 3 else ""
    if not zp_name:
        zp = np.full((n, blocks), 2.0 ** (bits - 1))
    elif initializers[zp_name].dtype == np.uint8:
        stored = initializers[zp_name].reshape(n, -1)
        zp = (stored if bits == 8 else np.stack([stored & 0x0F, stored >> 4], -1).reshape(n, -1))[:, :blocks]
        zp = zp.astype(np.float64)
    else:
        zp = initializers[zp_name].astype(np.float64).reshape(n, blocks)
    return ((q - zp[..., None]) * scales[..., None]).reshape(n, -1)[:, :k]
