"""onnxruntime's fused activations (``com.microsoft``), through the activation gradients of
:mod:`normgrad.ops.activation_grad` (:func:`~normgrad.graphs.rules.activations.activation_gradient`):

- Gelu(X): x Phi(x) (erf), ``GeluGrad``; BiasGelu(A, B): Gelu(A + B).
- FastGelu(X, bias?): the tanh GELU of X (+ bias), ``GeluTanhGrad`` (onnxruntime's
  0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the same constants).
- QuickGelu(X; alpha = 1.702): x sigmoid(alpha x) = silu(alpha x) / alpha, so its derivative
  is silu's at alpha x: ``SiLUGrad(dy, alpha x)``.
- BiasAdd(X, bias, skip): X + bias + skip (onnxruntime has it for CUDA only).

A bias gets dy (of the sum) summed over the axes it was broadcast along; the sum A + B a
gradient reads is recomputed (one Add), the forward keeps only the activation's output.
"""

from __future__ import annotations

from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules._contrib import like_input
from normgrad.graphs.rules.activations import activation_gradient
from normgrad.graphs.rules.registry import register

__all__ = ["ACTIVATIONS", "biased_activation_gradient", "quick_gelu_gradient", "bias_add_gradient"]

ACTIVATIONS = {"Gelu": "gelu_erf", "BiasGelu": "gelu_erf", "FastGelu": "gelu_tanh"}
"""Each op's activation in :data:`normgrad.ops.activation_grad.ACTIVATIONS`."""

QUICK_GELU_ALPHA = 1.702
"""QuickGelu's default alpha (its schema's)."""


def _biases_gradient(ctx: GradientContext, node: onnx.NodeProto, dz: str) -> List[Optional[str]]:
    """dz (the gradient of the sum of the node's inputs, shaped like its output) for each input."""
    y = node.output[0]
    return [ctx.sum_to(dz, y, name) if name and ctx.needs_grad(name) else None for name in node.input]


@register(*ACTIVATIONS, inputs=(0, 1), contrib=True, output_types=like_input(0))
def biased_activation_gradient(ctx: GradientContext, node: onnx.NodeProto,
                               grads: List[Optional[str]]) -> List[Optional[str]]:
    """The activation's gradient at X (+ bias), to X and to the bias."""
    x, y = node.input[0], node.output[0]
    biased = len(node.input) > 1 and node.input[1]
    z = ctx.op("Add", x, node.input[1]) if biased else x
    dz = activation_gradient(ctx, ACTIVATIONS[node.op_type], grads[0], z, like=y)
    return _biases_gradient(ctx, node, dz)


@register("QuickGelu", contrib=True, output_types=like_input(0))
def quick_gelu_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """``SiLUGrad(dy, alpha x)``."""
    x = node.input[0]
    alpha = attr(node, "alpha", QUICK_GELU_ALPHA)
    scaled = x if alpha == 1.0 else ctx.op("Mul", x, ctx.scalar(alpha, x))
    return [activation_gradient(ctx, "silu", grads[0], scaled, like=x)]


@register("BiasAdd", inputs=(0, 1, 2), contrib=True, output_types=like_input(0))
def bias_add_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dy to X and skip, summed over the leading axes to bias."""
    return _biases_gradient(ctx, node, grads[0])
