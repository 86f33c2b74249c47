"""AdamUpdate: one torch.optim.Adam/AdamW step of one float32 parameter, in one pass.

The optimizer graphs (``normgrad.graphs.optimizers``, Adam and AdamW without amsgrad) write
one node per parameter: the step as separate ONNX ops reads and writes the parameter-sized
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

The update is skipped (every output equals its input, bitwise; written in place, nothing is
written at all) when ``applied`` is false, and when a scalar input breaks the hyperparameters'
rule: every scalar finite, and one_minus_beta1, beta2, one_minus_beta2, epsilon >= 0 (an
epsilon of NaN would make every weight NaN). The C++ kernel, the Python kernel and the
function body all skip alike; the Python kernel also reports the broken rule.

Outputs (float, shape of ``param``): param_next, exp_avg_next, exp_avg_sq_next. Per element,
in float32, in this order (the function body's ops; the C++ and Python kernels give exactly
these roundings, as the function body does on onnxruntime 1.32 and the separate ops of the
optimizer graph did before; 1.19.2 runs the body 1 ulp off in a few percent of elements):

    g = grad * grad_scale                             (g = grad without grad_scale)
    g = g + param * weight_decay                      (only with weight_decay != 0)
    exp_avg_next = exp_avg + (g - exp_avg) * one_minus_beta1
    exp_avg_sq_next = exp_avg_sq * beta2 + (g * g) * one_minus_beta2
    param_next = param * param_scale - exp_avg_next / (sqrt(exp_avg_sq_next) / correction2_sqrt + epsilon) * step_size
                                                      (param alone without param_scale)

An omitted optional input is no operation at all, in the kernels and in the function body
(``add_functions`` gives a model the body that reads what its nodes give).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import onnx
import onnx.parser
from onnx.defs import OpSchema

from normgrad.ops import _common
from normgrad.ops._common import NormgradInputError

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OPTIONAL", "BOOL_INPUTS", "HYPERPARAMETERS", "ELEMENTWISE",
           "SCALAR_IF_OMITTED", "ONES_IF_OMITTED", "OUTPUT_SHAPE_FROM", "TYPES", "Result",
           "skip_reason", "validate", "reference", "python_kernel", "schema", "function_body"]

OP_TYPE = "AdamUpdate"
INPUTS = ("param", "grad", "exp_avg", "exp_avg_sq", "step_size", "correction2_sqrt", "one_minus_beta1", "beta2",
          "one_minus_beta2", "epsilon", "param_scale", "grad_scale", "weight_decay", "applied")
OUTPUTS = ("param_next", "exp_avg_next", "exp_avg_sq_next")
ATTRIBUTES: dict = {}
OPTIONAL = ("param_scale", "grad_scale", "weight_decay", "applied")
BOOL_INPUTS = ("applied",)
SCALAR_IF_OMITTED = {"param_scale": 1.0, "grad_scale": 1.0, "weight_decay": 0.0, "applied": True}
"""What an omitted optional input means: a function body that reads it feeds nodes omitting it
this; the Python bridge, which needs every input, feeds it too (shaped like step_size, a scalar)."""
ONES_IF_OMITTED = {name: ("step_size", None) for name in OPTIONAL}
"""The Python bridge feeds an omitted optional input its SCALAR_IF_OMITTED value, shaped like step_size."""
HYPERPARAMETERS = ("one_minus_beta1", "beta2", "one_minus_beta2", "epsilon")
"""The scalar inputs that must be >= 0 (and finite, as every scalar) for the update to run."""
OUTPUT_SHAPE_FROM = {name: ("param", None) for name in OUTPUTS}
"""Each output's shape as (input, axis): input.shape[axis], or the whole shape for None."""
TYPES = ("tensor(float)",)
ELEMENTWISE = True
"""Each output element reads only the same element of the tensor inputs, before it is
written: an output may share its input's buffer (``normgrad.graphs.structure.in_place_updates``)."""
_TENSORS, _SCALARS = INPUTS[:4], INPUTS[4:]
_TORCH_DEFAULTS = {"one_minus_beta1": 0.1, "beta2": 0.999, "one_minus_beta2": 0.001, "epsilon": 1e-8}


class Result(NamedTuple):
    """The three outputs."""

    param_next: np.ndarray
    exp_avg_next: np.ndarray
    exp_avg_sq_next: np.ndarray


def skip_reason(arrays) -> str:
    """Why the update is skipped ('' when it runs): ``applied`` false, or a scalar input
    breaking the hyperparameters' rule. ``arrays``: {input name: array or None}."""
    applied = arrays.get("applied")
    if applied is not None and not bool(np.asarray(applied).reshape(())):
        return "applied is false"
    for name in _SCALARS:
        value = arrays.get(name)
        if value is None or name in BOOL_INPUTS:
            continue
        value = float(np.asarray(value).reshape(()))
        if not np.isfinite(value) or (name in HYPERPARAMETERS and value < 0):
            rule = "a finite number >= 0" if name in HYPERPARAMETERS else "finite"
            return f"input '{name}' must be {rule}; got {value!r}"
    return ""


def validate(param, grad, exp_avg, exp_avg_sq, step_size, correction2_sqrt, one_minus_beta1=_TORCH_DEFAULTS["one_minus_beta1"],
             beta2=_TORCH_DEFAULTS["beta2"], one_minus_beta2=_TORCH_DEFAULTS["one_minus_beta2"],
             epsilon=_TORCH_DEFAULTS["epsilon"], param_scale=None, grad_scale=None, weight_decay=None, applied=None):
    """Checks the inputs against the contract (the hyperparameter scalars default to torch's).

    Returns:
        {input name: array (None for an omitted optional one)}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    arrays = {}
    given = (param, grad, exp_avg, exp_avg_sq, step_size, correction2_sqrt, one_minus_beta1, beta2, one_minus_beta2,
             epsilon, param_scale, grad_scale, weight_decay, applied)
    for name, value in zip(INPUTS, given):
        if value is None and name in OPTIONAL:
            arrays[name] = None
            continue
        array = np.asarray(value, np.float32 if isinstance(value, float) else None)
        wanted = (np.bool_,) if name in BOOL_INPUTS else (np.float32, np.float64)
        if array.dtype not in wanted:
            raise NormgradInputError(f"{OP_TYPE}: input '{name}' must be {'bool' if name in BOOL_INPUTS else 'float32'}; "
                                     f"got {array.dtype}")
        if name in _SCALARS and array.size != 1:
            raise NormgradInputError(f"{OP_TYPE}: input '{name}' must be a scalar; got shape {list(array.shape)}")
        if name in _TENSORS[1:]:
            _common.check_same_shape(OP_TYPE, name, array, "param", arrays["param"])
        arrays[name] = array
    return arrays


def _step(xp_float, a) -> Result:
    """The update of the checked inputs ``a`` in the arithmetic of ``xp_float`` (np.float64
    or np.float32), in the contract's order; the inputs themselves when it is skipped."""
    param, grad, exp_avg, exp_avg_sq = (np.asarray(a[name], xp_float) for name in _TENSORS)
    if skip_reason(a):
        return Result(param.copy(), exp_avg.copy(), exp_avg_sq.copy())
    f = lambda name: np.asarray(a[name], xp_float).reshape(())  # noqa: E731  (a scalar of that type)
    g = grad if a["grad_scale"] is None else grad * f("grad_scale")
    if a["weight_decay"] is not None and f("weight_decay") != 0:
        g = g + param * f("weight_decay")
    avg = exp_avg + (g - exp_avg) * f("one_minus_beta1")
    sq = exp_avg_sq * f("beta2") + (g * g) * f("one_minus_beta2")
    denominator = np.sqrt(sq) / f("correction2_sqrt") + f("epsilon")
    scaled = param if a["param_scale"] is None else param * f("param_scale")
    return Result(scaled - avg / denominator * f("step_size"), avg, sq)


def reference(*args, **kwargs) -> Result:
    """The operator in float64 NumPy: the truth every other implementation is tested against
    (the scalar inputs taken as float32, as a node's are).

    Returns:
        A :class:`Result` in param's dtype (float32; float64 for float64 evaluations).
    """
    arrays = validate(*args, **kwargs)
    dtype = arrays["param"].dtype
    arrays.update({name: np.float32(arrays[name]) for name in _SCALARS if arrays[name] is not None
                   and name not in BOOL_INPUTS and arrays[name].dtype == np.float32})
    return Result(*(out.astype(dtype) for out in _step(np.float64, arrays)))


def python_kernel(*args, **kwargs) -> Result:
    """What the float32 Python kernel runs: the contract's float32 arithmetic, so it gives
    the C++ kernel's bits. A skipped update for a broken hyperparameter rule is reported on
    the ``normgrad`` logger (as the kernels' other errors) and gives the inputs unchanged."""
    arrays = validate(*args, **kwargs)
    reason = skip_reason(arrays)
    if reason and reason != "applied is false":
        import logging

        logging.getLogger("normgrad").error(f"{OP_TYPE}: {reason}; the update is skipped (float32 Python kernel)")
    return _step(np.float32, arrays)


def _infer(ctx) -> None:
    param_type = _common.input_tensor_type(ctx, 0)
    if param_type is not None:
        for index in range(len(OUTPUTS)):
            ctx.set_output_type(index, _common.make_output_type(param_type.elem_type, _common.known_dims(param_type)))


def schema() -> OpSchema:
    """The ONNX schema, with type and shape inference."""
    param = OpSchema.FormalParameter
    optional = OpSchema.FormalParameterOption.Optional
    inputs = [param(name, "B" if name in BOOL_INPUTS else "T", f"See the operator's documentation: {name}.",
                    param_option=optional if name in OPTIONAL else OpSchema.FormalParameterOption.Single) for name in INPUTS]
    return _common.make_schema(
        OP_TYPE,
        __doc__,
        inputs=inputs,
        outputs=[param(name, "T", f"The step's {name.removesuffix('_next')}; shape of param.") for name in OUTPUTS],
        type_docs={"T": "float32.", "B": (("tensor(bool)",), "bool.")},
        infer=_infer,
        types=TYPES,
    )


def function_body(opset: int = _common.ONNX_OPSET, reads: Sequence[str] = ()) -> onnx.FunctionProto:
    """The operator in standard ONNX ops, for runtimes without a kernel: the contract's
    float32 ops in its order, each output then Where(run, update, input) (a body cannot skip
    work; ``run``: the scalars keep the rule and ``applied``). The optional inputs in
    ``reads`` are formal inputs and read; the others are not (a body cannot test whether an
    input is present), so a model whose nodes give neither gets no operation for them."""
    required = len(INPUTS) - len(OPTIONAL)
    formals = list(INPUTS[:max([INPUTS.index(n) + 1 for n in reads] + [required])])
    grad, param = "grad", "param"
    lines = ["zero = Constant <value_float: float = 0.0> ()"]
    if "grad_scale" in reads:
        lines.append("scaled_grad = Mul (grad, grad_scale)")
        grad = "scaled_grad"
    if "weight_decay" in reads:
        lines += ["decay_term = Mul (param, weight_decay)", f"decayed_grad = Add ({grad}, decay_term)",
                  "no_decay = Equal (weight_decay, zero)", f"l2_grad = Where (no_decay, {grad}, decayed_grad)"]
        grad = "l2_grad"
    if "param_scale" in reads:
        lines.append("decayed = Mul (param, param_scale)")
        param = "decayed"
    scalars = [n for n in formals if n in _SCALARS and n not in BOOL_INPUTS and (n not in OPTIONAL or n in reads)]
    lines += [f"{n}_zero = Mul ({n}, zero)" for n in scalars]  # NaN for an infinite or NaN scalar
    lines += [f"scalar_zeros = Sum ({', '.join(f'{n}_zero' for n in scalars)})",
              "finite = Equal (scalar_zeros, scalar_zeros)",
              f"lowest = Min ({', '.join(HYPERPARAMETERS)})",
              "not_negative = GreaterOrEqual (lowest, zero)",
              "run_rule = And (finite, not_negative)"]
    lines.append("run = And (run_rule, applied)" if "applied" in reads else "run = Identity (run_rule)")
    body = "\n            ".join(lines)
    return onnx.parser.parse_function(
        f"""
        <domain: "{_common.DOMAIN}", opset_import: ["" : {opset}]>
        {OP_TYPE} ({", ".join(formals)}) => ({", ".join(OUTPUTS)})
        {{
            {body}
            g_minus_avg = Sub ({grad}, exp_avg)
            avg_step = Mul (g_minus_avg, one_minus_beta1)
            avg_next = Add (exp_avg, avg_step)
            sq_kept = Mul (exp_avg_sq, beta2)
            g_sq = Mul ({grad}, {grad})
            sq_step = Mul (g_sq, one_minus_beta2)
            sq_next = Add (sq_kept, sq_step)
            root = Sqrt (sq_next)
            corrected = Div (root, correction2_sqrt)
            denominator = Add (corrected, epsilon)
            ratio = Div (avg_next, denominator)
            update = Mul (ratio, step_size)
            updated = Sub ({param}, update)
            param_next = Where (run, updated, param)
            exp_avg_next = Where (run, avg_next, exp_avg)
            exp_avg_sq_next = Where (run, sq_next, exp_avg_sq)
        }}
        """
    )
