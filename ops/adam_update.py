"""AdamUpdate: one torch.optim.Adam/AdamW step (amsgrad too) of one float32 parameter, in one pass.

The optimizer graphs (``normgrad.graphs.optimizers``, Adam and AdamW) write one node per
parameter: the step as separate ONNX ops reads and writes the parameter-sized
tensors about fourteen times (ResNet-18: 12% of a training step on the CPU); the kernel
reads param, grad, exp_avg and exp_avg_sq once and writes three tensors. torch's
``_fused_adamw_`` and onnxruntime-training's ``AdamWOptimizer`` are the same idea.

Inputs:
    param (float): the parameter.
    grad (float): its gradient; shape of ``param``.
    exp_avg (float): the first-moment state; shape of ``param``.
    exp_avg_sq (float): the second-moment state; shape of ``param``.
    step_size (float): scalar; lr / (1 - beta1^step).
    correction2_sqrt (float): scalar; sqrt(1 - beta2^step).
    one_minus_beta1, beta2, one_minus_beta2 (float): scalars, given separately so that each
        is the float32 rounding of the double value, as torch's Python floats are.
    epsilon (float): scalar added to the denominator.
    param_scale (float, optional): scalar; AdamW's decoupled weight decay 1 - lr * weight_decay.
    grad_scale (float, optional): scalar the gradient is multiplied by first (gradient clipping).
    weight_decay (float, optional): scalar; Adam's L2 weight decay: param * weight_decay is
        added to the (scaled) gradient, unless it is 0 (torch's ``if weight_decay != 0``).
    applied (bool, optional): scalar; false: no update (the loss or a gradient is not finite).
    max_exp_avg_sq (float, optional): amsgrad's running maximum of exp_avg_sq; shape of
        ``param``. Omitted: zeros, which makes it exp_avg_sq_next (Adam without amsgrad).

The update is skipped (every output equals its input, bitwise; written in place, nothing is
written at all) when ``applied`` is false, and when a scalar input breaks the hyperparameters'
rule: every scalar finite, and one_minus_beta1, beta2, one_minus_beta2, epsilon >= 0 (an
epsilon of NaN would make every weight NaN). The C++ kernel, the Python kernel and the
function body all skip alike; the Python kernel also reports the broken rule.

Outputs (float, shape of ``param``): param_next, exp_avg_next, exp_avg_sq_next and, optional,
max_exp_avg_sq_next. Per element,
in float32, in this order (the function body's ops; the C++ and Python kernels give exactly
these roundings, as the function body does on onnxruntime 1.32 and the separate ops of the
optimizer graph did before; 1.19.2 runs the body 1 ulp off in a few percent of elements):

    g = grad * grad_scale                             (g = grad without grad_scale)
    g = g + param * weight_decay                      (only with weight_decay != 0)
    exp_avg_next = exp_avg + (g - exp_avg) * one_minus_beta1
    exp_avg_sq_next = exp_avg_sq * beta2 + (g * g) * one_minus_beta2
    max_exp_avg_sq_next = max(max_exp_avg_sq, exp_avg_sq_next)   (NaN if either is; exp_avg_sq_next when omitted)
    param_next = param * param_scale - exp_avg_next / (sqrt(max_exp_avg_sq_next) / correction2_sqrt + epsilon) * step_size
                                                      (param alone without param_scale)

An omitted optional input is no operation at all, in the kernels and in the function body
(``add_functions`` gives a model the body that reads what its nodes give). The checks, the
skip, the gradient's scaling and L2 term, the schema and the body's frame are shared with
SGDUpdate (``normgrad.ops._update``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np
import onnx

import normgrad.ops._common as _common
import normgrad.ops._update as _update

__all__ = list(_update.MODULE_API)

SPEC = _update.UpdateSpec(
    op_type="AdamUpdate",
    inputs=("param", "grad", "exp_avg", "exp_avg_sq", "step_size", "correction2_sqrt", "one_minus_beta1", "beta2",
            "one_minus_beta2", "epsilon", "param_scale", "grad_scale", "weight_decay", "applied", "max_exp_avg_sq"),
    outputs=("param_next", "exp_avg_next", "exp_avg_sq_next", "max_exp_avg_sq_next"),
    tensors=("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    scalar_if_omitted={"param_scale": 1.0, "grad_scale": 1.0, "weight_decay": 0.0, "applied": True,
                       "max_exp_avg_sq": 0.0},
    nonnegative=("one_minus_beta1", "beta2", "one_minus_beta2", "epsilon"),
    kept={"param_next": "param", "exp_avg_next": "exp_avg", "exp_avg_sq_next": "exp_avg_sq",
          "max_exp_avg_sq_next": "max_exp_avg_sq"},
)
(OP_TYPE, INPUTS, OUTPUTS, ATTRIBUTES, OPTIONAL, BOOL_INPUTS, SCALAR_IF_OMITTED, ONES_IF_OMITTED, HYPERPARAMETERS,
 OUTPUT_SHAPE_FROM, TYPES, ELEMENTWISE) = _update.declarations(SPEC)
_TORCH_DEFAULTS = {"one_minus_beta1": 0.1, "beta2": 0.999, "one_minus_beta2": 0.001, "epsilon": 1e-8}


class Result(NamedTuple):
    """The four outputs (max_exp_avg_sq_next is exp_avg_sq_next without amsgrad)."""

    param_next: np.ndarray
    exp_avg_next: np.ndarray
    exp_avg_sq_next: np.ndarray
    max_exp_avg_sq_next: Optional[np.ndarray] = None


def skip_reason(arrays) -> str:
    """Why the update is skipped ('' when it runs): ``applied`` false, or a scalar input
    breaking the hyperparameters' rule. ``arrays``: {input name: array or None}."""
    return _update.skip_reason(SPEC, arrays)


def validate(*args, **kwargs):
    """Checks the inputs (positional in :data:`INPUTS` order, or by name) against the contract
    (the hyperparameter scalars default to torch's).

    Returns:
        {input name: array (None for an omitted optional one)}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    return _update.validate(SPEC, args, kwargs, _TORCH_DEFAULTS)


def _step(tensor, scalar, flag) -> Result:
    """The contract's update, in its order."""
    param, exp_avg, exp_avg_sq = tensor("param"), tensor("exp_avg"), tensor("exp_avg_sq")
    g = _update.scaled_gradient(tensor("grad"), param, scalar)
    avg = exp_avg + (g - exp_avg) * scalar("one_minus_beta1")
    sq = exp_avg_sq * scalar("beta2") + (g * g) * scalar("one_minus_beta2")
    most = np.maximum(tensor("max_exp_avg_sq"), sq)
    denominator = np.sqrt(most) / scalar("correction2_sqrt") + scalar("epsilon")
    return Result(param * scalar("param_scale") - avg / denominator * scalar("step_size"), avg, sq, most)


def reference(*args, **kwargs) -> Result:
    """The operator in float64 NumPy: the truth every other implementation is tested against
    (the scalar inputs taken as float32, as a node's are).

    Returns:
        A :class:`Result` in param's dtype (float32; float64 for float64 evaluations).
    """
    return _without_amsgrad(validate(*args, **kwargs), _update.reference)


def python_kernel(*args, **kwargs) -> Result:
    """What the float32 Python kernel runs: the contract's float32 arithmetic, so it gives
    the C++ kernel's bits. A skipped update for a broken hyperparameter rule is reported on
    the ``normgrad`` logger (as the kernels' other errors) and gives the inputs unchanged."""
    return _without_amsgrad(validate(*args, **kwargs), _update.python_kernel)


def _without_amsgrad(arrays, evaluate) -> Result:
    """The outputs by ``evaluate``; max_exp_avg_sq_next is exp_avg_sq_next when max_exp_avg_sq
    is omitted (skipped too: the kernels and the body give it so)."""
    result = Result(*evaluate(SPEC, arrays, _step))
    return result._replace(max_exp_avg_sq_next=result.exp_avg_sq_next) if arrays["max_exp_avg_sq"] is None else result


def schema():
    """The ONNX schema, with type and shape inference."""
    return _update.schema(SPEC, __doc__)


def function_body(opset: int = _common.ONNX_OPSET, reads: Sequence[str] = ()) -> onnx.FunctionProto:
    """The operator in standard ONNX ops, for runtimes without a kernel: the contract's
    float32 ops in its order, each output then Where(run, update, input) (a body cannot skip
    work; ``run``: the scalars keep the rule and ``applied``); see :func:`_update.function_body`
    for ``reads``."""
    lines, grad = _update.scaled_gradient_lines(reads)
    param = "param"
    if "param_scale" in reads:
        lines.append("decayed = Mul (param, param_scale)")
        param = "decayed"
    amsgrad = "max_exp_avg_sq" in reads
    lines += [
        f"g_minus_avg = Sub ({grad}, exp_avg)",
        "avg_step = Mul (g_minus_avg, one_minus_beta1)",
        "avg_next = Add (exp_avg, avg_step)",
        "sq_kept = Mul (exp_avg_sq, beta2)",
        f"g_sq = Mul ({grad}, {grad})",
        "sq_step = Mul (g_sq, one_minus_beta2)",
        "sq_next = Add (sq_kept, sq_step)",
        *(["max_next = Max (max_exp_avg_sq, sq_next)"] if amsgrad else []),
        f"root = Sqrt ({'max_next' if amsgrad else 'sq_next'})",
        "corrected = Div (root, correction2_sqrt)",
        "denominator = Add (corrected, epsilon)",
        "ratio = Div (avg_next, denominator)",
        "update = Mul (ratio, step_size)",
        f"updated = Sub ({param}, update)",
    ]
    results = {"param_next": ("updated", "run"), "exp_avg_next": ("avg_next", "run"),
               "exp_avg_sq_next": ("sq_next", "run"),
               # omitted: max(0, exp_avg_sq_next), which is exp_avg_sq_next as it is
               "max_exp_avg_sq_next": ("max_next", "run") if amsgrad else ("exp_avg_sq_next", None)}
    return _update.function_body(SPEC, opset, reads, lines, results)
