"""Structural facts and checks of a forward graph that the gradient builder relies on."""

from __future__ import annotations

from typing import Dict, List, Set

import onnx

from normgrad.ops import DOMAIN

__all__ = ["subgraph_captures", "check_graph_structure", "updatable_in_place"]


def _subgraphs(node: onnx.NodeProto) -> List[onnx.GraphProto]:
    return [graph for attr in node.attribute for graph in ([attr.g] if attr.HasField("g") else list(attr.graphs))]


def subgraph_captures(node: onnx.NodeProto) -> List[str]:
    """The outer-scope values that ``node``'s subgraphs (If branches, Loop/Scan bodies, at
    any depth) read. They feed the node as much as ``node.input`` does, unlisted there."""
    captured: List[str] = []

    def visit(graph: onnx.GraphProto, scope: Set[str]) -> None:
        scope = scope | {i.name for i in graph.input} | {t.name for t in graph.initializer}
        scope |= {t.values.name for t in graph.sparse_initializer}
        for inner in graph.node:
            for name in inner.input:
                if name and name not in scope and name not in captured:
                    captured.append(name)
            for sub in _subgraphs(inner):
                visit(sub, scope)
            scope = scope | set(inner.output)

    for sub in _subgraphs(node):
        visit(sub, set())
    return captured


def _describe(node: onnx.NodeProto) -> str:
    return f"{node.op_type} node '{node.name}'" if node.name else f"{node.op_type} node producing {list(node.output)}"


def check_graph_structure(graph: onnx.GraphProto) -> None:
    """Checks that every value has one producer and that the nodes are in topological order.

    Raises:
        ValueError: a value is produced twice; a node reads a value nothing defines; the
            graph has a cycle; or a node reads a value a later node produces (the message
            names the nodes and the value).
    """
    defined: Set[str] = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    producer: Dict[str, onnx.NodeProto] = {}
    for node in graph.node:
        for name in node.output:
            if not name:
                continue
            if name in producer or name in defined:
                first = _describe(producer[name]) if name in producer else "a graph input or initializer"
                raise ValueError(
                    f"'{name}' is produced twice (by {first} and by {_describe(node)}); every value needs one producer"
                )
            producer[name] = node
    available = set(defined)
    for index, node in enumerate(graph.node):
        for name in list(node.input) + subgraph_captures(node):
            if not name or name in available:
                continue
            if name not in producer:
                raise ValueError(f"{_describe(node)} reads '{name}', which no node, graph input or initializer defines")
            if _reaches(producer, producer[name], node):
                raise ValueError(f"the graph has a cycle: {_describe(node)} reads '{name}', which depends on its own output")
            raise ValueError(
                f"the nodes are not in topological order: {_describe(node)} reads '{name}', which "
                f"{_describe(producer[name])} produces later; sort the nodes topologically"
            )
        available.update(node.output)
    for output in graph.output:
        if output.name not in available:
            raise ValueError(f"graph output '{output.name}' is not produced by any node, input or initializer")


def _reaches(producer: Dict[str, onnx.NodeProto], start: onnx.NodeProto, target: onnx.NodeProto) -> bool:
    """Whether ``start`` depends (through node inputs) on an output of ``target``."""
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        if node is target:
            return True
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack += [producer[name] for name in list(node.input) + subgraph_captures(node) if name in producer]
    return False


_ELEMENTWISE = frozenset({("", "Add"), ("", "Sub"), ("", "Mul"), ("", "Div"), ("", "Max"), ("", "Min"),
                          (DOMAIN, "AdamUpdate")})
"""Ops whose outputs' element i reads only element i of same-shaped inputs: onnxruntime runs
the standard ones with the output in the input's buffer itself (their kernels declare
MayInplace); AdamUpdate's kernel and function body read an element before writing it."""


def _static_shape(info: onnx.ValueInfoProto):
    dims = info.type.tensor_type.shape.dim
    return [d.dim_value for d in dims] if all(d.HasField("dim_value") for d in dims) else None


def updatable_in_place(graph: onnx.GraphProto, value: str, next_value: str) -> bool:
    """Whether one buffer can hold both graph input ``value`` and graph output ``next_value``
    (the output written over the input during the run). Every node reading ``value`` must be
    a strict ancestor of the node writing ``next_value``, so data dependencies finish every
    read before the write starts, in any execution order or parallelism; or the writer
    itself, if it is elementwise and ``value`` has the output's shape (element i read before
    element i is written). CastLike's second input is its type only, not a read. Optimizer
    moments and running statistics qualify; a weight that a backward node reads after its
    update could run does not."""
    producer = {name: node for node in graph.node for name in node.output if name}
    writer = producer.get(next_value)
    inputs = {i.name: i for i in graph.input}
    outputs = {o.name: o for o in graph.output}
    if writer is None or value not in inputs or next_value not in outputs or value in outputs:
        return False

    def reads(node: onnx.NodeProto) -> bool:
        data_inputs = node.input[:1] if node.op_type == "CastLike" else node.input
        return value in data_inputs or value in subgraph_captures(node)

    readers = [node for node in graph.node if reads(node)]
    if any(node is writer for node in readers):
        shape = _static_shape(inputs[value])
        if (writer.domain or "", writer.op_type) not in _ELEMENTWISE or shape is None or shape != _static_shape(outputs[next_value]):
            return False
    ancestors, stack = set(), [writer]
    while stack:
        node = stack.pop()
        for name in list(node.input) + subgraph_captures(node):
            source = producer.get(name)
            if source is not None and id(source) not in ancestors:
                ancestors.add(id(source))
                stack.append(source)
    return all(id(node) in ancestors or node is writer for node in readers)
