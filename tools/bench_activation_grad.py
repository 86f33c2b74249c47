"""The activation gradients at 1 thread: each operator's C++ kernel (SiLUGrad, GeluGrad,
GeluTanhGrad) against the standard-op gradient the step graph writes without it, on one
tensor of [8, 128, 1024] float32 (Llama's and BERT's MLP activations).

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

__all__ = ["main"]


def _model(nodes: List[onnx.NodeProto], inputs: Sequence[str], shape: Sequence[int]) -> onnx.ModelProto:
    from normgrad.ops import DOMAIN, IR_VERSION, ONNX_OPSET, OPSET_VERSION

    def info(name: str):
        return oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(shape))

    graph = oh.make_graph(nodes, "activation_grad", [info(name) for name in inputs], [info("dx")])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", ONNX_OPSET), oh.make_opsetid(DOMAIN, OPSET_VERSION)],
                         ir_version=IR_VERSION)


def _standard_nodes(activation: str, known: Dict[str, str]) -> List[onnx.NodeProto]:
    from normgrad.ops import activation_grad

    nodes: List[onnx.NodeProto] = []

    def op(op_type: str, *inputs: str) -> str:
        nodes.append(oh.make_node(op_type, list(inputs), [f"t{len(nodes)}"]))
        return nodes[-1].output[0]

    def scalar(value: float) -> str:
        nodes.append(oh.make_node("Constant", [], [f"t{len(nodes)}"], value=onh.from_array(np.array(value, np.float32))))
        return nodes[-1].output[0]

    nodes.append(oh.make_node("Identity", [activation_grad.standard_form(activation, op, scalar, "dy", "x", known)],
                              ["dx"]))
    return nodes


def main(argv=None) -> Dict[str, Dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--shape", type=int, nargs="+", default=[8, 128, 1024])
    args = parser.parse_args(argv)
    import onnxruntime as ort

    import normgrad
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
    normgrad.session_options("cpp", options)
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
    return result


if __name__ == "__main__":
    main()
