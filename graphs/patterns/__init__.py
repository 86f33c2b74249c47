"""Multi-node patterns differentiated as a whole: one module per pattern, and their registry.

A rule (:mod:`normgrad.graphs.rules`) differentiates one node. Some exporters write a layer
as a chain of nodes whose node-by-node gradient costs extra passes over the data; a pattern
recognises such a chain in the forward graph and differentiates it in one go (for example
torch's TorchScript GroupNorm: Reshape → InstanceNormalization → Reshape → Mul → Add, one
``GroupNormalizationGrad`` instead of that plus the Mul/Add gradients).

A pattern module calls :func:`register` with a matcher ``match(view, ctx, node) ->
Match | None``, tried on every node as the candidate *anchor* (the last node of the chain).
Matchers are strict: anything unexpected (a value of the chain that is a graph output or
feeds another node, a constant that is not the expected one, an unknown shape) returns
None and the general per-node rules apply instead. The builder then, in reverse order,
calls the match's ``gradient`` at the anchor and skips the match's other nodes.
"""

from __future__ import annotations

from normgrad.graphs.patterns.registry import (
    GradientFn,
    GraphView,
    Match,
    Matcher,
    Matches,
    find_matches,
    is_op,
    register,
)

# Importing the pattern modules registers their matchers.
from normgrad.graphs.patterns import (  # noqa: F401
    batch_norm_relu,
    gelu_erf_chain,
    gelu_tanh_chain,
    layer_norm_chain,
    rms_norm_chain,
    silu,
    torch_group_norm,
)

__all__ = ["GraphView", "Match", "Matches", "register", "find_matches", "is_op"]
