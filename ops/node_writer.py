"""NodeWriter: writes ONNX nodes into a graph under construction: fresh names, constants,
the Reduce* nodes written for an opset (deterministic stages), and the ranks and types it
knows of the values. The operators' function bodies written in standard ops
(:func:`normgrad.ops.softmax_cross_entropy.function_body`) and the gradient rules'
:class:`normgrad.graphs.context.GradientContext` both write through it."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Set, Union

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.ops._common import reserve_name

__all__ = ["NodeWriter", "Dim"]

Dim = Union[int, str, None]


class NodeWriter:
    """Writes nodes (:attr:`nodes`) whose names are fresh in ``graph``, knowing the types of
    ``graph``'s values.

    Args:
        graph: the graph the nodes are written for (its values' types and names are read).
        opset: the default-domain opset the nodes are written for.
    """

    def __init__(self, graph: onnx.GraphProto, opset: int):
        self.opset = opset
        # emitted nodes live in one message's arena (~0.4 KB each), not as standalone
        # NodeProtos (~1.6 KB each under upb): millions are emitted for a large model
        self._emitted = onnx.GraphProto()
        self.nodes = self._emitted.node
        self._types: Dict[str, onnx.TypeProto] = {}
        for info in list(graph.input) + list(graph.value_info) + list(graph.output):
            if info.name not in self._types or info.type.tensor_type.HasField("shape"):
                self._types[info.name] = info.type
        for init in graph.initializer:
            self._types.setdefault(init.name, oh.make_tensor_type_proto(init.data_type, list(init.dims)))
        self._gemm_products: Set[str] = set()  # outputs of emitted Gemms without C
        self._used: Set[str] = set(self._types)
        for node in graph.node:
            self._used.update(node.input)
            self._used.update(node.output)
            self._used.add(node.name)
        self._emitted_ranks: Dict[str, int] = {}
        self._constant_lengths: Dict[str, int] = {}
        self._scope = "grad"
        self._counters: Dict[str, int] = {}  # per scope: fresh names continue, never probe from 1 again

    def elem_type(self, name: str) -> Optional[int]:
        """The element type of forward value ``name``, or None if unknown."""
        type_proto = self._types.get(name)
        if type_proto is None or not type_proto.HasField("tensor_type"):
            return None
        return type_proto.tensor_type.elem_type or None

    def shape(self, name: str) -> Optional[List[Dim]]:
        """The static shape of ``name``: ints, symbolic strings or None per dim; None if unknown rank."""
        type_proto = self._types.get(name)
        if type_proto is None or not type_proto.HasField("tensor_type"):
            return None
        tensor = type_proto.tensor_type
        if not tensor.HasField("shape"):
            return None
        return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim]

    def static_shape(self, name: str) -> Optional[List[int]]:
        """The shape of ``name`` if every dim is a known int, else None."""
        shape = self.shape(name)
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        return shape

    def type_of(self, name: str) -> Optional[onnx.TypeProto]:
        """The TypeProto of forward value ``name``."""
        return self._types.get(name)

    def scope(self, node: Union[onnx.NodeProto, str]) -> None:
        """Sets the name prefix of the values emitted next: ``node``'s gradient, or a given prefix."""
        self._scope = node if isinstance(node, str) else f"grad/{node.name or node.op_type}"

    def fresh(self, hint: str = "t") -> str:
        """A value name unused in the graph."""
        while True:
            self._counters[self._scope] = counter = self._counters.get(self._scope, 0) + 1
            name = f"{self._scope}/{hint}_{counter}"
            if name not in self._used:
                self._used.add(name)
                return name

    def reserve(self, name: str) -> str:
        """Reserves ``name`` (or ``name`` with a numeric suffix, if taken) and returns it."""
        return reserve_name(self._used, name)

    def op(self, op_type: str, *inputs: Optional[str], outputs: int = 1, domain: str = "", **attrs):
        """Emits one node and returns its output name (or the list of them if ``outputs > 1``).

        ``outputs`` may also be a list of names (empty string for an omitted output).
        """
        if isinstance(outputs, int):
            names = [self.fresh(op_type.lower()) for _ in range(outputs)]
        else:
            names = list(outputs)
        attrs = {k: v for k, v in attrs.items() if v is not None}
        node = oh.make_node(
            op_type,
            [i or "" for i in inputs],
            names,
            name=self.fresh(f"{op_type}_node"),
            domain=domain,
            **attrs,
        )
        self.nodes.append(node)
        self._record_rank(node)
        if op_type == "Gemm" and not domain and len(node.input) == 2:
            self._gemm_products.add(names[0])
        return names[0] if len(names) == 1 else names

    def _record_rank(self, node: onnx.NodeProto) -> None:
        """Notes the rank of an emitted node's output where it follows from its inputs."""
        out, op_type = node.output[0], node.op_type
        if node.domain or not out:
            return
        if op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            dims = list(node.attribute[0].t.dims)
            self._emitted_ranks[out] = len(dims)
            if len(dims) == 1:
                self._constant_lengths[out] = dims[0]
        elif op_type in _RANK_OF_BROADCAST:
            ranks = [self.known_rank(name) for name in node.input if name]
            if ranks and None not in ranks:
                self._emitted_ranks[out] = max(ranks)
        elif op_type == "Reshape" and node.input[1] in self._constant_lengths:
            self._emitted_ranks[out] = self._constant_lengths[node.input[1]]
        elif op_type in ("Unsqueeze", "Squeeze") and len(node.input) > 1 and node.input[1] in self._constant_lengths:
            rank = self.known_rank(node.input[0])
            if rank is not None:
                change = self._constant_lengths[node.input[1]]
                self._emitted_ranks[out] = rank + change if op_type == "Unsqueeze" else rank - change

    def known_rank(self, name: str) -> Optional[int]:
        """The rank of ``name`` if known: a forward value's, a recorded gradient's
        (:meth:`gradient_of`), or an emitted value's that follows from its inputs."""
        shape = self.shape(name)
        if shape is not None:
            return len(shape)
        return self._emitted_ranks.get(name)

    def ints(self, values: Iterable[int]) -> str:
        """An int64 1-D Constant."""
        return self.op("Constant", value=onh.from_array(np.asarray(list(values), np.int64)))

    def scalar(self, value: float, like: str) -> str:
        """A scalar Constant with the element type of forward value ``like``."""
        elem_type = self.elem_type(like)
        if elem_type is None:
            return self.op("CastLike", self.scalar(value, ""), like) if like else self._float_const(value, 1)
        return self._float_const(value, elem_type)

    def _float_const(self, value: float, elem_type: int) -> str:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
        return self.op("Constant", value=onh.from_array(np.asarray(value, dtype=dtype)))

    def shape_of(self, name: str, start: Optional[int] = None, end: Optional[int] = None) -> str:
        """The runtime shape of ``name`` (``Shape`` with start/end)."""
        return self.op("Shape", name, start=start, end=end)

    def reshape_like(self, value: str, like: str) -> str:
        """``value`` reshaped to the runtime shape of ``like``."""
        return self.op("Reshape", value, self.shape_of(like))

    def sum_all(self, values: Sequence[str]) -> str:
        """The sum of ``values`` (itself if there is one). The outputs of Gemms without C
        are added one at a time, each in a Sum of two, which onnxruntime's GemmSumFusion
        turns into that Gemm's C: they cost no pass of their own."""
        if len(values) == 1:
            return values[0]
        products = [v for v in values if v in self._gemm_products]
        if len(products) < 2 or len(values) == 2:
            return self.op("Sum", *values)
        others = [v for v in values if v not in self._gemm_products]
        total = self.sum_all(others) if others else None
        for product in products:
            total = product if total is None else self.op("Sum", product, total)
        return total

    def gradient_of(self, grad: str, forward: str) -> str:
        """Records that backward value ``grad`` is the gradient of forward value ``forward``
        (so it has that value's rank); returns ``grad``."""
        rank = self.known_rank(forward)
        if rank is not None and self.known_rank(grad) is None:
            self._emitted_ranks[grad] = rank
        return grad

    def reduce(
        self, op_type: str, value: str, axes: Optional[Sequence[int]], keepdims: bool, rank: Optional[int] = None
    ) -> str:
        """A Reduce* node over ``axes`` (None: all axes), written for the context's opset.

        ReduceSum, ReduceMean and ReduceSumSquare whose axes are neither one leading nor one
        trailing run (e.g. [0, 2, 3] of NCHW, or a middle axis) are written as stages that
        each reduce a leading or a trailing run: onnxruntime's CPU kernels for a
        reduced-kept-reduced or kept-reduced-kept layout split the sum by thread count when
        the kept extent is smaller than the thread count, so the float result would change
        in its last bits with ``intra_op_num_threads``. A trailing run is reduced first (each
        output the sum of one contiguous row: x is read once and only [N, C, 1, 1] written,
        3x faster than a leading run first on [16, 64, 56, 56], 0.8 vs 2.6 ms at 2 threads),
        then a leading run (each output a column sum taken row by row); later stages of a
        ReduceSumSquare are ReduceSums. Other axes are reduced together with a size-1 axis
        put in front, a layout of four or more runs, which onnxruntime's general kernel sums
        output by output, each on one thread in order (a Transpose to the end would be
        folded back into the reduction by onnxruntime's graph optimizer). Needs the rank of
        ``value``: ``rank``, else :meth:`known_rank`; without it one node is written.
        """
        if axes is None or not axes:
            return self._reduce_node(op_type, value, axes, keepdims)
        rank = self.known_rank(value) if rank is None else rank
        if op_type not in ("ReduceSum", "ReduceMean", "ReduceSumSquare") or rank is None:
            return self._reduce_node(op_type, value, axes, keepdims)
        axes = sorted({a % rank for a in axes})
        leading = 0
        while leading < len(axes) and axes[leading] == leading:
            leading += 1
        rest = axes[leading:]
        trailing = rest == list(range(rank - len(rest), rank))
        if not rest or (not leading and trailing):  # one run: a single deterministic node
            return self._reduce_node(op_type, value, axes, keepdims)
        later = "ReduceSum" if op_type == "ReduceSumSquare" else op_type
        if trailing:
            result = self._reduce_node(op_type, value, rest, keepdims=True)
            result = self._reduce_node(later, result, axes[:leading], keepdims=True)
        else:  # a leading size-1 axis reduced too makes four or more runs: the general kernel
            result = value
            if leading:
                result = self._reduce_node(op_type, result, axes[:leading], keepdims=True)
                op_type = later
            lifted = self.unsqueeze(result, [0])
            summed = self._reduce_node(op_type, lifted, [0] + [a + 1 for a in rest], keepdims=True)
            result = self.op("Squeeze", summed, self.ints([0]))
        return result if keepdims else self.op("Squeeze", result, self.ints(axes))

    def _reduce_node(self, op_type: str, value: str, axes: Optional[Sequence[int]], keepdims: bool) -> str:
        if axes is None:
            return self.op(op_type, value, keepdims=int(keepdims))
        axes_as_input = op_type == "ReduceSum" or self.opset >= 18
        if axes_as_input:
            return self.op(op_type, value, self.ints(axes), keepdims=int(keepdims))
        return self.op(op_type, value, keepdims=int(keepdims), axes=list(axes))

    def unsqueeze(self, value: str, axes: Sequence[int]) -> str:
        """``Unsqueeze`` with constant axes."""
        return self.op("Unsqueeze", value, self.ints(axes))

    def transpose_last_two(self, value: str, rank: int) -> str:
        """``value`` with its last two axes swapped."""
        perm = list(range(rank))
        perm[-2], perm[-1] = perm[-1], perm[-2]
        return self.op("Transpose", value, perm=perm)


_RANK_OF_BROADCAST = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Sum", "Mean", "Neg", "Abs", "Exp", "Log", "Sqrt",
    "Reciprocal", "Tanh", "Sigmoid", "Relu", "Erf", "Sin", "Cos", "Cast", "CastLike", "Identity", "Equal", "Greater",
    "Less", "Not", "And", "Or",
})
"""Operators whose output rank is the largest rank of their inputs (NumPy broadcasting)."""
