"""Data-parallel training across processes on MPI: the one place normgrad talks to MPI.

Launch with ``mpirun -n N python train.py`` (``pip install "normgrad[mpi]"`` brings mpi4py
and Open MPI; a system MPI with its own mpi4py works too). In the script::

    from normgrad import mpi
    mpi.init()                                    # MPI up, AllReduce kernels configured,
                                                  # a failing rank ends the job
    trainer = mpi.DataParallelTrainer("net_step.onnx", "net_step.ckpt", lr=0.1)
    loss = trainer.step(mpi.shard(x), mpi.shard(labels))   # this rank's part of the global batch

or, with sessions of your own: ``mpi.broadcast(state)`` (rank 0's initial weights
everywhere) and ``onnxruntime.InferenceSession(path, mpi.session_options())``. The step
graph comes from ``normgrad export ... --data-parallel --sync-batch-norm``.

mpi4py is imported lazily (by :func:`init` and the functions that need a communicator), so
``import normgrad`` never needs MPI. Without :func:`init` every function here behaves as a
single process of rank 0: :func:`size` is 1, :func:`broadcast` and :func:`allreduce_array`
return their input, and the AllReduce operator is the identity.

How the C++ kernel reaches MPI: the library is built without MPI (no header, no link), so
one wheel works with or without it and with any MPI. :func:`init` hands it the addresses
of ``MPI_Alltoallv``, ``MPI_Allgatherv`` and ``MPI_Error_string`` in the MPI library
mpi4py itself loaded, the communicator's and ``MPI_BYTE``'s handles and the handle width
(pointers in Open MPI, ints in MPICH), through the library's exported
``normgrad_mpi_configure``. The kernel and mpi4py then share one MPI, whichever it is.

:mod:`normgrad.mpi.communicator` holds the communicator and its collectives, the C++ library's
configuration and :func:`abort_on_error`; :mod:`normgrad.mpi.data_parallel` the
:class:`DataParallelTrainer` built on them; :mod:`normgrad.util.mpi_launch` the launcher
helpers (:func:`launched_ranks`, :func:`mpirun_command`, :func:`mpirun_environment`); all
are exported from here.
"""

from __future__ import annotations

from normgrad.mpi import communicator
from normgrad.mpi.communicator import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    EXIT_WAIT_SECONDS,
    LAUNCHER_SIZE_VARIABLES,
    MPIUnavailableError,
    TIMEOUT_SECONDS,
    abort_on_error,
    allreduce_array,
    available,
    barrier,
    broadcast,
    comm,
    configure_library,
    configured_size,
    gather,
    init,
    initialized,
    launched_ranks,
    mpirun_command,
    mpirun_environment,
    rank,
    session_options,
    shard,
    size,
    timeout,
)
from normgrad.mpi.data_parallel import DataParallelTrainer

__all__ = [*communicator.__all__, "configured_size", "EXIT_WAIT_SECONDS", "trainer", "DataParallelTrainer"]


def trainer(step_model, checkpoint, **options):
    """A :class:`normgrad.train.Trainer` for ``mpirun`` (see :class:`DataParallelTrainer`)."""
    return DataParallelTrainer(step_model, checkpoint, **options)
