"""The gradient rules: one module per forward op (or small family), and their registry.

A rule module calls :func:`register` for each op type it handles. A rule's ``gradient``
function receives the :class:`~normgrad.graphs.context.GradientContext`, the forward node
and the gradient of each of the node's outputs (a value name, or None where no gradient
flows), emits backward nodes through the context and returns the gradient of each input
(None where none is computed). Only inputs listed as differentiable ever receive one.
"""

from __future__ import annotations

from normgrad.graphs.rules.registry import (
    CONTRIB_DOMAIN,
    GradientFn,
    IndexSpec,
    Rule,
    UnsupportedOperatorError,
    lookup,
    register,
    register_non_differentiable,
    supported_op_types,
)

# Importing the rule modules registers their rules.
from normgrad.graphs.rules import (  # noqa: F401
    activations,
    batch_norm,
    col2im,
    concat,
    contrib_activations,
    contrib_norm,
    conv,
    cumsum,
    depth_to_space,
    dft,
    dropout,
    einsum,
    embed_layer_norm,
    elementwise,
    gather,
    gemm,
    group_norm,
    group_query_attention,
    layer_norm,
    loss,
    matmul,
    matmul_nbits,
    non_differentiable,
    pad,
    pool,
    recurrent,
    reduce,
    resize,
    rotary,
    scatter_elements,
    scatter_nd,
    select,
    shape,
    slice,
    topk,
)

__all__ = ["Rule", "register", "lookup", "supported_op_types", "UnsupportedOperatorError"]
