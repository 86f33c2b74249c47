"""Chains described declaratively, matched with onnxscript's rewriter (an optional dependency).

A chain is written as a function of onnxscript's pattern builder, e.g.
``lambda op, x, w: op.Mul(op.Sqrt(x), w)``, with ``pattern.OrValue`` for alternatives
(Pow or Mul, an optional Cast). :class:`ChainPattern` matches it, in every order of the
operands of Add and Mul, against the forward graph viewed as onnx-ir (built once per graph,
constants marked from the context). The match is only accepted when the chain's
intermediate values are read by the chain alone and are not graph outputs; the pattern
module then checks shapes, types and constants with the :class:`GradientContext` and the
NodeProtos, as the hand-written matchers do.

Without onnxscript installed nothing matches: the chains are differentiated node by node
(correct, with more passes over the data), and a warning says so once per graph that has
a candidate.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import onnx

from normgrad.graphs.context import GradientContext
from normgrad.graphs.patterns.registry import GraphView

__all__ = ["AVAILABLE", "ChainPattern", "Binding", "or_value"]

AVAILABLE = importlib.util.find_spec("onnxscript") is not None and importlib.util.find_spec("onnx_ir") is not None
"""Whether onnxscript (and onnx-ir) are installed. They are imported on the first match, not
here: with sympy they hold about 65 MB and take half a second to import, which a process that
only trains (the Trainer imports the graphs package) never needs."""


def _rewriter():
    """(onnx_ir, onnxscript.rewriter.pattern)."""
    import onnx_ir
    from onnxscript.rewriter import pattern

    return onnx_ir, pattern


def or_value(values: list, **kwargs):
    """onnxscript's ``pattern.OrValue`` (alternatives inside a pattern function)."""
    return _rewriter()[1].OrValue(values, **kwargs)

Binding = Union[str, int, None]
"""A matched pattern variable: a value name, the index of the OrValue alternative taken, or None."""


def _ir_view(view: GraphView, ctx: GradientContext):
    """(ir model, {output name: ir node}) of the view's graph, built once and cached on the view."""
    cached = view.cache.get("onnx_ir")
    if cached is None:
        ir = _rewriter()[0]
        graph = ir.serde.deserialize_graph(view.graph)
        by_output: Dict[str, object] = {}
        for node in graph:
            for value in node.outputs:
                by_output[value.name] = node
                constant = ctx.constant(value.name)
                if constant is not None and value.const_value is None:
                    value.const_value = ir.tensor(constant)
        for value in graph.inputs:
            if value.const_value is None and ctx.constant(value.name) is not None:
                value.const_value = ir.tensor(ctx.constant(value.name))
        cached = view.cache["onnx_ir"] = (ir.Model(graph, ir_version=10), by_output)
    return cached


def _no_replacement(op, **_):  # the rules are used to match only
    return None


class ChainPattern:
    """A chain (one or more pattern functions: alternatives tried in order), matched with
    every order of the operands of its Add and Mul nodes.

    Args:
        name: for the missing-onnxscript warning.
        functions: onnxscript pattern functions ``f(op, **variables) -> output``.
        differentiable: the variables that may need a gradient; a match where any other
            input of the chain's nodes needs one is refused.
    """

    def __init__(self, name: str, *functions: Callable, differentiable: Sequence[str]):
        self.name = name
        self._differentiable = tuple(differentiable)
        self._functions = functions
        self._variants: Optional[List[object]] = None

    def _rules(self) -> List[object]:
        if self._variants is None:
            self._variants = [
                variant
                for function in self._functions
                for variant in _rewriter()[1].RewriteRule(function, _no_replacement).commute()
            ]
        return self._variants

    def match(
        self, view: GraphView, ctx: GradientContext, node: onnx.NodeProto
    ) -> Optional[Tuple[Dict[str, Binding], List[onnx.NodeProto]]]:
        """The chain's variables and nodes if it ends at ``node``, else None."""
        if not AVAILABLE:
            self._warn(view, "onnxscript is not installed", "; `pip install onnxscript` fuses them")
            return None
        try:
            return self._match(view, ctx, node)
        except Exception as error:  # an optional speed-up must not break the export
            self._warn(view, f"onnxscript's rewriter failed on this graph ({type(error).__name__}: {error})")
            return None

    def match_scalars(
        self, view: GraphView, ctx: GradientContext, node: onnx.NodeProto, marker: str, scalars: Dict[str, float]
    ) -> Optional[Tuple[Dict[str, Binding], List[onnx.NodeProto]]]:
        """:meth:`match` for a chain ending at the Mul ``node`` of a graph that has a
        ``marker`` node, whose variables named in ``scalars`` are one-element constants of
        those values (to float precision); else None."""
        if node.op_type != "Mul" or node.domain not in ("", "ai.onnx") or marker not in view.op_types:
            return None
        found = self.match(view, ctx, node)
        if found is None:
            return None
        for name, expected in scalars.items():
            value = view.static_value(ctx, found[0][name])
            if value is None or value.size != 1 or not np.isclose(float(value.reshape(())), expected, rtol=1e-6, atol=0):
                return None
        return found

    def _warn(self, view: GraphView, reason: str, hint: str = "") -> None:
        """Warns once per graph that ``self``'s chains go node by node, and why."""
        if not view.cache.get(f"warned {self.name}"):
            view.cache[f"warned {self.name}"] = True
            warnings.warn(
                f"{reason}: chains like {self.name} are differentiated node by node "
                f"(correct, with more passes over the data){hint}",
                stacklevel=4,
            )

    def _match(
        self, view: GraphView, ctx: GradientContext, node: onnx.NodeProto
    ) -> Optional[Tuple[Dict[str, Binding], List[onnx.NodeProto]]]:
        ir = _rewriter()[0]
        model, by_output = _ir_view(view, ctx)
        ir_node = by_output.get(node.output[0]) if node.output else None
        if ir_node is None:
            return None
        for rule in self._rules():
            found = rule.match(model, model.graph, ir_node, check_nodes_are_removable=True)
            if found:
                bindings = {
                    key: value.name if isinstance(value, ir.Value) else value
                    for key, value in found.bindings.items()
                    if value is None or isinstance(value, (ir.Value, int))
                }
                nodes = [view.producer[n.outputs[0].name] for n in found.nodes]
                inside = {name for chain_node in nodes for name in chain_node.output}
                allowed = {bindings.get(name) for name in self._differentiable} | inside
                if any(ctx.needs_grad(name) for chain_node in nodes for name in chain_node.input if name not in allowed):
                    return None  # e.g. a trainable initializer where the pattern has a constant
                return bindings, nodes
        return None
