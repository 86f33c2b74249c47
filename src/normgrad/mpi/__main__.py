"""``python -m normgrad.mpi SCRIPT [ARG ...]`` (or ``-m MODULE [ARG ...]``): runs the script
under :func:`normgrad.mpi.communicator.main`, in the imported ``normgrad.mpi``."""

from normgrad.mpi.communicator import main

main()
