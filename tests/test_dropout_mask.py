"""DropoutMask: every backend (C++ kernel, its baseline and AVX2 loops, Python kernel,
function body on onnxruntime and on onnx's ReferenceEvaluator) draws bitwise the mask of
the generator written again from its documentation (tests/test_dropout_seed.py); the step
graphs use the operator by default and the standard-op generator in the ``--inline`` and
portable forms, with the same masks on onnxruntime 1.32 and 1.19.2 at every thread count
and optimization level; bad inputs are errors naming the input."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper
import onnxruntime as ort
import pytest

import normgrad
from _helpers import bad_input_tests, cpp_available, old_runtime_python
from normgrad.graphs import build_step_graph, build_training_graph, rewrites
from normgrad.graphs.optimizers import hyperparameter_feeds
from normgrad.ops import DOMAIN, dropout_mask, harness
from normgrad.ops import python_kernels
from normgrad.train import Trainer
from _dropout_runs import LR, N, D, RATIOS, WORD, _feeds, _forward, _mask_names, _masks, _run_plain, _squares

BACKENDS = ["reference", "evaluator", "functions", "python"] + (["cpp"] if cpp_available() else [])
needs_cpp = pytest.mark.skipif(not cpp_available(), reason="the C++ library is not built")
SHAPES = [(0,), (1,), (7,), (3, 5, 33), (2, 0, 4), (2, 70001)]
"""Empty, one element, odd sizes, and more than two of the C++ loop's 65536-element chunks."""
KEYS = [(0, 1), (12345, 4567), (2**15 - 1, 2**15 - 1)]
LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL")


def _documented(shape, ratio, key):
    """The mask of the module docstring, in Python integers (test_dropout_seed's squares)."""
    key = key[0] * 2**15 + key[1]
    drawn = _squares(np.arange(int(np.prod(shape))) % WORD, key) // 2**6
    return (drawn.astype(np.float64) / 2**24 >= np.float64(np.float32(ratio))).reshape(shape)


def _inputs(shape, ratio, key, dtype=np.float32):
    return {"data": np.zeros(shape, dtype), "ratio": np.array(ratio, np.float32),
            "key_high": np.array([key[0]], np.int32), "key_low": np.array([key[1]], np.int32)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_backend_draws_the_documented_mask(backend, shape):
    for key in KEYS if np.prod(shape) < 1000 else KEYS[1:2]:
        for ratio in (0.0, 0.1, 0.5, 0.9):
            mask = harness.run(backend, dropout_mask.OP_TYPE, _inputs(shape, ratio, key))["mask"]
            assert mask.dtype == np.bool_ and mask.shape == shape
            np.testing.assert_array_equal(mask, _documented(shape, ratio, key), err_msg=f"key {key} ratio {ratio}")


@needs_cpp
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_cpp_kernel_reads_only_the_shape_of_data(dtype):
    inputs = _inputs((3, 50), 0.3, KEYS[1], dtype)
    inputs["data"] = np.random.default_rng(0).standard_normal((3, 50)).astype(dtype)
    np.testing.assert_array_equal(harness.run("cpp", dropout_mask.OP_TYPE, inputs)["mask"],
                                  _documented((3, 50), 0.3, KEYS[1]))


_RUN_GENERIC = """
import sys, numpy as np
from normgrad.ops import harness
inputs = {"data": np.zeros((3, 70001), np.float32), "ratio": np.array(0.25, np.float32),
          "key_high": np.array([12345], np.int32), "key_low": np.array([4567], np.int32)}
np.save(sys.argv[1], harness.run("cpp", "DropoutMask", inputs, threads=int(sys.argv[2]))["mask"])
"""


@needs_cpp
@pytest.mark.parametrize("kernels", ["generic", "auto", "auto on onnxruntime 1.19.2"])
def test_cpp_loops_agree_at_every_thread_count(tmp_path, kernels):
    """The baseline loop (NORMGRAD_KERNELS=generic) and the AVX2 one, at 1 and 2 threads,
    and the library loaded by the oldest supported onnxruntime (NORMGRAD_OLD_ORT_PYTHON)."""
    python = sys.executable
    if kernels.endswith("1.19.2"):
        python = old_runtime_python()
    env = {name: value for name, value in os.environ.items() if name != "NORMGRAD_KERNELS"}
    if kernels == "generic":
        env["NORMGRAD_KERNELS"] = "generic"
    for threads in (1, 2):
        path = tmp_path / f"{kernels.split()[0]}_{threads}.npy"
        process = subprocess.run([python, "-c", _RUN_GENERIC, str(path), str(threads)], env=env, cwd=tmp_path,
                                 capture_output=True, text=True, timeout=600)
        assert process.returncode == 0, process.stderr[-3000:]
        np.testing.assert_array_equal(np.load(path), _documented((3, 70001), 0.25, KEYS[1]))


_BAD_INPUTS = {
    "data int32": ("data", np.zeros(3, np.int32), "must be float32, float16, bfloat16 or double; got int32"),
    "ratio float16": ("ratio", np.array(0.3, np.float16), "must be float32; got float16"),
    "key_high int64": ("key_high", np.array([1], np.int64), "must be int32; got int64"),
    "key_low too large": ("key_low", np.array([2**15], np.int32), "must be a 15-bit limb in [0, 2**15); got 32768"),
    "key_high negative": ("key_high", np.array([-1], np.int32), "must be a 15-bit limb in [0, 2**15); got -1"),
    "ratio two elements": ("ratio", np.array([0.1, 0.2], np.float32), "must have one element; got shape [2]"),
    "key_low two elements": ("key_low", np.array([1, 2], np.int32), "must have one element; got shape [2]"),
}


BAD = {case: ({**_inputs((3, 4), 0.3, KEYS[1]), name: bad}, f"input '{name}' {rule}")
       for case, (name, bad, rule) in _BAD_INPUTS.items()}
test_cpp_bad_input_names_the_input, test_validate_names_the_input = bad_input_tests(dropout_mask, BAD)


def test_python_kernel_bad_limb_logs_and_drops_everything():
    """The bridge cannot raise: the message names the input, the mask keeps nothing."""
    inputs = _inputs((3, 4), 0.3, KEYS[1])
    inputs["key_low"] = np.array([2**15 + 3], np.int32)
    mask = harness.run("python", dropout_mask.OP_TYPE, inputs)["mask"]
    assert mask.shape == (3, 4) and not mask.any()
    assert "input 'key_low' must be a 15-bit limb" in python_kernels.errors()[-1]


# -- the step graphs ------------------------------------------------------------------------------


def _standard_only(model):
    return all(node.domain in ("", "ai.onnx") for node in model.graph.node) and not model.functions


def _session_masks(model, feeds, kernels, threads=1, level="ORT_ENABLE_ALL"):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    if kernels:
        normgrad.session_options(kernels, options)
        model = normgrad.prepare_for_python_kernels(model) if kernels == "python" else model
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(_mask_names(), {k: v for k, v in feeds.items() if k in {i.name for i in session.get_inputs()}})


def _probe(model):
    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.graph.output.extend(oh.make_empty_tensor_value_info(name) for name in _mask_names())
    return model


def test_step_graph_forms_draw_the_same_masks_at_every_level(tmp_path):
    """The default step graph draws with one DropoutMask node per Dropout (C++ and Python
    kernels, and the body onnxruntime inlines without them); ``--inline`` and the portable
    form have the generator in standard ops instead, the body's ops exactly; all draw the
    documented masks at every thread count and optimization level, and on the reference
    evaluator."""
    training = build_training_graph(_forward(), loss="mse")
    default, initial = build_step_graph(training, "adamw", dropout_seed=3)
    inline = build_step_graph(build_training_graph(_forward(), loss="mse", inline=True), "adamw", dropout_seed=3)
    portable = build_step_graph(training, "adamw", portable=True, dropout_seed=3)
    masks = [n for n in default.graph.node if n.domain == DOMAIN and n.op_type == dropout_mask.OP_TYPE]
    assert len(masks) == 2
    body = [n.op_type for n in dropout_mask.function_body().node]
    for form, _ in (inline, portable):
        ops = [n.op_type for n in form.graph.node]
        assert dropout_mask.OP_TYPE not in ops and not any(f.name == dropout_mask.OP_TYPE for f in form.functions)
        # the portable form writes Size as ReduceProd(Shape) (OpenVINO), the body's too
        assert all(ops.count(op_type) >= 2 * body.count(op_type) for op_type in body
                   if form is inline[0] or op_type != "Size")
    assert _standard_only(inline[0])
    expanded = rewrites.expand_dropout_masks(onnx.ModelProto.FromString(default.SerializeToString()))
    others = [n.op_type for n in default.graph.node if n.op_type != dropout_mask.OP_TYPE]
    assert sorted(n.op_type for n in expanded.graph.node) == sorted(others + body * 2)
    from onnx.reference import ReferenceEvaluator

    for step, seed in [(1, 3), (4, -7)]:
        feeds = {**hyperparameter_feeds(default), **initial, **_feeds(step, seed)}
        expected = _masks(seed, step, 0, [(N, D)] * 2, RATIOS)
        runs = {("plain", level): _session_masks(_probe(default), feeds, None, 1, level) for level in LEVELS}
        for kernels in (["cpp"] if cpp_available() else []) + ["python"]:
            runs.update({(kernels, threads, level): _session_masks(_probe(default), feeds, kernels, threads, level)
                         for threads in (1, 2) for level in LEVELS})
        for where, (model, state) in (("inline", inline), ("portable", portable)):
            form_feeds = {**hyperparameter_feeds(model), **state, **_feeds(step, seed)}
            out = _run_plain("current", _probe(model), {i.name: form_feeds[i.name] for i in model.graph.input}, tmp_path)
            runs[where] = [out[name] for name in _mask_names()]
        evaluator = ReferenceEvaluator(_probe(default))
        runs["evaluator"] = evaluator.run(_mask_names(), {i.name: feeds[i.name] for i in default.graph.input})
        for where, drawn in runs.items():
            for mask, truth in zip(drawn, expected):
                np.testing.assert_array_equal(mask, truth, err_msg=f"{where} step {step} seed {seed}")


@pytest.mark.parametrize("kernels", ["auto", None])
def test_trainer_step_is_the_standard_op_generator(kernels):
    """A Trainer's step (C++ kernel, or the body onnxruntime inlines) is bitwise the plain
    session of the expanded step graph, the generator in standard ops."""
    model, initial = build_step_graph(build_training_graph(_forward(), loss="mse"), "sgd", dropout_seed=9)
    expanded = rewrites.expand_dropout_masks(onnx.ModelProto.FromString(model.SerializeToString()))
    assert not any(n.op_type == dropout_mask.OP_TYPE for n in expanded.graph.node)
    rng = np.random.default_rng(5)
    x, labels = (rng.standard_normal((N, D)).astype(np.float32) for _ in range(2))
    trainer = Trainer(model, initial, lr=LR, kernels=kernels)
    loss = trainer.step(x, labels)
    session = ort.InferenceSession(expanded.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    out = dict(zip(names, session.run(None, {**hyperparameter_feeds(model), **initial, "x": x, "labels": labels,
                                            "lr": np.array(LR, np.float32), "step": np.array(1, np.float32),
                                             "dropout_seed": np.array(9, np.int64)})))
    assert np.float32(loss) == out["loss"]
    for name, value in trainer.state_dict().items():
        np.testing.assert_array_equal(value, out[f"{name}.next"])


@pytest.mark.slow
@needs_cpp
def test_bench_dropout_runs_and_checks_its_baseline(tmp_path, capsys):
    """The benchmark's smoke test: its rows, a baseline with the same outputs accepted, one
    with another Dropout ratio (other masks, other outputs) refused."""
    from normgrad.tools import bench_dropout
    from normgrad.tools.bench_portable import blocks

    forward = next(model for title, model, _, _ in blocks() if title.startswith("Transformer"))
    step, _ = build_step_graph(build_training_graph(forward, loss="mse"), "sgd")
    onnx.save(rewrites.expand_dropout_masks(step), tmp_path / "same.onnx")
    assert bench_dropout.main(["--rounds", "1", "--steps", "1", "--baseline", str(tmp_path / "same.onnx")]) == 0
    printed = capsys.readouterr().out
    for row in ("| C++ kernel |", "| function body |", "| step, DropoutMask kernel |", "| step, no Dropout |",
                f"| step, {tmp_path / 'same.onnx'} |"):
        assert row in printed
    other = onnx.ModelProto.FromString(step.SerializeToString())
    ratio = next(node for node in other.graph.node if node.op_type == "Constant" and node.output[0] == "ratio")
    ratio.attribute[0].t.CopyFrom(onnx.numpy_helper.from_array(np.array(0.5, np.float32), "ratio"))
    onnx.save(other, tmp_path / "other.onnx")
    with pytest.raises(SystemExit, match="differ from the DropoutMask step's"):
        bench_dropout.main(["--rounds", "1", "--steps", "1", "--baseline", str(tmp_path / "other.onnx")])
