"""The normgrad operators: the one registration point.

Importing this package registers every operator's schema with ``onnx.defs`` so that
``onnx.checker`` and ``onnx.shape_inference`` know them.
"""

from __future__ import annotations

import onnx.defs

from normgrad.ops import (
    activation_grad,
    adam_update,
    bias_softmax_cross_entropy,
    all_reduce,
    batch_norm_elemt_backward,
    batch_norm_reduce_backward,
    bias_safe_softmax,
    depthwise_conv,
    depthwise_conv_grad,
    dropout_mask,
    embedding_grad,
    gated_update,
    gelu_with_slope,
    group_normalization_grad,
    layer_normalization_grad,
    lstm_backward_factors,
    matrix_transpose,
    max_pool_grad,
    outer_product_sum,
    rms_normalization_grad,
    rotate_half_embedding,
    safe_softmax,
    sgd_update,
    silu_mul,
    softmax_cross_entropy,
    softmax_grad,
    swiglu_grad,
)
from normgrad.ops._common import DOMAIN, IR_VERSION, ONNX_OPSET, OPSET_VERSION, NormgradInputError

__all__ = ["DOMAIN", "OPSET_VERSION", "IR_VERSION", "ONNX_OPSET", "OPERATORS", "NormgradInputError", "operator"]

OPERATORS = {
    module.OP_TYPE: module
    for module in (
        batch_norm_reduce_backward,
        batch_norm_elemt_backward,
        group_normalization_grad,
        layer_normalization_grad,
        rms_normalization_grad,
        all_reduce,
        adam_update,
        sgd_update,
        gated_update,
        dropout_mask,
        embedding_grad,
        softmax_cross_entropy,
        matrix_transpose,
        outer_product_sum,
        depthwise_conv,
        depthwise_conv_grad,
        max_pool_grad,
        lstm_backward_factors,
        *activation_grad.OPERATORS,
        swiglu_grad,
        softmax_grad,
        safe_softmax,
        bias_safe_softmax,
        rotate_half_embedding,
        bias_softmax_cross_entropy,
        silu_mul,
        gelu_with_slope,
    )
}
"""Every operator module by op type (activation_grad's operators are objects of one module). Each has OP_TYPE, INPUTS, OUTPUTS, ATTRIBUTES,
``validate``, ``reference``, ``schema`` and ``function_body``; optionally OUTPUT_FLAGS
({output: the flag attribute enabling it}) and ONES_IF_OMITTED ({optional input: (input,
axis) whose shape the ones it equals when omitted have}), which
``normgrad.prepare_for_python_kernels`` reads; optionally SCALAR_IF_OMITTED ({optional
input: the scalar that means the same as omitting it}; ``function_body(opset, reads)``
then reads those named in ``reads``) and ATTRIBUTES_READ_UNLESS_DEFAULT (attributes whose
non-default value on some node puts their name in ``reads``), which
``normgrad.add_functions`` reads; optionally
``python_kernel`` (what the float32 Python kernel runs instead of ``reference``); optionally
INPUT_DTYPES / OUTPUT_DTYPES ({name: NumPy dtype} of the inputs and outputs that are not
float32, which the Python kernels declare); optionally
STATIC_SUM_AXES_OF ((x, param) input positions; ``function_body(opset, sum_axes=...)`` then
takes reduction axes known at export, which ``normgrad.graphs.inline`` gives it)."""


def operator(op_type: str):
    """The module of a normgrad operator.

    Raises:
        KeyError: ``op_type`` is not a normgrad operator.
    """
    try:
        return OPERATORS[op_type]
    except KeyError:
        raise KeyError(f"{op_type!r} is not a normgrad operator; known: {sorted(OPERATORS)}") from None


def _register_schemas() -> None:
    for module in OPERATORS.values():
        if not onnx.defs.has(module.OP_TYPE, DOMAIN):
            onnx.defs.register_schema(module.schema())


_register_schemas()
