"""Running models on another execution provider (OpenVINO) and reading where their nodes ran.

``onnxruntime-openvino`` replaces ``onnxruntime``, so these helpers only do anything in a
venv that has it (``.ci/run`` builds one); elsewhere :data:`OPENVINO` is False and the tests
using them skip.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Dict, List, Optional, Tuple

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import pytest

OPENVINO_PROVIDER = "OpenVINOExecutionProvider"
OPENVINO = OPENVINO_PROVIDER in ort.get_available_providers()
if os.environ.get("NORMGRAD_REQUIRE_OPENVINO") and not OPENVINO:
    raise RuntimeError(
        f"NORMGRAD_REQUIRE_OPENVINO is set but onnxruntime {ort.__version__} offers only {ort.get_available_providers()}"
    )
OPENVINO_CPU = [(OPENVINO_PROVIDER, {"device_type": "CPU"}), "CPUExecutionProvider"]
CPU = ["CPUExecutionProvider"]

requires_openvino = pytest.mark.skipif(
    not OPENVINO, reason="onnxruntime-openvino is not installed (its own venv: see docs/explanation/openvino.md)"
)


def session(model: onnx.ModelProto, providers, profile: bool = False) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(tempfile.mkdtemp(prefix="normgrad-profile-"), "run")
    return ort.InferenceSession(model.SerializeToString(), options, providers=providers)


def _declared(model: onnx.ModelProto, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The feeds the model declares as inputs (initializer-backed ones included)."""
    declared = {i.name for i in model.graph.input}
    return {k: v for k, v in feeds.items() if k in declared}


def run(model: onnx.ModelProto, feeds: Dict[str, np.ndarray], providers) -> Dict[str, np.ndarray]:
    """Every output by name; only the inputs the model declares are fed."""
    s = session(model, providers)
    names = [o.name for o in s.get_outputs()]
    return dict(zip(names, s.run(None, _declared(model, feeds))))


def counted_nodes(model: onnx.ModelProto) -> int:
    """The nodes of ``model`` with its local functions inlined, Constant nodes not counted."""
    inlined = onnx.inliner.inline_local_functions(model) if model.functions else model
    return sum(1 for node in inlined.graph.node if node.op_type != "Constant")


def nodes_on_cpu(profiled: ort.InferenceSession) -> List[Tuple[str, str]]:
    """[(op type, node name)] of every node the CPU provider ran in a session made with
    ``session(..., profile=True)`` and run at least once, read from its profile: each node
    event names the provider that ran it (an OpenVINO subgraph is one event). Ends the
    profiling."""
    path = profiled.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    os.rmdir(os.path.dirname(path))
    on_cpu = set()
    for event in events:
        args = event.get("args", {})
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and args.get("provider") == "CPUExecutionProvider":
            on_cpu.add((args["op_name"], event["name"][: -len("_kernel_time")]))
    return sorted(on_cpu)


def run_profiled(
    model: onnx.ModelProto, feeds: Dict[str, np.ndarray], providers
) -> Tuple[Dict[str, np.ndarray], List[Tuple[str, str]]]:
    """(outputs, :func:`nodes_on_cpu`)."""
    s = session(model, providers, profile=True)
    names = [o.name for o in s.get_outputs()]
    outputs = dict(zip(names, s.run(None, _declared(model, feeds))))
    return outputs, nodes_on_cpu(s)


def max_relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max(1, max |expected|), in float64."""
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.abs(expected).max())) if expected.size else 1.0
    return float(np.abs(np.asarray(actual, np.float64) - expected).max() / scale) if expected.size else 0.0


def first_line(error: BaseException, limit: Optional[int] = 300) -> str:
    """The most telling line of an onnxruntime/OpenVINO error (they run to pages)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    telling = [line for line in lines if "not supported" in line or "mismatch" in line or "Unexpected" in line]
    text = (telling or lines or [type(error).__name__])[0]
    return text.split("[OpenVINO-EP]")[-1].strip()[:limit]
