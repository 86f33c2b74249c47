"""DFT: the gradient of a discrete Fourier transform is a transform of the gradient.

Along ``axis`` a DFT is a linear map of the complex signal: the forward transform
y = F x (F_jk = exp(-2 pi i jk / n)), the inverse one y = conj(F) x / n. With real and
imaginary parts as separate reals, the gradient is the adjoint applied to dy: n times the
inverse transform of dy, or the forward transform of dy over n. Around it:

- ``dft_length`` n zero-pads or truncates x along the axis first: the gradient is truncated
  or zero-padded back to x's length;
- a real x (last dim 1) gets the real part;
- onesided forward (torch.fft.rfft): y holds bins 0..n//2 only, so dy is zero-padded to n
  (the backward DFT's own ``dft_length``);
- onesided inverse (torch.fft.irfft: complex x of n//2 + 1 bins, real y of n): y reads bins
  1..n - (n//2 + 1) of x twice (the Hermitian extension), so the gradient is the onesided
  forward transform of dy over n with those bins doubled (torch's rule; the imaginary parts
  of bins 0 and n/2, which y ignores, get 0). onnxruntime reads such an x as numpy's irfft
  only when it has n//2 + 1 bins, as torch exports it; other lengths known statically are
  refused.

The axis is an attribute before opset 20 and a constant input from opset 20 (a computed
axis is refused); the backward DFT is written in the form of the graph's opset.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.graphs.rules import UnsupportedOperatorError, register

__all__ = ["dft_gradient"]

AXIS_INPUT_OPSET = 20
"""From this opset DFT takes its axis as an input (default -2), before as an attribute (default 1)."""


def _axis(ctx: GradientContext, node: onnx.NodeProto, rank: int) -> int:
    """The node's axis, non-negative."""
    if ctx.opset < AXIS_INPUT_OPSET:
        return attr(node, "axis", 1) % rank
    if len(node.input) < 3 or not node.input[2]:
        return -2 % rank
    value = ctx.constant(node.input[2])
    if value is None:
        raise UnsupportedOperatorError(f"{describe(node)}: the gradient of a DFT needs a constant axis")
    return int(np.asarray(value).reshape(-1)[0]) % rank


def _transform(ctx: GradientContext, signal: str, length: Optional[str], axis: int, inverse: bool,
               onesided: bool) -> str:
    """A DFT of ``signal`` written for the context's opset."""
    flags = dict(inverse=int(inverse), onesided=int(onesided))
    if ctx.opset < AXIS_INPUT_OPSET:
        return ctx.op("DFT", signal, length, axis=axis, **flags)
    axis_value = ctx.op("Constant", value=onh.from_array(np.asarray(axis, np.int64)))
    return ctx.op("DFT", signal, length, axis_value, **flags)


def _length(ctx: GradientContext, value: str, axis: int) -> str:
    """The run-time length of ``value`` along ``axis``, an int64 scalar."""
    return ctx.op("Reshape", ctx.shape_of(value, start=axis, end=axis + 1), ctx.ints([]))


def _doubled_bins(ctx: GradientContext, grad: str, n: str, axis: int, rank: int) -> str:
    """``grad`` (k = n//2 + 1 bins along ``axis``; ``n`` an int64 scalar) with bins 1..n - k doubled."""
    k = _length(ctx, grad, axis)
    zero = ctx.op("Constant", value=onh.from_array(np.asarray(0, np.int64)))
    one = ctx.op("Constant", value=onh.from_array(np.asarray(1, np.int64)))
    bins = ctx.op("Range", zero, k, one)
    last_doubled = ctx.op("Sub", n, k)
    doubled = ctx.op("And", ctx.op("Greater", bins, zero), ctx.op("Not", ctx.op("Greater", bins, last_doubled)))
    weights = ctx.op("CastLike", ctx.op("Add", ctx.op("Cast", doubled, to=onnx.TensorProto.INT64), one), grad)
    return ctx.op("Mul", grad, ctx.unsqueeze(weights, list(range(1, rank - axis))))


def _fit_length(ctx: GradientContext, grad: str, x: str, axis: int, rank: int) -> str:
    """``grad`` zero-padded or truncated along ``axis`` to the length of ``x``'s."""
    wanted = ctx.shape_of(x, start=axis, end=axis + 1)
    missing = ctx.op("Max", ctx.op("Sub", wanted, ctx.shape_of(grad, start=axis, end=axis + 1)), ctx.ints([0]))
    pads = ctx.op("Concat", ctx.ints([0] * (rank + axis)), missing, ctx.ints([0] * (rank - axis - 1)), axis=0)
    padded = ctx.op("Pad", grad, pads)
    return ctx.op("Slice", padded, ctx.ints([0]), wanted, ctx.ints([axis]))


def _check_irfft_bins(node: onnx.NodeProto, bins, n) -> None:
    """Refuses an inverse onesided DFT whose x has other than n//2 + 1 bins, where both are known."""
    if isinstance(bins, int) and isinstance(n, int) and bins != n // 2 + 1:
        raise UnsupportedOperatorError(
            f"{describe(node)}: an inverse onesided DFT of length {n} needs {n // 2 + 1} bins for the gradient "
            f"(torch.fft.irfft's form), not {bins}")


@register("DFT", min_opset=17)
def dft_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """The adjoint transform of dy, scaled, fitted to x's length and complex dim (see the module)."""
    x, y, dy = node.input[0], node.output[0], grads[0]
    rank = ctx.rank(x, node)
    axis = _axis(ctx, node, rank)
    x_shape = ctx.shape(x)
    if x_shape[-1] not in (1, 2):
        raise UnsupportedOperatorError(f"{describe(node)}: the gradient of a DFT needs a static last dim (1 or 2) of x")
    inverse, onesided = bool(attr(node, "inverse", 0)), bool(attr(node, "onesided", 0))
    length = node.input[1] if len(node.input) > 1 and node.input[1] else None
    if inverse and onesided:
        _check_irfft_bins(node, x_shape[axis], (ctx.shape(y) or [None] * rank)[axis])
    if onesided and not inverse:  # y has n//2 + 1 bins: n is dft_length or x's length
        n = ctx.op("Reshape", length, ctx.ints([])) if length else _length(ctx, x, axis)
        grad = _transform(ctx, dy, n, axis, inverse=True, onesided=False)
    else:
        n = _length(ctx, y, axis)
        grad = _transform(ctx, dy, None, axis, inverse=not inverse, onesided=inverse and onesided)
    grad = ctx.op("Div" if inverse else "Mul", grad, ctx.op("CastLike", n, dy))
    if inverse and onesided:
        grad = _doubled_bins(ctx, grad, n, axis, rank)
    if length:
        grad = _fit_length(ctx, grad, x, axis, rank)
    if x_shape[-1] == 1:
        grad = ctx.op("Slice", grad, ctx.ints([0]), ctx.ints([1]), ctx.ints([rank - 1]))
    return [grad]
