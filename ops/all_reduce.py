"""AllReduce: the elementwise sum of a tensor over the ranks of an MPI communicator.

Every rank passes a tensor of the same shape and element type; every rank gets the sum of
all of them, bitwise the same on every rank. This is the collective that data-parallel
training graphs (``normgrad export --data-parallel``) and synchronized BatchNorm
(``--sync-batch-norm``) are built on.

Input:
    input (T): any shape (rank 0 included).

Output:
    output (T): the shape and type of ``input``; the sum over the ranks.

T is float, float16, bfloat16 or double. With no communicator configured (a single
process, or ``normgrad.mpi`` not initialised) or a communicator of one rank, the operator
is the identity, which is also its function body: the same graph runs single-process in
any runtime. The kernels refuse to run unconfigured in a process the MPI launcher started
as one of several ranks (``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE`` or ``MV2_COMM_WORLD_SIZE``
above 1), with an error naming ``normgrad.mpi.init()``, instead of returning this rank's
own tensor (``normgrad.mpi.configure_library(None)`` opts the C++ kernel out of that).

The C++ kernel sums in a fixed order (rank 0 + rank 1 + ... in float64, rounded once to
T), whatever algorithm the MPI library would pick for ``MPI_Allreduce``, so results are
reproducible run to run and identical on every rank; float16 and bfloat16 are summed
exactly that way too (MPI has no portable float16 type). See ``normgrad.mpi``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
import onnx.parser
from onnx.defs import OpSchema

import normgrad.ops._common as _common
from normgrad.ops._common import NormgradInputError
from normgrad.util.mpi_launch import launched_ranks

__all__ = ["OP_TYPE", "INPUTS", "OUTPUTS", "ATTRIBUTES", "OUTPUT_SHAPE_FROM", "TYPES", "Result",
           "validate", "reference", "set_communicator", "unconfigured_message", "sum_over_ranks", "python_kernel",
           "schema", "function_body"]

OP_TYPE = "AllReduce"
INPUTS = ("input",)
OUTPUTS = ("output",)
ATTRIBUTES: dict = {}
OUTPUT_SHAPE_FROM = {"output": ("input", None)}
"""Each output's shape as (input, axis): input.shape[axis], or the whole shape for None."""
TYPES = _common.FLOAT_TYPES + ("tensor(double)",)
"""Element types of T (the other operators' three, plus double)."""


class Result(NamedTuple):
    """The one output."""

    output: np.ndarray


def validate(input, *other_ranks):
    """Checks ``input`` (and, for the reference, the other ranks' inputs: same shape and dtype).

    Returns:
        The inputs as arrays, in the order given.

    Raises:
        NormgradInputError: naming the offending input and the rule it broke.
    """
    arrays = []
    for index, value in enumerate((input, *other_ranks)):
        name = "input" if index == 0 else f"input of rank {index}"
        array = np.asarray(value)
        if not _common.is_float_dtype(array.dtype):
            raise NormgradInputError(
                f"{OP_TYPE}: input '{name}' must be float32, float16, bfloat16 or float64; got {array.dtype}"
            )
        if arrays:
            _common.check_same_shape(OP_TYPE, name, array, "input", arrays[0])
        arrays.append(array)
    return tuple(arrays)


def reference(input, *other_ranks) -> Result:
    """The operator in float64 NumPy: the sum of the inputs of every rank (``input`` is rank
    0's, ``other_ranks`` the others' in rank order), rounded once to T. One rank: ``input``.
    """
    arrays = validate(input, *other_ranks)
    total = np.zeros(arrays[0].shape, np.float64)
    for array in arrays:
        total += array.astype(np.float64)
    return Result(total.astype(arrays[0].dtype))


_communicator = None
"""The mpi4py communicator the Python kernel sums over; None (the identity) until
``normgrad.mpi.init`` hands its own down through :func:`set_communicator`."""


def set_communicator(communicator) -> None:
    """Makes ``communicator`` (an ``mpi4py.MPI.Comm``; None: none) the one the Python kernel sums over."""
    global _communicator
    _communicator = communicator


def unconfigured_message(ranks: int) -> str:
    """The refusal of an AllReduce run in a job of ``ranks`` ranks without ``normgrad.mpi.init()``."""
    return (f"AllReduce: this process is one of {ranks} MPI ranks but normgrad's AllReduce is not configured: "
            "call normgrad.mpi.init() before running a --data-parallel or --sync-batch-norm graph "
            "(unconfigured, each rank would train on its own gradients)")


def sum_over_ranks(array: np.ndarray, communicator) -> np.ndarray:
    """The sum of ``array`` over the ranks of ``communicator`` (an ``mpi4py.MPI.Comm``):
    rank-order float64 sum rounded once, as the C++ kernel. With None or one rank: a copy
    of ``array``."""
    array = np.asarray(array)
    if communicator is None or communicator.Get_size() == 1:
        return array.copy()
    parts = communicator.allgather(array)
    total = np.zeros(array.shape, np.float64)
    for part in parts:
        total += part.astype(np.float64)
    return total.astype(array.dtype)


def python_kernel(input) -> Result:
    """What the float32 Python kernel runs: the sum over the communicator ``normgrad.mpi.init``
    set (:func:`set_communicator`), else the identity."""
    if _communicator is None and launched_ranks() > 1:
        raise NormgradInputError(unconfigured_message(launched_ranks()))
    return Result(sum_over_ranks(validate(input)[0], _communicator))


def _infer(ctx) -> None:
    input_type = _common.input_tensor_type(ctx, 0)
    if input_type is not None:
        ctx.set_output_type(0, _common.make_output_type(input_type.elem_type, _common.known_dims(input_type)))


def schema() -> OpSchema:
    """The ONNX schema, with type and shape inference."""
    param = OpSchema.FormalParameter
    return _common.make_schema(
        OP_TYPE,
        __doc__,
        inputs=[param("input", "T", "This rank's tensor.")],
        outputs=[param("output", "T", "The sum over the ranks; shape and type of input.")],
        type_docs={"T": "Element type of input and output."},
        infer=_infer,
        types=TYPES,
    )


def function_body(opset: int = _common.ONNX_OPSET) -> onnx.FunctionProto:
    """The identity: what the operator is on one process, for runtimes without the kernel."""
    return onnx.parser.parse_function(
        f"""
        <domain: "{_common.DOMAIN}", opset_import: ["" : {opset}]>
        {OP_TYPE} (input) => (output)
        {{
            output = Identity (input)
        }}
        """
    )
