"""Data-parallel training on 2 MPI ranks (loopback), launched with mpirun from here: each test
runs tests/mpi_worker.py under ``mpirun -n 2`` with a timeout, so no MPI test can hang the
suite. Skipped when mpi4py or mpirun is missing (``pip install "normgrad[mpi]"``)."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from normgrad import mpi

from _artifacts import frozen_base_step
from _helpers import cpp_available

pytest.importorskip("mpi4py")
WORKER = pathlib.Path(__file__).with_name("mpi_worker.py")
TIMEOUT = 1800  # a hang guard for any one job (they take seconds; several on a loaded machine)
# A job whose failure handling is broken never ends: the other ranks wait forever in a collective
# (a failing rank) or far longer than TIMEOUT (a hanging rank sleeps an hour), so a job that ends
# ended through it; no test reads the clock.
RANKS = 2
MPIRUN = mpi.mpirun_command(RANKS, forward=["NORMGRAD_MPI_EXIT_WAIT"])
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(MPIRUN is None, reason="mpirun not found"),
    pytest.mark.skipif(not cpp_available(), reason="the AllReduce kernel is in the C++ library"),
]


def run_job(*args: str, timeout: float = TIMEOUT, runner: bool = False) -> subprocess.CompletedProcess:
    """``mpirun -n 2 python tests/mpi_worker.py ARGS`` (``runner``: ``python -m normgrad.mpi tests/mpi_worker.py``)."""
    env = mpi.mpirun_environment(NORMGRAD_MPI_EXIT_WAIT="3", PYTHONUNBUFFERED="1")
    command = MPIRUN + [sys.executable, *(["-m", "normgrad.mpi"] if runner else []), str(WORKER), *args]
    # its own process group, so that a job that overruns is ended whole (mpirun and its ranks)
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                           errors="replace", start_new_session=True)
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        stdout, stderr = job.communicate()
        pytest.fail(f"{' '.join(args)}: no result within {timeout} s (hang?)\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, job.returncode, stdout, stderr)


def test_all_reduce_on_two_ranks():
    result = run_job("allreduce")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "allreduce ok on 2 ranks" in result.stdout


@pytest.mark.parametrize("mode", ["sync", "local"])
def test_two_ranks_train_as_one_process(mode):
    """sync: 2 ranks x batch 2 with SyncBatchNorm = 1 process x batch 4 (loss, gradients and
    weights after 3 SGD steps within 1e-5 of their scale, also against float64 torch), and
    bitwise the same weights in a second job;
    local: per-rank BatchNorm with averaged gradients = torch DDP's semantics."""
    result = run_job("train", mode)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"train {mode} ok on 2 ranks" in result.stdout, result.stdout + result.stderr
    if mode == "sync":  # run to run: a second job ends with bitwise the same weights
        again = run_job("train", mode)
        digests = [re.search(r"state digest (\w+)", r.stdout) for r in (result, again)]
        assert all(digests) and digests[0].group(1) == digests[1].group(1), again.stdout + again.stderr


def test_data_parallel_trainer_trains_as_one_process(tmp_path):
    """mpi.DataParallelTrainer on 2 ranks x batch 2 = Trainer on 1 process x batch 4: losses and
    the whole state (weights, momentum, running statistics) after 3 steps; rank 0's initial
    weights win over the others'; rank 0's checkpoint is complete when save() returns."""
    result = run_job("trainer", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "trainer ok on 2 ranks" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("mode, runner, names_it", [
    ("raise", False, r"normgrad\.mpi: rank 1 of 2 raised RuntimeError: deliberate failure"),
    ("exit", True, r"normgrad\.mpi: rank 1 of 2 raised SystemExit\(3\)"),
    ("systemexit", True, r"normgrad\.mpi: rank 1 of 2 raised SystemExit\(3\)"),
    # run as `python SCRIPT`, no hook sees the SystemExit: the rank leaves, waits, then aborts
    ("systemexit", False, r"normgrad\.mpi: rank 1 of 2 left the program while other ranks still run"),
    ("leave", False, r"normgrad\.mpi: rank 1 of 2 left the program while other ranks still run"),
    ("die", False, r"rank 1 with PID \d+ on node \S+ exited on\s+signal 9"),
])
def test_a_failing_rank_ends_the_job(mode, runner, names_it):
    """``runner``: the job runs ``python -m normgrad.mpi tests/mpi_worker.py``, which records
    the status of a SystemExit ending the script: the job ends with it."""
    result = run_job(mode, "1", runner=runner)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert re.search(names_it, output), output
    if runner:
        assert result.returncode == 3, output


def test_runner_runs_the_script_as_python_would(tmp_path):
    """``python -m normgrad.mpi SCRIPT ARG...`` runs SCRIPT as ``__main__`` with ``sys.argv``
    ``[SCRIPT, ARG...]`` and SCRIPT's folder first on ``sys.path`` (``-m MODULE`` likewise), and
    ends with its exit status."""
    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    (tmp_path / "script.py").write_text("import sys, helper\nprint(__name__, sys.argv[1:], helper.VALUE)\nsys.exit(3)\n")
    by_path = subprocess.run([sys.executable, "-m", "normgrad.mpi", str(tmp_path / "script.py"), "a", "b"],
                             capture_output=True, text=True, timeout=TIMEOUT)
    by_module = subprocess.run([sys.executable, "-m", "normgrad.mpi", "-m", "script", "a", "b"], cwd=tmp_path,
                               capture_output=True, text=True, timeout=TIMEOUT)
    for result in (by_path, by_module):
        assert result.returncode == 3, result.stderr
        assert result.stdout == "__main__ ['a', 'b'] 7\n", result.stdout + result.stderr


def test_all_reduce_refuses_to_run_without_init():
    """A --data-parallel step graph run under mpirun without normgrad.mpi.init(): the C++
    kernel fails naming normgrad.mpi.init(), the Python kernel reports it (NaN loss)."""
    result = run_job("unconfigured")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("unconfigured ok") == RANKS, result.stdout + result.stderr


@pytest.mark.parametrize("kind", ["sizes", "differ", "options"])
def test_data_parallel_trainer_refuses_ranks_that_disagree(kind):
    """sizes: per-rank batches of 4 and 3 samples; differ: SGD momentum 0.9 on rank 0, 0.5 on
    rank 1 in the step graph; options: rank 1 alone gives the Trainer a weight decay. Every rank raises a TrainerError naming the ranks and what differs."""
    result = run_job(kind)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(f"{kind} ok on rank") == RANKS, result.stdout + result.stderr


def test_fit_on_two_ranks(tmp_path):
    """normgrad.loop.fit with per-rank shards of the training and validation batches, a
    metric, early stopping and checkpoints: both ranks agree on every record, whose
    validation loss and metric are those of the whole set (mpi_worker.check_fit)."""
    result = run_job("fit", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("fit ok on rank") == RANKS, result.stdout + result.stderr


@pytest.mark.parametrize("ends_with", ["evaluation", "checkpoint", "neither"])
def test_fit_with_unequal_shards_is_one_error_on_every_rank(tmp_path, ends_with):
    """Rank 0 holds 3 training batches, rank 1 2: at step 3 rank 1 comes to the end of the
    epoch instead (with or without an evaluation or checkpoint there). Every collective carries what it is, so each rank
    raises the same TrainerError naming the ranks and where they came to, and the job
    ends (mpi_worker.check_unequal_shards); no other collective's values read as a step's."""
    result = run_job("unequal", str(tmp_path), ends_with)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("unequal shards ok on rank") == RANKS, result.stdout + result.stderr


def test_a_hanging_rank_times_out_naming_it():
    """Rank 1 sleeps before its first step; rank 0 fails after the 3 s timeout, naming rank 1,
    and the job ends long before rank 1 wakes up (it sleeps an hour, past the hang guard)."""
    result = run_job("hang", "1", "3")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert re.search(r"CollectiveTimeoutError: normgrad\.mpi: rank 1 of 2 did not reach step 1 within 3 s", output), output


def test_bench_mpi_prints_both_rank_counts():
    """``normgrad bench --mpi --quick`` (one round): a row for 1 and for 2 ranks; no timing asserted."""
    result = subprocess.run([sys.executable, "-m", "normgrad.tools.cli", "bench", "--mpi", "--quick", "--repeat", "1"],
                            capture_output=True, text=True, timeout=TIMEOUT, env=mpi.mpirun_environment())
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"\s+[12]\s+\d+\s+\d+\s+[\d.]+ ms", line)]
    assert [row[:3] for row in rows] == [["1", "4", "2"], ["2", "2", "1"]], result.stdout


DATA_PARALLEL = """
import sys
from normgrad import mpi
from normgrad.util.external_data import uses_external_data
from normgrad.train import TrainerError
mpi.init(abort=False, library=False)
try:
    trainer = mpi.DataParallelTrainer(sys.argv[1], sys.argv[2], lr=0.1, kernels=None)
except TrainerError as error:
    print("TrainerError:", error)
    sys.exit(3)
print(sorted(t.name for t in trainer.step_model.graph.initializer if uses_external_data(t)))
"""


@pytest.mark.slow
def test_the_data_parallel_trainer_keeps_the_frozen_base_in_its_file(tmp_path):
    """mpi.DataParallelTrainer loads the step graph as the Trainer does: the frozen base stays
    external (no 2 GiB protobuf limit), and a missing base is one TrainerError naming it."""
    pytest.importorskip("mpi4py")
    from normgrad import mpi

    mpirun = mpi.mpirun_command(1)
    if mpirun is None:
        pytest.skip("mpirun not found")
    step, ckpt = frozen_base_step(tmp_path)
    run = mpirun + [sys.executable, "-c", DATA_PARALLEL, str(step), str(ckpt)]
    done = subprocess.run(run, capture_output=True, text=True, timeout=300, env=mpi.mpirun_environment())
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "['w1']", done.stderr[-2000:]
    os.rename(tmp_path / "forward.onnx.data", tmp_path / "moved.data")
    done = subprocess.run(run, capture_output=True, text=True, timeout=300, env=mpi.mpirun_environment())
    assert done.returncode != 0, done.stderr[-2000:]
    assert "external data of tensor 'w1' is missing" in done.stdout and "forward.onnx.data" in done.stdout
