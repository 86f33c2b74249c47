"""Launching MPI jobs: how many ranks the launcher started this process with
(:func:`launched_ranks`), and the ``mpirun`` command and environment that start one
(:func:`mpirun_command`, :func:`mpirun_environment`, for ``normgrad bench --mpi`` and the
tests). Nothing here needs mpi4py; :mod:`normgrad.mpi` exports these names."""

from __future__ import annotations

import sys
from typing import Dict, List, Optional, Sequence

__all__ = ["LAUNCHER_SIZE_VARIABLES", "launched_ranks", "mpirun_command", "mpirun_environment"]

LAUNCHER_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
"""Environment variables through which MPI launchers tell a process how many ranks the job
has: Open MPI's mpirun; MPICH's Hydra (and Intel MPI, Slurm's PMI); MVAPICH2. The C++
AllReduce kernel reads the same list (ops/cpp/all_reduce.cc)."""


def launched_ranks() -> int:
    """How many ranks the MPI launcher started this job with, from the environment
    (:data:`LAUNCHER_SIZE_VARIABLES`); 1 outside a multi-rank launch."""
    import os

    for name in LAUNCHER_SIZE_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return max(1, int(value))
    return 1


def mpirun_command(ranks: int, forward: Sequence[str] = ()) -> Optional[List[str]]:
    """The command prefix that launches ``ranks`` processes: the ``mpirun`` beside this Python
    (the "mpi" extra's Open MPI) or else on PATH, with Open MPI's ``--oversubscribe`` (more
    ranks than cores) and ``-x VAR`` for each environment variable in ``forward``; None when
    there is no mpirun. Used by ``normgrad bench --mpi`` and the tests."""
    import pathlib
    import shutil
    import subprocess

    beside = pathlib.Path(sys.executable).parent / "mpirun"
    found = str(beside) if beside.is_file() else shutil.which("mpirun")
    if found is None:
        return None
    version = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=60).stdout
    command = [found]
    if "Open MPI" in version or "prte" in version.lower():
        command.append("--oversubscribe")
        for name in forward:
            command += ["-x", name]
    return command + ["-n", str(ranks)]


def mpirun_environment(**variables: str) -> Dict[str, str]:
    """This process's environment plus ``variables``, and, when running as root (containers),
    the two variables without which Open MPI refuses to start."""
    import os

    env = dict(os.environ, **variables)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env
