"""Every contract rule is enforced with an error naming the input, and no backend crashes.

The kernel backends run the whole battery in a subprocess: a crash there fails the test
instead of taking the test run down.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from onnx import helper

import normgrad
from normgrad.ops import NormgradInputError, batch_norm_reduce_backward as bnr, harness

from _helpers import batch_norm_inputs, cpp_available, run_in_tests_folder
from bad_inputs import CASES

HERE = pathlib.Path(__file__).parent


@pytest.mark.parametrize("case_id,case,name,_", CASES, ids=[c[0] for c in CASES])
def test_reference_names_the_input(case_id, case, name, _):
    op_type, inputs = case
    with pytest.raises(NormgradInputError, match=f"'{name}'"):
        harness.run("reference", op_type, inputs)


def _battery(backend: str) -> dict:
    process = subprocess.run(
        [sys.executable, str(HERE / "bad_inputs.py"), backend], capture_output=True, text=True, timeout=1800
    )
    assert process.returncode == 0, f"battery on {backend} crashed ({process.returncode}):\n{process.stderr[-3000:]}"
    results = {}
    for line in process.stdout.splitlines():
        result = json.loads(line)
        results[result.pop("case")] = result
    assert sorted(results) == sorted(c[0] for c in CASES)
    return results


def test_python_kernels_survive_and_report():
    """Float32 shape errors come back as NaN with the message logged; dtype errors fail at session creation."""
    results = _battery("python")
    for case_id, (_, inputs), name, _ in CASES:
        result = results[case_id]
        if any(v.dtype != "float32" for v in inputs.values()):
            assert result["outcome"] == "raised", case_id
            continue
        assert result["outcome"] == "nan", (case_id, result)
        assert f"'{name}'" in result["message"], (case_id, result)


def test_cpp_kernels_reject_with_the_input_name():
    from _helpers import cpp_available

    if not cpp_available():
        pytest.skip("C++ library not built")
    results = _battery("cpp")
    for case_id, _, name, _ in CASES:
        assert results[case_id]["outcome"] == "raised", (case_id, results[case_id])
        assert name in results[case_id]["message"], (case_id, results[case_id])


@pytest.mark.parametrize("backend", ["functions", "evaluator"])
def test_function_bodies_fail_on_inconsistent_shapes(backend):
    """Function bodies have no validation step; the shape errors they can see still raise."""
    for case_id, (op_type, inputs), _, noticed in CASES:
        if noticed:
            with pytest.raises(Exception):
                harness.run(backend, op_type, inputs, static_shapes=False)


needs_cpp = pytest.mark.skipif(not cpp_available(), reason="C++ library not built")


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
import test_bad_input as t
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
    process = run_in_tests_folder(_CPP_ATTRIBUTE_SCRIPT)
    assert process.returncode == 0, process.stderr[-2000:]
    assert process.stdout.split() == [w for c, _, _ in BAD_ATTRIBUTES for w in (c, "OK")], process.stdout


# ------------------------------------------------------------- non-finite inputs on every path


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
    process = run_in_tests_folder(_NON_FINITE_SCRIPT, env=env)
    assert process.returncode == 0, process.stderr[-2000:]
    for spatial, name, got, truth in json.loads(process.stdout):
        assert got == truth, (spatial, name, got, truth)  # json writes inf as Infinity, NaN as NaN
        if name == "sum_dy_xmu":
            assert got == [-np.inf, np.inf]
