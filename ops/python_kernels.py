"""float32 Python kernels for onnxruntime, through onnxruntime-extensions (``onnx_op``).

For reference and debugging; the C++ library is what users run. Importing this module
defines the kernels; :func:`library_path` is what ``register_custom_ops_library`` takes.

Two traps of the onnxruntime-extensions bridge are handled here:

* Any exception raised inside a kernel calls ``std::terminate``. Our kernels therefore
  never raise: input that breaks an operator's contract is reported on the ``normgrad``
  logger at ERROR level (message naming the input and the rule, also kept in
  :func:`errors`) and the kernel returns outputs filled with NaN (a bool output, DropoutMask's
  mask: all false, every element dropped), so the process survives and no plausible-looking
  number comes out. ``session.run`` itself cannot be made to raise.
* Outputs are marshalled by default through ``flatten().tolist()`` (~150 ms per million
  elements). :func:`_invoke` replaces that invocation hook and, for normgrad's kernels,
  hands contiguous arrays of the declared dtypes (float32; ``OUTPUT_DTYPES``: bool) straight
  to the bridge's ``memcpy`` (their shapes are the shapes it allocates, so the copy stays in
  bounds).

What still cannot work through this bridge: float16/bfloat16 (the kernels declare float
for every float input, so onnxruntime rejects such a model when the session is created) and omitted
optional inputs or outputs (the bridge declares every input and output required, so
onnxruntime rejects such a node when the session is created). Both fail at session
creation with onnxruntime's own error, never mid-run. Nor can it hand a kernel an INTS
attribute: an operator with one (DepthwiseConvGrad's geometry) has no Python kernel, and
``normgrad.prepare_for_python_kernels`` gives the model its function body instead. A scalar
output (SoftmaxCrossEntropy's loss) comes out of the bridge with shape [1];
``normgrad.prepare_for_python_kernels`` reshapes it.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

import numpy as np
from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
from onnxruntime_extensions import _ocos

from normgrad.ops import DOMAIN, OPERATORS, NormgradInputError
from normgrad.ops._common import has_python_kernel

__all__ = ["library_path", "errors", "last_kernel_seconds"]

_LOGGER = logging.getLogger("normgrad")
_ERRORS: collections.deque = collections.deque(maxlen=100)
_FLOAT = PyCustomOpDef.dt_float
_KERNEL_TYPES = {np.dtype(np.float32): _FLOAT, np.dtype(np.bool_): PyCustomOpDef.dt_bool,
                 np.dtype(np.int32): PyCustomOpDef.dt_int32, np.dtype(np.int64): PyCustomOpDef.dt_int64}
_last_kernel_seconds = [0.0]


def library_path() -> str:
    """The onnxruntime-extensions library that serves the kernels defined here."""
    return get_library_path()


def errors() -> list:
    """The messages of the most recent rejected kernel calls (at most 100), oldest first."""
    return list(_ERRORS)


def last_kernel_seconds() -> float:
    """Seconds the most recent kernel call spent in Python (arithmetic and handing over
    the outputs); the rest of a ``session.run`` is onnxruntime and the bridge's copies."""
    return _last_kernel_seconds[0]


def _failure_shapes(module, inputs) -> list:
    """Best-effort output shapes for a rejected call; () where nothing sensible exists."""
    shapes = []
    for name in module.OUTPUTS:
        source, axis = module.OUTPUT_SHAPE_FROM[name]
        if source is None:  # a scalar output
            shapes.append(())
            continue
        shape = tuple(inputs[module.INPUTS.index(source)].shape)
        shapes.append(shape if axis is None else (shape[axis : axis + 1] or (0,)))
    return shapes


def _input_dtype(module, name: str) -> np.dtype:
    if name in getattr(module, "BOOL_INPUTS", ()):
        return np.dtype(np.bool_)
    return getattr(module, "INPUT_DTYPES", {}).get(name, np.dtype(np.float32))


def _output_dtypes(module) -> list:
    """Each output's dtype: float32 unless the module's OUTPUT_DTYPES says otherwise."""
    return [getattr(module, "OUTPUT_DTYPES", {}).get(name, np.dtype(np.float32)) for name in module.OUTPUTS]


def _make_kernel(module) -> Callable:
    compute = getattr(module, "python_kernel", module.reference)
    dtypes = _output_dtypes(module)

    def kernel(*inputs, **attributes):
        try:
            outputs = compute(*inputs, **attributes)
            unset = [name for name, out in zip(module.OUTPUTS, outputs) if out is None]
            if unset:
                raise NormgradInputError(
                    f"{module.OP_TYPE}: outputs {unset} are named but their flag attributes are 0"
                )
            return tuple(np.asarray(out, dtype=dtype) for out, dtype in zip(outputs, dtypes))
        except Exception as error:  # any exception here would abort the process
            message = f"{error} (float32 Python kernel; outputs set to NaN)"
            _ERRORS.append(message)
            _LOGGER.error(message)
            # NaN where the output is float; an all-false mask (everything dropped) where it is bool
            return tuple(np.full(shape, np.nan if dtype.kind == "f" else 0, dtype)
                         for shape, dtype in zip(_failure_shapes(module, inputs), dtypes))

    kernel.__name__ = module.OP_TYPE
    return kernel


def _invoke(kernel_id, feed, attributes):
    """Replacement for onnxruntime-extensions' hook: normgrad's kernels hand arrays of their declared dtypes
    over instead of Python lists; other libraries' Python ops keep the original hook."""
    if kernel_id not in _KERNEL_IDS:
        return _ocos._on_pyop_invocation(kernel_id, feed, attributes)
    start = time.perf_counter()
    opdef = _ocos.Opdef._odlist[kernel_id]
    outputs = opdef.body(*feed, **opdef.cast_attributes(attributes))
    flat = [kernel_id]
    for output, dtype in zip(outputs, _KERNEL_IDS[kernel_id]):
        array = np.ascontiguousarray(output, dtype=dtype)
        flat += [array.shape, array]
    _last_kernel_seconds[0] = time.perf_counter() - start
    return tuple(flat)


_KERNEL_IDS = {
    onnx_op(
        op_type=f"{DOMAIN}::{module.OP_TYPE}",
        inputs=[_KERNEL_TYPES[_input_dtype(module, name)] for name in module.INPUTS],
        outputs=[_KERNEL_TYPES[dtype] for dtype in _output_dtypes(module)],
        attrs={name: PyCustomOpDef.dt_float if isinstance(default, float) else PyCustomOpDef.dt_int64
               for name, default in module.ATTRIBUTES.items()},
    )(_make_kernel(module))._id: _output_dtypes(module)
    for module in OPERATORS.values()
    if has_python_kernel(module)
}
"""{kernel id: its outputs' dtypes}."""
PyCustomOpDef.install_hooker(_invoke)
