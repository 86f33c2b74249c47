"""onnxruntime's MatMulNBits weights in NumPy: the float64 weight a node multiplies by, as its
kernel dequantizes it (the tests' reference and the bench's torch side)."""

from __future__ import annotations

from typing import Dict

import numpy as np
import onnx
import onnx.helper as oh


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
