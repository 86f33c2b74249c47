"""Definitions shared by every normgrad operator: the domain, dtypes, errors, checks."""

from __future__ import annotations

from typing import Sequence, Set

import ml_dtypes
import numpy as np
import onnx

__all__ = [
    "DOMAIN",
    "OPSET_VERSION",
    "IR_VERSION",
    "ONNX_OPSET",
    "FLOAT_TYPES",
    "NormgradInputError",
    "as_float_array",
    "attribute_reads",
    "broadcast_error",
    "check_attribute_flag",
    "check_rank",
    "check_same_shape",
    "check_vector",
    "describe",
    "is_float_dtype",
    "make_schema",
    "reserve_name",
    "normalization_grad_body",
    "sum_to_shape",
    "sum_to_shape_body",
]

DOMAIN = "normgrad"
"""The ONNX domain of every normgrad operator."""

OPSET_VERSION = 1
"""The opset version of :data:`DOMAIN` that this release defines."""

IR_VERSION = 10
"""IR version of every model normgrad writes: onnxruntime 1.19.2 loads IR <= 10."""

ONNX_OPSET = 18
"""Default-domain opset used by the function bodies and the models normgrad writes."""

FLOAT_TYPES = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)")
"""Element types both operators accept, as ONNX type strings."""

# float64 is not an operator type; the NumPy references accept it for float64 checks.
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64))


class NormgradInputError(ValueError):
    """An operator input breaks the operator's contract.

    The message names the operator, the offending input and the rule it broke.
    """


def is_float_dtype(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is an element type the operators (or, for float64, the references) accept."""
    return np.dtype(dtype) in _FLOAT_DTYPES


def as_float_array(op: str, name: str, value) -> np.ndarray:
    """Returns ``value`` as an array after checking it has an accepted dtype."""
    array = np.asarray(value)
    if not is_float_dtype(array.dtype):
        raise NormgradInputError(
            f"{op}: input '{name}' must be float32, float16 or bfloat16; got {array.dtype}"
        )
    return array


def float32_or_float64_arrays(op: str, dims: dict, values) -> dict:
    """``values`` as {input name: array}: each float32 or float64, of the rank of its entry in
    ``dims`` ({name: "[T, M]"}, in input order) and of the first input's type.

    Raises:
        NormgradInputError: naming the first input that breaks a rule and the rule.
    """
    arrays = {name: np.asarray(value) for name, value in zip(dims, values)}
    first = next(iter(arrays))
    for name, array in arrays.items():
        if array.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise NormgradInputError(f"{op}: input '{name}' must be float32 or float64; got {array.dtype}")
        if array.ndim != dims[name].count(",") + 1:
            raise NormgradInputError(f"{op}: input '{name}' must have rank {dims[name].count(',') + 1} ({dims[name]}); "
                                     f"got shape {list(array.shape)}")
    for name, array in arrays.items():
        if array.dtype != arrays[first].dtype:
            raise NormgradInputError(f"{op}: input '{name}' must have {first}'s type {arrays[first].dtype}; "
                                     f"got {array.dtype}")
    return arrays


def has_python_kernel(module) -> bool:
    """Whether the onnxruntime-extensions bridge serves operator ``module``: it reads INT,
    FLOAT and STRING attributes only, so an operator with INTS attributes (DepthwiseConvGrad's
    geometry) runs as its function body beside the Python kernels."""
    return all(isinstance(default, (int, float)) for default in module.ATTRIBUTES.values())


def check_rank(op: str, name: str, array: np.ndarray, low: int, high: int) -> None:
    """Raises unless ``low <= array.ndim <= high``."""
    if not low <= array.ndim <= high:
        raise NormgradInputError(
            f"{op}: input '{name}' must have rank {low}..{high}; got rank {array.ndim} "
            f"(shape {list(array.shape)})"
        )


def check_same_shape(op: str, name: str, array: np.ndarray, ref_name: str, ref: np.ndarray) -> None:
    """Raises unless ``array`` has the shape and dtype of ``ref``."""
    if array.shape != ref.shape:
        raise NormgradInputError(
            f"{op}: input '{name}' must have the shape of '{ref_name}' {list(ref.shape)}; "
            f"got {list(array.shape)}"
        )
    if array.dtype != ref.dtype:
        raise NormgradInputError(
            f"{op}: input '{name}' must have the dtype of '{ref_name}' ({ref.dtype}); got {array.dtype}"
        )


def check_vector(op: str, name: str, array: np.ndarray, shape: Sequence[int], rule: str) -> None:
    """Raises unless ``array.shape == shape``; ``rule`` says where ``shape`` comes from."""
    if tuple(array.shape) != tuple(shape):
        raise NormgradInputError(
            f"{op}: input '{name}' must have shape {list(shape)} ({rule}); got {list(array.shape)}"
        )


def check_attribute_flag(op: str, name: str, value: int) -> int:
    """Returns ``value`` as an int after checking it is 0 or 1."""
    if value not in (0, 1):
        raise NormgradInputError(f"{op}: attribute '{name}' must be 0 or 1; got {value}")
    return int(value)


def attribute_reads(module, nodes) -> tuple:
    """The attributes of ``module.ATTRIBUTES_READ_UNLESS_DEFAULT`` that some of ``nodes`` (of
    its op type) sets to a non-default value: its function body must then read them. The
    nodes that omit one of those get its default written out: onnx's inliner leaves the
    body's reference to an omitted attribute empty instead of taking the default."""
    def value(node, name):
        attribute = next((a for a in node.attribute if a.name == name), None)
        return module.ATTRIBUTES[name] if attribute is None else onnx.helper.get_attribute_value(attribute)

    reads = tuple(name for name in getattr(module, "ATTRIBUTES_READ_UNLESS_DEFAULT", ())
                  if any(value(node, name) != module.ATTRIBUTES[name] for node in nodes))
    for node in nodes:
        node.attribute.extend(onnx.helper.make_attribute(name, module.ATTRIBUTES[name]) for name in reads
                              if not any(a.name == name for a in node.attribute))
    return reads


def tensor_type(dtype: np.dtype) -> int:
    """The ``onnx.TensorProto`` element type of a NumPy dtype."""
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def input_tensor_type(ctx, index: int):
    """The ``TypeProto.Tensor`` of input ``index`` during shape inference, or None."""
    if index >= ctx.get_num_inputs() or not ctx.has_input(index):
        return None
    type_proto = ctx.get_input_type(index)
    if type_proto is None or not type_proto.HasField("tensor_type"):
        return None
    return type_proto.tensor_type


def known_dims(tensor_type) -> list | None:
    """The dims of a ``TypeProto.Tensor``: ints, dim_param strings or None; None if rank unknown."""
    if tensor_type is None or not tensor_type.HasField("shape"):
        return None
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim
    ]


def make_output_type(elem_type: int, dims) -> onnx.TypeProto:
    """A tensor ``TypeProto``; ``dims`` may hold None (unknown) or symbolic strings."""
    if dims is None:
        return onnx.helper.make_tensor_type_proto(elem_type, None)
    return onnx.helper.make_tensor_type_proto(elem_type, list(dims))


def outputs_like_input(index: int, count: int):
    """Type and shape inference of an operator whose ``count`` outputs all have input ``index``'s
    type and shape."""

    def infer(ctx) -> None:
        like = input_tensor_type(ctx, index)
        if like is not None:
            for output in range(count):
                ctx.set_output_type(output, make_output_type(like.elem_type, known_dims(like)))

    return infer


def function_of_standard_form(op_type: str, inputs, outputs, opset: int, write) -> onnx.FunctionProto:
    """The normgrad function ``op_type`` whose body ``write(op) -> [output value, ...]`` appends
    with ``op(op_type, *inputs, **attributes) -> output name`` (default-domain nodes)."""
    nodes = []

    def op(node_type: str, *node_inputs: str, **attributes) -> str:
        output = f"t{len(nodes)}"
        nodes.append(onnx.helper.make_node(node_type, list(node_inputs), [output], **attributes))
        return output

    for value, name in zip(write(op), outputs):
        nodes.append(onnx.helper.make_node("Identity", [value], [name]))
    return onnx.helper.make_function(DOMAIN, op_type, list(inputs), list(outputs), nodes,
                                     [onnx.helper.make_opsetid("", opset)])


def image_gradients_infer(op_type: str, dims: dict):
    """Type and shape inference of an operator over images whose inputs (``dims``: {name:
    "[N, C, H, W]"}, in order) all have rank 4 and whose outputs are the gradients of the first
    inputs, one each: output ``i`` has input ``i``'s shape and input 0's type (float by default)."""

    def infer(ctx) -> None:
        types = [input_tensor_type(ctx, index) for index in range(len(dims))]
        elem_type = types[0].elem_type if types[0] is not None and types[0].elem_type else onnx.TensorProto.FLOAT
        for index, name in enumerate(dims):
            known = known_dims(types[index])
            if known is not None and len(known) != 4:
                raise NormgradInputError(f"{op_type}: input '{name}' must have rank 4 ({dims[name]}); "
                                         f"got rank {len(known)}")
        for output in range(ctx.get_num_outputs()):
            ctx.set_output_type(output, make_output_type(elem_type, known_dims(types[output])))

    return infer


def rows_output_infer(op_type: str, index: int, name: str):
    """Type and shape inference of an operator over rows along the last axis whose one output
    has input ``index``'s (``name``) type and shape, which must have rank >= 1."""

    def infer(ctx) -> None:
        row_type = input_tensor_type(ctx, index)
        if row_type is not None:
            dims = known_dims(row_type)
            if dims is not None and not dims:
                raise NormgradInputError(f"{op_type}: input '{name}' must have rank >= 1 (rows along the last axis); got a scalar")
            ctx.set_output_type(0, make_output_type(row_type.elem_type, dims))

    return infer


def attribute_int(ctx, name: str, default: int) -> int:
    """An int attribute of the node being inferred, or ``default`` when absent."""
    attr = ctx.get_attribute(name)
    if attr is None:
        return default
    if attr.type != onnx.AttributeProto.INT:
        raise NormgradInputError(f"attribute '{name}' must be an int")
    return attr.i


def make_schema(op_type: str, doc: str, inputs, outputs, type_docs, infer, attributes=(), types=FLOAT_TYPES):
    """An ``OpSchema`` of the normgrad domain: deterministic, with type constraints T and U
    over ``types`` (default :data:`FLOAT_TYPES`; ``type_docs`` says what each covers, or
    gives ``(its types, text)``) and ``infer`` as its type and shape inference."""
    from onnx.defs import OpSchema

    op_schema = OpSchema(
        op_type,
        DOMAIN,
        OPSET_VERSION,
        doc,
        inputs=list(inputs),
        outputs=list(outputs),
        type_constraints=[(name, list(text[0]), text[1]) if isinstance(text, tuple) else (name, list(types), text)
                          for name, text in type_docs.items()],
        attributes=list(attributes),
        node_determinism=OpSchema.NodeDeterminism.Deterministic,
    )
    op_schema.set_type_and_shape_inference_function(infer)
    return op_schema


def dims_compatible(a, b) -> bool:
    """Whether two dim lists can be equal (unknown and symbolic dims match anything)."""
    if len(a) != len(b):
        return False
    return all(not isinstance(p, int) or not isinstance(q, int) or p == q for p, q in zip(a, b))


def broadcast_error(shape, target) -> str | None:
    """Why ``shape`` does not broadcast to ``target`` by NumPy rules, or None if it does.

    Dims may be ints, symbolic strings or None; only two ints can disagree."""
    if len(shape) > len(target):
        return f"rank {len(shape)} exceeds the rank of 'x' ({len(target)})"
    for dim, x_dim in zip(reversed(shape), reversed(target)):
        if isinstance(dim, int) and isinstance(x_dim, int) and dim not in (1, x_dim):
            return f"dim {dim} is neither 1 nor the matching dim {x_dim} of 'x'"
    return None


def sum_to_shape(value: np.ndarray, shape) -> np.ndarray:
    """Sums ``value`` over the axes along which an array of ``shape`` was broadcast to it."""
    lead = value.ndim - len(shape)
    value = value.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, dim in enumerate(shape) if dim == 1 and value.shape[i] != 1)
    return value.sum(axis=axes, keepdims=True).reshape(shape)


def static_sum_axes(param_dims, x_rank):
    """The reduction axes of :func:`sum_to_shape_body` known at export: (first, second), the
    axes of its two ReduceSums over the value lifted by one leading axis, from ``param``'s
    dims and ``x``'s rank; None when a dim of ``param`` is not a known int or ``param``
    outranks ``x`` (the body then finds them at run time)."""
    if param_dims is None or x_rank is None or len(param_dims) > x_rank:
        return None
    if not all(isinstance(dim, int) and dim > 0 for dim in param_dims):
        return None
    padded = [1] * (x_rank - len(param_dims)) + list(param_dims)
    kept = [i for i, dim in enumerate(padded) if dim != 1]
    first_kept = kept[0] if kept else x_rank
    leading = [i for i in range(first_kept)]
    later = [i for i in range(first_kept, x_rank) if padded[i] == 1]
    return [0] + [i + 1 for i in leading], [i + 1 for i in later] + [x_rank + 1]


def sum_to_shape_body(param: str, param_float: str, full_shape: str, sums, sum_axes=None) -> str:
    """Function-body lines (ONNX text) that sum float32 values of ``full_shape`` down to the
    shape of ``param`` (which broadcasts to it), as :func:`sum_to_shape` does.

    The leading broadcast axes are summed first, the others after: one ReduceSum over e.g.
    axes [0, 3] of [N, G, C/G, S] would hit onnxruntime's reduced-kept-reduced kernel, whose
    float sums change with the thread count when fewer elements than threads are kept. A
    size-1 axis in front and one at the end, summed too, keep each axes list non-empty:
    onnxruntime 1.19.2 reduces an empty tensor over every axis for empty axes, even with
    ``noop_with_empty_axes``.

    Args:
        param: the input whose shape and type the sums take.
        param_float: ``param`` cast to float32.
        full_shape: a Shape value of the broadcast shape.
        sums: (output, full-shape float32 value) pairs; each output is cast like ``param``.
        sum_axes: the two ReduceSums' axes when known at export (:func:`static_sum_axes`):
            constants replace the run-time CumSum/NonZero search (same reductions, so the
            same bits), which runtimes that need static axes (OpenVINO, tract) take.
    """
    if sum_axes is not None:
        first, second = sum_axes
        lines = [
            f"sts_shape = Shape ({param})",
            f"sts_lift = Constant <value_ints = [0, {second[-1]}]> ()",
            f"sts_first_axes = Constant <value_ints = {list(first)}> ()",
            f"sts_second_axes = Constant <value_ints = {list(second)}> ()",
        ]
    else:
        lines = _run_time_sum_axes_lines(param, param_float, full_shape)
    for output, value in sums:
        lines += [
            f"{output}_lifted = Unsqueeze ({value}, sts_lift)",
            f"{output}_leading = ReduceSum <keepdims = 1> ({output}_lifted, sts_first_axes)",
            f"{output}_kept = ReduceSum <keepdims = 1> ({output}_leading, sts_second_axes)",
            f"{output}_float = Reshape <allowzero = 1> ({output}_kept, sts_shape)",
            f"{output} = CastLike ({output}_float, {param})",
        ]
    return "\n".join(lines)


def _run_time_sum_axes_lines(param: str, param_float: str, full_shape: str):
    return [
        f"sts_shape = Shape ({param})",
        f"sts_rank = Shape ({full_shape})",
        "sts_ones = ConstantOfShape <value = int64[1] {1}> (sts_rank)",
        f"sts_padded_value = Expand ({param_float}, sts_ones)",
        "sts_padded = Shape (sts_padded_value)",
        "sts_one = Constant <value_int = 1> ()",
        "sts_is_broadcast = Equal (sts_padded, sts_one)",
        "sts_kept = Not (sts_is_broadcast)",
        "sts_kept_count = Cast <to = 7> (sts_kept)",
        "sts_zero = Constant <value_int = 0> ()",
        "sts_kept_so_far = CumSum (sts_kept_count, sts_zero)",
        "sts_leading = Equal (sts_kept_so_far, sts_zero)",
        "sts_not_leading = Not (sts_leading)",
        "sts_later = And (sts_is_broadcast, sts_not_leading)",
        "sts_flat = Constant <value_ints = [-1]> ()",
        "sts_leading_2d = NonZero (sts_leading)",
        "sts_leading_axes = Reshape (sts_leading_2d, sts_flat)",
        "sts_later_2d = NonZero (sts_later)",
        "sts_later_axes = Reshape (sts_later_2d, sts_flat)",
        "sts_front = Constant <value_ints = [0]> ()",
        "sts_next = Constant <value_ints = [1]> ()",
        "sts_end = Add (sts_rank, sts_next)",
        "sts_lift = Concat <axis = 0> (sts_front, sts_end)",
        "sts_leading_lifted = Add (sts_leading_axes, sts_next)",
        "sts_first_axes = Concat <axis = 0> (sts_front, sts_leading_lifted)",
        "sts_later_lifted = Add (sts_later_axes, sts_next)",
        "sts_second_axes = Concat <axis = 0> (sts_later_lifted, sts_end)",
    ]


def normalization_grad_body(rstd: str, count: str, centre: bool, param: str, param_float: str, sums,
                            sum_axes=None) -> str:
    """Function-body lines (ONNX text) shared by the normalization gradients. From float32
    views ``x_hat`` and ``g`` (dy * scale) with the normalised axes merged into the last one,
    ``rstd`` broadcasting to them and ``count`` (values per normalised group, at least 1):

        dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))    (no mean(g) unless ``centre``)

    reshaped to ``x_shape`` and cast like ``x``; then dy * x_hat (``dy_x_hat``) and ``dyf``
    summed to the shape of ``param`` as :func:`sum_to_shape_body` does, for ``sums``.
    The caller defines ``x``, ``dyf``, ``x_shape``, ``x_hat``, ``g`` and ``last`` ([-1])."""
    lines = [
        "g_x_hat = Mul (g, x_hat)",
        "sum_g_x_hat = ReduceSum <keepdims = 1> (g_x_hat, last)",
        f"mean_g_x_hat = Div (sum_g_x_hat, {count})",
        "x_hat_term = Mul (x_hat, mean_g_x_hat)",
    ]
    if centre:
        lines += [
            "sum_g = ReduceSum <keepdims = 1> (g, last)",
            f"mean_g = Div (sum_g, {count})",
            "g_centred = Sub (g, mean_g)",
            "inner = Sub (g_centred, x_hat_term)",
        ]
    else:
        lines.append("inner = Sub (g, x_hat_term)")
    lines += [
        f"dx_view = Mul ({rstd}, inner)",
        "dx_full = Reshape <allowzero = 1> (dx_view, x_shape)",
        "dx = CastLike (dx_full, x)",
        "x_hat_full = Reshape <allowzero = 1> (x_hat, x_shape)",
        "dy_x_hat = Mul (dyf, x_hat_full)",
    ]
    return "\n".join(lines) + "\n" + sum_to_shape_body(param, param_float, "x_shape", sums, sum_axes)


def reserve_name(used: Set[str], name: str) -> str:
    """``name``, or ``name`` with the first numeric suffix not in ``used``; added to ``used``."""
    candidate, k = name, 0
    while candidate in used:
        k += 1
        candidate = f"{name}_{k}"
    used.add(candidate)
    return candidate


def describe(node: onnx.NodeProto) -> str:
    """A human-readable reference to ``node`` for error messages."""
    return f"{node.op_type} node '{node.name}'" if node.name else f"{node.op_type} node producing '{node.output[0]}'"
