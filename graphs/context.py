"""GradientContext: what a gradient rule sees of the graph and how it emits backward nodes."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Union

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnx.shape_inference

from normgrad.ops import DOMAIN, outer_product_sum
from normgrad.ops._common import describe, reserve_name
from normgrad.ops.node_writer import Dim, NodeWriter

__all__ = ["GradientContext", "FLOAT_ELEM_TYPES", "attr", "constant_node_value", "describe", "reserve_name", "value_types",
           "UnsupportedOperatorError"]

FLOAT_ELEM_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
)
"""Element types a gradient can flow through."""

class UnsupportedOperatorError(NotImplementedError):
    """A gradient must flow through an operator (or a variant of one) that no rule handles."""


WEIGHT_GRADIENT_OUTER_PRODUCT_MACS = 1 << 24
"""Float32 weight gradients of at least this many multiply-adds are an OuterProductSum
(:meth:`GradientContext.weight_gradient`)."""


class GradientContext(NodeWriter):
    """Type information about the forward graph plus a writer for backward nodes (:class:`NodeWriter`).

    Args:
        graph: the forward graph (after shape inference).
        opset: the default-domain opset of the training graph.
        needs_grad: names of the values whose gradient is wanted.
    """

    def __init__(self, graph: onnx.GraphProto, opset: int, needs_grad: Set[str]):
        super().__init__(graph, opset)
        self._needs_grad = needs_grad
        self._constants: Dict[str, np.ndarray] = {}
        fed = {i.name for i in graph.input}
        for init in graph.initializer:
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

    def rank(self, name: str, node: Optional[onnx.NodeProto] = None) -> int:
        """The rank of ``name``.

        Raises:
            UnsupportedOperatorError: the rank is unknown (the rule cannot be applied).
        """
        shape = self.shape(name)
        if shape is None:
            where = f" (input of {describe(node)})" if node is not None else ""
            raise UnsupportedOperatorError(f"the rank of '{name}'{where} is unknown; shape inference could not find it")
        return len(shape)

    def constant(self, name: str) -> Optional[np.ndarray]:
        """The value of ``name`` if nothing can change it at run time: a Constant node's
        output, or an initializer that is not also a graph input (and so cannot be fed)."""
        return self._constants.get(name)

    def producer(self, name: str) -> Optional[onnx.NodeProto]:
        """The forward node whose output is ``name`` (None for graph inputs and initializers)."""
        return self._producers.get(name)

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

    def declare_shape(self, name: str, elem_type: int, dims: Sequence[Union[int, str]]) -> str:
        """Declares emitted value ``name`` in the graph's value_info as a tensor of ``elem_type``
        and ``dims`` (ints and dim_params, each known); returns ``name``. onnxruntime lets an
        output take the buffer of an input its kernel may overwrite only when the graph gives
        both the same shape (equal ints or equal dim_params)."""
        type_proto = oh.make_tensor_type_proto(elem_type, list(dims))
        self._types[name] = type_proto
        self.declared.append(oh.make_value_info(name, type_proto))
        return name

    def same_type(self, name: str, like: str) -> str:
        """Records that value ``name`` (e.g. a forward output a rule added) has the type and
        shape of forward value ``like``, for the rules' own reading; returns ``name``."""
        type_proto = self.type_of(like)
        if type_proto is not None:
            self._types[name] = type_proto
        return name

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
