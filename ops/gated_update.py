"""GatedUpdate: a state tensor's next value, or the tensor itself when the step is not applied.

The trainer's gate (``normgrad._session._gate_state_updates``) writes one per state update
that is not an optimizer update taking ``applied`` itself (AdamUpdate, SGDUpdate): BatchNorm's
running statistics, whose update onnxruntime's BatchNormalization computes. They are
per-channel vectors, so the update is no copy worth avoiding; the node makes the write wait
for the step's gate and, in place over ``value``, writes nothing when it is false.

Inputs:
    value (float): the state tensor.
    update (float): its next value when the step is applied; shape of ``value``.
    applied (bool): scalar; false: the output is ``value``, bitwise.

Output (float, shape of ``value``): value_next = update if applied else value.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import onnx

import normgrad.ops._common as _common
import normgrad.ops._update as _update

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OPTIONAL", "BOOL_INPUTS", "HYPERPARAMETERS", "ELEMENTWISE",
           "SCALAR_IF_OMITTED", "ONES_IF_OMITTED", "OUTPUT_SHAPE_FROM", "TYPES", "SPEC", "Result", "validate",
           "reference", "python_kernel", "schema", "function_body"]

SPEC = _update.UpdateSpec(op_type="GatedUpdate", inputs=("value", "update", "applied"), outputs=("value_next",),
                          tensors=("value", "update"), scalar_if_omitted={}, nonnegative=(),
                          kept={"value_next": "value"})
(OP_TYPE, INPUTS, OUTPUTS, ATTRIBUTES, OPTIONAL, BOOL_INPUTS, SCALAR_IF_OMITTED, ONES_IF_OMITTED, HYPERPARAMETERS,
 OUTPUT_SHAPE_FROM, TYPES, ELEMENTWISE) = _update.declarations(SPEC)


class Result(NamedTuple):
    """The output."""

    value_next: np.ndarray


def validate(*args, **kwargs):
    """Checks the inputs against the contract: {input name: array}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    return _update.validate(SPEC, args, kwargs)


def _step(tensor, scalar, flag) -> Result:
    return Result(tensor("update"))


def reference(*args, **kwargs) -> Result:
    """The operator in NumPy (exact: it selects, it computes nothing)."""
    return Result(*_update.reference(SPEC, validate(*args, **kwargs), _step))


def python_kernel(*args, **kwargs) -> Result:
    """What the float32 Python kernel runs."""
    return Result(*_update.python_kernel(SPEC, validate(*args, **kwargs), _step))


def schema():
    """The ONNX schema, with type and shape inference."""
    return _update.schema(SPEC, __doc__)


def function_body(opset: int = _common.ONNX_OPSET, reads: Sequence[str] = ()) -> onnx.FunctionProto:
    """The operator in standard ONNX ops: Where(applied, update, value)."""
    return _update.function_body(SPEC, opset, reads, [], {"value_next": ("update", "run")})
