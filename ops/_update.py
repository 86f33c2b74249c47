"""What the optimizer-update operators (AdamUpdate, SGDUpdate) share: their input tables,
the checks of their inputs, when an update is skipped, the gradient's clipping and L2 terms,
their schema and the frame of their function bodies.

An update operator takes parameter-shaped tensors and scalars and writes parameter-shaped
outputs, each element from the same element of the inputs (so an output may share its
input's buffer). An omitted optional input means the scalar of ``scalar_if_omitted`` (an
omitted optional tensor: that scalar everywhere). The update is skipped, every output equal
to the input ``kept`` names, bitwise (in place: nothing written), when ``applied`` is false
or a scalar breaks the rule: every scalar finite, those of ``nonnegative`` >= 0.
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, NamedTuple, Sequence, Tuple

import numpy as np
import onnx
import onnx.parser
from onnx.defs import OpSchema

import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError


class UpdateSpec(NamedTuple):
    """The input table of an update operator."""

    op_type: str
    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    tensors: Tuple[str, ...]
    """The parameter-shaped inputs, the parameter first."""
    scalar_if_omitted: Mapping[str, object]
    """Every optional input and what omitting it means (a bool for a bool input)."""
    nonnegative: Tuple[str, ...]
    kept: Mapping[str, str]
    """{output: the input it equals when the update is skipped}."""
    bools: Tuple[str, ...] = ("applied",)
    """The bool scalar inputs."""

    @property
    def optional(self) -> Tuple[str, ...]:
        return tuple(name for name in self.inputs if name in self.scalar_if_omitted)

    @property
    def bool_inputs(self) -> Tuple[str, ...]:
        return self.bools

    @property
    def scalars(self) -> Tuple[str, ...]:
        return tuple(name for name in self.inputs if name not in self.tensors)


class Declarations(NamedTuple):
    """What ``normgrad.ops`` reads of an operator module (see its OPERATORS), for an update operator."""

    OP_TYPE: str
    INPUTS: Tuple[str, ...]
    OUTPUTS: Tuple[str, ...]
    ATTRIBUTES: dict
    OPTIONAL: Tuple[str, ...]
    BOOL_INPUTS: Tuple[str, ...]
    SCALAR_IF_OMITTED: dict
    """What an omitted optional input means: a function body that reads it feeds nodes
    omitting it this; the Python bridge, which needs every input, feeds it too (ONES_IF_OMITTED)."""
    ONES_IF_OMITTED: dict
    HYPERPARAMETERS: Tuple[str, ...]
    """The scalar inputs that must be >= 0 (and finite, as every scalar) for the update to run."""
    OUTPUT_SHAPE_FROM: dict
    """Each output's shape: the parameter's."""
    TYPES: Tuple[str, ...]
    ELEMENTWISE: bool
    """Each output element reads only the same element of the tensor inputs, before it is
    written: an output may share its input's buffer (``normgrad.graphs.structure.in_place_updates``)."""


MODULE_API = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OPTIONAL", "BOOL_INPUTS", "HYPERPARAMETERS", "ELEMENTWISE",
              "SCALAR_IF_OMITTED", "ONES_IF_OMITTED", "OUTPUT_SHAPE_FROM", "TYPES", "SPEC", "Result",
              "skip_reason", "validate", "reference", "python_kernel", "schema", "function_body"]
"""The public names of every update operator's module (its ``__all__``)."""


def declarations(spec: UpdateSpec) -> Declarations:
    """The module-level declarations of an update operator."""
    return Declarations(spec.op_type, spec.inputs, spec.outputs, {}, spec.optional, spec.bool_inputs,
                        dict(spec.scalar_if_omitted), ones_if_omitted(spec), spec.nonnegative,
                        {name: (spec.tensors[0], None) for name in spec.outputs}, ("tensor(float)",), True)


def ones_if_omitted(spec: UpdateSpec) -> Dict[str, Tuple[str, None]]:
    """The Python bridge's fill of each omitted optional input: its scalar, shaped like a
    scalar input (a tensor input: like the parameter)."""
    scalar_shaped = next((name for name in spec.scalars if name not in spec.optional), None)
    return {name: (spec.tensors[0] if name in spec.tensors else scalar_shaped, None) for name in spec.optional}


def validate(spec: UpdateSpec, args: Sequence, kwargs: Mapping[str, object],
             defaults: Mapping[str, object] = {}) -> Dict[str, np.ndarray]:
    """Checks the inputs given as ``args`` (in the inputs' order) and ``kwargs`` (by name;
    ``defaults`` for required ones not given) against the contract.

    Returns:
        {input name: array (None for an omitted optional one)}.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    unknown = sorted(set(kwargs) - set(spec.inputs))
    if unknown or len(args) > len(spec.inputs):
        raise TypeError(f"{spec.op_type} has no input {unknown[0] if unknown else len(args)!r}")
    given = {**defaults, **dict(zip(spec.inputs, args)), **kwargs}
    arrays: Dict[str, np.ndarray] = {}
    param = spec.tensors[0]
    for name in spec.inputs:
        value = given.get(name)
        if value is None and name in spec.scalar_if_omitted:
            arrays[name] = None
            continue
        if value is None:
            raise NormgradInputError(f"{spec.op_type}: input '{name}' is required")
        array = np.asarray(value, np.float32 if isinstance(value, float) else None)
        is_bool = name in spec.bool_inputs
        wanted = (np.bool_,) if is_bool else (np.float32, np.float64)
        if array.dtype not in wanted:
            raise NormgradInputError(f"{spec.op_type}: input '{name}' must be {'bool' if is_bool else 'float32'}; "
                                     f"got {array.dtype}")
        if name in spec.tensors and name != param:
            _common.check_same_shape(spec.op_type, name, array, param, arrays[param])
        elif name not in spec.tensors and array.size != 1:
            raise NormgradInputError(f"{spec.op_type}: input '{name}' must be a scalar; got shape {list(array.shape)}")
        arrays[name] = array
    return arrays


def skip_reason(spec: UpdateSpec, arrays: Mapping[str, object]) -> str:
    """Why the update is skipped ('' when it runs): ``applied`` false, or a scalar input
    breaking the rule. ``arrays``: {input name: array or None}."""
    applied = arrays.get("applied")
    if applied is not None and not bool(np.asarray(applied).reshape(())):
        return "applied is false"
    for name in spec.scalars:
        value = arrays.get(name)
        if value is None or name in spec.bool_inputs:
            continue
        value = float(np.asarray(value).reshape(()))
        if not np.isfinite(value) or (name in spec.nonnegative and value < 0):
            rule = "a finite number >= 0" if name in spec.nonnegative else "finite"
            return f"input '{name}' must be {rule}; got {value!r}"
    return ""


def evaluate(spec: UpdateSpec, arrays: Mapping[str, object], xp_float, step: Callable) -> tuple:
    """The outputs of the checked inputs ``arrays`` in the arithmetic of ``xp_float``
    (np.float64 or np.float32): ``step(tensor, scalar, flag)`` (the contract's update, from
    the parameter-shaped inputs, the float scalars and the bool inputs, each omitted one its
    ``scalar_if_omitted`` value) unless the update is skipped; then the kept inputs."""
    shape = np.shape(arrays[spec.tensors[0]])
    omitted = spec.scalar_if_omitted

    def tensor(name):
        value = arrays[name]
        return np.full(shape, omitted[name], xp_float) if value is None else np.asarray(value, xp_float)

    def scalar(name):
        value = arrays[name]
        return xp_float(omitted[name]) if value is None else np.asarray(value, xp_float).reshape(())

    def flag(name):
        value = arrays[name]
        return bool(omitted[name]) if value is None else bool(np.asarray(value).reshape(()))

    if skip_reason(spec, arrays):
        return tuple(tensor(spec.kept[output]).copy() for output in spec.outputs)
    return step(tensor, scalar, flag)


def reference(spec: UpdateSpec, arrays: Dict[str, object], step: Callable) -> tuple:
    """:func:`evaluate` in float64, the scalars taken as float32 as a node's are, each
    output in the parameter's dtype (float32; float64 for float64 evaluations)."""
    dtype = arrays[spec.tensors[0]].dtype
    arrays = {name: np.float32(value) if value is not None and name in spec.scalars and name not in spec.bool_inputs
              and value.dtype == np.float32 else value for name, value in arrays.items()}
    return tuple(out.astype(dtype) for out in evaluate(spec, arrays, np.float64, step))


def python_kernel(spec: UpdateSpec, arrays: Dict[str, object], step: Callable) -> tuple:
    """:func:`evaluate` in float32, the contract's arithmetic: the C++ kernel's bits. A skip
    for a broken scalar rule is reported on the ``normgrad`` logger (as the kernels' other
    errors)."""
    reason = skip_reason(spec, arrays)
    if reason and reason != "applied is false":
        import logging

        logging.getLogger("normgrad").error(f"{spec.op_type}: {reason}; the update is skipped (float32 Python kernel)")
    return evaluate(spec, arrays, np.float32, step)


def scaled_gradient(grad, param, scalar) -> object:
    """The gradient the update takes: times ``grad_scale`` (clipping; omitted, 1: no change),
    plus ``param * weight_decay`` unless that is 0 (torch's ``if weight_decay != 0``)."""
    g = grad * scalar("grad_scale")
    if scalar("weight_decay") != 0:
        g = g + param * scalar("weight_decay")
    return g


def scaled_gradient_lines(reads: Sequence[str]) -> Tuple[list, str]:
    """Function-body lines of :func:`scaled_gradient` for the optional inputs ``reads``;
    returns them and the value holding the gradient."""
    grad, lines = "grad", []
    if "grad_scale" in reads:
        lines.append("scaled_grad = Mul (grad, grad_scale)")
        grad = "scaled_grad"
    if "weight_decay" in reads:
        lines += ["decay_term = Mul (param, weight_decay)", f"decayed_grad = Add ({grad}, decay_term)",
                  "no_decay = Equal (weight_decay, zero)", f"l2_grad = Where (no_decay, {grad}, decayed_grad)"]
        grad = "l2_grad"
    return lines, grad


def _infer(spec: UpdateSpec):
    def infer(ctx) -> None:
        param_type = _common.input_tensor_type(ctx, 0)
        if param_type is not None:
            for index in range(min(len(spec.outputs), ctx.get_num_outputs())):  # an optional one may be left off
                ctx.set_output_type(index, _common.make_output_type(param_type.elem_type, _common.known_dims(param_type)))
    return infer


def schema(spec: UpdateSpec, doc: str) -> OpSchema:
    """The ONNX schema, with type and shape inference."""
    param = OpSchema.FormalParameter
    optional, single = OpSchema.FormalParameterOption.Optional, OpSchema.FormalParameterOption.Single
    inputs = [param(name, "B" if name in spec.bool_inputs else "T", f"See the operator's documentation: {name}.",
                    param_option=optional if name in spec.optional else single) for name in spec.inputs]
    outputs = [param(name, "T", f"The step's {name.removesuffix('_next')}; shape of {spec.tensors[0]}.",
                     param_option=optional if spec.kept[name] in spec.optional else single) for name in spec.outputs]
    return _common.make_schema(spec.op_type, doc, inputs=inputs, outputs=outputs,
                               type_docs={"T": "float32.", "B": (("tensor(bool)",), "bool.")}, infer=_infer(spec),
                               types=("tensor(float)",))


def function_body(spec: UpdateSpec, opset: int, reads: Sequence[str], lines: Sequence[str],
                  results: Mapping[str, Tuple[str, str]]) -> onnx.FunctionProto:
    """The operator's function body: a constant ``zero``, ``run`` (the scalars keep the rule
    and ``applied``, for the optional inputs in ``reads``), ``lines`` (the contract's float32
    ops), then each output Where(condition, value, kept input) for ``results`` {output:
    (value, condition: "run", a bool value the lines define, or None: the value as it is)};
    a body cannot skip work. The
    optional inputs in ``reads`` are formal inputs and read; the others are not (a body cannot
    test whether an input is present), so a model whose nodes give neither gets no operation
    for them."""
    required = [name for name in spec.inputs if name not in spec.optional]
    formals = list(spec.inputs[:max([spec.inputs.index(n) + 1 for n in reads] +
                                    [spec.inputs.index(n) + 1 for n in required])])
    scalars = [n for n in formals if n in spec.scalars and n not in spec.bool_inputs
               and (n not in spec.optional or n in reads)]
    checked = [n for n in spec.nonnegative if n in scalars]
    rule, conditions = [], []
    if scalars:
        # NaN for an infinite or NaN scalar, and (through Sqrt) for a negative one that must be
        # >= 0: one finiteness test is the whole rule (no Min/GreaterOrEqual of scalars, whose
        # result OpenVINO's CPU plugin takes as a dynamic-rank parameter across a partition)
        rule += [f"{n}_root = Sqrt ({n})" for n in checked]
        rule += [f"{n}_zero = Mul ({n + '_root' if n in checked else n}, zero)" for n in scalars]
        rule += [f"scalar_zeros = Sum ({', '.join(f'{n}_zero' for n in scalars)})",
                 "finite = Equal (scalar_zeros, scalar_zeros)"]
        conditions.append("finite")
    if "applied" in formals and ("applied" not in spec.optional or "applied" in reads):
        conditions.append("applied")
    for index, condition in enumerate(conditions[1:], 1):
        rule.append(f"run_{index} = And ({'run_' + str(index - 1) if index > 1 else conditions[0]}, {condition})")
    rule.append(f"run = Identity ({f'run_{len(conditions) - 1}' if len(conditions) > 1 else conditions[0]})")
    outputs = [f"{output} = Identity ({value})" if condition is None else
               f"{output} = Where ({condition}, {value}, {spec.kept[output]})" for output, (value, condition) in results.items()]
    body = "\n            ".join(["zero = Constant <value_float: float = 0.0> ()", *rule, *lines, *outputs])
    return onnx.parser.parse_function(
        f"""
        <domain: "{_common.DOMAIN}", opset_import: ["" : {opset}]>
        {spec.op_type} ({", ".join(formals)}) => ({", ".join(spec.outputs)})
        {{
            {body}
        }}
        """
    )
