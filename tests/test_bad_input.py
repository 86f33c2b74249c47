"""Every contract rule is enforced with an error naming the input, and no backend crashes.

The kernel backends run the whole battery in a subprocess: a crash there fails the test
instead of taking the test run down.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from bad_inputs import CASES

from normgrad.ops import NormgradInputError
from normgrad.ops import harness

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
    from conftest import cpp_available

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
