"""The AVX2 loops of AdamUpdate and SGDUpdate (ops/cpp/update_avx2.cc) against their portable
loops (NORMGRAD_KERNELS=generic, in a child process), bitwise: random values mixed with zeros
of both signs, denormals, huge values, infinities and NaNs, lengths around the 8-lane groups
and the chunks (tails), every optional input pattern, out of place and in place. Skipped on a
CPU without AVX2 (there the two are the same loop)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from _helpers import cpp_available
from normgrad.ops import adam_update, harness, sgd_update

HERE = pathlib.Path(__file__).parent
LENGTHS = [1, 7, 8, 9, 31, 1001, (1 << 14) + 13]
"""One lane, a tail alone, one group, a group and a tail, ..., a chunk boundary and a tail."""


def _has_avx2() -> bool:
    try:
        flags = next(line for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return {"avx2", "fma", "f16c"} <= set(flags)


pytestmark = pytest.mark.skipif(not (cpp_available() and _has_avx2()), reason="needs the C++ library on an AVX2 CPU")


def _values(rng, n: int, positive: bool = False) -> np.ndarray:
    """Normal values, a fifth of them replaced by zeros, denormals, huge and non-finite values."""
    values = rng.standard_normal(n).astype(np.float32)
    specials = np.array([0.0, -0.0, 1e-40, -3e-42, 1.4e-45, 3e38, -2e37, 1e20, np.inf, -np.inf, np.nan], np.float32)
    where = rng.random(n) < 0.2
    values[where] = rng.choice(specials, int(where.sum()))
    return np.abs(values) if positive else values


def _adam_cases():
    for n in LENGTHS:
        for optional in [(), ("param_scale", "grad_scale"), ("weight_decay", "max_exp_avg_sq"),
                         adam_update.OPTIONAL]:
            rng = np.random.default_rng(n + len(optional))
            tensors = {name: _values(rng, n, positive=name.endswith("sq")) for name in
                       ("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")}
            scalars = {"step_size": 1e-3, "correction2_sqrt": 0.03, "one_minus_beta1": 0.1, "beta2": 0.999,
                       "one_minus_beta2": 0.001, "epsilon": 1e-8, "param_scale": 0.9999, "grad_scale": 0.7,
                       "weight_decay": 0.01}
            inputs = {**tensors, **{k: np.array(v, np.float32) for k, v in scalars.items()}, "applied": np.array(True)}
            yield f"adam-{n}-{'-'.join(optional)}", adam_update, {
                k: v for k, v in inputs.items() if k not in adam_update.OPTIONAL or k in optional}


def _sgd_cases():
    settings = [dict(momentum=0.0, weight_decay=0.0), dict(momentum=0.9, one_minus_dampening=0.75, grad_scale=0.5),
                dict(momentum=0.9, weight_decay=0.01, nesterov=True), dict(momentum=0.9, first_step=True)]
    for n in LENGTHS:
        for index, setting in enumerate(settings):
            rng = np.random.default_rng(100 * n + index)
            inputs = {name: _values(rng, n) for name in ("param", "grad", "momentum_buffer")}
            inputs["lr"] = np.array(0.05, np.float32)
            for name, value in setting.items():
                inputs[name] = np.array(value, bool if isinstance(value, bool) else np.float32)
            yield f"sgd-{n}-{index}", sgd_update, inputs


def _outputs() -> dict:
    """Every case's outputs, out of place and in place, by case and output name."""
    results = {}
    for case, module, inputs in [*_adam_cases(), *_sgd_cases()]:
        for name, value in harness.run_model(harness.node_model(module.OP_TYPE, inputs), inputs, "cpp",
                                             threads=1).items():
            results[f"{case}/{name}"] = value
        kept = {output: state for output, state in module.SPEC.kept.items() if state in inputs}
        for name, value in harness.run_in_place(module.OP_TYPE, inputs, kept, threads=2).items():
            results[f"{case}/in-place/{name}"] = value
    return results


_CHILD = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import test_update_avx2 as t
np.savez(sys.argv[2], **t._outputs())
"""


def test_avx2_loops_equal_the_portable_loops_bitwise(tmp_path):
    portable_file = tmp_path / "portable.npz"
    env = dict(os.environ, NORMGRAD_KERNELS="generic")
    process = subprocess.run([sys.executable, "-c", _CHILD, str(HERE), str(portable_file)], capture_output=True,
                             text=True, env=env, timeout=600)
    assert process.returncode == 0, process.stderr[-3000:]
    avx2 = _outputs()
    with np.load(portable_file) as portable:
        assert sorted(portable.files) == sorted(avx2)
        for key, value in avx2.items():
            assert value.tobytes() == portable[key].tobytes(), key
    # the cases do reach every kind of value (the comparison above is not over finite numbers only)
    adam_params = [v for k, v in avx2.items() if k.startswith("adam-1001") and k.endswith("/param_next")]
    assert any(np.isnan(v).any() for v in adam_params) and any((np.abs(v) > 1e30).any() for v in adam_params)
