"""The float64 SwiGLU forward and an ulp-distance check, shared by the SwiGLU and SiLU-Mul tests."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.ops import IR_VERSION


def _within_ulps(got, truth, scale, ulps=8):
    """NaN where the truth is, infinities equal, the rest within ``ulps`` float32 ulps of ``scale``."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(truth))
    infinite = np.isinf(truth)
    np.testing.assert_array_equal(got[infinite], truth[infinite])
    finite = np.isfinite(truth)
    bound = ulps * np.spacing(np.abs(scale[finite]).astype(np.float32)).astype(np.float64) + 2.0**-140
    error = np.abs(got.astype(np.float64)[finite] - truth[finite])
    assert (error <= bound).all(), np.flatnonzero(~(error <= bound))[:5]


def _forward(variant="swiglu", dtype=onnx.TensorProto.FLOAT):
    """x @ wg -> SiLU (Mul(g, Sigmoid(g))) -> times up = x @ wu -> @ wd; variants: the
    operands of either Mul swapped; where the rewrite into SiLUMul must not apply: the SiLU
    also read elsewhere, up broadcast, up the SiLU's input, the Sigmoid or the SiLU a graph
    output, a dynamic batch size, another float type (``dtype``)."""
    rng = np.random.default_rng(0)
    values = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    weights = {name: onh.from_array((rng.standard_normal(shape) * 0.7).astype(values), name)
               for name, shape in (("wg", (6, 8)), ("wu", (6, 8)), ("wd", (8, 4)), ("bias", (1, 8)))}
    up = {"broadcast": "bias", "self": "g"}.get(variant, "u")
    swapped = variant == "both swapped"
    nodes = [oh.make_node("MatMul", ["x", "wg"], ["g"]), oh.make_node("MatMul", ["x", "wu"], ["u"]),
             oh.make_node("Sigmoid", ["g"], ["s"]),
             oh.make_node("Mul", ["s", "g"] if swapped or variant == "sigmoid first" else ["g", "s"], ["a"]),
             oh.make_node("Mul", [up, "a"] if swapped or variant == "up first" else ["a", up], ["p"])]
    if variant == "read twice":
        nodes += [oh.make_node("Add", ["p", "a"], ["q"]), oh.make_node("MatMul", ["q", "wd"], ["y"])]
    else:
        nodes.append(oh.make_node("MatMul", ["p", "wd"], ["y"]))
    batch = "batch" if variant == "dynamic batch" else 5
    outputs = [oh.make_tensor_value_info("y", dtype, [batch, 4])]
    outputs += [oh.make_tensor_value_info(name, dtype, [batch, 8])
                for name, case in (("s", "sigmoid an output"), ("a", "silu an output")) if variant == case]
    graph = oh.make_graph(nodes, "gated_mlp", [oh.make_tensor_value_info("x", dtype, [batch, 6])], outputs,
                          list(weights.values()))
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=IR_VERSION)
