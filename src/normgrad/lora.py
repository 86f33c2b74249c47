"""LoRA adapters trained by normgrad, out as what peft loads and as a merged inference model.

A module holding a ``peft`` LoRA model, exported with :func:`normgrad.torch.export`, carries
``normgrad.peft`` metadata (:data:`normgrad.graphs.torch_exports.METADATA_PEFT`) into its
training and step graphs: for each adapted layer the initializers of its ``lora_A``,
``lora_B`` and base weight, its scaling, and the names peft gives the adapters in
``adapter_model.safetensors``. From a step graph and its trained state:

* :func:`save_adapter` writes ``adapter_model.safetensors`` + ``adapter_config.json``, which
  ``peft.PeftModel.from_pretrained(base_model, directory)`` loads (neither torch nor peft
  is needed to write them);
* :func:`merged_model` is the inference model with every adapter folded into its base
  weight (W + scaling * B @ A, transposed for ``fan_in_fan_out`` layers, as peft's
  ``merge_and_unload``) and no adapter nodes left.

Adapters added to any ONNX model by :func:`add_adapters` (``normgrad export --lora-*``) are
listed in the ``normgrad.lora`` metadata instead; from a step graph holding them and its
trained state:

* :func:`save_onnx_adapter` writes them in onnxruntime's adapter format
  (``onnxruntime.AdapterFormat``);
* :func:`adapter_model` is the original model with each adapter's A and B as graph inputs
  (zeros by default), which onnxruntime runs with ``onnxruntime.LoraAdapter`` +
  ``RunOptions.add_active_adapter``, and unchanged with no adapter active;
  :func:`save_adapter_model` writes it with the base's external data streamed (any size);
* :func:`check_onnx_adapter` refuses an adapter file made for another model in one line;
* :func:`save_genai_peft_adapter` writes them as peft's pair for the transformers model an
  onnxruntime-genai build came from, where its layers map to that model's;
* :func:`merged_model` folds them into a float base as for a peft export (a MatMulNBits base
  is refused).
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np
import onnx
from onnx import helper, numpy_helper

from normgrad.util.files import PathLike, StagedFile, commit_files, replace_folder_files, staging
from normgrad.util.external_data import (ExternalDataError, check_model, external_data_extent, stage_models_external,
                                         uses_external_data)
from normgrad.errors import LoraError, one_line
from normgrad.graphs.adapters import METADATA_LORA, add_adapters, lora_layers, weight_is_out_by_in, wire_adapter
from normgrad.graphs.torch_exports import METADATA_PEFT

__all__ = ["LoraError", "adapters", "save_adapter", "merged_model", "merged_model_streamed", "merge_adapters",
           "ADAPTER_WEIGHTS", "ADAPTER_CONFIG", "add_adapters", "save_onnx_adapter", "adapter_model",
           "save_adapter_model", "stage_adapter_model",
           "check_onnx_adapter", "save_genai_peft_adapter", "onnx_adapter_bytes", "genai_peft_files"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def adapters(model: onnx.ModelProto) -> Dict[str, object]:
    """The ``normgrad.peft`` metadata of a forward, training or step graph.

    Raises:
        LoraError: the model has none (it was not exported by :func:`normgrad.torch.export`
            from a module holding a peft LoRA model).
    """
    metadata = {entry.key: entry.value for entry in model.metadata_props}
    if METADATA_PEFT not in metadata:
        raise LoraError("the model has no LoRA adapters (no normgrad.peft metadata): export a module holding a "
                        "peft LoRA model with normgrad.torch.export, then build the step graph from that export")
    return json.loads(metadata[METADATA_PEFT])


def _usable(model: onnx.ModelProto) -> Dict[str, object]:
    info = adapters(model)
    if info.get("unsupported"):
        raise LoraError(f"the adapters cannot be saved or merged: {info['unsupported']}")
    return info


def save_adapter(directory: PathLike, step_model: onnx.ModelProto, tensors: Mapping[str, np.ndarray]) -> List[str]:
    """Writes the trained adapters in ``tensors`` (a trainer's :meth:`~normgrad.Trainer.state_dict`)
    to ``directory`` (created if needed) as peft's ``adapter_model.safetensors`` and
    ``adapter_config.json``, as one set for any reader (:func:`normgrad.util.files.replace_folder_files`;
    where it cannot, :func:`normgrad.util.files.commit_files`, completed by normgrad's next read):
    a kill leaves the old pair or the new one, never run B's weights beside run A's config;
    returns the two paths.

    Raises:
        LoraError: ``step_model`` has no adapters, or ``tensors`` lacks one.
        OSError: a file cannot be written.
    """
    info = _usable(step_model)
    weights = {}
    for layer in info["layers"]:
        for part in ("A", "B"):
            if layer[part] not in tensors:
                raise LoraError(f"no trained value for adapter {layer[part]!r}")
            weights[layer[f"{part}_key"]] = np.ascontiguousarray(tensors[layer[part]])
    return _write_peft_pair(directory, weights, info["adapter_config"])


def _peft_pair(weights: Mapping[str, np.ndarray], adapter_config: str) -> Dict[str, bytes]:
    """{file name: bytes} of peft's ``adapter_model.safetensors`` (``weights``) and ``adapter_config.json``."""
    from safetensors.numpy import save as safetensors_bytes

    return {ADAPTER_WEIGHTS: safetensors_bytes(dict(weights), metadata={"format": "pt"}),
            ADAPTER_CONFIG: adapter_config.encode()}


def _write_peft_pair(directory: PathLike, weights: Mapping[str, np.ndarray], adapter_config: str) -> List[str]:
    """Writes ``adapter_model.safetensors`` (``weights``) and ``adapter_config.json`` to
    ``directory`` as one set (see :func:`save_adapter`); returns the two paths."""
    paths = [os.path.join(directory, ADAPTER_WEIGHTS), os.path.join(directory, ADAPTER_CONFIG)]
    contents = _peft_pair(weights, adapter_config)
    if not replace_folder_files(directory, contents):  # a folder with subfolders, or no atomic exchange here
        os.makedirs(directory, exist_ok=True)
        with staging() as staged:
            staged.extend(StagedFile(path, [contents[os.path.basename(path)]]) for path in paths)
        commit_files(staged)
    return paths


def merged_model(step_model: onnx.ModelProto, tensors: Mapping[str, np.ndarray],
                 base_dir: Optional[PathLike] = None) -> onnx.ModelProto:
    """The step graph's inference model (:func:`normgrad.graphs.build_inference_model`) with
    the trained adapters in ``tensors`` folded into their base weights (:func:`merge_adapters`):
    a peft export's, or those of :func:`add_adapters` (W + scaling * B A in the layer's weight
    layout: [in, out] for a MatMul's, [out, in] read through a Transpose or by a Gemm with
    transB; refused with a LoraError for a MatMulNBits's quantized weight, or a weight two
    adapters share).
    ``base_dir``: the folder of the step graph's external data (a frozen base), default the
    current folder; the base weights the adapters change are read from it and become inline
    tensors, the others stay external (write the model with
    :func:`normgrad.util.external_data.save_models_external`, as :meth:`normgrad.Trainer.export_merged_model`
    does)."""
    from normgrad.graphs.step_graph import build_inference_model

    inference = build_inference_model(step_model, tensors)
    return merge_adapters(inference, _merge_info(step_model, inference), base_dir)


def merged_model_streamed(step_model: onnx.ModelProto, tensors: Mapping[str, np.ndarray],
                          base_dir: Optional[PathLike] = None) -> "tuple[onnx.ModelProto, Dict[str, Callable]]":
    """:func:`merged_model` with the merged weights whose base is in external data left to
    compute while the model is written: ``(model, {name: function returning the merged
    weight's bytes})``, the model still referencing the base weight there; write it with
    :func:`normgrad.util.external_data.save_models_external` ``(..., contents=...)``, which
    computes them one at a time (the merged weights are never all in memory)."""
    from normgrad.graphs.step_graph import build_inference_model

    inference = build_inference_model(step_model, tensors)
    model, merged_weights = _merge(inference, _merge_info(step_model, inference), base_dir)
    external = {t.name for t in model.graph.initializer if t.name in merged_weights
                and t.data_location == onnx.TensorProto.EXTERNAL}
    _inline(model, {name: merged for name, merged in merged_weights.items() if name not in external})
    return model, {name: _bytes_of(merged_weights[name]) for name in external}


def _merge_info(step_model: onnx.ModelProto, inference: onnx.ModelProto) -> Dict[str, object]:
    """The layers to merge, as :func:`merge_adapters` takes them: a peft export's, or those of
    :func:`add_adapters` (``fan_in_fan_out`` where the base weight is stored [in, out]).

    Raises:
        LoraError: no adapters, a base that is no float matrix (a MatMulNBits's 4-bit weight),
            or a base weight two adapters share.
    """
    if METADATA_LORA not in {p.key for p in step_model.metadata_props}:
        return _usable(step_model)
    layers = []
    for layer in _onnx_adapters(step_model)["layers"]:
        if layer.op_type == "MatMulNBits":
            raise LoraError(f"cannot merge LoRA adapter {layer.A!r} into MatMulNBits node {layer.node!r}: its base "
                            "weight is quantized (merge into a float build of the model, e.g. the genai builder's "
                            "-p fp32, or deploy the adapter file with adapter_model)")
        if any(other["base"] == layer.weight for other in layers):
            raise LoraError(f"cannot merge: base weight {layer.weight!r} is shared by several adapted layers, "
                            "each with its own adapter")
        layers.append({"A": layer.A, "B": layer.B, "base": layer.weight, "scaling": layer.scaling,
                       "fan_in_fan_out": not weight_is_out_by_in(inference.graph, layer)})
    return {"layers": layers}


def _inline(model: onnx.ModelProto, merged_weights: Mapping[str, Callable[[], np.ndarray]]) -> None:
    for tensor in model.graph.initializer:
        if tensor.name in merged_weights:
            tensor.CopyFrom(numpy_helper.from_array(merged_weights[tensor.name](), tensor.name))


def _bytes_of(array: Callable[[], np.ndarray]) -> Callable[[], memoryview]:
    return lambda: memoryview(np.ascontiguousarray(array()).reshape(-1).view(np.uint8))


def _values_from(nodes: List[onnx.NodeProto], source: str) -> set:
    """Every value computed (transitively) from ``source``."""
    reached = {source}
    for node in nodes:
        if any(name in reached for name in node.input):
            reached.update(node.output)
    return reached


def merge_adapters(model: onnx.ModelProto, info: Mapping[str, object],
                   base_dir: Optional[PathLike] = None) -> onnx.ModelProto:
    """``model`` (an inference model reading the adapters as initializers) with each layer's
    base weight replaced by W + scaling * B @ A (computed in float32, then cast to W's
    dtype, as peft merges) and the adapter branch removed: the Add that joins the base
    output and the adapter's becomes the base output.

    ``base_dir``: the folder of the model's external data (default: the current folder).

    Raises:
        LoraError: an adapter or base weight that is not an initializer, or an adapter whose
            branch does not end in an Add with the base layer's output.
    """
    merged, merged_weights = _merge(model, info, base_dir)
    _inline(merged, merged_weights)
    return merged


def _merge(model: onnx.ModelProto, info: Mapping[str, object],
           base_dir: Optional[PathLike] = None) -> "tuple[onnx.ModelProto, Dict[str, Callable]]":
    """:func:`merge_adapters` but for the merged weights, whose base weights the model still
    holds (inline or external): ``(model, {base weight name: function computing the merged
    weight})``."""
    merged = onnx.ModelProto()
    merged.CopyFrom(model)
    graph = merged.graph
    initializers = {t.name: t for t in graph.initializer}
    nodes = list(graph.node)
    for layer in info["layers"]:
        for part in ("A", "B", "base"):
            if layer[part] not in initializers:
                raise LoraError(f"{part} weight {layer[part]!r} of a LoRA layer is not an initializer of the model")
        rows, cols = (initializers[layer[part]].dims[i] for part, i in (("B", 0), ("A", 1)))
        shape = [cols, rows] if layer["fan_in_fan_out"] else [rows, cols]
        if list(initializers[layer["base"]].dims) != shape:
            raise LoraError(f"B @ A of {layer['B']!r} has shape {shape}, base weight {layer['base']!r} "
                            f"{list(initializers[layer['base']].dims)}")
        branch = _values_from(nodes, layer["B"])
        for i, node in enumerate(nodes):
            joined = [name in branch for name in node.input]
            if node.op_type == "Add" and node.domain in ("", "ai.onnx") and len(joined) == 2 and sum(joined) == 1:
                nodes[i] = helper.make_node("Identity", [node.input[joined.index(False)]], list(node.output),
                                            name=node.name)
                break
        else:
            raise LoraError(f"no Add joins the adapter branch of {layer['B']!r} with its base layer's output")
    from normgrad.graphs.step_graph import live_nodes, read_values

    del graph.node[:]
    graph.node.extend(live_nodes(nodes, [o.name for o in graph.output]))
    read = read_values(graph.node)
    for layer in info["layers"]:
        if layer["A"] in read or layer["B"] in read:
            raise LoraError(f"the adapter {layer['A']!r} is still read after merging")
    kept = [t for t in graph.initializer if t.name in read or t.name in {o.name for o in graph.output}]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    # checked while the base weights are still as they came (of the same types and shapes as
    # the merged ones; in external data, not read), then merged one at a time: a large base
    # is not copied for the check
    check_model(merged)
    bases = {t.name: t for t in graph.initializer}
    folder = os.fspath(base_dir or os.getcwd())
    merged_weights = {}
    for layer in info["layers"]:
        base = bases[layer["base"]]
        adapter = (initializers[layer["A"]], initializers[layer["B"]])
        merged_weights[base.name] = _merged_weight(base, adapter, layer, folder)
    return merged, merged_weights


def _merged_weight(base: onnx.TensorProto, adapter, layer: Mapping[str, object], folder: str) -> Callable[[], np.ndarray]:
    """A function computing W + scaling * B @ A of one layer (reading W when called)."""
    if base.data_location == onnx.TensorProto.EXTERNAL:  # where W is, as the model says now
        base = onnx.TensorProto.FromString(base.SerializeToString())

    def merged() -> np.ndarray:
        down = numpy_helper.to_array(adapter[0]).astype(np.float32)
        up = numpy_helper.to_array(adapter[1]).astype(np.float32)
        delta = (up @ down) * np.float32(layer["scaling"])
        weight = numpy_helper.to_array(base, folder)
        delta = delta.T if layer["fan_in_fan_out"] else delta
        return (weight.astype(np.float32) + delta).astype(weight.dtype)

    return merged


def peft_metadata(module, initializers: Union[set, Mapping[str, object]]) -> Union[str, None]:
    """The ``normgrad.peft`` metadata (JSON text) for a torch module that holds one
    ``peft.PeftModel`` with an active LoRA adapter, None for any other module.
    ``initializers``: the exported model's initializer names."""
    import sys
    import tempfile

    if "peft" not in sys.modules:  # a module holding a peft model has imported it
        return None
    import peft
    from peft.tuners.lora import LoraLayer

    found = [(name, m) for name, m in module.named_modules() if isinstance(m, peft.PeftModel)]
    if not found:
        return None
    prefix, model = found[0]
    prefix = f"{prefix}." if prefix else ""
    adapter = model.active_adapter
    config = model.peft_config[adapter]
    unsupported = None
    if len(found) > 1:
        unsupported = f"the module holds {len(found)} peft models"
    elif config.peft_type != peft.PeftType.LORA:
        unsupported = f"peft type {config.peft_type} is not LoRA"
    layers = []
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer) or adapter not in layer.lora_A:
            if isinstance(layer, LoraLayer) and adapter in getattr(layer, "lora_embedding_A", {}):
                unsupported = unsupported or f"{name} adapts an embedding (only Linear/Conv1D adapters are supported)"
            continue
        if layer.use_dora.get(adapter, False):
            unsupported = unsupported or f"{name} uses DoRA (only plain LoRA is supported)"
        full = f"{prefix}{name}"
        entry = {"A": f"{full}.lora_A.{adapter}.weight", "B": f"{full}.lora_B.{adapter}.weight",
                 "base": f"{full}.base_layer.weight", "A_key": f"{name}.lora_A.weight", "B_key": f"{name}.lora_B.weight",
                 "scaling": float(layer.scaling[adapter]), "fan_in_fan_out": bool(getattr(layer, "fan_in_fan_out", False))}
        for part in ("A", "B"):
            if entry[part] not in initializers:
                unsupported = unsupported or f"adapter {entry[part]!r} is not an initializer of the exported model"
        layers.append(entry)
    with tempfile.TemporaryDirectory() as folder:
        # peft writes its own adapter_config.json (and the names its safetensors file uses,
        # which must be the ones computed above)
        model.save_pretrained(folder, selected_adapters=[adapter])
        written = folder if adapter == "default" else os.path.join(folder, adapter)
        with open(os.path.join(written, ADAPTER_CONFIG)) as file:
            adapter_config = _canonical_adapter_config(file.read())
        from safetensors import safe_open

        with safe_open(os.path.join(written, ADAPTER_WEIGHTS), "np") as file:
            keys = set(file.keys())
    ours = {layer[f"{part}_key"] for layer in layers for part in ("A", "B")}
    if keys != ours:
        other = sorted(keys ^ ours)
        unsupported = unsupported or f"peft saves tensors other than the LoRA A/B weights: {other[:3]}"
    return json.dumps({"adapter_name": adapter, "adapter_config": adapter_config, "layers": layers,
                       "unsupported": unsupported})


_SET_VALUED = ("target_modules", "exclude_modules", "modules_to_save")
"""adapter_config.json entries that peft keeps as Python sets and writes in the set's order,
which changes with the process's string hash seed; peft matches them as sets."""


def _canonical_adapter_config(text: str) -> str:
    """peft's adapter_config.json with its set-valued lists sorted, written as peft writes it
    (indented, keys sorted): the same model gives the same bytes in every process."""
    config = json.loads(text)
    for key in _SET_VALUED:
        if isinstance(config.get(key), list) and all(isinstance(item, str) for item in config[key]):
            config[key] = sorted(config[key])
    return json.dumps(config, indent=2, sort_keys=True)


def _onnx_adapters(step_model: onnx.ModelProto) -> Dict[str, object]:
    info = lora_layers(step_model)
    if info is None:
        raise LoraError("the model has no LoRA adapters of normgrad.lora.add_adapters (no normgrad.lora metadata): "
                        "export the base model with --lora-rank/--lora-alpha/--lora-targets")
    return info


def _adapter_format():
    """``onnxruntime.AdapterFormat`` (onnxruntime 1.20 and newer)."""
    import onnxruntime

    if not hasattr(onnxruntime, "AdapterFormat"):
        raise LoraError(f"onnxruntime {onnxruntime.__version__} has no adapter format (AdapterFormat, LoraAdapter): "
                        "adapter files need onnxruntime 1.20 or newer")
    return onnxruntime.AdapterFormat


def _adapter_shapes(info: Mapping[str, object]) -> Dict[str, List[int]]:
    """{adapter tensor: its shape} of ``normgrad.lora`` metadata."""
    rank = info["rank"]
    shapes = {}
    for layer in info["layers"]:
        shapes[layer.A], shapes[layer.B] = [rank, layer.in_features], [layer.out_features, rank]
    return shapes


def save_onnx_adapter(path: PathLike, step_model: onnx.ModelProto, tensors: Mapping[str, np.ndarray]) -> str:
    """Writes the trained adapters in ``tensors`` (a trainer's :meth:`~normgrad.Trainer.state_dict`)
    of a step graph built from :func:`add_adapters`'s model to ``path`` in onnxruntime's adapter
    format (``onnxruntime.AdapterFormat``, adapter and model version 1), atomically (a
    temporary file renamed); returns ``path``. The parameters are named as the inputs of
    :func:`adapter_model`.

    Raises:
        LoraError: ``step_model`` has no such adapters, ``tensors`` lacks one or gives it in
            another shape, or onnxruntime is older than 1.20 (no adapter format).
        OSError: the file cannot be written.
    """
    from normgrad.util.files import write_bytes_atomic

    write_bytes_atomic(path, onnx_adapter_bytes(step_model, tensors))
    return os.fspath(path)


def onnx_adapter_bytes(step_model: onnx.ModelProto, tensors: Mapping[str, np.ndarray]) -> bytes:
    """The contents of :func:`save_onnx_adapter`'s file (to write it in a set with others).

    Raises:
        LoraError: as :func:`save_onnx_adapter`.
    """
    import tempfile

    import onnxruntime

    adapter = _adapter_format()()
    parameters = {}
    for name, shape in _adapter_shapes(_onnx_adapters(step_model)).items():
        if name not in tensors:
            raise LoraError(f"no trained value for adapter {name!r}")
        value = np.ascontiguousarray(tensors[name], dtype=np.float32)
        if list(value.shape) != shape:
            raise LoraError(f"adapter {name!r} has shape {list(value.shape)}; the step graph's is {shape}")
        parameters[name] = onnxruntime.OrtValue.ortvalue_from_numpy(value)
    adapter.set_adapter_version(1)
    adapter.set_model_version(1)
    adapter.set_parameters(parameters)
    with tempfile.TemporaryDirectory() as folder:  # onnxruntime writes to a path only
        written = os.path.join(folder, "adapter.onnx_adapter")
        adapter.export_adapter(written)
        with open(written, "rb") as file:
            return file.read()


def adapter_model(step_model: onnx.ModelProto, base_model_path: PathLike,
                  load_external_data: bool = True) -> onnx.ModelProto:
    """The model at ``base_model_path`` (the one :func:`add_adapters` adapted; every node,
    initializer, input and output as it was) with each adapter of ``step_model`` wired in as
    in training (no dropout), its A and B graph inputs named as in :func:`save_onnx_adapter`'s
    file, each also an initializer of zeros: onnxruntime runs it as the base model with no
    adapter active, and with the trained adapters through ``onnxruntime.LoraAdapter`` +
    ``RunOptions.add_active_adapter``.

    ``load_external_data``: read the base's external data into the model (the default), or
    leave its external tensors referencing their files in the base's folder, checked, not
    read (a base of any size; :func:`save_adapter_model` writes such a model with its data).

    Raises:
        LoraError: ``step_model`` has no such adapters, or ``base_model_path`` is another
            model (a base layer or weight missing, or of another shape), not ONNX, with
            external data it does not hold, or one onnx's checker refuses.
    """
    info = _onnx_adapters(step_model)
    try:
        model = onnx.load(os.fspath(base_model_path), load_external_data=load_external_data)
    except Exception as error:  # protobuf's DecodeError, a missing external data file
        raise LoraError(f"{base_model_path} is not a readable ONNX model ({one_line(error)})") from None
    graph = model.graph
    folder = os.path.dirname(os.path.abspath(os.fspath(base_model_path)))
    try:
        for tensor in graph.initializer:
            if uses_external_data(tensor):
                external_data_extent(tensor, folder)
    except ExternalDataError as error:
        raise LoraError(f"{base_model_path}: {one_line(error)}") from None
    initializers = {t.name: t for t in graph.initializer}
    for layer in info["layers"]:
        weight = initializers.get(layer.weight)
        if weight is None or (layer.op_type != "MatMulNBits" and
                              sorted(weight.dims) != sorted([layer.in_features, layer.out_features])):
            raise LoraError(f"{base_model_path}: no weight {layer.weight!r} of shape [{layer.in_features}, "
                            f"{layer.out_features}] (either order), the base of LoRA adapter {layer.A!r}: the step "
                            "graph was made from another model")
        wire_adapter(graph, layer)
    for name, shape in _adapter_shapes(info).items():
        graph.input.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape))
        graph.initializer.append(numpy_helper.from_array(np.zeros(shape, np.float32), name))
    helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                   METADATA_LORA: next(p.value for p in step_model.metadata_props
                                                       if p.key == METADATA_LORA)})
    # structure only: the base is the user's as it was, and onnx's shape inference refuses
    # some that onnxruntime runs (genai's builder declares its 1-element Constants 0-d)
    try:
        check_model(model, full_check=False)
    except onnx.checker.ValidationError as error:
        raise LoraError(f"{base_model_path}: with the adapters wired in, not a valid ONNX model "
                        f"({one_line(error)})") from None
    return model


def stage_adapter_model(path: PathLike, step_model: onnx.ModelProto, base_model_path: PathLike) -> List[StagedFile]:
    """:func:`adapter_model` as files staged at ``path`` (nothing in place until
    :func:`normgrad.util.files.commit_files`): the base's external tensors are streamed
    from its data files into ``PATH.HASH.data`` beside ``path``, never all in memory, so a
    base past protobuf's 2 GiB is written too; a base without external data gives one file.

    Raises:
        LoraError: as :func:`adapter_model`.
    """
    model = adapter_model(step_model, base_model_path, load_external_data=False)
    return stage_models_external({os.fspath(path): model},
                                 base_dir=os.path.dirname(os.path.abspath(os.fspath(base_model_path))))


def save_adapter_model(path: PathLike, step_model: onnx.ModelProto, base_model_path: PathLike) -> None:
    """Writes :func:`adapter_model` to ``path`` with the base's external data, if any, in one
    ``PATH.HASH.data`` file beside it, model and data as one set (:func:`stage_adapter_model`).

    Raises:
        LoraError: as :func:`adapter_model`.
    """
    commit_files(stage_adapter_model(path, step_model, base_model_path))


def check_onnx_adapter(path: PathLike, model: onnx.ModelProto) -> None:
    """Checks that the adapter file at ``path`` (:func:`save_onnx_adapter`) fits ``model``
    (:func:`adapter_model`): each of its parameters an input of the model, of the same shape.

    Raises:
        LoraError: the file is not an adapter file, or it was made for another model.
    """
    adapter_format = _adapter_format()
    try:
        parameters = adapter_format.read_adapter(os.fspath(path)).get_parameters()
    except Exception as error:  # onnxruntime raises its own error types for a file it cannot read
        raise LoraError(f"{path} is not an onnxruntime adapter file ({one_line(error)})") from None
    inputs = {i.name: [d.dim_value if d.HasField("dim_value") else None for d in i.type.tensor_type.shape.dim]
              for i in model.graph.input}
    for name, value in sorted(parameters.items()):
        if inputs.get(name) != list(value.shape()):
            has = f"its input {name!r} is {inputs[name]}" if name in inputs else f"it has no input {name!r}"
            raise LoraError(f"{path} holds adapter {name!r} of shape {list(value.shape())}, but {has}: the adapter "
                            "file was made for another model")


GENAI_CONFIG = "genai_config.json"
"""The file onnxruntime-genai's model builder writes beside its model.onnx."""

_GENAI_LAYER = re.compile(r"/model/layers\.(\d+)/(attn|mlp)/(\w+)/MatMul(?:_Q4|_Q8)?|/lm_head/MatMul(?:_Q4|_Q8)?")
"""The genai builder's names of the nodes that take adapters: ``/model/layers.0/attn/q_proj/MatMul``
(``_Q4``/``_Q8`` where quantized), ``/lm_head/MatMul``."""

_HF_LAYOUT = {"llama": frozenset(), "mistral": frozenset(), "qwen2": frozenset(),
              "phi3": frozenset({"qkv_proj", "gate_up_proj"})}
"""The genai model types whose transformers modules are Llama's (``model.layers.N.self_attn.q_proj``,
``...mlp.gate_proj``, ``lm_head``), with the fused projections the transformers model has."""


def _genai_model_config(base_model_path: PathLike) -> Dict[str, object]:
    path = os.path.join(os.path.dirname(os.fspath(base_model_path)), GENAI_CONFIG)
    try:
        with open(path) as file:
            return json.load(file)["model"]
    except (OSError, ValueError, KeyError):
        raise LoraError(f"the base model is not an onnxruntime-genai build (no readable {path})") from None


def _genai_peft_parts(node: str, model: Mapping[str, object]) -> "List[tuple[str, slice]]":
    """[(transformers module, rows of the genai layer's output)] of an adapted genai layer: one
    module, or q/k/v_proj for the qkv_proj the builder fuses (each with the adapter's A and its
    rows of B, which computes what the fused adapter does).

    Raises:
        LoraError: the layer has no transformers module of its own (e.g. Phi-3's gate_proj, which
            the builder splits from gate_up_proj).
    """
    fused = _HF_LAYOUT.get(model["type"])
    if fused is None:
        raise LoraError(f"no peft names for onnxruntime-genai model type {model['type']!r} (known: "
                        f"{', '.join(sorted(_HF_LAYOUT))})")
    match = _GENAI_LAYER.fullmatch(node)
    if match is None:
        raise LoraError(f"the adapted layer {node!r} is not one the genai builder names after a transformers module")
    if match.group(1) is None:
        return [("lm_head", slice(None))]
    layer, block, projection = match.groups()
    prefix = f"model.layers.{layer}.{'self_attn' if block == 'attn' else 'mlp'}"
    if projection == "qkv_proj" and "qkv_proj" not in fused:
        q_size = model["decoder"]["num_attention_heads"] * model["decoder"]["head_size"]
        kv_size = model["decoder"]["num_key_value_heads"] * model["decoder"]["head_size"]
        ends = [0, q_size, q_size + kv_size, q_size + 2 * kv_size]
        return [(f"{prefix}.{name}", slice(ends[i], ends[i + 1])) for i, name in enumerate(("q_proj", "k_proj", "v_proj"))]
    if projection in ("q_proj", "k_proj", "v_proj") and "qkv_proj" in fused or (
            projection in ("gate_proj", "up_proj") and "gate_up_proj" in fused):
        whole = "qkv_proj" if projection.endswith(("q_proj", "k_proj", "v_proj")) else "gate_up_proj"
        raise LoraError(f"the adapter of {node!r} has no peft counterpart: the genai builder splits {model['type']}'s "
                        f"{whole}, whose one peft adapter cannot hold the separate adapters of its parts")
    return [(f"{prefix}.{projection}", slice(None))]


def save_genai_peft_adapter(directory: PathLike, step_model: onnx.ModelProto, tensors: Mapping[str, np.ndarray],
                            base_model_path: PathLike) -> List[str]:
    """Writes the trained adapters in ``tensors`` of a step graph built from :func:`add_adapters`
    on an onnxruntime-genai build (``base_model_path``, its ``genai_config.json`` beside it) as
    peft's ``adapter_model.safetensors`` + ``adapter_config.json`` for the transformers model
    the build came from, which ``peft.PeftModel.from_pretrained(hf_model, directory)`` loads
    (as one set, as :func:`save_adapter`); returns the two paths. The builder's fused qkv_proj
    of Llama-like models becomes q/k/v_proj adapters, each with the fused A and its rows of B.

    Raises:
        LoraError: nothing written: the base is no genai build of a known type, an adapted layer
            has no transformers module of its own (Phi-3's gate/up_proj, which the builder splits),
            or ``tensors`` lacks an adapter.
    """
    return _write_peft_pair(directory, *_genai_peft_weights(step_model, tensors, base_model_path))


def genai_peft_files(step_model: onnx.ModelProto, tensors: Mapping[str, np.ndarray],
                     base_model_path: PathLike) -> Dict[str, bytes]:
    """{file name: bytes} of :func:`save_genai_peft_adapter`'s pair (to write it in a set with others).

    Raises:
        LoraError: as :func:`save_genai_peft_adapter`.
    """
    return _peft_pair(*_genai_peft_weights(step_model, tensors, base_model_path))


def _genai_peft_weights(step_model: onnx.ModelProto, tensors: Mapping[str, np.ndarray],
                        base_model_path: PathLike) -> Tuple[Dict[str, np.ndarray], str]:
    """(peft's weights by key, its adapter_config.json) of :func:`save_genai_peft_adapter`."""
    info = _onnx_adapters(step_model)
    model = _genai_model_config(base_model_path)
    weights, modules = {}, []
    for layer in info["layers"]:
        parts = _genai_peft_parts(layer.node, model)
        for name in (layer.A, layer.B):
            if name not in tensors:
                raise LoraError(f"no trained value for adapter {name!r}")
        for module, rows in parts:
            key = f"base_model.model.{module}"
            weights[f"{key}.lora_A.weight"] = np.ascontiguousarray(tensors[layer.A], dtype=np.float32)
            weights[f"{key}.lora_B.weight"] = np.ascontiguousarray(tensors[layer.B][rows], dtype=np.float32)
            modules.append(module)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": info["rank"], "lora_alpha": info["alpha"],
              "lora_dropout": info["dropout"], "target_modules": sorted(modules), "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": None}
    return weights, json.dumps(config, indent=2, sort_keys=True)
