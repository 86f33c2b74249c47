"""Single-node models of the normgrad operators and one way to run them on every backend.

Used by the tests, ``normgrad demo`` and ``normgrad bench``; handy for users writing
their own interoperability checks.
"""

from __future__ import annotations

import copy
from typing import Mapping, Optional, Sequence

import ml_dtypes
import numpy as np
import onnx
from onnx import helper

import normgrad.ops.api as api
from normgrad.ops import DOMAIN, IR_VERSION, ONNX_OPSET, OPERATORS, OPSET_VERSION, operator
from normgrad.ops._common import tensor_type

__all__ = ["BACKENDS", "node_model", "make_session", "run_session", "run_model", "run", "run_in_place"]

BACKENDS = ("reference", "cpp", "python", "functions", "evaluator")
"""``reference``: the NumPy float64 truth; ``cpp``/``python``: onnxruntime with normgrad's
kernels; ``functions``: plain onnxruntime running the function bodies;
``evaluator``: ``onnx.reference.ReferenceEvaluator`` running the function bodies."""

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def node_model(
    op_type: str,
    inputs: Mapping[str, Optional[np.ndarray]],
    outputs: Optional[Sequence[str]] = None,
    attributes: Optional[Mapping[str, int]] = None,
    static_shapes: bool = True,
) -> onnx.ModelProto:
    """A model holding one normgrad node, its graph inputs shaped like ``inputs``.

    Args:
        op_type: a normgrad operator.
        inputs: every input by name; None (or absent) omits an optional input.
        outputs: the outputs the node names; the others are omitted ("" when not trailing).
            All outputs when None.
        attributes: the node's attributes; unset ones are written with their defaults,
            since ``ReferenceEvaluator`` requires them.
        static_shapes: declare the input shapes (so onnx shape inference checks them);
            with False the inputs have unknown shapes and only the kernels check them.
    """
    module = operator(op_type)
    wanted = list(module.OUTPUTS) if outputs is None else list(outputs)
    node_inputs = [name if inputs.get(name) is not None else "" for name in module.INPUTS]
    node_outputs = [name if name in wanted else "" for name in module.OUTPUTS]
    while node_inputs and not node_inputs[-1]:
        node_inputs.pop()
    while node_outputs and not node_outputs[-1]:
        node_outputs.pop()
    attrs = dict(module.ATTRIBUTES)
    attrs.update(attributes or {})
    node = helper.make_node(op_type, node_inputs, node_outputs, domain=DOMAIN, **attrs)
    graph_inputs = [
        helper.make_tensor_value_info(name, tensor_type(value.dtype), list(value.shape) if static_shapes else None)
        for name, value in inputs.items()
        if value is not None
    ]
    graph = helper.make_graph(
        [node], op_type, graph_inputs, [onnx.ValueInfoProto(name=name) for name in node_outputs if name]
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid(DOMAIN, OPSET_VERSION)],
        ir_version=IR_VERSION,
    )
    # Our schemas' inference fills in the output types.
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def make_session(model: onnx.ModelProto, backend: str, threads: Optional[int] = None, options=None):
    """An onnxruntime session for ``backend`` in {"cpp", "python", "functions"}, with
    ``options`` (a new ``SessionOptions`` when None) given ``threads`` when not None."""
    import onnxruntime

    options = onnxruntime.SessionOptions() if options is None else options
    if threads is not None:
        options.intra_op_num_threads = threads
    if backend == "functions":
        model = api.add_functions(model)
    else:
        if backend == "python":  # the bridge declares every input and output required
            model = api.prepare_for_python_kernels(model)
        api.session_options(backend, options)
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _bfloat16_via_float(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with bfloat16 graph inputs and outputs carried as float32 and cast inside.

    onnxruntime's Python API takes and returns no bfloat16 arrays before 1.20; the casts
    are exact both ways for values that are bfloat16 already.
    """
    bf16, f32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    model = copy.deepcopy(model)
    graph = model.graph
    casts_in, casts_out = [], []
    for value in graph.input:
        if value.type.tensor_type.elem_type == bf16:
            inner = f"{value.name}__bfloat16"
            for node in graph.node:
                node.input[:] = [inner if name == value.name else name for name in node.input]
            casts_in.append(helper.make_node("Cast", [value.name], [inner], to=bf16))
            value.type.tensor_type.elem_type = f32
    for value in graph.output:
        if value.type.tensor_type.elem_type == bf16:
            inner = f"{value.name}__bfloat16"
            for node in graph.node:
                node.output[:] = [inner if name == value.name else name for name in node.output]
            casts_out.append(helper.make_node("Cast", [inner], [value.name], to=f32))
            value.type.tensor_type.elem_type = f32
    nodes = casts_in + list(graph.node) + casts_out
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def run_session(session, inputs: Mapping[str, Optional[np.ndarray]], bfloat16_outputs=()) -> dict:
    """Runs ``session`` on ``inputs``, bfloat16 arrays going in and out as float32."""
    feeds = {
        name: np.asarray(value, np.float32 if value.dtype == _BFLOAT16 else value.dtype)
        for name, value in inputs.items()
        if value is not None
    }
    names = [o.name for o in session.get_outputs()]
    results = dict(zip(names, session.run(names, feeds)))
    for name in bfloat16_outputs:
        results[name] = results[name].astype(_BFLOAT16)
    return results


def run_model(model: onnx.ModelProto, inputs: Mapping[str, Optional[np.ndarray]], backend: str, threads=None) -> dict:
    """Runs ``model`` on the onnxruntime ``backend`` ("cpp", "python" or "functions").

    bfloat16 inputs and outputs work on every supported onnxruntime (see
    :func:`_bfloat16_via_float`); with bfloat16 inputs, output types the model leaves
    open are inferred first.
    """
    bfloat16_inputs = any(value is not None and value.dtype == _BFLOAT16 for value in inputs.values())
    if bfloat16_inputs and any(not o.type.tensor_type.elem_type for o in model.graph.output):
        inferred = {o.name: o.type for o in onnx.shape_inference.infer_shapes(model).graph.output}
        model = copy.deepcopy(model)
        for output in model.graph.output:
            if not output.type.tensor_type.elem_type and output.name in inferred:
                output.type.CopyFrom(inferred[output.name])
    bfloat16_outputs = [o.name for o in model.graph.output if o.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16]
    if bfloat16_inputs or bfloat16_outputs:
        model = _bfloat16_via_float(model)
    return run_session(make_session(model, backend, threads), inputs, bfloat16_outputs)


def run(
    backend: str,
    op_type: str,
    inputs: Mapping[str, Optional[np.ndarray]],
    outputs: Optional[Sequence[str]] = None,
    attributes: Optional[Mapping[str, int]] = None,
    threads: Optional[int] = None,
    static_shapes: bool = True,
) -> dict:
    """Runs one normgrad node on ``backend``; returns the named outputs by name."""
    module = operator(op_type)
    if backend == "reference":
        args = {name: inputs.get(name) for name in module.INPUTS}
        result = module.reference(**args, **dict(attributes or {}))
        wanted = module.OUTPUTS if outputs is None else outputs
        return {name: value for name, value in zip(module.OUTPUTS, result) if name in wanted}
    model = node_model(op_type, inputs, outputs, attributes, static_shapes)
    if backend == "evaluator":
        from onnx.reference import ReferenceEvaluator

        evaluator = ReferenceEvaluator(api.add_functions(model))
        feeds = {name: value for name, value in inputs.items() if value is not None}
        names = [o.name for o in model.graph.output]
        return dict(zip(names, evaluator.run(None, feeds)))
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    return run_model(model, inputs, backend, threads)


def run_in_place(op_type: str, inputs: Mapping[str, Optional[np.ndarray]], over: Mapping[str, str],
                 backend: str = "cpp", threads: Optional[int] = None) -> dict:
    """Runs one normgrad node with each output of ``over`` ({output: input}) bound to its
    input's own buffer (as the trainer updates state in place); returns every input's
    buffer after the run, by name."""
    import onnxruntime

    session = make_session(node_model(op_type, inputs), backend, threads)
    binding = session.io_binding()
    buffers = {name: onnxruntime.OrtValue.ortvalue_from_numpy(np.array(value, copy=True))
               for name, value in inputs.items() if value is not None}
    for name, value in buffers.items():
        binding.bind_ortvalue_input(name, value)
    for output, name in over.items():
        binding.bind_ortvalue_output(output, buffers[name])
    session.run_with_iobinding(binding)
    return {name: value.numpy().copy() for name, value in buffers.items()}  # the OrtValues die here
