"""normgrad.torch.export of a model with a frozen base in external data holds no second copy
of the base: the process's peak RSS during the export (the kernel's VmHWM, reset after the
model is built and the exporter has run once on a small module) grows by less than half the
weights' bytes W. Before the base was streamed from torch's tensors, the export held the ONNX
model with every weight in it (and tidy's shape inference copied it twice more): about 3 W
(TorchScript) to 5 W (dynamo) over the built model.

The exported model must still compute what the torch module does (onnxruntime against torch,
float32, 1e-5 of the output's scale), and its data file hold exactly the frozen weights.

The training-graph builder at scale: one copy of the caller's model, fresh names found in a
constant number of probes per node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from normgrad.graphs import build_training_graph, context as graph_context
from normgrad.ops import IR_VERSION

pytest.importorskip("torch")

# 12 Linear(2048, 2048) + Tanh layers, 201 MB of float32; all but the last layer frozen
SCRIPT = textwrap.dedent("""
    import json, os, sys, warnings
    warnings.simplefilter("ignore")
    import numpy as np
    import torch
    import normgrad.torch

    def status(key):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024

    exporter, folder = sys.argv[1], sys.argv[2]
    warm = os.path.join(folder, "warm")
    os.makedirs(warm)
    normgrad.torch.export(torch.nn.Linear(4, 4), (torch.ones(1, 4),), os.path.join(warm, "m.onnx"), exporter=exporter)
    torch.manual_seed(0)
    layers = []
    for _ in range(12):
        layers += [torch.nn.Linear(2048, 2048), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    for parameter in model[:-2].parameters():
        parameter.requires_grad_(False)
    frozen = sum(p.numel() * p.element_size() for p in model[:-2].parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(3, 2048, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x).numpy()
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")  # VmHWM := the current RSS
    baseline = status("VmRSS")
    normgrad.torch.export(model, (x,), os.path.join(folder, "forward.onnx"), exporter=exporter,
                          input_names=["x"], output_names=["y"], external_data=True)
    peak = status("VmHWM")
    np.save(os.path.join(folder, "expected.npy"), expected)
    np.save(os.path.join(folder, "x.npy"), x.numpy())
    print(json.dumps({"weights": weights, "frozen": frozen, "baseline": baseline, "peak": peak}))
""")


@pytest.mark.slow
@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs to reset the peak RSS")
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_export_of_a_frozen_base_holds_no_second_copy(exporter, tmp_path):
    import onnxruntime as ort

    result = subprocess.run([sys.executable, "-c", SCRIPT, exporter, str(tmp_path)], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    growth = figures["peak"] - figures["baseline"]
    assert growth < 0.5 * figures["weights"], (
        f"the {exporter} export grew the peak RSS by {growth / 2**20:.0f} MiB for {figures['weights'] / 2**20:.0f} MiB "
        f"of weights ({growth / figures['weights']:.2f} W): a second copy of the base")

    data = [name for name in os.listdir(tmp_path) if name.startswith("forward.onnx.") and name.endswith(".data")]
    assert len(data) == 1 and os.path.getsize(tmp_path / data[0]) == figures["frozen"]
    session = ort.InferenceSession(str(tmp_path / "forward.onnx"), providers=["CPUExecutionProvider"])
    (y,) = session.run(["y"], {"x": np.load(tmp_path / "x.npy")})
    expected = np.load(tmp_path / "expected.npy")
    np.testing.assert_allclose(y, expected, rtol=0, atol=1e-5 * float(np.abs(expected).max()))


def _chain_of_unnamed_nodes(count):
    nodes = [helper.make_node("Tanh", ["x" if i == 0 else f"v{i - 1}"], [f"v{i}"]) for i in range(count)]
    nodes.append(helper.make_node("Mul", [f"v{count - 1}", "w"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                              [numpy_helper.from_array(np.ones(3, np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=IR_VERSION)


def test_fresh_names_probe_a_constant_number_of_names_per_node(monkeypatch):
    probes = {"count": 0}

    class CountingSet(set):
        def __contains__(self, item):
            probes["count"] += 1
            return set.__contains__(self, item)

    original = graph_context.GradientContext.__init__

    def counting_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._used = CountingSet(self._used)

    monkeypatch.setattr(graph_context.GradientContext, "__init__", counting_init)
    per_node = []
    for count in (200, 800):
        probes["count"] = 0
        build_training_graph(_chain_of_unnamed_nodes(count), loss="mse")
        per_node.append(probes["count"] / count)
    assert per_node[1] < 1.2 * per_node[0], per_node  # quadratic probing: 4 times as many per node


def test_training_graph_is_built_with_one_copy_of_the_model(monkeypatch):
    """Each copy of a 10^6-node model costs gigabytes: the builder copies the caller's model
    once (it must not change it) and nothing else (add_functions used to copy it again)."""
    import copy

    copies = []
    real = copy.deepcopy

    def counting(value, *args, **kwargs):
        if isinstance(value, onnx.ModelProto):
            copies.append(len(value.graph.node))
        return real(value, *args, **kwargs)

    monkeypatch.setattr(copy, "deepcopy", counting)
    build_training_graph(_chain_of_unnamed_nodes(50), loss="mse")
    assert len(copies) == 1, copies
