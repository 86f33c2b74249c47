"""SiLUGrad, GeluGrad, GeluTanhGrad: the gradient of an elementwise activation in one pass.

dx = dy * f'(x), f' computed from x (the forward's sigmoid, erf or tanh recomputed inside):
one read of dy and x, one write of dx, where the standard-op gradient takes four to ten
passes. One operator per activation (an ONNX function body cannot switch on an attribute,
and every runtime without normgrad's kernels runs the bodies), one table of them here, one
C++ kernel with a switch (ops/cpp/activation_grad*.{cc,h}).

    silu(x)      = x s(x),  s = sigmoid:        f' = s + x s (1 - s)
    gelu(x)      = x Phi(x) (erf):              f' = Phi(x) + x phi(x)
    gelu_tanh(x) = x sigmoid(2u) (= x (1 + tanh u) / 2),  u = sqrt(2/pi) (x + 0.044715 x^3):
                                                f' = s + 2 x u' s (1 - s),  s = sigmoid(2u)

Phi and phi are the standard normal distribution and density; at x = +-inf f' is its limit,
1 or 0 (dx is then dy or 0 * dy), and a NaN x gives a NaN dx.

Inputs:
    dy (float32): the gradient of the activation's output.
    x (float32): the activation's input; dy's shape.

Output (float32, x's shape): dx.

The function bodies are the standard-op gradients the graph builder wrote before the
operators (:func:`standard_form`), so ``--inline`` graphs and runtimes without the kernels
compute what they did: SiLU's node by node (the Mul's and the Sigmoid's rules), GELU's as
``normgrad.graphs.patterns.gelu_erf_chain`` wrote it, the tanh GELU's as the Gelu rule
writes it. Those forms are float32 arithmetic of the textbook formulas (1 + erf and 1 - t^2
cancel in the tails); the kernels follow the float64 reference to a few float32 ulps of the
terms' magnitude everywhere.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, NamedTuple, Optional

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError

__all__ = ["ACTIVATIONS", "OPERATORS", "TANH_GELU_CUBIC", "Result", "ActivationGradOperator", "derivative",
           "body_writer", "sigmoid", "erfc", "standard_form", "gelu_erf_slope_form"]

TANH_GELU_CUBIC = 0.044715
"""The cubic coefficient of the tanh GELU (torch's, transformers' NewGELU)."""
ACTIVATIONS = {"silu": "SiLUGrad", "gelu_erf": "GeluGrad", "gelu_tanh": "GeluTanhGrad"}
"""Each activation's operator type."""

INPUTS = ("dy", "x")
OUTPUTS = ("dx",)


class Result(NamedTuple):
    """The output."""

    dx: np.ndarray


def _sigmoid_parts(v: np.ndarray):
    """(sigmoid(v), sigmoid(-v)), neither by subtraction from 1 (float64 NumPy)."""
    e = np.exp(-np.abs(v))
    big, small = 1.0 / (1.0 + e), e / (1.0 + e)
    return np.where(v >= 0, big, small), np.where(v >= 0, small, big)


def sigmoid(v: np.ndarray) -> np.ndarray:
    """sigmoid(v) in float64 NumPy."""
    return _sigmoid_parts(np.asarray(v, np.float64))[0]


def erfc(values: np.ndarray) -> np.ndarray:
    """erfc elementwise in float64 NumPy (math.erfc: accurate in the tails)."""
    return np.frompyfunc(math.erfc, 1, 1)(values).astype(np.float64)


def derivative(activation: str, x: np.ndarray) -> np.ndarray:
    """f'(x) in float64 NumPy: the truth the kernels are tested against."""
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        if activation == "gelu_erf":
            density = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
            slope = 0.5 * erfc(-x / math.sqrt(2.0)) + np.where(density == 0, 0.0, x * density)
        else:
            if activation == "silu":
                v, scale = x, x
            else:
                c = math.sqrt(2 / math.pi)
                v = 2 * c * (x + TANH_GELU_CUBIC * x**3)
                scale = 2 * c * x * (1 + 3 * TANH_GELU_CUBIC * x * x)
            s, one_minus_s = _sigmoid_parts(v)
            spread = s * one_minus_s
            slope = s + np.where(spread == 0, 0.0, scale * spread)
    return np.where(np.isnan(x), np.nan, slope)


def standard_form(activation: str, op: Callable, scalar: Callable, dy: str, x: str,
                  known: Optional[Dict[str, str]] = None) -> str:
    """dx in standard ONNX ops, as the graph builder writes it without the operator.

    Args:
        op: ``op(op_type, *inputs) -> output name`` appends a default-domain node.
        scalar: ``scalar(value) -> name`` of a constant of x's type.
        known: forward values the graph already has, which are read instead of recomputed:
            silu ``sigmoid``; gelu_erf ``scaled`` (x / sqrt(2)) and ``cdf`` (Phi(x)) or
            ``twice_cdf`` (1 + erf(x / sqrt(2))), with ``root2`` the forward's sqrt(2) value.
    """
    known = dict(known or {})
    if activation == "silu":
        s = known.get("sigmoid") or op("Sigmoid", x)
        through_sigmoid = op("Mul", op("Mul", dy, x), op("Mul", s, op("Sub", scalar(1.0), s)))
        return op("Sum", op("Mul", dy, s), through_sigmoid)
    if activation == "gelu_erf":
        return op("Mul", dy, gelu_erf_slope_form(op, scalar, x, known))
    if activation == "gelu_tanh":
        square = op("Mul", x, x)
        inner = op("Mul", scalar(math.sqrt(2 / math.pi)), op("Add", x, op("Mul", scalar(TANH_GELU_CUBIC), op("Mul", square, x))))
        t = op("Tanh", inner)
        slope = op("Mul", scalar(math.sqrt(2 / math.pi)),
                   op("Add", scalar(1.0), op("Mul", scalar(3 * TANH_GELU_CUBIC), square)))
        one_minus_square = op("Sub", scalar(1.0), op("Mul", t, t))
        local = op("Mul", scalar(0.5), op("Add", op("Add", scalar(1.0), t), op("Mul", x, op("Mul", one_minus_square, slope))))
        return op("Mul", dy, local)
    raise ValueError(f"unknown activation {activation!r}; known: {sorted(ACTIVATIONS)}")


def gelu_erf_slope_form(op: Callable, scalar: Callable, x: str, known: Optional[Dict[str, str]] = None) -> str:
    """The erf GELU's f'(x) = Phi(x) + x phi(x) in standard ONNX ops (:func:`standard_form`'s
    arguments): Phi(x) = (1 + erf(x / sqrt 2)) / 2, x phi(x) = x exp(log(1 / sqrt(2 pi)) - (x / sqrt 2)^2)."""
    known = dict(known or {})
    scaled = known.get("scaled") or op("Div", x, known.get("root2") or scalar(math.sqrt(2.0)))
    cdf = known.get("cdf")
    if cdf is None:
        twice_cdf = known.get("twice_cdf") or op("Add", op("Erf", scaled), scalar(1.0))
        cdf = op("Mul", twice_cdf, scalar(0.5))
    density = op("Exp", op("Sub", scalar(math.log(1 / math.sqrt(2 * math.pi))), op("Mul", scaled, scaled)))
    return op("Add", cdf, op("Mul", x, density))


def body_writer():
    """(nodes, op, scalar): a node list and the ``op`` and ``scalar`` writers
    :func:`standard_form` takes, appending to it (float32 constants), for function bodies."""
    nodes = []

    def op(op_type: str, *inputs: str) -> str:
        output = f"t{len(nodes)}"
        nodes.append(oh.make_node(op_type, list(inputs), [output]))
        return output

    def scalar(value: float) -> str:
        output = f"t{len(nodes)}"
        nodes.append(oh.make_node("Constant", [], [output], value=onh.from_array(np.array(value, np.float32))))
        return output

    return nodes, op, scalar


class ActivationGradOperator:
    """One activation's operator, with the attributes ``normgrad.ops`` reads of an operator
    module (see ``normgrad.ops.OPERATORS``)."""

    INPUTS = INPUTS
    OUTPUTS = OUTPUTS
    ATTRIBUTES: dict = {}
    OUTPUT_SHAPE_FROM = {"dx": ("x", None)}
    Result = Result

    def __init__(self, activation: str):
        self.activation = activation
        self.OP_TYPE = ACTIVATIONS[activation]
        self.__doc__ = __doc__

    def __repr__(self) -> str:
        return f"<normgrad operator {self.OP_TYPE} ({self.activation})>"

    def validate(self, dy, x):
        """(dy, x) as arrays after checking them against the contract (float64 is accepted
        for float64 checks of whole graphs).

        Raises:
            NormgradInputError: naming the offending input and the rule it broke.
        """
        x = np.asarray(x)
        if x.dtype not in (np.float32, np.float64):
            raise NormgradInputError(f"{self.OP_TYPE}: input 'x' must be float32; got {x.dtype}")
        dy = np.asarray(dy)
        _common.check_same_shape(self.OP_TYPE, "dy", dy, "x", x)
        return dy, x

    def reference(self, dy, x) -> Result:
        """dy * f'(x) in float64, returned in x's dtype."""
        dy, x = self.validate(dy, x)
        with np.errstate(invalid="ignore", over="ignore"):
            return Result((dy.astype(np.float64) * derivative(self.activation, x)).astype(x.dtype))

    def schema(self):
        """The ONNX schema, with type and shape inference."""
        from onnx.defs import OpSchema

        param = OpSchema.FormalParameter
        names = {"silu": "SiLU", "gelu_erf": "erf GELU", "gelu_tanh": "tanh GELU"}
        inputs = [param("dy", "T", f"The gradient of the {names[self.activation]} output."),
                  param("x", "T", f"The {names[self.activation]} input; dy's shape.")]
        outputs = [param("dx", "T", "dy * f'(x); x's shape.")]

        def infer(ctx) -> None:
            x_type = _common.input_tensor_type(ctx, 1)
            if x_type is not None:
                ctx.set_output_type(0, _common.make_output_type(x_type.elem_type, _common.known_dims(x_type)))

        return _common.make_schema(self.OP_TYPE, __doc__, inputs, outputs, {"T": "float32."}, infer,
                                   types=("tensor(float)",))

    def function_body(self, opset: int = _common.ONNX_OPSET) -> onnx.FunctionProto:
        """:func:`standard_form` as an ONNX function (float32 constants)."""
        nodes, op, scalar = body_writer()
        dx = standard_form(self.activation, op, scalar, "dy", "x")
        nodes.append(oh.make_node("Identity", [dx], ["dx"]))
        return oh.make_function(_common.DOMAIN, self.OP_TYPE, list(INPUTS), list(OUTPUTS), nodes,
                                [oh.make_opsetid("", opset)])


OPERATORS = tuple(ActivationGradOperator(activation) for activation in ACTIVATIONS)
"""The operators, in :data:`ACTIVATIONS` order."""
