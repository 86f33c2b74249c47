"""normgrad: normalization-layer gradients as ONNX custom operators.

The public API:

* :data:`DOMAIN`: the operators' ONNX domain.
* :func:`session_options`: onnxruntime ``SessionOptions`` with normgrad kernels registered.
* :func:`add_functions`: attach the operators' function bodies to a model.
* :func:`inference_session`: an onnxruntime session with kernels or function bodies, and
  an error that says what to register when a model has neither
  (:class:`NormgradSessionError`).
* :func:`library_path`: the compiled custom-op library.
* :func:`prepare_for_python_kernels`: rewrite normgrad nodes so the Python kernels take them.
* :func:`check_attributes`: every normgrad node's attributes against its operator.
* :class:`TrainerError`, :class:`CheckpointError`, :class:`LoraError`: a user's mistake in
  training (:mod:`normgrad.errors`).

Training: :mod:`normgrad.graphs` (training and step graphs), :mod:`normgrad.train`
(``Trainer``: step graphs run with their state in onnxruntime), :mod:`normgrad.checkpoint`.
"""

from __future__ import annotations

from normgrad.errors import CheckpointError, LoraError, TrainerError
from normgrad.ops import DOMAIN, OPSET_VERSION, NormgradInputError
from normgrad.util.version import __version__
from normgrad.ops import api
from normgrad.ops.api import (
    NormgradSessionError,
    add_functions,
    check_attributes,
    inference_session,
    library_path,
    prepare_for_python_kernels,
    session_options,
)

__all__ = ["CheckpointError", "DOMAIN", "OPSET_VERSION", "NormgradInputError", "LoraError", "TrainerError",
           *api.__all__]

_SUBMODULES = ("checkpoint", "graphs", "mpi", "ops", "tools", "torch", "train")


def __getattr__(name: str):
    """``normgrad.torch``, ``normgrad.train``, ... without importing them first: each is
    imported on first use, so the optional dependencies some need (torch, mpi4py) load
    only for those who use them."""
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"normgrad.{name}")
    raise AttributeError(f"module 'normgrad' has no attribute '{name}'")
