"""The patterns' registry and matching: what :mod:`normgrad.graphs.patterns` exports, in a
module of its own so that the pattern modules register into it without importing their
package (which imports them)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import onnx

from normgrad.graphs.context import GradientContext

__all__ = ["GraphView", "Match", "Matches", "register", "find_matches", "is_op"]


def is_op(node: Optional[onnx.NodeProto], op_type: str) -> bool:
    """Whether ``node`` is a standard-domain ``op_type`` node (False for None)."""
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _node_inputs(node: onnx.NodeProto) -> List[str]:
    """The values ``node`` reads: its inputs plus outer-scope values its subgraphs read."""
    names = [name for name in node.input if name]
    for attr in node.attribute:
        graphs = list(attr.graphs) + ([attr.g] if attr.HasField("g") else [])
        for graph in graphs:
            for inner in graph.node:
                names.extend(_node_inputs(inner))
            names.extend(o.name for o in graph.output)
    return names


class GraphView:
    """Who produces and who reads each value of the forward graph, for matchers.

    Args:
        graph: the forward graph.
    """

    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.producer: Dict[str, onnx.NodeProto] = {}
        self.consumers: Dict[str, List[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.output:
                if name:
                    self.producer[name] = node
            for name in _node_inputs(node):
                self.consumers.setdefault(name, []).append(node)
        self.outputs: Set[str] = {o.name for o in graph.output}
        self.op_types: Set[str] = {node.op_type for node in graph.node}
        self.cache: Dict[str, object] = {}
        """Per-graph data a matcher computes once (e.g. another view of the graph)."""

    def only_consumer(self, name: str, node: onnx.NodeProto) -> bool:
        """Whether ``name`` is read by ``node`` alone, once, and is not a graph output."""
        readers = self.consumers.get(name, [])
        return (
            name not in self.outputs
            and len(readers) == 1
            and _key(readers[0]) == _key(node)
            and list(node.input).count(name) == 1
        )


    def static_value(self, ctx: GradientContext, name: str) -> Optional[np.ndarray]:
        """The value of ``name`` if fixed: a constant (:meth:`GradientContext.constant`), or
        an Identity, Cast or Reshape of fixed values (as the dynamo exporter writes reduction
        axes without constant folding)."""
        value = ctx.constant(name)
        if value is not None:
            return value
        node = self.producer.get(name)
        if node is None or node.domain not in ("", "ai.onnx") or not node.input:
            return None
        operands = [self.static_value(ctx, i) if i else None for i in node.input]
        if operands[0] is None:
            return None
        if node.op_type == "Identity":
            return operands[0]
        if node.op_type == "Cast":
            to = next(a.i for a in node.attribute if a.name == "to")
            return operands[0].astype(onnx.helper.tensor_dtype_to_np_dtype(to))
        if node.op_type == "Reshape" and len(operands) == 2 and operands[1] is not None and 0 not in operands[1]:
            return operands[0].reshape(operands[1])
        return None


GradientFn = Callable[[GradientContext, str], Sequence[Tuple[str, str]]]


@dataclasses.dataclass
class Match:
    """One occurrence of a pattern.

    Attributes:
        pattern: the pattern's name (for messages and tests).
        anchor: the last node of the chain; its output's gradient starts the backward pass.
        nodes: every differentiable node of the chain, anchor included; the builder skips
            the others.
        gradient: ``gradient(ctx, anchor_output_grad) -> [(value, its gradient), ...]``
            for the chain's inputs that need one.
    """

    pattern: str
    anchor: onnx.NodeProto
    nodes: List[onnx.NodeProto]
    gradient: GradientFn


Matcher = Callable[[GraphView, GradientContext, onnx.NodeProto], Optional[Match]]
_PATTERNS: List[Tuple[str, Matcher]] = []


def register(name: str) -> Callable[[Matcher], Matcher]:
    """Decorator registering a matcher under ``name``."""

    def decorate(matcher: Matcher) -> Matcher:
        _PATTERNS.append((name, matcher))
        return matcher

    return decorate


def _key(node: onnx.NodeProto) -> Tuple[str, ...]:
    """A node's identity: its outputs (unique in SSA form; every chain node has one)."""
    return tuple(node.output)


def find_matches(graph: onnx.GraphProto, ctx: GradientContext) -> "Matches":
    """The non-overlapping matches in ``graph``."""
    view = GraphView(graph)
    matches = Matches()
    for node in reversed(graph.node):
        if matches.get(node) is not None:
            continue
        for _, matcher in _PATTERNS:
            found = matcher(view, ctx, node)
            if found is not None and not any(matches.get(n) is not None for n in found.nodes):
                matches.add(found)
                break
    return matches


class Matches:
    """The matches found in a graph, looked up by any node they cover."""

    def __init__(self):
        self._by_node: Dict[Tuple[str, ...], Match] = {}

    def add(self, match: Match) -> None:
        self._by_node.update((_key(n), match) for n in match.nodes)

    def get(self, node: onnx.NodeProto) -> Optional[Match]:
        """The match covering ``node``, or None."""
        return self._by_node.get(_key(node)) if any(node.output) else None

    def is_anchor(self, node: onnx.NodeProto) -> bool:
        """Whether ``node`` is the anchor of the match covering it."""
        match = self.get(node)
        return match is not None and _key(match.anchor) == _key(node)

    def __len__(self) -> int:
        return len({id(m) for m in self._by_node.values()})
