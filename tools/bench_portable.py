"""``python -m normgrad.tools.bench_portable [--rounds R]``: what each graph form of a training
graph costs on onnxruntime's CPU provider (2 threads): weights as initializers and inputs
(the old default), weights as pure inputs, every portable rewrite, and every rewrite but one.
Interleaved rounds (each round runs every form once, in a new order), medians and ranges
over the rounds of the per-round median step time; the weights are fed in every form."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import onnx

from normgrad.ops import api

__all__ = ["main", "forms", "blocks"]


def blocks():
    """(name, forward model, loss, runs per round): the graphs of the measurement."""
    from normgrad.graphs import examples

    def resized(model: onnx.ModelProto, shape: Sequence[int], output_shape: Optional[Sequence[int]] = None) -> onnx.ModelProto:
        for value, sizes in ((model.graph.input[0], shape), (model.graph.output[0], output_shape or shape)):
            for dim, size in zip(value.type.tensor_type.shape.dim, sizes):
                dim.dim_value = size
        return model

    return [
        ("UNet block [8, 16, 32, 32], mse", resized(examples.unet_block(channels=16, hidden=16), (8, 16, 32, 32)), "mse", 10),
        ("ResNet block [8, 32, 32, 32], mse", resized(examples.resnet_block(channels=32), (8, 32, 32, 32)), "mse", 10),
        ("MLP [8, 5] -> 3 classes, cross_entropy", resized(examples.mlp(), (8, 5), (8, 3)), "cross_entropy", 300),
        ("Transformer layer [16, 32, 64], Dropout 0.1, mse",
         resized(examples.transformer_block(dropout=0.1, width=64, hidden=256), (16, 32, 64)), "mse", 30),
    ]


def forms(training: onnx.ModelProto) -> Dict[str, onnx.ModelProto]:
    """The graph forms compared, by name."""
    from normgrad.graphs.portable import REWRITES, make_portable

    result = {"initializers+inputs": training, "pure inputs": make_portable(training, skip=REWRITES)[0],
              "portable (all)": make_portable(training)[0]}
    for rewrite in REWRITES:
        result[f"all but {rewrite}"] = make_portable(training, skip=[rewrite])[0]
    return result


def _feeds(training: onnx.ModelProto, rng) -> Dict[str, np.ndarray]:
    import onnx.numpy_helper as onh

    initializers = {t.name: onh.to_array(t) for t in training.graph.initializer}
    feeds = {}
    for info in training.graph.input:
        if info.name in initializers:
            feeds[info.name] = initializers[info.name]
            continue
        dims = [d.dim_value for d in info.type.tensor_type.shape.dim]
        if info.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            feeds[info.name] = rng.integers(0, 3, dims).astype(np.int64)
        else:
            feeds[info.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def measure(training: onnx.ModelProto, runs: int, rounds: int, seed: int = 0) -> Dict[str, List[float]]:
    """{form: per-round median milliseconds of one training-graph run}."""
    import onnxruntime as ort

    rng = np.random.default_rng(seed)
    feeds = _feeds(training, rng)
    sessions = {}
    for name, model in forms(training).items():
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        options.log_severity_level = 3
        session = ort.InferenceSession(api.add_functions(model).SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        wanted = {i.name for i in session.get_inputs()}
        fed = {k: v for k, v in {**feeds, "dropout_seed": np.array(0, np.int64)}.items() if k in wanted}
        sessions[name] = (session, fed)
        session.run(None, sessions[name][1])  # warm-up
    times: Dict[str, List[float]] = {name: [] for name in sessions}
    order = list(sessions)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            session, fed = sessions[name]
            samples = []
            for _ in range(runs):
                started = time.perf_counter()
                session.run(None, fed)
                samples.append((time.perf_counter() - started) * 1e3)
            times[name].append(statistics.median(samples))
    return times


def main(argv: Optional[Sequence[str]] = None) -> int:
    from normgrad.graphs.builder import training_graph_with_stored_weights

    parser = argparse.ArgumentParser(prog="python -m normgrad.tools.bench_portable", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", default="", help="measure the graphs whose title contains this text")
    args = parser.parse_args(argv)
    print("| graph | form | median ms | range over rounds |")
    print("|---|---|---|---|")
    for title, forward, loss, runs in blocks():
        if args.only not in title:
            continue
        training = training_graph_with_stored_weights(forward, loss=loss)
        for name, samples in measure(training, runs, args.rounds).items():
            print(f"| {title} | {name} | {statistics.median(samples):.3f} | {min(samples):.3f}-{max(samples):.3f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
