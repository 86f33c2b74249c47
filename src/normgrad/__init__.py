"""normgrad: normalization-layer gradients as ONNX custom operators.

The public API:

* :data:`DOMAIN`: the operators' ONNX domain.
* :func:`session_options`: onnxruntime ``SessionOptions`` with normgrad kernels registered.
* :func:`add_functions`: attach the operators' function bodies to a model.
* :func:`library_path`: the compiled custom-op library.
"""

from __future__ import annotations

from normgrad.ops import DOMAIN, OPSET_VERSION, NormgradInputError
from normgrad._api import add_functions, library_path, session_options

__all__ = ["DOMAIN", "OPSET_VERSION", "NormgradInputError", "add_functions", "library_path", "session_options"]
__version__ = "0.1.0"
