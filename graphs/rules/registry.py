"""The rules' registry: what :mod:`normgrad.graphs.rules` exports, in a module of its own so
that the rule modules register into it without importing their package (which imports them)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import onnx

from normgrad.graphs.context import UnsupportedOperatorError
from normgrad.ops import DOMAIN

__all__ = ["Rule", "register", "lookup", "supported_op_types", "UnsupportedOperatorError"]

GradientFn = Callable[..., Sequence[Optional[str]]]
OutputTypesFn = Callable[[onnx.NodeProto, Callable[[str], Optional[onnx.TypeProto]]], Sequence[Optional[onnx.TypeProto]]]
IndexSpec = Union[Tuple[int, ...], Callable[..., Tuple[int, ...]], None]


@dataclasses.dataclass(frozen=True)
class Rule:
    """How to differentiate one op type.

    Attributes:
        op_type: the forward op type (default domain).
        gradient: ``gradient(ctx, node, output_grads) -> input_grads``.
        inputs: indices of the differentiable inputs; None for all of them, or a callable
            ``(ctx, node) -> tuple`` when it depends on the node.
        outputs: indices of the outputs whose gradient the rule reads; None for all.
        min_opset: the lowest default-domain opset the emitted backward nodes need.
        output_types: for an op onnx's shape inference does not know (onnxruntime's own),
            ``output_types(node, type_of) -> [TypeProto or None per output]`` from its inputs'
            types (``type_of(name)``: a TypeProto or None), which the builder writes so that the
            rules after it see shapes.
    """

    op_type: str
    gradient: Optional[GradientFn]
    inputs: IndexSpec = (0,)
    outputs: Optional[Tuple[int, ...]] = None
    min_opset: int = 15
    output_types: Optional[OutputTypesFn] = None

    def differentiable_inputs(self, ctx, node: onnx.NodeProto) -> Tuple[int, ...]:
        """The indices of ``node``'s inputs a gradient can flow to."""
        if self.gradient is None:
            return ()
        if self.inputs is None:
            indices = tuple(range(len(node.input)))
        elif callable(self.inputs):
            indices = tuple(self.inputs(ctx, node))
        else:
            indices = self.inputs
        return tuple(i for i in indices if i < len(node.input) and node.input[i])

    def differentiable_outputs(self, node: onnx.NodeProto) -> Tuple[int, ...]:
        """The indices of ``node``'s outputs whose gradient the rule uses."""
        indices = range(len(node.output)) if self.outputs is None else self.outputs
        return tuple(i for i in indices if i < len(node.output) and node.output[i])


_RULES: Dict[str, Rule] = {}
_NORMGRAD_RULES: Dict[str, Rule] = {}
"""The rules of normgrad-domain forward ops, which the builder's own forward rewrites write
(e.g. SafeSoftmax); not listed by :func:`supported_op_types` (no exported model has them)."""
CONTRIB_DOMAIN = "com.microsoft"
_CONTRIB_RULES: Dict[str, Rule] = {}
"""The rules of onnxruntime's ``com.microsoft`` ops (the ones its own tools write)."""


def register(*op_types: str, inputs: IndexSpec = (0,), outputs=None, min_opset: int = 15, normgrad_domain: bool = False,
             contrib: bool = False, output_types: Optional[OutputTypesFn] = None):
    """Decorator registering ``gradient`` as the rule of each of ``op_types``.

    Args:
        op_types: default-domain op types (normgrad-domain ones with ``normgrad_domain``,
            ``com.microsoft`` ones with ``contrib``).
        inputs: differentiable inputs (see :class:`Rule`).
        outputs: outputs whose gradient the rule reads (see :class:`Rule`).
        min_opset: lowest opset the backward nodes need.
        output_types: the op's output types from its inputs' (see :class:`Rule`).
    """
    rules = _NORMGRAD_RULES if normgrad_domain else _CONTRIB_RULES if contrib else _RULES

    def decorate(gradient: GradientFn) -> GradientFn:
        for op_type in op_types:
            if op_type in rules:
                raise ValueError(f"two gradient rules for {op_type}")
            rules[op_type] = Rule(op_type, gradient, inputs, outputs, min_opset, output_types)
        return gradient

    return decorate


def register_non_differentiable(*op_types: str) -> None:
    """Declares ``op_types`` as having no gradient to any input (shape queries, comparisons)."""
    for op_type in op_types:
        _RULES[op_type] = Rule(op_type, None, ())


def lookup(node: onnx.NodeProto) -> Optional[Rule]:
    """The rule of ``node``, or None if its op type has none."""
    if node.domain == DOMAIN:
        return _NORMGRAD_RULES.get(node.op_type)
    if node.domain == CONTRIB_DOMAIN:
        return _CONTRIB_RULES.get(node.op_type)
    if node.domain not in ("", "ai.onnx"):
        return None
    return _RULES.get(node.op_type)


def supported_op_types() -> Dict[str, bool]:
    """Every op type with a rule, mapped to whether it is differentiable (``com.microsoft`` ones
    as ``com.microsoft.OpType``)."""
    rules = {**_RULES, **{f"{CONTRIB_DOMAIN}.{op_type}": rule for op_type, rule in _CONTRIB_RULES.items()}}
    return {op_type: rule.gradient is not None for op_type, rule in sorted(rules.items())}
