"""Llama's gated unit ``Mul(Mul(gate, Sigmoid(gate)), up)`` of float32 gate and up of one static
shape becomes one ``normgrad:SiLUMul``: one pass instead of two (onnxruntime's QuickGelu,
then the Mul), no silu(gate) written in between; its gradient SwiGLUGrad
(:func:`silu_products`).
"""

from __future__ import annotations

from typing import Dict

import onnx
import onnx.helper as oh

from normgrad.graphs.patterns import GraphView
from normgrad.graphs.patterns.silu import match_gated_silu
from normgrad.graphs.rewrites._graph import RewriteContext, replace_chains
from normgrad.ops import DOMAIN, silu_mul

__all__ = ["silu_products", "apply"]


def silu_products(model: onnx.ModelProto) -> int:
    """Rewrites, in place, each ``Mul(Mul(gate, Sigmoid(gate)), up)`` that
    :func:`normgrad.graphs.patterns.silu.match_gated_silu` accepts (float32 gate and up of one
    static shape, the Sigmoid and the SiLU read by the chain alone, neither a graph output)
    into one ``normgrad:SiLUMul(gate, up)`` writing the product's output; returns how many.
    Needs the inferred types."""
    graph = model.graph
    types = {init.name: oh.make_tensor_type_proto(init.data_type, list(init.dims)) for init in graph.initializer}
    types.update((info.name, info.type) for info in list(graph.input) + list(graph.value_info) + list(graph.output))
    view = GraphView(graph)
    replaced: Dict[int, list] = {}
    for node in graph.node:
        chain = match_gated_silu(view, types.get, node)
        if chain is None:
            continue
        fused = oh.make_node(silu_mul.OP_TYPE, [chain.gate, chain.up], [node.output[0]], name=node.name, domain=DOMAIN)
        replaced.update({id(node): [fused], id(chain.silu): [], id(chain.sigmoid): []})
    return replace_chains(model, replaced, set())


def apply(model: onnx.ModelProto, context: RewriteContext) -> int:
    """:func:`silu_products`."""
    return silu_products(model)
