"""Conv and ConvTranspose (any spatial rank, groups, strides, pads incl. auto_pad, dilations;
ConvTranspose also output_padding and output_shape), at static or symbolic image sizes.

Conv: dx (:func:`input_gradient`) and dW (:func:`weight_gradient`) take the form onnxruntime's
CPU kernels run fastest, chosen per case from measurements (below); db = sum of dy over all
axes but 1.

ConvTranspose(x, W) is the adjoint of Conv(., W) with the same geometry, so dx = Conv(dy, W)
and dW is Conv's weight gradient with dy as the input and x as the output gradient.

Measured (onnxruntime 1.32 CPU, float32, 2 intra-op threads, medians of 5-7 interleaved runs on
a shared machine at load 40-70, so +-20%), in ms, [N, C, H, W] -> M channels, kernel k, stride s:

==============================  ============  ===========  ===============  ===========
case                            dx ConvT      dx flip Conv dW big-kernel    dW per tap
==============================  ============  ===========  ===============  ===========
[16, 64, 56, 56] -> 64, k3 s1   80            74           310              165
[8, 64, 32, 32] -> 64, k3 s1    3.9           3.6          11.7             5.1
[16, 32, 28, 28] -> 32, k3 s1   4.9           2.1          11.4             3.2
[8, 256, 8, 8] -> 256, k3 s1    9.4           8.8          13.7             6.5
[8, 512, 4, 4] -> 512, k3 s1    12.5          19.0         18.9             9.4
[8, 64, 32, 32] -> 128, k3 s2   5.5           -            9.9              3.3
[8, 64, 32, 32] -> 128, k1 s2   0.4           -            4.2              0.6
[8, 3, 128, 128] -> 64, k7 s2   9.5           -            20.0             63.8
[16, 96, 28, 28] depthwise k3   2.5           10.5         -                -
[16, 240, 28, 28] depthwise k3  -             -            98               97 (*)
[8, 96, 56, 56] depthwise k3    -             -            60               56 (*)
==============================  ============  ===========  ===============  ===========

(*) depthwise dW per tap as Slice-Mul-ReduceSum: no better than the grouped big-kernel Conv,
which it keeps.

So dW is one GEMM per kernel tap for ungrouped convs with at most 9 taps (batched over
the samples for large images; one im2col GEMM where the output channels outnumber the
pixels: see :func:`_per_tap_weight_gradient`) (the big-kernel Conv is 2-10x slower there),
the big-kernel Conv otherwise (a 7x7 stem on 3 channels: 49 thin GEMMs lose); dx is the
flipped Conv for ungrouped stride-1 convs and ConvTranspose otherwise (depthwise: 4x faster
as ConvTranspose).

A 2-D depthwise conv (one output channel per input channel) whose dx and dW are both wanted
gets both from one ``DepthwiseConvGrad`` (:func:`_depthwise`), whose function body is the
ConvTranspose and big-kernel Conv above.

Every graph form of dW copies x once per tap (Slice, or inside the Conv's im2col), which
torch's direct (mkldnn) backward need not; the other graph forms lose at 1 thread on
ResNet-18's shapes (batch 16, 112x112; the 20 convs' dW, stem included, one run of medians):
a Gemm per tap 513 ms, the big-kernel Conv 759, a Gather im2col 930 (Gather copies element
by element). A kernel of ours that reads x in place (OuterProductSum's tile, the taps of x
gathered into its panels) lost too on an AMD Zen 4, 264 against 224 ms for the graph forms
(docs/explanation/performance-log.md, "What ResNet-18 and BERT still lose on AVX-512 CPUs"): its
tile runs 13-25% slower than MLAS's GEMM on these shapes, which costs more than the copies
it saves.
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Tuple

import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.graphs.rules.registry import UnsupportedOperatorError, register
from normgrad.graphs.rules._window import Window, transposed_window, window_of
from normgrad.ops import DOMAIN, depthwise_conv, depthwise_conv_grad

__all__ = ["conv_gradient", "conv_transpose_gradient", "input_gradient", "weight_gradient"]


def input_gradient(ctx: GradientContext, dy: str, w: str, x: str, window: Window, groups: int) -> str:
    """dx of Conv(x, w) over ``window``, sized like ``x``.

    Stride 1, groups 1, pads within the dilated kernel: a Conv of dy with w flipped in space and
    its two channel axes swapped (:func:`_flipped_swapped`), pads (k - 1) * d - p (onnxruntime
    runs it on the same path as the forward Conv). Otherwise ConvTranspose(dy, w): depthwise
    3x3 measured 4x faster as ConvTranspose than as the flipped Conv. (ConvTranspose is not
    the stride-1 default: onnxruntime transposes w for each sample, 57 against 30 ms at
    [16, 512, 4, 4], 1 thread.)"""
    r = len(window.kernel)
    reach = [(k - 1) * d for k, d in zip(window.kernel, window.dilations)]
    if groups == 1 and all(s == 1 for s in window.strides) and all(0 <= p <= reach[i % r] for i, p in enumerate(window.pads)):
        pads = [reach[i % r] - p for i, p in enumerate(window.pads)]
        return ctx.op("Conv", dy, _flipped_swapped(ctx, w, window.kernel), pads=pads, dilations=window.dilations,
                      kernel_shape=window.kernel)
    return transposed_window(ctx, dy, w, x, window, groups)


def _flipped_swapped(ctx: GradientContext, w: str, kernel: List[int]) -> str:
    """``w`` [M, C, k...] flipped along every spatial axis, as [C, M, k...].

    Flipping every spatial axis reverses the flattened kernel, so it is a MatMul of w as
    [M, C, taps] with the taps x taps anti-identity (exact for finite w: one product by 1, the rest by 0),
    then one Transpose of the channel axes. A Slice with step -1 copies w element by element:
    at [512, 512, 3, 3] the Slice and Transpose took 27 ms, the MatMul and Transpose 7, the
    Conv itself 23 (1 thread)."""
    taps = int(np.prod(kernel))
    reversal = ctx.op("Constant", value=onh.from_array(np.eye(taps, dtype=np.float32)[::-1].copy()))
    if ctx.elem_type(w) != onnx.TensorProto.FLOAT:
        reversal = ctx.op("CastLike", reversal, w)
    flipped = ctx.op("MatMul", ctx.op("Reshape", w, ctx.ints([0, 0, -1])), reversal)  # [M, C, taps]
    swapped = ctx.op("Transpose", flipped, perm=[1, 0, 2])
    return ctx.op("Reshape", swapped, ctx.ints([0, 0] + list(kernel)))


def _per_tap_weight_gradient(ctx: GradientContext, x: str, w: str, dy: str, window: Window) -> str:
    """dW of an ungrouped Conv as GEMMs over the kernel taps: x zero-padded and sliced at each
    tap's offset with the conv's strides (x_tap, shaped like dy but with C channels) against
    dy, summed over the batch and the output pixels. Three arrangements, by static sizes:

    * batched (at least 1024 output pixels per sample): a MatMul per tap, x_tap [N, C, P] @
      dy^T [N, P, M], then ReduceSum over N; x stays in NCHW and dy is transposed once.
    * im2col (more output channels M than a quarter of K = N * P, the deep layers): the taps
      stacked as [C, taps, K] and one Gemm with dy [M, K] into [M, C * taps], which is dW's
      layout. A Gemm per tap would need its [M, C] results interleaved tap by tap, an element
      at a time: at [16, 512, 4, 4] that Concat cost more than the x copies it saves.
    * otherwise one Gemm per tap over K, with x and dy arranged channels-first once ([C, K],
      [M, K]).

    Measured on forward + dW of one 3x3 conv: batched 117 vs 140 ms at [16, 64, 56, 56], 12.0
    vs 13.6 ms at [8, 64, 32, 32]; Gemm per tap 16.7 vs 19.8 ms at [8, 128, 16, 16], 12.2 vs
    13.9 at [8, 256, 8, 8], 22.5 vs 36.0 at [8, 512, 4, 4]; dW alone at 1 thread, Gemm per tap
    against im2col: 26 vs 34 ms at [16, 64, 28, 28], 28.5 vs 26.9 at [16, 512, 4, 4]."""
    r = len(window.kernel)
    spatial = list(range(2, 2 + r))
    out_pixels = None if window.out_sizes is None else int(np.prod(window.out_sizes))
    batch, out_channels = (ctx.shape(x) or [None])[0], (ctx.shape(w) or [None])[0]
    batched = out_pixels is not None and out_pixels >= 1024
    im2col = (not batched and out_pixels is not None and isinstance(batch, int) and isinstance(out_channels, int)
              and int(np.prod(window.kernel)) > 1 and 4 * out_channels > batch * out_pixels)
    if batched:
        source = x
        dy_arranged = ctx.op("Transpose", ctx.op("Reshape", dy, ctx.ints([0, 0, -1])), perm=[0, 2, 1])  # [N, P, M]
        flat = ctx.ints([0, 0, -1])  # [N, C, P]
    else:
        source = ctx.op("Transpose", x, perm=[1, 0] + spatial)  # [C, N, ...]
        dy_arranged = ctx.op("Reshape", ctx.op("Transpose", dy, perm=[1, 0] + spatial), ctx.ints([0, -1]))  # [M, K]
        flat = ctx.ints([0, -1])  # [C, K]
    if any(window.pads):
        source = ctx.op("Pad", source, ctx.ints([0, 0] + window.pads[:r] + [0, 0] + window.pads[r:]))
    out_sizes = ctx.shape_of(dy, start=2)
    # the last element a tap reads is offset + (out - 1) * stride; Slice's end is one past it
    span = ctx.op("Mul", ctx.op("Sub", out_sizes, ctx.ints([1] * r)), ctx.ints(window.strides))
    taps = []
    for offsets in itertools.product(*[range(0, k * d, d) for k, d in zip(window.kernel, window.dilations)]):
        ends = ctx.op("Add", span, ctx.ints([o + 1 for o in offsets]))
        tap = ctx.op("Slice", source, ctx.ints(list(offsets)), ends, ctx.ints(spatial), ctx.ints(window.strides))
        if im2col:
            taps.append(ctx.unsqueeze(tap, [1]))  # [C, 1, N, ...]
        elif batched:
            product = ctx.reduce("ReduceSum", ctx.op("MatMul", ctx.op("Reshape", tap, flat), dy_arranged), [0],
                                 keepdims=False)  # [C, M]
            taps.append(ctx.unsqueeze(product, [2]))
        else:
            taps.append(ctx.unsqueeze(ctx.op("Gemm", dy_arranged, ctx.op("Reshape", tap, flat), transB=1), [2]))  # [M, C, 1]
    w_shape = ctx.op("Concat", ctx.shape_of(w, end=2), ctx.ints(window.kernel), axis=0)
    if im2col:
        columns = ctx.op("Flatten", ctx.op("Concat", *taps, axis=1), axis=2)  # [C * taps, K]
        return ctx.op("Reshape", ctx.op("Gemm", dy_arranged, columns, transB=1), w_shape)
    stacked = taps[0] if len(taps) == 1 else ctx.op("Concat", *taps, axis=2)  # [M, C, taps] or [C, M, taps]
    if batched:
        stacked = ctx.op("Transpose", stacked, perm=[1, 0, 2])
    return ctx.op("Reshape", stacked, w_shape)


def weight_gradient(ctx: GradientContext, x: str, w: str, dy: str, window: Window, groups: int) -> str:
    """dW of Conv(x, w) over ``window``, shaped like ``w``.

    Groups 1 and at most 9 kernel taps: one GEMM per tap (:func:`_per_tap_weight_gradient`).
    Otherwise a Conv of the input (batch as channels) with dy (batch as input channels) as the
    kernel, strides and dilations swapped, cropped to the kernel: MLAS runs that big-kernel
    Conv slowly (ResNet 3x3 at [16, 64, 56, 56]: 310 ms against 150-165 ms per tap), but it
    beats 49 thin GEMMs for a 7x7 stem on 3 channels."""
    if groups == 1 and int(np.prod(window.kernel)) <= 9:
        return _per_tap_weight_gradient(ctx, x, w, dy, window)
    return _big_kernel_weight_gradient(ctx, x, w, dy, window, groups)


def _big_kernel_weight_gradient(ctx: GradientContext, x: str, w: str, dy: str, window: Window, groups: int) -> str:
    """dW as a Conv of x (batch as channels) with dy (batch as input channels) as the kernel."""
    r = len(window.kernel)
    spatial = list(range(2, 2 + r))
    if groups == 1:
        x_arranged = ctx.op("Transpose", x, perm=[1, 0] + spatial)  # [C, N, ...]
    else:
        # [N, C, ...] -> [N, g, C/g, ...] -> [C/g, g, N, ...] -> [C/g, g*N, ...]
        c_per_group = ctx.shape_of(w, start=1, end=2)
        spatial_shape = ctx.shape_of(x, start=2)
        split = ctx.op("Concat", ctx.ints([-1, groups]), c_per_group, spatial_shape, axis=0)
        grouped = ctx.op("Transpose", ctx.op("Reshape", x, split), perm=[2, 1, 0] + [s + 1 for s in spatial])
        x_arranged = ctx.op("Reshape", grouped, ctx.op("Concat", c_per_group, ctx.ints([-1]), spatial_shape, axis=0))
    dy_arranged = ctx.op("Transpose", dy, perm=[1, 0] + spatial)  # [M, N, ...]
    full = ctx.op(
        "Conv",
        x_arranged,
        dy_arranged,
        group=groups,
        strides=window.dilations,
        dilations=window.strides,
        pads=window.pads,
    )  # [C/g, M, k'...], k' >= k
    full_sizes = None
    if window.in_sizes is not None:
        full_sizes = [
            (window.in_sizes[i] + window.pads[i] + window.pads[r + i] - (window.out_sizes[i] - 1) * window.strides[i] - 1)
            // window.dilations[i]
            + 1
            for i in range(r)
        ]
    if full_sizes != window.kernel:
        full = ctx.op("Slice", full, ctx.ints([0] * r), ctx.ints(window.kernel), ctx.ints(spatial))
    return ctx.op("Transpose", full, perm=[1, 0] + spatial)


def _bias_gradient(ctx: GradientContext, dy: str, rank: int) -> str:
    return ctx.reduce("ReduceSum", dy, [0] + list(range(2, rank)), keepdims=False)


def _kernel(ctx: GradientContext, node: onnx.NodeProto) -> Optional[List[int]]:
    w_shape = ctx.shape(node.input[1])
    if w_shape is not None and all(isinstance(d, int) for d in w_shape[2:]):
        return list(w_shape[2:])
    return attr(node, "kernel_shape", None)


def _depthwise(ctx: GradientContext, x: str, w: str, window: Window, groups: int) -> bool:
    """Whether dx and dw of Conv(x, w) are one DepthwiseConvGrad: both wanted, 2-D, float32 or
    float64, one output channel per input channel (static C = group, w [C, 1, kh, kw]).

    Its C++ kernel walks each channel's planes in place, where the graph form (its function
    body) is a ConvTranspose and the grouped big-kernel Conv: dx and dw of a 3x3 in ms at 1
    thread, kernel against graph form, 4.1 / 32 at [16, 32, 64, 64], 11.4 / 42 at [16, 96,
    64, 64] stride 2, 6.9 / 38 at [16, 144, 32, 32], 3.0 / 9.7 at [16, 960, 4, 4]. A frozen
    w (dx alone) keeps the ConvTranspose. The forward Conv then becomes a DepthwiseConv
    (:mod:`normgrad.graphs.rewrites.depthwise_forward`)."""
    x_shape, w_shape = ctx.shape(x), ctx.shape(w)
    return (groups > 1 and len(window.kernel) == 2 and window.kernel[0] <= depthwise_conv.MAX_KERNEL_ROWS
            and ctx.needs_grad(x) and ctx.needs_grad(w)
            and ctx.elem_type(x) in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
            and x_shape is not None and len(x_shape) == 4 and x_shape[1] == groups
            and w_shape is not None and list(w_shape[:2]) == [groups, 1])


@register("Conv", inputs=(0, 1, 2))
def conv_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Gradients of X, W and B; dx and dw of a 2-D depthwise Conv as one DepthwiseConvGrad."""
    dy = grads[0]
    x, w = node.input[0], node.input[1]
    window = window_of(ctx, node, _kernel(ctx, node))
    groups = attr(node, "group", 1)
    result: List[Optional[str]] = [None] * len(node.input)
    if _depthwise(ctx, x, w, window, groups):
        result[0], result[1] = ctx.op(depthwise_conv_grad.OP_TYPE, x, w, dy, outputs=2, domain=DOMAIN, group=groups,
                                      strides=window.strides, pads=window.pads, dilations=window.dilations)
    elif ctx.needs_grad(x):
        result[0] = input_gradient(ctx, dy, w, x, window, groups)
    if ctx.needs_grad(w) and result[1] is None:
        result[1] = weight_gradient(ctx, x, w, dy, window, groups)
    if len(node.input) > 2 and ctx.needs_grad(node.input[2]):
        result[2] = _bias_gradient(ctx, dy, len(window.kernel) + 2)
    return result


def _transpose_geometry(ctx: GradientContext, node: onnx.NodeProto) -> Tuple[Window, bool]:
    """The geometry of the Conv that ConvTranspose ``node`` is the adjoint of (its input is
    y-sized, its output x-sized), and whether that Conv's output must be cropped to x
    (output_padding or output_shape reaching a whole stride past x's last element).

    Pads from output_shape or SAME_* as the onnx spec and onnxruntime 1.32 split the total:
    the odd one at the tail for SAME_UPPER, at the head otherwise."""
    x = node.input[0]
    kernel = _kernel(ctx, node)
    shape = ctx.shape(x)
    if kernel is None or shape is None:
        raise UnsupportedOperatorError(f"{describe(node)}: the kernel shape or the rank of '{x}' is unknown")
    r = len(kernel)
    strides = list(attr(node, "strides", [1] * r))
    dilations = list(attr(node, "dilations", [1] * r))
    output_padding = list(attr(node, "output_padding", [0] * r))
    output_shape = list(attr(node, "output_shape", []))[-r:] if attr(node, "output_shape", None) else None
    auto_pad = attr(node, "auto_pad", "NOTSET")
    in_sizes = list(shape[2:]) if all(isinstance(d, int) for d in shape[2:]) else None
    natural = lambda i, n: (n - 1) * strides[i] + output_padding[i] + (kernel[i] - 1) * dilations[i] + 1  # noqa: E731
    if output_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if output_shape is not None and in_sizes is None:
            raise UnsupportedOperatorError(
                f"{describe(node)}: output_shape needs static spatial dims of input '{x}' for the gradient; got {shape}")
        pads = [0] * (2 * r)
        for i in range(r):
            if output_shape is not None:
                total = max(0, natural(i, in_sizes[i]) - output_shape[i])
            else:  # the output is in * stride: the total does not depend on in
                total = max(0, natural(i, 1) - strides[i])
            head = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            pads[i], pads[r + i] = head, total - head
    elif auto_pad == "VALID":
        pads = [0] * (2 * r)
    else:
        pads = list(attr(node, "pads", [0] * (2 * r)))
    out_sizes, extra = None, list(output_padding)
    if in_sizes is not None:
        out_sizes = [natural(i, in_sizes[i]) - pads[i] - pads[r + i] for i in range(r)]
        if output_shape is not None:
            extra = [e + max(0, s - o) for e, o, s in zip(extra, out_sizes, output_shape)]
            out_sizes = [max(o, s) for o, s in zip(out_sizes, output_shape)]
    crop = any(e >= s for e, s in zip(extra, strides))
    return Window(kernel, strides, dilations, pads, out_sizes, in_sizes), crop


@register("ConvTranspose", inputs=(0, 1, 2))
def conv_transpose_gradient(
    ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]
) -> List[Optional[str]]:
    """dx = Conv(dy, W) (cropped to x where output_padding or output_shape reach a stride
    past the input); dW = Conv's weight gradient with dy as input and x as output gradient."""
    dy = grads[0]
    x, w = node.input[0], node.input[1]
    window, crop = _transpose_geometry(ctx, node)
    groups = attr(node, "group", 1)
    r = len(window.kernel)
    result: List[Optional[str]] = [None] * len(node.input)
    if ctx.needs_grad(x):
        dx = ctx.op("Conv", dy, w, group=groups, strides=window.strides, dilations=window.dilations,
                    pads=window.pads, kernel_shape=window.kernel)
        if crop:
            spatial = list(range(2, 2 + r))
            dx = ctx.op("Slice", dx, ctx.ints([0] * r), ctx.shape_of(x, start=2), ctx.ints(spatial))
        result[0] = dx
    if ctx.needs_grad(w):
        result[1] = weight_gradient(ctx, dy, w, x, window, groups)
    if len(node.input) > 2 and ctx.needs_grad(node.input[2]):
        result[2] = _bias_gradient(ctx, dy, r + 2)
    return result
