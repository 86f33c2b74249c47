"""``normgrad bench``: the kernels side by side, from one run.

For each operator it times, with medians over interleaved repetitions (each repetition runs
every implementation once, in turn, so drifts in machine load hit them alike; torch's OpenMP
workers are told to sleep between calls, ``OMP_WAIT_POLICY=PASSIVE``, unless set already):

* ``cpp``: the compiled kernels (``session_options("cpp")``);
* ``python``: the onnxruntime-extensions Python kernels (``session_options("python")``, float32);
* ``function``: the function bodies in plain onnxruntime (``normgrad.add_functions``);
* ``numpy``: the float64 NumPy reference;
* ``torch``: torch's CPU kernels, when torch is importable
  (``aten::native_batch_norm_backward`` with output mask [False, True, True],
  ``aten::native_group_norm_backward`` with [True, False, False]);
* ``floor``: the memory-streaming floor, the time to read the operator's input tensors once:
  ``np.add.reduce`` of their bytes viewed as int64 words, over contiguous slices, one slice
  per thread, on as many Python threads as the kernels get (NumPy releases the GIL while it
  sums; integer sums are vectorised, so this runs at memory speed for every dtype). The floor reads and
  writes nothing else: an operator that also writes an output of the input's size (dx)
  cannot reach it.

Every session gets ``intra_op_num_threads = --threads`` with spinning of idle pool threads off
(``session.intra_op.allow_spinning = 0``: a spinning pool would steal the cores from the
implementation timed next), and torch ``set_num_threads(--threads)``.
``mem`` is the growth of the process's peak RSS (``ru_maxrss``) during the implementation's
first call, with the inputs already allocated: a rough view of its temporaries (0 when it
stayed below an earlier peak). Ratios are to the ``cpp`` row and to the ``floor`` row.
"""

from __future__ import annotations

import argparse
import os
import concurrent.futures
import resource
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import ml_dtypes
import numpy as np

__all__ = ["main"]

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPE_NAMES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _session_options(threads):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    # Idle pool threads must not spin into the next implementation's time.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def _session(op_type, inputs, outputs, attributes, backend, threads):
    import onnxruntime

    import normgrad
    from normgrad.ops import harness

    model = harness.node_model(op_type, inputs, outputs, attributes)
    options = _session_options(threads)
    if backend == "function":
        model = normgrad.add_functions(model)
    else:
        normgrad.session_options(backend, options)
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _to_ort(value):
    import onnx
    import onnxruntime

    value = np.ascontiguousarray(value)
    if value.dtype == BF16:
        return onnxruntime.OrtValue.ortvalue_from_numpy_with_onnx_type(value.view(np.uint16), onnx.TensorProto.BFLOAT16)
    return onnxruntime.OrtValue.ortvalue_from_numpy(value)


def _ort_runner(session, inputs) -> Callable[[], object]:
    """A call of ``session`` with inputs bound once (bfloat16 included)."""
    binding = session.io_binding()
    for name, value in inputs.items():
        if value is not None:
            binding.bind_ortvalue_input(name, _to_ort(value))
    for output in session.get_outputs():
        binding.bind_output(output.name, "cpu")

    def run():
        session.run_with_iobinding(binding)

    return run


def _floor_runner(arrays, threads) -> Callable[[], object]:
    """Reads every array once: np.add.reduce over contiguous slices, `threads` at a time."""
    chunks = []
    for array in arrays:
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        words = raw[: raw.size // 8 * 8].view(np.int64)  # summing int64 words is vectorised and memory-bound
        step = max(1, -(-words.size // threads))
        chunks += [words[i:i + step] for i in range(0, words.size, step)]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads)

    def read(chunk):
        return np.add.reduce(chunk)

    def run():
        return list(pool.map(read, chunks))

    run.pool = pool
    return run


def _torch_bn(inputs, threads):
    import torch

    torch.set_num_threads(threads)
    to = {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in inputs.items() if v is not None}
    weight = to.get("weight", torch.ones_like(to["mean"]))
    mean, invstd = to["mean"], to["invstd"]

    def run():
        with torch.no_grad():
            return torch.ops.aten.native_batch_norm_backward(
                to["grad_out"], to["input"], weight, None, None, mean, invstd, True, 1e-5, [False, True, True]
            )

    return run


def _torch_gn(inputs, threads):
    import torch

    torch.set_num_threads(threads)
    x = torch.from_numpy(inputs["x"])
    n, g = x.shape[:2]
    channels = g * x.shape[2]
    hw = int(np.prod(x.shape[3:]))
    x4 = x.reshape(n, channels, hw)
    dy4 = torch.from_numpy(inputs["dy"]).reshape(n, channels, hw)
    gamma = torch.from_numpy(np.array(np.broadcast_to(inputs["gamma"], (1, g, x.shape[2], 1)).reshape(-1)))
    mean = torch.from_numpy(inputs["mean"])
    rstd = torch.from_numpy(inputs["rstd"])

    def run():
        with torch.no_grad():
            return torch.ops.aten.native_group_norm_backward(dy4, x4, mean, rstd, gamma, n, channels, hw, g,
                                                             [True, False, False])

    return run


def _numpy_runner(module, inputs, attributes=None):
    args = {name: inputs.get(name) for name in module.INPUTS}

    def run():
        return module.reference(**args, **dict(attributes or {}))

    return run


def _time(runners: Dict[str, Callable[[], object]], repeat: int) -> Dict[str, dict]:
    """Warm-up call (with peak-RSS growth), then `repeat` interleaved timed rounds."""
    results = {}
    for name, run in runners.items():
        before = _maxrss_mb()
        try:
            run()
        except Exception as error:  # an implementation that cannot run this case is reported, not fatal
            results[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"}
            continue
        results[name] = {"mem": max(0.0, _maxrss_mb() - before), "times": []}
    for _ in range(repeat):
        for name, run in runners.items():
            if "times" not in results[name]:
                continue
            start = time.perf_counter()
            run()
            results[name]["times"].append(time.perf_counter() - start)
    for result in results.values():
        if "times" in result:
            result["median"] = statistics.median(result["times"])
    return results


def _print_table(title: str, results: Dict[str, dict], out) -> None:
    print(f"\n{title}", file=out)
    cpp = results.get("cpp", {}).get("median")
    floor = results.get("floor", {}).get("median")
    print(f"  {'implementation':<16}{'median':>12}{'x cpp':>9}{'x floor':>9}{'mem MB':>9}", file=out)
    for name, result in results.items():
        if "error" in result:
            print(f"  {name:<16}{'failed: ' + result['error']}", file=out)
            continue
        median = result["median"]
        ratio_cpp = f"{median / cpp:8.2f}x" if cpp else "       -"
        ratio_floor = f"{median / floor:8.2f}x" if floor else "       -"
        mem = "" if name == "floor" else f"{result['mem']:9.0f}"
        print(f"  {name:<16}{median * 1e3:10.3f}ms {ratio_cpp}{ratio_floor}{mem}", file=out)


def _bn_inputs(shape, t, u, rng):
    x = rng.standard_normal(shape, dtype=np.float32)
    c = shape[1]
    return {
        "grad_out": rng.standard_normal(shape, dtype=np.float32).astype(t),
        "input": x.astype(t),
        "mean": (0.1 * rng.standard_normal(c)).astype(u),
        "invstd": (1.0 + 0.1 * rng.random(c)).astype(u),
        "weight": rng.standard_normal(c).astype(u),
    }


def _gn_inputs(shape, groups, t, u, rng):
    n, c = shape[:2]
    x_shape = (n, groups, c // groups, int(np.prod(shape[2:])))
    return {
        "x": rng.standard_normal(x_shape, dtype=np.float32).astype(t),
        "dy": rng.standard_normal(x_shape, dtype=np.float32).astype(t),
        "gamma": rng.standard_normal((1, groups, c // groups, 1)).astype(t),
        "mean": (0.1 * rng.standard_normal((n, groups))).astype(u),
        "rstd": (1.0 + 0.1 * rng.random((n, groups))).astype(u),
    }


def _have_torch() -> bool:
    try:
        import torch  # noqa: F401
    except Exception:
        return False
    return True


def _runners(op_type, inputs, outputs, threads, *, full: bool, torch_runner=None, floor_inputs=()):
    from normgrad.ops import operator

    module = operator(op_type)
    runners = {}
    for backend in ("cpp",) + (("function", "python") if full else ()):
        try:
            # The Python kernels cannot omit outputs: they compute them all.
            session = _session(op_type, inputs, None if backend == "python" else outputs, None, backend, threads)
            runners[backend] = _ort_runner(session, inputs)
        except Exception as error:
            message = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
            runners[backend] = (lambda m: (lambda: (_ for _ in ()).throw(RuntimeError(m))))(message)
    if full and torch_runner is not None and _have_torch():
        runners["torch"] = torch_runner(inputs, threads)
    if full:
        runners["numpy (float64)"] = _numpy_runner(module, inputs)
    runners["floor"] = _floor_runner([inputs[name] for name in floor_inputs], threads)
    return runners


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="normgrad bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (CI smoke test)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads for every implementation (2)")
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds (default 7, --quick 3)")
    parser.add_argument("--shape", type=int, nargs="+", default=None,
                        help="[N, C, H, W...] of the input (default 32 256 56 56; --quick 4 64 14 14)")
    parser.add_argument("--groups", type=int, default=32, help="GroupNorm groups (default 32)")
    parser.add_argument("--no-slow", action="store_true", help="skip python/function/numpy/torch rows")
    args = parser.parse_args(argv)
    # torch's OpenMP workers spin after each call by default and would steal the cores
    # from whatever runs next in the interleaved rounds; let them sleep instead.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    shape = tuple(args.shape or ((4, 64, 14, 14) if args.quick else (32, 256, 56, 56)))
    repeat = args.repeat or (3 if args.quick else 7)
    threads = args.threads
    out = sys.stdout
    if len(shape) < 3 or shape[1] % args.groups:
        parser.error(f"--shape needs rank >= 3 and C divisible by --groups; got {list(shape)}, {args.groups}")

    import onnxruntime

    import normgrad

    rng = np.random.default_rng(0)
    full = not args.no_slow
    print(f"normgrad bench: shape {list(shape)}, groups {args.groups}, {threads} threads, median of {repeat}; "
          f"onnxruntime {onnxruntime.__version__}, torch {'yes' if _have_torch() else 'not installed'}", file=out)
    print(f"C++ library: {normgrad.library_path()}", file=out)
    f32 = np.dtype(np.float32)

    # ---- BatchNormReduceBackward
    bn = _bn_inputs(shape, f32, f32, rng)
    runners = _runners("BatchNormReduceBackward", bn, ["sum_dy", "sum_dy_xmu", "grad_weight", "grad_bias"], threads,
                       full=full, torch_runner=_torch_bn, floor_inputs=("grad_out", "input"))
    _print_table(f"BatchNormReduceBackward float32 {list(shape)} (floor: read grad_out + input)",
                 _time(runners, repeat), out)
    del runners

    # ---- GroupNormalizationGrad
    gn = _gn_inputs(shape, args.groups, f32, f32, rng)
    runners = _runners("GroupNormalizationGrad", gn, ["dx"], threads, full=full, torch_runner=_torch_gn,
                       floor_inputs=("x", "dy"))
    _print_table(f"GroupNormalizationGrad float32 x {list(gn['x'].shape)}, gamma {list(gn['gamma'].shape)}, "
                 f"dx only (floor: read x + dy)", _time(runners, repeat), out)
    del runners

    # ---- BatchNormElemtBackward (cpp, function, numpy, floor)
    from normgrad.ops import batch_norm_reduce_backward as bnr

    sums = bnr.reference(**{k: bn[k] for k in ("grad_out", "input", "mean", "invstd")})
    elemt = dict(bn, sum_dy=sums.sum_dy, sum_dy_xmu=sums.sum_dy_xmu)
    try:
        runners = _runners("BatchNormElemtBackward", elemt, ["grad_input"], threads, full=full,
                           floor_inputs=("grad_out", "input"))
        runners.pop("python", None)
        _print_table(f"BatchNormElemtBackward float32 {list(shape)} (floor: read grad_out + input)",
                     _time(runners, repeat), out)
        del runners
    except KeyError as error:  # operator not registered in this build
        print(f"\nBatchNormElemtBackward: skipped ({error})", file=out)

    # ---- float16 / bfloat16 rows (C++ only, against float32 C++ and the floor of their own bytes)
    del bn, gn, elemt
    for t in (np.dtype(np.float16), BF16):
        bn = _bn_inputs(shape, t, f32, rng)
        runners = _runners("BatchNormReduceBackward", bn, ["sum_dy", "sum_dy_xmu", "grad_weight", "grad_bias"],
                           threads, full=False, floor_inputs=("grad_out", "input"))
        _print_table(f"BatchNormReduceBackward {t.name} (U float32)", _time(runners, repeat), out)
        del runners, bn
        gn = _gn_inputs(shape, args.groups, t, f32, rng)
        runners = _runners("GroupNormalizationGrad", gn, ["dx"], threads, full=False, floor_inputs=("x", "dy"))
        _print_table(f"GroupNormalizationGrad {t.name} (U float32), dx only", _time(runners, repeat), out)
        del runners, gn

    # ---- tiny tensors: per-call latency against an Identity node
    import onnx
    from onnx import helper

    from normgrad.ops import IR_VERSION

    tiny = _bn_inputs((2, 3, 4), f32, f32, rng)
    runners = {"cpp": _ort_runner(_session("BatchNormReduceBackward", tiny, None, None, "cpp", threads), tiny)}
    identity = helper.make_model(
        helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3, 4])]),
        opset_imports=[helper.make_opsetid("", 18)], ir_version=IR_VERSION)
    options = _session_options(threads)
    id_session = onnxruntime.InferenceSession(identity.SerializeToString(), options,
                                              providers=["CPUExecutionProvider"])
    runners["Identity node"] = _ort_runner(id_session, {"x": tiny["input"]})
    results = _time(runners, max(repeat, 9) * 50)
    print("\nTiny tensors [2, 3, 4]: per-call latency (session.run_with_iobinding)", file=out)
    for name, result in results.items():
        print(f"  {name:<16}{result['median'] * 1e6:10.1f}us", file=out)
    cpp, ident = results["cpp"]["median"], results["Identity node"]["median"]
    print(f"  overhead over Identity: {(cpp - ident) * 1e6:.1f}us", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
