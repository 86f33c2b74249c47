"""The public entry points: kernels for onnxruntime sessions and function bodies for models."""

from __future__ import annotations

import copy
import os
import pathlib
import re
from typing import Optional, Union

import onnx

import numpy as np
import onnx.numpy_helper

from normgrad.ops import DOMAIN, ONNX_OPSET, OPERATORS, OPSET_VERSION, NormgradInputError, _common

__all__ = [
    "add_functions",
    "check_attributes",
    "inference_session",
    "library_path",
    "prepare_for_python_kernels",
    "session_options",
    "NormgradSessionError",
]

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


_REGISTERED_KEY = "normgrad.kernels"
"""A session config entry normgrad sets on the SessionOptions it registers its kernels into."""


def session_options(backend: str = "cpp", options=None):
    """onnxruntime ``SessionOptions`` with normgrad's kernels of ``backend`` registered.

    Args:
        backend: ``"cpp"`` (the compiled library) or ``"python"`` (onnxruntime-extensions
            Python kernels, float32 only, for reference and debugging).
        options: an existing ``onnxruntime.SessionOptions`` to register into; a new one
            when None.

    Returns:
        ``options`` (or the new object) with the kernels registered. Registering into the
        same ``options`` again (two Trainers sharing one ``SessionOptions``) does nothing:
        onnxruntime would refuse every later session with "Domain already set in registry".

    Raises:
        ValueError: unknown backend, or another backend already registered in ``options``
            (one ``SessionOptions`` cannot serve the normgrad domain twice).
        FileNotFoundError: ``backend="cpp"`` but the library is not installed.
    """
    import onnxruntime

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if options is None:
        options = onnxruntime.SessionOptions()
    try:
        registered = options.get_session_config_entry(_REGISTERED_KEY)
    except RuntimeError:  # onnxruntime's answer for a key never set
        registered = None
    if registered == backend:
        return options
    if registered is not None:
        raise ValueError(f"these SessionOptions already have normgrad's {registered!r} kernels; {backend!r} cannot be "
                         "registered beside them (use a new onnxruntime.SessionOptions)")
    if backend == "cpp":
        options.register_custom_ops_library(library_path())
    else:
        import normgrad.ops.python_kernels as python_kernels

        options.register_custom_ops_library(python_kernels.library_path())
    options.add_session_config_entry(_REGISTERED_KEY, backend)
    return options


def _normgrad_nodes(nodes):
    """Every node of the normgrad domain among ``nodes`` and in their subgraphs."""
    for node in nodes:
        if node.domain == DOMAIN:
            yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from _normgrad_nodes(sub.node)


def _pad_optional(node: onnx.NodeProto, inputs: Optional[int] = None) -> None:
    """Writes omitted trailing inputs (up to ``inputs``, default every declared one) and
    outputs as "": the same node to ONNX, but onnxruntime's function inliner needs every
    formal parameter present."""
    module = OPERATORS[node.op_type]
    count = len(module.INPUTS) if inputs is None else inputs
    node.input.extend([""] * (count - len(node.input)))
    while len(node.input) > count and not node.input[-1]:  # an omitted input the body has no formal for
        node.input.pop()
    node.output.extend([""] * (len(module.OUTPUTS) - len(node.output)))


def _given(node: onnx.NodeProto, module, name: str) -> bool:
    index = module.INPUTS.index(name)
    return index < len(node.input) and bool(node.input[index])


def _body_reads(model: onnx.ModelProto, op_type: str, fresh) -> tuple:
    """The inputs of ``SCALAR_IF_OMITTED`` that some ``op_type`` node of ``model`` gives, so
    that its function body must read them (one body serves every node of an op type, and a
    body cannot test whether an input is present). Every ``op_type`` node omitting one of
    them is fed its scalar, which means the same (``CastLike`` of a float32 Constant to the
    node's ``input``, written just before the node). Then the attributes some node sets to
    a non-default value that select another body (``ATTRIBUTES_READ_UNLESS_DEFAULT``)."""
    module = OPERATORS[op_type]
    scalars = getattr(module, "SCALAR_IF_OMITTED", {})
    nodes = [node for nodes in _node_lists(model) for node in nodes if node.domain == DOMAIN and node.op_type == op_type]
    attributes = _common.attribute_reads(module, nodes)
    reads = tuple(name for name in scalars if any(_given(node, module, name) for node in nodes))
    if not reads:
        return attributes
    for nodes in _node_lists(model):
        rewritten = []
        for node in nodes:
            if node.domain == DOMAIN and node.op_type == op_type:
                _pad_optional(node, max(module.INPUTS.index(name) for name in reads) + 1)
                for name in reads:
                    index = module.INPUTS.index(name)
                    if not node.input[index]:
                        prefix = f"{node.name or op_type}/{name}_omitted"
                        value, cast = fresh(f"{prefix}_float"), fresh(prefix)
                        if isinstance(scalars[name], bool):  # a bool input: its value as it is
                            rewritten.append(onnx.helper.make_node(
                                "Constant", [], [cast], name=fresh(cast),
                                value=onnx.numpy_helper.from_array(np.asarray(scalars[name]))))
                        else:
                            rewritten.append(onnx.helper.make_node(
                                "Constant", [], [value], name=fresh(value),
                                value=onnx.numpy_helper.from_array(np.asarray(scalars[name], np.float32))))
                            rewritten.append(onnx.helper.make_node("CastLike", [value, node.input[1]], [cast],
                                                                   name=fresh(cast)))
                        node.input[index] = cast
            rewritten.append(node)
        del nodes[:]
        nodes.extend(rewritten)
    return reads + attributes


def _default_opset(model: onnx.ModelProto) -> int:
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            return opset.version
    return ONNX_OPSET


def add_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` carrying the function body of every normgrad operator it uses.

    One body serves every node of an op type. An optional input that a body reads only
    when given (``SCALAR_IF_OMITTED``: the BatchNorm operators' ``relu_output``) is read
    when any node of the model gives it; the nodes of that op type that omit it are then
    fed the scalar that means the same as omitting it (so they compute what they did).

    With the bodies attached, the model runs in any onnxruntime session (no kernels
    registered) and in ``onnx.reference.ReferenceEvaluator``. Functions already attached,
    and functions of other domains, are left alone; calling it twice changes nothing.
    The bodies use the model's default-domain opset, which must be 15 or newer.

    Raises:
        ValueError: the model imports a default-domain opset older than 15.
        KeyError: the model uses an op type of the normgrad domain that does not exist.
    """
    return add_functions_in_place(copy.deepcopy(model))


def add_functions_in_place(model: onnx.ModelProto) -> onnx.ModelProto:
    """:func:`add_functions` changing ``model`` itself (no copy of a large graph); returns it."""
    nodes = list(_normgrad_nodes(model.graph.node))
    for function in model.functions:
        nodes += _normgrad_nodes(function.node)
    used = {node.op_type for node in nodes}
    unknown = sorted(used - set(OPERATORS))
    if unknown:
        raise KeyError(f"{unknown} are not normgrad operators; known: {sorted(OPERATORS)}")
    present = {(f.domain, f.name) for f in model.functions}
    opset = _default_opset(model)
    if used and opset < 15:
        raise ValueError(f"normgrad function bodies need default-domain opset >= 15; the model imports {opset}")
    used_names = _value_names(model)
    bodies = {}
    for op_type in sorted(used - {name for domain, name in present if domain == DOMAIN}):
        reads = _body_reads(model, op_type, lambda name: _common.reserve_name(used_names, name))
        bodies[op_type] = OPERATORS[op_type].function_body(opset, reads) if reads else OPERATORS[op_type].function_body(opset)
    formals = {f.name: len(f.input) for f in list(model.functions) + list(bodies.values()) if f.domain == DOMAIN}
    for nodes in _node_lists(model):
        for node in nodes:
            if node.domain == DOMAIN:
                _pad_optional(node, formals.get(node.op_type))
    for op_type in sorted(bodies):
        model.functions.append(bodies[op_type])
    if used and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, OPSET_VERSION))
    return model


_ATTRIBUTE_TYPES = {int: onnx.AttributeProto.INT, float: onnx.AttributeProto.FLOAT, str: onnx.AttributeProto.STRING,
                    list: onnx.AttributeProto.INTS}


def _subgraph_node_lists(nodes):
    """The node lists of the subgraphs of ``nodes``, recursively."""
    for node in nodes:
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield sub.node
                yield from _subgraph_node_lists(sub.node)


def _node_lists(model: onnx.ModelProto):
    """Every node list of ``model``: its graph, its local functions, their subgraphs."""
    for nodes in [model.graph.node] + [function.node for function in model.functions]:
        yield nodes
        yield from _subgraph_node_lists(nodes)


def check_attributes(model: onnx.ModelProto) -> None:
    """Checks the attributes of every normgrad node against its operator's declaration
    (``ATTRIBUTES``: names and, by their defaults, types).

    Raises:
        NormgradInputError: a node sets an attribute its operator does not have, or one of
            the wrong type (e.g. FLOAT ``input_g=0.0``); the message names node and attribute.
    """
    for nodes in _node_lists(model):
        for node in nodes:
            module = OPERATORS.get(node.op_type) if node.domain == DOMAIN else None
            if module is None:
                continue
            for attr in node.attribute:
                if attr.name not in module.ATTRIBUTES:
                    known = ", ".join(sorted(module.ATTRIBUTES)) or "none"
                    raise NormgradInputError(
                        f"{_common.describe(node)}: unknown attribute '{attr.name}' ({node.op_type} has: {known})"
                    )
                expected = _ATTRIBUTE_TYPES[type(module.ATTRIBUTES[attr.name])]
                if attr.type != expected:
                    raise NormgradInputError(
                        f"{_common.describe(node)}: attribute '{attr.name}' must be of type "
                        f"{onnx.AttributeProto.AttributeType.Name(expected)}; got "
                        f"{onnx.AttributeProto.AttributeType.Name(attr.type)}"
                    )


def _value_names(model: onnx.ModelProto) -> set:
    graph = model.graph
    names = {i.name for i in list(graph.input) + list(graph.output) + list(graph.value_info)}
    names |= {t.name for t in graph.initializer}
    for nodes in _node_lists(model):
        for node in nodes:
            names.update(node.input)
            names.update(node.output)
            names.add(node.name)
    return names


def prepare_for_python_kernels(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose normgrad nodes the onnxruntime-extensions bridge accepts.

    The bridge declares every attribute, input and output of a Python kernel required, so
    onnxruntime rejects valid nodes that rely on defaults or omit optional ones. Each
    normgrad node (in the graph, its subgraphs and local functions) is rewritten into an
    equivalent one, driven by its operator module's declarations:

    * every attribute it does not set is written with its default (``ATTRIBUTES``);
    * an omitted optional input listed in ``ONES_IF_OMITTED`` (BatchNormReduceBackward's
      ``weight``, both BatchNorm operators' ``relu_output``, AdamUpdate's optional scalars) is
      fed ones (its ``SCALAR_IF_OMITTED`` value where it has one), made at run time
      (``Shape`` + ``ConstantOfShape``) in the shape the declaration names;
    * every omitted output gets a named placeholder (``NODE/unused_OUTPUT``) that nothing
      reads; a flag attribute (``OUTPUT_FLAGS``) that is 0 while every output it enables is
      omitted is set to 1, so the placeholders get values. The outputs the node names keep
      their values;
    * a scalar output, which the bridge hands over with shape [1], is reshaped back to [];
    * an operator the bridge cannot serve (:func:`_common.has_python_kernel`) gets its function body.

    ``normgrad.inference_session(..., backend="python")`` applies it; call it yourself when
    you register ``session_options("python")`` on a session of your own.

    Raises:
        NormgradInputError: as :func:`check_attributes`.
    """
    check_attributes(model)
    model = copy.deepcopy(model)
    used = _value_names(model)

    def fresh(name: str) -> str:
        return _common.reserve_name(used, name)

    def rewrite(nodes) -> None:
        rewritten = []
        for node in nodes:
            for attr in node.attribute:
                for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                    rewrite(sub.node)
            module = OPERATORS.get(node.op_type) if node.domain == DOMAIN else None
            if module is not None:
                rewritten += _bridge_node(node, module, fresh)
            rewritten.append(node)
            if module is not None:
                rewritten += _scalar_outputs_reshaped(node, module, fresh)
        del nodes[:]
        nodes.extend(rewritten)  # copies, so subgraphs are rewritten first

    for nodes in [model.graph.node] + [function.node for function in model.functions]:
        rewrite(nodes)
    present = {(f.domain, f.name) for f in model.functions}
    for op_type in sorted({n.op_type for nodes in _node_lists(model) for n in _normgrad_nodes(nodes)}):
        if not _common.has_python_kernel(OPERATORS[op_type]) and (DOMAIN, op_type) not in present:
            model.functions.append(OPERATORS[op_type].function_body(_default_opset(model)))
    return model


def _scalar_outputs_reshaped(node: onnx.NodeProto, module, fresh) -> list:
    """The bridge hands a scalar output (``OUTPUT_SHAPE_FROM`` (None, None): SoftmaxCrossEntropy's
    loss) over with shape [1]: each one the node names is renamed, then reshaped back to [];
    returns the nodes that must run after it."""
    after = []
    for index, name in enumerate(module.OUTPUTS):
        if getattr(module, "OUTPUT_SHAPE_FROM", {}).get(name, ("", None))[0] is not None or not node.output[index]:
            continue
        prefix = node.name or node.op_type
        bridged, shape = fresh(f"{prefix}/{name}_bridged"), fresh(f"{prefix}/{name}_scalar_shape")
        after.append(onnx.helper.make_node("Constant", [], [shape], name=fresh(shape),
                                           value=onnx.numpy_helper.from_array(np.zeros(0, np.int64))))
        after.append(onnx.helper.make_node("Reshape", [bridged, shape], [node.output[index]], name=fresh(bridged)))
        node.output[index] = bridged
    return after


def _bridge_node(node: onnx.NodeProto, module, fresh) -> list:
    """Rewrites ``node`` in place for the bridge (see :func:`prepare_for_python_kernels`);
    returns the nodes that must run before it."""
    prefix = node.name or node.op_type
    attributes = {attr.name: attr for attr in node.attribute}
    for name, default in module.ATTRIBUTES.items():
        if name not in attributes:
            node.attribute.append(onnx.helper.make_attribute(name, default))
            attributes[name] = node.attribute[-1]
    _pad_optional(node)
    before = []
    for index, name in enumerate(module.INPUTS):
        ones_like = getattr(module, "ONES_IF_OMITTED", {}).get(name)
        if node.input[index] or ones_like is None:
            continue
        source, axis = ones_like
        bounds = {} if axis is None else {"start": axis, "end": axis + 1}
        shape, ones = fresh(f"{prefix}/{name}_shape"), fresh(f"{prefix}/{name}_ones")
        source_value = node.input[module.INPUTS.index(source)]
        before.append(onnx.helper.make_node("Shape", [source_value], [shape], name=fresh(shape), **bounds))
        fill = getattr(module, "SCALAR_IF_OMITTED", {}).get(name, 1.0)  # what omitting it means; ones by default
        fill = np.asarray([fill], np.bool_ if isinstance(fill, bool) else np.float32)
        before.append(onnx.helper.make_node(
            "ConstantOfShape", [shape], [ones], name=fresh(ones), value=onnx.numpy_helper.from_array(fill)
        ))
        node.input[index] = ones
    omitted = {name for name, value in zip(module.OUTPUTS, node.output) if not value}
    flags = getattr(module, "OUTPUT_FLAGS", {})
    for flag in sorted(set(flags.values())):
        if attributes[flag].i == 0 and {name for name, f in flags.items() if f == flag} <= omitted:
            attributes[flag].i = 1
    for index, name in enumerate(module.OUTPUTS):
        if not node.output[index]:
            node.output[index] = fresh(f"{prefix}/unused_{name}")
    return before


class NormgradSessionError(RuntimeError):
    """onnxruntime could not build a session for a model using normgrad operators; the
    message says what to register. The original onnxruntime error is ``__cause__``."""


SESSION_BACKENDS = ("cpp", "python", "functions", None)
_NOT_REGISTERED = re.compile(r"([\w.]*):(\w+)\(-?\d+\) is not a registered function/op")
_BAD_TYPE = re.compile(r"Type 'tensor\(\w+\)' of input parameter \(\w*\) of operator \((?P<op>\w+)\)")
_BAD_NODE = re.compile(r'In Node, \("[^"]*", (?P<op>\w+), "%s"' % re.escape(DOMAIN))


def _explain(error: Exception, backend: Optional[str]) -> Optional[str]:
    """A normgrad-specific explanation of onnxruntime's session-creation error, or None."""
    text = str(error)
    match = _NOT_REGISTERED.search(text)
    if match and match.group(1) == DOMAIN:
        op_type = match.group(2)
        if op_type not in OPERATORS:
            return (
                f"the model uses {DOMAIN}:{op_type}, which is not a normgrad operator (known: {sorted(OPERATORS)})"
            )
        how = "nothing was registered" if backend is None else f"backend {backend!r} was used"
        return (
            f"onnxruntime has neither a kernel nor a function body for the normgrad operator {op_type} "
            f"({how}). Register normgrad's kernels with `normgrad.session_options(\"cpp\")` (or \"python\", "
            f"float32 only) as the session's options, or attach the function bodies with "
            f"`model = normgrad.add_functions(model)`; normgrad.inference_session(model, backend=\"cpp\" | "
            f"\"python\" | \"functions\") does either"
        )
    match = _BAD_TYPE.search(text) or _BAD_NODE.search(text)
    if backend == "python" and match and match.group("op") in OPERATORS:
        return (
            f"normgrad's Python kernels take float32 only (the onnxruntime-extensions bridge declares "
            f"float inputs and outputs); a {match.group('op')} node breaks that. Use backend=\"cpp\" or "
            f"backend=\"functions\""
        )
    return None


def inference_session(
    model_or_path: Union[onnx.ModelProto, bytes, str, "os.PathLike[str]"],
    backend: Optional[str] = "cpp",
    options=None,
    providers=None,
):
    """An ``onnxruntime.InferenceSession`` for a model using normgrad operators.

    Args:
        model_or_path: a ``ModelProto``, its serialized bytes, or a path.
        backend: ``"cpp"`` (the compiled kernels), ``"python"`` (float32 Python kernels,
            the model first rewritten by :func:`prepare_for_python_kernels`),
            ``"functions"`` (attach the function bodies with :func:`add_functions`; no
            kernel registered, so any execution provider can take the inlined standard
            ops), or None (register nothing: the model must carry what it needs).
        options: ``onnxruntime.SessionOptions`` to register into (a new one when None).
        providers: passed to ``InferenceSession`` (onnxruntime's default when None).

    Raises:
        NormgradSessionError: onnxruntime found a normgrad node it has no kernel and no
            function body for (the message says what to call), or, with
            ``backend="python"``, a node the float32 Python kernels cannot take.
            onnxruntime's own error is the ``__cause__``; other errors pass unchanged.
        NormgradInputError: a normgrad node sets an unknown attribute or one of the wrong
            type (:func:`check_attributes`).
        ValueError: unknown backend.
    """
    import onnxruntime

    if backend not in SESSION_BACKENDS:
        raise ValueError(f"backend must be one of {SESSION_BACKENDS}; got {backend!r}")
    if options is None:
        options = onnxruntime.SessionOptions()
    if isinstance(model_or_path, onnx.ModelProto):
        source: Union[bytes, str] = model_or_path.SerializeToString()
    elif isinstance(model_or_path, (bytes, bytearray)):
        source = bytes(model_or_path)
    else:
        source = os.fspath(model_or_path)
    model = onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(source)
    check_attributes(model)
    if backend == "functions":
        source = add_functions(model).SerializeToString()
    elif backend == "python":
        source = prepare_for_python_kernels(model).SerializeToString()
    if backend in BACKENDS:
        session_options(backend, options)
    try:
        return onnxruntime.InferenceSession(source, options, providers=providers)
    except Exception as error:
        explanation = _explain(error, backend)
        if explanation is None:
            raise
        raise NormgradSessionError(f"{explanation}. onnxruntime said: {error}") from error
