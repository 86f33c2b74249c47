"""DepthToSpace (DCR and CRD) and SpaceToDepth: permutations of the elements, whose
gradient is the inverse permutation of dy.

SpaceToDepth inverts DepthToSpace in DCR mode exactly (both order a pixel block's channels
as [b, b, C]). CRD mode orders them [C, b, b]: it is DCR applied to x with its channels
regrouped from [C, b*b] to [b*b, C], so its gradient is SpaceToDepth(dy) regrouped back
(Reshape to [N, b*b, C, H, W] from the run-time shape, Transpose, Reshape to x's shape),
valid at any batch and image size.
"""

from __future__ import annotations

from typing import List, Optional

import onnx

from normgrad.graphs.context import GradientContext, attr
from normgrad.graphs.rules.registry import register

__all__ = ["depth_to_space_gradient", "space_to_depth_gradient"]


@register("DepthToSpace")
def depth_to_space_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """SpaceToDepth(dy), with CRD's channel order restored."""
    blocksize = int(attr(node, "blocksize", 1))
    grad = ctx.op("SpaceToDepth", grads[0], blocksize=blocksize)
    if attr(node, "mode", "DCR") == "CRD":
        block = blocksize * blocksize
        grouped_shape = ctx.op("Concat", ctx.shape_of(grad, end=1), ctx.ints([block, -1]), ctx.shape_of(grad, start=2), axis=0)
        swapped = ctx.op("Transpose", ctx.op("Reshape", grad, grouped_shape), perm=[0, 2, 1, 3, 4])
        grad = ctx.op("Reshape", swapped, ctx.shape_of(node.input[0]))
    return [grad]


@register("SpaceToDepth")
def space_to_depth_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]]) -> List[Optional[str]]:
    """DepthToSpace(dy) in DCR mode."""
    return [ctx.op("DepthToSpace", grads[0], blocksize=int(attr(node, "blocksize", 1)), mode="DCR")]
