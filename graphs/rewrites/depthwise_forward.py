"""The forward of each depthwise Conv whose gradient is a ``normgrad:DepthwiseConvGrad`` becomes
one ``normgrad:DepthwiseConv`` (on training graphs, after differentiation), with the geometry
the gradient node has (auto_pad resolved).

onnxruntime runs a depthwise Conv fast only in its NCHWc layout, which it applies to constant
weights alone: in a training graph the weights are inputs, and its generic path took 2.5-6x
the operator's time at 1 thread (a 7x7 on [16, 48, 32, 32]: 8.4 against 2.1 ms; a 5x5 on
[16, 240, 16, 16]: 7.4 against 3.5). Its function body is the Conv, so ``--inline`` and
``--portable`` graphs keep the Conv.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import onnx
import onnx.helper as oh

from normgrad.graphs.context import attr
from normgrad.ops import DOMAIN, depthwise_conv, depthwise_conv_grad

__all__ = ["depthwise_forwards"]


def depthwise_forwards(model: onnx.ModelProto) -> int:
    """Rewrites, in place, each default-domain Conv(x, w[, b]) for which the graph has a
    DepthwiseConvGrad(x, w, ...) of its geometry into DepthwiseConv(x, w[, b]) with that node's
    attributes (same name and output); returns how many. Where x and w feed several such
    Convs whose own attributes do not tell which gradient node is theirs (SAME pads of
    different geometries), the Convs stay."""
    geometries: Dict[Tuple[str, str], List[Dict[str, object]]] = {}
    for node in model.graph.node:
        if node.op_type == depthwise_conv_grad.OP_TYPE and node.domain == DOMAIN:
            geometries.setdefault((node.input[0], node.input[1]), []).append(
                {a.name: oh.get_attribute_value(a) for a in node.attribute})
    count = 0
    for node in model.graph.node:
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx"):
            continue
        own = [g for g in geometries.get((node.input[0], node.input[1]), []) if _fits(node, g)]
        if not own or any(g != own[0] for g in own):
            continue
        inputs = list(node.input[:3]) if len(node.input) > 2 and node.input[2] else list(node.input[:2])
        forward = oh.make_node(depthwise_conv.OP_TYPE, inputs, list(node.output), name=node.name, domain=DOMAIN,
                               **own[0])
        node.CopyFrom(forward)
        count += 1
    return count


def _fits(conv: onnx.NodeProto, geometry: Dict[str, object]) -> bool:
    """Whether a DepthwiseConvGrad's ``geometry`` can be ``conv``'s (its pads resolved from
    auto_pad SAME_* are not checked: they need the shapes)."""
    auto_pad = attr(conv, "auto_pad", "NOTSET")
    pads = {"NOTSET": list(attr(conv, "pads", [0, 0, 0, 0])), "VALID": [0, 0, 0, 0]}.get(auto_pad, geometry["pads"])
    return (attr(conv, "group", 1) == geometry["group"] and list(attr(conv, "strides", [1, 1])) == geometry["strides"]
            and list(attr(conv, "dilations", [1, 1])) == geometry["dilations"] and list(pads) == geometry["pads"])
