"""AdamUpdate: one torch.optim.Adam/AdamW step of one float32 parameter, in one pass.

The optimizer graphs (``normgrad.graphs.optimizers``, Adam and AdamW without amsgrad) write
one node per parameter: the step as separate ONNX ops reads and writes the parameter-sized
tensors about fourteen times (ResNet-18: 12% of a training step on the CPU); the kernel
reads param, grad, exp_avg and exp_avg_sq once and writes three tensors. torch's
``_fused_adamw_`` and onnxruntime-training's ``AdamWOptimizer`` are the same idea.

Inputs:
    param (float): the parameter.
    grad (float): its gradient; shape of ``param``. (Adam's L2 weight decay is added to it
        before, as torch does.)
    exp_avg (float): the first-moment state; shape of ``param``.
    exp_avg_sq (float): the second-moment state; shape of ``param``.
    step_size (float): scalar; lr / (1 - beta1^step).
    correction2_sqrt (float): scalar; sqrt(1 - beta2^step).
    param_scale (float, optional): scalar; AdamW's decoupled weight decay 1 - lr * weight_decay.
    grad_scale (float, optional): scalar the gradient is multiplied by first (gradient clipping).

Attributes:
    beta2, one_minus_beta1, one_minus_beta2 (float): given separately so that each is the
        float32 rounding of the double value, as torch's Python floats are.
    epsilon (float): added to the denominator.

Outputs (float, shape of ``param``): param_next, exp_avg_next, exp_avg_sq_next. Per element,
in float32, in this order (the function body's ops; the C++ and Python kernels give exactly
these roundings, as the function body does on onnxruntime 1.32 and the separate ops of the
optimizer graph did before; 1.19.2 runs the body 1 ulp off in a few percent of elements):

    g = grad * grad_scale                             (g = grad without grad_scale)
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

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OPTIONAL", "ELEMENTWISE", "SCALAR_IF_OMITTED", "ONES_IF_OMITTED",
           "OUTPUT_SHAPE_FROM", "TYPES", "Result",
           "validate", "reference", "python_kernel", "schema", "function_body"]

OP_TYPE = "AdamUpdate"
INPUTS = ("param", "grad", "exp_avg", "exp_avg_sq", "step_size", "correction2_sqrt", "param_scale", "grad_scale")
OUTPUTS = ("param_next", "exp_avg_next", "exp_avg_sq_next")
ATTRIBUTES = {"beta2": 0.999, "one_minus_beta1": 0.1, "one_minus_beta2": 0.001, "epsilon": 1e-8}
OPTIONAL = ("param_scale", "grad_scale")
SCALAR_IF_OMITTED = {name: 1.0 for name in OPTIONAL}
"""What an omitted optional input means: a function body that reads it feeds nodes omitting it this."""
ONES_IF_OMITTED = {name: ("step_size", None) for name in OPTIONAL}
"""The Python bridge needs every input: an omitted one is fed ones shaped like step_size (a scalar)."""
OUTPUT_SHAPE_FROM = {name: ("param", None) for name in OUTPUTS}
"""Each output's shape as (input, axis): input.shape[axis], or the whole shape for None."""
TYPES = ("tensor(float)",)
ELEMENTWISE = True
"""Each output element reads only the same element of the tensor inputs, before it is
written: an output may share its input's buffer (``normgrad.graphs.structure.in_place_updates``)."""
_TENSORS, _SCALARS = INPUTS[:4], INPUTS[4:]


class Result(NamedTuple):
    """The three outputs."""

    param_next: np.ndarray
    exp_avg_next: np.ndarray
    exp_avg_sq_next: np.ndarray


def _check_attribute(name: str, value) -> None:
    """The attributes' rule, which the C++ kernel enforces at session creation too."""
    if not isinstance(value, (float, int)) or not np.isfinite(value) or value < 0:
        raise NormgradInputError(f"{OP_TYPE}: attribute '{name}' must be a finite float >= 0; got {value!r}")


def validate(param, grad, exp_avg, exp_avg_sq, step_size, correction2_sqrt, param_scale=None, grad_scale=None, **attributes):
    """Checks the inputs and attributes against the contract.

    Returns:
        The inputs as arrays in the order given (None for an omitted optional one), then the
        attributes with their defaults filled in.

    Raises:
        NormgradInputError: naming the offending input or attribute and the rule it broke.
    """
    unknown = sorted(set(attributes) - set(ATTRIBUTES))
    if unknown:
        raise NormgradInputError(f"{OP_TYPE}: unknown attribute '{unknown[0]}'; known: {sorted(ATTRIBUTES)}")
    attributes = {**ATTRIBUTES, **attributes}
    for name, value in attributes.items():
        _check_attribute(name, value)
    arrays = {}
    for name, value in zip(INPUTS, (param, grad, exp_avg, exp_avg_sq, step_size, correction2_sqrt, param_scale, grad_scale)):
        if value is None and name in OPTIONAL:
            arrays[name] = None
            continue
        array = np.asarray(value)
        if array.dtype not in (np.float32, np.float64):
            raise NormgradInputError(f"{OP_TYPE}: input '{name}' must be float32; got {array.dtype}")
        if name in _SCALARS and array.size != 1:
            raise NormgradInputError(f"{OP_TYPE}: input '{name}' must be a scalar; got shape {list(array.shape)}")
        if name in _TENSORS[1:]:
            _common.check_same_shape(OP_TYPE, name, array, "param", arrays["param"])
        arrays[name] = array
    return (*arrays.values(), attributes)


def _step(xp_float, param, grad, exp_avg, exp_avg_sq, step_size, correction2_sqrt, param_scale, grad_scale, a):
    """The update in the arithmetic of ``xp_float`` (np.float64 or np.float32), in the
    contract's order."""
    f = lambda v: np.asarray(v, xp_float).reshape(())  # noqa: E731  (a scalar of that type)
    param, grad, exp_avg, exp_avg_sq = (np.asarray(v, xp_float) for v in (param, grad, exp_avg, exp_avg_sq))
    g = grad if grad_scale is None else grad * f(grad_scale)
    avg = exp_avg + (g - exp_avg) * f(a["one_minus_beta1"])
    sq = exp_avg_sq * f(a["beta2"]) + (g * g) * f(a["one_minus_beta2"])
    denominator = np.sqrt(sq) / f(correction2_sqrt) + f(a["epsilon"])
    scaled = param if param_scale is None else param * f(param_scale)
    return scaled - avg / denominator * f(step_size), avg, sq


def reference(param, grad, exp_avg, exp_avg_sq, step_size, correction2_sqrt, param_scale=None, grad_scale=None, **attributes) -> Result:
    """The operator in float64 NumPy: the truth every other implementation is tested against.

    Returns:
        A :class:`Result` in param's dtype (float32; float64 for float64 evaluations).
    """
    *inputs, attributes = validate(param, grad, exp_avg, exp_avg_sq, step_size, correction2_sqrt, param_scale,
                                   grad_scale, **attributes)
    attributes = {k: float(np.float32(v)) for k, v in attributes.items()}  # the attributes are float32 in a node
    return Result(*(out.astype(inputs[0].dtype) for out in _step(np.float64, *inputs, attributes)))


def python_kernel(param, grad, exp_avg, exp_avg_sq, step_size, correction2_sqrt, param_scale=None, grad_scale=None, **attributes) -> Result:
    """What the float32 Python kernel runs: the contract's float32 arithmetic, so it gives
    the C++ kernel's bits."""
    *inputs, attributes = validate(param, grad, exp_avg, exp_avg_sq, step_size, correction2_sqrt, param_scale,
                                   grad_scale, **attributes)
    return Result(*_step(np.float32, *inputs, attributes))


def _infer(ctx) -> None:
    for name in ATTRIBUTES:  # onnx.checker (full_check) refuses what the kernels refuse
        attribute = ctx.get_attribute(name)
        if attribute is not None:
            _check_attribute(name, attribute.f if attribute.type == onnx.AttributeProto.FLOAT else None)
    param_type = _common.input_tensor_type(ctx, 0)
    if param_type is not None:
        for index in range(len(OUTPUTS)):
            ctx.set_output_type(index, _common.make_output_type(param_type.elem_type, _common.known_dims(param_type)))


def schema() -> OpSchema:
    """The ONNX schema, with type and shape inference."""
    param = OpSchema.FormalParameter
    optional = OpSchema.FormalParameterOption.Optional
    inputs = [param(name, "T", f"See the operator's documentation: {name}.",
                    param_option=optional if name in OPTIONAL else OpSchema.FormalParameterOption.Single) for name in INPUTS]
    return _common.make_schema(
        OP_TYPE,
        __doc__,
        inputs=inputs,
        outputs=[param(name, "T", f"The step's {name.removesuffix('_next')}; shape of param.") for name in OUTPUTS],
        type_docs={"T": "float32."},
        infer=_infer,
        attributes=[OpSchema.Attribute(name, onnx.helper.make_attribute(name, default), name) for name, default in ATTRIBUTES.items()],
        types=TYPES,
    )


def function_body(opset: int = _common.ONNX_OPSET, reads: Sequence[str] = ()) -> onnx.FunctionProto:
    """The operator in standard ONNX ops, for runtimes without a kernel: the contract's
    float32 ops in its order. The optional inputs in ``reads`` are formal inputs and read;
    the others are not (a body cannot test whether an input is present), so a model whose
    nodes give neither gets no operation for them."""
    formals = list(INPUTS[:max([INPUTS.index(n) + 1 for n in reads] + [len(INPUTS) - len(OPTIONAL)])])
    grad = "grad"
    lines = []
    if "grad_scale" in reads:
        lines.append("scaled_grad = Mul (grad, grad_scale)")
        grad = "scaled_grad"
    param = "param"
    if "param_scale" in reads:
        lines.append("decayed = Mul (param, param_scale)")
        param = "decayed"
    body = "\n            ".join(lines)
    defaults = ", ".join(f"{name}: float = {value!r}" for name, value in ATTRIBUTES.items())
    return onnx.parser.parse_function(
        f"""
        <domain: "{_common.DOMAIN}", opset_import: ["" : {opset}]>
        {OP_TYPE} <{defaults}> ({", ".join(formals)}) => ({", ".join(OUTPUTS)})
        {{
            {body}
            b1c = Constant <value_float: float = @one_minus_beta1> ()
            b2 = Constant <value_float: float = @beta2> ()
            b2c = Constant <value_float: float = @one_minus_beta2> ()
            eps = Constant <value_float: float = @epsilon> ()
            g_minus_avg = Sub ({grad}, exp_avg)
            avg_step = Mul (g_minus_avg, b1c)
            exp_avg_next = Add (exp_avg, avg_step)
            sq_kept = Mul (exp_avg_sq, b2)
            g_sq = Mul ({grad}, {grad})
            sq_step = Mul (g_sq, b2c)
            exp_avg_sq_next = Add (sq_kept, sq_step)
            root = Sqrt (exp_avg_sq_next)
            corrected = Div (root, correction2_sqrt)
            denominator = Add (corrected, eps)
            ratio = Div (exp_avg_next, denominator)
            update = Mul (ratio, step_size)
            param_next = Sub ({param}, update)
        }}
        """
    )
