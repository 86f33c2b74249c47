"""Issue 24 item 17: an export that would need more memory than the process may use ends with
one line and exit 1, nothing written (it died with an uncaught protobuf 'Arena alloc failed'
traceback, or SIGSEGV/abort without a message)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from normgrad.ops import IR_VERSION

pytestmark = pytest.mark.slow

_ADDRESS_SPACE = 1536 * 2**20  # Python, onnx and the loaded model fit; the export does not


def _chain(count):
    ops = ["Tanh", "Add", "Mul"]
    nodes = [helper.make_node(ops[i % 3], ["x" if i == 0 else f"v{i - 1}"] + ([] if i % 3 == 0 else ["w"]),
                              ["y" if i == count - 1 else f"v{i}"]) for i in range(count)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                              [numpy_helper.from_array(np.full(4, 0.01, np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


def _limit_address_space():
    resource.setrlimit(resource.RLIMIT_AS, (_ADDRESS_SPACE, resource.getrlimit(resource.RLIMIT_AS)[1]))


def test_export_beyond_memory_ends_with_one_line_and_exit_1(tmp_path):
    model = tmp_path / "chain.onnx"
    onnx.save(_chain(200_000), model)
    out = tmp_path / "train.onnx"
    run = subprocess.run(
        [sys.executable, "-c", "import sys; from normgrad.tools.export import main; sys.exit(main(sys.argv[1:]))",
         str(model), "-o", str(out), "--loss", "mse", "--optimizer", "sgd"],
        capture_output=True, text=True, timeout=3600, preexec_fn=_limit_address_space,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 1, (run.returncode, run.stderr[-2000:])
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("normgrad export: "), run.stderr[-2000:]
    assert "memory" in lines[0] and "chain.onnx" in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain.onnx"]
