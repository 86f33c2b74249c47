"""DropoutMask: the keep-mask of one seeded Dropout node, drawn from the node's key.

The step graphs replace every training-mode Dropout by a mask that is a function of (seed,
step, micro-batch, node, element) (``normgrad.graphs.rewrites.seed_dropout``). The key chain
(seed, step, micro-batch -> one odd key per Dropout node) is a few scalar standard ops in the
graph; this operator draws the node's mask from its key, one integer hash per element. Its
function body is the generator in standard ops, exact in 32-bit integer arithmetic, so every
runtime (OpenVINO computes int64 in 32 bits, tract has no int64 Square) draws the same masks;
the C++ and Python kernels compute the same integers directly.

The generator: Widynski's counter-based "squares" on 30-bit words (all arithmetic mod
2**30), for a counter c under a key k:

    y = c * k;  z = y + k
    x = rot(y * y + y);  x = rot(x * x + z);  x = rot(x * x + y);  squares(c, k) = x * x + z

where rot swaps the two 15-bit halves of a word. Element e of ``data`` (row-major, taken mod
2**30) is kept when the top 24 bits of squares(e, key), divided by 2**24 (exact in float32),
are >= ``ratio``: probability 1 - ratio.

Inputs:
    data (float, float16, bfloat16 or double): the Dropout's input; only its shape is read.
    ratio (float32): one element; the drop probability.
    key_high (int32): one element; the high 15-bit limb of the node's 30-bit key.
    key_low (int32): one element; its low 15-bit limb.

Output (bool, shape of ``data``): mask, true where the element is kept.

``data`` has fewer than 2**31 elements (the body counts elements in int32); each limb is in
[0, 2**15).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_SHAPE_FROM", "INPUT_DTYPES", "OUTPUT_DTYPES",
           "LIMB_BITS", "LIMB", "WORD_BITS", "UNIFORM_BITS", "Result", "Emitter", "squares", "validate", "reference",
           "schema", "function_body"]

OP_TYPE = "DropoutMask"
INPUTS = ("data", "ratio", "key_high", "key_low")
OUTPUTS = ("mask",)
ATTRIBUTES: dict = {}
OUTPUT_SHAPE_FROM = {"mask": ("data", None)}
INPUT_DTYPES = {"ratio": np.dtype(np.float32), "key_high": np.dtype(np.int32), "key_low": np.dtype(np.int32)}
"""The element types of the inputs that are not float data (the Python kernels declare them)."""
OUTPUT_DTYPES = {"mask": np.dtype(np.bool_)}

LIMB_BITS = 15
"""Words are 30 bits held as two 15-bit limbs in int32 by the function body: every product
and sum stays below 2**31."""
LIMB = 1 << LIMB_BITS
WORD_BITS = 2 * LIMB_BITS
UNIFORM_BITS = 24
"""Bits of each element's uniform number: float32 holds them exactly."""
MAX_ELEMENTS = 2**31 - 1
_WORD = (1 << WORD_BITS) - 1


class Result(NamedTuple):
    """The output."""

    mask: np.ndarray


def squares(counter, key) -> np.ndarray:
    """squares(counter, key) of the module docstring, elementwise, in uint64 NumPy."""
    counter, key = np.asarray(counter, np.uint64) & _WORD, np.uint64(int(key) & _WORD)
    word, half = np.uint64(_WORD), np.uint64(LIMB_BITS)
    rotate = lambda v: ((v & np.uint64(LIMB - 1)) << half) | (v >> half)  # noqa: E731
    y = counter * key & word
    z = (y + key) & word
    x = rotate((y * y + y) & word)
    x = rotate((x * x + z) & word)
    x = rotate((x * x + y) & word)
    return (x * x + z) & word


class Emitter:
    """Appends default-domain nodes with fresh names under one prefix: the generator's words
    as (high, low) pairs of 15-bit int32 limbs, exact where a runtime computes integers in
    32 bits (``normgrad.graphs.rewrites.seed_dropout`` draws the node keys with it too)."""

    def __init__(self, prefix: str):
        self.prefix, self.nodes, self._count = prefix, [], 0

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}/{hint}{self._count}"

    def const(self, value, dtype=np.int64) -> str:
        name = self._name("c")
        self.nodes.append(oh.make_node("Constant", [], [name], value=onh.from_array(np.asarray(value, dtype))))
        return name

    def op(self, op_type: str, *inputs: str, output: str = None, **attributes) -> str:
        output = output or self._name(op_type.lower())
        self.nodes.append(oh.make_node(op_type, list(inputs), [output], **attributes))
        return output

    def divmod(self, value: str, limb: str, quotient: bool = True) -> tuple:
        """(value div 2**15 or None, value mod 2**15), floor division, of an integer tensor.
        Exact where Div and Mod alone are not: OpenVINO computes int32 Div and Mod (and casts
        and shifts) in float32, off past 2**24, so its quotient may be 1 off; the remainder is
        then taken of a value below 3 * 2**15, and the quotient divides an exact multiple of
        2**15 (truncating and flooring Div agree on it)."""
        rough = self.op("Sub", value, self.op("Mul", self.op("Div", value, limb), limb))
        remainder = self.op("Mod", self.op("Add", rough, limb), limb)
        if not quotient:
            return None, remainder
        return self.op("Div", self.op("Sub", value, remainder), limb), remainder

    def limbs(self, value: str, count: int) -> list:
        """The ``count`` low 15-bit limbs of an int64 tensor (floor remainders)."""
        limb, found = self.const(LIMB), []
        for _ in range(count):
            value, remainder = self.divmod(value, limb)
            found.append(remainder)
        return found

    def carry(self, low: str, high: str, limb: str) -> tuple:
        """(high + low div 2**15) mod 2**15, low mod 2**15: a word from unnormalized limbs."""
        carry, low = self.divmod(low, limb)
        return self.divmod(self.op("Add", high, carry), limb, quotient=False)[1], low

    def squares(self, counter: tuple, key: tuple) -> tuple:
        """:func:`squares` for each element of the word ``counter`` under the word ``key``."""
        limb = self.const(LIMB, np.int32)

        def times(a, b):  # a * b mod 2**30
            low = self.op("Mul", a[1], b[1])
            cross = self.op("Add", self.op("Mul", a[0], b[1]), self.op("Mul", a[1], b[0]))
            return self.carry(low, cross, limb)

        def plus(a, b):  # a + b mod 2**30
            return self.carry(self.op("Add", a[1], b[1]), self.op("Add", a[0], b[0]), limb)

        def square_plus(a, b):  # a * a + b mod 2**30: 2 * high * low + carries stays below 2**31
            low = self.op("Add", self.op("Mul", a[1], a[1]), b[1])
            cross = self.op("Add", self.op("Mul", a[0], self.op("Add", a[1], a[1])), b[0])
            return self.carry(low, cross, limb)

        swap = lambda word: (word[1], word[0])  # noqa: E731  (rotation by 15 bits)
        y = times(counter, key)
        z = plus(y, key)
        x = swap(square_plus(y, y))
        x = swap(square_plus(x, z))
        x = swap(square_plus(x, y))
        return square_plus(x, z)

    def odd(self, word: tuple) -> tuple:
        low = word[1]
        return word[0], self.op("Add", self.op("Sub", low, self.op("Mod", low, self.const(2, np.int32))),
                                self.const(1, np.int32))

    def split(self, value: str, count: int) -> list:
        """The ``count`` elements of the 1-D ``value``, each of shape [1]."""
        if count == 1:
            return [value]
        parts = [self._name("part") for _ in range(count)]
        self.nodes.append(oh.make_node("Split", [value, self.const([1] * count)], parts, axis=0))
        return parts

    def word_const(self, value: int) -> tuple:
        return self.const(value >> LIMB_BITS, np.int32), self.const(value & (LIMB - 1), np.int32)

    def mask(self, data: str, ratio: str, key: tuple, output: str) -> str:
        """The operator: ``output`` = the keep-mask of ``data``'s shape under the word ``key``."""
        count = self.op("Cast", self.op("Size", data), to=onnx.TensorProto.INT32)
        elements = self.op("Range", self.const(0, np.int32), count, self.const(1, np.int32))
        limb = self.const(LIMB, np.int32)
        high, low = self.divmod(elements, limb)
        counter = (self.op("Mod", high, limb), low)  # high < 2**16: exact
        high, low = self.squares(counter, key)
        dropped_bits = WORD_BITS - UNIFORM_BITS
        drawn = self.op("Add", self.op("Mul", high, self.const(1 << (LIMB_BITS - dropped_bits), np.int32)),
                        self.op("Div", low, self.const(1 << dropped_bits, np.int32)))
        uniform = self.op("Mul", self.op("Cast", drawn, to=onnx.TensorProto.FLOAT),
                          self.const(2.0 ** -UNIFORM_BITS, np.float32))
        # allowzero: a 0 in data's shape is a 0 (main's graphs before the operator, without it,
        # failed on an empty data with more than one axis)
        uniform = self.op("Reshape", uniform, self.op("Shape", data), allowzero=1)
        return self.op("GreaterOrEqual", uniform, ratio, output=output)


def _one_element(name: str, value, dtype: np.dtype) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype != dtype:
        raise NormgradInputError(f"{OP_TYPE}: input '{name}' must be {dtype}; got {array.dtype}")
    if array.size != 1:
        raise NormgradInputError(f"{OP_TYPE}: input '{name}' must have one element; got shape {list(array.shape)}")
    return array.reshape(())


def validate(data, ratio, key_high, key_low) -> dict:
    """Checks the inputs against the contract: {input name: array}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    data = np.asarray(data)
    if not _common.is_float_dtype(data.dtype):
        raise NormgradInputError(f"{OP_TYPE}: input 'data' must be float32, float16, bfloat16 or double; "
                                 f"got {data.dtype}")
    if data.size > MAX_ELEMENTS:
        raise NormgradInputError(f"{OP_TYPE}: input 'data' must have fewer than 2**31 elements; got {data.size}")
    arrays = {"data": data}
    # float64 ratio only where a float64 check evaluates the whole graph in float64
    ratio_array = np.asarray(ratio)
    arrays["ratio"] = _one_element("ratio", ratio, ratio_array.dtype if ratio_array.dtype == np.float64
                                   else INPUT_DTYPES["ratio"])
    for name, value in (("key_high", key_high), ("key_low", key_low)):
        limb = _one_element(name, value, INPUT_DTYPES[name])
        if not 0 <= int(limb) < LIMB:
            raise NormgradInputError(f"{OP_TYPE}: input '{name}' must be a 15-bit limb in [0, 2**15); got {int(limb)}")
        arrays[name] = limb
    return arrays


def reference(data, ratio, key_high, key_low) -> Result:
    """The operator in NumPy integer arithmetic (exact): what the C++ kernel computes."""
    arrays = validate(data, ratio, key_high, key_low)
    key = (int(arrays["key_high"]) << LIMB_BITS) | int(arrays["key_low"])
    drawn = squares(np.arange(arrays["data"].size, dtype=np.uint64), key) >> np.uint64(WORD_BITS - UNIFORM_BITS)
    uniform = drawn.astype(np.float64) * 2.0 ** -UNIFORM_BITS  # exact: below 2**24
    return Result((uniform >= np.float64(arrays["ratio"])).reshape(arrays["data"].shape))


def _infer(ctx) -> None:
    data_type = _common.input_tensor_type(ctx, 0)
    ctx.set_output_type(0, _common.make_output_type(onnx.TensorProto.BOOL, _common.known_dims(data_type)))


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    inputs = [param("data", "T", "The Dropout's input; only its shape is read."),
              param("ratio", "F", "One element: the drop probability."),
              param("key_high", "I", "One element: the high 15-bit limb of the node's key."),
              param("key_low", "I", "One element: the low 15-bit limb of the node's key.")]
    outputs = [param("mask", "B", "True where the element is kept; shape of data.")]
    return _common.make_schema(OP_TYPE, __doc__, inputs, outputs,
                               {"T": (_common.FLOAT_TYPES + ("tensor(double)",), "The data's type."),
                                "F": (("tensor(float)",), "float32."), "I": (("tensor(int32)",), "int32."),
                                "B": (("tensor(bool)",), "bool.")}, _infer)


def function_body(opset: int = _common.ONNX_OPSET) -> onnx.FunctionProto:
    """The operator in standard ONNX integer ops (see :class:`Emitter`)."""
    emit = Emitter("m")
    emit.mask("data", "ratio", ("key_high", "key_low"), "mask")
    return oh.make_function(_common.DOMAIN, OP_TYPE, list(INPUTS), list(OUTPUTS), emit.nodes,
                            [oh.make_opsetid("", opset)])
