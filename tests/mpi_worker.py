"""Programs the MPI tests launch under ``mpirun -n N`` (tests/test_mpi.py): each checks
what it computes on every rank and raises on a mismatch (which aborts the whole job).

    python tests/mpi_worker.py allreduce      AllReduce kernels against the reference
    python tests/mpi_worker.py raise RANK     RANK raises after MPI is up; the others wait
    python tests/mpi_worker.py exit RANK      RANK calls sys.exit(3); the others wait
    python tests/mpi_worker.py die RANK       RANK is killed by SIGKILL; the others wait
"""

from __future__ import annotations

import os
import signal
import sys
import time

import ml_dtypes
import numpy as np

from normgrad import mpi
from normgrad.ops import all_reduce, harness

TOLERANCE = {np.dtype(np.float16): 2e-3, np.dtype(ml_dtypes.bfloat16): 1.6e-2}


def _bits(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def check_allreduce() -> None:
    comm = mpi.comm()
    assert mpi.configured_size() == mpi.size(), (mpi.configured_size(), mpi.size())
    rng = np.random.default_rng(100 + mpi.rank())
    # sizes below, at and across the chunking (one element, fewer elements than ranks, odd
    # lengths) and across one 2**22-element segment boundary
    shapes = [(), (0,), (1,), (3, 5), (2, 1000)]
    for dtype in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16):
        for shape in shapes + ([(2**22 + 7,)] if dtype == np.float32 else []):
            value = (rng.normal(size=shape) * 3).astype(dtype)
            everyone = comm.allgather(value)
            expected = all_reduce.reference(*everyone).output
            # the Python bridge: float32 only, and it hands rank-0 outputs back as [1]
            python = dtype == np.float32 and 0 < value.ndim and value.size < 10**6
            backends = ["cpp"] + (["python"] if python else [])
            for backend in backends:
                runs = [harness.run(backend, "AllReduce", {"input": value})["output"] for _ in range(2)]
                got = runs[0]
                assert got.dtype == np.dtype(dtype) and got.shape == value.shape, (backend, got.dtype, got.shape)
                assert _bits(runs[1]) == _bits(got), f"{backend} {dtype} {shape}: two runs differ"
                if np.dtype(dtype) in TOLERANCE:
                    scale = max(1.0, float(np.abs(expected.astype(np.float64)).max())) if value.size else 1.0
                    error = float(np.abs(got.astype(np.float64) - expected.astype(np.float64)).max()) if value.size else 0.0
                    assert error <= TOLERANCE[np.dtype(dtype)] * scale, f"{backend} {dtype} {shape}: error {error}"
                else:  # float64 sum in rank order rounded once: the reference's bits
                    assert _bits(got) == _bits(expected), f"{backend} {dtype} {shape}: not the reference's bits"
                others = comm.allgather(_bits(got))
                assert all(bits == others[0] for bits in others), f"{backend} {dtype} {shape}: ranks differ"
    if mpi.rank() == 0:
        print(f"allreduce ok on {mpi.size()} ranks")


def wait_then_fail(mode: str, victim: int) -> None:
    """Rank ``victim`` fails; every other rank blocks in a collective it can never finish."""
    mpi.barrier()
    if mpi.rank() == victim:
        time.sleep(0.5)
        if mode == "raise":
            raise RuntimeError("deliberate failure for the test")
        if mode == "exit":
            raise SystemExit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    mpi.comm().allreduce(1)  # the victim never joins
    time.sleep(600)


def main(argv) -> None:
    mpi.init()
    if argv[0] == "allreduce":
        check_allreduce()
    elif argv[0] in ("raise", "exit", "die"):
        wait_then_fail(argv[0], int(argv[1]))
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
