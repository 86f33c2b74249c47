"""BatchNormReduceBackward: the per-channel reductions of BatchNorm's backward pass.

CANN ``aclnnBatchNormReduceBackward``; torch ``batch_norm_backward_reduce``.

Inputs:
    grad_out (T): dy, the gradient of the BatchNorm output; shape of ``input``.
    input (T): x, the BatchNorm input; rank 2..8, channel axis 1, C >= 1.
    mean (U): [C], the mean BatchNorm normalised with.
    invstd (U): [C], 1 / sqrt(var + eps).
    weight (U, optional): [C]. Only its length is checked: like CANN and torch, the
        reductions never read it.
    relu_output (T, optional): y of a ReLU that follows the BatchNorm, shape of ``input``
        or a scalar; given, every dy below is (y > 0 ? grad_out : 0), exactly 0 where masked
        (:data:`normgrad.ops._batch_norm.RELU_OUTPUT_DOC`).

Attributes (int, 0 or 1, default 1):
    input_g: compute ``sum_dy`` and ``sum_dy_xmu``.
    weight_g: compute ``grad_weight``.
    bias_g: compute ``grad_bias``.

Outputs (U, [C], each optional; naming one whose flag is 0 is an error):
    sum_dy = sum(dy); sum_dy_xmu = sum(dy * (x - mean));
    grad_weight = sum_dy_xmu * invstd; grad_bias = sum(dy).
    The sums run over every axis but 1. ``sum_dy_xmu`` is computed as written, never as
    sum(dy * x) - mean * sum(dy), which cancels catastrophically when |mean| >> std.

T and U are each float, float16 or bfloat16; sums accumulate in float64 here and in at
least float32 in every other implementation.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np
import onnx
import onnx.parser
from onnx.defs import OpSchema

import normgrad.ops._batch_norm as _batch_norm
import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_FLAGS", "ONES_IF_OMITTED", "SCALAR_IF_OMITTED",
           "OUTPUT_SHAPE_FROM", "Result", "validate", "reference", "schema", "function_body"]

OP_TYPE = "BatchNormReduceBackward"
INPUTS = ("grad_out", "input", "mean", "invstd", "weight", _batch_norm.RELU_OUTPUT)
OUTPUTS = ("sum_dy", "sum_dy_xmu", "grad_weight", "grad_bias")
ATTRIBUTES = {"input_g": 1, "weight_g": 1, "bias_g": 1}
OUTPUT_FLAGS = {"sum_dy": "input_g", "sum_dy_xmu": "input_g", "grad_weight": "weight_g", "grad_bias": "bias_g"}
"""The flag attribute that enables each output."""
ONES_IF_OMITTED = {"weight": ("input", 1), _batch_norm.RELU_OUTPUT: ("input", None)}
"""Optional inputs whose omission equals ones shaped like (input, axis), as OUTPUT_SHAPE_FROM."""
SCALAR_IF_OMITTED = {_batch_norm.RELU_OUTPUT: 1.0}
"""Optional inputs only the function body that reads them has (``function_body(reads=...)``),
with the scalar that means the same as omitting them (see ``normgrad.add_functions``)."""
OUTPUT_SHAPE_FROM = {name: ("input", 1) for name in OUTPUTS}
"""Each output's shape as (input, axis): input.shape[axis], or the whole shape for None."""


class Result(NamedTuple):
    """The outputs; an output whose flag is 0 is None."""

    sum_dy: Optional[np.ndarray]
    sum_dy_xmu: Optional[np.ndarray]
    grad_weight: Optional[np.ndarray]
    grad_bias: Optional[np.ndarray]


def validate(grad_out, input, mean, invstd, weight=None, relu_output=None, *, input_g=1, weight_g=1, bias_g=1):
    """Checks the inputs against the contract.

    Returns:
        The inputs as arrays (None for omitted ones) and the flags as a dict, in the order given.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    dy, x, arrays = _batch_norm.validate(
        OP_TYPE, grad_out, input, {"mean": mean, "invstd": invstd, "weight": weight}, relu_output
    )
    flags = {
        name: _common.check_attribute_flag(OP_TYPE, name, value)
        for name, value in (("input_g", input_g), ("weight_g", weight_g), ("bias_g", bias_g))
    }
    return dy, x, arrays["mean"], arrays["invstd"], arrays.get("weight"), arrays.get(_batch_norm.RELU_OUTPUT), flags


def reference(grad_out, input, mean, invstd, weight=None, relu_output=None, *, input_g=1, weight_g=1, bias_g=1) -> Result:
    """The operator in float64 NumPy: the truth every other implementation is tested against.

    Returns:
        A :class:`Result` in U (``mean``'s dtype); outputs whose flag is 0 are None.
    """
    dy, x, mean, invstd, _, relu_output, flags = validate(
        grad_out, input, mean, invstd, weight, relu_output, input_g=input_g, weight_g=weight_g, bias_g=bias_g
    )
    out_dtype = mean.dtype
    axes = (0,) + tuple(range(2, x.ndim))
    per_channel = (1, -1) + (1,) * (x.ndim - 2)
    dy64 = _batch_norm.relu_select(dy.astype(np.float64), relu_output)
    sum_dy = dy64.sum(axis=axes)
    xmu = x.astype(np.float64) - mean.astype(np.float64).reshape(per_channel)
    sum_dy_xmu = (dy64 * xmu).sum(axis=axes)
    grad_weight = sum_dy_xmu * invstd.astype(np.float64)

    def out(value, flag):
        return value.astype(out_dtype) if flags[flag] else None

    return Result(
        out(sum_dy, "input_g"), out(sum_dy_xmu, "input_g"), out(grad_weight, "weight_g"), out(sum_dy, "bias_g")
    )


def _infer(ctx) -> None:
    mean_type = _common.input_tensor_type(ctx, 2)
    flags = {name: _common.attribute_int(ctx, name, default) for name, default in ATTRIBUTES.items()}
    for name, value in flags.items():
        _common.check_attribute_flag(OP_TYPE, name, value)
    _, _, channels = _batch_norm.infer(ctx, OP_TYPE, {2: "mean", 3: "invstd", 4: "weight"}, 5)
    for index, name in enumerate(OUTPUTS):
        if not ctx.has_output(index):
            continue
        flag = OUTPUT_FLAGS[name]
        if not flags[flag]:
            raise NormgradInputError(f"{OP_TYPE}: output '{name}' is named but attribute '{flag}' is 0")
        if mean_type is not None:
            ctx.set_output_type(index, _common.make_output_type(mean_type.elem_type, [channels]))


def schema() -> OpSchema:
    """The ONNX schema, with type and shape inference."""
    param = OpSchema.FormalParameter
    optional = OpSchema.FormalParameterOption.Optional
    return _common.make_schema(
        OP_TYPE,
        __doc__,
        inputs=[
            param("grad_out", "T", "Gradient of the BatchNorm output."),
            param("input", "T", "BatchNorm input, rank 2..8, channel axis 1."),
            param("mean", "U", "Per-channel mean, [C]."),
            param("invstd", "U", "Per-channel 1/sqrt(var + eps), [C]."),
            param("weight", "U", "Per-channel scale, [C]; only its length is checked.", param_option=optional),
            param(_batch_norm.RELU_OUTPUT, "T", _batch_norm.RELU_OUTPUT_DOC, param_option=optional),
        ],
        outputs=[param(name, "U", f"[C]; needs {OUTPUT_FLAGS[name]} = 1.", param_option=optional) for name in OUTPUTS],
        type_docs={"T": "Element type of grad_out and input.", "U": "Element type of the per-channel tensors."},
        infer=_infer,
        attributes=[
            OpSchema.Attribute(name, onnx.helper.make_attribute(name, default), "0 or 1; see outputs.")
            for name, default in ATTRIBUTES.items()
        ],
    )


def function_body(opset: int = _common.ONNX_OPSET, reads: Sequence[str] = ()) -> onnx.FunctionProto:
    """The operator in standard ONNX ops (float32 arithmetic), for runtimes without a kernel.

    ``weight`` is never read. ``relu_output`` is a formal input, and read, only with
    ``reads=("relu_output",)``: a body cannot test whether an input is present. Outputs a node does not name are pruned by the runtime. The
    sums over [N, C, M] run over N first, then M: one ReduceSum over axes [0, 2] would hit
    onnxruntime's reduced-kept-reduced kernel, whose float sums change with the thread
    count when C is smaller than it.
    """
    masked = _batch_norm.RELU_OUTPUT in reads
    relu_output = f", {_batch_norm.RELU_OUTPUT}" if masked else ""
    dy = _batch_norm.relu_select_body("dy_unmasked", "dy") if masked else ""
    return onnx.parser.parse_function(
        f"""
        <domain: "{_common.DOMAIN}", opset_import: ["" : {opset}]>
        {OP_TYPE} <input_g: int = 1, weight_g: int = 1, bias_g: int = 1>
            (grad_out, input, mean, invstd, weight{relu_output}) => (sum_dy, sum_dy_xmu, grad_weight, grad_bias)
        {{
            {"dy_unmasked" if masked else "dy"} = Cast <to = 1> (grad_out){dy}
            x = Cast <to = 1> (input)
            mu = Cast <to = 1> (mean)
            rstd = Cast <to = 1> (invstd)
            n_c = Shape <end = 2> (x)
            spatial_dims = Shape <start = 2> (x)
            spatial = ReduceProd <keepdims = 1> (spatial_dims)
            ncm = Concat <axis = 0> (n_c, spatial)
            dy3 = Reshape <allowzero = 1> (dy, ncm)
            x3 = Reshape <allowzero = 1> (x, ncm)
            per_channel = Constant <value_ints = [1, -1, 1]> ()
            mu3 = Reshape (mu, per_channel)
            xmu = Sub (x3, mu3)
            dy_xmu = Mul (dy3, xmu)
            batch = Constant <value_ints = [0]> ()
            along = Constant <value_ints = [1]> ()
            sdy_cm = ReduceSum <keepdims = 0> (dy3, batch)
            sdy = ReduceSum <keepdims = 0> (sdy_cm, along)
            sdy_xmu_cm = ReduceSum <keepdims = 0> (dy_xmu, batch)
            sdy_xmu = ReduceSum <keepdims = 0> (sdy_xmu_cm, along)
            gw = Mul (sdy_xmu, rstd)
            sum_dy = CastLike (sdy, mean)
            sum_dy_xmu = CastLike (sdy_xmu, mean)
            grad_weight = CastLike (gw, mean)
            grad_bias = CastLike (sdy, mean)
        }}
        """
    )
