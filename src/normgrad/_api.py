"""The public entry points: kernels for onnxruntime sessions and function bodies for models."""

from __future__ import annotations

import copy
import pathlib
from typing import Optional

import onnx

from normgrad.ops import DOMAIN, ONNX_OPSET, OPERATORS, OPSET_VERSION

__all__ = ["add_functions", "library_path", "session_options"]

_LIBRARY_NAMES = ("libnormgrad_ops.so", "libnormgrad_ops.dylib", "normgrad_ops.dll")
BACKENDS = ("cpp", "python")


def library_path() -> str:
    """The path of the compiled custom-op library, for ``register_custom_ops_library``.

    Raises:
        FileNotFoundError: the package was installed without its C++ library.
    """
    import normgrad.ops

    for folder in normgrad.ops.__path__:
        for name in _LIBRARY_NAMES:
            candidate = pathlib.Path(folder) / name
            if candidate.is_file():
                return str(candidate)
    raise FileNotFoundError(
        "normgrad's C++ custom-op library is not installed (looked for "
        f"{', '.join(_LIBRARY_NAMES)} in {list(normgrad.ops.__path__)}); reinstall with "
        "`pip install .` from a checkout, or use session_options(backend='python') or add_functions()."
    )


def session_options(backend: str = "cpp", options=None):
    """onnxruntime ``SessionOptions`` with normgrad's kernels of ``backend`` registered.

    Args:
        backend: ``"cpp"`` (the compiled library) or ``"python"`` (onnxruntime-extensions
            Python kernels, float32 only, for reference and debugging).
        options: an existing ``onnxruntime.SessionOptions`` to register into; a new one
            when None.

    Returns:
        ``options`` (or the new object) with the kernels registered.

    Raises:
        ValueError: unknown backend.
        FileNotFoundError: ``backend="cpp"`` but the library is not installed.
    """
    import onnxruntime

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if options is None:
        options = onnxruntime.SessionOptions()
    if backend == "cpp":
        options.register_custom_ops_library(library_path())
    else:
        from normgrad.ops import python_kernels

        options.register_custom_ops_library(python_kernels.library_path())
    return options


def _normgrad_nodes(nodes):
    """Every node of the normgrad domain among ``nodes`` and in their subgraphs."""
    for node in nodes:
        if node.domain == DOMAIN:
            yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from _normgrad_nodes(sub.node)


def _pad_optional(node: onnx.NodeProto) -> None:
    """Writes omitted trailing inputs/outputs as "": the same node to ONNX, but onnxruntime's
    function inliner needs every formal parameter present."""
    module = OPERATORS[node.op_type]
    node.input.extend([""] * (len(module.INPUTS) - len(node.input)))
    node.output.extend([""] * (len(module.OUTPUTS) - len(node.output)))


def _default_opset(model: onnx.ModelProto) -> int:
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            return opset.version
    return ONNX_OPSET


def add_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` carrying the function body of every normgrad operator it uses.

    With the bodies attached, the model runs in any onnxruntime session (no kernels
    registered) and in ``onnx.reference.ReferenceEvaluator``. Functions already attached,
    and functions of other domains, are left alone; calling it twice changes nothing.
    The bodies use the model's default-domain opset, which must be 15 or newer.

    Raises:
        ValueError: the model imports a default-domain opset older than 15.
        KeyError: the model uses an op type of the normgrad domain that does not exist.
    """
    model = copy.deepcopy(model)
    nodes = list(_normgrad_nodes(model.graph.node))
    for function in model.functions:
        nodes += _normgrad_nodes(function.node)
    used = {node.op_type for node in nodes}
    unknown = sorted(used - set(OPERATORS))
    if unknown:
        raise KeyError(f"{unknown} are not normgrad operators; known: {sorted(OPERATORS)}")
    for node in nodes:
        _pad_optional(node)
    present = {(f.domain, f.name) for f in model.functions}
    opset = _default_opset(model)
    if used and opset < 15:
        raise ValueError(f"normgrad function bodies need default-domain opset >= 15; the model imports {opset}")
    for op_type in sorted(used):
        if (DOMAIN, op_type) not in present:
            model.functions.append(OPERATORS[op_type].function_body(opset))
    if used and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, OPSET_VERSION))
    return model
