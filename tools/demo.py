"""``normgrad demo``: the operators on every backend, checked against the float64 reference.

Prints one table of errors (small random cases in every dtype a backend takes) and one
of timings on a large float32 tensor. For the Python kernel it also shows its NumPy
arithmetic alone and what onnxruntime-extensions' default ``tolist()`` marshalling of the
outputs would have added (normgrad's hook hands arrays over instead).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import ml_dtypes
import numpy as np

import normgrad
from normgrad.ops import batch_norm_elemt_backward as bne
from normgrad.ops import batch_norm_reduce_backward as bnr
from normgrad.ops import group_normalization_grad as gng
from normgrad.ops import layer_normalization_grad as lng
from normgrad.ops import rms_normalization_grad as rmsg
from normgrad.ops import harness, python_kernels
from normgrad.tools.cli import ArgumentParser, positive_int

__all__ = ["main"]

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# Relative error budget per dtype (scaled by the output magnitude).
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def batch_norm_case(shape, dtype, seed=0) -> dict:
    """Inputs of BatchNormReduceBackward with the batch statistics of a random x."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, dtype=np.float32)
    axes = (0,) + tuple(range(2, len(shape)))
    mean = x.mean(axis=axes)
    return {
        "grad_out": rng.standard_normal(shape, dtype=np.float32).astype(dtype),
        "input": x.astype(dtype),
        "mean": mean.astype(dtype),
        "invstd": (1 / np.sqrt(x.var(axis=axes) + 1e-5)).astype(dtype),
        "weight": rng.standard_normal(shape[1], dtype=np.float32).astype(dtype),
    }


def batch_norm_elemt_case(shape, dtype, seed=0) -> dict:
    """Inputs of BatchNormElemtBackward: a BatchNorm case plus its reduced sums."""
    inputs = batch_norm_case(shape, dtype, seed)
    sums = bnr.reference(**inputs)
    return {**inputs, "sum_dy": sums.sum_dy, "sum_dy_xmu": sums.sum_dy_xmu}


def group_norm_case(shape, groups, dtype, seed=0) -> dict:
    """Inputs of GroupNormalizationGrad for x [N, C, *spatial] viewed as [N, G, C/G, prod(spatial)]."""
    rng = np.random.default_rng(seed)
    n, channels = shape[:2]
    view = (n, groups, channels // groups, int(np.prod(shape[2:])))
    x = rng.standard_normal(view, dtype=np.float32)
    grouped = x.reshape(n, groups, -1)
    return {
        "x": x.astype(dtype),
        "dy": rng.standard_normal(view, dtype=np.float32).astype(dtype),
        "gamma": rng.normal(1.0, 0.5, size=(1, groups, channels // groups, 1)).astype(dtype),
        "mean": grouped.mean(-1).astype(np.float32),
        "rstd": (1 / np.sqrt(grouped.var(-1) + 1e-5)).astype(np.float32),
    }


def row_norm_case(op_type, shape, dtype, stats_dtype=np.float32, seed=0) -> dict:
    """Inputs of LayerNormalizationGrad or RMSNormalizationGrad for x of ``shape`` (tokens x
    hidden ...), normalised over the last axis, with the statistics of x."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, dtype=np.float32)
    inputs = {
        "dy": rng.standard_normal(shape, dtype=np.float32).astype(dtype),
        "x": x.astype(dtype),
        "scale": rng.normal(1.0, 0.5, size=shape[-1:]).astype(dtype),
    }
    if op_type == lng.OP_TYPE:
        inputs["mean"] = x.mean(-1, keepdims=True).astype(stats_dtype)
        inputs["inv_std_dev"] = (1 / np.sqrt(x.var(-1, keepdims=True) + 1e-5)).astype(stats_dtype)
    else:
        inputs["inv_rms"] = (1 / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)).astype(stats_dtype)
    return inputs


def available_backends() -> list:
    backends = ["cpp", "python", "functions", "evaluator"]
    try:
        normgrad.library_path()
    except FileNotFoundError:
        backends.remove("cpp")
    return backends


def _relative_error(actual: dict, expected: dict) -> float:
    worst = 0.0
    for name, value in actual.items():
        truth = np.asarray(expected[name], dtype=np.float64)
        scale = max(1.0, float(np.abs(truth).max())) if truth.size else 1.0
        diff = np.abs(np.asarray(value, dtype=np.float64) - truth)
        worst = max(worst, float(diff.max()) / scale if diff.size else 0.0)
    return worst


def accuracy_rows(backends) -> list:
    """(operator, backend, dtype, relative error, within tolerance) for small random cases."""
    cases = {
        bnr.OP_TYPE: lambda dtype: batch_norm_case((4, 8, 5, 7), dtype),
        bne.OP_TYPE: lambda dtype: batch_norm_elemt_case((4, 8, 5, 7), dtype),
        gng.OP_TYPE: lambda dtype: group_norm_case((2, 8, 6, 5), 4, dtype),
        lng.OP_TYPE: lambda dtype: row_norm_case(lng.OP_TYPE, (4, 9, 40), dtype),
        rmsg.OP_TYPE: lambda dtype: row_norm_case(rmsg.OP_TYPE, (4, 9, 40), dtype),
    }
    rows = []
    for op_type, make in cases.items():
        for dtype_name, dtype in DTYPES.items():
            inputs = make(dtype)
            expected = harness.run("reference", op_type, {k: v.astype(np.float64) for k, v in inputs.items()})
            for backend in backends:
                if backend == "python" and dtype_name != "float32":
                    continue
                error = _relative_error(harness.run(backend, op_type, inputs), expected)
                rows.append((op_type, backend, dtype_name, error, error <= TOLERANCE[dtype_name]))
    return rows


def _median_time(run, repeats) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def timing_rows(backends, shape, groups, repeats) -> list:
    """(operator, what, milliseconds) on one large float32 case per operator."""
    rows = []
    cases = {
        bnr.OP_TYPE: (batch_norm_case(shape, np.float32), bnr.reference),
        bne.OP_TYPE: (batch_norm_elemt_case(shape, np.float32), bne.reference),
        gng.OP_TYPE: (group_norm_case(shape, groups, np.float32), gng.reference),
    }
    # The row normalizations on the same number of elements as [tokens, hidden] rows.
    hidden = shape[-1] if len(shape) == 2 else 768
    tokens = (max(1, int(np.prod(shape)) // hidden), hidden)
    for module in (lng, rmsg):
        cases[module.OP_TYPE] = (row_norm_case(module.OP_TYPE, tokens, np.float32), module.reference)
    for op_type, (inputs, reference) in cases.items():
        numpy_ms = 1e3 * _median_time(lambda: reference(**inputs), repeats)
        rows.append((op_type, "NumPy reference (float64)", numpy_ms))
        model = harness.node_model(op_type, inputs)
        for backend in backends:
            if backend == "evaluator":
                continue
            session = harness.make_session(model, backend)
            feeds = dict(inputs)
            session.run(None, feeds)
            elapsed, in_kernel = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                session.run(None, feeds)
                elapsed.append(time.perf_counter() - start)
                if backend == "python":
                    in_kernel.append(python_kernels.last_kernel_seconds())
            rows.append((op_type, f"onnxruntime, {backend}", 1e3 * float(np.median(elapsed))))
            if backend == "python":
                bridge = [total - inside for total, inside in zip(elapsed, in_kernel)]
                outputs = reference(**inputs)
                tolist_ms = 1e3 * _median_time(lambda: [o.flatten().tolist() for o in outputs], 1)
                rows.append((op_type, "  in the Python kernel", 1e3 * float(np.median(in_kernel))))
                rows.append((op_type, "  onnxruntime + bridge copies", 1e3 * float(np.median(bridge))))
                rows.append((op_type, "  (default tolist() would add)", tolist_ms))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = ArgumentParser(prog="normgrad demo", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=positive_int, nargs="+", default=[32, 256, 56, 56], help="timing tensor shape")
    parser.add_argument("--groups", type=positive_int, default=32, help="GroupNorm groups for the timing case")
    parser.add_argument("--repeats", type=positive_int, default=3)
    args = parser.parse_args(argv)
    if len(args.shape) < 2 or args.shape[1] % args.groups:
        parser.error(f"--shape needs N and C, C divisible by --groups; got {args.shape}, {args.groups}")

    backends = available_backends()
    print(f"normgrad {normgrad.__version__}: backends {', '.join(backends)} (reference: NumPy float64)\n")
    rows = accuracy_rows(backends)
    print(f"{'operator':<26}{'backend':<11}{'dtype':<10}{'rel. error':>12}  ok")
    for op_type, backend, dtype, error, ok in rows:
        print(f"{op_type:<26}{backend:<11}{dtype:<10}{error:>12.2e}  {'yes' if ok else 'NO'}")
    shape = tuple(args.shape)
    print(f"\ntimings, float32 {list(shape)} ({int(np.prod(shape)) / 1e6:.1f}M elements; the row normalizations as "
          f"[tokens, {shape[-1] if len(shape) == 2 else 768}]), median of {args.repeats}:")
    for op_type, what, ms in timing_rows(backends, shape, args.groups, args.repeats):
        print(f"{op_type:<26}{what:<34}{ms:>10.1f} ms")
    failed = [row for row in rows if not row[4]]
    if failed:
        print(f"\n{len(failed)} case(s) outside tolerance")
        return 1
    print("\nall backends agree with the reference")
    return 0
