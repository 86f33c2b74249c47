"""The dynamo exporter's erf GELU, ``x * ((erf(x / sqrt 2) + 1) * 0.5)``, is written in
TorchScript's order, ``(x * (erf(x / sqrt 2) + 1)) * 0.5``, which onnxruntime fuses into one
Gelu kernel (:func:`gelu_erf_fusable_order`; the same bits: a product by 0.5 is exact, below
|x| = 2^127, where x (erf + 1) overflows).
"""

from __future__ import annotations

import collections

import onnx

from normgrad.graphs.rewrites._graph import RewriteContext, constant_values

__all__ = ["gelu_erf_fusable_order", "apply"]


def gelu_erf_fusable_order(model: onnx.ModelProto) -> int:
    """Rewrites, in place, each ``Mul(x, Mul(Add(Erf(Div(x, c)), 1), 0.5))`` (either operand
    order in each Mul and the Add) into ``Mul(Mul(x, Add(...)), 0.5)`` where the inner
    ``Mul(.., 0.5)`` is read by that product alone; returns how many. Only the order of the
    products changes: onnxruntime's GeluFusion matches this order and not the other."""
    graph = model.graph
    producers = {name: node for node in graph.node for name in node.output if name}
    readers = collections.Counter(name for node in graph.node for name in node.input)
    outputs = {o.name for o in graph.output}

    def made_by(name: str, op_type: str):
        node = producers.get(name)
        return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None

    def is_scalar(name: str, value: float) -> bool:
        found = constant_values(graph, name)
        return found is not None and found.size == 1 and float(found.reshape(())) == value

    rewritten = 0
    for node in graph.node:
        if node.op_type != "Mul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        for x, cdf in (node.input, node.input[::-1]):
            halving = made_by(cdf, "Mul")
            if halving is None or readers[cdf] != 1 or cdf in outputs:
                continue
            sums = [(b, h) for b, h in (halving.input, halving.input[::-1]) if is_scalar(h, 0.5)]
            add = made_by(sums[0][0], "Add") if sums else None
            if add is None:
                continue
            erf = next((made_by(i, "Erf") for i in add.input if made_by(i, "Erf") is not None), None)
            other = [i for i in add.input if erf is None or i != erf.output[0]]
            div = made_by(erf.input[0], "Div") if erf is not None else None
            if div is None or div.input[0] != x or len(other) != 1 or not is_scalar(other[0], 1.0):
                continue
            halving.input[:] = [x, sums[0][0]]  # the former Mul(b, 0.5) now computes x * b
            node.input[:] = [cdf, sums[0][1]]  # and the product halves it
            rewritten += 1
            break
    return rewritten


def apply(model: onnx.ModelProto, context: RewriteContext) -> int:
    """:func:`gelu_erf_fusable_order`."""
    return gelu_erf_fusable_order(model)
