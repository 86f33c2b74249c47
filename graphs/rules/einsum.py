"""Einsum: the gradient of each operand is an Einsum of dy with the other operands.

For ``"A,B,...->Y"`` the gradient of operand A is ``Einsum("Y,B,...->A'")(dy, B, ...)``, with
A' the labels of A that occur in Y or another operand; the labels only A has (summed out by
the forward) are put back as size-1 axes and broadcast to A's shape. Ellipses broadcast, so
an operand with an ellipsis gets its gradient summed to its own shape. Implicit output
(no ``->``) follows numpy: the labels seen once, sorted. A label repeated within one operand
(a diagonal, ``"ii->i"``) is refused.
"""

from __future__ import annotations

from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.graphs.rules.registry import UnsupportedOperatorError, register

__all__ = ["einsum_gradient", "parse_equation"]

ELLIPSIS = "..."


def _labels(term: str) -> str:
    return term.replace(ELLIPSIS, "")


def parse_equation(equation: str, node: onnx.NodeProto):
    """(operand terms, output term) of an Einsum equation, with the implicit output made explicit."""
    equation = equation.replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    terms = inputs.split(",")
    if not arrow:
        counts = {}
        for label in "".join(_labels(t) for t in terms):
            counts[label] = counts.get(label, 0) + 1
        output = (ELLIPSIS if any(ELLIPSIS in t for t in terms) else "") + "".join(
            sorted(label for label, count in counts.items() if count == 1)
        )
    for term in terms:
        if len(set(_labels(term))) != len(_labels(term)):
            raise UnsupportedOperatorError(
                f"{describe(node)}: Einsum with a label repeated within an operand ('{term}' in '{equation}', a "
                "diagonal) has no gradient rule"
            )
        if ELLIPSIS in term and ELLIPSIS not in output:
            raise UnsupportedOperatorError(
                f"{describe(node)}: Einsum summing over an ellipsis ('{equation}') has no gradient rule"
            )
    return terms, output


@register("Einsum", inputs=None)
def einsum_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """One Einsum per operand needing a gradient (see the module docstring)."""
    terms, output = parse_equation(attr(node, "equation", ""), node)
    dy = grads[0]
    result: List[Optional[str]] = []
    for index, (operand, term) in enumerate(zip(node.input, terms)):
        if not ctx.needs_grad(operand):
            result.append(None)
            continue
        others = [t for i, t in enumerate(terms) if i != index]
        seen = set(_labels(output) + "".join(_labels(t) for t in others))
        before, has_ellipsis, after = term.partition(ELLIPSIS)
        summed_ellipsis = 0
        if ELLIPSIS in output and not has_ellipsis:  # the others' ellipsis dims: kept, then summed away
            summed_ellipsis = ctx.rank(node.output[0], node) - len(_labels(output))
            term = ELLIPSIS + term
        kept = "".join(label for label in term if label in seen or label == ".")
        equation = ",".join([output] + others) + "->" + kept
        grad = ctx.op("Einsum", dy, *[o for i, o in enumerate(node.input) if i != index], equation=equation)
        if summed_ellipsis:
            grad = ctx.reduce("ReduceSum", grad, list(range(summed_ellipsis)), keepdims=False)
        missing = [i for i, label in enumerate(before) if label not in seen]
        missing += [i - len(after) for i, label in enumerate(after) if label not in seen]  # from the end
        if missing:
            grad = ctx.op("Expand", ctx.unsqueeze(grad, missing), ctx.shape_of(operand))
        if has_ellipsis:
            grad = _sum_ellipsis_to(ctx, grad, operand, len(before), len(after), node.output[0], output)
        result.append(grad)
    return result


def _sum_ellipsis_to(ctx: GradientContext, grad: str, operand: str, before: int, after: int, y: str, output: str) -> str:
    """``grad`` (with y's ellipsis dims between ``before`` and ``after`` labels) summed to the
    operand's shape over the ellipsis dims the operand broadcast: found from static shapes
    when they are known, else at run time."""
    y_shape, shape = ctx.static_shape(y), ctx.static_shape(operand)
    if y_shape is None or shape is None:
        return ctx.sum_to_runtime(grad, operand)
    out_before, _, out_after = output.partition(ELLIPSIS)
    y_dims = y_shape[len(out_before) : len(y_shape) - len(out_after)]
    own_dims = shape[before : len(shape) - after]
    lead = len(y_dims) - len(own_dims)
    axes = [before + i for i, dim in enumerate(y_dims) if i < lead or (own_dims[i - lead] == 1 and dim != 1)]
    if not axes:
        return grad
    return ctx.reshape_like(ctx.reduce("ReduceSum", grad, axes, keepdims=True), operand)
