"""BiasSoftmaxCrossEntropy: :mod:`~normgrad.ops.softmax_cross_entropy` of ``logits + bias``
(the bias broadcast over the rows), with the bias's gradient, in one node.

A classifier or masked-LM head ends in MatMul, then Add of a bias over the classes, then the
loss: the step graphs (``normgrad.graphs.losses``) give the loss the logits before the bias,
so that neither the Add over [N, C] nor its gradient, a ReduceSum of ``dlogits`` over the
rows, is a pass over memory of its own: the kernel adds the bias to each row and sums
``dlogits``' columns while the row is in cache.

    z = logits + bias        (float32, as the Add rounds it)
    loss, dlogits = SoftmaxCrossEntropy(z, labels)
    dbias[c] = sum_i dlogits[i, c]

so ``loss`` and ``dlogits`` are bitwise what Add then SoftmaxCrossEntropy give. The function
body is that, node for node: Add, SoftmaxCrossEntropy's standard-op body, ReduceSum over axis 0.

Inputs:
    logits (float32): [N, C], before the bias.
    labels (int64): [N]; each in [0, C) or equal to ``ignore_index``.
    bias (float32): [C].

Outputs:
    loss (float32): SoftmaxCrossEntropy's loss of logits + bias.
    dlogits (float32): [N, C], d loss / d logits (= d loss / d (logits + bias)).
    dbias (float32): [C], d loss / d bias, the column sums of ``dlogits``.

Attribute:
    ignore_index (int): as SoftmaxCrossEntropy's.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx

import normgrad.ops._common as _common
import normgrad.ops.softmax_cross_entropy as softmax_cross_entropy
from normgrad.ops._common import NormgradInputError
from normgrad.ops.softmax_cross_entropy import ATTRIBUTES_READ_UNLESS_DEFAULT, NO_IGNORE_INDEX  # noqa: F401

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "ATTRIBUTES_READ_UNLESS_DEFAULT", "OUTPUT_SHAPE_FROM",
           "INPUT_DTYPES", "Result", "validate", "reference", "schema", "function_body"]

OP_TYPE = "BiasSoftmaxCrossEntropy"
INPUTS = ("logits", "labels", "bias")
OUTPUTS = ("loss", "dlogits", "dbias")
ATTRIBUTES = dict(softmax_cross_entropy.ATTRIBUTES)
OUTPUT_SHAPE_FROM = {**softmax_cross_entropy.OUTPUT_SHAPE_FROM, "dbias": ("bias", None)}
INPUT_DTYPES = softmax_cross_entropy.INPUT_DTYPES


class Result(NamedTuple):
    """The outputs."""

    loss: np.ndarray
    dlogits: np.ndarray
    dbias: np.ndarray


def validate(logits, labels, bias, ignore_index: int = NO_IGNORE_INDEX) -> dict:
    """Checks the inputs against the contract: {input name: array}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    arrays = softmax_cross_entropy.checked_logits_and_labels(OP_TYPE, logits, labels, ignore_index)
    bias = np.asarray(bias)
    if bias.dtype != arrays["logits"].dtype:
        raise NormgradInputError(f"{OP_TYPE}: input 'bias' must have the type of 'logits' ({arrays['logits'].dtype}); "
                                 f"got {bias.dtype}")
    if bias.shape != arrays["logits"].shape[1:]:
        raise NormgradInputError(f"{OP_TYPE}: input 'bias' must have shape [{arrays['logits'].shape[1]}] (one value per "
                                 f"column of 'logits'); got {list(bias.shape)}")
    return {**arrays, "bias": bias}


def reference(logits, labels, bias, ignore_index: int = NO_IGNORE_INDEX) -> Result:
    """SoftmaxCrossEntropy's reference of logits + bias (added in their dtype, as the Add),
    and dlogits' column sums in float64 (the results in ``logits``' dtype)."""
    arrays = validate(logits, labels, bias, ignore_index)
    dtype = arrays["logits"].dtype
    summed = (arrays["logits"] + arrays["bias"]).astype(np.float64)
    loss, dlogits = softmax_cross_entropy.reference(summed, arrays["labels"], ignore_index)
    return Result(loss.astype(dtype), dlogits.astype(dtype), dlogits.sum(axis=0).astype(dtype))


def _infer(ctx) -> None:
    dims = _common.known_dims(_common.input_tensor_type(ctx, 0))
    ctx.set_output_type(0, _common.make_output_type(onnx.TensorProto.FLOAT, []))
    ctx.set_output_type(1, _common.make_output_type(onnx.TensorProto.FLOAT, dims))
    ctx.set_output_type(2, _common.make_output_type(onnx.TensorProto.FLOAT, None if dims is None else dims[1:]))


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    inputs = [param("logits", "T", "[N, C] logits before the bias."),
              param("labels", "L", "[N] class indices, each in [0, C) or ignore_index."),
              param("bias", "T", "[C], added to every row of logits.")]
    outputs = [param("loss", "T", "The mean cross-entropy of logits + bias over the samples not ignored (a scalar)."),
               param("dlogits", "T", "d loss / d logits, [N, C]."),
               param("dbias", "T", "d loss / d bias, [C]: the column sums of dlogits.")]
    return softmax_cross_entropy.schema_with_ignore_index(OP_TYPE, __doc__, inputs, outputs, _infer)


def function_body(opset: int = _common.ONNX_OPSET, reads=()) -> onnx.FunctionProto:
    """Add, SoftmaxCrossEntropy's standard-op body, ReduceSum of dlogits over axis 0."""
    def write(ctx, ignore_index):
        loss, dlogits = softmax_cross_entropy.cross_entropy_standard_ops(ctx, ctx.op("Add", "logits", "bias"), "labels",
                                                   ignore_index=ignore_index)
        return loss, dlogits, ctx.reduce("ReduceSum", dlogits, [0], keepdims=False)

    return softmax_cross_entropy.standard_op_function(OP_TYPE, {"logits": ["N", "C"], "bias": ["C"]}, OUTPUTS, write,
                                                      opset, reads)
