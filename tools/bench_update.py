"""The optimizer-update kernels (AdamUpdate, SGDUpdate) against a streaming floor, at 1 thread.

    python -m normgrad.tools.bench_update [--repeat 30] [--rounds 3]

Each kernel runs in place (its outputs bound to its state inputs, as the Trainer runs it) on
the benchmark models' parameter shapes; CPU time per call (time.process_time), median over
the calls. Both kernel sets side by side: the AVX2 loops and the portable ones
(NORMGRAD_KERNELS=generic), each in its own process, the processes interleaved over rounds.
The floor is NumPy's 1-thread copy (np.copyto) of the same size, as GB/s; a kernel's GB/s
counts every tensor it reads and writes once (AdamW: 4 read, 3 written; SGD with momentum:
3 read, 2 written).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

SHAPES = [(8192, 256), (1024, 256), (256, 256), (256,)]


def _median_seconds(call, repeat: int) -> float:
    call()
    times = []
    for _ in range(repeat):
        start = time.process_time()
        call()
        times.append(time.process_time() - start)
    return float(np.median(times))


def _adam_inputs(shape, rng):
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name in ("param", "grad", "exp_avg")}
    tensors["exp_avg_sq"] = np.abs(rng.standard_normal(shape)).astype(np.float32) * 1e-2
    scalars = {"step_size": 1e-3, "correction2_sqrt": 0.05, "one_minus_beta1": 0.1, "beta2": 0.999,
               "one_minus_beta2": 0.001, "epsilon": 1e-8, "param_scale": 1 - 1e-5, "grad_scale": 0.5}
    return {**tensors, **{k: np.array(v, np.float32) for k, v in scalars.items()}, "applied": np.array(True)}


def _sgd_inputs(shape, rng):
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name in ("param", "grad", "momentum_buffer")}
    scalars = {"lr": 1e-2, "momentum": 0.9, "one_minus_dampening": 1.0, "weight_decay": 1e-4, "grad_scale": 0.5}
    return {**tensors, **{k: np.array(v, np.float32) for k, v in scalars.items()}, "first_step": np.array(False),
            "nesterov": np.array(False), "applied": np.array(True)}


def _in_place_call(module, inputs):
    """A call of the op's 1-thread session with every kept output bound to its input's buffer."""
    import onnxruntime

    from normgrad.ops import harness

    outputs = [name for name, state in module.SPEC.kept.items() if state in inputs]
    session = harness.make_session(harness.node_model(module.OP_TYPE, inputs, outputs), "cpp", threads=1)
    binding = session.io_binding()
    buffers = {name: onnxruntime.OrtValue.ortvalue_from_numpy(np.array(value, copy=True))
               for name, value in inputs.items()}
    for name, value in buffers.items():
        binding.bind_ortvalue_input(name, value)
    for output in outputs:
        binding.bind_ortvalue_output(output, buffers[module.SPEC.kept[output]])
    return lambda: session.run_with_iobinding(binding), buffers


def measure(repeat: int) -> dict:
    """GB/s per shape of AdamUpdate, SGDUpdate and the copy floor, in this process."""
    from normgrad.ops import adam_update, sgd_update

    rng = np.random.default_rng(0)
    figures = {}
    for shape in SHAPES:
        size = int(np.prod(shape)) * 4
        row = {}
        for name, module, make, tensors in (("adam", adam_update, _adam_inputs, 7), ("sgd", sgd_update, _sgd_inputs, 5)):
            call, _buffers = _in_place_call(module, make(shape, rng))
            row[name] = tensors * size / _median_seconds(call, repeat) / 1e9
        source, target = rng.standard_normal(shape).astype(np.float32), np.empty(shape, np.float32)
        row["copy"] = 2 * size / _median_seconds(lambda: np.copyto(target, source), repeat) / 1e9
        figures["x".join(map(str, shape))] = row
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30, help="calls per shape and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved process pairs")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.repeat)))
        return 0
    runs = {"avx2": [], "generic": []}
    for _ in range(args.rounds):
        for kernels in runs:
            env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
            env.pop("NORMGRAD_KERNELS", None)
            if kernels == "generic":
                env["NORMGRAD_KERNELS"] = "generic"
            out = subprocess.run([sys.executable, "-m", "normgrad.tools.bench_update", "--child", "--repeat",
                                  str(args.repeat)], env=env, capture_output=True, text=True, check=True).stdout
            runs[kernels].append(json.loads(out.strip().splitlines()[-1]))
    print(f"GB/s at 1 thread, median of {args.rounds} rounds x {args.repeat} calls (CPU time); "
          "avx2 = this CPU's loops, generic = NORMGRAD_KERNELS=generic")
    print(f"{'shape':>10} {'Adam avx2':>10} {'Adam gen':>9} {'ratio':>6} {'SGD avx2':>9} {'SGD gen':>8} {'ratio':>6} "
          f"{'copy':>6}")
    for shape in runs["avx2"][0]:
        med = {k: {f: float(np.median([r[shape][f] for r in rs])) for f in ("adam", "sgd", "copy")}
               for k, rs in runs.items()}
        a, g = med["avx2"], med["generic"]
        print(f"{shape:>10} {a['adam']:>10.1f} {g['adam']:>9.1f} {a['adam'] / g['adam']:>6.2f} {a['sgd']:>9.1f} "
              f"{g['sgd']:>8.1f} {a['sgd'] / g['sgd']:>6.2f} {a['copy']:>6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
