"""RotateHalfEmbedding: the rotary position embedding of Llama and its relatives, and its transpose, in one pass.

    y = x * cos + r(x) * sin,        r(x) = [-x2, x1]       (transposed = 0)
    y = x * cos + r^T(x * sin),      r^T(z) = [z2, -z1]     (transposed = 1)

x1 and x2 are the two halves of x's last axis. transformers' Llama (Mistral, Qwen2, Gemma,
Phi-3, ...) applies the first to attention's queries and keys (``apply_rotary_pos_emb``,
``rotate_half``); torch's exporters write it as two Slices (or a Split), Neg, Concat, two
Muls and an Add: six passes over x. The graph builder writes this operator in their place
for a float32 x (``normgrad.graphs.rewrites.rotate_half_embeddings``); the gradient of x is
the same operator with ``transposed = 1`` applied to the incoming gradient (the
RotateHalfEmbedding rule).

Every element is computed with the float32 operations of the standard nodes in their order
(the two products, the negation, then the sum; no fused a*b+c): the forward is bitwise the
node-by-node graph's, and so is the transposed mode against the node-by-node gradient
(``dy * cos`` plus the Concat of the Split and negated halves of ``dy * sin``).

cos and sin need not have equal halves. They broadcast (NumPy rules) to x's shape with a
last axis equal to x's; the output has x's shape.

Inputs (float32):
    x: rank >= 1, its last axis even.
    cos, sin: broadcastable to x's shape, their last axis x's.

Attribute:
    transposed (int, default 0): 1 applies the transpose of the rotation (the gradient of x).

Output (float32, x's shape): y.

The function body is the standard-op form (Split, Neg, Concat, Mul, Mul, Add; transposed:
Mul, Split, Neg, Concat, Mul, Add).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import onnx
import onnx.helper as oh

import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "ATTRIBUTES_READ_UNLESS_DEFAULT", "OUTPUT_SHAPE_FROM", "Result",
           "validate", "reference", "shape_error", "x_error", "halves", "rotate_half", "standard_form", "schema",
           "function_body"]

OP_TYPE = "RotateHalfEmbedding"
INPUTS = ("x", "cos", "sin")
OUTPUTS = ("y",)
ATTRIBUTES = {"transposed": 0}
ATTRIBUTES_READ_UNLESS_DEFAULT = ("transposed",)
"""A graph with transposed nodes gets the body that reads the attribute (see :func:`function_body`)."""
OUTPUT_SHAPE_FROM = {"y": ("x", None)}
"""(The Python kernel's output when it rejects its input: NaN shaped like x.)"""


class Result(NamedTuple):
    """The output."""

    y: np.ndarray


def shape_error(name: str, shape, x_shape) -> str | None:
    """Why input ``name`` (cos or sin) of ``shape`` does not fit an x of ``x_shape``, or None.
    Dims may be ints, symbolic strings or None; only two ints can disagree."""
    if not shape or shape[-1] != x_shape[-1] and isinstance(shape[-1], int) and isinstance(x_shape[-1], int):
        return (f"{OP_TYPE}: input '{name}' must have x's last axis {x_shape[-1]} as its last axis; "
                f"got shape {list(shape)}")
    problem = _common.broadcast_error(shape, x_shape)
    if problem is not None:
        return f"{OP_TYPE}: input '{name}' must broadcast to x's shape {list(x_shape)}: {problem}"
    return None


def x_error(x_shape) -> str | None:
    """Why an x of ``x_shape`` is not one this operator takes, or None."""
    if not x_shape:
        return f"{OP_TYPE}: input 'x' must have rank >= 1 (the rotated pairs along the last axis); got a scalar"
    if isinstance(x_shape[-1], int) and x_shape[-1] % 2:
        return (f"{OP_TYPE}: input 'x' must have an even last axis (its two halves are rotated); "
                f"got shape {list(x_shape)}")
    return None


def validate(x, cos, sin, transposed: int = 0) -> dict:
    """Checks the inputs against the contract (float64 is accepted for float64 checks):
    {input name: array}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float64):
        raise NormgradInputError(f"{OP_TYPE}: input 'x' must be float32; got {x.dtype}")
    problem = x_error(x.shape)
    if problem is not None:
        raise NormgradInputError(problem)
    arrays = {"x": x, "cos": np.asarray(cos), "sin": np.asarray(sin)}
    for name in ("cos", "sin"):
        if arrays[name].dtype != x.dtype:
            raise NormgradInputError(f"{OP_TYPE}: input '{name}' must have x's type {x.dtype}; "
                                     f"got {arrays[name].dtype}")
        problem = shape_error(name, arrays[name].shape, x.shape)
        if problem is not None:
            raise NormgradInputError(problem)
    if transposed not in (0, 1):
        raise NormgradInputError(f"{OP_TYPE}: attribute 'transposed' must be 0 or 1; got {transposed}")
    return arrays


def reference(x, cos, sin, transposed: int = 0) -> Result:
    """y in x's dtype, each element by the standard nodes' operations in their order (float64
    inputs: the float64 truth; float32: the node-by-node graph's bits)."""
    arrays = validate(x, cos, sin, transposed)
    x, cos, sin = arrays["x"], arrays["cos"], arrays["sin"]
    half = x.shape[-1] // 2
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        if transposed:
            z = x * sin
            rotated = np.concatenate([z[..., half:], -z[..., :half]], axis=-1)
        else:
            rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin
        return Result(x * cos + rotated)


def halves(op: Callable, x: str, opset: int) -> list:
    """The two halves of x's last axis (a Split)."""
    return op("Split", x, axis=-1, outputs=2, **({"num_outputs": 2} if opset >= 18 else {}))


def rotate_half(op: Callable, x: str, opset: int, transposed: bool = False) -> str:
    """r(x) = [-x2, x1] (transposed: r^T(x) = [x2, -x1]) in standard ONNX ops (Split, Neg, Concat).

    Args:
        op: ``op(op_type, *inputs, **attributes) -> output name(s)`` appends a default-domain
            node; ``outputs=2`` asks for two outputs.
    """
    first, second = halves(op, x, opset)
    if transposed:
        return op("Concat", second, op("Neg", first), axis=-1)
    return op("Concat", op("Neg", second), first, axis=-1)


def standard_form(op: Callable, x: str, cos: str, sin: str, opset: int, transposed: bool = False) -> str:
    """y in standard ONNX ops: today's node-by-node forward (transposed: its gradient of x)."""
    if transposed:
        return op("Add", op("Mul", x, cos), rotate_half(op, op("Mul", x, sin), opset, transposed=True))
    return op("Add", op("Mul", x, cos), op("Mul", rotate_half(op, x, opset), sin))


def _infer(ctx) -> None:
    x_type = _common.input_tensor_type(ctx, 0)
    if x_type is None:
        return
    x_dims = _common.known_dims(x_type)
    if x_dims is not None:
        problem = x_error(x_dims)
        for index, name in ((1, "cos"), (2, "sin")):
            dims = _common.known_dims(_common.input_tensor_type(ctx, index))
            if problem is None and dims is not None:
                problem = shape_error(name, dims, x_dims)
        if problem is not None:
            raise NormgradInputError(problem)
    ctx.set_output_type(0, _common.make_output_type(x_type.elem_type, x_dims))


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    inputs = [param("x", "T", "rank >= 1, its last axis even."),
              param("cos", "T", "Broadcastable to x's shape, its last axis x's."),
              param("sin", "T", "Broadcastable to x's shape, its last axis x's.")]
    outputs = [param("y", "T", "x * cos + r(x) * sin (transposed: x * cos + r^T(x * sin)); x's shape.")]
    attributes = [OpSchema.Attribute("transposed", oh.make_attribute("transposed", ATTRIBUTES["transposed"]),
                                     "1: the transpose of the rotation (the gradient of x).")]
    return _common.make_schema(OP_TYPE, __doc__, inputs, outputs, {"T": "float32."}, _infer, attributes=attributes,
                               types=("tensor(float)",))


def function_body(opset: int = _common.ONNX_OPSET, reads=()) -> onnx.FunctionProto:
    """:func:`standard_form`'s forward when ``reads`` is empty (no node sets ``transposed``);
    when it holds ``transposed``, the forward of the sin the attribute selects (by a Where):
    sin itself, or -[sin2, sin1], with which the forward's operations are the transposed
    mode's up to the sign of a product's factors (exact: the same bits)."""
    nodes = []

    def op(node_type: str, *node_inputs: str, outputs: int = 1, **attributes):
        names = [f"t{len(nodes)}_{k}" for k in range(outputs)]
        nodes.append(oh.make_node(node_type, list(node_inputs), names, **attributes))
        return names[0] if outputs == 1 else names

    sin = "sin"
    if "transposed" in reads:
        flag = oh.make_node("Constant", [], [f"t{len(nodes)}_0"])
        flag.attribute.append(onnx.AttributeProto(name="value_int", ref_attr_name="transposed",
                                                  type=onnx.AttributeProto.INT))
        nodes.append(flag)
        selected = op("Cast", flag.output[0], to=onnx.TensorProto.BOOL)
        first, second = halves(op, "sin", opset)
        sin = op("Where", selected, op("Neg", op("Concat", second, first, axis=-1)), "sin")
    nodes.append(oh.make_node("Identity", [standard_form(op, "x", "cos", sin, opset)], ["y"]))
    return oh.make_function(_common.DOMAIN, OP_TYPE, list(INPUTS), list(OUTPUTS), nodes, [oh.make_opsetid("", opset)],
                            attribute_protos=[oh.make_attribute("transposed", ATTRIBUTES["transposed"])])
