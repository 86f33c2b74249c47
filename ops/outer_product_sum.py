"""OuterProductSum: the sum over rows of outer products, y = aᵀ b.

y[i, j] = Σ_t a[t, i] b[t, j]: the gradient of a weight used by a product over many rows
(``normgrad.graphs.context.GradientContext.weight_gradient``), summed over those rows
without a transposed GEMM operand. MLAS (onnxruntime's CPU GEMM) multiplies a transposed A
panel by panel: 84-98 GFLOP/s against 131-147 for torch's on a vocabulary head's
[1024, 8192]ᵀ [1024, 256] (1 thread, AVX-512), and onnxruntime folds a ``Transpose`` feeding
a Gemm back into its ``transA``. The C++ kernel packs both operands into panels (b's columns
a depth block at a time, each row block of y its rows of a) and runs a register tile over
them (14 x 32 on AVX-512, 6 x 16 on AVX2): 34-37 ms against MLAS's 44-46 for that head's
product (node time, 1 thread), which packs only one. Each element of y is one chain of fused
multiply-adds over t in order, from +0, on every path (AVX-512, AVX2, the portable loop's
``std::fma``): the same bits at any thread count, on any CPU. Its function body is ``Gemm(a, b, transA=1)``, which
``--inline`` and the portable form write instead.

Inputs:
    a (float or double): [T, M].
    b (a's type): [T, N].

Output (a's type): y, [M, N].
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
import onnx.helper as oh

import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_SHAPE_FROM", "Result", "validate", "reference",
           "schema", "function_body"]

OP_TYPE = "OuterProductSum"
INPUTS = ("a", "b")
OUTPUTS = ("y",)
ATTRIBUTES: dict = {}
OUTPUT_SHAPE_FROM = {"y": ("a", None)}
"""(The Python kernel's output when it rejects its input: NaN shaped like a.)"""
_OPERAND_DIMS = {"a": "[T, M]", "b": "[T, N]"}


class Result(NamedTuple):
    """The output."""

    y: np.ndarray


def validate(a, b) -> dict:
    """Checks the inputs against the contract: {input name: array}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    arrays = _common.float32_or_float64_arrays(OP_TYPE, _OPERAND_DIMS, (a, b))
    if arrays["a"].shape[0] != arrays["b"].shape[0]:
        raise NormgradInputError(f"{OP_TYPE}: inputs 'a' [T, M] and 'b' [T, N] must have the same number of rows T; "
                                 f"got shapes {list(arrays['a'].shape)} and {list(arrays['b'].shape)}")
    return arrays


def reference(a, b) -> Result:
    """The operator in NumPy: the float64 product, in a's type (rounded once for float32)."""
    arrays = validate(a, b)
    product = arrays["a"].astype(np.float64).T @ arrays["b"].astype(np.float64)
    return Result(product.astype(arrays["a"].dtype))


def _infer(ctx) -> None:
    types = [_common.input_tensor_type(ctx, index) for index in range(2)]
    elem_type = types[0].elem_type if types[0] is not None and types[0].elem_type else onnx.TensorProto.FLOAT
    dims = [_common.known_dims(t) for t in types]
    for name, known in zip(INPUTS, dims):
        if known is not None and len(known) != 2:
            raise NormgradInputError(f"{OP_TYPE}: input '{name}' must have rank 2 ({_OPERAND_DIMS[name]}); "
                                     f"got rank {len(known)}")
    if dims[0] is not None and dims[1] is not None and not _common.dims_compatible(dims[0][:1], dims[1][:1]):
        raise NormgradInputError(f"{OP_TYPE}: inputs 'a' [T, M] and 'b' [T, N] must have the same number of rows T; "
                                 f"got {dims[0][0]} and {dims[1][0]}")
    out = None if dims[0] is None or dims[1] is None else [dims[0][1], dims[1][1]]
    ctx.set_output_type(0, _common.make_output_type(elem_type, out))


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    return _common.make_schema(OP_TYPE, __doc__, [param("a", "T", "[T, M]."), param("b", "T", "[T, N].")],
                               [param("y", "T", "[M, N]: aᵀ b.")],
                               {"T": (("tensor(float)", "tensor(double)"), "a's and b's type.")}, _infer)


def function_body(opset: int = _common.ONNX_OPSET) -> onnx.FunctionProto:
    """One standard Gemm with transA."""
    nodes = [oh.make_node("Gemm", ["a", "b"], ["y"], transA=1)]
    return oh.make_function(_common.DOMAIN, OP_TYPE, list(INPUTS), list(OUTPUTS), nodes,
                            [oh.make_opsetid("", opset)])
