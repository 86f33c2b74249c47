"""Forward-graph rewrites applied before differentiation: one pass per module, each exposing
``apply(model, context) -> changes`` (in place; ``context`` a :class:`RewriteContext`; the
number of changes it made), run by :func:`normgrad.graphs.builder.build_training_graph` in
the order listed here, as :mod:`normgrad.graphs.rules` registers the gradient rules.

:data:`PASSES` run on the forward model as it is, :data:`FUSIONS` after onnx shape
inference, on those inferred types (the builder infers them again after the fusions when
any made a change). Each module's docstring says what its pass rewrites and why.

Not passes of the builder: :mod:`~normgrad.graphs.rewrites.dropout_seed` (training-mode
Dropout drawn from a seed, on step graphs), :mod:`~normgrad.graphs.rewrites.weight_casts`,
:mod:`~normgrad.graphs.rewrites.input_shapes` and
:mod:`~normgrad.graphs.rewrites.depthwise_forward` (on training graphs, after
differentiation) and :mod:`~normgrad.graphs.rewrites.expand` (a normgrad operator written
as its function body).
"""

from __future__ import annotations

from normgrad.graphs.rewrites import (bfloat16, contrib_attention, contrib_rotary, embedding_bag_loops, gated_silu,
                                      gelu_order, gelu_slopes, integer_constants, kv_cache, opset, recurrent_layout,
                                      rotate_half, safe_softmax, sequences, tiling_slices, transposed_weights)
from normgrad.graphs.rewrites._graph import RewriteContext
from normgrad.graphs.rewrites.bfloat16 import bfloat16_in_float32, bfloat16_values
from normgrad.graphs.rewrites.depthwise_forward import depthwise_forwards
from normgrad.graphs.rewrites.dropout_seed import (DROPOUT_MICRO_BATCH_INPUT, DROPOUT_SEED_INPUT, METADATA_DROPOUT,
                                                   expand_dropout_masks, seed_dropout)
from normgrad.graphs.rewrites.embedding_bag_loops import embedding_bags
from normgrad.graphs.rewrites.expand import expand_operator
from normgrad.graphs.rewrites.gelu_order import gelu_erf_fusable_order
from normgrad.graphs.rewrites.gelu_slopes import gelu_erf_slopes
from normgrad.graphs.rewrites.input_shapes import shapes_from_inputs
from normgrad.graphs.rewrites.integer_constants import fold_integer_constants
from normgrad.graphs.rewrites.kv_cache import drop_kv_cache
from normgrad.graphs.rewrites.opset import GROUP_NORM_PER_CHANNEL_OPSET, MIN_OPSET, convert_opset
from normgrad.graphs.rewrites.recurrent_layout import recurrent_layout_0
from normgrad.graphs.rewrites.rotate_half import rotate_half_embeddings
from normgrad.graphs.rewrites.safe_softmax import safe_softmaxes
from normgrad.graphs.rewrites.sequences import rewrite_sequences
from normgrad.graphs.rewrites.gated_silu import silu_products
from normgrad.graphs.rewrites.tiling_slices import tiling_slices_as_split
from normgrad.graphs.rewrites.transposed_weights import transposed_weight_products
from normgrad.graphs.rewrites.weight_casts import cast_stored_weights_per_reader

__all__ = ["PASSES", "FUSIONS", "RewriteContext", "GROUP_NORM_PER_CHANNEL_OPSET", "MIN_OPSET", "convert_opset",
           "fold_integer_constants", "seed_dropout", "expand_dropout_masks", "expand_operator", "DROPOUT_SEED_INPUT",
           "DROPOUT_MICRO_BATCH_INPUT", "METADATA_DROPOUT", "recurrent_layout_0", "embedding_bags",
           "rewrite_sequences", "bfloat16_in_float32", "bfloat16_values", "transposed_weight_products",
           "cast_stored_weights_per_reader", "shapes_from_inputs", "gelu_erf_fusable_order", "tiling_slices_as_split",
           "safe_softmaxes", "silu_products", "depthwise_forwards", "gelu_erf_slopes", "rotate_half_embeddings", "drop_kv_cache", "REWRITTEN_CONTRIB_OP_TYPES"]

PASSES = (kv_cache, bfloat16, sequences, recurrent_layout, embedding_bag_loops, integer_constants, gelu_order, opset,
          contrib_attention, contrib_rotary)
"""The passes on the forward model, in order (kv_cache first: the data inputs the others see;
the opset pass after those that write ops it may convert, and the rules' minimum opsets are
read from the rewritten graph; the com.microsoft expansions after it, written for the opset it
sets)."""

REWRITTEN_CONTRIB_OP_TYPES = tuple(f"com.microsoft.{op_type}"
                                   for op_type in contrib_attention.OP_TYPES + contrib_rotary.OP_TYPES)
"""The com.microsoft operators the passes write as standard ONNX before differentiation (no
gradient rule of their own; ``supported_op_types`` names the ones with rules)."""

FUSIONS = (transposed_weights, tiling_slices, safe_softmax, gated_silu, gelu_slopes, rotate_half)
"""The passes that need inferred types, in order (rotate_half after tiling_slices, which makes
its Split)."""
