"""GeluWithSlope: the exact (erf) GELU and its derivative in one pass, so its gradient is one Mul.

    y     = x Phi(x)                (torch's gelu, approximate="none")
    slope = Phi(x) + x phi(x)       (y's derivative)

Phi and phi are the standard normal distribution and density. The forward and GeluGrad
(:mod:`normgrad.ops.activation_grad`) compute the same erf and exp: computing both in the
forward's one read of x, the backward becomes ``Mul(dy, slope)``, a memory pass, instead of
GeluGrad's second round of that math. The graph builder writes this operator in place of a
float32 erf GELU (the exporters' Div, Erf, Add, Mul, Mul chain and opset 20's Gelu with
approximate="none": ``normgrad.graphs.rewrites.gelu_erf_slopes``).

The C++ kernel's slope is GeluGrad's f'(x) bitwise (so ``Mul(dy, slope)`` is GeluGrad's dx);
y is within 2 float32 ulps of the float64 x Phi(x) (subnormal results within 1 ulp of the
subnormal spacing). At x = +inf y is +inf and the slope 1; at x = -inf y is NaN (-inf times
0, as torch's gelu) and the slope 0; a NaN x gives NaN for both; y keeps x's sign (-0.0 at
x = -0.0 and where x Phi(x) underflows).

Input:
    x (float32): the GELU's input.

Outputs (float32, x's shape): y, slope.

The function body is the standard-op form: y as the TorchScript exporter's chain (Div, Erf,
Add, Mul, Mul; the order onnxruntime fuses into its Gelu kernel) and the slope as GeluGrad's
body writes f' (:func:`normgrad.ops.activation_grad.gelu_erf_slope_form`), reading the chain's
x / sqrt 2 and 1 + erf: ``--inline`` and portable graphs compute the forward they did.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Tuple

import numpy as np
import onnx
import onnx.helper as oh

import normgrad.ops._common as _common
import normgrad.ops.activation_grad as activation_grad
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_SHAPE_FROM", "Result", "validate", "reference",
           "standard_form", "schema", "function_body"]

OP_TYPE = "GeluWithSlope"
INPUTS = ("x",)
OUTPUTS = ("y", "slope")
ATTRIBUTES: dict = {}
OUTPUT_SHAPE_FROM = {"y": ("x", None), "slope": ("x", None)}


class Result(NamedTuple):
    """The outputs."""

    y: np.ndarray
    slope: np.ndarray


def validate(x) -> dict:
    """Checks the input against the contract (float64 is accepted for float64 checks of whole
    graphs): {input name: array}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float64):
        raise NormgradInputError(f"{OP_TYPE}: input 'x' must be float32; got {x.dtype}")
    return {"x": x}


def reference(x) -> Result:
    """x Phi(x) and its derivative in float64, returned in x's dtype."""
    x = validate(x)["x"]
    x64 = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        y = x64 * (0.5 * activation_grad.erfc(-x64 / math.sqrt(2.0)))
    return Result(y.astype(x.dtype), activation_grad.derivative("gelu_erf", x64).astype(x.dtype))


def standard_form(op: Callable, scalar: Callable, x: str) -> Tuple[str, str]:
    """(y, slope) in standard ONNX ops: the TorchScript exporter's GELU chain, and f' reading
    its x / sqrt 2 and 1 + erf (``op`` and ``scalar`` as
    :func:`normgrad.ops.activation_grad.standard_form`'s)."""
    root2 = scalar(math.sqrt(2.0))
    scaled = op("Div", x, root2)
    twice_cdf = op("Add", op("Erf", scaled), scalar(1.0))
    y = op("Mul", op("Mul", x, twice_cdf), scalar(0.5))
    slope = activation_grad.gelu_erf_slope_form(op, scalar, x, {"scaled": scaled, "twice_cdf": twice_cdf,
                                                                  "root2": root2})
    return y, slope


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    inputs = [param("x", "T", "The GELU's input.")]
    outputs = [param("y", "T", "x Phi(x); x's shape."),
               param("slope", "T", "Phi(x) + x phi(x), y's derivative; x's shape.")]
    return _common.make_schema(OP_TYPE, __doc__, inputs, outputs, {"T": "float32."},
                               _common.outputs_like_input(0, 2), types=("tensor(float)",))


def function_body(opset: int = _common.ONNX_OPSET) -> onnx.FunctionProto:
    """:func:`standard_form` as an ONNX function (float32 constants)."""
    nodes, op, scalar = activation_grad.body_writer()
    y, slope = standard_form(op, scalar, "x")
    nodes += [oh.make_node("Identity", [y], ["y"]), oh.make_node("Identity", [slope], ["slope"])]
    return oh.make_function(_common.DOMAIN, OP_TYPE, list(INPUTS), list(OUTPUTS), nodes,
                            [oh.make_opsetid("", opset)])
