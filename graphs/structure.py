"""Structural facts and checks of a forward graph that the gradient builder relies on."""

from __future__ import annotations

from typing import Dict, List, Mapping, Set

import onnx

from normgrad.ops import DOMAIN, OPERATORS

__all__ = ["subgraph_captures", "check_graph_structure", "in_place_updates", "ALIASING"]


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


_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min", "Where"})
"""Default-domain ops whose output element i reads only element i of same-shaped inputs:
onnxruntime runs them with the output in the input's buffer itself (their kernels declare
MayInplace). A normgrad operator says so with ``ELEMENTWISE = True`` in its module."""


def _elementwise(node: onnx.NodeProto) -> bool:
    if node.domain in ("", "ai.onnx"):
        return node.op_type in _ELEMENTWISE
    return node.domain == DOMAIN and getattr(OPERATORS.get(node.op_type), "ELEMENTWISE", False)


ALIASING = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Dropout", "Optional",
                      "OptionalGetElement", "ExpandDims", "InPlaceAccumulator", "Yield"})
"""Ops (default and com.microsoft domains) whose output 0 onnxruntime may place in input 0's
own buffer: their kernels declare ``Alias(0, 0)`` (CPU or another provider). Reading such an
output reads the input. (Kernels that declare ``MayInplace`` never reuse a graph input's
buffer: the planner counts one more use for every graph input.)"""


def _aliases(graph: onnx.GraphProto) -> Dict[str, List[str]]:
    """{value: every value that may share its buffer through a chain of :data:`ALIASING` nodes}."""
    direct: Dict[str, List[str]] = {}
    for node in graph.node:
        if node.op_type in ALIASING and node.domain in ("", "ai.onnx", "com.microsoft") and node.input and node.output[0]:
            direct.setdefault(node.input[0], []).append(node.output[0])
    closure: Dict[str, List[str]] = {}
    for value in direct:
        found, stack = [], list(direct[value])
        while stack:
            name = stack.pop()
            if name not in found:
                found.append(name)
                stack += direct.get(name, [])
        closure[value] = found
    return closure


def _static_shape(info: onnx.ValueInfoProto):
    dims = info.type.tensor_type.shape.dim
    return [d.dim_value for d in dims] if all(d.HasField("dim_value") for d in dims) else None


def in_place_updates(graph: onnx.GraphProto, state: Mapping[str, str]) -> Set[str]:
    """The graph inputs of ``state`` ({input: output holding its next value}) whose input and
    output can share one buffer (the output written over the input during the run).

    Every node reading the input must be a strict ancestor of the node writing the output,
    so data dependencies finish every read before the write starts, in any execution order
    or parallelism; or the writer itself, if it is elementwise and the input has the
    output's shape (element i read before element i is written). A node reading a value
    that may share the input's buffer (:data:`ALIASING`: Reshape(W), Identity(Reshape(W))...)
    reads the input. CastLike's second input is its type only, not a read. Optimizer moments
    and running statistics qualify; a weight that a backward node reads after its update
    could run does not.

    The rule holds for the graph that runs: onnxruntime rewrites a graph before running it
    (a Transpose pair removed lets a backward MatMul read W itself), so give the graph
    onnxruntime wrote out for the session (``SessionOptions.optimized_model_filepath``), as
    :class:`normgrad.train.Trainer` does."""
    producer = {name: node for node in graph.node for name in node.output if name}
    inputs = {i.name: i for i in graph.input}
    outputs = {o.name: o for o in graph.output}
    reads: Dict[int, List[str]] = {}  # node id -> the values it reads (subgraph captures included)
    readers: Dict[str, List[onnx.NodeProto]] = {}
    for node in graph.node:
        reads[id(node)] = list(node.input) + subgraph_captures(node)
        data = (node.input[:1] if node.op_type == "CastLike" else list(node.input)) + subgraph_captures(node)
        for name in set(data):
            readers.setdefault(name, []).append(node)
    aliases = _aliases(graph)

    def ancestors(writer: onnx.NodeProto) -> Set[int]:
        found, stack = set(), [writer]
        while stack:
            for name in reads[id(stack.pop())]:
                source = producer.get(name)
                if source is not None and id(source) not in found:
                    found.add(id(source))
                    stack.append(source)
        return found

    result = set()
    for value, next_value in state.items():
        writer = producer.get(next_value)
        if writer is None or value not in inputs or next_value not in outputs or value in outputs:
            continue
        alias_readers = [node for name in aliases.get(value, ()) for node in readers.get(name, [])]
        if any(node is writer for node in alias_readers):  # a view's element i need not be the input's
            continue
        value_readers = readers.get(value, []) + alias_readers
        if any(node is writer for node in readers.get(value, [])):
            shape = _static_shape(inputs[value])
            if not _elementwise(writer) or shape is None or shape != _static_shape(outputs[next_value]):
                continue
        before = ancestors(writer)
        if all(id(node) in before or node is writer for node in value_readers):
            result.add(value)
    return result
