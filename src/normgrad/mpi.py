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

This module holds the communicator and its collectives, the C++ library's configuration
and :func:`abort_on_error`; :class:`DataParallelTrainer` lives in
:mod:`normgrad._data_parallel` (imported on first use), the launcher helpers
(:func:`launched_ranks`, :func:`mpirun_command`, :func:`mpirun_environment`) in
:mod:`normgrad._mpi_launch`; all are exported from here.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
import traceback
from typing import Dict, Mapping, Optional

import numpy as np

from normgrad._mpi_launch import LAUNCHER_SIZE_VARIABLES, launched_ranks, mpirun_command, mpirun_environment

__all__ = [
    "MPIUnavailableError",
    "available",
    "init",
    "initialized",
    "comm",
    "rank",
    "size",
    "configure_library",
    "session_options",
    "broadcast",
    "shard",
    "allreduce_array",
    "abort_on_error",
    "barrier",
    "trainer",
    "DataParallelTrainer",
    "mpirun_command",
    "mpirun_environment",
    "CollectiveTimeoutError",
    "CollectiveMismatchError",
    "TIMEOUT_SECONDS",
    "timeout",
    "gather",
    "launched_ranks",
    "LAUNCHER_SIZE_VARIABLES",
]

_comm = None  # the communicator of init(), None before
_exit_comm = None  # a duplicate of it, for the exit barrier of abort_on_error (no clash with _comm's collectives)
_gather_comm = None  # another duplicate, for gather()'s point-to-point messages
_gather_tag = 0
_pending_sends: list = []  # gather()'s sends not yet complete (their buffers must live until they are)
_timeout: Optional[float] = None  # init(timeout=); None: NORMGRAD_MPI_TIMEOUT or TIMEOUT_SECONDS

TIMEOUT_SECONDS = 1800.0
"""How long :func:`gather` (and so every check of :class:`DataParallelTrainer`: construction,
each step, save) waits for the other ranks by default: 30 minutes, torch.distributed's
default. ``init(timeout=)`` or the environment variable ``NORMGRAD_MPI_TIMEOUT`` change it."""


class CollectiveTimeoutError(RuntimeError):
    """Some ranks did not reach a collective of :mod:`normgrad.mpi` within the timeout."""


class CollectiveMismatchError(RuntimeError):
    """The ranks came to different collectives of :mod:`normgrad.mpi` (raised on every rank).

    Attributes:
        labels: what each rank came to, in rank order (the ``what`` of its :func:`gather`).
    """

    def __init__(self, labels):
        self.labels = list(labels)
        shown = ", ".join(f"rank {r}: {label}" for r, label in enumerate(self.labels))
        super().__init__(f"normgrad.mpi: the ranks came to different collectives ({shown}): they run different code "
                         "or different numbers of steps")


class MPIUnavailableError(RuntimeError):
    """mpi4py (or the MPI library under it) cannot be loaded."""


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise MPIUnavailableError(
            f"normgrad.mpi needs mpi4py and an MPI library ({error}); install them with "
            "`pip install \"normgrad[mpi]\"` (mpi4py and Open MPI) or use your system's MPI and mpi4py"
        ) from None
    return MPI


def available() -> bool:
    """Whether mpi4py and an MPI library can be loaded (importing it initialises MPI)."""
    try:
        _mpi()
    except (MPIUnavailableError, RuntimeError, OSError):
        return False
    return True


def unconfigured_message(ranks: int) -> str:
    """The refusal of an AllReduce run in a job of ``ranks`` ranks without :func:`init`."""
    return (f"AllReduce: this process is one of {ranks} MPI ranks but normgrad's AllReduce is not configured: "
            "call normgrad.mpi.init() before running a --data-parallel or --sync-batch-norm graph "
            "(unconfigured, each rank would train on its own gradients)")


def timeout() -> float:
    """Seconds :func:`gather` waits for the other ranks (see :data:`TIMEOUT_SECONDS`)."""
    import os

    if _timeout is not None:
        return _timeout
    text = os.environ.get("NORMGRAD_MPI_TIMEOUT")
    if text is None:
        return TIMEOUT_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"NORMGRAD_MPI_TIMEOUT must be a positive number of seconds, got {text!r}")
    return value


def gather(value, what: str, seconds: Optional[float] = None) -> list:
    """Every rank's ``value`` (picklable, small), in rank order, waiting at most ``seconds``
    (default :func:`timeout`) for the others. Point-to-point messages on a private
    communicator, so a rank that never comes is named. Each message carries ``what`` (the
    same text on every rank at the same collective), so that a rank at another collective is
    never read as this one. Without :func:`init`: ``[value]``.

    Raises:
        CollectiveTimeoutError: naming the ranks that had not reached ``what`` in time.
        CollectiveMismatchError: (on every rank) some rank came to another collective.
    """
    global _gather_tag
    if _comm is None or size() == 1:
        return [value]
    limit = timeout() if seconds is None else float(seconds)
    me, ranks = rank(), size()
    _gather_tag = _gather_tag % 30000 + 1  # every rank calls gather in the same order: the same tag
    _pending_sends[:] = [request for request in _pending_sends if not request.Test()]
    _pending_sends.extend(_gather_comm.isend((what, value), dest=r, tag=_gather_tag) for r in range(ranks) if r != me)
    received = {me: (what, value)}
    deadline, pause = time.monotonic() + limit, 1e-4
    while len(received) < ranks:
        arrived = [r for r in range(ranks) if r not in received and _gather_comm.iprobe(source=r, tag=_gather_tag)]
        for r in arrived:
            received[r] = _gather_comm.recv(source=r, tag=_gather_tag)
        if len(received) == ranks:
            break
        if time.monotonic() > deadline:
            silent = [r for r in range(ranks) if r not in received]
            raise CollectiveTimeoutError(
                f"normgrad.mpi: rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} of {ranks} did not "
                f"reach {what} within {limit:g} s (rank {me} waited): a rank hangs or runs other code; "
                "NORMGRAD_MPI_TIMEOUT or normgrad.mpi.init(timeout=) sets the limit")
        if not arrived:
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
    if any(received[r][0] != what for r in range(ranks)):
        raise CollectiveMismatchError(received[r][0] for r in range(ranks))
    return [received[r][1] for r in range(ranks)]


def init(communicator=None, abort: bool = True, library: bool = True, timeout: Optional[float] = None):
    """Starts MPI (through mpi4py) and makes ``communicator`` (default ``COMM_WORLD``) the one
    normgrad uses: :func:`rank`, :func:`size`, :func:`broadcast`, :func:`shard` and the
    AllReduce kernels. Calling it again switches the communicator.

    Args:
        communicator: an ``mpi4py.MPI.Comm``; None for ``COMM_WORLD``.
        abort: install :func:`abort_on_error` (an uncaught exception on any rank ends the job).
        library: configure the C++ library's AllReduce kernel (skipped, with no error, when
            normgrad was installed without its C++ library).
        timeout: seconds :func:`gather` waits for the other ranks (default
            ``NORMGRAD_MPI_TIMEOUT`` or :data:`TIMEOUT_SECONDS`).

    Returns:
        The communicator.

    Raises:
        MPIUnavailableError: mpi4py or MPI cannot be loaded.
    """
    global _comm, _exit_comm, _gather_comm, _timeout
    if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise ValueError(f"normgrad.mpi.init: timeout must be a positive number of seconds, got {timeout!r}")
    MPI = _mpi()
    _comm = MPI.COMM_WORLD if communicator is None else communicator
    _exit_comm = _comm.Dup()
    _gather_comm = _comm.Dup()
    _timeout = None if timeout is None else float(timeout)
    if abort:
        abort_on_error()
    if library:
        try:
            configure_library(_comm)
        except FileNotFoundError:
            pass
    return _comm


def initialized() -> bool:
    """Whether :func:`init` has run in this process."""
    return _comm is not None


def comm():
    """The communicator of :func:`init`, or None."""
    return _comm


def rank() -> int:
    """This process's rank in the communicator (0 without :func:`init`)."""
    return _comm.Get_rank() if _comm is not None else 0


def size() -> int:
    """The number of ranks (1 without :func:`init`)."""
    return _comm.Get_size() if _comm is not None else 1


def _library():
    import normgrad

    return ctypes.CDLL(normgrad.library_path())


def configure_library(communicator) -> None:
    """Points the C++ library's AllReduce kernel at ``communicator`` (an ``mpi4py.MPI.Comm``,
    or None to make it the identity again, also in a job of several ranks, where the
    kernel refuses to run before any configuration).

    Raises:
        FileNotFoundError: normgrad's C++ library is not installed.
        RuntimeError: the library refused the configuration.
    """
    library = _library()
    configure = library.normgrad_mpi_configure
    configure.restype = ctypes.c_int
    configure.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    if communicator is None:
        status = configure(0, None, None, None, 0, 0, 0, 1)
    else:
        MPI = _mpi()
        handle_size = MPI._sizeof(MPI.Comm)
        if MPI._sizeof(MPI.Datatype) != handle_size:
            raise RuntimeError("this MPI's communicator and datatype handles differ in width; normgrad supports "
                               "pointer handles (Open MPI) and int handles (MPICH)")
        mpi_library = ctypes.CDLL(MPI.__file__)  # symbol lookup reaches the libmpi it links
        address = lambda name: ctypes.cast(getattr(mpi_library, name), ctypes.c_void_p).value
        status = configure(handle_size, address("MPI_Alltoallv"), address("MPI_Allgatherv"), address("MPI_Error_string"),
                           MPI._handleof(communicator), MPI._handleof(MPI.BYTE), communicator.Get_rank(),
                           communicator.Get_size())
    if status != 0:
        raise RuntimeError("normgrad's C++ library refused the MPI configuration")


def configured_size() -> int:
    """How many ranks the C++ AllReduce kernel sums over (1: the identity)."""
    library = _library()
    library.normgrad_mpi_size.restype = ctypes.c_int
    return library.normgrad_mpi_size()


def session_options(backend: str = "cpp", options=None):
    """``normgrad.session_options(backend)`` for graphs with AllReduce nodes: sequential
    execution, so every rank runs the collectives in the same (graph) order."""
    import normgrad

    return _sequential(normgrad.session_options(backend, options))


def broadcast(arrays: Optional[Mapping[str, np.ndarray]], root: int = 0) -> Dict[str, np.ndarray]:
    """Rank ``root``'s arrays on every rank (names, shapes, dtypes and values), e.g. the
    initial weights, so that every rank starts from the same state. A rank other than the
    root may pass None to receive whatever the root sends. Without :func:`init`: a copy of
    ``arrays``.

    Raises:
        ValueError: a rank's names differ from the root's (the ranks run different models).
    """
    if _comm is None or size() == 1:
        return {name: np.array(value) for name, value in (arrays or {}).items()}
    is_root = rank() == root
    if is_root and arrays is None:
        raise ValueError("normgrad.mpi.broadcast: the root rank must pass the arrays")
    layout = None if arrays is None else [(name, np.asarray(v).dtype, np.asarray(v).shape) for name, v in arrays.items()]
    layouts = gather(layout, f"a broadcast from rank {root}")
    root_layout, root_names = layouts[root], [n for n, _, _ in layouts[root]]
    differ = [r for r, theirs in enumerate(layouts) if theirs is not None and [n for n, _, _ in theirs] != root_names]
    if differ:
        example = sorted({n for n, _, _ in layouts[differ[0]]} ^ set(root_names))[:3] or "a different order"
        raise ValueError(f"normgrad.mpi.broadcast: ranks {differ} pass other tensors than rank {root} (e.g. {example})")
    result = {}
    for name, dtype, shape in root_layout:
        buffer = np.array(arrays[name], order="C") if is_root else np.empty(shape, dtype)
        _comm.Bcast(buffer.reshape(-1).view(np.uint8), root=root)
        result[name] = buffer
    return result


def shard(data: np.ndarray, axis: int = 0) -> np.ndarray:
    """This rank's contiguous part of ``data`` along ``axis`` (rank r of N gets the r-th of N
    equal parts), e.g. its share of a global batch. Without :func:`init`: ``data``.

    Raises:
        ValueError: the axis length is not a multiple of the number of ranks (unequal parts
            would weight the ranks' samples unequally in the averaged gradient).
    """
    data = np.asarray(data)
    ranks = size()
    length = data.shape[axis]
    if length % ranks:
        raise ValueError(
            f"normgrad.mpi.shard: {length} samples along axis {axis} cannot be split evenly over {ranks} ranks"
        )
    part = length // ranks
    return np.take(data, np.arange(rank() * part, (rank() + 1) * part), axis=axis)


def allreduce_array(array: np.ndarray) -> np.ndarray:
    """The sum of ``array`` over the ranks, through mpi4py (what the Python kernel of
    AllReduce runs): rank-order float64 sum rounded once, as the C++ kernel. Without
    :func:`init` or with one rank: a copy of ``array``."""
    array = np.asarray(array)
    if _comm is None or size() == 1:
        return array.copy()
    parts = _comm.allgather(array)
    total = np.zeros(array.shape, np.float64)
    for part in parts:
        total += part.astype(np.float64)
    return total.astype(array.dtype)


def trainer(step_model, checkpoint, **options):
    """A :class:`normgrad.train.Trainer` for ``mpirun`` (see :class:`DataParallelTrainer`)."""
    return __getattr__("DataParallelTrainer")(step_model, checkpoint, **options)


def _sequential(options):
    import onnxruntime

    options = options if options is not None else onnxruntime.SessionOptions()
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    return options


def __getattr__(name: str):
    if name == "DataParallelTrainer":  # imported on first use: normgrad.train is not imported before
        from normgrad._data_parallel import DataParallelTrainer

        return globals().setdefault(name, DataParallelTrainer)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def barrier() -> None:
    """Waits for every rank (nothing without :func:`init`)."""
    if _comm is not None:
        _comm.Barrier()


_hook_installed = False
EXIT_WAIT_SECONDS = 120.0
"""How long a rank that leaves the program waits at exit for the others to leave too before
aborting the job (``NORMGRAD_MPI_EXIT_WAIT`` overrides it)."""


def _abort(message: str, code: int = 1) -> None:
    sys.stderr.write(f"normgrad.mpi: rank {rank()} of {size()} {message}; aborting the job\n")
    sys.stderr.flush()
    if _comm is not None and size() > 1:
        _comm.Abort(code)


_exit_status = None  # the status of the SystemExit that ended a script run by main()


def _exit_code(status) -> int:
    """The process exit status Python gives ``SystemExit(status)``."""
    return status if isinstance(status, int) else 0 if status is None else 1


def main(argv: Optional[list] = None) -> None:
    """``python -m normgrad.mpi SCRIPT [ARG ...]`` (or ``-m MODULE [ARG ...]``) runs the script
    as ``python SCRIPT`` would, as ``__main__``, and records the status of a ``SystemExit``
    that ends it (``sys.exit(3)``, ``raise SystemExit(3)``) for :func:`abort_on_error`, as
    ``python -m mpi4py`` does: Python hands an uncaught SystemExit to no hook."""
    import os
    import runpy

    global _exit_status
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2):
        sys.stderr.write("usage: python -m normgrad.mpi SCRIPT [ARG ...] | -m MODULE [ARG ...]\n")
        raise SystemExit(0 if args[:1] in (["-h"], ["--help"]) else 2)
    try:
        if args[0] == "-m":
            sys.argv = args[1:]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = args
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as ended:
        _exit_status = ended.code
        raise


def abort_on_error() -> None:
    """Makes a rank that fails end the whole job within a bounded time, with a message
    naming the rank, instead of the other ranks waiting forever in their next collective
    (through ``sys.excepthook``, ``threading.excepthook`` and ``atexit``; nothing is replaced):

    * an uncaught exception (main thread or another thread): the traceback, then ``MPI_Abort``;
    * a script run as ``python -m normgrad.mpi SCRIPT`` (:func:`main`) that ends with a
      non-zero ``SystemExit`` (``sys.exit(3)``, ``raise SystemExit(3)``): ``MPI_Abort`` with
      that status, at exit;
    * leaving the program in any other way while other ranks still run (a script run as
      ``python SCRIPT`` ending with a ``SystemExit`` among them: Python hands it to no hook):
      the rank waits at exit (in a non-blocking barrier) up to ``NORMGRAD_MPI_EXIT_WAIT``
      seconds (default 120) for the others, then aborts;
    * a rank killed by a signal is reported and ended by mpirun itself.
    """
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    import atexit
    import os

    previous_hook = sys.excepthook

    def report_and_abort(kind, value, tb) -> None:
        try:
            sys.stderr.write("".join(traceback.format_exception(kind, value, tb)))
        finally:
            _abort(f"raised {kind.__name__}: {value}")
            previous_hook(kind, value, tb)

    def wait_for_the_others() -> None:
        if _exit_comm is None or size() == 1:
            return
        if _exit_code(_exit_status):
            _abort(f"raised SystemExit({_exit_status!r})", _exit_code(_exit_status))
        wait = float(os.environ.get("NORMGRAD_MPI_EXIT_WAIT", EXIT_WAIT_SECONDS))
        try:
            request = _exit_comm.Ibarrier()
            deadline = time.monotonic() + wait
            while not request.Test():
                if time.monotonic() > deadline:
                    _abort(f"left the program while other ranks still run (waited {wait:g} s for them at exit)")
                time.sleep(0.01)
        except Exception as error:  # noqa: BLE001 - any failure here must still end the job
            _abort(f"failed at exit ({error})")

    sys.excepthook = report_and_abort
    threading.excepthook = lambda args: report_and_abort(args.exc_type, args.exc_value, args.exc_traceback)
    atexit.register(wait_for_the_others)


if __name__ == "__main__":  # python -m normgrad.mpi SCRIPT: the imported module (the script's normgrad.mpi) runs it
    from normgrad import mpi

    mpi.main()
