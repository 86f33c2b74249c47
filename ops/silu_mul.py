"""SiLUMul: Llama's gated unit y = silu(gate) * up = (gate * sigmoid(gate)) * up in one pass.

Llama's and Mistral's MLP computes ``down(silu(gate(x)) * up(x))``, which the exporters write
as Sigmoid, Mul(gate, sigmoid) and Mul(silu, up): onnxruntime fuses the first two into one
QuickGelu, then the product is a second pass with silu(gate) written and read again between
them. This operator reads gate and up once and writes y. The graph builder writes it in place
of that chain for float32 gate and up of one static shape
(``normgrad.graphs.rewrites.silu_products``); its gradient is ``SwiGLUGrad(dy, gate, up)``, which
recomputes the sigmoid (no intermediate is kept). The function body is the three standard
nodes, so ``--inline`` / ``--portable`` graphs compute what they did. (Not named SwiGLU: ONNX
opset 28's standard ``SwiGLU`` has that name, and ``onnx.reference`` needs op names unique
across domains.)

The C++ kernel's silu(gate) is SwiGLUGrad's bit for bit (activation_grad_math.h: one sigmoid
for both): y = dup of SwiGLUGrad for dy = up, within a few float32 ulps of the float64
``gate * sigmoid(gate) * up``. Special values are the formula's, as torch's
``F.silu(gate) * up``: gate = -inf gives NaN (-inf * 0), +inf gives ``inf * up``, -0.0 gives
``-0.0 * up``, NaN gives NaN.

Inputs (float32, one shape):
    gate: the SiLU's input.
    up: the other factor.

Output (float32, gate's shape): y.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import onnx

import normgrad.ops._common as _common
import normgrad.ops.activation_grad as activation_grad
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_SHAPE_FROM", "Result", "validate", "reference",
           "standard_form", "schema", "function_body"]

OP_TYPE = "SiLUMul"
INPUTS = ("gate", "up")
OUTPUTS = ("y",)
ATTRIBUTES: dict = {}
OUTPUT_SHAPE_FROM = {"y": ("gate", None)}


class Result(NamedTuple):
    """The output."""

    y: np.ndarray


def validate(gate, up) -> dict:
    """Checks the inputs against the contract (float64 is accepted for float64 checks of
    whole graphs): {input name: array}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    gate = np.asarray(gate)
    if gate.dtype not in (np.float32, np.float64):
        raise NormgradInputError(f"{OP_TYPE}: input 'gate' must be float32; got {gate.dtype}")
    up = np.asarray(up)
    _common.check_same_shape(OP_TYPE, "up", up, "gate", gate)
    return {"gate": gate, "up": up}


def reference(gate, up) -> Result:
    """(gate * sigmoid(gate)) * up in float64, returned in gate's dtype."""
    arrays = validate(gate, up)
    gate64, up64 = (arrays[name].astype(np.float64) for name in INPUTS)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        return Result(((gate64 * activation_grad.sigmoid(gate64)) * up64).astype(arrays["gate"].dtype))


def standard_form(op: Callable, gate: str, up: str) -> str:
    """y in standard ONNX ops, as the exporters write it: Sigmoid, Mul(gate, sigmoid), Mul(silu, up).

    Args:
        op: ``op(op_type, *inputs) -> output name`` appends a default-domain node.
    """
    return op("Mul", op("Mul", gate, op("Sigmoid", gate)), up)


def _infer(ctx) -> None:
    gate_type = _common.input_tensor_type(ctx, 0)
    if gate_type is not None:
        ctx.set_output_type(0, _common.make_output_type(gate_type.elem_type, _common.known_dims(gate_type)))


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    inputs = [param("gate", "T", "The SiLU's input."), param("up", "T", "The other factor; gate's shape.")]
    outputs = [param("y", "T", "(gate * sigmoid(gate)) * up; gate's shape.")]
    return _common.make_schema(OP_TYPE, __doc__, inputs, outputs, {"T": "float32."}, _infer,
                               types=("tensor(float)",))


def function_body(opset: int = _common.ONNX_OPSET) -> onnx.FunctionProto:
    """:func:`standard_form` as an ONNX function."""
    return _common.function_of_standard_form(OP_TYPE, INPUTS, OUTPUTS, opset,
                                             lambda op: [standard_form(op, "gate", "up")])
