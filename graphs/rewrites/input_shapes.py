"""Shapes of computed values read from the graph's data inputs instead
(:func:`shapes_from_inputs`): run on the training graph after differentiation (not a forward
pass), so that no ``Shape`` node keeps a large forward activation alive until the backward.

The rules write ``Shape(X)`` wherever a gradient must take a forward value's runtime shape
(``reshape_like``, ``sum_to``, ...; ``Size`` for means), and the forward graph has its own.
onnxruntime runs a ``Shape`` node just before its reader, so X stays allocated from its
producer in the forward until that reader in the backward. Where X's inferred shape is made
of ints and dims named by a data input (``batch_size``, ``sequence_length``), its shape is the
same numbers taken from that input. A shape only Reshapes read as their target may also have
one dim known to neither (the rows of a ``[batch * sequence, n]`` product, flattened): -1
there gives the same target. On a LoRA step of a genai int4 Llama (hidden 768, 6 layers,
4 x 128 tokens) the adapters' products, kept only for the shapes their gradient Reshapes
read, were 80 MB of the step's 400 MB peak (tensor lifetimes simulated over onnxruntime's
profile); 148 of 614 MB on Qwen2-0.5B's shape.

That is only right when the inputs that name a dim alike are fed the same size:
:class:`normgrad.train.Trainer` refuses a batch (each micro-batch) whose data inputs disagree
on a dim they name alike, and only the forward model's data inputs are sources.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.graphs.context import attr, reserve_name
from normgrad.graphs.structure import subgraph_captures

__all__ = ["shapes_from_inputs", "dim_sources"]

InputAxis = Tuple[str, int]
"""(data input, axis): where a named dim is read at run time."""

ResolvedDim = Union[int, InputAxis]


def dim_sources(graph: onnx.GraphProto, data_inputs: Sequence[str]) -> Dict[str, InputAxis]:
    """{dim_param: (the first of ``data_inputs`` naming it, its first axis named so)}, in the
    order of ``data_inputs``; the dims onnx's inference invents (``unk__N``) excluded."""
    inputs = {i.name: i for i in graph.input}
    sources: Dict[str, InputAxis] = {}
    for name in data_inputs:
        for axis, dim in enumerate(inputs[name].type.tensor_type.shape.dim):
            if dim.HasField("dim_param") and dim.dim_param and not dim.dim_param.startswith("unk__"):
                sources.setdefault(dim.dim_param, (name, axis))
    return sources


def _resolved(node: onnx.NodeProto, type_proto: Optional[onnx.TypeProto], sources: Dict[str, InputAxis],
              reshape_target: bool) -> Optional[List[ResolvedDim]]:
    """The dims ``node`` (a Shape, or a Size: their product) outputs, each an int or a data
    input's axis; None where the rank of its input or one of the dims it outputs is unknown,
    except that a ``reshape_target`` (read only as Reshapes' shape, none of its ints 0) may
    have one unknown dim, written -1."""
    if type_proto is None or not type_proto.HasField("tensor_type") or not type_proto.tensor_type.HasField("shape"):
        return None
    dims = type_proto.tensor_type.shape.dim
    rank = len(dims)
    start, end = attr(node, "start", 0), attr(node, "end", rank)
    start, end = (min(max(i + rank if i < 0 else i, 0), rank) for i in (start, end))
    resolved: List[ResolvedDim] = []
    for dim in dims[start:end]:
        if dim.HasField("dim_value"):
            resolved.append(dim.dim_value)
        elif dim.HasField("dim_param") and dim.dim_param in sources:
            resolved.append(sources[dim.dim_param])
        else:
            resolved.append(-1)
    unknown = resolved.count(-1)
    # with allowzero unset a 0 in a Reshape's target copies the data's dim: -1 beside it is not the same target
    if unknown == 0 or (unknown == 1 and reshape_target and 0 not in resolved):
        return resolved
    return None


def _reshape_targets(graph: onnx.GraphProto) -> Set[str]:
    """The values of ``graph`` that only Reshape nodes read, each as its target shape (no
    graph output, nothing a subgraph reads)."""
    other = {o.name for o in graph.output}
    targets = set()
    for node in graph.node:
        other.update(subgraph_captures(node))
        for position, name in enumerate(node.input):
            if node.op_type == "Reshape" and node.domain in ("", "ai.onnx") and position == 1:
                targets.add(name)
            else:
                other.add(name)
    return targets - other


def _runs(dims: List[ResolvedDim]) -> List[Tuple[Optional[str], tuple]]:
    """``dims`` as maximal runs: ``(None, ints)`` of consecutive ints, ``(input, axes)`` of
    consecutive dims read from one input."""
    runs: List[Tuple[Optional[str], list]] = []
    for dim in dims:
        source, value = (None, dim) if isinstance(dim, int) else dim
        if runs and runs[-1][0] == source:
            runs[-1][1].append(value)
        else:
            runs.append((source, [value]))
    return [(source, tuple(values)) for source, values in runs]


class _ShapeWriter:
    """Writes the nodes computing a shape from ints and input axes, sharing one ``Shape`` per
    input and one node per constant or gathered run among all the shapes it writes."""

    def __init__(self, used: set):
        self._used = used
        self._shared: Dict[tuple, str] = {}
        self.nodes: List[onnx.NodeProto] = []

    def _node(self, op_type: str, inputs: Sequence[str], output: str, **attributes) -> str:
        self.nodes.append(oh.make_node(op_type, list(inputs), [output], name=reserve_name(self._used, output),
                                       **attributes))
        return output

    def _run(self, source: Optional[str], values: tuple, output: Optional[str] = None) -> str:
        """A run's 1-D int64 value (shared unless written as ``output``)."""
        key = ("run", source, values)
        if output is None and key in self._shared:
            return self._shared[key]
        hint = f"{source}.dims" if source is not None else "shape.dims"
        name = output or reserve_name(self._used, hint)
        if source is None:
            self._node("Constant", [], name, value=onh.from_array(np.array(values, np.int64)))
        else:
            indices = self._run(None, values)
            self._node("Gather", [self._input_shape(source), indices], name, axis=0)
        if output is None:
            self._shared[key] = name
        return name

    def _input_shape(self, source: str) -> str:
        key = ("input", source)
        if key not in self._shared:
            self._shared[key] = self._node("Shape", [source], reserve_name(self._used, f"{source}.shape"))
        return self._shared[key]

    def shape(self, dims: List[ResolvedDim], output: Optional[str] = None) -> str:
        """``dims`` as a 1-D int64 value: written as ``output``, else shared."""
        runs = _runs(dims)
        if len(runs) <= 1:
            source, values = runs[0] if runs else (None, ())
            return self._run(source, values, output)
        key = ("concat", tuple(dims))
        if output is None and key in self._shared:
            return self._shared[key]
        name = self._node("Concat", [self._run(source, values) for source, values in runs],
                          output or reserve_name(self._used, "shape"), axis=0)
        if output is None:
            self._shared[key] = name
        return name

    def size(self, dims: List[ResolvedDim], output: str) -> None:
        """The product of ``dims`` as the int64 scalar ``output``."""
        if all(isinstance(dim, int) for dim in dims):
            self._node("Constant", [], output, value=onh.from_array(np.array(np.prod(dims, dtype=np.int64))))
        else:
            self._node("ReduceProd", [self.shape(dims)], output, keepdims=0)


def shapes_from_inputs(model: onnx.ModelProto, types: Callable[[str], Optional[onnx.TypeProto]],
                       data_inputs: Sequence[str]) -> int:
    """Replaces, in place, each main-graph ``Shape`` (and ``Size``) node whose input a node
    computes and whose output is known from the input's type (``types``: a value's inferred
    type, or None) by nodes computing it from ints and ``Shape(data input)``: a dim named as
    a dim of one of ``data_inputs`` (the first in that order that the graph reads) is read
    from that input's shape; returns how many. A Shape reading a value of unknown rank or a dim named by no data input (or
    invented by onnx's inference) stays, unless only Reshapes read it as their target and
    that dim is its only one (then -1). Same values (start and end included), as long as the
    data inputs that name a dim alike are fed the same size."""
    graph = model.graph
    read = {name for node in graph.node for name in [*node.input, *subgraph_captures(node)]}
    sources = dim_sources(graph, [name for name in data_inputs if name in read])  # no input it did not read
    computed = {name for node in graph.node for name in node.output if name}
    used = {name for node in graph.node for name in [*node.input, *node.output, node.name]}
    used |= {i.name for i in graph.input} | {t.name for t in graph.initializer}
    writer, reshape_targets = _ShapeWriter(used), _reshape_targets(graph)
    nodes: List[onnx.NodeProto] = []
    replaced = 0
    for node in graph.node:
        dims = None
        if node.op_type in ("Shape", "Size") and node.domain in ("", "ai.onnx") and node.input[0] in computed:
            reshape_target = node.op_type == "Shape" and node.output[0] in reshape_targets
            dims = _resolved(node, types(node.input[0]), sources, reshape_target)
        if dims is None:
            nodes.append(node)
            continue
        start = len(writer.nodes)
        (writer.shape if node.op_type == "Shape" else writer.size)(dims, node.output[0])
        nodes.extend(writer.nodes[start:])
        replaced += 1
    if replaced:
        del graph.node[:]
        graph.node.extend(nodes)
    return replaced
