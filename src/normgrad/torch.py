"""normgrad.torch: export a torch module to the forward ONNX model ``normgrad export`` needs.

:func:`export` chooses the exporter settings under which the training graph gives torch's
gradients: BatchNorm and Dropout exported in the mode each module is in (training-mode
BatchNorm keeps ``training_mode=1``), no constant folding, no merging of initializers that
happen to be equal, no BatchNorm folded into convolutions, every parameter an initializer
under its torch name. The model's metadata lists which initializers are torch parameters
(``normgrad.torch_parameters``), and :func:`normgrad.graphs.build_training_graph` trains only
those. torch is an optional dependency (``pip install "normgrad[torch]"``), imported here
only when :func:`export` is called.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import onnx

from normgrad import lora
from normgrad._external_data import EXTERNAL_TENSOR_MIN_BYTES, save_models_external
from normgrad.graphs.tidy import tidy
from normgrad.graphs.torch_exports import (METADATA_EMBEDDINGS, METADATA_PEFT, METADATA_TORCH_PARAMETERS,
                                          referenced_parameters)
from normgrad.ops import IR_VERSION

__all__ = ["export", "TorchExportError", "EXPORTERS", "OPSETS"]

EXPORTERS = ("torchscript", "dynamo")
OPSETS = {"torchscript": (12, 20), "dynamo": (18, 21)}
"""The default-domain opsets each exporter may write here (onnxruntime 1.19.2 loads up to 21;
training-mode BatchNorm and Dropout need 12; the dynamo exporter writes 18 and newer)."""
DEFAULT_OPSET = {"torchscript": 17, "dynamo": 18}

DynamicAxes = Mapping[str, Union[Sequence[int], Mapping[int, str]]]


class TorchExportError(ValueError):
    """A bad argument, or a module the chosen exporter cannot export (with its own error)."""


def _import_torch():
    try:
        import torch
    except ImportError as error:
        raise ImportError(
            f"normgrad.torch.export needs torch ({error}); install it with: pip install \"normgrad[torch]\""
        ) from None
    return torch


def causal_lm_logits(model):
    """A module ``input_ids -> logits`` around a transformers causal language model (or the
    peft model wrapping one): what to export for training with ``loss="causal_lm"``, one
    output and no key/value cache. Its parameters keep the model's names under ``model.``."""
    torch = _import_torch()

    class CausalLMLogits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    return CausalLMLogits()


def export(
    module: Any,
    example_inputs: Any,
    path: Union[str, "os.PathLike[str]"],
    *,
    exporter: str = "torchscript",
    dynamic_axes: Optional[DynamicAxes] = None,
    input_names: Optional[Sequence[str]] = None,
    output_names: Optional[Sequence[str]] = None,
    opset: Optional[int] = None,
    external_data: bool = False,
) -> onnx.ModelProto:
    """Exports ``module`` as a forward ONNX model from which ``normgrad export`` builds a
    training graph with torch's gradients, writes it to ``path`` atomically and returns it.

    Each module is exported in the mode it is in (``module.train()`` / ``.eval()``, per
    submodule, as torch would run it): BatchNorm in training mode normalizes with the batch
    statistics, Dropout in training mode draws a mask.

    Args:
        module: a ``torch.nn.Module``.
        example_inputs: a tensor or a tuple of tensors (the positional arguments).
        path: where to write the model (a new file, or one to replace atomically).
        exporter: ``"torchscript"`` (``torch.onnx.export(dynamo=False)``) or ``"dynamo"``
            (``dynamo=True``, needs onnxscript).
        dynamic_axes: ``{input or output name: [axis, ...] or {axis: "dim name"}}``, e.g.
            ``{"x": {0: "batch", 2: "height", 3: "width"}}``; the other axes are static.
        input_names: ONNX names of the inputs (default ``input_0``...).
        output_names: ONNX names of the outputs (default ``output_0``...).
        opset: default-domain opset (torchscript 12-20, default 17; dynamo 18-21, default 18).
        external_data: write the frozen initializers (no ``requires_grad``; 1 KiB or more)
            to ``PATH.HASH.data`` beside the model (named by its content: the model and its data
            are one set, see :func:`normgrad._files.commit_files`), which references them (relative location):
            the route for models past protobuf's 2 GiB limit. The returned model holds the
            references too (relative to the model's folder: the graph builders do not read
            them; give the Trainer the step graph by path, or ``external_data_folder``).

    Returns:
        The model written: IR version 10, metadata ``normgrad.torch_parameters`` = JSON
        ``{initializer name: torch parameter name}`` for every parameter with
        ``requires_grad`` (buffers such as BatchNorm's running statistics are not in it);
        for a module holding a peft LoRA model, also ``normgrad.peft`` (its adapters, for
        :func:`normgrad.lora.save_adapter` and :func:`normgrad.lora.merged_model`); for
        trained nn.Embedding weights with ``padding_idx`` or ``scale_grad_by_freq``, also
        ``normgrad.embeddings`` (torch's gradient semantics of their lookups, which the
        exported Gather cannot carry: see :mod:`normgrad.graphs.torch_exports`).

    Raises:
        ImportError: torch (or, for dynamo, onnxscript) is not installed.
        TorchExportError: a bad argument, a parameter that did not become an initializer of
            its own, nn.Embedding modules sharing a weight with different ``padding_idx`` or
            ``scale_grad_by_freq``, or the exporter's own error.
        OSError: ``path`` cannot be written (it is then unchanged).
    """
    torch = _import_torch()
    if not isinstance(module, torch.nn.Module):
        raise TorchExportError(f"module must be a torch.nn.Module; got {type(module).__name__}")
    if exporter not in EXPORTERS:
        raise TorchExportError(f"exporter must be one of {', '.join(map(repr, EXPORTERS))}; got {exporter!r}")
    inputs = _example_inputs(torch, example_inputs)
    input_names = _names("input_names", input_names, "input", len(inputs))
    opset = _opset(exporter, opset)
    if os.path.isdir(path):
        raise TorchExportError(f"path {os.fspath(path)!r} is a folder; name the .onnx file to write")
    output_count = None if output_names is None else len(output_names)
    output_names = None if output_names is None else _names("output_names", output_names, "output", output_count)
    dynamic_axes = _dynamic_axes(dynamic_axes, inputs, input_names, output_names)

    parameters = _trainable_parameters(module)
    frozen = (lambda name: name not in parameters) if external_data else (lambda name: False)
    embeddings = _embedding_settings(torch, module)
    export_module = _export_torchscript if exporter == "torchscript" else _export_dynamo
    with _exportable_experts(module), _without_scale_grad_by_freq(torch, module):
        model, contents = export_module(torch, module, inputs, input_names, output_names, dynamic_axes, opset, frozen)
    # onnxruntime warns at every session creation about each initializer no node reads
    # (e.g. transformers' position_ids buffer) and each constant CastLike (dynamo)
    tidy(model)
    recorded = {t.name: parameters[t.name] for t in model.graph.initializer if t.name in parameters}
    _check_parameters_kept(model, parameters, recorded, exporter)
    metadata = {**{p.key: p.value for p in model.metadata_props}, METADATA_TORCH_PARAMETERS: json.dumps(recorded)}
    embeddings = _embedding_gradients(embeddings, parameters, recorded)
    if embeddings:
        metadata[METADATA_EMBEDDINGS] = json.dumps(embeddings, sort_keys=True)
    peft_adapters = lora.peft_metadata(module, {t.name for t in model.graph.initializer})
    if peft_adapters is not None:
        metadata[METADATA_PEFT] = peft_adapters
    onnx.helper.set_model_props(model, metadata)
    model.ir_version = IR_VERSION
    trained = set(recorded)
    moving = [t for t in model.graph.initializer if external_data and t.name not in trained
              and t.HasField("raw_data") and len(t.raw_data) >= EXTERNAL_TENSOR_MIN_BYTES]
    # nothing frozen (full fine-tuning): no empty data file beside the model
    save_models_external({path: model}, move=moving, contents=contents)
    return model


EXPORTABLE_EXPERTS = "batched_mm"
"""The transformers experts implementation both exporters can export: transformers' default
``grouped_mm`` is a custom op without ONNX form, and ``eager`` loops over the experts the
example routes to (data-dependent for dynamo; unrolled for just those by TorchScript)."""


@contextlib.contextmanager
def _exportable_experts(module):
    """Within the block, every transformers mixture-of-experts model in ``module`` runs its
    experts as :data:`EXPORTABLE_EXPERTS`; each gets its own implementation back after."""
    models = [m for m in module.modules() if getattr(m, "_can_set_experts_implementation", lambda: False)()
              and set(m.get_experts_implementation().values()) != {EXPORTABLE_EXPERTS}]
    originals = [m.get_experts_implementation() for m in models]
    try:
        for model in models:
            model.set_experts_implementation(EXPORTABLE_EXPERTS)
        yield
    finally:
        for model, original in reversed(list(zip(models, originals))):
            model.set_experts_implementation(original)


def _example_inputs(torch, example_inputs) -> Tuple[Any, ...]:
    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    for i, value in enumerate(inputs):
        if not isinstance(value, torch.Tensor):
            raise TorchExportError(
                f"example_inputs[{i}] must be a torch.Tensor; got {type(value).__name__} "
                "(pass a tensor or a tuple of tensors, the module's positional arguments)"
            )
    if not inputs:
        raise TorchExportError("example_inputs is empty; pass the tensors the module's forward takes")
    return tuple(inputs)


def _names(argument: str, names: Optional[Sequence[str]], prefix: str, count: Optional[int]) -> List[str]:
    if names is None:
        return [f"{prefix}_{i}" for i in range(count or 0)]
    if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
        raise TorchExportError(f"{argument} must be a list of non-empty strings; got {names!r}")
    if len(set(names)) != len(names):
        raise TorchExportError(f"{argument} names a value twice: {list(names)!r}")
    if count is not None and len(names) != count:
        raise TorchExportError(f"{argument} has {len(names)} names for {count} example inputs")
    return list(names)


def _opset(exporter: str, opset: Optional[int]) -> int:
    low, high = OPSETS[exporter]
    if opset is None:
        return DEFAULT_OPSET[exporter]
    if isinstance(opset, bool) or not isinstance(opset, int) or not low <= opset <= high:
        raise TorchExportError(f"opset for the {exporter} exporter must be an int in {low}..{high}; got {opset!r}")
    return opset


def _dynamic_axes(dynamic_axes, inputs, input_names, output_names) -> Optional[Dict[str, Dict[int, str]]]:
    """``dynamic_axes`` checked, as ``{name: {axis: dim name}}`` with non-negative axes."""
    if dynamic_axes is None:
        return None
    if not isinstance(dynamic_axes, Mapping):
        raise TorchExportError(f"dynamic_axes must be a dict {{input or output name: axes}}; got {type(dynamic_axes).__name__}")
    ranks = {name: value.dim() for name, value in zip(input_names, inputs)}
    result: Dict[str, Dict[int, str]] = {}
    for name, axes in dynamic_axes.items():
        if name not in ranks and name not in (output_names or ()):
            known = input_names + list(output_names or ())
            raise TorchExportError(f"dynamic_axes names {name!r}, which is none of the input or output names {known}")
        named = dict(axes) if isinstance(axes, Mapping) else {axis: None for axis in axes}
        result[name] = {}
        for axis, dim_name in named.items():
            rank = ranks.get(name)
            if isinstance(axis, bool) or not isinstance(axis, int) or (rank is not None and not -rank <= axis < rank):
                raise TorchExportError(f"dynamic_axes[{name!r}] has axis {axis!r}, not an axis of a rank-{rank} tensor")
            axis = axis % rank if rank is not None else axis
            result[name][axis] = dim_name if isinstance(dim_name, str) and dim_name else f"{name}_dim{axis}"
    return result


def _trainable_parameters(module) -> Dict[str, str]:
    """{every name of a parameter with requires_grad: its first name} (a parameter shared by
    several modules has several names; an exporter keeps one initializer under one of them)."""
    first: Dict[int, str] = {}
    names: Dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            names[name] = first.setdefault(id(param), name)
    return names


def _embedding_settings(torch, module) -> List[Tuple[str, Dict[str, Any]]]:
    """(name, {"padding_idx", "scale_grad_by_freq"}) of every nn.Embedding in ``module``,
    under each of its names."""
    return [(name, {"padding_idx": embedding.padding_idx, "scale_grad_by_freq": bool(embedding.scale_grad_by_freq)})
            for name, embedding in module.named_modules(remove_duplicate=False)
            if isinstance(embedding, torch.nn.Embedding)]


@contextlib.contextmanager
def _without_scale_grad_by_freq(torch, module):
    """nn.Embedding's scale_grad_by_freq off while exporting: it changes no forward value,
    the TorchScript exporter refuses it in training mode, and the metadata carries it."""
    scaled = [m for m in module.modules() if isinstance(m, torch.nn.Embedding) and m.scale_grad_by_freq]
    try:
        for embedding in scaled:
            embedding.scale_grad_by_freq = False
        yield
    finally:
        for embedding in scaled:
            embedding.scale_grad_by_freq = True


def _embedding_gradients(embeddings: Sequence[Tuple[str, Dict[str, Any]]], parameters: Mapping[str, str],
                         recorded: Mapping[str, str]) -> Dict[str, Dict[str, Any]]:
    """``normgrad.embeddings``: {initializer: {"padding_idx", "scale_grad_by_freq"}} of each
    trained weight of the nn.Embedding modules ``embeddings`` (:func:`_embedding_settings`)
    that set either (the graph's Gather cannot say).

    Raises:
        TorchExportError: nn.Embedding modules sharing a weight differ in these settings
            (the graph's lookups of the one weight cannot be told apart)."""
    initializer_of = {name: initializer for initializer, name in recorded.items()}
    found: Dict[str, Tuple[str, Dict[str, Any]]] = {}
    for name, semantics in embeddings:
        initializer = initializer_of.get(parameters.get(f"{name}.weight" if name else "weight"))
        if initializer is None:  # frozen, or not read by the graph
            continue
        first, settings = found.setdefault(initializer, (name, semantics))
        if settings != semantics:
            raise TorchExportError(
                f"nn.Embedding modules {first!r} ({_settings(settings)}) and {name!r} ({_settings(semantics)}) share "
                "one weight: the exported lookups of that weight cannot be told apart, so their torch gradients cannot "
                "be kept; give them the same padding_idx and scale_grad_by_freq")
    return {initializer: settings for initializer, (_, settings) in found.items()
            if settings["padding_idx"] is not None or settings["scale_grad_by_freq"]}


def _settings(semantics: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={value}" for key, value in semantics.items())


def _check_parameters_kept(model: onnx.ModelProto, parameters: Mapping[str, str], recorded: Mapping[str, str], exporter: str) -> None:
    """Raises when a parameter the dynamo exporter says the graph reads is not an initializer."""
    if exporter != "dynamo":
        return
    kept = set(recorded.values())
    lost = [name for name in referenced_parameters(model, parameters) if parameters[name] not in kept]
    if lost:
        raise TorchExportError(
            f"the dynamo exporter did not keep torch parameter{'s' if len(lost) > 1 else ''} {', '.join(lost[:5])}"
            f"{' ...' if len(lost) > 5 else ''} as initializers of their own; export with exporter='torchscript'"
        )


def _export_torchscript(torch, module, inputs, input_names, output_names, dynamic_axes, opset,
                        frozen) -> Tuple[onnx.ModelProto, Dict[str, Any]]:
    """TorchScript export: each module in its own mode (PRESERVE), nothing folded.

    torch deduplicates initializers by value when the top module is in eval mode, so an
    eval-mode module is exported inside a wrapper that reports training mode but changes
    no submodule's mode.

    The exporter writes no weights (``export_params=False``: they are graph inputs under
    their state-dict names, in the order it would write them; its model with the weights
    would be held twice, as bytes and parsed); they become initializers here, from torch's
    tensors, those named ``frozen(name)`` of :data:`EXTERNAL_TENSOR_MIN_BYTES` or more as
    external references with their contents returned as :func:`_export_dynamo` does."""
    target = module if module.training else _training_flag_wrapper(torch, module)

    def exported(export_params: bool) -> onnx.ModelProto:
        buffer = io.BytesIO()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    target, inputs, buffer, dynamo=False, training=torch.onnx.TrainingMode.PRESERVE,
                    do_constant_folding=False, export_params=export_params, keep_initializers_as_inputs=False,
                    input_names=input_names, output_names=output_names, dynamic_axes=dynamic_axes,
                    opset_version=opset,
                )
        except Exception as error:  # the exporter's own error, reported as is
            raise TorchExportError(f"torch's TorchScript exporter failed: {type(error).__name__}: "
                                   f"{_first_line(error)}") from error
        return onnx.load_from_string(buffer.getvalue())

    # the trace runs the module once: training-mode BatchNorm updates its running statistics
    buffers = [(buffer, buffer.clone()) for buffer in target.buffers()]
    model = exported(export_params=False)
    contents = _weights_from_state(torch, model, target, set(input_names), frozen)
    if contents is None:  # weights the state dict does not hold: torch's own export, from the same state
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
        model, contents = exported(export_params=True), {}
    del buffers
    if target is not module:
        renames = _strip_prefix(model, _WRAPPED + ".")
        contents = {renames.get(name, name): read for name, read in contents.items()}
    return model, contents


def _weights_from_state(torch, model: onnx.ModelProto, target, user_inputs, frozen) -> Optional[Dict[str, Any]]:
    """The graph inputs of ``model`` other than ``user_inputs`` (the weights of an export
    with ``export_params=False``) made initializers with the values of ``target``'s state
    dict of those names; returns ``{name: function returning the bytes}`` of those left
    external (see :func:`_export_torchscript`), or None (``model`` unchanged) when the state
    dict lacks one of them or holds one off the CPU or of a type without a NumPy one."""
    state = dict(target.state_dict(keep_vars=True))
    weights = [i for i in model.graph.input if i.name not in user_inputs]
    types = {i.name: _onnx_dtype(torch, state[i.name]) for i in weights if i.name in state}
    if len(types) < len(weights) or None in types.values():
        return None
    contents = {}
    for info in weights:
        value = state[info.name].detach()
        tensor = onnx.TensorProto(name=info.name, dims=list(value.shape), data_type=types[info.name])
        read = _torch_bytes(torch, value)
        if frozen(info.name) and value.numel() * value.element_size() >= EXTERNAL_TENSOR_MIN_BYTES:
            for key, entry in (("location", f"{info.name}.data"), ("offset", "0"),
                               ("length", str(value.numel() * value.element_size()))):
                tensor.external_data.add(key=key, value=entry)
            tensor.data_location = onnx.TensorProto.EXTERNAL
            contents[info.name] = read
        else:
            tensor.raw_data = bytes(read())
        model.graph.initializer.append(tensor)
    kept = [i for i in model.graph.input if i.name in user_inputs]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    return contents


def _onnx_dtype(torch, value) -> Optional[int]:
    """The ONNX element type of a CPU tensor's values (None: not on the CPU, or none)."""
    if value.device.type != "cpu":
        return None
    if value.dtype == torch.bfloat16:
        return onnx.TensorProto.BFLOAT16
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(torch.empty(0, dtype=value.dtype).numpy().dtype)
    except (TypeError, KeyError, ValueError):
        return None


def _torch_bytes(torch, value):
    """A function returning a CPU torch tensor's bytes, a view of its storage (no copy)."""
    def read():
        return memoryview(value.contiguous().reshape(-1).view(torch.uint8).numpy())
    return read


def _export_dynamo(torch, module, inputs, input_names, output_names, dynamic_axes, opset,
                   frozen) -> Tuple[onnx.ModelProto, Dict[str, Any]]:
    """dynamo export with ``optimize=False`` (its optimizer folds BatchNorm into convolutions,
    merges equal initializers and constant-folds parameter transforms), training-mode
    batch_norm written as BatchNormalization with ``training_mode=1`` (onnxscript's own
    translation always writes inference mode), and nn.Dropout modules made out-of-place
    for the export (the exporter leaves an in-place dropout in training mode out of the
    graph, torch 2.13).

    Returns the model and the contents of its initializers named ``frozen(name)`` of
    :data:`EXTERNAL_TENSOR_MIN_BYTES` or more, which the model references as external data
    (at a placeholder location) instead of holding: ``{name: function returning the bytes}``,
    read from the torch tensors when the data file is written, so the base is never copied
    whole."""
    try:
        import onnxscript  # noqa: F401
    except ImportError as error:
        raise ImportError(f"the dynamo exporter needs onnxscript ({error}); pip install onnxscript") from None
    in_place = [m for m in module.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.inplace]
    aten = torch.ops.aten
    table = {
        aten._native_batch_norm_legit_functional.default: _batch_norm_training,
        aten._native_batch_norm_legit.no_stats: _batch_norm_training_no_stats,
    }
    try:
        for dropout in in_place:  # the dynamo exporter drops an in-place training-mode dropout
            dropout.inplace = False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module, inputs, dynamo=True, optimize=False, opset_version=opset, verbose=False,
                input_names=input_names, output_names=output_names, dynamic_axes=dynamic_axes,
                custom_translation_table=table, report=False,
            )
    except Exception as error:
        raise TorchExportError(f"torch's dynamo exporter failed: {type(error).__name__}: {_first_line(error)}") from error
    finally:
        for dropout in in_place:
            dropout.inplace = True
    import onnx_ir as ir

    contents = {}
    for name, value in program.model.graph.initializers.items():
        tensor = value.const_value
        if (tensor is not None and frozen(name) and tensor.dtype != ir.DataType.STRING
                and tensor.nbytes >= EXTERNAL_TENSOR_MIN_BYTES):
            contents[name] = _tensor_bytes(torch, tensor)
            value.const_value = ir.ExternalTensor(f"{name}.data", 0, tensor.nbytes, tensor.dtype,
                                                  shape=tensor.shape, name=name)
    return program.model_proto, contents


def _tensor_bytes(torch, tensor):
    """A function returning the bytes of an onnx_ir tensor: for one over a torch tensor, a
    view of its storage (no copy); for any other, ``tobytes()``."""
    raw = getattr(tensor, "raw", None)
    if isinstance(raw, torch.Tensor) and raw.element_size() * 8 == tensor.dtype.bitwidth and sys.byteorder == "little":
        return _torch_bytes(torch, raw.detach())
    return tensor.tobytes


def _batch_norm_training(input, weight=None, bias=None, running_mean=None, running_var=None, training=False,
                         momentum=0.1, eps=1e-5):
    """aten._native_batch_norm_legit_functional as one BatchNormalization in its own mode."""
    from onnxscript import opset15 as op

    channels = op.Shape(input, start=1, end=2)
    if weight is None:
        weight = op.Expand(op.CastLike(op.Constant(value_floats=[1.0]), input), channels)
    if bias is None:
        bias = op.Expand(op.CastLike(op.Constant(value_floats=[0.0]), input), channels)
    onnx_momentum = 1.0 - (0.1 if momentum is None else momentum)
    if not training:
        y = op.BatchNormalization(input, weight, bias, running_mean, running_var, epsilon=eps,
                                  momentum=onnx_momentum, training_mode=0)
        return y, running_mean, running_var, running_mean, running_var
    y, new_mean, new_var = op.BatchNormalization(input, weight, bias, running_mean, running_var, epsilon=eps,
                                                 momentum=onnx_momentum, training_mode=1)
    return y, new_mean, new_var, new_mean, new_var


def _batch_norm_training_no_stats(input, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """aten._native_batch_norm_legit.no_stats (track_running_stats=False): training mode
    with placeholder running statistics, whose updated values nothing reads."""
    from onnxscript import opset15 as op

    channels = op.Shape(input, start=1, end=2)
    zeros = op.Expand(op.CastLike(op.Constant(value_floats=[0.0]), input), channels)
    ones = op.Expand(op.CastLike(op.Constant(value_floats=[1.0]), input), channels)
    y, _, _ = _batch_norm_training(input, weight, bias, zeros, ones, True, momentum, eps)[:3]
    return y, zeros, ones


_WRAPPED = "wrapped"


def _training_flag_wrapper(torch, module):
    """A module whose own flag says training, running ``module`` with its modes untouched."""

    class Wrapper(torch.nn.Module):
        def forward(self, *args):
            return getattr(self, _WRAPPED)(*args)

    wrapper = Wrapper()
    wrapper.add_module(_WRAPPED, module)
    wrapper.training = True  # the flag alone: wrapper.train() would change every submodule
    return wrapper


def _strip_prefix(model: onnx.ModelProto, prefix: str) -> Dict[str, str]:
    """Renames initializers ``PREFIX + name`` to ``name`` everywhere in the main graph;
    returns ``{old name: new name}``."""
    renames = {t.name: t.name[len(prefix):] for t in model.graph.initializer if t.name.startswith(prefix)}
    taken = {t.name for t in model.graph.initializer} | {v.name for v in model.graph.input}
    renames = {old: new for old, new in renames.items() if new not in taken}
    for tensor in model.graph.initializer:
        tensor.name = renames.get(tensor.name, tensor.name)
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
    for info in list(model.graph.value_info) + list(model.graph.output):
        info.name = renames.get(info.name, info.name)
    return renames


def _first_line(error: BaseException) -> str:
    """The error's first line, and its innermost cause's (where torch wraps the real one)."""

    def line(exception: BaseException) -> str:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exception)).strip().splitlines()
        return text[0] if text else type(exception).__name__

    cause = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    if cause is error:
        return line(error)
    return f"{line(error)} Caused by {type(cause).__name__}: {line(cause)}"
