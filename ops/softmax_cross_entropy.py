"""SoftmaxCrossEntropy: torch's ``cross_entropy(logits, labels, reduction="mean")`` with
class-index labels, and its gradient with respect to the logits, in one node.

The step graphs' ``cross_entropy`` and ``causal_lm`` losses (``normgrad.graphs.losses``)
write it for float32 [samples, classes] logits without label smoothing; over a vocabulary
the standard-op form (Softmax, two ReduceMax, the label's log-probability, the weighted
gradient) makes about eight passes over [N, C], the kernel reads the logits once and
writes the gradient once. The function body is that standard-op form, node for node
(:func:`cross_entropy_standard_ops`).

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

from typing import NamedTuple, Optional

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError
from normgrad.ops.node_writer import NodeWriter

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "NO_IGNORE_INDEX", "ATTRIBUTES_READ_UNLESS_DEFAULT",
           "OUTPUT_SHAPE_FROM", "INPUT_DTYPES", "Result", "validate", "reference", "schema", "function_body",
           "checked_logits_and_labels", "schema_with_ignore_index", "standard_op_function", "cross_entropy_standard_ops",
           "softmax_cross_entropy_gradient"]

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


def cross_entropy_standard_ops(ctx: NodeWriter, output: str, labels: str, label_smoothing: float = 0.0,
                               ignore_index: Optional[int] = None) -> tuple:
    """torch's ``cross_entropy`` of logits ``output`` and class-index ``labels`` (the loss and
    its gradient, :func:`normgrad.graphs.losses.append_loss`'s) in standard ops (y of rank >= 2,
    any float type); the operator's function body.

    The gradient is softmax(y) times each sample's weight (1/count, 0 where ignored), its
    entry at the label lowered by (1 - ls) times the weight
    (:func:`softmax_cross_entropy_gradient`)."""
    probs = ctx.op("Softmax", output, axis=1)
    if ignore_index is None:
        safe, valid = labels, None
        count = ctx.op("CastLike", ctx.op("Size", labels), output)
    else:
        ignored = ctx.op("Equal", labels, ctx.op("Constant", value=onh.from_array(np.array(ignore_index, np.int64))))
        safe = ctx.op("Where", ignored, ctx.op("Constant", value=onh.from_array(np.array(0, np.int64))), labels)
        valid = ctx.op("CastLike", ctx.op("Not", ignored), output)
        count = ctx.reduce("ReduceSum", valid, None, keepdims=False)
    masked = (lambda value: value) if valid is None else (lambda value: ctx.op("Mul", value, valid))
    index = ctx.unsqueeze(safe, [1])
    if label_smoothing:  # the loss sums every class's log-probability
        log_probs = ctx.op("LogSoftmax", output, axis=1)
        picked = ctx.op("GatherElements", log_probs, index, axis=1)
    else:
        picked = _log_probability_at(ctx, output, probs, index)
    picked = ctx.op("Squeeze", picked, ctx.ints([1]))
    if valid is None and not label_smoothing:  # a plain mean (OpenVINO's EP leaves a ReduceSum to a scalar on the CPU)
        loss = ctx.op("Neg", ctx.reduce("ReduceMean", picked, None, keepdims=False))
    else:
        total = ctx.reduce("ReduceSum", masked(picked), None, keepdims=False)
        if label_smoothing:
            # the classes' count C as a scalar
            depth = ctx.op("CastLike", ctx.op("Squeeze", ctx.shape_of(output, start=1, end=2), ctx.ints([0])), output)
            smoothing_per_class = ctx.op("Div", ctx.scalar(label_smoothing, output), depth)
            total = ctx.op("Mul", total, ctx.scalar(1.0 - label_smoothing, output))
            class_sum = ctx.reduce("ReduceSum", masked(ctx.reduce("ReduceSum", log_probs, [1], keepdims=False)), None,
                                   keepdims=False)
            total = ctx.op("Add", total, ctx.op("Mul", class_sum, smoothing_per_class))
        loss = ctx.op("Neg", ctx.op("Div", total, count))
    weight = ctx.op("Div", ctx.scalar(1.0, output), count) if valid is None else ctx.unsqueeze(
        ctx.op("Div", valid, count), [1])
    shift = ctx.op("Mul", weight, smoothing_per_class) if label_smoothing else None
    lowered = ctx.op("Mul", weight, ctx.scalar(1.0 - label_smoothing, output)) if label_smoothing else weight
    return loss, softmax_cross_entropy_gradient(ctx, probs, index, weight, lowered, shift)


def _log_probability_at(ctx: NodeWriter, logits: str, probs: str, index: str) -> str:
    """log_softmax(logits) at ``index`` along axis 1, from ``probs`` = softmax(logits, axis 1)
    without a LogSoftmax pass over [samples, classes] (a vocabulary-sized one costs as much as
    the Softmax the gradient needs): with m the largest logit of a sample, the largest
    probability is 1 / sum_c exp(logits_c - m), at least 1/C, so never underflowing, and
    log_softmax(logits)_t = (logits_t - m) + log(max probs). Two reading passes (ReduceMax)
    instead of one writing a tensor. A non-finite logit makes the sample's whole softmax NaN,
    and its log-probability with it."""
    top = ctx.reduce("ReduceMax", logits, [1], keepdims=True)
    largest = ctx.reduce("ReduceMax", probs, [1], keepdims=True)
    below_top = ctx.op("Sub", ctx.op("GatherElements", logits, index, axis=1), top)
    return ctx.op("Add", below_top, ctx.op("Log", largest))


def softmax_cross_entropy_gradient(ctx: NodeWriter, probs: str, index: str, weight: str,
                                   lowered: Optional[str] = None, shift: Optional[str] = None) -> str:
    """probs * weight - shift, with each sample's entry at its label lowered by ``lowered``
    (``weight`` when None): the gradient of a weighted cross-entropy over the logits whose
    softmax (axis 1) is ``probs``. ``index`` holds the labels with a size-1 axis 1
    ([N, 1, d1, ...]); ``weight``, ``lowered`` and ``shift`` are scalars or shaped like ``index``.

    Written without a one-hot tensor: over a vocabulary, every [samples, classes] tensor is a
    pass over memory (OneHot alone cost onnxruntime 200 ms at [1024, 8192]); the label entries
    are read and written back with GatherElements and ScatterElements."""
    grad = ctx.op("Mul", probs, weight)
    if shift is not None:
        grad = ctx.op("Sub", grad, shift)
    at_label = ctx.op("Sub", ctx.op("GatherElements", grad, index, axis=1), lowered or weight)
    return ctx.op("ScatterElements", grad, index, at_label, axis=1)


_IGNORE_INDEX_MARK = -0x5EED0CE1055
"""A value the body builder passes for ``ignore_index``, whose Constant becomes a reference
to the node's attribute."""


def function_body(opset: int = _common.ONNX_OPSET, reads=()) -> onnx.FunctionProto:
    """The standard-op form the loss writes without the operator: the plain mean when
    ``reads`` is empty, the masked mean reading ``ignore_index`` when it holds it."""
    def write(ctx, ignore_index):
        return cross_entropy_standard_ops(ctx, "logits", "labels", ignore_index=ignore_index)

    return standard_op_function(OP_TYPE, {"logits": ["N", "C"]}, OUTPUTS, write, opset, reads)


def standard_op_function(op_type: str, float_inputs: dict, outputs, write, opset: int, reads) -> onnx.FunctionProto:
    """The function body ``write(ctx, ignore_index)`` emits (returning the outputs' values
    in ``outputs``' order) over the float32 ``float_inputs`` ({name: dims}) and int64
    ``labels``, with ``ignore_index`` a reference to the node's attribute when ``reads``
    holds it (None otherwise): SoftmaxCrossEntropy's and BiasSoftmaxCrossEntropy's."""
    infos = [oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, dims) for name, dims in float_inputs.items()]
    graph = oh.make_graph([], op_type, infos + [oh.make_tensor_value_info("labels", onnx.TensorProto.INT64, ["N"])], [])
    ctx = NodeWriter(graph, opset)
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
