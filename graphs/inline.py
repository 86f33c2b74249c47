"""``inline=True`` / ``--inline``: a graph of standard ONNX domains only.

Every normgrad node is replaced by its function body, each body built for that node: the
normalization gradients (operators with ``STATIC_SUM_AXES_OF``) get their reduction axes as
constants where the parameter's dims and x's rank are known at export, so runtimes that need
static reduction axes (OpenVINO's own runtime, tract) take them; the others get the shared
body. The result has no model-local function and imports no normgrad opset.

Each Scan's per-step (stacked) outputs are values of their own in the inlined form
(:func:`scan_outputs_own_values`): tract reshapes a stacked output to [1, ...] in place,
for every reader of that value in the body too (its shape inference then fails: "Impossible
to unify"). The copies cost about 3% of an LSTM step on onnxruntime, so the default form
shares the values.

``ReverseSequence`` (the reverse direction of a recurrent node with sequence_lens) becomes a
``GatherElements`` by per-sequence time indices (:func:`reversals_by_gather`): tract has no
ReverseSequence. The default form keeps the operator, one copy instead of an index tensor.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Set

import numpy as np
import onnx
import onnx.numpy_helper as onh
import onnx.helper as oh
import onnx.inliner
import onnx.shape_inference

from normgrad.ops import api
from normgrad.graphs.context import attr
from normgrad.graphs.context import value_types
from normgrad.ops import DOMAIN, OPERATORS, _common

__all__ = ["inline_normgrad", "reversals_by_gather", "scan_outputs_own_values", "shared_scan_outputs"]

_NODE_DOMAIN = "normgrad.inline.node"


def _dims(types: Dict[str, onnx.TypeProto], name: str) -> Optional[list]:
    info = types.get(name)
    if info is None or not info.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in info.tensor_type.shape.dim]


_SHAPE_OPS = {"Shape", "Size", "Constant", "ConstantOfShape", "Concat", "Gather", "Slice", "Squeeze", "Unsqueeze",
              "Reshape", "Cast", "Add", "Sub", "Mul", "Div", "ReduceProd", "Identity", "Range", "Equal", "Where"}
"""Default-domain ops that shape arithmetic uses, evaluated where every input is known."""


def _known_values(model: onnx.ModelProto) -> Dict[str, np.ndarray]:
    """Integer values computable at export: constants and the arithmetic on the shapes of
    values whose dims shape inference knows (what the gradient rules compute from weights'
    shapes, e.g. GroupNorm's per-channel gamma viewed as [1, G, C/G, 1])."""
    from onnx.reference import ReferenceEvaluator

    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    for info in list(inferred.graph.input) + list(inferred.graph.value_info):
        shape = info.type.tensor_type.shape
        if info.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in shape.dim):
            dims[info.name] = [d.dim_value for d in shape.dim]
    known: Dict[str, np.ndarray] = {}
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in _SHAPE_OPS:
            continue
        if node.op_type == "Shape" and node.input[0] in dims:
            start, end = attr(node, "start", 0), attr(node, "end", None)
            known[node.output[0]] = np.array(dims[node.input[0]][start:end], np.int64)
            continue
        if not all(name in known or not name for name in node.input):
            continue
        if node.op_type != "Constant" and not all(known[name].dtype.kind in "iub" for name in node.input if name):
            continue
        inputs = [name for name in node.input if name]
        single = oh.make_model(
            oh.make_graph([node], "fold", [oh.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(known[n].dtype),
                                                                      list(known[n].shape)) for n in inputs],
                          [oh.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output]),
            opset_imports=[o for o in model.opset_import if o.domain in ("", "ai.onnx")])
        try:
            values = ReferenceEvaluator(single).run(None, {n: known[n] for n in inputs})
        except Exception:  # noqa: BLE001 (an op the evaluator cannot fold stays unknown)
            continue
        for name, value in zip(node.output, values):
            if isinstance(value, np.ndarray) and value.dtype.kind in "iub" and value.size <= 64:
                known[name] = value
    return known


def _value_types(model: onnx.ModelProto) -> Dict[str, onnx.TypeProto]:
    """Types with the dims shape inference finds once the shape arithmetic known at export
    is folded (in a copy used for this only)."""
    known = _known_values(model)
    folded = copy.deepcopy(model)
    nodes = [n for n in folded.graph.node if not (n.output and all(o in known for o in n.output))]
    del folded.graph.node[:]
    folded.graph.node.extend(nodes)
    present = {t.name for t in folded.graph.initializer}
    folded.graph.initializer.extend(onh.from_array(value, name) for name, value in known.items() if name not in present)
    return value_types(folded)


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def inline_normgrad(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every normgrad node (and every other model-local function)
    inlined; normgrad bodies with static reduction axes where they are known."""
    model = api.add_functions(model)
    types = _value_types(model)
    opset = _opset(model)
    per_node = []
    for index, node in enumerate(model.graph.node):
        module = OPERATORS.get(node.op_type) if node.domain == DOMAIN else None
        positions = getattr(module, "STATIC_SUM_AXES_OF", None)
        if positions is None or max(positions) >= len(node.input) or not all(node.input[p] for p in positions):
            continue
        x_dims, param_dims = _dims(types, node.input[positions[0]]), _dims(types, node.input[positions[1]])
        sum_axes = _common.static_sum_axes(param_dims, None if x_dims is None else len(x_dims))
        if sum_axes is None:
            continue
        body = module.function_body(opset, sum_axes=sum_axes)
        body.domain, body.name = _NODE_DOMAIN, f"{node.op_type}_{index}"
        node.domain, node.op_type = _NODE_DOMAIN, body.name
        per_node.append(body)
    if per_node:
        model.functions.extend(per_node)
        model.opset_import.append(oh.make_opsetid(_NODE_DOMAIN, 1))
    model = onnx.inliner.inline_local_functions(model)
    del model.functions[:]
    kept = [o for o in model.opset_import if o.domain not in (DOMAIN, _NODE_DOMAIN)]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    scan_outputs_own_values(model)
    reversals_by_gather(model)
    return model


def _value_names(graph: onnx.GraphProto, names: Set[str]) -> Set[str]:
    """Every value and node name of ``graph`` and of the graphs in its nodes' attributes."""
    names.update(v.name for v in list(graph.input) + list(graph.output) + list(graph.value_info))
    names.update(t.name for t in graph.initializer)
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        names.add(node.name)
        for attribute in node.attribute:
            for subgraph in [attribute.g] if attribute.HasField("g") else attribute.graphs:
                _value_names(subgraph, names)
    return names


def shared_scan_outputs(scan: onnx.NodeProto) -> List[int]:
    """Positions among the body outputs of ``scan``'s per-step outputs that are also a body
    input, a state output or another output, or are read inside the body."""
    body = next(a.g for a in scan.attribute if a.name == "body")
    states = len(body.input) - attr(scan, "num_scan_inputs", None)
    read = {i for n in body.node for i in n.input} | {i.name for i in body.input}
    outputs = [o.name for o in body.output]
    return [k for k in range(states, len(outputs)) if outputs[k] in read or outputs[k] in outputs[:k]]


def scan_outputs_own_values(model: onnx.ModelProto) -> None:
    """Makes each of :func:`shared_scan_outputs` of every main-graph Scan an Identity of the value."""
    used: Optional[Set[str]] = None
    for node in model.graph.node:
        if node.op_type != "Scan" or node.domain not in ("", "ai.onnx"):
            continue
        body = next(a.g for a in node.attribute if a.name == "body")
        for k in shared_scan_outputs(node):
            name = body.output[k].name
            used = _value_names(model.graph, set()) if used is None else used
            own = next(f"{name}/own_{n}" for n in range(len(used) + 1) if f"{name}/own_{n}" not in used)
            used.update((own, f"{own}/Identity"))
            body.node.append(oh.make_node("Identity", [name], [own], name=f"{own}/Identity"))
            body.output[k].name = own


def reversals_by_gather(model: onnx.ModelProto) -> None:
    """Replaces every main-graph ``ReverseSequence`` by the same values gathered along time:
    x viewed as [time, batch, rest] (or [batch, time, rest]), and at step t of a sequence of
    length n the step n - 1 - t where t < n, else t itself."""
    graph = model.graph
    if not any(n.op_type == "ReverseSequence" and n.domain in ("", "ai.onnx") for n in graph.node):
        return
    used = _value_names(graph, set())
    nodes: List[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != "ReverseSequence" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        prefix = next(f"{node.output[0]}/gathered_{n}" for n in range(len(used) + 1)
                      if not any(name.startswith(f"{node.output[0]}/gathered_{n}") for name in used))
        counter = iter(range(1 << 30))

        def emit(op_type: str, *inputs: str, **attributes) -> str:
            output = f"{prefix}/{op_type}_{next(counter)}"
            nodes.append(oh.make_node(op_type, list(inputs), [output], name=output, **attributes))
            return output

        def ints(values) -> str:
            return emit("Constant", value=onh.from_array(np.asarray(values, np.int64)))

        time_axis, batch_axis = attr(node, "time_axis", 0), attr(node, "batch_axis", 1)
        x, lengths = node.input[0], emit("Cast", node.input[1], to=onnx.TensorProto.INT64)
        view = emit("Reshape", x, ints([0, 0, -1]))
        steps = emit("Range", ints(0), emit("Squeeze", emit("Shape", x, start=time_axis, end=time_axis + 1), ints([0])),
                     ints(1))
        steps = emit("Unsqueeze", steps, ints([1 - time_axis]))  # [T, 1] or [1, T]
        lengths = emit("Unsqueeze", lengths, ints([1 - batch_axis]))  # [1, B] or [B, 1]
        reversed_steps = emit("Sub", emit("Sub", lengths, ints(1)), steps)
        index = emit("Where", emit("Less", steps, lengths), reversed_steps, steps)
        index = emit("Expand", emit("Unsqueeze", index, ints([2])), emit("Shape", view))
        gathered = emit("GatherElements", view, index, axis=time_axis)
        nodes.append(oh.make_node("Reshape", [gathered, emit("Shape", x)], [node.output[0]], name=f"{prefix}/Reshape"))
    del graph.node[:]
    graph.node.extend(nodes)
