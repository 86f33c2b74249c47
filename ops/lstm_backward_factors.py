"""LSTMBackwardFactors: the factors of an LSTM's backward steps, for every step at once, last step first.

The LSTM backward of ``normgrad.graphs.rules.recurrent`` runs its state-gradient recurrence in
a reverse Scan whose step is d_c = dc + dh a_c, d_pre = [d_c, dh, d_c, d_c] * factors,
dc' = d_c keep. Everything but the incoming gradients comes from what the forward kept (the
activated gates i, o, f, g, the cell states and act(c) = tanh(c) of every step), and is computed
for all steps before the Scan, for the default activations (Sigmoid, Tanh, Tanh), no peepholes
and no sequence_lens:

    a_i = g * (i (1 - i)),  a_o = act_c * (o (1 - o)),  a_f = c_prev * (f (1 - f)),
    a_g = i * (1 - g g),    a_c = o * (1 - act_c act_c),  keep = f,

with c_prev the cell state entering the step (c0 at step 0). As standard nodes that is fifteen
elementwise passes over [T, H, B], a Concat and Slices reversing the three in time (the Scan
runs forward over reversed sequences): 15 ms per layer of the benchmark LSTM (hidden 256,
batch 32, 128 steps, 1 thread). This operator reads the six inputs once and writes the three
outputs reversed. Every value is the same IEEE operation in the same order as in the standard
form (:func:`standard_form`, the function body), so the C++ kernel gives its bits.

Inputs (float32 or float64, one type):
    i, o, f, g: the activated gates of every step, [T, H, ...].
    cells: the cell state after every step, i's shape.
    act_c: tanh(cells), i's shape.
    c0: the initial cell state, i's shape without T.

Outputs (i's type), last step first:
    factors: [T, 4 H, ...], [a_i, a_o, a_f, a_g] along axis 1.
    a_c: i's shape.
    keep: f, i's shape.
"""

from __future__ import annotations

import functools
from typing import Callable, List, NamedTuple

import numpy as np
import onnx

import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_SHAPE_FROM", "Result", "validate", "reference",
           "gate_factors", "activation_slope", "standard_form", "schema", "function_body"]

OP_TYPE = "LSTMBackwardFactors"
INPUTS = ("i", "o", "f", "g", "cells", "act_c", "c0")
OUTPUTS = ("factors", "a_c", "keep")
ATTRIBUTES: dict = {}
OUTPUT_SHAPE_FROM = {"factors": ("i", None), "a_c": ("i", None), "keep": ("i", None)}
"""(The Python kernel's outputs when it rejects its input: NaN shaped like i.)"""
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class Result(NamedTuple):
    """The outputs."""

    factors: np.ndarray
    a_c: np.ndarray
    keep: np.ndarray


def validate(i, o, f, g, cells, act_c, c0) -> dict:
    """Checks the inputs against the contract: {input name: array}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    arrays = {name: np.asarray(value) for name, value in zip(INPUTS, (i, o, f, g, cells, act_c, c0))}
    gates = arrays["i"]
    if gates.dtype not in _DTYPES:
        raise NormgradInputError(f"{OP_TYPE}: input 'i' must be float32 or float64; got {gates.dtype}")
    if gates.ndim < 2:
        raise NormgradInputError(f"{OP_TYPE}: input 'i' must have rank >= 2 ([T, H, ...]); got shape "
                                 f"{list(gates.shape)}")
    for name in INPUTS[1:6]:
        _common.check_same_shape(OP_TYPE, name, arrays[name], "i", gates)
    c0 = arrays["c0"]
    if c0.shape != gates.shape[1:]:
        raise NormgradInputError(f"{OP_TYPE}: input 'c0' must have the shape of one step of 'i' "
                                 f"{list(gates.shape[1:])}; got {list(c0.shape)}")
    if c0.dtype != gates.dtype:
        raise NormgradInputError(f"{OP_TYPE}: input 'c0' must have the dtype of 'i' ({gates.dtype}); got {c0.dtype}")
    return arrays


def reference(i, o, f, g, cells, act_c, c0) -> Result:
    """The outputs from the formulas in float64, returned in i's dtype."""
    arrays = validate(i, o, f, g, cells, act_c, c0)
    i, o, f, g, cells, act_c, c0 = (arrays[name].astype(np.float64) for name in INPUTS)
    c_prev = np.concatenate([c0[None], cells[:-1]], axis=0)
    factors = np.concatenate([g * i * (1 - i), act_c * o * (1 - o), c_prev * f * (1 - f), i * (1 - g * g)], axis=1)
    a_c = o * (1 - act_c * act_c)
    dtype = arrays["i"].dtype
    return Result(factors[::-1].astype(dtype), a_c[::-1].astype(dtype), f[::-1].astype(dtype))


def gate_factors(op: Callable, i: str, o: str, f: str, g: str, c_prev: str, act_c: str,
                 slope_f: Callable[[str], str], slope_g: Callable[[str], str], slope_h: Callable[[str], str]
                 ) -> List[str]:
    """[a_i, a_o, a_f, a_g, a_c] in time order, for any activations: ``slope_f(y)`` is the gate
    activation's derivative at the input whose output is y (``slope_g``: the cell candidate's,
    ``slope_h``: the cell output's). The LSTM rule adds the peephole and sequence_lens terms to
    them where there are some; this operator's standard form is them for the default activations.

    Args:
        op: ``op(op_type, *inputs, **attributes) -> output name`` appends a default-domain node.
    """
    return [op("Mul", g, slope_f(i)), op("Mul", act_c, slope_f(o)), op("Mul", c_prev, slope_f(f)),
            op("Mul", i, slope_g(g)), op("Mul", o, slope_h(act_c))]


def activation_slope(op: Callable, activation: str, y: str, one: str) -> str:
    """The derivative of ``activation`` ("Sigmoid" or "Tanh") at the input whose output is ``y``,
    from y alone: y (1 - y) and 1 - y y (``one`` the constant 1 of y's type)."""
    if activation == "Sigmoid":
        return op("Mul", y, op("Sub", one, y))
    if activation == "Tanh":
        return op("Sub", one, op("Mul", y, y))
    raise ValueError(f"activation_slope: no slope from the output for activation {activation!r}")


def standard_form(op: Callable, i: str, o: str, f: str, g: str, cells: str, act_c: str, c0: str) -> List[str]:
    """[factors, a_c, keep] in standard ONNX ops (opset 15+).

    Args:
        op: ``op(op_type, *inputs, **attributes) -> output name`` appends a default-domain node.
    """
    def ints(*values: int) -> str:
        return op("Constant", value_ints=list(values))

    def reversed_in_time(value: str) -> str:
        return op("Slice", value, ints(-1), ints(-(2 ** 63)), ints(0), ints(-1))

    one = op("CastLike", op("Constant", value_float=1.0), i)
    sigmoid_slope = functools.partial(activation_slope, op, "Sigmoid", one=one)
    tanh_slope = functools.partial(activation_slope, op, "Tanh", one=one)
    c_prev = op("Concat", op("Unsqueeze", c0, ints(0)), op("Slice", cells, ints(0), ints(-1), ints(0)), axis=0)
    *per_gate, a_c = gate_factors(op, i, o, f, g, c_prev, act_c, sigmoid_slope, tanh_slope, tanh_slope)
    return [reversed_in_time(op("Concat", *per_gate, axis=1)), reversed_in_time(a_c), reversed_in_time(f)]


def _infer(ctx) -> None:
    gate_type = _common.input_tensor_type(ctx, 0)
    if gate_type is None:
        return
    dims = _common.known_dims(gate_type)
    if dims is not None and len(dims) < 2:
        raise NormgradInputError(f"{OP_TYPE}: input 'i' must have rank >= 2 ([T, H, ...]); got rank {len(dims)}")
    factors = None
    if dims is not None:
        factors = list(dims)
        factors[1] = 4 * dims[1] if isinstance(dims[1], int) else None
    ctx.set_output_type(0, _common.make_output_type(gate_type.elem_type, factors))
    for index in (1, 2):
        ctx.set_output_type(index, _common.make_output_type(gate_type.elem_type, dims))


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    inputs = [param("i", "T", "The input gate of every step, sigmoid-activated: [T, H, ...]."),
              param("o", "T", "The output gate; i's shape."), param("f", "T", "The forget gate; i's shape."),
              param("g", "T", "The cell candidate, tanh-activated; i's shape."),
              param("cells", "T", "The cell state after every step; i's shape."),
              param("act_c", "T", "tanh(cells); i's shape."), param("c0", "T", "The initial cell state: [H, ...].")]
    outputs = [param("factors", "T", "[a_i, a_o, a_f, a_g] along axis 1, last step first: [T, 4 H, ...]."),
               param("a_c", "T", "o (1 - act_c^2), last step first; i's shape."),
               param("keep", "T", "f, last step first; i's shape.")]
    return _common.make_schema(OP_TYPE, __doc__, inputs, outputs,
                               {"T": (("tensor(float)", "tensor(double)"), "float32 or float64.")}, _infer)


def function_body(opset: int = _common.ONNX_OPSET) -> onnx.FunctionProto:
    """:func:`standard_form` as an ONNX function."""
    return _common.function_of_standard_form(OP_TYPE, INPUTS, OUTPUTS, opset,
                                             lambda op: standard_form(op, *INPUTS))
