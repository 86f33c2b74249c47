"""Ops that only move elements: Reshape, Flatten, Squeeze, Unsqueeze, Identity, Expand and Transpose."""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules.registry import register

__all__ = ["reshape_gradient", "identity_gradient", "expand_gradient", "transpose_gradient"]


@register("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dy reshaped to the runtime shape of the input."""
    return [ctx.reshape_like(grads[0], node.input[0])]


@register("Identity")
def identity_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dy itself."""
    return [grads[0]]


@register("Expand")
def expand_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dy summed over the broadcast axes."""
    return [ctx.sum_to(grads[0], node.output[0], node.input[0])]


@register("Transpose")
def transpose_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dy transposed by the inverse permutation."""
    perm = attr(node, "perm", None)
    if perm is None:
        perm = list(reversed(range(ctx.rank(node.input[0], node))))
    return [ctx.op("Transpose", grads[0], perm=[int(i) for i in np.argsort(perm)])]
