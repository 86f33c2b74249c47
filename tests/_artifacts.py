"""Helpers of the tests of artifact sets (a model and its data file, export's step graph, eval
graph and checkpoint, the Trainer's writers): a two-layer model's float64 forward, `normgrad
export` with SGD, and writers killed by SIGKILL at a chosen file operation."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from normgrad.util.external_data import uses_external_data
from normgrad.tools.export import main as export_main

from _graph_models import two_layer_model

RNG = np.random.default_rng(30)
X = RNG.standard_normal((4, 32)).astype(np.float32)
LABELS = RNG.standard_normal((4, 8)).astype(np.float32)


def two_layer_reference(model: onnx.ModelProto, folder=None) -> np.ndarray:
    """float64 NumPy forward of a two_layer_model (its weights read from ``folder``)."""
    weights = {t.name: numpy_helper.to_array(t, folder or "").astype(np.float64) for t in model.graph.initializer}
    return np.maximum(X.astype(np.float64) @ weights["w1"], 0) @ weights["w2"]


def run_two_layer(path) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["y"], {"x": X})[0]


def export_sgd(source, output, *options) -> int:
    return export_main([str(source), "-o", str(output), "--loss", "mse", "--optimizer", "sgd", *options])


def frozen_base_step(folder):
    """forward.onnx with its weights in forward.onnx.data, and step.onnx (w1 frozen) beside
    it, whose frozen base is that data file."""
    onnx.save(two_layer_model(), folder / "forward.onnx", save_as_external_data=True, location="forward.onnx.data",
              size_threshold=0)
    assert export_sgd(folder / "forward.onnx", folder / "step.onnx", "--freeze", "w1") == 0
    step = onnx.load(folder / "step.onnx", load_external_data=False)
    assert [t.name for t in step.graph.initializer if uses_external_data(t)] == ["w1"]
    return folder / "step.onnx", folder / "step.ckpt"


def killed_by_hook(script: str, *arguments) -> None:
    """Runs ``script`` (after the kill hook) in a subprocess and checks it died by SIGKILL."""
    process = subprocess.run([sys.executable, "-c", KILL_HOOK + textwrap.dedent(script), *map(str, arguments)],
                             capture_output=True, timeout=300)
    assert process.returncode == -signal.SIGKILL, process.stderr.decode()[-2000:]


def two_layer_model_named(names, shapes=((32, 32), (32, 8))) -> onnx.ModelProto:
    """two_layer_model with its weights named ``names``."""
    model = two_layer_model()
    renames = dict(zip(("w1", "w2"), names))
    for tensor in model.graph.initializer:
        tensor.name = renames[tensor.name]
    for node in model.graph.node:
        node.input[:] = [renames.get(name, name) for name in node.input]
    return model


KILL_HOOK = """
import os, signal, sys
KILL_EVENT, KILL_AT = sys.argv[1], int(sys.argv[2])
seen = [0]
def hook(event, arguments):
    if event == KILL_EVENT:
        seen[0] += 1
        if seen[0] == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
sys.addaudithook(hook)
"""
