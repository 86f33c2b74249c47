"""The interoperability corpus (graphs/corpus) as test cases: its manifest, a case's model, feeds and
float64-reference outputs, and the per-dtype closeness check of a runtime's outputs against them."""

from __future__ import annotations

import json
import pathlib

import onnx
import onnx.numpy_helper as onh

from normgrad.tools import corpus as corpus_tool


CORPUS = pathlib.Path(__file__).resolve().parents[1] / "graphs" / "corpus"
MANIFEST = json.loads((CORPUS / "manifest.json").read_text()) if (CORPUS / "manifest.json").is_file() else {}
CASES = sorted(MANIFEST)

# Largest error relative to max(1, max |expected|), by kind and dtype (normgrad.tools.corpus).
TOLERANCE = corpus_tool.TOLERANCE


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


def assert_matches(actual: dict, expected: dict, tolerance: float, what: str) -> None:
    assert list(actual) == list(expected), f"{what}: outputs {list(actual)} != {list(expected)}"
    failures = [f"{name}: {difference}" for name, want in expected.items()
                if (difference := corpus_tool.tensor_difference(actual[name], want, tolerance)) is not None]
    assert not failures, f"{what}:\n" + "\n".join(failures)
