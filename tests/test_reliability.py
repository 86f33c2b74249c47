"""Issue 13: what adversarial use found, each case asserting the behaviour it must have now.

Crash-prone cases (C++ kernels, CLI runs on malformed models) run in subprocesses with a
timeout, so a crash fails the test instead of the test run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

import normgrad
from normgrad.ops import DOMAIN, harness
from normgrad.ops import batch_norm_reduce_backward as bnr
from normgrad.ops import group_normalization_grad as gng

from conftest import batch_norm_inputs, cpp_available

needs_cpp = pytest.mark.skipif(not cpp_available(), reason="C++ library not built")
HERE = os.path.dirname(os.path.abspath(__file__))


def _run_subprocess(code: str, *args: str, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})), cwd=HERE)


# ------------------------------------------------------------- 4. Python kernels take every valid node


def _bnr_model(inputs, node_inputs, node_outputs, attributes):
    """One BatchNormReduceBackward node exactly as given: no defaults written, omissions kept."""
    node = helper.make_node(bnr.OP_TYPE, node_inputs, node_outputs, domain=DOMAIN, **attributes)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, list(inputs[n].shape)) for n in node_inputs if n],
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in node_outputs if n],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)],
                             ir_version=normgrad.ops.IR_VERSION)


BRIDGE_CASES = {
    # attributes left to their defaults, weight omitted, trailing outputs omitted
    "defaults": (["grad_out", "input", "mean", "invstd"], ["sum_dy", "sum_dy_xmu"], {}),
    # a flag at 0 with its outputs omitted, the others named in the middle
    "flag_off": (["grad_out", "input", "mean", "invstd", ""], ["", "", "grad_weight"], {"input_g": 0, "bias_g": 0}),
}


@pytest.mark.parametrize("case", sorted(BRIDGE_CASES))
def test_python_backend_takes_nodes_relying_on_defaults_and_omissions(case):
    node_inputs, node_outputs, attributes = BRIDGE_CASES[case]
    inputs = batch_norm_inputs((2, 3, 5))
    model = _bnr_model(inputs, node_inputs, node_outputs, attributes)
    feeds = {n: inputs[n] for n in node_inputs if n}
    with pytest.raises(Exception):  # what the bridge does with the node as written
        ort.InferenceSession(model.SerializeToString(), normgrad.session_options("python"),
                             providers=["CPUExecutionProvider"])
    truth = bnr.reference(**feeds, **attributes)._asdict()
    wanted = [n for n in node_outputs if n]
    session = normgrad.inference_session(model, backend="python", providers=["CPUExecutionProvider"])
    for name, value in zip(wanted, session.run(wanted, feeds)):
        np.testing.assert_allclose(value, truth[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # the public helper, for users building their own sessions
    prepared = normgrad.prepare_for_python_kernels(model)
    own = ort.InferenceSession(prepared.SerializeToString(), normgrad.session_options("python"),
                               providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(own.run(wanted, feeds), session.run(wanted, feeds))
    assert [o.name for o in prepared.graph.output] == wanted
    assert model.graph.node[0].output[:] == node_outputs  # the input model is not changed


def test_python_rewrite_reaches_subgraphs():
    """A node inside an If branch is rewritten too."""
    inputs = {"x": np.random.default_rng(1).normal(size=(2, 4, 3)).astype(np.float32)}
    stats = gng.reference  # the truth
    gamma = np.ones((1, 4, 1), np.float32)
    mean, rstd = np.zeros((2, 4), np.float32), np.ones((2, 4), np.float32)
    consts = [helper.make_node("Constant", [], [n], value=onnx.numpy_helper.from_array(v))
              for n, v in (("gamma", gamma), ("mean", mean), ("rstd", rstd))]
    branch = helper.make_graph(
        [helper.make_node(gng.OP_TYPE, ["x", "x", "gamma", "mean", "rstd"], ["dx"], domain=DOMAIN)], "then", [],
        [helper.make_tensor_value_info("dx", onnx.TensorProto.FLOAT, None)],
    )
    cond = helper.make_node("Constant", [], ["cond"], value=onnx.numpy_helper.from_array(np.array(True)))
    if_node = helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)
    graph = helper.make_graph(consts + [cond, if_node], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4, 3])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)],
                              ir_version=normgrad.ops.IR_VERSION)
    session = normgrad.inference_session(model, backend="python", providers=["CPUExecutionProvider"])
    expected = stats(inputs["x"], inputs["x"], gamma, mean, rstd).dx
    np.testing.assert_allclose(session.run(["y"], inputs)[0], expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------- 5. invalid attributes


BAD_ATTRIBUTES = [
    ("float", helper.make_attribute("input_g", 0.0), "FLOAT"),
    ("string", helper.make_attribute("input_g", "0"), "STRING"),
    ("ints", helper.make_attribute("input_g", [0]), "INTS"),
]


def _with_attribute(attribute):
    inputs = batch_norm_inputs((2, 3, 4))
    model = harness.node_model(bnr.OP_TYPE, inputs, outputs=["grad_weight"], attributes={"input_g": 0})
    node = model.graph.node[0]
    kept = [a for a in node.attribute if a.name != attribute.name]
    del node.attribute[:]
    node.attribute.extend(kept + [attribute])
    return model, inputs


@pytest.mark.parametrize("case,attribute,type_name", BAD_ATTRIBUTES, ids=[c[0] for c in BAD_ATTRIBUTES])
@pytest.mark.parametrize("backend", ["python", "cpp", "functions"])
def test_wrongly_typed_attribute_is_named(case, attribute, type_name, backend):
    if backend == "cpp" and not cpp_available():
        pytest.skip("C++ library not built")
    model, _ = _with_attribute(attribute)
    with pytest.raises(normgrad.NormgradInputError, match=f"attribute 'input_g' must be of type INT; got {type_name}"):
        normgrad.inference_session(model, backend=backend, providers=["CPUExecutionProvider"])


def test_unknown_attribute_is_named():
    model, _ = _with_attribute(helper.make_attribute("input_gg", 0))
    with pytest.raises(normgrad.NormgradInputError, match="unknown attribute 'input_gg'"):
        normgrad.inference_session(model, backend="cpp", providers=["CPUExecutionProvider"])
    with pytest.raises(normgrad.NormgradInputError, match="unknown attribute 'input_gg'"):
        normgrad.prepare_for_python_kernels(model)


_CPP_ATTRIBUTE_SCRIPT = r"""
import sys
import onnxruntime as ort
import normgrad
import test_reliability as t
for case, attribute, type_name in t.BAD_ATTRIBUTES:
    model, inputs = t._with_attribute(attribute)
    try:
        ort.InferenceSession(model.SerializeToString(), normgrad.session_options("cpp"),
                             providers=["CPUExecutionProvider"])
        print(case, "accepted")
    except Exception as error:
        print(case, "OK" if f"BatchNormReduceBackward: attribute 'input_g' must be of type INT; got {type_name}"
              in str(error) else f"other error: {error}")
"""


@needs_cpp
def test_cpp_kernels_reject_wrongly_typed_attributes():
    """Registered by hand (no Python check in between), the kernel itself names the attribute."""
    process = _run_subprocess(_CPP_ATTRIBUTE_SCRIPT)
    assert process.returncode == 0, process.stderr[-2000:]
    assert process.stdout.split() == [w for c, _, _ in BAD_ATTRIBUTES for w in (c, "OK")], process.stdout


# ------------------------------------------------------------- 6. non-finite inputs on every path


_NON_FINITE_SCRIPT = r"""
import json
import numpy as np
from normgrad.ops import harness, batch_norm_reduce_backward as bnr
results = []
for spatial in (5, 64, 67, 100, 4099):  # per-sample path, vector path with and without a tail
    dy = np.full((2, 2, spatial), 0.5, np.float32)
    inputs = {"grad_out": dy, "input": np.ones_like(dy), "mean": np.array([np.inf, -np.inf], np.float32),
              "invstd": np.ones(2, np.float32)}
    out = harness.run("cpp", bnr.OP_TYPE, inputs)
    truth = bnr.reference(**{k: v.astype(np.float64) for k, v in inputs.items()})
    for name in bnr.OUTPUTS:
        results.append([spatial, name, out[name].tolist(), getattr(truth, name).tolist()])
print(json.dumps(results))
"""


@needs_cpp
@pytest.mark.parametrize("kernels", ["default", "generic"])
def test_non_finite_mean_gives_the_ieee_result(kernels):
    """mean = +-inf, dy > 0: sum_dy_xmu = -+inf on every row length, as the float64 reference."""
    import json

    env = {"NORMGRAD_KERNELS": "generic"} if kernels == "generic" else {}
    process = _run_subprocess(_NON_FINITE_SCRIPT, env=env)
    assert process.returncode == 0, process.stderr[-2000:]
    for spatial, name, got, truth in json.loads(process.stdout):
        assert got == truth, (spatial, name, got, truth)  # json writes inf as Infinity, NaN as NaN
        if name == "sum_dy_xmu":
            assert got == [-np.inf, np.inf]
