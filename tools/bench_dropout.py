"""The seeded Dropout mask at 1 thread: the DropoutMask C++ kernel against its function body
(the standard-op generator, which the step graphs drew before the operator and still draw in
the ``--inline`` and portable forms), per element and in a whole training step.

    python -m normgrad.tools.bench_dropout [--rounds 15] [--steps 5] [--baseline STEP.onnx]

CPU time (time.process_time) at 1 thread, every side in this process, interleaved rounds
(each round runs every side, in a new order), medians over the rounds of each round's
median. Per element: one DropoutMask node on [8, 128, 256]. The step: the SGD step graph of
the transformer layer of ``bench_portable`` ([16, 32, 64], Dropout 0.1, mse), with the
operator (this release's default form) and with it expanded into the standard-op generator
(``normgrad.graphs.rewrites.expand_dropout_masks``: bitwise the same masks, the graph the
default form was before the operator), both with the C++ kernels of the other operators
registered as the Trainer runs; and the same layer without Dropout as the floor.
``--baseline``: also the step graph of that file (the same layer's SGD step graph written by
another normgrad checkout, e.g. ``build_step_graph(build_training_graph(forward, loss="mse"),
"sgd")`` saved by the previous release), after checking its outputs are bitwise this one's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import onnx

from normgrad.ops import api

__all__ = ["main"]

MASK_SHAPE = (8, 128, 256)


def _session(model: onnx.ModelProto, kernels: bool):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    if kernels:
        api.session_options("cpp", options)
    return ort.InferenceSession(api.add_functions(model).SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def _mask_calls() -> Dict[str, Callable[[], object]]:
    from normgrad.ops import dropout_mask, harness

    inputs = {"data": np.zeros(MASK_SHAPE, np.float32), "ratio": np.array(0.1, np.float32),
              "key_high": np.array([12345], np.int32), "key_low": np.array([4567], np.int32)}
    model = harness.node_model(dropout_mask.OP_TYPE, inputs)
    calls = {}
    for name, kernels in (("C++ kernel", True), ("function body", False)):
        session = _session(model, kernels)
        calls[name] = lambda session=session: session.run(None, inputs)
    return calls


def _step_calls(baseline: Optional[str] = None) -> Dict[str, Callable[[], object]]:
    from normgrad.graphs import build_step_graph, build_training_graph, rewrites
    from normgrad.graphs.optimizers import hyperparameter_feeds
    from normgrad.tools.bench_portable import blocks

    forward = next(model for title, model, _, _ in blocks() if title.startswith("Transformer"))
    rng = np.random.default_rng(0)
    calls = {}
    for dropout in (True, False):
        if not dropout:
            for node in forward.graph.node:  # the same layer with its Dropouts in inference mode
                if node.op_type == "Dropout":
                    node.input[2] = "dropout_off"
            forward.graph.initializer.append(onnx.numpy_helper.from_array(np.array(False), "dropout_off"))
        step, initial = build_step_graph(build_training_graph(forward, loss="mse"), "sgd")
        feeds = {**hyperparameter_feeds(step), **initial, "lr": np.array(1e-3, np.float32),
                 "step": np.array(1, np.float32), "dropout_seed": np.array(7, np.int64)}
        for info in step.graph.input:
            if info.name not in feeds:
                feeds[info.name] = rng.standard_normal([d.dim_value for d in info.type.tensor_type.shape.dim]
                                                       ).astype(np.float32)
        forms = {"step, DropoutMask kernel": step,
                 "step, standard-op generator": rewrites.expand_dropout_masks(onnx.ModelProto.FromString(
                     step.SerializeToString()))} if dropout else {"step, no Dropout": step}
        if dropout and baseline:
            forms[f"step, {baseline}"] = onnx.load(baseline)
        outputs = {}
        for name, model in forms.items():
            session = _session(model, True)
            wanted = {i.name for i in session.get_inputs()}
            fed = {k: v for k, v in feeds.items() if k in wanted}
            outputs[name] = session.run(None, fed)
            calls[name] = lambda session=session, fed=fed: session.run(None, fed)
        first = outputs["step, DropoutMask kernel"] if dropout else None
        for name, values in outputs.items():
            if dropout and not all(np.array_equal(a, b) for a, b in zip(values, first)):
                raise SystemExit(f"bench_dropout: the outputs of '{name}' differ from the DropoutMask step's")
    return calls


def measure(calls: Dict[str, Callable[[], object]], rounds: int, runs: int, seed: int = 0) -> Dict[str, List[float]]:
    """{side: per-round median CPU milliseconds of one call}."""
    rng = np.random.default_rng(seed)
    for call in calls.values():
        call()  # warm-up
    times: Dict[str, List[float]] = {name: [] for name in calls}
    order = list(calls)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            samples = []
            for _ in range(runs):
                started = time.process_time()
                calls[name]()
                samples.append((time.process_time() - started) * 1e3)
            times[name].append(statistics.median(samples))
    return times


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m normgrad.tools.bench_dropout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5, help="calls per side and round")
    parser.add_argument("--baseline", default=None, help="an older normgrad's SGD step graph of the same layer (.onnx)")
    args = parser.parse_args(argv)
    elements = int(np.prod(MASK_SHAPE))
    masks = measure(_mask_calls(), args.rounds, args.steps)
    print(f"DropoutMask on {list(MASK_SHAPE)} ({elements} elements), 1 thread, CPU time:")
    print("| side | ns/element | ms | range over rounds (ms) |")
    print("|---|---|---|---|")
    for name, samples in masks.items():
        ms = statistics.median(samples)
        print(f"| {name} | {ms * 1e6 / elements:.2f} | {ms:.3f} | {min(samples):.3f}-{max(samples):.3f} |")
    steps = measure(_step_calls(args.baseline), args.rounds, args.steps)
    base = statistics.median(steps["step, DropoutMask kernel"])
    print("\nSGD step of the transformer layer [16, 32, 64], Dropout 0.1, mse, 1 thread, CPU time:")
    print("| side | ms per step | range over rounds | / DropoutMask kernel |")
    print("|---|---|---|---|")
    for name, samples in steps.items():
        ms = statistics.median(samples)
        print(f"| {name} | {ms:.3f} | {min(samples):.3f}-{max(samples):.3f} | {ms / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
