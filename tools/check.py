"""``normgrad check TRAIN.onnx``: every gradient of a training graph against float64
central finite differences of its forward part.

The training graph runs in onnxruntime as written (function bodies, or a kernel backend).
Its forward part (the nodes the forward outputs and the loss need) is copied with every
float tensor turned into float64 and evaluated by ``onnx.reference.ReferenceEvaluator``. The scalar
differentiated is the loss, or sum(y * y_grad) over the seeded outputs. Each gradient g
of a value x is compared along random directions v: <g, v> against
(f(x + h v) - f(x - h v)) / 2h.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.graphs.builder import METADATA_GRADIENTS, METADATA_LOSS, METADATA_SEEDS
from normgrad.graphs.structure import subgraph_captures

__all__ = ["GradientCheck", "random_feeds", "forward_function", "check_gradients", "check_metadata", "main"]

_FLOAT = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


@dataclasses.dataclass
class GradientCheck:
    """The comparison for one gradient output.

    Attributes:
        gradient: the gradient output's name.
        wrt: the input or initializer it is the gradient of.
        analytic: <g, v> per direction.
        numeric: the central differences per direction.
        error: max over directions of |analytic - numeric| / scale, with scale the largest
            of |numeric|, |g| (the typical size of <g, v> for a standard normal v) and
            1e-3 times the largest |g| of all gradients (so that a gradient that is zero
            in exact arithmetic, such as a conv bias before BatchNorm, is not judged on
            float32 round-off alone).
    """

    gradient: str
    wrt: str
    analytic: List[float]
    numeric: List[float]
    error: float


def _metadata(model: onnx.ModelProto, key: str):
    for prop in model.metadata_props:
        if prop.key == key:
            try:
                return json.loads(prop.value)
            except ValueError as error:
                raise ValueError(f"metadata {key} is not valid JSON ({error})") from None
    raise ValueError(f"{key} missing from the model's metadata: not a training graph written by normgrad")


def check_metadata(model: onnx.ModelProto) -> None:
    """Checks that the training-graph metadata names values the graph has.

    Raises:
        ValueError: a key is missing, is not JSON of the right shape, or names a graph
            input or output that does not exist (the message names key and value).
    """
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    seeds, gradients, loss = (_metadata(model, key) for key in (METADATA_SEEDS, METADATA_GRADIENTS, METADATA_LOSS))
    for key, value in ((METADATA_SEEDS, seeds), (METADATA_GRADIENTS, gradients)):
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ValueError(f"metadata {key} must be a JSON object of names; got {value!r}")
    if loss is not None and not (isinstance(loss, dict) and isinstance(loss.get("output"), str)):
        raise ValueError(f"metadata {METADATA_LOSS} must be null or an object with an 'output' name; got {loss!r}")
    named = [(METADATA_GRADIENTS, g, "output", outputs) for g in gradients]
    named += [(METADATA_GRADIENTS, w, "input", inputs) for w in gradients.values()]
    named += [(METADATA_SEEDS, y, "output", outputs) for y in seeds]
    named += [(METADATA_SEEDS, seed, "input", inputs) for seed in seeds.values()]
    if loss is not None:
        named += [(METADATA_LOSS, loss["output"], "output", outputs), (METADATA_LOSS, "loss", "output", outputs)]
    for key, name, kind, names in named:
        if name not in names:
            raise ValueError(f"metadata {key} names '{name}', which is not a graph {kind} of the model")


def _dims(info: onnx.ValueInfoProto, symbols: Dict[str, int], default: int) -> List[int]:
    dims = []
    for d in info.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        else:
            dims.append(symbols.setdefault(d.dim_param or f"?{len(symbols)}", default))
    return dims


def random_feeds(model: onnx.ModelProto, seed: int = 0, batch: int = 2) -> Dict[str, np.ndarray]:
    """Random values for every input of training graph ``model``.

    Trainable initializers get their stored values; float inputs standard normal values;
    ``labels`` of a cross-entropy loss class indices within the output's axis 1. Symbolic
    dims become ``batch``, but a seed gradient gets the shape its output has at run time.
    """
    rng = np.random.default_rng(seed)
    initializers = {t.name: onh.to_array(t) for t in model.graph.initializer}
    loss = _metadata(model, METADATA_LOSS)
    symbols: Dict[str, int] = {}
    feeds: Dict[str, np.ndarray] = {}
    for info in model.graph.input:
        if info.name in initializers:
            feeds[info.name] = initializers[info.name]
            continue
        elem_type = info.type.tensor_type.elem_type
        dtype = oh.tensor_dtype_to_np_dtype(elem_type)
        dims = _dims(info, symbols, batch)
        if elem_type in _FLOAT:
            feeds[info.name] = rng.standard_normal(dims).astype(dtype)
        else:
            feeds[info.name] = np.zeros(dims, dtype)
    seeds = _metadata(model, METADATA_SEEDS)
    static = {i.name for i in model.graph.input if all(d.HasField("dim_value") for d in i.type.tensor_type.shape.dim)}
    unknown = {output: seed for output, seed in seeds.items() if seed not in static}
    if unknown:
        for output, shape in _output_shapes(model, list(unknown), feeds).items():
            feeds[unknown[output]] = rng.standard_normal(shape).astype(feeds[unknown[output]].dtype)
    if loss and loss["kind"] == "cross_entropy":
        classes = _output_shapes(model, [loss["output"]], feeds)[loss["output"]][1]
        feeds["labels"] = rng.integers(0, classes, feeds["labels"].shape).astype(np.int64)
    return feeds


def _output_shapes(model: onnx.ModelProto, outputs: Sequence[str], feeds: Dict[str, np.ndarray]) -> Dict[str, tuple]:
    """The run-time shapes of forward ``outputs``, from onnxruntime running the forward part."""
    import onnxruntime

    forward = _forward_model(model, outputs, double=False)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(forward.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = {i.name for i in forward.graph.input}
    values = session.run(list(outputs), {k: v for k, v in feeds.items() if k in names})
    return {name: value.shape for name, value in zip(outputs, values)}


def _to_double(graph: onnx.GraphProto) -> None:
    """Turns every float tensor of ``graph`` (inputs, outputs, initializers, constants, Cast targets) into float64."""
    for info in list(graph.input) + list(graph.output):
        if info.type.tensor_type.elem_type in _FLOAT:
            info.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    del graph.value_info[:]
    for index, init in enumerate(graph.initializer):
        if init.data_type in _FLOAT:
            graph.initializer[index].CopyFrom(onh.from_array(onh.to_array(init).astype(np.float64), init.name))
    for node in graph.node:
        if node.op_type == "GroupNormalization" and not any(a.name == "stash_type" for a in node.attribute):
            node.attribute.append(oh.make_attribute("stash_type", onnx.TensorProto.DOUBLE))
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in _FLOAT:
                attr.t.CopyFrom(onh.from_array(onh.to_array(attr.t).astype(np.float64), attr.t.name))
            elif attr.name in ("to", "dtype", "stash_type") and attr.type == onnx.AttributeProto.INT and attr.i in _FLOAT:
                # onnx's reference Layer/RMSNormalization compute in X's type but refuse a stash_type other than 1
                if not (node.op_type in ("LayerNormalization", "RMSNormalization") and attr.name == "stash_type"):
                    attr.i = onnx.TensorProto.DOUBLE
            elif attr.name == "value_float" and node.op_type == "Constant":
                value = attr.f
                attr.Clear()
                attr.CopyFrom(oh.make_attribute("value", onh.from_array(np.asarray(value, np.float64))))


def _forward_model(model: onnx.ModelProto, outputs: Sequence[str], double: bool = True) -> onnx.ModelProto:
    """The nodes of ``model`` that ``outputs`` need, in float64 (``double``) or as written."""
    needed = set(outputs)
    nodes = []
    for node in reversed(model.graph.node):
        if any(name in needed for name in node.output):
            nodes.append(node)
            needed.update(list(node.input) + subgraph_captures(node))
    nodes.reverse()
    by_name = {o.name: o for o in model.graph.output}
    output_infos = [by_name.get(name) or oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in outputs]
    graph = oh.make_graph(
        nodes,
        "forward",
        [i for i in model.graph.input if i.name in needed],
        output_infos,
        initializer=[t for t in model.graph.initializer if t.name in needed],
    )
    if double:
        _to_double(graph)
    forward = oh.make_model(graph, opset_imports=[o for o in model.opset_import if o.domain in ("", "ai.onnx")])
    forward.ir_version = model.ir_version
    return forward


def forward_function(model: onnx.ModelProto) -> Callable[[Dict[str, np.ndarray]], float]:
    """The scalar the training graph differentiates, evaluated in float64.

    Returns:
        ``f(feeds) -> float``: the loss, or the sum over seeded outputs of sum(y * y_grad).
    """
    seeds = _metadata(model, METADATA_SEEDS)
    loss = _metadata(model, METADATA_LOSS)
    outputs = ["loss"] if loss else list(seeds)
    forward = _forward_model(model, outputs)
    run = _runner(forward)
    names = {i.name for i in forward.graph.input}

    def f(feeds: Dict[str, np.ndarray]) -> float:
        doubles = {
            k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items() if k in names
        }
        values = run(doubles)
        if loss:
            return float(values[0])
        return float(sum(np.sum(y * feeds[seeds[name]].astype(np.float64)) for name, y in zip(outputs, values)))

    return f


def _runner(model: onnx.ModelProto) -> Callable[[Dict[str, np.ndarray]], list]:
    """``onnx.reference.ReferenceEvaluator`` (exact float64 NumPy), or onnxruntime where the
    evaluator cannot run the model (onnxruntime's float64 kernels of some ops, e.g. Erf,
    are float32-accurate, too coarse for finite differences)."""
    from onnx.reference import ReferenceEvaluator

    try:
        evaluator = ReferenceEvaluator(model)
        return lambda feeds: evaluator.run(None, feeds)
    except Exception:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return lambda feeds: session.run(None, feeds)


def check_gradients(
    model: onnx.ModelProto,
    feeds: Optional[Dict[str, np.ndarray]] = None,
    session_options=None,
    directions: int = 3,
    step: float = 1e-6,
    seed: int = 0,
) -> List[GradientCheck]:
    """Compares every gradient output of training graph ``model`` with finite differences.

    Args:
        model: a training graph written by :func:`normgrad.graphs.build_training_graph`.
        feeds: the inputs; :func:`random_feeds` when None.
        session_options: onnxruntime ``SessionOptions`` for the training graph (e.g.
            ``normgrad.session_options("cpp")``); when None, plain options and the
            function bodies (attached with ``normgrad.add_functions`` if missing).
        directions: random directions per gradient.
        step: the central-difference step h along unit-RMS directions.
        seed: seeds the feeds and the directions.

    Returns:
        One :class:`GradientCheck` per gradient output, in output order.

    Raises:
        ValueError: the metadata is malformed (:func:`check_metadata`), or ``directions``
            or ``step`` is not positive.
    """
    if directions < 1 or not (np.isfinite(step) and step > 0):
        raise ValueError(f"directions must be >= 1 and step a finite number > 0; got {directions}, {step}")
    import onnxruntime

    import normgrad

    check_metadata(model)
    feeds = random_feeds(model, seed) if feeds is None else feeds
    if session_options is None:  # the function bodies, attached if the model lacks them
        model = normgrad.add_functions(model)
        session_options = onnxruntime.SessionOptions()
    session_options.log_severity_level = 3
    session = onnxruntime.InferenceSession(model.SerializeToString(), session_options, providers=["CPUExecutionProvider"])
    gradients = _metadata(model, METADATA_GRADIENTS)
    values = dict(zip(gradients, session.run(list(gradients), feeds)))
    f = forward_function(model)
    rng = np.random.default_rng(seed + 1)
    measured = []
    for grad_name, wrt in gradients.items():
        g = values[grad_name].astype(np.float64)
        analytic, numeric = [], []
        for _ in range(directions):
            v = rng.standard_normal(g.shape)
            plus, minus = dict(feeds), dict(feeds)
            base = feeds[wrt].astype(np.float64)
            plus[wrt], minus[wrt] = base + step * v, base - step * v
            numeric.append((f(plus) - f(minus)) / (2 * step))
            analytic.append(float(np.sum(g * v)))
        typical = float(np.linalg.norm(g))  # the size of <g, v> for a standard normal v
        measured.append((grad_name, wrt, analytic, numeric, typical))
    floor = 1e-3 * max([m[4] for m in measured] + [1e-30])
    checks = []
    for grad_name, wrt, analytic, numeric, typical in measured:
        errors = [abs(a - n) / max(abs(n), typical, floor) for a, n in zip(analytic, numeric)]
        checks.append(GradientCheck(grad_name, wrt, analytic, numeric, max(errors, default=0.0)))
    return checks


_ORT_ERRORS = ("Fail", "InvalidArgument", "InvalidGraph", "InvalidProtobuf", "NoSuchFile", "NotImplemented",
               "RuntimeException")
"""onnxruntime's exception classes for a model it cannot load or run."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``normgrad check``; returns the process exit code (1 if a gradient fails)."""
    from normgrad.tools.cli import ArgumentParser, CommandError, load_model, one_line, positive_float, positive_int

    parser = ArgumentParser(prog="normgrad check", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="training graph written by `normgrad export`")
    parser.add_argument("--backend", choices=("functions", "cpp", "python"), default="functions",
                        help="run normgrad ops through their function bodies (default) or a kernel library")
    parser.add_argument("--directions", type=positive_int, default=3, help="random directions per gradient (default 3)")
    parser.add_argument("--step", type=positive_float, default=1e-6, help="finite-difference step (default 1e-6)")
    parser.add_argument("--tolerance", type=positive_float, default=1e-3,
                        help="largest accepted relative error (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import onnxruntime.capi.onnxruntime_pybind11_state as ort_errors

    runtime_errors = tuple(getattr(ort_errors, name) for name in _ORT_ERRORS if hasattr(ort_errors, name))
    try:
        model = load_model(args.model)
        check_metadata(model)
        options = None
        if args.backend != "functions":
            import normgrad

            options = normgrad.session_options(args.backend)
        checks = check_gradients(model, session_options=options, directions=args.directions, step=args.step,
                                 seed=args.seed)
    except (CommandError, ValueError, KeyError, FileNotFoundError, onnx.checker.ValidationError) as error:
        print(f"normgrad check: {one_line(error)}", file=sys.stderr)
        return 1
    except runtime_errors as error:
        print(f"normgrad check: onnxruntime cannot run {args.model}: {one_line(error)}", file=sys.stderr)
        return 1
    failed = 0
    for check in checks:
        ok = check.error <= args.tolerance
        failed += not ok
        print(
            f"{'OK  ' if ok else 'FAIL'} {check.gradient:<40} rel.err {check.error:.2e}  "
            f"<g,v> {check.analytic[0]: .6e}  finite diff {check.numeric[0]: .6e}"
        )
    print(f"{len(checks) - failed}/{len(checks)} gradients within {args.tolerance:g}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
