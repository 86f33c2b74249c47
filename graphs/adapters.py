"""LoRA adapters added to any ONNX model: beside each chosen MatMul, Gemm or
``com.microsoft`` MatMulNBits, ``y = base(x) + (dropout(x) @ A^T @ B^T) * (alpha / rank)``
with A ``[rank, in]`` and B ``[out, rank]`` (peft's shapes and initialization: A
kaiming-uniform, U(-1/sqrt(in), 1/sqrt(in)), B zeros).

:func:`add_adapters` writes the adapters into a forward model and records them in its
``normgrad.lora`` metadata (:data:`METADATA_LORA`), which the training and step graphs carry:
the builder then trains only the adapters (every other float initializer frozen).
:func:`wire_adapter` is the one place that writes an adapter's nodes; ``normgrad.lora``
uses it again for the deployable model (adapters as graph inputs, no dropout).
"""

from __future__ import annotations

import fnmatch
import json
import math
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np
import onnx
from onnx import helper, numpy_helper

from normgrad.errors import LoraError

__all__ = ["add_adapters", "wire_adapter", "lora_layers", "weight_is_out_by_in", "METADATA_LORA", "AdaptedLayer"]

METADATA_LORA = "normgrad.lora"
"""Metadata key: JSON ``{"rank", "alpha", "dropout", "seed", "layers": [AdaptedLayer as a dict]}``."""

_DEFAULT_DOMAINS = ("", "ai.onnx")
_ADAPTED = {"MatMul": _DEFAULT_DOMAINS, "Gemm": _DEFAULT_DOMAINS, "MatMulNBits": ("com.microsoft",)}
_FEW = 8


class AdaptedLayer(NamedTuple):
    """One adapted layer, as recorded in the metadata."""

    node: str
    """The base node's name."""
    op_type: str
    output: str
    """The base node's first output in the original model (the adapter's sum takes its name)."""
    weight: str
    """The base weight initializer."""
    A: str
    B: str
    in_features: int
    out_features: int
    scaling: float
    dtype: int = onnx.TensorProto.FLOAT
    """The layer's activation type (its weight's, a MatMulNBits's scales'): another than
    float32 is cast to float32 for the adapter and the adapter's output back."""


def lora_layers(model: onnx.ModelProto) -> Optional[Dict[str, object]]:
    """The ``normgrad.lora`` metadata of a model (forward, training or step graph) as a dict
    whose ``layers`` are :class:`AdaptedLayer`, None when it has none."""
    text = next((p.value for p in model.metadata_props if p.key == METADATA_LORA), None)
    if text is None:
        return None
    info = json.loads(text)
    info["layers"] = [AdaptedLayer(**layer) for layer in info["layers"]]
    return info


def _producers(graph: onnx.GraphProto) -> Dict[str, onnx.NodeProto]:
    return {output: node for node in graph.node for output in node.output}


def _attribute(node: onnx.NodeProto, name: str, default):
    found = next((a for a in node.attribute if a.name == name), None)
    return default if found is None else helper.get_attribute_value(found)


def _weight(node: onnx.NodeProto, initializers: Mapping[str, onnx.TensorProto],
            producers: Mapping[str, onnx.NodeProto]) -> "tuple[Optional[str], bool]":
    """(the initializer a layer's weight input is, whether it is read transposed), (None, False)
    when it is none: a MatMul reading ``Transpose(W)`` (torch's export of a Linear on a 3-D
    input) adapts W."""
    name = node.input[1] if len(node.input) > 1 else ""
    if name in initializers:
        return name, False
    source = producers.get(name)
    if (source is not None and source.op_type == "Transpose" and source.domain in _DEFAULT_DOMAINS
            and source.input[0] in initializers and len(initializers[source.input[0]].dims) == 2
            and list(_attribute(source, "perm", [1, 0])) == [1, 0]):
        return source.input[0], True
    return None, False


def _features(node: onnx.NodeProto, weight: onnx.TensorProto, transposed: bool) -> "tuple[int, int]":
    """(in, out) of a layer: a MatMul's weight is [in, out] (read through a Transpose: [out,
    in]), a Gemm's [in, out] or with transB [out, in]; a MatMulNBits's are its K and N."""
    if node.op_type == "MatMulNBits":
        return int(_attribute(node, "K", 0)), int(_attribute(node, "N", 0))
    if len(weight.dims) != 2:
        raise LoraError(f"{_describe(node)}: its weight {weight.name!r} has shape {list(weight.dims)}; a LoRA target's "
                        "weight is a matrix")
    rows, cols = weight.dims
    if node.op_type == "Gemm":
        if _attribute(node, "transA", 0):
            raise LoraError(f"{_describe(node)}: a Gemm with transA=1 cannot take a LoRA adapter (its input is "
                            "transposed)")
        transposed = bool(_attribute(node, "transB", 0))
    return (cols, rows) if transposed else (rows, cols)


def _describe(node: onnx.NodeProto) -> str:
    return f"{node.op_type} node {node.name or node.output[0]!r}"


def _check_options(targets: Sequence[str], rank: int, alpha: float, dropout: float) -> List[str]:
    if isinstance(targets, str):
        targets = [targets]
    targets = list(targets)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise LoraError(f"LoRA targets must be one or more fnmatch globs (node or weight names); got {targets!r}")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank <= 0:
        raise LoraError(f"the LoRA rank must be a positive integer; got {rank!r}")
    if not (isinstance(alpha, (int, float, np.number)) and math.isfinite(alpha) and alpha > 0):
        raise LoraError(f"the LoRA alpha must be a positive number; got {alpha!r}")
    if not (isinstance(dropout, (int, float, np.number)) and 0.0 <= dropout < 1.0):
        raise LoraError(f"the LoRA dropout must be in [0, 1); got {dropout!r}")
    return targets


def _targets(graph: onnx.GraphProto, globs: Sequence[str]) -> List[onnx.NodeProto]:
    """The layers whose node name or weight name matches a glob and whose weight is a stored
    matrix (an initializer), in graph order. A layer whose weight is computed (attention's
    activation products) is passed over, so ``*`` means every layer that can take an
    adapter; a glob that matches only such layers, or nothing, is refused by name."""
    initializers = {t.name: t for t in graph.initializer}
    producers = _producers(graph)
    candidates = [n for n in graph.node if n.domain in _ADAPTED.get(n.op_type, ()) and len(n.input) > 1]
    if not candidates:
        raise LoraError("the model has no MatMul, Gemm or MatMulNBits node: there is no layer to add a LoRA adapter to")
    names, stored = {}, set()
    for node in candidates:
        weight, _ = _weight(node, initializers, producers)
        names[id(node)] = [name for name in (node.name, node.input[1], weight) if name]
        if weight is not None:
            stored.add(id(node))

    def matching(glob):
        return [node for node in candidates if any(fnmatch.fnmatchcase(n, glob) for n in names[id(node)])]

    unmatched = [g for g in globs if not matching(g)]
    if unmatched:
        few = [names[id(node)][-1] for node in candidates if id(node) in stored][:_FEW]
        raise LoraError(f"LoRA targets {unmatched} match no MatMul, Gemm or MatMulNBits node or weight name of the "
                        f"model (some are: {', '.join(few)}{', ...' if len(stored) > _FEW else ''})")
    for glob in globs:
        if not any(id(node) in stored for node in matching(glob)):
            node = matching(glob)[0]
            raise LoraError(f"LoRA target {glob!r} matches only layers whose weight is not an initializer, e.g. "
                            f"{_describe(node)} reading {node.input[1]!r} (a LoRA target's weight is a stored matrix)")
    return [node for node in candidates if id(node) in stored and any(node in matching(g) for g in globs)]


def _adapter_names(weight: str) -> "tuple[str, str]":
    """peft's names: ``fc1.weight`` -> ``fc1.lora_A.weight``; any other name -> ``NAME.lora_A``."""
    if weight.endswith(".weight"):
        return f"{weight[: -len('.weight')]}.lora_A.weight", f"{weight[: -len('.weight')]}.lora_B.weight"
    return f"{weight}.lora_A", f"{weight}.lora_B"


def _layers(graph: onnx.GraphProto, nodes: List[onnx.NodeProto], rank: int, scaling: float) -> List[AdaptedLayer]:
    initializers = {t.name: t for t in graph.initializer}
    producers = _producers(graph)
    weights = []
    for node in nodes:
        weights.append(_weight(node, initializers, producers))
    shared = {w for w, _ in weights if sum(1 for v, _ in weights if v == w) > 1}
    taken = set(initializers) | {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    layers = []
    for node, (weight, transposed) in zip(nodes, weights):
        # a weight read by several adapted nodes gets one adapter per node, named after the node
        base = f"{node.name or node.output[0]}.weight" if weight in shared else weight
        a_name, b_name = _adapter_names(base)
        for name in (a_name, b_name):
            if name in taken:
                raise LoraError(f"the model already has a value named {name!r}, the name of the LoRA adapter of "
                                f"{_describe(node)}")
            taken.add(name)
        fan_in, fan_out = _features(node, initializers[weight], transposed)
        typed = initializers.get(node.input[2] if node.op_type == "MatMulNBits" else weight)
        layers.append(AdaptedLayer(node.name, node.op_type, node.output[0], weight, a_name, b_name, fan_in, fan_out,
                                   scaling, typed.data_type if typed is not None else onnx.TensorProto.FLOAT))
    return layers


def _prefix(layer: AdaptedLayer) -> str:
    """The start of the names of an adapter's nodes and values (``fc1.lora``)."""
    stem = layer.A[: -len(".lora_A.weight")] if layer.A.endswith(".lora_A.weight") else layer.A[: -len(".lora_A")]
    return f"{stem}.lora"


def wire_adapter(graph: onnx.GraphProto, layer: AdaptedLayer, dropout: float = 0.0) -> None:
    """Writes one adapter's nodes into ``graph`` right after its base node (found by
    ``layer.output``): the base node's output is renamed and ``layer.output`` becomes
    base + (dropout(x) @ A^T @ B^T) * scaling, A and B read by name (initializers or inputs
    the caller adds), in float32 (a layer of another type: x cast to float32, the sum's
    term cast back). Training-mode Dropout on x when ``dropout`` > 0.

    Raises:
        LoraError: no node of ``layer.op_type`` computes ``layer.output`` (a model other than
            the one the adapters were made for).
    """
    index = next((i for i, n in enumerate(graph.node) if n.output and n.output[0] == layer.output), None)
    if index is None or graph.node[index].op_type != layer.op_type:
        raise LoraError(f"the model has no {layer.op_type} node computing {layer.output!r}, the base layer of LoRA "
                        f"adapter {layer.A!r}: the adapters were made for another model")
    base = graph.node[index]
    prefix = _prefix(layer)
    base.output[0] = f"{prefix}.base_output"
    x = base.input[0]
    nodes = []
    cast = layer.dtype != onnx.TensorProto.FLOAT
    if cast:
        nodes.append(helper.make_node("Cast", [x], [f"{prefix}.input"], name=f"{prefix}.Cast", to=onnx.TensorProto.FLOAT))
        x = f"{prefix}.input"
    if dropout > 0:
        nodes += [helper.make_node("Constant", [], [f"{prefix}.dropout_ratio"], name=f"{prefix}.dropout_ratio",
                                   value=numpy_helper.from_array(np.array(dropout, np.float32))),
                  helper.make_node("Constant", [], [f"{prefix}.dropout_training"], name=f"{prefix}.dropout_training",
                                   value=numpy_helper.from_array(np.array(True))),
                  helper.make_node("Dropout", [x, f"{prefix}.dropout_ratio", f"{prefix}.dropout_training"],
                                   [f"{prefix}.dropout"], name=f"{prefix}.Dropout")]
        x = f"{prefix}.dropout"
    nodes += [
        helper.make_node("Transpose", [layer.A], [f"{prefix}.A_t"], name=f"{prefix}.A_Transpose", perm=[1, 0]),
        helper.make_node("MatMul", [x, f"{prefix}.A_t"], [f"{prefix}.down"], name=f"{prefix}.A_MatMul"),
        helper.make_node("Transpose", [layer.B], [f"{prefix}.B_t"], name=f"{prefix}.B_Transpose", perm=[1, 0]),
        helper.make_node("MatMul", [f"{prefix}.down", f"{prefix}.B_t"], [f"{prefix}.up"], name=f"{prefix}.B_MatMul"),
        helper.make_node("Constant", [], [f"{prefix}.scaling"], name=f"{prefix}.scaling",
                         value=numpy_helper.from_array(np.array(layer.scaling, np.float32))),
        helper.make_node("Mul", [f"{prefix}.up", f"{prefix}.scaling"], [f"{prefix}.delta"], name=f"{prefix}.Mul"),
    ]
    if cast:
        nodes.append(helper.make_node("Cast", [f"{prefix}.delta"], [f"{prefix}.delta_cast"], name=f"{prefix}.Cast_back",
                                      to=layer.dtype))
    nodes.append(helper.make_node("Add", [base.output[0], nodes[-1].output[0]], [layer.output], name=f"{prefix}.Add"))
    for offset, node in enumerate(nodes, start=1):
        graph.node.insert(index + offset, node)


def weight_is_out_by_in(graph: onnx.GraphProto, layer: AdaptedLayer) -> bool:
    """Whether the base weight of ``layer`` (wired in ``graph`` by :func:`wire_adapter`, the
    graph maybe rewritten since) is stored [out, in] (a Gemm's with transB, or read through a
    Transpose) rather than [in, out].

    Raises:
        LoraError: ``graph`` does not hold the adapter's base node.
    """
    base = _producers(graph).get(f"{_prefix(layer)}.base_output")
    if base is None or len(base.input) < 2:
        raise LoraError(f"the model has no base layer of LoRA adapter {layer.A!r} (no {_prefix(layer)}.base_output)")
    if base.op_type == "Gemm":
        return bool(_attribute(base, "transB", 0))
    return base.input[1] != layer.weight


def add_adapters(model: onnx.ModelProto, targets: Union[str, Sequence[str]], rank: int, alpha: float,
                 dropout: float = 0.0, seed: int = 0) -> onnx.ModelProto:
    """A copy of ``model`` with a LoRA adapter beside each MatMul, Gemm or ``com.microsoft``
    MatMulNBits node whose node name or weight initializer name matches an fnmatch glob of
    ``targets``: ``y = base(x) + (dropout(x) @ A^T @ B^T) * (alpha / rank)``.

    A (``[rank, in]``) is drawn as peft's ``kaiming_uniform_(a=sqrt(5))``, U(-1/sqrt(in),
    1/sqrt(in)), from ``numpy.random.default_rng(seed)`` layer by layer in graph order; B
    (``[out, rank]``) is zeros, so the model computes what it did. The adapters are named
    after the base weight as peft names them (``fc1.weight`` -> ``fc1.lora_A.weight``,
    ``fc1.lora_B.weight``; another name ``W`` -> ``W.lora_A``, ``W.lora_B``; a weight shared
    by several adapted nodes: after each node). The ``normgrad.lora`` metadata lists them:
    a training graph built from the result trains the adapters only.

    Raises:
        LoraError: no MatMul/Gemm/MatMulNBits in the model, a glob that matches nothing, a
            target whose weight is not an initializer, rank <= 0, alpha <= 0, dropout outside
            [0, 1), or a model that already has adapters.
    """
    targets = _check_options(targets, rank, alpha, dropout)
    keys = {p.key for p in model.metadata_props}
    if METADATA_LORA in keys or "normgrad.peft" in keys:
        raise LoraError("the model already has LoRA adapters: add adapters to the base model")
    _ensure_opset(model, 12 if dropout > 0 else 1)
    adapted = onnx.ModelProto()
    adapted.CopyFrom(model)
    graph = adapted.graph
    layers = _layers(graph, _targets(graph, targets), int(rank), float(alpha) / int(rank))
    generator = np.random.default_rng(seed)
    for layer in layers:
        bound = 1.0 / math.sqrt(layer.in_features)
        down = generator.uniform(-bound, bound, (int(rank), layer.in_features)).astype(np.float32)
        graph.initializer.append(numpy_helper.from_array(down, layer.A))
        graph.initializer.append(numpy_helper.from_array(np.zeros((layer.out_features, int(rank)), np.float32), layer.B))
        wire_adapter(graph, layer, float(dropout))
    info = {"rank": int(rank), "alpha": float(alpha), "dropout": float(dropout), "seed": int(seed),
            "layers": [layer._asdict() for layer in layers]}
    helper.set_model_props(adapted, {**{p.key: p.value for p in model.metadata_props}, METADATA_LORA: json.dumps(info)})
    return adapted


def _ensure_opset(model: onnx.ModelProto, minimum: int) -> None:
    """LoraError when the model's default-domain opset is below ``minimum`` (Dropout with a
    training_mode input needs 12)."""
    for entry in model.opset_import:
        if entry.domain in _DEFAULT_DOMAINS and entry.version < minimum:
            raise LoraError(f"LoRA dropout needs default-domain opset >= {minimum}; the model has {entry.version}: "
                            "convert it (onnx.version_converter) or give no dropout")
