"""Sequence values rewritten to tensors before differentiation (a gradient cannot flow
through a sequence): the forms the exporters write for torch.split/chunk/unbind/stack.

* SplitToSequence read only by SequenceAt at constant positions, with piece sizes the graph
  fixes (torch's dynamo exporter for torch.split/chunk): one Split whose outputs are those
  pieces (plus a Squeeze per piece when ``keepdims=0`` without split).
* Otherwise (sizes computed at run time, as torch's TorchScript exporter writes for
  Mamba's splits, or positions computed at run time): each SequenceAt becomes a Slice of
  the input between run-time bounds: the cumulative sizes of a 1-D ``split``, or multiples
  of a scalar one (the last piece shorter: Slice clamps), the position taken modulo the
  number of pieces (negative positions count from the end).
* ConcatFromSequence of a SplitToSequence along the same axis (``new_axis=0`` over kept
  pieces, or ``new_axis=1`` over the size-1 pieces ``keepdims=0`` squeezed): the input itself.
* SequenceConstruct read by SequenceAt at a constant position: that tensor; read by
  ConcatFromSequence: a Concat (of the tensors Unsqueezed at ``axis`` when ``new_axis=1``).

A sequence that is a graph output, or read any other way, is left alone (the builder then
names the operator it cannot differentiate).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.graphs.context import attr, reserve_name
from normgrad.graphs.rewrites._graph import RewriteContext, constant_values

__all__ = ["rewrite_sequences", "apply"]


class _Writer:
    """Fresh names under one tag and the nodes written with them."""

    def __init__(self, used: set, tag: str):
        self.used, self.tag, self.nodes = used, tag, []

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        out = reserve_name(self.used, f"{self.tag}/{op_type}")
        self.nodes.append(oh.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def ints(self, values) -> str:
        return self.op("Constant", value=onh.from_array(np.asarray(values, np.int64)))


def _static_dim(model_inferred: onnx.GraphProto, name: str, axis: int) -> Optional[int]:
    for info in list(model_inferred.input) + list(model_inferred.value_info):
        dims = info.type.tensor_type.shape.dim
        if info.name == name and dims and -len(dims) <= axis < len(dims) and dims[axis].HasField("dim_value"):
            return dims[axis].dim_value
    return None


def _piece_sizes(graph, node, inferred) -> Optional[List[int]]:
    """The piece sizes of SplitToSequence ``node``, or None where the graph does not fix them."""
    split = constant_values(graph, node.input[1]) if len(node.input) > 1 and node.input[1] else None
    if split is not None and split.ndim == 1:
        return [int(v) for v in split]
    if len(node.input) > 1 and node.input[1] and split is None:
        return None
    dim = _static_dim(inferred, node.input[0], attr(node, "axis", 0))
    if dim is None:
        return None
    step = 1 if split is None else int(split)
    return [min(step, dim - start) for start in range(0, dim, step)]


def _squeezes(node: onnx.NodeProto) -> bool:
    """Whether SplitToSequence ``node`` squeezes its pieces (no split input, ``keepdims=0``)."""
    return not attr(node, "keepdims", 1) and not (len(node.input) > 1 and node.input[1])


def _read_piece(writer: _Writer, node: onnx.NodeProto, piece_op: str, inputs: list, output: str) -> None:
    """Writes ``piece_op(*inputs)`` into ``output``, then a Squeeze of the split axis when
    SplitToSequence ``node`` squeezes its pieces."""
    axis = attr(node, "axis", 0)
    if _squeezes(node):
        axes = writer.ints([axis])
        piece = writer.op(piece_op, *inputs) if piece_op != "Identity" else inputs[0]
        writer.nodes.append(oh.make_node("Squeeze", [piece, axes], [output]))
    else:
        writer.nodes.append(oh.make_node(piece_op, inputs, [output]))


def _as_split(used: set, node, users, positions, sizes, opset: int) -> Dict[int, list]:
    """One Split for SplitToSequence ``node`` whose readers are SequenceAt at constant ``positions``."""
    writer = _Writer(used, f"{node.name or 'SplitToSequence'}/piece")
    pieces = [reserve_name(used, f"{writer.tag}/piece") for _ in sizes]
    split_inputs = [node.input[0], writer.ints(sizes)] if opset >= 13 else [node.input[0]]
    split_attrs = {} if opset >= 13 else {"split": sizes}
    writer.nodes.append(oh.make_node("Split", split_inputs, pieces, name=writer.tag, axis=attr(node, "axis", 0),
                                     **split_attrs))
    replaced = {id(node): writer.nodes}
    for user, position in zip(users, positions):
        reader = _Writer(used, f"{user.name or 'SequenceAt'}/piece")
        _read_piece(reader, node, "Identity", [pieces[int(position) % len(sizes)]], user.output[0])
        replaced[id(user)] = reader.nodes
    return replaced


def _is_input_again(node: onnx.NodeProto, concat: onnx.NodeProto, rank: Optional[int]) -> bool:
    """Whether ConcatFromSequence ``concat`` of SplitToSequence ``node``'s pieces (x of ``rank``)
    rebuilds x: along the split axis, stacked anew exactly when the pieces were squeezed."""
    stacked = bool(attr(concat, "new_axis", 0))
    if stacked != _squeezes(node):
        return False
    split_axis, concat_axis = attr(node, "axis", 0), attr(concat, "axis", 0)
    if rank is None:
        return split_axis == concat_axis
    return split_axis % rank == concat_axis % rank


def _as_slices(used: set, node, users, split_rank: Optional[int], x_rank: Optional[int]) -> Optional[Dict[int, list]]:
    """Each SequenceAt reader of SplitToSequence ``node`` as a Slice between run-time bounds,
    each ConcatFromSequence reader as the input; None when a ConcatFromSequence does not
    rebuild the input."""
    x, axis = node.input[0], attr(node, "axis", 0)
    split = node.input[1] if len(node.input) > 1 and node.input[1] else None
    replaced = {}
    for user in users:
        if user.op_type == "ConcatFromSequence":
            if not _is_input_again(node, user, x_rank):
                return None
            replaced[id(user)] = [oh.make_node("Identity", [x], [user.output[0]])]
    shared = _Writer(used, f"{node.name or 'SplitToSequence'}/bounds")
    starts = ends = step = None
    if split is None or split_rank == 0:  # pieces of one size (1 without split), the last shorter
        step = shared.ints([1]) if split is None else shared.op(
            "Reshape", shared.op("Cast", split, to=onnx.TensorProto.INT64), shared.ints([1]))
        dim = shared.op("Shape", x, start=axis, end=axis + 1) if axis != -1 else shared.op("Shape", x, start=-1)
        count = shared.op("Div", shared.op("Sub", shared.op("Add", dim, step), shared.ints([1])), step)
    else:
        sizes = shared.op("Cast", split, to=onnx.TensorProto.INT64)
        ends = shared.op("CumSum", sizes, shared.ints(0))
        starts = shared.op("Sub", ends, sizes)
        count = shared.op("Shape", sizes)
    replaced[id(node)] = shared.nodes
    for user in users:
        if user.op_type != "SequenceAt":
            continue
        writer = _Writer(used, f"{user.name or 'SequenceAt'}/slice")
        position = writer.op("Reshape", writer.op("Cast", user.input[1], to=onnx.TensorProto.INT64), writer.ints([1]))
        index = writer.op("Mod", position, count)  # Mod takes the divisor's sign: from the end when negative
        if starts is None:
            start = writer.op("Mul", index, step)
            end = writer.op("Add", start, step)
        else:
            start, end = writer.op("Gather", starts, index), writer.op("Gather", ends, index)
        _read_piece(writer, node, "Slice", [x, start, end, writer.ints([axis])], user.output[0])
        replaced[id(user)] = writer.nodes
    return replaced


def _from_construct(used: set, node, users, positions) -> Optional[Dict[int, list]]:
    """SequenceConstruct ``node`` read by SequenceAt at constant ``positions`` and by ConcatFromSequence."""
    replaced: Dict[int, list] = {id(node): []}
    for user, position in zip(users, positions):
        if user.op_type == "SequenceAt":
            if position is None:
                return None
            picked = node.input[int(position) % len(node.input)]
            replaced[id(user)] = [oh.make_node("Identity", [picked], [user.output[0]])]
            continue
        axis = attr(user, "axis", 0)
        writer = _Writer(used, f"{user.name or 'ConcatFromSequence'}/concat")
        parts = list(node.input)
        if attr(user, "new_axis", 0):
            parts = [writer.op("Unsqueeze", part, writer.ints([axis])) for part in parts]
        writer.nodes.append(oh.make_node("Concat", parts, [user.output[0]], axis=axis))
        replaced[id(user)] = writer.nodes
    return replaced


def _flat_tile_repeats(graph: onnx.GraphProto, ranks: Dict[str, int], used: set) -> None:
    """Reshapes to 1-D each Tile's ``repeats`` that shape inference finds of another rank:
    torch's TorchScript export of ``torch.tensor_split`` at a run-time index writes repeats of
    shape [1, 1], which onnxruntime refuses ("'repeat' input tensor must be 1 dimensional")."""
    kept = []
    for node in graph.node:
        if node.op_type == "Tile" and ranks.get(node.input[1], 1) != 1:
            shape, flat = reserve_name(used, f"{node.name or 'Tile'}/flat_shape"), reserve_name(used, f"{node.name or 'Tile'}/repeats")
            kept += [oh.make_node("Constant", [], [shape], value=onh.from_array(np.asarray([-1], np.int64))),
                     oh.make_node("Reshape", [node.input[1], shape], [flat])]
            node.input[1] = flat
        kept.append(node)
    if len(kept) != len(graph.node):
        del graph.node[:]
        graph.node.extend(kept)


def rewrite_sequences(model: onnx.ModelProto) -> int:
    """Rewrites, in place, the sequence values of ``model``'s graph that only SequenceAt and
    ConcatFromSequence read into tensor ops (see the module docstring); returns how many
    nodes it replaced."""
    graph = model.graph
    if not any(node.op_type in ("SplitToSequence", "SequenceConstruct") for node in graph.node):
        return 0
    inferred = onnx.shape_inference.infer_shapes(model).graph
    ranks = {info.name: len(info.type.tensor_type.shape.dim) for info in list(inferred.input) + list(inferred.value_info)
             if info.type.tensor_type.HasField("shape")}
    ranks.update({init.name: len(init.dims) for init in graph.initializer})
    used = {n for node in graph.node for n in list(node.input) + list(node.output) + [node.name]}
    used |= {i.name for i in graph.input} | {t.name for t in graph.initializer}
    _flat_tile_repeats(graph, ranks, used)
    readers: dict = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    replaced: Dict[int, list] = {}
    for node in graph.node:
        if node.op_type not in ("SplitToSequence", "SequenceConstruct") or node.output[0] in outputs:
            continue
        users = readers.get(node.output[0], [])
        if not users or any(user.op_type not in ("SequenceAt", "ConcatFromSequence") for user in users):
            continue
        positions = [constant_values(graph, user.input[1]) if user.op_type == "SequenceAt" else None for user in users]
        if node.op_type == "SequenceConstruct":
            found = _from_construct(used, node, users, positions)
        elif all(user.op_type == "SequenceAt" and p is not None for user, p in zip(users, positions)) \
                and (sizes := _piece_sizes(graph, node, inferred)) is not None:
            found = _as_split(used, node, users, positions, sizes, opset)
        else:
            split = node.input[1] if len(node.input) > 1 and node.input[1] else None
            split_rank = ranks.get(split) if split else None
            found = None if split and split_rank is None else _as_slices(used, node, users, split_rank,
                                                                         ranks.get(node.input[0]))
        if found:
            replaced.update(found)
    if not replaced:
        return 0
    kept = [new for node in graph.node for new in replaced.get(id(node), [node])]
    del graph.node[:]
    graph.node.extend(kept)
    return len(replaced)


def apply(model: onnx.ModelProto, context: RewriteContext) -> int:
    """:func:`rewrite_sequences`."""
    return rewrite_sequences(model)
