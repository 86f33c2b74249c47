"""Ops that only move elements: Reshape, Flatten, Squeeze, Unsqueeze, Identity, Dropout
(inference), Expand and Transpose."""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.graphs.rules import UnsupportedOperatorError, register

__all__ = ["reshape_gradient", "identity_gradient", "dropout_gradient", "expand_gradient", "transpose_gradient"]


@register("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dy reshaped to the runtime shape of the input."""
    return [ctx.reshape_like(grads[0], node.input[0])]


@register("Identity")
def identity_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dy itself."""
    return [grads[0]]


@register("Dropout", outputs=(0,))
def dropout_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Inference-mode Dropout is the identity; training mode needs a random mask and is refused."""
    training = node.input[2] if len(node.input) > 2 else ""
    if training:
        value = ctx.constant(training)
        if value is None or bool(np.asarray(value).reshape(-1)[0]):
            raise UnsupportedOperatorError(
                f"{describe(node)}: Dropout in training mode is not supported (export the model with dropout "
                "disabled, e.g. model.eval() for the dropout layers)"
            )
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
