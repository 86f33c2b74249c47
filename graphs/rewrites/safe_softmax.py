"""torch's safe softmax, ``Where(IsNaN(Softmax(x)), 0, Softmax(x))`` over the last axis of a
float32 x (scaled-dot-product attention's), becomes one ``normgrad:SafeSoftmax``: one pass per
row instead of three, its gradient 0 on fully masked rows as torch's (:func:`safe_softmaxes`).
"""

from __future__ import annotations

from typing import Dict, Set

import numpy as np
import onnx
import onnx.helper as oh

from normgrad.graphs.context import attr
from normgrad.graphs.rewrites._graph import RewriteContext, constant_values, float32_dims, replace_chains, value_readers
from normgrad.ops import DOMAIN, bias_safe_softmax, safe_softmax

__all__ = ["safe_softmaxes", "apply"]


def safe_softmaxes(model: onnx.ModelProto, trainable: Set[str] = frozenset()) -> int:
    """Rewrites, in place, torch's safe softmax ``Where(IsNaN(s), 0, s)``, s = Softmax(x) over
    the last axis of a float32 x, into one ``normgrad:SafeSoftmax(x)`` writing the Where's
    output, where s is read by that IsNaN and that Where alone and the IsNaN by the Where
    alone (none a graph output) and the 0 is a constant (not one of the ``trainable``
    initializers, whose gradient the fused node would lose); returns how many. Where x is an
    Add read by the Softmax alone of scores of x's static shape and a bias that fits them
    (:func:`normgrad.ops.bias_safe_softmax.broadcasts_over_rows`: attention's mask), the node
    is ``normgrad:BiasSafeSoftmax(scores, bias)`` in the Add's place too. Needs the inferred
    types. The gradient is then ``SoftmaxGrad`` of the zeroed output: 0 on a fully masked
    row, as torch's, where the Where and Softmax gradients give NaN."""
    graph = model.graph
    types = {info.name: info.type.tensor_type for info in list(graph.input) + list(graph.value_info)}
    readers = value_readers(graph)
    producers = {name: node for node in graph.node for name in node.output}
    outputs = {o.name for o in graph.output}
    replaced: Dict[int, list] = {}
    zeros = set()

    known_dims = float32_dims(graph)

    def static_dims(name: str):
        """The static dims of a float32 value, else None."""
        dims = known_dims.get(name)
        return dims if dims is not None and all(isinstance(d, int) for d in dims) else None

    def scores_and_bias(x: str):
        """(scores, bias) of an Add x read by the softmax alone that BiasSafeSoftmax takes, else None."""
        add = producers.get(x)
        if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(readers[x]) != 1 \
                or x in outputs or static_dims(x) is None:
            return None
        for scores, bias in (tuple(add.input), tuple(reversed(add.input))):
            bias_dims = static_dims(bias)
            if static_dims(scores) == static_dims(x) and bias_dims is not None \
                    and bias_safe_softmax.broadcasts_over_rows(bias_dims, static_dims(x)):
                return scores, bias
        return None

    for softmax in graph.node:
        if softmax.op_type != "Softmax" or softmax.domain not in ("", "ai.onnx"):
            continue
        x, s = softmax.input[0], softmax.output[0]
        x_type = types.get(x)
        if x_type is None or x_type.elem_type != onnx.TensorProto.FLOAT or not x_type.HasField("shape"):
            continue
        rank = len(x_type.shape.dim)
        if rank == 0 or attr(softmax, "axis", -1) not in (-1, rank - 1):
            continue
        pair = sorted(readers[s], key=lambda node: node.op_type)
        if s in outputs or [n.op_type for n in pair] != ["IsNaN", "Where"] or any(n.domain not in ("", "ai.onnx") for n in pair):
            continue
        isnan, where = pair
        if list(where.input) != [isnan.output[0], where.input[1], s] or readers[isnan.output[0]] != [where] \
                or isnan.output[0] in outputs:
            continue
        zero = constant_values(graph, where.input[1])
        if where.input[1] in trainable or zero is None or zero.dtype != np.float32 or zero.size != 1 or zero.ndim > rank or float(zero.reshape(())) != 0.0:
            continue
        added = scores_and_bias(x)
        if added is None:
            fused = oh.make_node(safe_softmax.OP_TYPE, [x], [where.output[0]], name=softmax.name, domain=DOMAIN)
        else:
            fused = oh.make_node(bias_safe_softmax.OP_TYPE, list(added), [where.output[0]], name=softmax.name,
                                 domain=DOMAIN)
            replaced[id(producers[x])] = []
        replaced.update({id(softmax): [fused], id(isnan): [], id(where): []})
        zeros.add(where.input[1])
    return replace_chains(model, replaced, zeros)


def apply(model: onnx.ModelProto, context: RewriteContext) -> int:
    """:func:`safe_softmaxes` (no trainable initializer fused away)."""
    return safe_softmaxes(model, context.trainable)
