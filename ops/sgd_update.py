"""SGDUpdate: one torch.optim.SGD step of one float32 parameter, in one pass.

The optimizer graphs (``normgrad.graphs.optimizers``, SGD) write one node per parameter,
which reads param, grad and the momentum buffer once and writes the parameter and the
buffer, in place in the trainer; as AdamUpdate, it takes the trainer's ``applied`` and then
writes nothing at all (no per-tensor Where and second copy of every parameter).

Inputs:
    param (float): the parameter.
    grad (float): its gradient; shape of ``param``.
    lr (float): scalar; the learning rate.
    momentum_buffer (float, optional): the momentum buffer; shape of ``param``. Omitted: zeros.
    momentum (float, optional): scalar; omitted: 0, no momentum (torch's ``if momentum != 0``:
        then momentum_buffer_next is momentum_buffer).
    one_minus_dampening (float, optional): scalar; 1 - dampening, the float32 rounding of the
        double value as torch's Python floats. Omitted: 1.
    weight_decay (float, optional): scalar; L2 weight decay: param * weight_decay is added to
        the (scaled) gradient, unless it is 0 (torch's ``if weight_decay != 0``).
    grad_scale (float, optional): scalar the gradient is multiplied by first (gradient clipping).
    first_step (bool, optional): scalar; true: the buffer becomes the gradient (torch's first
        step, when the state has no buffer yet). Omitted: false.
    nesterov (bool, optional): scalar; Nesterov momentum. Omitted: false.
    applied (bool, optional): scalar; false: no update (the loss or a gradient is not finite).

The update is skipped (every output equals its input, bitwise; written in place, nothing is
written at all) when ``applied`` is false, and when a scalar input breaks the rule: every
float scalar finite, and lr, momentum, weight_decay >= 0 (as torch.optim.SGD refuses).

Outputs (float, shape of ``param``): param_next and, optional, momentum_buffer_next. Per
element, in float32, in this order (the function body's ops and the roundings of the
separate ops of the optimizer graph before this operator):

    g = grad * grad_scale                             (g = grad without grad_scale)
    g = g + param * weight_decay                      (only with weight_decay != 0)
    with momentum != 0:
        momentum_buffer_next = g                      (first_step)
                             = momentum_buffer * momentum + g * one_minus_dampening   (otherwise)
        g = g + momentum_buffer_next * momentum       (nesterov)
          = momentum_buffer_next                      (otherwise)
    param_next = param - g * lr

The checks, the skip, the gradient's scaling and L2 term, the schema and the body's frame
are shared with AdamUpdate (``normgrad.ops._update``).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import onnx

import normgrad.ops._common as _common
import normgrad.ops._update as _update

__all__ = list(_update.MODULE_API)

SPEC = _update.UpdateSpec(
    op_type="SGDUpdate",
    inputs=("param", "grad", "lr", "momentum_buffer", "momentum", "one_minus_dampening", "weight_decay", "grad_scale",
            "first_step", "nesterov", "applied"),
    outputs=("param_next", "momentum_buffer_next"),
    tensors=("param", "grad", "momentum_buffer"),
    scalar_if_omitted={"momentum_buffer": 0.0, "momentum": 0.0, "one_minus_dampening": 1.0, "weight_decay": 0.0,
                       "grad_scale": 1.0, "first_step": False, "nesterov": False, "applied": True},
    nonnegative=("lr", "momentum", "weight_decay"),
    kept={"param_next": "param", "momentum_buffer_next": "momentum_buffer"},
    bools=("first_step", "nesterov", "applied"),
)
(OP_TYPE, INPUTS, OUTPUTS, ATTRIBUTES, OPTIONAL, BOOL_INPUTS, SCALAR_IF_OMITTED, ONES_IF_OMITTED, HYPERPARAMETERS,
 OUTPUT_SHAPE_FROM, TYPES, ELEMENTWISE) = _update.declarations(SPEC)


class Result(NamedTuple):
    """The two outputs."""

    param_next: np.ndarray
    momentum_buffer_next: np.ndarray


def skip_reason(arrays) -> str:
    """Why the update is skipped ('' when it runs): ``applied`` false, or a scalar input
    breaking the rule. ``arrays``: {input name: array or None}."""
    return _update.skip_reason(SPEC, arrays)


def validate(*args, **kwargs):
    """Checks the inputs (positional in :data:`INPUTS` order, or by name) against the contract.

    Returns:
        {input name: array (None for an omitted optional one)}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    return _update.validate(SPEC, args, kwargs)


def _step(tensor, scalar, flag) -> Result:
    """The contract's update, in its order."""
    param, buffer = tensor("param"), tensor("momentum_buffer")
    g = _update.scaled_gradient(tensor("grad"), param, scalar)
    momentum = scalar("momentum")
    if momentum != 0:
        buffer = g if flag("first_step") else buffer * momentum + g * scalar("one_minus_dampening")
        g = g + buffer * momentum if flag("nesterov") else buffer
    return Result(param - g * scalar("lr"), buffer)


def reference(*args, **kwargs) -> Result:
    """The operator in float64 NumPy: the truth every other implementation is tested against
    (the scalar inputs taken as float32, as a node's are).

    Returns:
        A :class:`Result` in param's dtype (float32; float64 for float64 evaluations).
    """
    return Result(*_update.reference(SPEC, validate(*args, **kwargs), _step))


def python_kernel(*args, **kwargs) -> Result:
    """What the float32 Python kernel runs: the contract's float32 arithmetic, so it gives
    the C++ kernel's bits. A skipped update for a broken rule is reported on the
    ``normgrad`` logger (as the kernels' other errors) and gives the inputs unchanged."""
    return Result(*_update.python_kernel(SPEC, validate(*args, **kwargs), _step))


def schema():
    """The ONNX schema, with type and shape inference."""
    return _update.schema(SPEC, __doc__)


def function_body(opset: int = _common.ONNX_OPSET, reads: Sequence[str] = ()) -> onnx.FunctionProto:
    """The operator in standard ONNX ops, for runtimes without a kernel: the contract's
    float32 ops in its order, each output then Where(condition, update, input) (a body cannot
    skip work; a runtime momentum of 0 and nesterov are Where too); see
    :func:`_update.function_body` for ``reads``."""
    lines, grad = _update.scaled_gradient_lines(reads)
    results = {}
    if "momentum" in reads:
        buffer = "momentum_buffer" if "momentum_buffer" in reads else "zero"
        damped = "damped" if "one_minus_dampening" in reads else grad
        lines += [f"damped = Mul ({grad}, one_minus_dampening)"] if damped == "damped" else []
        lines += [f"buffer_kept = Mul ({buffer}, momentum)", f"buffer_later = Add (buffer_kept, {damped})"]
        new_buffer = "buffer_later"
        if "first_step" in reads:
            lines.append(f"buffer_update = Where (first_step, {grad}, buffer_later)")
            new_buffer = "buffer_update"
        momentum_grad = new_buffer
        if "nesterov" in reads:
            lines += [f"look_ahead = Mul ({new_buffer}, momentum)", f"nesterov_grad = Add ({grad}, look_ahead)",
                      f"momentum_grad = Where (nesterov, nesterov_grad, {new_buffer})"]
            momentum_grad = "momentum_grad"
        lines += ["no_momentum = Equal (momentum, zero)", f"step_grad = Where (no_momentum, {grad}, {momentum_grad})",
                  # momentum > 0 is momentum != 0 wherever run is true (the rule: momentum >= 0); not Not,
                  # which makes onnxruntime-openvino 1.24's partition cyclic
                  "has_momentum = Greater (momentum, zero)", "run_momentum = And (run, has_momentum)"]
        grad = "step_grad"
    lines += [f"scaled_step = Mul ({grad}, lr)", "updated = Sub (param, scaled_step)"]
    results["param_next"] = ("updated", "run")
    if "momentum" in reads and "momentum_buffer" in reads:
        results["momentum_buffer_next"] = (new_buffer, "run_momentum")
    elif "momentum_buffer" in reads:  # no momentum: the buffer as it is
        results["momentum_buffer_next"] = ("momentum_buffer", None)
    else:  # the omitted buffer: zeros (momentum would update them, but without it none is read)
        lines += ["param_shape = Shape (param)", "zeros = ConstantOfShape (param_shape)"]
        if "momentum" in reads:
            lines.append(f"buffer_zeros = Where (run_momentum, {new_buffer}, zeros)")
        results["momentum_buffer_next"] = ("buffer_zeros" if "momentum" in reads else "zeros", None)
    return _update.function_body(SPEC, opset, reads, lines, results)
