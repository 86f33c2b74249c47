"""SoftmaxCrossEntropy: torch's ``cross_entropy(logits, labels, reduction="mean")`` with
class-index labels, and its gradient with respect to the logits, in one node.

The step graphs' ``cross_entropy`` and ``causal_lm`` losses (``normgrad.graphs.losses``)
write it for float32 [samples, classes] logits without label smoothing; over a vocabulary
the standard-op form (Softmax, two ReduceMax, the label's log-probability, the weighted
gradient) makes about eight passes over [N, C], the kernel reads the logits once and
writes the gradient once. The function body is that standard-op form, node for node
(``normgrad.graphs.losses.cross_entropy_standard_ops``).

With m_i the largest logit of sample i, S_i = sum_c exp(logits[i, c] - m_i), the samples
counted those whose label is not ``ignore_index`` (all of them when ``ignore_index`` is
:data:`NO_IGNORE_INDEX`, the default) and ``count`` their number:

    loss = -(1 / count) sum_{i counted} (logits[i, t_i] - m_i - log S_i)
    dlogits[i, c] = w_i exp(logits[i, c] - m_i) / S_i - w_i [c = t_i]

with w_i = 1 / count for a counted sample and 0 for an ignored one. A sample with a NaN or
+inf logit, or with only -inf logits, has NaN loss and gradient (as the standard-op form: its
softmax is NaN), an ignored one included (NaN * 0); when every sample is ignored, ``count``
is 0 and the loss and every gradient entry are NaN (0 / 0, as the standard-op form).

Inputs:
    logits (float32): [N, C].
    labels (int64): [N]; each in [0, C) or equal to ``ignore_index``.

Outputs:
    loss (float32): the scalar above.
    dlogits (float32): [N, C], d loss / d logits.

Attribute:
    ignore_index (int): samples with this label are not counted; the default,
    :data:`NO_IGNORE_INDEX` (-2**63), counts every sample.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.ops import _common
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "NO_IGNORE_INDEX", "ATTRIBUTES_READ_UNLESS_DEFAULT",
           "OUTPUT_SHAPE_FROM", "INPUT_DTYPES", "Result", "validate", "reference", "schema", "function_body",
           "checked_logits_and_labels", "schema_with_ignore_index", "standard_op_function"]

OP_TYPE = "SoftmaxCrossEntropy"
INPUTS = ("logits", "labels")
OUTPUTS = ("loss", "dlogits")
NO_IGNORE_INDEX = -(2**63)
"""The ``ignore_index`` that ignores no sample (no label in [0, C) equals it)."""
ATTRIBUTES = {"ignore_index": NO_IGNORE_INDEX}
ATTRIBUTES_READ_UNLESS_DEFAULT = ("ignore_index",)
"""Attributes whose non-default value selects another function body (one body serves every
node of a model, ``normgrad.add_functions``): the masked form reading ``ignore_index``, which
a node with the default also computes correctly."""
OUTPUT_SHAPE_FROM = {"loss": (None, None), "dlogits": ("logits", None)}
INPUT_DTYPES = {"labels": np.dtype(np.int64)}
"""The element types of the inputs that are not float32 (the Python kernels declare them)."""


class Result(NamedTuple):
    """The outputs."""

    loss: np.ndarray
    dlogits: np.ndarray


def validate(logits, labels, ignore_index: int = NO_IGNORE_INDEX) -> dict:
    """Checks the inputs against the contract: {input name: array}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    return checked_logits_and_labels(OP_TYPE, logits, labels, ignore_index)


def checked_logits_and_labels(op_type: str, logits, labels, ignore_index: int) -> dict:
    """:func:`validate` for ``op_type`` (the errors name it)."""
    logits, labels = np.asarray(logits), np.asarray(labels)
    # float64 only where a float64 check evaluates the reference
    if logits.dtype not in (np.float32, np.float64):
        raise NormgradInputError(f"{op_type}: input 'logits' must be float32; got {logits.dtype}")
    if logits.ndim != 2:
        raise NormgradInputError(f"{op_type}: input 'logits' must have rank 2 ([samples, classes]); "
                                 f"got shape {list(logits.shape)}")
    if labels.dtype != np.int64:
        raise NormgradInputError(f"{op_type}: input 'labels' must be int64; got {labels.dtype}")
    if labels.shape != logits.shape[:1]:
        raise NormgradInputError(f"{op_type}: input 'labels' must have shape [{logits.shape[0]}] (one label per row "
                                 f"of 'logits'); got {list(labels.shape)}")
    classes = logits.shape[1]
    wrong = (labels < 0) | (labels >= classes)
    if ignore_index != NO_IGNORE_INDEX:
        wrong &= labels != ignore_index
    if wrong.any():
        row = int(np.argmax(wrong))
        ignored = "" if ignore_index == NO_IGNORE_INDEX else f" or ignore_index {ignore_index}"
        raise NormgradInputError(f"{op_type}: input 'labels' must hold class indices in [0, {classes}){ignored}; "
                                 f"got {int(labels[row])} at row {row}")
    return {"logits": logits, "labels": labels}


def reference(logits, labels, ignore_index: int = NO_IGNORE_INDEX) -> Result:
    """The operator in float64 NumPy (the results in ``logits``' dtype)."""
    arrays = validate(logits, labels, ignore_index)
    x, labels = arrays["logits"].astype(np.float64), arrays["labels"]
    counted = labels != ignore_index
    index = np.where(counted, labels, 0)[:, None]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        shifted = x - x.max(axis=1, keepdims=True)
        exps = np.exp(shifted)
        sums = exps.sum(axis=1, keepdims=True)
        picked = np.take_along_axis(shifted, index, axis=1)[:, 0] - np.log(sums[:, 0])
        count = np.float64(counted.sum())
        loss = -np.sum(picked * counted) / count
        weight = counted / count
        dlogits = exps / sums * weight[:, None]
        np.put_along_axis(dlogits, index, np.take_along_axis(dlogits, index, axis=1) - (weight * counted)[:, None],
                          axis=1)
    return Result(np.asarray(loss, arrays["logits"].dtype), dlogits.astype(arrays["logits"].dtype))


def _infer(ctx) -> None:
    logits = _common.input_tensor_type(ctx, 0)
    dims = _common.known_dims(logits)
    ctx.set_output_type(0, _common.make_output_type(onnx.TensorProto.FLOAT, []))
    ctx.set_output_type(1, _common.make_output_type(onnx.TensorProto.FLOAT, dims))


def schema():
    """The ONNX schema, with type and shape inference."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    inputs = [param("logits", "T", "[N, C] logits."),
              param("labels", "L", "[N] class indices, each in [0, C) or ignore_index.")]
    outputs = [param("loss", "T", "The mean cross-entropy over the samples not ignored (a scalar)."),
               param("dlogits", "T", "d loss / d logits, [N, C].")]
    return schema_with_ignore_index(OP_TYPE, __doc__, inputs, outputs, _infer)


def schema_with_ignore_index(op_type: str, doc: str, inputs, outputs, infer):
    """The schema of ``op_type`` with float32 T, int64 L and the ``ignore_index`` attribute:
    SoftmaxCrossEntropy's and BiasSoftmaxCrossEntropy's."""
    from onnx.defs import OpSchema

    attributes = [OpSchema.Attribute("ignore_index", oh.make_attribute("ignore_index", NO_IGNORE_INDEX),
                                     "Samples with this label are not counted; the default counts every sample.")]
    return _common.make_schema(op_type, doc, inputs, outputs,
                               {"T": (("tensor(float)",), "float32."), "L": (("tensor(int64)",), "int64.")}, infer,
                               attributes=attributes)


_IGNORE_INDEX_MARK = -0x5EED0CE1055
"""A value the body builder passes for ``ignore_index``, whose Constant becomes a reference
to the node's attribute."""


def function_body(opset: int = _common.ONNX_OPSET, reads=()) -> onnx.FunctionProto:
    """The standard-op form the loss writes without the operator: the plain mean when
    ``reads`` is empty, the masked mean reading ``ignore_index`` when it holds it."""
    from normgrad.graphs.losses import cross_entropy_standard_ops

    def write(ctx, ignore_index):
        return cross_entropy_standard_ops(ctx, "logits", "labels", ignore_index=ignore_index)

    return standard_op_function(OP_TYPE, {"logits": ["N", "C"]}, OUTPUTS, write, opset, reads)


def standard_op_function(op_type: str, float_inputs: dict, outputs, write, opset: int, reads) -> onnx.FunctionProto:
    """The function body ``write(ctx, ignore_index)`` emits (returning the outputs' values
    in ``outputs``' order) over the float32 ``float_inputs`` ({name: dims}) and int64
    ``labels``, with ``ignore_index`` a reference to the node's attribute when ``reads``
    holds it (None otherwise): SoftmaxCrossEntropy's and BiasSoftmaxCrossEntropy's."""
    from normgrad.graphs.context import GradientContext

    infos = [oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, dims) for name, dims in float_inputs.items()]
    graph = oh.make_graph([], op_type, infos + [oh.make_tensor_value_info("labels", onnx.TensorProto.INT64, ["N"])], [])
    ctx = GradientContext(graph, opset, set())
    ctx.scope(op_type)
    ignore_index = _IGNORE_INDEX_MARK if "ignore_index" in reads else None
    renamed = dict(zip(write(ctx, ignore_index), outputs))
    nodes = []
    for node in ctx.nodes:
        node = onnx.NodeProto.FromString(node.SerializeToString())
        node.input[:] = [renamed.get(name, name) for name in node.input]
        node.output[:] = [renamed.get(name, name) for name in node.output]
        value = node.attribute[0].t if node.op_type == "Constant" and node.attribute[0].HasField("t") else None
        if value is not None and value.data_type == onnx.TensorProto.INT64 and onh.to_array(value).tolist() == \
                _IGNORE_INDEX_MARK:
            del node.attribute[:]
            node.attribute.append(onnx.AttributeProto(name="value_int", ref_attr_name="ignore_index",
                                                      type=onnx.AttributeProto.INT))
        nodes.append(node)
    inputs = list(float_inputs)
    inputs[1:1] = ["labels"]
    return oh.make_function(_common.DOMAIN, op_type, inputs, list(outputs), nodes, [oh.make_opsetid("", opset)],
                            attribute_protos=[oh.make_attribute("ignore_index", NO_IGNORE_INDEX)])
