"""What a forward model exported from torch says about itself, and the exports that would give
wrong gradients.

torch's exporters leave traces: the dynamo exporter writes node metadata naming the torch op
each node came from (``pkg.torch.onnx.fx_node``, with the parameters it read as ``%p_NAME``)
and the rewrite rule that changed it (``pkg.onnxscript.rewriter.rule_name``); the TorchScript
exporter names constants it folds ``onnx::OP_N``. :func:`normgrad.torch.export` adds
``normgrad.torch_parameters`` and, for nn.Embedding weights with gradient-only semantics,
``normgrad.embeddings`` (:func:`embedding_gradients`). From these, :func:`check_forward_model` refuses what it can see
would train wrongly (BatchNorm folded into a convolution, training-mode BatchNorm written in
inference mode, parameters folded or merged into other initializers) and warns about folded
constants trained under their own names.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Dict, Iterable, List, Optional, Tuple

import onnx

from normgrad.graphs.context import FLOAT_ELEM_TYPES

__all__ = [
    "METADATA_TORCH_PARAMETERS",
    "METADATA_PEFT",
    "METADATA_EMBEDDINGS",
    "OPTIMIZER_PRODUCER",
    "EmbeddingGradient",
    "MisexportedModelError",
    "TorchExportWarning",
    "torch_parameters",
    "embedding_gradients",
    "referenced_parameters",
    "check_forward_model",
    "torchscript_folded_constants",
    "exported_constants",
    "folded_constants_warning",
    "torchscript_eval_mode",
    "torchscript_merged_initializers",
    "merged_initializers_warning",
]

METADATA_TORCH_PARAMETERS = "normgrad.torch_parameters"
"""Model metadata key: JSON {initializer name: torch parameter name}, written by
:func:`normgrad.torch.export`; only these initializers are trained."""

METADATA_PEFT = "normgrad.peft"
"""Model metadata key, written by :func:`normgrad.torch.export` for a module holding a peft
LoRA model and carried into training and step graphs: JSON ``{"adapter_name", "adapter_config"
(the adapter_config.json peft writes, as text), "layers": [{"A", "B", "base" (initializer
names), "A_key", "B_key" (the names in peft's adapter_model.safetensors), "scaling",
"fan_in_fan_out"}], "unsupported" (why the adapter cannot be saved, or null)}`` (see
:mod:`normgrad.lora`)."""

METADATA_EMBEDDINGS = "normgrad.embeddings"
"""Model metadata key, written by :func:`normgrad.torch.export`: JSON ``{initializer name:
{"padding_idx": a row or null, "scale_grad_by_freq": bool}}`` for each trained weight of
nn.Embedding modules that set either: torch's gradient semantics that live in the module,
not in the graph (see :class:`EmbeddingGradient`)."""

OPTIMIZER_PRODUCER = "onnxruntime.transformers"
"""The producer name onnxruntime's transformer optimizer (``optimize_model``) gives the models it writes."""

FIX = ("export with normgrad.torch.export(module, inputs, path) (pip install \"normgrad[torch]\"), which keeps "
       "training-mode BatchNorm and every parameter as its own initializer")

_FX_NODE = "pkg.torch.onnx.fx_node"
_NAMESPACE = "pkg.torch.onnx.name_scopes"
_REWRITE_RULE = "pkg.onnxscript.rewriter.rule_name"
_PARAMETER_TOKEN = re.compile(r"%p_([A-Za-z0-9_]+)")
_TORCHSCRIPT_FOLDED = re.compile(r"^onnx::[A-Za-z]+_\d+$")
_CONSTANT_OUTPUT = re.compile(r"(^|/)Constant(OfShape)?(_\d+)?_output_0$")


class MisexportedModelError(ValueError):
    """The forward model was exported in a way that makes its gradients differ from torch's."""


class TorchExportWarning(UserWarning):
    """The forward model trains, but not quite as the torch module would (see the message)."""


def _metadata_json(model: onnx.ModelProto, key: str) -> Tuple[Optional[str], Any]:
    """The text of metadata ``key`` of ``model`` (None if absent) and its JSON value (None
    if it is no JSON)."""
    text = next((p.value for p in model.metadata_props if p.key == key), None)
    try:
        return text, None if text is None else json.loads(text)
    except ValueError:
        return text, None


def torch_parameters(model: onnx.ModelProto) -> Optional[Dict[str, str]]:
    """``normgrad.torch_parameters`` of ``model`` ({initializer: torch name}), None if absent.

    Raises:
        MisexportedModelError: the metadata is not such a dict, or names a value that is not a
            float initializer of the graph.
    """
    text, mapping = _metadata_json(model, METADATA_TORCH_PARAMETERS)
    if text is None:
        return None
    if not isinstance(mapping, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
        raise MisexportedModelError(f"metadata {METADATA_TORCH_PARAMETERS} must be a JSON object of strings; got {text[:80]!r}")
    initializers = {t.name for t in model.graph.initializer}
    unknown = sorted(set(mapping) - initializers)
    if unknown:
        why = (": onnxruntime's transformer optimizer folded them into other tensors (transposed, the rows read), "
               "which are no torch parameters; fine-tune the export and optimize the trained model"
               if model.producer_name == OPTIMIZER_PRODUCER else "")
        raise MisexportedModelError(
            f"metadata {METADATA_TORCH_PARAMETERS} names {', '.join(unknown[:5])}, which "
            f"{'are not initializers' if len(unknown) > 1 else 'is not an initializer'} of the graph{why}"
        )
    return mapping


@dataclasses.dataclass(frozen=True)
class EmbeddingGradient:
    """How torch's nn.Embedding differentiates its lookup of a weight (the Gather gradient
    rule applies it to every Gather along axis 0 of that weight; its other readers, e.g. a
    tied output projection's MatMul, keep their own gradients).

    Attributes:
        padding_idx: the row that gets no gradient from the lookup, or None.
        scale_grad_by_freq: each row's lookup gradient is divided by the number of times the
            lookup's indices name that row.
    """

    padding_idx: Optional[int]
    scale_grad_by_freq: bool


def embedding_gradients(model: onnx.ModelProto) -> Dict[str, EmbeddingGradient]:
    """``normgrad.embeddings`` of ``model``: {initializer name: its EmbeddingGradient}, empty
    if absent.

    Raises:
        MisexportedModelError: the metadata is malformed, names no 2-D initializer of the
            graph, or a padding_idx outside the weight's rows.
    """
    text, entries = _metadata_json(model, METADATA_EMBEDDINGS)
    if text is None:
        return {}
    if not isinstance(entries, dict):
        raise _malformed_embeddings(text)
    rows = {t.name: t.dims[0] for t in model.graph.initializer if len(t.dims) == 2}
    result: Dict[str, EmbeddingGradient] = {}
    for name, entry in entries.items():
        if name not in rows:
            raise MisexportedModelError(f"metadata {METADATA_EMBEDDINGS} names {name!r}, which is no 2-D initializer of the graph")
        if not isinstance(entry, dict) or set(entry) != {"padding_idx", "scale_grad_by_freq"} \
                or not isinstance(entry["scale_grad_by_freq"], bool):
            raise _malformed_embeddings(text)
        padding = entry["padding_idx"]
        if padding is not None and (type(padding) is not int or not 0 <= padding < rows[name]):
            raise MisexportedModelError(f"metadata {METADATA_EMBEDDINGS} gives {name!r} padding_idx {padding!r}, "
                                        f"not one of its {rows[name]} rows")
        result[name] = EmbeddingGradient(padding, entry["scale_grad_by_freq"])
    return result


def _malformed_embeddings(text: str) -> MisexportedModelError:
    return MisexportedModelError(
        f"metadata {METADATA_EMBEDDINGS} must be a JSON object {{initializer: {{\"padding_idx\": a row or null, "
        f"\"scale_grad_by_freq\": true or false}}}}; got {text[:120]!r}")


def _mangled(name: str) -> str:
    """The name torch.export gives a parameter's placeholder, without its ``p_`` (lower case)."""
    return re.sub(r"[^a-z0-9_]", "_", name.lower())


def _parameter_tokens(model: onnx.ModelProto) -> Dict[str, onnx.NodeProto]:
    """Mangled names of the torch parameters the dynamo exporter's node metadata says were
    read, each with the first node that says so."""
    tokens: Dict[str, onnx.NodeProto] = {}
    for node in model.graph.node:
        for prop in node.metadata_props:
            if prop.key == _FX_NODE:
                for token in _PARAMETER_TOKEN.findall(prop.value):
                    tokens.setdefault(token.lower(), node)
    return tokens


def referenced_parameters(model: onnx.ModelProto, parameters: Iterable[str]) -> List[str]:
    """Which of ``parameters`` (torch names) the dynamo exporter's node metadata says the
    graph reads."""
    tokens = _parameter_tokens(model)
    return [name for name in parameters if _mangled(name) in tokens]


def _metadata(node: onnx.NodeProto, key: str) -> str:
    return next((p.value for p in node.metadata_props if p.key == key), "")


def _attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def _node_name(node: onnx.NodeProto) -> str:
    return f"{node.op_type} '{node.name or node.output[0]}'"


def check_forward_model(model: onnx.ModelProto) -> None:
    """Refuses a forward model whose training graph could not give torch's gradients, where
    the model shows it.

    Raises:
        MisexportedModelError: (dynamo exporter, seen from its node metadata) BatchNorm folded
            into a Conv/Gemm by its optimizer (``optimize=True``, the default); a torch
            training-mode batch_norm written as BatchNormalization in inference mode (which the
            dynamo exporter always does); torch parameters that are not initializers of their
            own (folded into computed constants, or merged with an equal one).
    """
    problems: List[str] = []
    folded = [n for n in model.graph.node if _metadata(n, _REWRITE_RULE).startswith("FuseBatchNorm")]
    if folded:
        problems.append(
            f"the dynamo exporter's optimizer folded BatchNorm into {len(folded)} node(s) (first {_node_name(folded[0])}; "
            "torch.onnx.export(dynamo=True) optimizes by default): the BatchNorm's scale and bias are no parameters "
            "of their own and, in training mode, the batch statistics are gone"
        )
    inference = [
        n for n in model.graph.node
        if n.op_type == "BatchNormalization" and not _attribute(n, "training_mode", 0)
        and "_native_batch_norm_legit_functional" in _metadata(n, _FX_NODE) + _metadata(n, _NAMESPACE)
    ]
    if inference:
        problems.append(
            f"{len(inference)} BatchNormalization node(s) (first {_node_name(inference[0])}) ran in training mode in torch "
            "but are written with training_mode=0 (the dynamo exporter always writes inference mode), so their "
            "gradients would use the running statistics"
        )
    initializers = {_mangled(t.name) for t in model.graph.initializer}
    lost = {token: node for token, node in _parameter_tokens(model).items() if token not in initializers}
    if lost:
        token, node = next(iter(lost.items()))
        problems.append(
            f"{len(lost)} torch parameter(s) (first p_{token}, read by {_node_name(node)}) are not initializers of their own: "
            "the dynamo exporter's optimizer folded them into computed constants or merged equal ones, so their "
            "gradients would be wrong"
        )
    if problems:
        raise MisexportedModelError("; ".join(problems) + f". Fix: {FIX}, or torch.onnx.export(..., dynamo=False, "
                                    "training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False)")


def torchscript_folded_constants(model: onnx.ModelProto) -> List[str]:
    """Float initializers named as torch's TorchScript exporter names constants it folded
    (``onnx::Mul_41``: a parameter reshaped, transposed, ... by ``do_constant_folding=True``),
    in a model torch wrote without :func:`normgrad.torch.export`'s metadata."""
    if model.producer_name != "pytorch" or torch_parameters(model) is not None:
        return []
    return [t.name for t in model.graph.initializer if _TORCHSCRIPT_FOLDED.match(t.name) and t.data_type in FLOAT_ELEM_TYPES]


def exported_constants(model: onnx.ModelProto) -> List[str]:
    """Float initializers named as torch's TorchScript exporter names a Constant node's output
    (``/h.0/attn/Constant_11_output_0``), in a model without :func:`normgrad.torch.export`'s
    metadata (that list decides there).

    onnxruntime's transformer optimizer (and any model onnxruntime's graph optimizer saves)
    stores the exported graph's Constant nodes as initializers under those names: the attention
    scale, the mask's fill values, Gelu's coefficients. The unfused model never trains them; a
    real parameter keeps its torch name, and a value the optimizer folds from parameters or
    merges (``/Exp_output_0``, ``Attention_0_qkv_weight``) is named after its node.
    """
    if torch_parameters(model) is not None:
        return []
    return [t.name for t in model.graph.initializer if _CONSTANT_OUTPUT.search(t.name) and t.data_type in FLOAT_ELEM_TYPES]


def torchscript_eval_mode(model: onnx.ModelProto, folded: List[str]) -> bool:
    """Whether a TorchScript export without normgrad's metadata looks exported in eval mode
    (``torch.onnx.export``'s default ``training=TrainingMode.EVAL``): no training-mode
    BatchNormalization, no Dropout, and a folded constant feeding a Conv or Gemm (a
    BatchNorm folded into the layer before it)."""
    if not any(re.match(r"^onnx::(Conv|ConvTranspose|Gemm|MatMul)_\d+$", name) for name in folded):
        return False
    return not any(
        n.op_type == "Dropout" or (n.op_type == "BatchNormalization" and _attribute(n, "training_mode", 0))
        for n in model.graph.node
    )


def folded_constants_warning(names: List[str], eval_mode: bool = False) -> str:
    """The warning for trainable :func:`torchscript_folded_constants`; ``eval_mode``: the
    model looks exported in eval mode (:func:`torchscript_eval_mode`)."""
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    if eval_mode:
        return (
            "the model looks exported in eval mode (torch.onnx.export's default training=TrainingMode.EVAL): "
            "BatchNorm folded into the layer before it, Dropout removed, so it would train as a different network "
            f"than in torch's train(); {len(names)} trainable initializer(s) ({shown}) are those folded weights, "
            f"not torch parameters. Fix: {FIX}, or torch.onnx.export(model.train(), ..., dynamo=False, "
            "training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False)"
        )
    return (
        f"{len(names)} trainable initializer(s) ({shown}) look like constants torch's TorchScript exporter folded "
        "from parameters (do_constant_folding=True): they are trained under those names, not as the torch "
        f"parameters they came from; {FIX}, or torch.onnx.export(..., do_constant_folding=False)"
    )


def torchscript_merged_initializers(model: onnx.ModelProto) -> Dict[str, List[str]]:
    """{float initializer: the names torch gave the values merged into it}: torch's
    TorchScript exporter keeps one initializer for tensors it deduplicates (one shared
    parameter, or, exporting an eval-mode model, equal values) and writes
    ``Identity(kept) -> other name`` for the rest."""
    if model.producer_name != "pytorch" or torch_parameters(model) is not None:
        return {}
    floats = {t.name for t in model.graph.initializer if t.data_type in FLOAT_ELEM_TYPES}
    merged: Dict[str, List[str]] = {}
    for node in model.graph.node:
        if node.op_type == "Identity" and node.input and node.input[0] in floats and not _TORCHSCRIPT_FOLDED.match(node.output[0]):
            merged.setdefault(node.input[0], []).append(node.output[0])
    return merged


def merged_initializers_warning(merged: Dict[str, List[str]]) -> str:
    """The warning for trainable :func:`torchscript_merged_initializers`."""
    shown = "; ".join(f"{kept} also stands for {', '.join(names)}" for kept, names in list(merged.items())[:3])
    return (
        f"{len(merged)} trainable initializer(s) stand for several torch tensors ({shown}"
        f"{'; ...' if len(merged) > 3 else ''}): torch's TorchScript exporter merged them, and each gets the sum of "
        "their gradients. Right for one parameter shared in torch; wrong for distinct parameters merged because "
        "their values were equal, which torch does exporting an eval-mode model: "
        f"{FIX}, or export with the top module in training mode"
    )
