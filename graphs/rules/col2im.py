"""Col2Im (opset 18; torch's ``F.fold``): the gradient is the Im2Col of dy (``F.unfold``).

Col2Im adds each column entry [n, c * K + k, l] (K the kernel positions, l the block) into
the padded image at block l's origin plus kernel offset k (dilated), then crops the pads.
So dcols[n, c * K + k, l] = dy_padded[n, c, origin(l) + offset(k)]: dy is padded, flattened
over the spatial axes and read with one Gather at the flat positions of every (k, l), which
the node's constant image and block shapes fix when the graph is built.
"""

from __future__ import annotations

import itertools
from typing import List, Optional

import numpy as np
import onnx

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.graphs.rules.registry import UnsupportedOperatorError, register

__all__ = ["col2im_gradient", "im2col_positions"]


def im2col_positions(image: List[int], block: List[int], dilations: List[int], pads: List[int],
                     strides: List[int]) -> np.ndarray:
    """int64 [K, L]: the flat position in the padded image of kernel offset k of block l."""
    rank = len(image)
    padded = [image[i] + pads[i] + pads[rank + i] for i in range(rank)]
    blocks = [(padded[i] - dilations[i] * (block[i] - 1) - 1) // strides[i] + 1 for i in range(rank)]
    if any(b < 1 for b in blocks):
        raise ValueError(f"the blocks {block} (dilations {dilations}) do not fit the padded image {padded}")
    offsets = np.array(list(itertools.product(*[range(k) for k in block])), np.int64).reshape(-1, rank)
    origins = np.array(list(itertools.product(*[range(b) for b in blocks])), np.int64).reshape(-1, rank)
    coordinates = origins[None, :, :] * np.asarray(strides) + offsets[:, None, :] * np.asarray(dilations)
    return np.ravel_multi_index(tuple(np.moveaxis(coordinates, -1, 0)), padded).astype(np.int64)


@register("Col2Im", min_opset=18)
def col2im_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """Pad(dy), flattened spatially, gathered at :func:`im2col_positions`, reshaped to [N, C K, L]."""
    image, block = ctx.constant(node.input[1]), ctx.constant(node.input[2])
    if image is None or block is None:
        raise UnsupportedOperatorError(f"{describe(node)}: the gradient needs a constant image_shape and block_shape")
    image, block = [int(v) for v in image.reshape(-1)], [int(v) for v in block.reshape(-1)]
    rank = len(image)
    dilations = list(attr(node, "dilations", [1] * rank))
    pads = list(attr(node, "pads", [0] * 2 * rank))
    strides = list(attr(node, "strides", [1] * rank))
    try:
        positions = im2col_positions(image, block, dilations, pads, strides)
    except ValueError as error:
        raise UnsupportedOperatorError(f"{describe(node)}: {error}") from None
    dy = grads[0]
    if any(pads):
        dy = ctx.op("Pad", dy, ctx.ints([0, 0] + pads[:rank] + [0, 0] + pads[rank:]))
    flat = ctx.op("Reshape", dy, ctx.ints([0, 0, -1]))
    gathered = ctx.op("Gather", flat, ctx.ints(positions.reshape(-1)), axis=2)
    columns = ctx.op("Reshape", gathered, ctx.ints([0, -1, positions.shape[1]]))
    return [columns]
