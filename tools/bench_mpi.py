"""``normgrad bench --mpi``: the ResNet basic block's training step on 1 and 2 MPI ranks.

The same global batch ``--resnet-shape`` [N, C, H, W] (default 16 64 56 56; ``--quick`` 4 8
16 16) is trained by one process, and by 2 ranks holding N/2 samples each, with the step
graph ``normgrad export --loss mse --optimizer sgd --momentum 0.9 --data-parallel
--sync-batch-norm`` writes (gradients averaged over the ranks in one bucketed AllReduce,
BatchNorm synchronized: 3 AllReduces per BatchNorm layer). The ``--threads`` cores are split
between the ranks (2 threads for 1 rank, 1 each for 2 ranks), so both rows use the same
cores. Each rank count runs as its own ``mpirun`` job (launched from here), the jobs
alternating for ``--repeat`` rounds (default 3) so that drifts in machine load hit both;
each job takes 1 warm-up step, then 5 timed steps (a step's time is the slowest rank's).
Printed: the median step time over all rounds and the range of the per-round medians; the
share of the step spent in communication, from onnxruntime's profiler (3 more steps in a
profiled session on every rank: the AllReduce nodes' time over the model_run time, mean over
the ranks, which includes waiting for the slower rank, part of what synchronization costs;
``(least)`` is the smallest rank's share); ``exchange alone``: the same AllReduces (sizes and
order of the step graph's) in a graph of their own, every rank starting together after a
barrier, median of 20: the cost of the exchange without waiting for a slower rank; and the
speed-up over one rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import numpy as np

__all__ = ["run_section"]

TIMED_STEPS, PROFILED_STEPS = 5, 3


def _worker(shape: List[int], threads: int) -> None:
    import onnxruntime

    import normgrad.mpi as mpi
    from normgrad.graphs import build_step_graph, build_training_graph
    from normgrad.graphs.optimizers import hyperparameter_feeds
    from normgrad.tools._bench_options import bench_session_options
    from normgrad.tools._bench_models import resnet_forward

    onnxruntime.set_default_logger_severity(3)
    comm = mpi.init()
    ranks = mpi.size()
    n, c, h, w = shape
    if n % ranks:
        raise SystemExit(f"normgrad bench --mpi: the global batch {n} is not a multiple of {ranks} ranks")
    local = [n // ranks, c, h, w]
    training = build_training_graph(resnet_forward(*local), loss="mse", data_parallel=True, sync_batch_norm=True)
    step_model, initial = build_step_graph(training, "sgd", momentum=0.9)
    meta = {p.key: json.loads(p.value) for p in step_model.metadata_props}
    state = mpi.broadcast(initial)
    rng = np.random.default_rng(0)
    x = mpi.shard(rng.standard_normal(shape, dtype=np.float32))
    labels = mpi.shard(rng.standard_normal(shape, dtype=np.float32))
    model_bytes = step_model.SerializeToString()

    def session(profile_prefix=None):
        options = bench_session_options(threads, profile_prefix, mpi.session_options())
        return onnxruntime.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])

    def stepper(sess):
        names = [o.name for o in sess.get_outputs()]
        current = {"state": dict(state), "k": 0}

        def run():
            current["k"] += 1
            feeds = {**hyperparameter_feeds(step_model), **current["state"], "x": x, "labels": labels, "lr": np.array(0.01, np.float32),
                     "step": np.array(current["k"], np.float32)}
            out = dict(zip(names, sess.run(None, feeds)))
            current["state"] = {name: out[meta["normgrad.state"][name]] for name in current["state"]}

        return run

    run = stepper(session())
    run()  # warm-up
    times = []
    for _ in range(TIMED_STEPS):
        mpi.barrier()  # every rank starts the step together; the barrier is not timed
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    step_times = [max(per_rank) for per_rank in zip(*comm.allgather(times))]

    with tempfile.TemporaryDirectory() as tmp:
        profiled = session(os.path.join(tmp, f"rank{mpi.rank()}"))
        run = stepper(profiled)
        for _ in range(PROFILED_STEPS + 1):
            run()
        with open(profiled.end_profiling()) as f:
            events = json.load(f)
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"])
    start = runs[0]["ts"] + runs[0]["dur"]  # the first profiled run is a warm-up
    all_reduce = [e["dur"] for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")
                  and e.get("args", {}).get("op_name") == "AllReduce" and e["ts"] >= start]
    share = sum(all_reduce) / max(1, sum(e["dur"] for e in runs[1:]))
    shares = comm.allgather(share)
    exchange = _exchange_alone(step_model, threads)
    if mpi.rank() == 0:
        calls = len(all_reduce) // PROFILED_STEPS
        print("RESULT " + json.dumps({"ranks": ranks, "times": step_times, "comm_share": statistics.mean(shares),
                                      "comm_share_min": min(shares), "exchange": exchange,
                                      "all_reduces_per_step": calls}), flush=True)


def _exchange_alone(step_model, threads: int, repeat: int = 20) -> float:
    """Seconds per step of the step graph's AllReduces alone (same sizes, same order, in one
    graph, every rank starting together): the exchange without the wait for a slower rank."""
    import onnx
    import onnx.helper as oh
    import onnxruntime

    import normgrad.mpi as mpi
    from normgrad.ops import IR_VERSION, ONNX_OPSET

    inferred = onnx.shape_inference.infer_shapes(step_model, data_prop=True)
    types = {v.name: v.type for v in list(inferred.graph.value_info) + list(inferred.graph.input)}
    nodes, inputs, feeds = [], [], {}
    for k, node in enumerate(n for n in step_model.graph.node if n.op_type == "AllReduce"):
        dims = [d.dim_value for d in types[node.input[0]].tensor_type.shape.dim]
        name = f"v{k}"
        inputs.append(oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, dims))
        nodes.append(oh.make_node("AllReduce", [name], [f"s{k}"], domain="normgrad"))
        feeds[name] = np.ones(dims, np.float32)
    outputs = [oh.make_tensor_value_info(n.output[0], onnx.TensorProto.FLOAT, None) for n in nodes]
    model = oh.make_model(oh.make_graph(nodes, "exchange", inputs, outputs), ir_version=IR_VERSION,
                          opset_imports=[oh.make_opsetid("", ONNX_OPSET), oh.make_opsetid("normgrad", 1)])
    options = mpi.session_options()
    options.intra_op_num_threads = threads
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    session.run(None, feeds)
    times = []
    for _ in range(repeat):
        mpi.barrier()
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return statistics.median(max(per_rank) for per_rank in zip(*mpi.comm().allgather(times)))


def run_section(shape: List[int], total_threads: int, rounds: int, out) -> int:
    """Launches the jobs, prints the section; returns 0, or 1 when a job failed."""
    import normgrad.mpi as mpi

    title = (f"\nData parallelism on MPI: ResNet basic block SGD step (--data-parallel --sync-batch-norm), "
             f"global batch x {list(shape)}, {total_threads} threads split between the ranks, {rounds} rounds")
    print(title, file=out)
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        mpi4py = None
    if mpi4py is None or mpi.mpirun_command(1) is None:
        print("  skipped: needs mpi4py and mpirun (pip install \"normgrad[mpi]\")", file=out)
        return 0
    env = mpi.mpirun_environment(OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    results: Dict[int, List[dict]] = {1: [], 2: []}
    for _ in range(rounds):
        for ranks in results:
            threads = max(1, total_threads // ranks)
            command = mpi.mpirun_command(ranks) + [sys.executable, "-m", "normgrad.tools.bench_mpi", "--worker",
                                "--shape", *map(str, shape), "--threads", str(threads)]
            job = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800, errors="replace")
            lines = [line for line in job.stdout.splitlines() if line.startswith("RESULT ")]
            if job.returncode != 0 or not lines:
                lines = (job.stderr + job.stdout).strip().splitlines()
                named = [line for line in lines if line.startswith("normgrad.mpi:") or "Error" in line]
                tail = " | ".join(named[:2] or lines[-3:])
                print(f"  {ranks} rank(s): job failed (exit {job.returncode}): {tail}", file=out)
                return 1
            results[ranks].append(json.loads(lines[-1][len("RESULT "):]))
    one = statistics.median(t for r in results[1] for t in r["times"])
    print(f"  {'ranks':>5}{'batch/rank':>12}{'threads/rank':>14}{'step median':>13}{'round medians':>22}"
          f"{'comm share':>12}{'(least)':>9}{'exchange alone':>16}{'all-reduces':>13}{'speed-up':>10}", file=out)
    for ranks, rows in results.items():
        median = statistics.median(t for r in rows for t in r["times"])
        per_round = [statistics.median(r["times"]) for r in rows]
        share = statistics.median(r["comm_share"] for r in rows)
        least = statistics.median(r["comm_share_min"] for r in rows)
        exchange = statistics.median(r["exchange"] for r in rows)
        span = f"{min(per_round) * 1e3:.1f}-{max(per_round) * 1e3:.1f} ms"
        print(f"  {ranks:>5}{shape[0] // ranks:>12}{max(1, total_threads // ranks):>14}{median * 1e3:>10.1f} ms"
              f"{span:>22}{share:>11.1%}{least:>9.1%}{exchange * 1e3:>13.2f} ms"
              f"{rows[0]['all_reduces_per_step']:>13}{one / median:>9.2f}x",
              file=out)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m normgrad.tools.bench_mpi", description="one rank of normgrad bench --mpi")
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--shape", type=int, nargs=4, required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    _worker(args.shape, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
