"""Training-mode BatchNormalization → Relu: the ReLU backward fused into the BatchNorm's.

The common CNN block Conv → BatchNormalization → Relu. Node by node, the Relu's gradient is
a full tensor dy · (x > 0) that the two BatchNorm backward ops then read. Here, when the
BatchNorm output's only reader is the Relu, the BatchNorm backward ops (``BatchNormReduceBackward``
and ``BatchNormElemtBackward``) read the Relu's incoming gradient and its output y directly
(their optional input ``relu_output``) and mask on the fly, as cuDNN's fused
BatchNorm-activation backward does: no Relu gradient nodes, no masked tensor written. The
mask is taken from the Relu's output, which the next layer's backward keeps alive anyway,
so the BatchNorm output is no longer needed after the forward.

Matched strictly, else the general rules apply: a default-domain Relu whose input is the
output of a training-mode BatchNormalization (rewritten by
:func:`normgrad.graphs.rules.batch_norm.make_batch_statistics_explicit`) that nothing else
reads and that is not a graph output. Inference-mode BatchNormalization keeps the node by
node gradient.

Measured (fp32, 2 threads, onnxruntime 1.32, shared machine at load 2-5): the AdamW step
graphs of ``normgrad bench --train``'s ResNet block and ResNet-18 built before and after,
run in one process with the C++ kernels, alternating 60 rounds: per-round time ratio
after/before median 0.987 on both (quartiles 0.965-1.025 and 0.953-1.008), every output
bitwise equal. ``normgrad bench --train --repeat 5``, four before/after pairs interleaved:
``cpp`` against torch eager, median of the four runs 1.14x → 1.02x (ResNet block) and
1.11x → 1.05x (ResNet-18), within the load's noise; peak RSS 374 → 331 MB and 894 → 870 MB
(the step's own share 201 → 158 MB and 216 → 186 MB): the BatchNorm output and the masked
gradient are no longer kept. On function bodies (no kernels) the select is an ONNX Where,
which onnxruntime's CPU runs single-threaded (13 ms on [16, 64, 56, 56] against 1.7 ms for
Greater + Cast + Mul), and the BatchNorms without a Relu are fed the scalar 1.0 (one body per
op type): that path got 1-4% slower (same A/B, 20 rounds).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import onnx

from normgrad.graphs.context import GradientContext
from normgrad.graphs.patterns.registry import GraphView, Match, is_op, register
from normgrad.graphs.rules.batch_norm import batch_norm_backward

__all__ = ["PATTERN", "match_batch_norm_relu"]

PATTERN = "batch_norm_relu"


@register(PATTERN)
def match_batch_norm_relu(view: GraphView, ctx: GradientContext, relu: onnx.NodeProto) -> Optional[Match]:
    """BatchNormalization → ``relu``, or None."""
    if not is_op(relu, "Relu") or len(relu.input) != 1 or not relu.output[0]:
        return None
    norm = view.producer.get(relu.input[0])
    if not is_op(norm, "BatchNormalization") or norm.output[0] not in ctx.batch_statistics:
        return None
    if not view.only_consumer(norm.output[0], relu):
        return None

    def gradient(ctx: GradientContext, dy: str) -> List[Tuple[str, str]]:
        grads = batch_norm_backward(ctx, norm, dy, relu_output=relu.output[0])
        return [(norm.input[i], grad) for i, grad in enumerate(grads) if grad]

    return Match(PATTERN, relu, [relu, norm], gradient)
