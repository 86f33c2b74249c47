"""A normgrad operator's nodes written as its function body (the standard ops).
"""

from __future__ import annotations

import onnx
import onnx.inliner

from normgrad.ops import DOMAIN, _common

__all__ = ["expand_operator"]


def expand_operator(model: onnx.ModelProto, module) -> onnx.ModelProto:
    """``model`` with every main-graph node of the normgrad operator ``module`` replaced by
    its function body; ``model`` itself when it has none."""
    selected = (DOMAIN, module.OP_TYPE)
    nodes = [n for n in model.graph.node if (n.domain, n.op_type) == selected]
    if not nodes:
        return model
    if not any((f.domain, f.name) == selected for f in model.functions):
        opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        reads = _common.attribute_reads(module, nodes)
        model.functions.append(module.function_body(opset, reads) if reads else module.function_body(opset))
    model = onnx.inliner.inline_selected_functions(model, [selected])
    kept = [f for f in model.functions if (f.domain, f.name) != selected]
    del model.functions[:]
    model.functions.extend(kept)
    if not any(n.domain == DOMAIN for n in model.graph.node) and not any(f.domain == DOMAIN for f in kept):
        opsets = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(opsets)
    return model
