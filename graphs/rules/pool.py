"""AveragePool and MaxPool.

AveragePool: each channel is a one-channel ConvTranspose of dy (divided by the window
counts) with a kernel of ones. MaxPool: dy scattered (summed) to the positions the
forward node's Indices output names.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.graphs.rules.registry import UnsupportedOperatorError, register
from normgrad.graphs.rules._scatter import scatter_to_positions
from normgrad.graphs.rules._window import transposed_window, window_of
from normgrad.ops import DOMAIN, max_pool_grad

__all__ = ["average_pool_gradient", "max_pool_gradient"]


@register("AveragePool")
def average_pool_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """dx = ConvTranspose(dy / count, ones) per channel; ceil_mode's last windows as end pads
    (counting only the explicit pads with count_include_pad, as torch and onnxruntime do)."""
    x, dy = node.input[0], grads[0]
    window = window_of(ctx, node)
    geometry = dict(strides=window.strides, dilations=window.dilations, pads=window.pads)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(ctx.elem_type(x) or onnx.TensorProto.FLOAT)
    ones = ctx.op("Constant", value=onh.from_array(np.ones([1, 1] + window.kernel, dtype)))
    if any(window.ceil_pads) and attr(node, "count_include_pad", 0):
        # the windows count the explicit pads, not the end that ceil_mode adds: ones over the padded input
        r = len(window.kernel)
        padded = [size + window.pads[i] + window.pads[r + i] - window.ceil_pads[i] for i, size in enumerate(window.in_sizes)]
        plane = ctx.op("ConstantOfShape", ctx.ints([1, 1] + padded), value=onh.from_array(np.ones(1, dtype)))
        geometry["pads"] = [0] * r + window.ceil_pads
        dy = ctx.op("Div", dy, ctx.op("Conv", plane, ones, **geometry))
    elif attr(node, "count_include_pad", 0) or not any(window.pads):
        dy = ctx.op("Div", dy, ctx.scalar(float(np.prod(window.kernel)), x))
    else:
        plane_shape = ctx.op("Concat", ctx.ints([1, 1]), ctx.shape_of(x, start=2), axis=0)
        plane = ctx.op("ConstantOfShape", plane_shape, value=onh.from_array(np.ones(1, dtype)))
        counts = ctx.op("Conv", plane, ones, **geometry)
        dy = ctx.op("Div", dy, counts)
    channels = ctx.op("Concat", ctx.ints([-1, 1]), ctx.shape_of(dy, start=2), axis=0)
    planes = ctx.op("Reshape", dy, channels)
    dx = transposed_window(ctx, planes, ones, x, window)  # x lends only its spatial size
    return [ctx.reshape_like(dx, x)]


@register("MaxPool", outputs=(0,), min_opset=16)
def max_pool_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """MaxPoolGrad(x, dy) (:func:`_one_operator`), or else ScatterElements(zeros, Indices, dy,
    reduction='add'), Indices from the forward node."""
    if attr(node, "storage_order", 0):
        raise UnsupportedOperatorError(f"{describe(node)}: MaxPool with storage_order=1 is not supported")
    if attr(node, "auto_pad", "NOTSET") in ("SAME_UPPER", "SAME_LOWER") and any(d != 1 for d in attr(node, "dilations", [])):
        # onnxruntime computes Y without the auto padding once the Indices output is requested
        raise UnsupportedOperatorError(
            f"{describe(node)}: MaxPool with auto_pad SAME_* and dilations is not supported (onnxruntime's "
            "Indices output, which the gradient needs, ignores the padding there); write explicit pads"
        )
    if _one_operator(ctx, node):
        geometry = {name: attr(node, name, default) for name, default in max_pool_grad.ATTRIBUTES.items()}
        return [ctx.op(max_pool_grad.OP_TYPE, node.input[0], grads[0], domain=DOMAIN, **geometry)]
    indices = ctx.ensure_output(node, 1, "indices")
    return [scatter_to_positions(ctx, grads[0], indices, node.input[0], "add")]


def _one_operator(ctx: GradientContext, node: onnx.NodeProto) -> bool:
    """Whether dx of ``node`` is one MaxPoolGrad: 2-D, float32 or float64, explicit pads (no
    auto_pad SAME_*), and no Indices output that the graph already reads."""
    shape = ctx.shape(node.input[0])
    return (shape is not None and len(shape) == 4 and (len(node.output) < 2 or not node.output[1])
            and ctx.elem_type(node.input[0]) in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
            and attr(node, "auto_pad", "NOTSET") in ("NOTSET", "VALID"))
