"""The bad-input battery: one case per rule of the operators' contracts.

Run as a script (``python bad_inputs.py BACKEND``) it feeds every case to one backend in
this process and prints one JSON line per case, so a caller can run it in a subprocess
and tell a crash (no lines, non-zero exit) from an error.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from normgrad.ops import batch_norm_elemt_backward as bne
from normgrad.ops import batch_norm_reduce_backward as bnr
from normgrad.ops import group_normalization_grad as gng
from normgrad.ops import layer_normalization_grad as lng
from normgrad.ops import rms_normalization_grad as rmsg

f32, f16 = np.float32, np.float16


def _bn(**changes):
    rng = np.random.default_rng(0)
    inputs = {
        "grad_out": rng.normal(size=(2, 3, 4)).astype(f32),
        "input": rng.normal(size=(2, 3, 4)).astype(f32),
        "mean": np.zeros(3, f32),
        "invstd": np.ones(3, f32),
        "weight": np.ones(3, f32),
    }
    inputs.update(changes)
    return bnr.OP_TYPE, inputs


def _gn(**changes):
    rng = np.random.default_rng(0)
    inputs = {
        "x": rng.normal(size=(2, 3, 4)).astype(f32),
        "dy": rng.normal(size=(2, 3, 4)).astype(f32),
        "gamma": np.ones((1, 3, 4), f32),
        "mean": np.zeros((2, 3), f32),
        "rstd": np.ones((2, 3), f32),
    }
    inputs.update(changes)
    return gng.OP_TYPE, inputs


def _elemt(**changes):
    op_type, inputs = _bn(**changes)
    inputs = {"sum_dy": np.zeros(3, f32), "sum_dy_xmu": np.zeros(3, f32), **inputs}
    return bne.OP_TYPE, {name: inputs[name] for name in bne.INPUTS if name in inputs}


def _ln(**changes):
    rng = np.random.default_rng(0)
    inputs = {
        "dy": rng.normal(size=(2, 3, 4)).astype(f32),
        "x": rng.normal(size=(2, 3, 4)).astype(f32),
        "scale": np.ones(4, f32),
        "mean": np.zeros((2, 3, 1), f32),
        "inv_std_dev": np.ones((2, 3, 1), f32),
    }
    inputs.update(changes)
    return lng.OP_TYPE, inputs


def _rms(**changes):
    _, inputs = _ln()
    inputs = {"dy": inputs["dy"], "x": inputs["x"], "scale": inputs["scale"], "inv_rms": inputs["inv_std_dev"], **changes}
    return rmsg.OP_TYPE, inputs


def _ones(*shape, dtype=f32):
    return np.ones(shape, dtype)


# (case id, (op type, inputs), the input the error must name, whether the function bodies notice)
CASES = [
    ("bn-grad_out-shape", _bn(grad_out=_ones(2, 3, 5)), "grad_out", True),
    ("bn-input-rank-1", _bn(grad_out=_ones(3), input=_ones(3)), "input", True),
    ("bn-input-rank-9", _bn(grad_out=_ones(*[1] * 9), input=_ones(*[1] * 9)), "input", False),
    ("bn-input-no-channels", _bn(grad_out=_ones(2, 0, 3), input=_ones(2, 0, 3)), "input", False),
    ("bn-mean-length", _bn(mean=_ones(4)), "mean", True),
    ("bn-mean-rank", _bn(mean=_ones(1, 3)), "mean", False),
    ("bn-invstd-length", _bn(invstd=_ones(2)), "invstd", True),
    ("bn-weight-length", _bn(weight=_ones(5)), "weight", False),
    ("bn-grad_out-dtype", _bn(grad_out=_ones(2, 3, 4, dtype=f16)), "grad_out", False),
    ("bn-invstd-dtype", _bn(invstd=_ones(3, dtype=f16)), "invstd", False),
    ("bn-relu_output-shape", _bn(relu_output=_ones(2, 3, 5)), "relu_output", True),
    ("bn-relu_output-dtype", _bn(relu_output=_ones(2, 3, 4, dtype=f16)), "relu_output", False),
    ("elemt-grad_out-shape", _elemt(grad_out=_ones(2, 3, 5)), "grad_out", True),
    ("elemt-weight-length", _elemt(weight=_ones(4)), "weight", True),
    ("elemt-sum_dy-length", _elemt(sum_dy=_ones(2)), "sum_dy", True),
    ("elemt-relu_output-broadcast", _elemt(relu_output=_ones(2, 1, 4)), "relu_output", False),
    ("gn-dy-shape", _gn(dy=_ones(2, 3, 5)), "dy", True),
    ("gn-x-rank-2", _gn(x=_ones(2, 3), dy=_ones(2, 3), gamma=_ones(1, 3)), "x", False),
    ("gn-gamma-not-broadcastable", _gn(gamma=_ones(1, 3, 5)), "gamma", True),
    ("gn-gamma-rank", _gn(gamma=_ones(1, 2, 3, 4)), "gamma", False),
    ("gn-mean-shape", _gn(mean=_ones(2, 4)), "mean", True),
    ("gn-rstd-shape", _gn(rstd=_ones(2)), "rstd", False),
    ("gn-gamma-dtype", _gn(gamma=_ones(1, 3, 4, dtype=f16)), "gamma", False),
    ("gn-rstd-dtype", _gn(rstd=_ones(2, 3, dtype=f16)), "rstd", False),
    ("ln-dy-shape", _ln(dy=_ones(2, 3, 5)), "dy", True),
    ("ln-x-scalar", _ln(x=_ones(), dy=_ones()), "x", True),
    ("ln-scale-not-broadcastable", _ln(scale=_ones(5)), "scale", True),
    ("ln-scale-per-row", _ln(scale=_ones(3, 4)), "scale", False),
    ("ln-mean-shape", _ln(mean=_ones(2, 4, 1)), "mean", True),
    ("ln-mean-no-trailing-1", _ln(mean=_ones(2, 3)), "mean", False),
    ("ln-inv_std_dev-shape", _ln(inv_std_dev=_ones(3, 2, 1)), "inv_std_dev", False),
    ("ln-scale-dtype", _ln(scale=_ones(4, dtype=f16)), "scale", False),
    ("ln-inv_std_dev-dtype", _ln(inv_std_dev=_ones(2, 3, 1, dtype=f16)), "inv_std_dev", False),
    ("rms-dy-shape", _rms(dy=_ones(2, 4, 4)), "dy", True),
    ("rms-scale-not-broadcastable", _rms(scale=_ones(1, 2)), "scale", True),
    ("rms-inv_rms-shape", _rms(inv_rms=_ones(2, 1, 1)), "inv_rms", True),
    ("rms-inv_rms-dtype", _rms(inv_rms=_ones(2, 3, 1, dtype=f16)), "inv_rms", False),
]


def run_case(backend: str, op_type: str, inputs: dict) -> dict:
    """Feeds one case to ``backend``; says how it was rejected."""
    from normgrad.ops import harness

    try:
        outputs = harness.run(backend, op_type, inputs, static_shapes=False)
    except Exception as error:  # the point is to see which error each backend gives
        return {"outcome": "raised", "message": f"{type(error).__name__}: {error}"}
    values = [np.asarray(v, dtype=np.float64) for v in outputs.values()]
    message = ""
    if backend == "python":
        from normgrad.ops import python_kernels

        message = python_kernels.errors()[-1] if python_kernels.errors() else ""
    all_nan = all(np.isnan(v).all() for v in values)
    return {"outcome": "nan" if all_nan else "returned", "message": message}


def main(backend: str) -> None:
    import logging

    logging.disable(logging.CRITICAL)
    for case_id, (op_type, inputs), _, _ in CASES:
        result = run_case(backend, op_type, inputs)
        print(json.dumps({"case": case_id, **result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
