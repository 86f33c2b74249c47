"""BatchNormElemtBackward: the elementwise half of BatchNorm's backward pass.

CANN ``aclnnBatchNormElemtBackward``; torch ``batch_norm_backward_elemt``. It consumes the
per-channel sums that :mod:`normgrad.ops.batch_norm_reduce_backward` produces (after an
all-reduce, in synchronized BatchNorm) and gives the gradient of the BatchNorm input.

Inputs (all but ``relu_output`` required):
    grad_out (T): dy, the gradient of the BatchNorm output; shape and dtype of ``input``.
    input (T): x, the BatchNorm input; rank 2..8, channel axis 1, C >= 1.
    mean (U): [C], the mean BatchNorm normalised with.
    invstd (U): [C], 1 / sqrt(var + eps).
    weight (U): [C], the BatchNorm scale.
    sum_dy (U): [C], sum(dy) over every axis but 1.
    sum_dy_xmu (U): [C], sum(dy * (x - mean)) over every axis but 1.
    relu_output (T, optional): y of a ReLU that follows the BatchNorm, shape of ``input``
        or a scalar; given, dy below is (y > 0 ? grad_out : 0), exactly 0 where masked
        (:data:`normgrad.ops._batch_norm.RELU_OUTPUT_DOC`). sum_dy and sum_dy_xmu are then
        the sums of that dy (BatchNormReduceBackward with the same relu_output).

Attributes: none.

Output:
    grad_input (T): shape of ``input``. With M = N * prod(shape[2:]),

        dx = (dy - sum_dy / M - (x - mean) * invstd^2 * sum_dy_xmu / M) * invstd * weight

    An empty ``input`` gives an empty ``grad_input``.

T and U are each float, float16 or bfloat16; arithmetic runs in float64 here and in at
least float32 in every other implementation.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import onnx
import onnx.parser
from onnx.defs import OpSchema

import normgrad.ops._batch_norm as _batch_norm
import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "ONES_IF_OMITTED", "SCALAR_IF_OMITTED", "OUTPUT_SHAPE_FROM",
           "Result", "validate", "reference", "schema", "function_body"]

OP_TYPE = "BatchNormElemtBackward"
INPUTS = ("grad_out", "input", "mean", "invstd", "weight", "sum_dy", "sum_dy_xmu", _batch_norm.RELU_OUTPUT)
OUTPUTS = ("grad_input",)
ATTRIBUTES: dict = {}
ONES_IF_OMITTED = {_batch_norm.RELU_OUTPUT: ("input", None)}
"""Optional inputs whose omission equals ones shaped like (input, axis), as OUTPUT_SHAPE_FROM."""
SCALAR_IF_OMITTED = {_batch_norm.RELU_OUTPUT: 1.0}
"""Optional inputs only the function body that reads them has (``function_body(reads=...)``),
with the scalar that means the same as omitting them (see ``normgrad.add_functions``)."""
OUTPUT_SHAPE_FROM = {"grad_input": ("input", None)}
"""Each output's shape as (input, axis): input.shape[axis], or the whole shape for None."""
_VECTORS = INPUTS[2:7]


def validate(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, relu_output=None):
    """Checks the inputs against the contract.

    Returns:
        The inputs as arrays (None for an omitted ``relu_output``), in the order given.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    values = dict(zip(_VECTORS, (mean, invstd, weight, sum_dy, sum_dy_xmu)))
    missing = [name for name, value in values.items() if value is None]
    if missing:
        raise NormgradInputError(f"{OP_TYPE}: input '{missing[0]}' is required")
    dy, x, arrays = _batch_norm.validate(OP_TYPE, grad_out, input, values, relu_output)
    return (dy, x, *(arrays[name] for name in _VECTORS), arrays.get(_batch_norm.RELU_OUTPUT))


class Result(NamedTuple):
    """The one output."""

    grad_input: np.ndarray


def reference(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, relu_output=None) -> Result:
    """The operator in float64 NumPy: the truth every other implementation is tested against.

    Returns:
        A :class:`Result` holding ``grad_input`` in T (``input``'s dtype).
    """
    dy, x, *vectors, relu_output = validate(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, relu_output)
    if x.size == 0:
        return Result(np.zeros(x.shape, x.dtype))
    per_channel = (1, -1) + (1,) * (x.ndim - 2)
    mean, invstd, weight, sum_dy, sum_dy_xmu = (v.astype(np.float64).reshape(per_channel) for v in vectors)
    count = x.size // x.shape[1]
    xmu = x.astype(np.float64) - mean
    g = _batch_norm.relu_select(dy.astype(np.float64), relu_output)
    dx = (g - sum_dy / count - xmu * invstd**2 * sum_dy_xmu / count) * invstd * weight
    return Result(dx.astype(x.dtype))


def _infer(ctx) -> None:
    x_type, x_dims, _ = _batch_norm.infer(ctx, OP_TYPE, dict(enumerate(_VECTORS, start=2)), 7)
    dy_type = _common.input_tensor_type(ctx, 0)
    dy_dims = _common.known_dims(dy_type)
    out_type = x_type if x_type is not None else dy_type
    if out_type is not None:
        ctx.set_output_type(0, _common.make_output_type(out_type.elem_type, x_dims if x_dims is not None else dy_dims))


def schema() -> OpSchema:
    """The ONNX schema, with type and shape inference."""
    param = OpSchema.FormalParameter
    per_channel = {
        "mean": "Per-channel mean, [C].",
        "invstd": "Per-channel 1/sqrt(var + eps), [C].",
        "weight": "Per-channel scale, [C].",
        "sum_dy": "Per-channel sum of grad_out, [C].",
        "sum_dy_xmu": "Per-channel sum of grad_out * (input - mean), [C].",
    }
    return _common.make_schema(
        OP_TYPE,
        __doc__,
        inputs=[
            param("grad_out", "T", "Gradient of the BatchNorm output."),
            param("input", "T", "BatchNorm input, rank 2..8, channel axis 1."),
            *(param(name, "U", text) for name, text in per_channel.items()),
            param(_batch_norm.RELU_OUTPUT, "T", _batch_norm.RELU_OUTPUT_DOC, param_option=OpSchema.FormalParameterOption.Optional),
        ],
        outputs=[param("grad_input", "T", "Gradient of the BatchNorm input; shape of input.")],
        type_docs={"T": "Element type of grad_out, input and grad_input.", "U": "Element type of the per-channel tensors."},
        infer=_infer,
    )


def function_body(opset: int = _common.ONNX_OPSET, reads: Sequence[str] = ()) -> onnx.FunctionProto:
    """The operator in standard ONNX ops (float32 arithmetic), for runtimes without a kernel.

    ``relu_output`` is a formal input, and read, only with ``reads=("relu_output",)``: a
    body cannot test whether an input is present."""
    masked = _batch_norm.RELU_OUTPUT in reads
    relu_output = f", {_batch_norm.RELU_OUTPUT}" if masked else ""
    dy = _batch_norm.relu_select_body("dy_unmasked", "dy") if masked else ""
    return onnx.parser.parse_function(
        f"""
        <domain: "{_common.DOMAIN}", opset_import: ["" : {opset}]>
        {OP_TYPE} (grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu{relu_output}) => (grad_input)
        {{
            {"dy_unmasked" if masked else "dy"} = Cast <to = 1> (grad_out){dy}
            x = Cast <to = 1> (input)
            mu = Cast <to = 1> (mean)
            rstd = Cast <to = 1> (invstd)
            w = Cast <to = 1> (weight)
            sdy = Cast <to = 1> (sum_dy)
            sdy_xmu = Cast <to = 1> (sum_dy_xmu)
            x_shape = Shape (input)
            n = Shape <end = 1> (x)
            n_c = Shape <end = 2> (x)
            spatial_dims = Shape <start = 2> (x)
            spatial = ReduceProd <keepdims = 1> (spatial_dims)
            ncm = Concat <axis = 0> (n_c, spatial)
            count_int = Mul (n, spatial)
            count_float = Cast <to = 1> (count_int)
            one = Constant <value_float = 1.0> ()
            count = Max (count_float, one)
            dy3 = Reshape <allowzero = 1> (dy, ncm)
            x3 = Reshape <allowzero = 1> (x, ncm)
            per_channel = Constant <value_ints = [1, -1, 1]> ()
            mean_dy = Div (sdy, count)
            rstd_sq = Mul (rstd, rstd)
            proj_num = Mul (rstd_sq, sdy_xmu)
            proj = Div (proj_num, count)
            scale = Mul (rstd, w)
            mu3 = Reshape (mu, per_channel)
            mean_dy3 = Reshape (mean_dy, per_channel)
            proj3 = Reshape (proj, per_channel)
            scale3 = Reshape (scale, per_channel)
            xmu = Sub (x3, mu3)
            xmu_proj = Mul (xmu, proj3)
            dy_centred = Sub (dy3, mean_dy3)
            inner = Sub (dy_centred, xmu_proj)
            dx3 = Mul (inner, scale3)
            dx = Reshape <allowzero = 1> (dx3, x_shape)
            grad_input = CastLike (dx, grad_out)
        }}
        """
    )
