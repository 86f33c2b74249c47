"""The activation gradients at 1 thread: each operator's C++ kernel (SiLUGrad, GeluGrad,
GeluTanhGrad) against the standard-op gradient the step graph writes without it, on one
tensor of [8, 128, 1024] float32 (Llama's and BERT's MLP activations); and the erf GELU's
forward and backward together, as the step graph computed them before GeluWithSlope (the
exporter's chain, which onnxruntime fuses into its Gelu, then GeluGrad(dy, x)) and with it
(GeluWithSlope, then Mul(dy, slope)).

    python -m normgrad.tools.bench_activation_grad [--rounds 15] [--shape 8 128 1024]

The standard side reads the forward values the graph has (SiLU's sigmoid; the erf GELU's
x / sqrt(2) and Phi(x)), as the step graph's gradient does; the tanh GELU's form recomputes
everything from x, as the Gelu rule's does. CPU time (time.process_time), both sides in this
process, interleaved rounds, medians; each side's output is checked against the float64
reference first.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Dict, List, Sequence

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from normgrad.ops import api

__all__ = ["main"]


def _model(nodes: List[onnx.NodeProto], inputs: Sequence[str], shape: Sequence[int],
           outputs: Sequence[str] = ("dx",)) -> onnx.ModelProto:
    from normgrad.ops import DOMAIN, IR_VERSION, ONNX_OPSET, OPSET_VERSION

    def info(name: str):
        return oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(shape))

    graph = oh.make_graph(nodes, "activation_grad", [info(name) for name in inputs], [info(name) for name in outputs])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", ONNX_OPSET), oh.make_opsetid(DOMAIN, OPSET_VERSION)],
                         ir_version=IR_VERSION)


def _standard_nodes(activation: str, known: Dict[str, str]) -> List[onnx.NodeProto]:
    from normgrad.ops import activation_grad

    nodes, op, scalar = activation_grad.body_writer()
    nodes.append(oh.make_node("Identity", [activation_grad.standard_form(activation, op, scalar, "dy", "x", known)],
                              ["dx"]))
    return nodes


def main(argv=None) -> Dict[str, Dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--shape", type=int, nargs="+", default=[8, 128, 1024])
    args = parser.parse_args(argv)
    import onnxruntime as ort

    from normgrad.ops import DOMAIN, activation_grad

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(args.shape) * 2).astype(np.float32)
    dy = rng.standard_normal(args.shape).astype(np.float32)
    forward = {"s": 1 / (1 + np.exp(-x.astype(np.float64))), "scaled": x.astype(np.float64) / math.sqrt(2)}
    forward["cdf"] = 0.5 * np.frompyfunc(math.erfc, 1, 1)(-forward["scaled"]).astype(np.float64)
    forward = {name: value.astype(np.float32) for name, value in forward.items()}
    known = {"silu": {"sigmoid": "s"}, "gelu_erf": {"scaled": "scaled", "cdf": "cdf"}, "gelu_tanh": {}}
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    api.session_options("cpp", options)
    calls = {}
    for activation, op_type in activation_grad.ACTIVATIONS.items():
        names = ["dy", "x", *known[activation].values()]
        feeds = {"dy": dy, "x": x, **{name: forward[name] for name in known[activation].values()}}
        truth = dy * activation_grad.derivative(activation, x)
        sides = {"standard ops": (_model(_standard_nodes(activation, known[activation]), names, args.shape), feeds),
                 op_type: (_model([oh.make_node(op_type, ["dy", "x"], ["dx"], domain=DOMAIN)], ["dy", "x"], args.shape),
                           {"dy": dy, "x": x})}
        for side, (model, side_feeds) in sides.items():
            session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            (out,) = session.run(None, side_feeds)
            if not np.allclose(out, truth, rtol=1e-4, atol=1e-5 * float(np.abs(dy).max())):
                raise SystemExit(f"bench_activation_grad: {activation} {side} differs from the float64 reference")
            calls[activation, side] = lambda session=session, side_feeds=side_feeds: session.run(None, side_feeds)
    times: Dict[tuple, List[float]] = {key: [] for key in calls}
    order = list(calls)
    for round_index in range(args.rounds):
        for key in order[round_index % len(order):] + order[:round_index % len(order)]:
            start = time.process_time()
            calls[key]()
            times[key].append(time.process_time() - start)
    elements = int(np.prod(args.shape))
    print(f"activation gradients on {args.shape} ({elements} elements) float32, 1 thread, CPU time, "
          f"medians of {args.rounds} interleaved rounds:")
    print("| activation | standard ops (ms) | operator (ms) | operator / standard |")
    print("|---|---|---|---|")
    result = {}
    for activation, op_type in activation_grad.ACTIVATIONS.items():
        standard = 1000 * statistics.median(times[activation, "standard ops"])
        fused = 1000 * statistics.median(times[activation, op_type])
        result[activation] = {"standard": standard, "operator": fused}
        print(f"| {activation} ({op_type}) | {standard:.2f} | {fused:.2f} | {fused / standard:.2f} |")
    result["gelu_erf forward and backward"] = _gelu_forward_and_backward(args.rounds, x, dy, options)
    return result


def _gelu_forward_and_backward(rounds: int, x: np.ndarray, dy: np.ndarray, options) -> Dict[str, float]:
    """The erf GELU's forward and backward without and with GeluWithSlope: times in ms, printed."""
    import onnxruntime as ort

    from normgrad.ops import DOMAIN, gelu_with_slope

    chain = [oh.make_node("Constant", [], [name], value=onh.from_array(np.array(value, np.float32)))
             for name, value in (("root2", math.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]
    chain += [oh.make_node("Div", ["x", "root2"], ["scaled"]), oh.make_node("Erf", ["scaled"], ["erf"]),
              oh.make_node("Add", ["erf", "one"], ["twice_cdf"]), oh.make_node("Mul", ["x", "twice_cdf"], ["product"]),
              oh.make_node("Mul", ["product", "half"], ["y"])]
    sides = {
        "Gelu, GeluGrad": chain + [oh.make_node("GeluGrad", ["dy", "x"], ["dx"], domain=DOMAIN)],
        "GeluWithSlope, Mul": [oh.make_node(gelu_with_slope.OP_TYPE, ["x"], ["y", "slope"], domain=DOMAIN),
                               oh.make_node("Mul", ["dy", "slope"], ["dx"])],
    }
    truth = gelu_with_slope.reference(x.astype(np.float64))
    calls = {}
    for side, nodes in sides.items():
        model = _model(nodes, ["dy", "x"], x.shape, ("y", "dx"))
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        y, dx = session.run(None, {"dy": dy, "x": x})
        if not (np.allclose(y, truth.y, rtol=1e-5, atol=1e-6) and np.allclose(dx, dy * truth.slope, rtol=1e-5, atol=1e-6)):
            raise SystemExit(f"bench_activation_grad: the erf GELU's {side} differs from the float64 reference")
        calls[side] = lambda session=session: session.run(None, {"dy": dy, "x": x})
    times: Dict[str, List[float]] = {side: [] for side in calls}
    for round_index in range(rounds):
        for side in list(calls)[::1 if round_index % 2 == 0 else -1]:
            start = time.process_time()
            calls[side]()
            times[side].append(time.process_time() - start)
    before, after = (1000 * statistics.median(times[side]) for side in sides)
    print(f"| erf GELU forward and backward (Gelu, GeluGrad -> GeluWithSlope, Mul) | {before:.2f} | {after:.2f} | "
          f"{after / before:.2f} |")
    return {"standard": before, "operator": after}


if __name__ == "__main__":
    main()
