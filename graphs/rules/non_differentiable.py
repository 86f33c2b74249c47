"""Ops no gradient flows through (shape queries, comparisons, integer outputs), Cast and CastLike.

A float value feeding one of these ops contributes nothing to the gradient along that
path; the step functions (Sign, Floor, Ceil, Round) have derivative zero almost everywhere.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import onnx

from normgrad.graphs.context import FLOAT_ELEM_TYPES, GradientContext, attr
from normgrad.graphs.rules.registry import register, register_non_differentiable

__all__ = ["NON_DIFFERENTIABLE", "cast_gradient"]

NON_DIFFERENTIABLE = (
    "Shape", "Size", "Constant", "ConstantOfShape", "EyeLike", "Range", "Equal", "Greater", "GreaterOrEqual",
    "Less", "LessOrEqual", "Not", "And", "Or", "Xor", "ArgMax", "ArgMin", "NonZero", "IsNaN", "IsInf",
    "Sign", "Floor", "Ceil", "Round", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
    "Bernoulli", "Multinomial", "OneHot",
)

register_non_differentiable(*NON_DIFFERENTIABLE)


def _float_to_float(ctx: GradientContext, node: onnx.NodeProto) -> Tuple[int, ...]:
    source = ctx.elem_type(node.input[0])
    target = attr(node, "to", None) if node.op_type == "Cast" else ctx.elem_type(node.input[1])
    return (0,) if source in FLOAT_ELEM_TYPES and target in FLOAT_ELEM_TYPES else ()


@register("Cast", "CastLike", inputs=_float_to_float)
def cast_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """A float-to-float Cast (or CastLike) passes dy back cast to the input's type; other
    casts stop it. CastLike's second input only gives the type: no gradient."""
    return [ctx.op("CastLike", grads[0], node.input[0])]
