"""The erf GELU of a float32 x (the exporters' Div, Erf, Add, Mul, Mul chain, or Gelu-20 with
approximate="none") becomes one ``normgrad:GeluWithSlope`` writing y and its derivative in one
pass: the gradient is then ``Mul(dy, slope)`` instead of GeluGrad's erf and exp over again
(:func:`gelu_erf_slopes`).
"""

from __future__ import annotations

from typing import Dict, Set

import onnx
import onnx.helper as oh

from normgrad.graphs.context import GradientContext, attr, reserve_name
from normgrad.graphs.patterns import GraphView, _declarative, gelu_erf_chain
from normgrad.graphs.rewrites._graph import RewriteContext, replace_chains
from normgrad.ops import DOMAIN, gelu_with_slope

__all__ = ["gelu_erf_slopes", "apply"]


def gelu_erf_slopes(model: onnx.ModelProto, opset: int, trainable: Set[str] = frozenset()) -> int:
    """Rewrites, in place, each erf GELU of a float32 x into one ``normgrad:GeluWithSlope(x)``
    writing y (the GELU's output name) and a new slope value; returns how many. The GELU is
    the chain :func:`normgrad.graphs.patterns.gelu_erf_chain.match_chain` matches (either
    product order; its intermediates read by the chain alone, none a graph output) or a
    default-domain ``Gelu`` with approximate="none", its constants none of the ``trainable``
    initializers (whose gradients the fused node would lose). Needs the inferred types; its
    constants no longer read are dropped."""
    graph = model.graph
    view = GraphView(graph)
    if "Erf" not in view.op_types and "Gelu" not in view.op_types:
        return 0
    ctx = GradientContext(graph, opset, set())
    used = {name for node in graph.node for name in list(node.input) + list(node.output)}
    used |= {i.name for i in graph.input} | {t.name for t in graph.initializer}
    replaced: Dict[int, list] = {}
    constants = set()
    for node in graph.node:
        if node.op_type == "Gelu" and node.domain in ("", "ai.onnx") and attr(node, "approximate", "none") == "none":
            bound, chain = {"x": node.input[0]}, [node]
        else:
            found = gelu_erf_chain.match_chain(view, ctx, node) if _declarative.AVAILABLE else None
            if found is None:  # (without onnxscript the backward's matcher warns that chains go node by node)
                continue
            bound, chain = found
        x = bound["x"]
        fixed = {bound[name] for name in ("root2", "one", "half") if name in bound}
        if ctx.elem_type(x) != onnx.TensorProto.FLOAT or any(id(n) in replaced for n in chain) or fixed & trainable:
            continue
        constants |= fixed
        y = node.output[0]
        slope = reserve_name(used, f"{y}_slope")
        fused = oh.make_node(gelu_with_slope.OP_TYPE, [x], [y, slope], name=node.name, domain=DOMAIN)
        replaced.update({id(n): [] for n in chain})
        replaced[id(node)] = [fused]
    return replace_chains(model, replaced, constants)


def apply(model: onnx.ModelProto, context: RewriteContext) -> int:
    """:func:`gelu_erf_slopes` (no trainable initializer fused away)."""
    return gelu_erf_slopes(model, context.opset, context.trainable)
