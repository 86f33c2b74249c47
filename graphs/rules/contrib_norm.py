"""onnxruntime's fused normalizations, through ``LayerNormalizationGrad`` and
``RMSNormalizationGrad`` (:func:`normgrad.graphs.rules.layer_norm.row_norm_gradient`):

- ``com.microsoft`` SkipLayerNormalization (input, skip, gamma, beta?, bias?) and
  SkipSimplifiedLayerNormalization (input, skip, gamma, bias?), what onnxruntime's transformer
  optimizer and onnxruntime-genai's builder write: s = input + skip (+ bias), normalised over
  the last axis (LayerNorm, or RMSNorm for the simplified one), times gamma (+ beta). skip is
  input's shape or broadcasts to it ([S, H], [1, S, H]); bias and beta are [H]. Outputs: y,
  mean and inv_std_var ([..., 1]; no gradient may flow into them), and s
  (``input_skip_bias_sum``, the residual stream), whose gradient joins s's. onnxruntime
  1.19.2's simplified kernel ignores the bias; the bias's gradient is that of the runtime
  running the graph (:func:`_bias_applied`).
- SimplifiedLayerNormalization (X, scale; Y, inv_std_var), which onnxruntime defines in the
  default domain (as the genai builder writes it): RMSNormalization's rule.

The backward reads s from the forward's sum output (added where the model omits it) and
recomputes the row statistics from it in float32 rather than reading the kernels' statistics
outputs, which it would then depend on (onnxruntime 1.32's CPU kernel of the simplified op
writes zeros as its mean).
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx
import onnx.defs
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.graphs.context import GradientContext, attr, describe
from normgrad.graphs.rules._contrib import TypeOf, input_type, rows_type
from normgrad.graphs.rules._norm import as_float32, inv_rms, statistics
from normgrad.graphs.rules.layer_norm import rms_norm_gradient, row_norm_gradient
from normgrad.graphs.rules.registry import UnsupportedOperatorError, register

__all__ = ["skip_layer_norm_gradient", "skip_simplified_layer_norm_gradient"]

_INPUT, _SKIP, _GAMMA = range(3)
_SUM_OUTPUT = 3
EPSILON = 1e-12
"""SkipLayerNormalization's default epsilon (its schema's); the simplified op's is the same."""


def _skip_output_types(node: onnx.NodeProto, type_of: TypeOf) -> List[Optional[onnx.TypeProto]]:
    """y and s like the input; mean and inv_std_var float32 rows."""
    x = input_type(node, type_of, _INPUT)
    stats = rows_type(x, -1, onnx.TensorProto.FLOAT)
    return [x, stats, stats, x][: len(node.output)]


def _optional(node: onnx.NodeProto, index: Optional[int]) -> Optional[str]:
    return node.input[index] if index is not None and len(node.input) > index and node.input[index] else None


def _skip_gradient(ctx: GradientContext, node: onnx.NodeProto, grads: List[Optional[str]],
                   simplified: bool) -> List[Optional[str]]:
    """The gradient of each input of a Skip(Simplified)LayerNormalization."""
    if any(grads[1:_SUM_OUTPUT]):
        raise UnsupportedOperatorError(
            f"{describe(node)}: a gradient flows into its mean or inv_std_var output; only the output's and the "
            "input_skip_bias_sum's are supported")
    x, skip, gamma = node.input[_INPUT], node.input[_SKIP], node.input[_GAMMA]
    beta_index, bias_index = (None, 3) if simplified else (3, 4)
    beta, bias = _optional(node, beta_index), _optional(node, bias_index)
    total = ctx.same_type(ctx.ensure_output(node, _SUM_OUTPUT, "input_skip_bias_sum"), x)
    result: List[Optional[str]] = [None] * len(node.input)
    parts = [grads[_SUM_OUTPUT]] if len(grads) > _SUM_OUTPUT and grads[_SUM_OUTPUT] else []
    if grads[0]:
        epsilon = attr(node, "epsilon", EPSILON)
        axes = [ctx.rank(x, node) - 1]
        if simplified:
            stats = [(inv_rms(ctx, total, axes, epsilon), None)]
        else:
            stats = [(value, None) for value in statistics(ctx, as_float32(ctx, total, total), axes, epsilon, keepdims=True)]
        op_type = "RMSNormalizationGrad" if simplified else "LayerNormalizationGrad"
        ds, result[_GAMMA], dbeta = row_norm_gradient(ctx, op_type, grads[0], node.output[0], total, gamma, stats, -1, beta)
        if beta is not None:
            result[beta_index] = dbeta
        parts.insert(0, ds)
    ds = ctx.sum_all(parts)
    result[_INPUT] = ds if ctx.needs_grad(x) else None  # s has the input's shape
    for index, name in ((_SKIP, skip), (bias_index, bias)):
        if name and ctx.needs_grad(name):
            result[index] = ctx.sum_to(ds, total, name)
    if simplified and bias and result[bias_index]:
        result[bias_index] = ctx.op("Mul", result[bias_index], ctx.op("CastLike", _bias_applied(ctx), result[bias_index]))
    return result


def _bias_applied(ctx: GradientContext) -> str:
    """1.0 (float32) where the runtime's SkipSimplifiedLayerNormalization adds its bias input, 0.0
    where it ignores it (onnxruntime 1.19.2's CPU kernel: its sum and output leave the bias out),
    asked of a node on constants that the runtime folds at load: zero input and skip, bias 1.
    The bias's gradient is the running runtime's derivative, zero where the bias changes nothing."""
    zeros = ctx.op("Constant", value=onh.from_array(np.zeros((1, 1, 2), np.float32)))
    ones = ctx.op("Constant", value=onh.from_array(np.ones(2, np.float32)))
    total = ctx.op("SkipSimplifiedLayerNormalization", zeros, zeros, ones, ones, domain="com.microsoft", outputs=4)[3]
    first = ctx.op("Reshape", ctx.op("Slice", total, ctx.ints([0, 0, 0]), ctx.ints([1, 1, 1])), ctx.ints([]))
    zero = ctx.op("Constant", value=onh.from_array(np.asarray(0.0, np.float32)))
    return ctx.op("Cast", ctx.op("Greater", first, zero), to=onnx.TensorProto.FLOAT)


@register("SkipLayerNormalization", inputs=(0, 1, 2, 3, 4), outputs=None, contrib=True, output_types=_skip_output_types)
def skip_layer_norm_gradient(ctx: GradientContext, node: onnx.NodeProto,
                             grads: List[Optional[str]]) -> List[Optional[str]]:
    """Gradients of input, skip, gamma, beta and bias."""
    return _skip_gradient(ctx, node, grads, simplified=False)


@register("SkipSimplifiedLayerNormalization", inputs=(0, 1, 2, 3), outputs=None, contrib=True,
          output_types=_skip_output_types)
def skip_simplified_layer_norm_gradient(ctx: GradientContext, node: onnx.NodeProto,
                                        grads: List[Optional[str]]) -> List[Optional[str]]:
    """Gradients of input, skip, gamma and bias."""
    return _skip_gradient(ctx, node, grads, simplified=True)


def _simplified_output_types(node: onnx.NodeProto, type_of: TypeOf) -> List[Optional[onnx.TypeProto]]:
    """Y like X; inv_std_var float32 (stash_type 1) over the axes from ``axis``."""
    x = input_type(node, type_of, 0)
    return [x, rows_type(x, attr(node, "axis", -1), onnx.TensorProto.FLOAT)][: len(node.output)]


def _register_simplified_schema() -> None:
    """Declares onnxruntime's default-domain SimplifiedLayerNormalization to onnx (its schema as
    onnxruntime registers it) so that onnx's checker accepts the models and training graphs that
    hold it; once per process."""
    if onnx.defs.has("SimplifiedLayerNormalization"):
        return
    schema = onnx.defs.OpSchema
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]
    onnx.defs.register_schema(schema(
        "SimplifiedLayerNormalization", "", 1, "onnxruntime's RMSNorm: X / sqrt(mean(X^2) + epsilon) * scale",
        inputs=[schema.FormalParameter("X", "T"), schema.FormalParameter("scale", "V")],
        outputs=[schema.FormalParameter("Y", "V"),
                 schema.FormalParameter("inv_std_var", "U", param_option=schema.FormalParameterOption.Optional)],
        type_constraints=[("T", floats, "X's type"), ("V", floats, "scale's and Y's type"),
                          ("U", ["tensor(float)", "tensor(double)"], "the statistics' type")],
        attributes=[schema.Attribute("axis", oh.make_attribute("axis", -1), "the first normalised axis"),
                    schema.Attribute("epsilon", oh.make_attribute("epsilon", 1e-5), "added to the mean square"),
                    schema.Attribute("stash_type", oh.make_attribute("stash_type", 1), "the statistics' type")]))


_register_simplified_schema()
register("SimplifiedLayerNormalization", inputs=(0, 1), output_types=_simplified_output_types)(rms_norm_gradient)
