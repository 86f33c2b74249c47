"""The interoperability corpus (graphs/corpus, written by ``normgrad corpus``) on every runtime path.

Paths, each against the stored float64-reference outputs with per-dtype tolerances:

* ``cpp``: onnxruntime with the C++ kernels (``normgrad.session_options("cpp")``); the
  kernels win over the function bodies the models carry.
* ``python``: onnxruntime with the Python kernels. float32 cases only; cases whose normgrad
  nodes omit an optional input or output are skipped (the onnxruntime-extensions bridge
  declares every input and output required and rejects such nodes at session creation).
* ``functions``: plain onnxruntime, nothing registered: it inlines the function bodies.
  ``*_inline`` cases (standard ops only) run here.
* ``evaluator``: ``onnx.reference.ReferenceEvaluator`` running the function bodies.

``*_inline`` cases have no normgrad node, so ``cpp``/``python`` would repeat ``functions``:
skipped. bfloat16 travels through onnxruntime's Python API as float32 with casts inside the
graph (``harness._bfloat16_via_float``; onnxruntime < 1.20 has no bfloat16 arrays).
"""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np
import onnx
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest

import normgrad
from normgrad.ops import harness
from normgrad.tools import corpus as corpus_tool

from conftest import cpp_available

CORPUS = pathlib.Path(__file__).resolve().parents[1] / "graphs" / "corpus"
MANIFEST = json.loads((CORPUS / "manifest.json").read_text()) if (CORPUS / "manifest.json").is_file() else {}
CASES = sorted(MANIFEST)
PATHS = ("cpp", "python", "functions", "evaluator")
_BF16 = np.dtype(ml_dtypes.bfloat16)

# Largest error relative to max(1, max |expected|), per dtype of the graph's data and kind.
# float32 training graphs chain several convolutions and normalizations: a little looser.
TOLERANCE = {
    ("node", "float32"): 2e-5,
    ("node", "float16"): 2e-3,
    ("node", "bfloat16"): 1.6e-2,
    ("training", "float32"): 1e-4,
}


def load_case(name: str):
    """(model, inputs {name: array} in graph order, expected {name: array} in graph order)."""
    folder = CORPUS / name
    model = onnx.load(str(folder / "model.onnx"))

    def tensors(prefix):
        files = sorted((folder / corpus_tool.DATA_SET).glob(f"{prefix}_*.pb"), key=lambda p: int(p.stem.split("_")[1]))
        result = {}
        for path in files:
            tensor = onnx.TensorProto()
            tensor.ParseFromString(path.read_bytes())
            result[tensor.name] = onh.to_array(tensor)
        return result

    return model, tensors("input"), tensors("output")


def _has_bfloat16(model: onnx.ModelProto) -> bool:
    values = list(model.graph.input) + list(model.graph.output)
    return any(v.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16 for v in values)


def run_onnxruntime(model: onnx.ModelProto, inputs: dict, options: ort.SessionOptions) -> dict:
    bfloat16_outputs = [o.name for o in model.graph.output if o.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16]
    if _has_bfloat16(model):
        model = harness._bfloat16_via_float(model)
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return harness.run_session(session, inputs, bfloat16_outputs)


def run_evaluator(model: onnx.ModelProto, inputs: dict) -> dict:
    from onnx.reference import ReferenceEvaluator

    evaluator = ReferenceEvaluator(model)
    names = [o.name for o in model.graph.output]
    return dict(zip(names, evaluator.run(names, inputs)))


def skip_reason(name: str, path: str):
    info = MANIFEST[name]
    if path == "cpp" and not cpp_available():
        return "C++ library not built"
    if path in ("cpp", "python") and info["inline"]:
        return "inline variant: no normgrad node, the run would repeat 'functions'"
    if path == "python" and info["dtype"] != "float32":
        return "Python kernels are float32 only"
    if path == "python" and info["omits_optional"]:
        return "Python-kernel bridge rejects nodes omitting optional inputs/outputs"
    return None


def run_path(path: str, model: onnx.ModelProto, inputs: dict) -> dict:
    if path == "evaluator":
        return run_evaluator(model, inputs)
    options = ort.SessionOptions()
    if path in ("cpp", "python"):
        normgrad.session_options(path, options)
    return run_onnxruntime(model, inputs, options)


def assert_matches(actual: dict, expected: dict, tolerance: float, what: str) -> None:
    assert list(actual) == list(expected), f"{what}: outputs {list(actual)} != {list(expected)}"
    failures = []
    for name, want in expected.items():
        got = np.asarray(actual[name])
        if got.shape != want.shape:
            failures.append(f"{name}: shape {got.shape} != {want.shape}")
            continue
        if want.size == 0:
            continue
        want64 = want.astype(np.float64)
        scale = max(1.0, float(np.abs(want64).max()))
        error = float(np.abs(got.astype(np.float64) - want64).max())
        if not error <= tolerance * scale:
            failures.append(f"{name}: max error {error:.3g} at scale {scale:.3g} (tolerance {tolerance:g})")
    assert not failures, f"{what}:\n" + "\n".join(failures)


def test_corpus_present():
    assert CASES, f"no corpus in {CORPUS}: run `normgrad corpus`"
    kinds = {(MANIFEST[c]["kind"], MANIFEST[c]["dtype"]) for c in CASES}
    assert kinds == set(TOLERANCE)
    for name in CASES:
        assert (CORPUS / name / "model.onnx").stat().st_size < 1 << 20


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", CASES)
def test_corpus_case(name, path):
    reason = skip_reason(name, path)
    if reason:
        pytest.skip(reason)
    model, inputs, expected = load_case(name)
    info = MANIFEST[name]
    actual = run_path(path, model, inputs)
    if path != "evaluator":
        for output in model.graph.output:  # onnxruntime returns the declared dtypes
            assert actual[output.name].dtype == expected[output.name].dtype, output.name
    assert_matches(actual, expected, TOLERANCE[(info["kind"], info["dtype"])], f"{name} on {path}")


def test_corpus_models_are_valid():
    for name in CASES:
        model = onnx.load(str(CORPUS / name / "model.onnx"))
        assert model.ir_version == 10, name
        onnx.checker.check_model(model, full_check=True)
        has_ops = any(n.domain == normgrad.DOMAIN for n in model.graph.node)
        assert has_ops != MANIFEST[name]["inline"] or MANIFEST[name]["normgrad_ops"] == [], name


def test_training_cases_feed_weights_unlike_any_stored():
    """Every training case feeds weights that differ from every value a graph stores for
    them: the forward model's initializers (kept in the ``_stored_weights`` twin) and the
    case's own initializers. A runtime that uses a stored weight instead of the fed one fails."""
    training = [c for c in CASES if MANIFEST[c]["kind"] == "training"]
    assert training
    for name in training:
        model, inputs, _ = load_case(name)
        base = name.removesuffix("_stored_weights").removesuffix("_inline")
        twin, _, _ = load_case(base + "_stored_weights")
        stored = {t.name: onh.to_array(t) for t in list(twin.graph.initializer) + list(model.graph.initializer)}
        weights = [k for k in inputs if k in {t.name for t in twin.graph.initializer}]
        assert weights, f"{name}: no weight input"
        for key in weights:
            assert stored[key].shape == inputs[key].shape
            assert not np.any(stored[key] == inputs[key]), f"{name}: fed {key} equals a stored value somewhere"
        as_initializers = {i.name for i in model.graph.input} & {t.name for t in model.graph.initializer}
        assert bool(as_initializers) == name.endswith("_stored_weights"), (name, sorted(as_initializers))


def _values_match(path: str, committed: bytes, fresh: bytes) -> bool:
    """Same tensor name, dtype and shape, values within 1 unit in the last place (the
    float64 reference can round differently on a CPU with other SIMD math routines)."""
    a, b = onnx.TensorProto(), onnx.TensorProto()
    a.ParseFromString(committed)
    b.ParseFromString(fresh)
    x, y = onh.to_array(a), onh.to_array(b)
    if a.name != b.name or x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.dtype.kind != "f" and x.dtype != _BF16:
        return bool(np.array_equal(x, y))
    bits = {2: np.int16, 4: np.int32, 8: np.int64}[x.dtype.itemsize]
    ix, iy = x.view(bits).astype(np.int64), y.view(bits).astype(np.int64)
    sign = np.int64(1) << (8 * x.dtype.itemsize - 1)
    ix = np.where(ix < 0, -(ix + sign), ix)  # sign-magnitude -> ordered integers
    iy = np.where(iy < 0, -(iy + sign), iy)
    return bool(np.all(np.abs(ix - iy) <= 1))


def test_corpus_is_current(tmp_path):
    """The committed corpus is what the generator writes: models, manifest and README byte
    for byte, tensors byte for byte or (on another CPU) within 1 ulp."""
    fresh = corpus_tool.generate()
    corpus_tool.write(tmp_path, fresh)
    problems = corpus_tool.compare(CORPUS, fresh)
    real = []
    for problem in problems:
        kind, path = problem.split(": ", 1)
        if kind == "differs" and path.endswith(".pb") and _values_match(path, (CORPUS / path).read_bytes(), fresh[path]):
            continue
        real.append(problem)
    assert not real, "graphs/corpus is stale; regenerate with `normgrad corpus`:\n" + "\n".join(real)
    assert not corpus_tool.compare(tmp_path, fresh)
    again = corpus_tool.generate()
    assert again == fresh, "the generator is not deterministic"
