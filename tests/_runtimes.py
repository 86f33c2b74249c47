"""ONNX runtimes other than onnxruntime, behind one call: ``run(runtime, model, feeds)``.

* ``evaluator``: ``onnx.reference.ReferenceEvaluator`` (always there).
* ``openvino``: OpenVINO's own runtime (pip ``openvino``: ``Core().read_model``, device CPU,
  ``INFERENCE_PRECISION_HINT`` f32: on a CPU with bfloat16 instructions the default is
  bfloat16, which gave 2e-3..7e-3 relative errors on the training cases); its own venv in
  ``.ci/run``. ``NORMGRAD_REQUIRE_OPENVINO_RUNTIME=1`` makes a missing package an error.
* ``tract``: Sonos' tract (pip ``tract``). ``NORMGRAD_REQUIRE_TRACT=1`` likewise.
* ``openvino-ep``: onnxruntime-openvino's OpenVINOExecutionProvider, device CPU (its own venv;
  ``tests/test_openvino.py`` runs the corpus there, these tests only the training loops).

:func:`lacks` names, before running, what a runtime lacks to run a model (or None): the
tests expect such a model to fail there (an explicit xfail naming it) and fail if it runs.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import tempfile
from typing import Dict, Optional

import ml_dtypes
import numpy as np
import onnx
import pytest

from normgrad.graphs.inline import shared_scan_outputs

RUNTIMES = ("evaluator", "openvino", "tract", "openvino-ep")
_PACKAGES = {"evaluator": "onnx", "openvino": "openvino", "tract": "tract", "openvino-ep": "onnxruntime"}
_REQUIRED = {"openvino": "NORMGRAD_REQUIRE_OPENVINO_RUNTIME", "tract": "NORMGRAD_REQUIRE_TRACT"}
_BF16 = np.dtype(ml_dtypes.bfloat16)




SEEDED_DROPOUT_TRACT = ("graphs with the seeded Dropout mask generator: tract 0.23.9's into_model did not finish "
                        "in 4 minutes on the transformer step graph (not run)")


def available(runtime: str) -> bool:
    if runtime == "openvino-ep":  # tests/_providers.py checks NORMGRAD_REQUIRE_OPENVINO
        import onnxruntime

        return "OpenVINOExecutionProvider" in onnxruntime.get_available_providers()
    present = importlib.util.find_spec(_PACKAGES[runtime]) is not None
    variable = _REQUIRED.get(runtime)
    if variable and os.environ.get(variable) and not present:
        raise RuntimeError(f"{variable} is set but the package {_PACKAGES[runtime]!r} is not installed")
    return present


def requires(runtime: str):
    return pytest.mark.skipif(not available(runtime), reason=f"{_PACKAGES[runtime]} is not installed "
                                                              "(.ci/run installs it; see docs/reference/runtimes.md)")


def _elem_types(model: onnx.ModelProto):
    values = list(model.graph.input) + list(model.graph.output)
    return {v.type.tensor_type.elem_type for v in values}


def lacks(runtime: str, model: onnx.ModelProto) -> Optional[str]:
    """What ``runtime`` lacks to run ``model``, measured (docs/reference/runtimes.md), or None."""
    if runtime in ("openvino", "openvino-ep") and any(_reads_outer_scope(n) for n in model.graph.node
                                                      if n.op_type == "Scan"):
        return "Scan bodies that read outer-scope values (OpenVINO: 'Number of Scan node inputs ... is less than " \
               "required'; the EP: 'node not found in graph cache'): export with --inline or --portable"
    if runtime == "openvino-ep" and any(n.op_type == "LayerNormalization" and any(n.output[1:]) for n in model.graph.node):
        return "LayerNormalization with its Mean/InvStdDev outputs read ('expects 1 output tensor'; --portable computes them beside it)"
    if runtime == "evaluator" and any(n.op_type in ("GRU", "RNN") and len(n.input) > 4 and n.input[4]
                                      for n in model.graph.node):
        return "GRU and RNN nodes with sequence_lens (it ignores sequence_lens: wrong values)"
    if runtime == "openvino-ep" and training_dropout(model):
        return TRAINING_DROPOUT
    if runtime == "openvino-ep" and _runtime_axes_grad_graph(model):
        return RUNTIME_AXES_EP
    if runtime == "openvino-ep" and _clipping_if(model) and any(n.op_type == "EmbeddingGrad" for n in model.graph.node):
        return CLIPPING_IF_EMBEDDING_EP
    if runtime in ("evaluator", "openvino-ep"):  # the EP gets the graph with functions inlined by onnxruntime
        return None
    if runtime == "openvino" and _inputs_also_initializers(model):
        return "graph inputs that are also initializers (read as constants: the model has fewer inputs, cannot be fed)"
    if runtime == "tract" and _inputs_also_initializers(model):
        return "graph inputs that are also initializers (tract 0.23.9 aborts the process: not run)"
    if model.functions:
        ops = sorted({f"{f.domain}:{f.name}" for f in model.functions})
        return f"model-local functions ({', '.join(ops)}): export with --inline"
    if runtime in ("openvino", "tract") and training_dropout(model):
        return TRAINING_DROPOUT
    if runtime == "openvino" and onnx.TensorProto.BFLOAT16 in _elem_types(model):
        return "bfloat16 graph inputs and outputs (come back as float16, wrong values)"
    if runtime == "tract":
        if _seeded(model):
            return SEEDED_DROPOUT_TRACT
        if {onnx.TensorProto.BFLOAT16} & _elem_types(model):
            return "bfloat16 tensors"
        constants = {t.name for t in model.graph.initializer} | {n.output[0] for n in model.graph.node
                                                                  if n.op_type == "Constant"}
        for node in model.graph.node:
            if node.op_type == "BatchNormalization" and any(name not in constants for name in node.input[1:5]):
                return "BatchNormalization fed computed batch statistics ('Params are not const')"
        return _tract_recurrent_lacks(model.graph.node, constants)
    return None


def _tract_recurrent_lacks(nodes, constants) -> Optional[str]:
    """What tract lacks for a recurrent graph: every one that applies, joined by
    :data:`normgrad.tools.runtime_table.AND` (which one it meets first varies: shape inference
    or the translation after it)."""
    recurrent = [n for n in nodes if n.op_type in ("GRU", "RNN")]
    reasons = []
    if any(len(n.input) > 4 and n.input[4] and n.input[4] not in constants for n in recurrent):
        reasons.append("GRU and RNN nodes with sequence_lens computed or fed ('Non constant seq_len is not supported')")
    if any(n.op_type == "Scan" and shared_scan_outputs(n) for n in nodes):
        reasons.append("Scan bodies whose per-step outputs are also read in the body (it reshapes them to [1, ...] for "
                       "every reader: 'Impossible to unify'): export with --inline")
    if any(n.op_type == "ReverseSequence" for n in nodes):
        reasons.append("ReverseSequence (the reverse direction of a recurrent node with sequence_lens)")
    if any(onnx.helper.get_attribute_value(a) == b"reverse" for n in recurrent for a in n.attribute if a.name == "direction"):
        reasons.append("GRU and RNN nodes of direction reverse (its kernels give another Y: wrong values)")
    from normgrad.tools.runtime_table import AND

    return AND.join(reasons) or None


TRAINING_DROPOUT = ("onnxruntime's training-mode Dropout (OpenVINO and the EP: 'Training mode is not supported for "
                    "Dropout op'; tract: 'Dropout in training mode with a non-zero ratio is not supported'), which a "
                    "grad-only graph keeps but with --portable: export with --portable (--inline --portable)")


CLIPPING_IF_EMBEDDING_EP = ("a step graph whose clipping-norm If reads an EmbeddingGrad's gradient ('the graph is not "
                            "acyclic': its partitioning after onnxruntime removes an Identity; measured on torch's "
                            "EmbeddingBag + Embedding classifier): export with --inline or --portable")


def _clipping_if(model: onnx.ModelProto) -> bool:
    """The step graph's If that computes the clipping norm only when max_grad_norm is finite."""
    return any(n.op_type == "If" and any(a.g.name == "clip_grad_norm" for a in n.attribute
                                         if a.type == onnx.AttributeProto.GRAPH) for n in model.graph.node)


RUNTIME_AXES_EP = ("a grad-only graph wholly in standard ops with a broadcast gradient summed over axes computed at run "
                   "time ('Output names mismatch between OpenVINO and ONNX'; torch's EmbeddingBag + Embedding "
                   "classifier: the bag output's batch size is unknown to shape inference)")


def _runtime_axes_grad_graph(model: onnx.ModelProto) -> bool:
    """A grad-only graph (no ``lr`` input) without normgrad nodes whose ReduceSum axes come
    from a NonZero (``GradientContext.sum_to_runtime``): the EP fails it, measured."""
    producers = {o: n for n in model.graph.node for o in n.output}
    if "lr" in {i.name for i in model.graph.input} or any(n.domain == "normgrad" for n in model.graph.node):
        return False
    for node in model.graph.node:
        axes = producers.get(node.input[1]) if node.op_type == "ReduceSum" and len(node.input) > 1 else None
        if axes is not None and axes.op_type == "Reshape" and getattr(producers.get(axes.input[0]), "op_type", "") == "NonZero":
            return True
    return False


def training_dropout(model: onnx.ModelProto) -> bool:
    """Whether ``model`` has a Dropout node given a training_mode (a grad-only graph's, not
    seeded: it draws the runtime's own random mask)."""
    return any(n.op_type == "Dropout" and len(n.input) > 2 and n.input[2] for n in model.graph.node)


def _reads_outer_scope(scan: onnx.NodeProto) -> bool:
    body = next(a.g for a in scan.attribute if a.name == "body")
    produced = {i.name for i in body.input} | {o for n in body.node for o in n.output}
    return any(i and i not in produced for n in body.node for i in n.input)


def _seeded(model: onnx.ModelProto) -> bool:
    return any(i.name == "dropout_seed" for i in model.graph.input)


def _inputs_also_initializers(model: onnx.ModelProto) -> bool:
    return bool({i.name for i in model.graph.input} & {t.name for t in model.graph.initializer})


def _evaluator(model: onnx.ModelProto, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    names = [o.name for o in model.graph.output]
    return dict(zip(names, ReferenceEvaluator(model).run(names, feeds)))


def _openvino(model: onnx.ModelProto, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    import openvino

    core = openvino.Core()
    with tempfile.TemporaryDirectory(prefix="normgrad-openvino-") as folder:
        path = pathlib.Path(folder) / "model.onnx"
        onnx.save(model, str(path))
        compiled = core.compile_model(core.read_model(str(path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    inputs = [feeds[i.name] for i in model.graph.input]
    result = compiled(inputs)
    return {o.name: np.asarray(result[compiled.outputs[k]]) for k, o in enumerate(model.graph.output)}


_TRACT_TYPES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.float64): "f64",
                np.dtype(np.int64): "i64", np.dtype(np.int32): "i32", np.dtype(np.bool_): "bool"}


def _tract(model: onnx.ModelProto, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    import tract

    if _inputs_also_initializers(model):  # measured: a Rust panic that aborts the whole process
        raise RuntimeError("not run: tract aborts the process on a graph input that is also an initializer")
    if _seeded(model):  # measured: its model analysis runs for minutes (a hang guard would be the test's only result)
        raise RuntimeError(f"not run: {SEEDED_DROPOUT_TRACT}")
    with tempfile.TemporaryDirectory(prefix="normgrad-tract-") as folder:
        path = pathlib.Path(folder) / "model.onnx"
        onnx.save(model, str(path))
        loaded = tract.onnx().load(str(path))
    inputs = [feeds[i.name] for i in model.graph.input]
    for k, value in enumerate(inputs):
        loaded.set_input_fact(k, ",".join([str(d) for d in value.shape] + [_TRACT_TYPES[value.dtype]]))
    outputs = loaded.into_model().into_runnable().run(inputs)
    return {o.name: outputs[k].to_numpy() for k, o in enumerate(model.graph.output)}


def _openvino_ep(model: onnx.ModelProto, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    from _providers import OPENVINO_CPU
    from _providers import run as run_on

    return run_on(model, feeds, OPENVINO_CPU)


def run(runtime: str, model: onnx.ModelProto, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Every output of ``model`` run by ``runtime`` on ``feeds`` (every graph input, by name)."""
    return {"evaluator": _evaluator, "openvino": _openvino, "tract": _tract,
            "openvino-ep": _openvino_ep}[runtime](model, feeds)


def record(runtime: str, row: str, outcome: str) -> None:
    """Checks ``outcome`` against the one recorded in graphs/runtime_support.json: a row
    not recorded, or recorded otherwise, fails (the table would not say what was measured);
    records it instead with NORMGRAD_RECORD_RUNTIMES=1."""
    from normgrad.tools import runtime_table

    results = runtime_table.load_results()
    if runtime_table.recording():
        results.setdefault(runtime, {})[row] = outcome
        runtime_table.save_results(results)
        return
    recorded = results.get(runtime, {}).get(row)
    again = "record with NORMGRAD_RECORD_RUNTIMES=1 and run python -m normgrad.tools.runtime_table docs/reference/runtimes.md"
    assert recorded is not None, f"{runtime}, {row}: not in graphs/runtime_support.json ({again})"
    assert outcome == recorded, f"{runtime}, {row}: recorded {recorded!r}, now {outcome!r} ({again})"
