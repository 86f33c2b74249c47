"""GradientContext: what a gradient rule sees of the graph and how it emits backward nodes."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Set, Union

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnx.shape_inference

from normgrad.ops import DOMAIN, outer_product_sum

__all__ = ["GradientContext", "FLOAT_ELEM_TYPES", "attr", "constant_node_value", "describe", "value_types"]

FLOAT_ELEM_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
)
"""Element types a gradient can flow through."""

Dim = Union[int, str, None]

WEIGHT_GRADIENT_OUTER_PRODUCT_MACS = 1 << 24
"""Float32 weight gradients of at least this many multiply-adds are an OuterProductSum
(:meth:`GradientContext.weight_gradient`)."""


def reserve_name(used: Set[str], name: str) -> str:
    """``name``, or ``name`` with the first numeric suffix not in ``used``; added to ``used``."""
    candidate, k = name, 0
    while candidate in used:
        k += 1
        candidate = f"{name}_{k}"
    used.add(candidate)
    return candidate


class GradientContext:
    """Type information about the forward graph plus a writer for backward nodes.

    Args:
        graph: the forward graph (after shape inference).
        opset: the default-domain opset of the training graph.
        needs_grad: names of the values whose gradient is wanted.
    """

    def __init__(self, graph: onnx.GraphProto, opset: int, needs_grad: Set[str]):
        self.opset = opset
        # emitted nodes live in one message's arena (~0.4 KB each), not as standalone
        # NodeProtos (~1.6 KB each under upb): millions are emitted for a large model
        self._emitted = onnx.GraphProto()
        self.nodes = self._emitted.node
        self._needs_grad = needs_grad
        self._types: Dict[str, onnx.TypeProto] = {}
        self._constants: Dict[str, np.ndarray] = {}
        for info in list(graph.input) + list(graph.value_info) + list(graph.output):
            if info.name not in self._types or info.type.tensor_type.HasField("shape"):
                self._types[info.name] = info.type
        fed = {i.name for i in graph.input}
        for init in graph.initializer:
            self._types.setdefault(init.name, oh.make_tensor_type_proto(init.data_type, list(init.dims)))
            # an initializer that is also an input (IR < 4 style) is only a default; one in
            # external data (a frozen base) is a weight no rule reads, not loaded
            if init.name not in fed and init.data_location != onnx.TensorProto.EXTERNAL:
                self._constants[init.name] = onh.to_array(init)
        for node in graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.attribute:
                value = constant_node_value(node)
                if value is not None:
                    self._constants[node.output[0]] = value
        self._producers = {name: node for node in graph.node for name in node.output if name}
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
        self.batch_statistics: Dict[str, "BatchStatistics"] = {}
        """{Y of a training-mode BatchNormalization: its forward statistics}, set by the builder."""
        self.embeddings: Dict[str, "EmbeddingGradient"] = {}
        """{initializer: torch's nn.Embedding gradient semantics of its lookups} (metadata of
        :func:`normgrad.torch.export`, :func:`normgrad.graphs.torch_exports.embedding_gradients`),
        set by the builder."""
        self.declared: List[onnx.ValueInfoProto] = []
        """Value infos of emitted values (:meth:`declare`); the builder writes them into the graph."""
        self.forward_replacements: Dict[str, List[onnx.NodeProto]] = {}
        """{first output of a forward node: the nodes the training graph computes it with instead}
        (:meth:`replace_forward`); the builder puts them in the node's place."""

    # ----------------------------------------------------------------- forward graph facts
    def needs_grad(self, name: str) -> bool:
        """Whether a gradient of forward value ``name`` is wanted."""
        return bool(name) and name in self._needs_grad

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

    def rank(self, name: str, node: Optional[onnx.NodeProto] = None) -> int:
        """The rank of ``name``.

        Raises:
            UnsupportedOperatorError: the rank is unknown (the rule cannot be applied).
        """
        shape = self.shape(name)
        if shape is None:
            from normgrad.graphs.rules import UnsupportedOperatorError

            where = f" (input of {describe(node)})" if node is not None else ""
            raise UnsupportedOperatorError(f"the rank of '{name}'{where} is unknown; shape inference could not find it")
        return len(shape)

    def static_shape(self, name: str) -> Optional[List[int]]:
        """The shape of ``name`` if every dim is a known int, else None."""
        shape = self.shape(name)
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        return shape

    def constant(self, name: str) -> Optional[np.ndarray]:
        """The value of ``name`` if nothing can change it at run time: a Constant node's
        output, or an initializer that is not also a graph input (and so cannot be fed)."""
        return self._constants.get(name)

    def producer(self, name: str) -> Optional[onnx.NodeProto]:
        """The forward node whose output is ``name`` (None for graph inputs and initializers)."""
        return self._producers.get(name)

    def type_of(self, name: str) -> Optional[onnx.TypeProto]:
        """The TypeProto of forward value ``name``."""
        return self._types.get(name)

    # ------------------------------------------------------------------- node emission
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

    def declare(self, name: str, like: str) -> str:
        """Declares emitted value ``name`` in the graph's value_info with the type and shape of
        forward value ``like``, when its shape is static (onnxruntime knows no output shape of a
        normgrad node, and some of its fusions need one: a Gemm takes a summand of known shape as
        its C); returns ``name``."""
        type_proto = self.type_of(like)
        if type_proto is not None and self.static_shape(like) is not None and self.elem_type(like):
            self._types[name] = type_proto
            self.declared.append(oh.make_value_info(name, type_proto))
        return name

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

    def weight_gradient(self, p: str, q: str, dims: Optional[Sequence[Optional[int]]], like: str,
                        alpha: float = 1.0) -> str:
        """alpha P^T Q for 2-D P [t, m] and Q [t, n] (``dims`` = (t, m, n), None where unknown;
        ``like``: a forward value of their element type): a weight's gradient, summed over the
        t rows. MLAS multiplies a transposed A panel by panel, 20-35% slower than contiguous
        operands, and onnxruntime folds a Transpose feeding a Gemm back into its transA: a
        float32 product of at least WEIGHT_GRADIENT_OUTER_PRODUCT_MACS multiply-adds is an
        OuterProductSum (its kernel packs both operands itself), a smaller one, one of another
        element type or scaled by alpha a Gemm with transA."""
        t, m, n = dims if dims is not None else (None, None, None)
        if alpha == 1.0 and None not in (t, m, n) and self.elem_type(like) == onnx.TensorProto.FLOAT \
                and t * m * n >= WEIGHT_GRADIENT_OUTER_PRODUCT_MACS:
            return self.op(outer_product_sum.OP_TYPE, p, q, domain=DOMAIN)
        return self.op("Gemm", p, q, alpha=alpha if alpha != 1.0 else None, transA=1)

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

    def sum_to(self, grad: str, grad_like: str, target: str) -> str:
        """Sums ``grad`` (shaped like ``grad_like``) over the axes along which ``target`` was broadcast.

        Uses static shapes when they decide the axes and a runtime computation otherwise.
        """
        out_shape, in_shape = self.shape(grad_like), self.shape(target)
        if out_shape is not None and in_shape is not None and len(in_shape) <= len(out_shape):
            lead = len(out_shape) - len(in_shape)
            axes, decided = [], True
            for i, dim in enumerate(in_shape):
                out_dim = out_shape[lead + i]
                if dim == 1:
                    if out_dim != 1:
                        axes.append(lead + i)  # summing a size-1 axis is harmless
                elif not isinstance(dim, int) and (dim is None or dim != out_dim):
                    decided = False  # could be 1 at run time
            if decided:
                if axes:
                    grad = self.reduce("ReduceSum", grad, axes, keepdims=True, rank=len(out_shape))
                if lead:
                    grad = self.reduce("ReduceSum", grad, list(range(lead)), keepdims=False)
                return grad
        return self.sum_to_runtime(grad, target)

    def sum_to_runtime(self, grad: str, target: str) -> str:
        """``grad`` summed to the runtime shape of ``target`` (broadcast axes found at run time)."""
        grad_shape = self.shape_of(grad)
        target_shape = self.shape_of(target)
        pad_len = self.op("Sub", self.op("Size", grad_shape), self.op("Size", target_shape))
        pad = self.op(
            "ConstantOfShape",
            self.unsqueeze(pad_len, [0]),
            value=onh.from_array(np.ones(1, np.int64)),
        )
        padded = self.op("Concat", pad, target_shape, axis=0)
        one = self.op("Constant", value=onh.from_array(np.asarray(1, np.int64)))
        broadcast = self.op("And", self.op("Equal", padded, one), self.op("Not", self.op("Equal", grad_shape, one)))
        axes = self.op("Reshape", self.op("NonZero", broadcast), self.ints([-1]))
        summed = self.op("ReduceSum", grad, axes, keepdims=1, noop_with_empty_axes=1)
        return self.op("Reshape", summed, target_shape)

    def zeros_like(self, name: str) -> str:
        """A tensor of zeros with the runtime shape and dtype of forward value ``name``."""
        zero = self.scalar(0.0, name)
        return self.op("Expand", zero, self.shape_of(name))

    def replace_forward(self, node: onnx.NodeProto, nodes: Sequence[onnx.NodeProto]) -> None:
        """Has the training graph compute forward ``node``'s outputs (same names) with
        ``nodes`` in its place, e.g. a form that also keeps what the backward reads."""
        self.forward_replacements[next(name for name in node.output if name)] = list(nodes)

    def ensure_output(self, node: onnx.NodeProto, index: int, hint: str) -> str:
        """The name of forward ``node``'s output ``index``, adding the output if it is omitted."""
        while len(node.output) <= index:
            node.output.append("")
        if not node.output[index]:
            node.output[index] = self.reserve(f"{node.name or node.op_type}/{hint}")
        return node.output[index]


_RANK_OF_BROADCAST = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Sum", "Mean", "Neg", "Abs", "Exp", "Log", "Sqrt",
    "Reciprocal", "Tanh", "Sigmoid", "Relu", "Erf", "Sin", "Cos", "Cast", "CastLike", "Identity", "Equal", "Greater",
    "Less", "Not", "And", "Or",
})
"""Operators whose output rank is the largest rank of their inputs (NumPy broadcasting)."""


def constant_node_value(node: onnx.NodeProto) -> Optional[np.ndarray]:
    """The value of Constant node ``node`` (any of its value attributes but sparse and strings), or None."""
    attr = node.attribute[0]
    if attr.name == "value":
        return onh.to_array(attr.t)
    if attr.name == "value_ints":
        return np.asarray(list(attr.ints), np.int64)
    if attr.name == "value_int":
        return np.asarray(attr.i, np.int64)
    if attr.name == "value_floats":
        return np.asarray(list(attr.floats), np.float32)
    if attr.name == "value_float":
        return np.asarray(attr.f, np.float32)
    return None


def describe(node: onnx.NodeProto) -> str:
    """A human-readable reference to ``node`` for error messages."""
    return f"{node.op_type} node '{node.name}'" if node.name else f"{node.op_type} node producing '{node.output[0]}'"


def attr(node: onnx.NodeProto, name: str, default):
    """Attribute ``name`` of ``node`` (strings decoded), or ``default``."""
    for attribute in node.attribute:
        if attribute.name == name:
            value = oh.get_attribute_value(attribute)
            return value.decode() if isinstance(value, bytes) else value
    return default


def value_types(model: onnx.ModelProto) -> Dict[str, onnx.TypeProto]:
    """{value: its type} of every initializer, input, output and inferred value (shape
    inference with data propagation)."""
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    graph = inferred.graph
    types = {t.name: oh.make_tensor_type_proto(t.data_type, list(t.dims)) for t in graph.initializer}
    for info in list(graph.input) + list(graph.value_info) + list(graph.output):
        types[info.name] = info.type
    return types
