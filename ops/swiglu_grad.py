"""SwiGLUGrad: the gradient of a gated linear unit with SiLU, y = silu(gate) * up, in one pass.

Llama's and Mistral's MLP computes ``down(silu(gate(x)) * up(x))``; node by node the gradient
of the product and of SiLU is three passes over the activations (``dy * up``, ``dy *
silu(gate)``, then SiLUGrad). This operator reads dy, gate and up once and writes both
gradients, the sigmoid recomputed inside:

    dgate = (dy * up) * silu'(gate)     (bitwise SiLUGrad's dx for the gradient dy * up)
    dup   = dy * (gate * sigmoid(gate))

silu' is :func:`normgrad.ops.activation_grad.derivative`'s; a NaN gate gives NaN in both.

Inputs (float32, one shape):
    dy: the gradient of y.
    gate: the SiLU's input.
    up: the other factor.

Outputs (float32, gate's shape): dgate, dup.

The function body is the standard-op form: the product's gradients (two Muls) and SiLU's
(:func:`normgrad.ops.activation_grad.standard_form`), with silu(gate) recomputed from one
Sigmoid that both read, where the graph without the operator read the forward's values.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
import onnx.helper as oh

import normgrad.ops._common as _common
import normgrad.ops.activation_grad as activation_grad
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_SHAPE_FROM", "Result", "validate", "reference",
           "schema", "function_body"]

OP_TYPE = "SwiGLUGrad"
INPUTS = ("dy", "gate", "up")
OUTPUTS = ("dgate", "dup")
ATTRIBUTES: dict = {}
OUTPUT_SHAPE_FROM = {"dgate": ("gate", None), "dup": ("gate", None)}


class Result(NamedTuple):
    """The outputs."""

    dgate: np.ndarray
    dup: np.ndarray


def validate(dy, gate, up) -> dict:
    """Checks the inputs against the contract (float64 is accepted for float64 checks of
    whole graphs): {input name: array}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    gate = np.asarray(gate)
    if gate.dtype not in (np.float32, np.float64):
        raise NormgradInputError(f"{OP_TYPE}: input 'gate' must be float32; got {gate.dtype}")
    arrays = {"dy": np.asarray(dy), "gate": gate, "up": np.asarray(up)}
    for name in ("dy", "up"):
        if arrays[name].dtype != gate.dtype:
            raise NormgradInputError(f"{OP_TYPE}: input '{name}' must have gate's type {gate.dtype}; "
                                     f"got {arrays[name].dtype}")
        _common.check_same_shape(OP_TYPE, name, arrays[name], "gate", gate)
    return arrays


def reference(dy, gate, up) -> Result:
    """Both gradients in float64, returned in gate's dtype."""
    arrays = validate(dy, gate, up)
    dy64, gate64, up64 = (arrays[name].astype(np.float64) for name in INPUTS)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        dgate = dy64 * up64 * activation_grad.derivative("silu", gate64)
        dup = dy64 * (gate64 * activation_grad.sigmoid(gate64))
    dtype = arrays["gate"].dtype
    return Result(dgate.astype(dtype), dup.astype(dtype))


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    inputs = [param("dy", "T", "The gradient of y = silu(gate) * up."),
              param("gate", "T", "The SiLU's input."),
              param("up", "T", "The other factor; gate's shape.")]
    outputs = [param("dgate", "T", "(dy * up) * silu'(gate); gate's shape."),
               param("dup", "T", "dy * silu(gate); gate's shape.")]
    return _common.make_schema(OP_TYPE, __doc__, inputs, outputs, {"T": "float32."},
                               _common.outputs_like_input(1, 2), types=("tensor(float)",))


def function_body(opset: int = _common.ONNX_OPSET) -> onnx.FunctionProto:
    """The product's and SiLU's standard-op gradients, one Sigmoid shared (float32 constants)."""
    nodes, op, scalar = activation_grad.body_writer()
    sigmoid = op("Sigmoid", "gate")
    dup = op("Mul", "dy", op("Mul", "gate", sigmoid))
    dgate = activation_grad.standard_form("silu", op, scalar, op("Mul", "dy", "up"), "gate", {"sigmoid": sigmoid})
    nodes += [oh.make_node("Identity", [dgate], ["dgate"]), oh.make_node("Identity", [dup], ["dup"])]
    return oh.make_function(_common.DOMAIN, OP_TYPE, list(INPUTS), list(OUTPUTS), nodes,
                            [oh.make_opsetid("", opset)])
