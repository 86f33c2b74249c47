"""Dropout-seeded step graphs and their plain-session runs, shared by the seed and the mask tests."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from _helpers import old_runtime_python

from normgrad.graphs import build_training_graph, rewrites


N, D = 6, 5
RATIOS = (0.3, 0.5)
LR = 0.1


def _forward(ratios=RATIOS, n=N, d=D, runtime_training=False) -> onnx.ModelProto:
    """y = Dropout(tanh(Dropout(x * W, p1)), p2) * V: two training-mode Dropouts."""
    rng = np.random.default_rng(1)
    training = [oh.make_tensor_value_info("training", onnx.TensorProto.BOOL, [])] if runtime_training else []
    graph = oh.make_graph(
        [oh.make_node("Mul", ["x", "W"], ["h"]),
         oh.make_node("Dropout", ["h", "p1", "training"], ["d1"], name="drop1"),
         oh.make_node("Tanh", ["d1"], ["t"]),
         oh.make_node("Dropout", ["t", "p2", "training"], ["d2"], name="drop2"),
         oh.make_node("Mul", ["d2", "V"], ["y"])],
        "dropout_net",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [n, d])] + training,
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [n, d])],
        initializer=[onh.from_array(rng.standard_normal(d).astype(np.float32), "W"),
                     onh.from_array(rng.standard_normal(d).astype(np.float32), "V"),
                     onh.from_array(np.array(ratios[0], np.float32), "p1"),
                     onh.from_array(np.array(ratios[1], np.float32), "p2")]
        + ([] if runtime_training else [onh.from_array(np.array(True), "training")]),
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _mask_names(**forward):
    """The mask outputs (d1's, d2's) the Dropout gradient rule adds in the training graph."""
    training = build_training_graph(_forward(**forward), loss="mse")
    return [n.output[1] for n in training.model.graph.node if n.op_type == "Dropout"]


WORD = 2**30


def _squares(counter, key):
    """squares on 30-bit words: Python integers, so no step can overflow or round."""
    counter = np.asarray(counter, object)
    rotate = lambda v: (v % 2**15) * 2**15 + v // 2**15  # noqa: E731
    y = counter * key % WORD
    z = (y + key) % WORD
    x = rotate((y * y + y) % WORD)
    x = rotate((x * x + z) % WORD)
    x = rotate((x * x + y) % WORD)
    return (x * x + z) % WORD


def _limbs(value, count):
    return [(int(value) >> (15 * j)) % 2**15 for j in range(count)]


def _masks(seed, step, micro_batch, shapes, ratios):
    limbs = _limbs(seed, 5) + _limbs(step, 2) + _limbs(micro_batch, 2)
    summed = int(_squares([j * 2**15 + v for j, v in enumerate(limbs)], rewrites.dropout_seed._CHAIN_KEYS[0]).sum()) % WORD
    key = int(_squares(summed, rewrites.dropout_seed._CHAIN_KEYS[1])) | 1
    node_keys = [int(k) | 1 for k in _squares(np.arange(len(shapes)), key)]
    return [((_squares(np.arange(int(np.prod(shape))) % WORD, k) // 2**6).astype(np.float64) / 2**24 >= p).reshape(shape)
            for k, shape, p in zip(node_keys, shapes, ratios)]


_RUN_PLAIN = """
import sys, numpy as np, onnxruntime as ort
model, feeds, out, threads, level = sys.argv[1:]
options = ort.SessionOptions()
options.intra_op_num_threads = int(threads)
options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
names = [o.name for o in session.get_outputs()]
np.savez(out, **dict(zip(names, session.run(None, dict(np.load(feeds))))))
"""


def _run_plain(runtime, model, feeds, folder, threads=1, level="ORT_ENABLE_ALL"):
    """Outputs of a plain onnxruntime session (no normgrad kernels: the function bodies)."""
    python = sys.executable
    if runtime == "old":
        python = old_runtime_python()
    tag = f"{runtime}_{threads}_{level}"
    paths = [os.path.join(folder, f"{tag}.{ext}") for ext in ("onnx", "feeds.npz", "out.npz")]
    onnx.save(model, paths[0])
    np.savez(paths[1], **feeds)
    process = subprocess.run([python, "-c", _RUN_PLAIN, *paths, str(threads), level],
                             capture_output=True, text=True, timeout=3600)
    assert process.returncode == 0, process.stderr[-3000:]
    return dict(np.load(paths[2]))


def _feeds(step, seed=0, micro=None, rng_seed=0):
    rng = np.random.default_rng(rng_seed)
    feeds = {"x": rng.standard_normal((N, D)).astype(np.float32),
             "labels": rng.standard_normal((N, D)).astype(np.float32),
             "lr": np.array(LR, np.float32), "step": np.array(step, np.float32)}
    feeds["dropout_seed"] = np.array(seed, np.int64)
    if micro is not None:
        feeds["dropout_micro_batch"] = np.array(micro, np.int64)
    return feeds
