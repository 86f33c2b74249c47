"""Minimal reproducers of the OpenVINO execution-provider defects normgrad works around
(found on onnxruntime-openvino 1.24.1, device CPU), to check your own OpenVINO version.

Each ``test_defect_*`` builds a tiny model, checks that the CPU provider's result equals a
float64 NumPy reference (so the reproducer itself is right), then runs it on OpenVINO:

* correct result: the test passes: your version does not have the defect;
* wrong result, or the refusal the defect is known by: XFAIL, the reason naming the defect
  and the error measured (``pytest -rx tests/test_openvino_defects.py`` lists them);
* any other error: the test fails (something new, not this defect).

Each ``test_portable_*`` runs the same model after :func:`normgrad.graphs.portable.make_portable`
on OpenVINO and must give the correct result: the workaround works.
Everything skips where onnxruntime-openvino is not installed.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from normgrad.graphs import examples
from normgrad.graphs.portable import make_portable
from normgrad.ops import IR_VERSION

from _providers import CPU, OPENVINO_CPU, first_line, max_relative_error, requires_openvino, run

pytestmark = [pytest.mark.slow, requires_openvino]

TOLERANCE = 1e-5
FLOAT = onnx.TensorProto.FLOAT


def _model(nodes, inputs, outputs, initializers=(), opset=18) -> onnx.ModelProto:
    graph = oh.make_graph(
        nodes,
        "reproducer",
        [oh.make_tensor_value_info(name, elem, shape) for name, elem, shape in inputs],
        [oh.make_tensor_value_info(*((name, FLOAT, None) if isinstance(name, str) else (name[0], FLOAT, name[1])))
         for name in outputs],
        initializer=[onh.from_array(value, name) for name, value in initializers],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 10
    inferred = onnx.shape_inference.infer_shapes(model)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    return model


def _conv(x: np.ndarray, w: np.ndarray, pad: int) -> np.ndarray:
    """float64 Conv, stride 1, group 1."""
    x = np.pad(x.astype(np.float64), [(0, 0), (0, 0), (pad, pad), (pad, pad)])
    k = w.shape[2]
    windows = np.lib.stride_tricks.sliding_window_view(x, (k, k), axis=(2, 3))  # N, C, H, W, k, k
    return np.einsum("nchwij,ocij->nohw", windows, w.astype(np.float64))


def _conv_transpose(d: np.ndarray, w: np.ndarray, pad: int) -> np.ndarray:
    """float64 ConvTranspose, stride 1: a Conv with the kernel flipped and its channel axes swapped."""
    k = w.shape[2]
    return _conv(d, np.flip(w, (2, 3)).transpose(1, 0, 2, 3), k - 1 - pad)


def _observe(model, feeds, expected, defect: str, refusal: str = None) -> None:
    """The check every reproducer shares (see the module docstring)."""
    cpu = run(model, feeds, CPU)
    for name, want in expected.items():
        assert max_relative_error(cpu[name], want) <= TOLERANCE, f"the reproducer is wrong: CPU provider's {name}"
    try:
        got = run(model, feeds, OPENVINO_CPU)
    except Exception as error:  # onnxruntime's errors have no public type of their own
        if refusal and re.search(refusal, str(error)):
            pytest.xfail(f"{defect}: OpenVINO refused it ({first_line(error)})")
        raise
    errors = {name: max_relative_error(got[name], want) for name, want in expected.items()}
    wrong = {name: e for name, e in errors.items() if not e <= TOLERANCE}
    if wrong:
        pytest.xfail(f"{defect}: " + ", ".join(f"{name} off by {e:.3g} of its scale" for name, e in wrong.items()))


def _portable_is_correct(model, feeds, expected) -> None:
    portable, moved = make_portable(model)
    got = run(portable, {**moved, **feeds}, OPENVINO_CPU)
    for name, want in expected.items():
        assert max_relative_error(got[name], want) <= TOLERANCE, name


# 1. A constant square weight read by a Conv and a ConvTranspose: the ConvTranspose is wrong.

def _shared_weight_case():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 3, 3, 3)).astype(np.float32)
    feeds = {name: rng.standard_normal((1, 3, 5, 5)).astype(np.float32) for name in ("x", "d")}
    model = _model(
        [oh.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         oh.make_node("ConvTranspose", ["d", "w"], ["t"], pads=[1, 1, 1, 1])],
        [("x", FLOAT, [1, 3, 5, 5]), ("d", FLOAT, [1, 3, 5, 5])], ["c", "t"], [("w", w)],
    )
    expected = {"c": _conv(feeds["x"], w, 1), "t": _conv_transpose(feeds["d"], w, 1)}
    return model, feeds, expected


# 2. A graph input that is also an initializer: OpenVINO uses the stored value, not the fed one.

def _initializer_input_case():
    rng = np.random.default_rng(2)
    stored, fed, x = (rng.standard_normal((2, 3)).astype(np.float32) for _ in range(3))
    model = _model([oh.make_node("Mul", ["x", "w"], ["y"])], [("x", FLOAT, [2, 3]), ("w", FLOAT, [2, 3])], ["y"],
                   [("w", stored)])
    return model, {"x": x, "w": fed}, {"y": x.astype(np.float64) * fed}


def test_portable_initializer_input_frozen():
    model, feeds, expected = _initializer_input_case()
    portable, moved = make_portable(model)
    assert list(moved) == ["w"] and not portable.graph.initializer
    got = run(portable, feeds, OPENVINO_CPU)  # the fed w, not the stored one
    assert max_relative_error(got["y"], expected["y"]) <= TOLERANCE


# 3. BatchNormalization with training_mode=1: refused when the session is created, no CPU fallback.

def _batch_norm_case():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3, 2, 2)).astype(np.float32)
    scale, bias, mean = (rng.standard_normal(3).astype(np.float32) for _ in range(3))
    var = rng.uniform(0.5, 1.5, 3).astype(np.float32)
    model = _model(
        [oh.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "running_mean", "running_var"],
                      training_mode=1, epsilon=1e-5)],
        [("x", FLOAT, [4, 3, 2, 2])], ["y"], [("s", scale), ("b", bias), ("m", mean), ("v", var)],
    )
    x64 = x.astype(np.float64)
    mu, sigma2 = x64.mean(axis=(0, 2, 3), keepdims=True), x64.var(axis=(0, 2, 3), keepdims=True)
    y = (x64 - mu) / np.sqrt(sigma2 + 1e-5) * scale.reshape(1, 3, 1, 1) + bias.reshape(1, 3, 1, 1)
    return model, {"x": x}, {"y": y}


def test_portable_refuses_training_mode_batch_norm():
    """make_portable cannot fix a training-mode BatchNormalization written by someone else;
    it says so (the exporter writes the batch statistics explicitly instead)."""
    with pytest.raises(ValueError, match="training_mode=1 is not portable"):
        make_portable(_batch_norm_case()[0])


# 4. The cross-entropy loss graph (OneHot with a run-time depth, CastLike of a constant):
#    "Output names mismatch" at run time when the batch size is symbolic.

def _onehot_case():
    """The cross-entropy training graph of Relu(x) as normgrad wrote it before its loss
    gradient lost the one-hot tensor (and as a user's model may still hold one): OneHot of
    the labels with a run-time depth and CastLike'd values, softmax minus it, over the count."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    labels = np.array([0, 2, 1, 2], np.int64)
    f32 = onnx.TensorProto.FLOAT
    nodes = [
        oh.make_node("Relu", ["x"], ["y"]),
        oh.make_node("LogSoftmax", ["y"], ["log_probs"], axis=1),
        oh.make_node("Constant", [], ["one"], value_ints=[1]),
        oh.make_node("Unsqueeze", ["labels", "one"], ["index"]),
        oh.make_node("GatherElements", ["log_probs", "index"], ["picked"], axis=1),
        oh.make_node("ReduceMean", ["picked"], ["mean"], keepdims=0),
        oh.make_node("Neg", ["mean"], ["loss"]),
        oh.make_node("Shape", ["y"], ["classes"], start=1, end=2),
        oh.make_node("Constant", [], ["zero"], value_ints=[0]),
        oh.make_node("Squeeze", ["classes", "zero"], ["depth"]),
        oh.make_node("Constant", [], ["off_on"], value=onh.from_array(np.array([0.0, 1.0], np.float32))),
        oh.make_node("CastLike", ["off_on", "y"], ["values"]),
        oh.make_node("OneHot", ["labels", "depth", "values"], ["onehot"], axis=1),
        oh.make_node("Softmax", ["y"], ["probabilities"], axis=1),
        oh.make_node("Size", ["labels"], ["size"]),
        oh.make_node("CastLike", ["size", "y"], ["count"]),
        oh.make_node("Sub", ["probabilities", "onehot"], ["difference"]),
        oh.make_node("Div", ["difference", "count"], ["y_grad"]),
        oh.make_node("Constant", [], ["zero_f"], value=onh.from_array(np.array(0.0, np.float32))),
        oh.make_node("Greater", ["x", "zero_f"], ["positive"]),
        oh.make_node("CastLike", ["positive", "x"], ["mask"]),
        oh.make_node("Mul", ["y_grad", "mask"], ["x_grad"]),
    ]
    graph = oh.make_graph(nodes, "onehot_cross_entropy",
                          [oh.make_tensor_value_info("x", f32, ["N", 3]),
                           oh.make_tensor_value_info("labels", onnx.TensorProto.INT64, ["N"])],
                          [oh.make_tensor_value_info("loss", f32, []), oh.make_tensor_value_info("x_grad", f32, ["N", 3])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=IR_VERSION)
    onnx.checker.check_model(model, full_check=True)
    y = np.maximum(x.astype(np.float64), 0.0)
    e = np.exp(y - y.max(axis=1, keepdims=True))
    probabilities = e / e.sum(axis=1, keepdims=True)
    loss = -np.mean(np.log(probabilities[np.arange(4), labels]))
    x_grad = (probabilities - np.eye(3)[labels]) / 4 * (x > 0)
    return model, {"x": x, "labels": labels}, {"loss": np.array(loss), "x_grad": x_grad}


# 5. An input nothing reads: OpenVINO binds the remaining inputs by position.

def _unused_input_case():
    a, b, c = (np.full(3, v, np.float32) for v in (1.0, 10.0, 100.0))
    model = _model([oh.make_node("Sub", ["a", "b"], ["y"])], [(n, FLOAT, [3]) for n in ("c", "a", "b")], ["y"])
    return model, {"a": a, "b": b, "c": c}, {"y": (a - b).astype(np.float64)}


# 6. GroupNormalization-21: its output loses its rank and the model does not compile.

def _group_norm_case():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 4, 3, 3)).astype(np.float32)
    scale, bias = rng.uniform(0.5, 1.5, 4).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    model = _model(
        [oh.make_node("GroupNormalization", ["x", "s", "b"], ["n"], num_groups=2, epsilon=1e-5),
         oh.make_node("Relu", ["n"], ["y"])],
        [("x", FLOAT, [2, 4, 3, 3])], [("y", [2, 4, 3, 3])], [("s", scale), ("b", bias)], opset=21,
    )
    grouped = x.astype(np.float64).reshape(2, 2, -1)
    normed = (grouped - grouped.mean(-1, keepdims=True)) / np.sqrt(grouped.var(-1, keepdims=True) + 1e-5)
    y = normed.reshape(x.shape) * scale.reshape(1, 4, 1, 1) + bias.reshape(1, 4, 1, 1)
    return model, {"x": x}, {"y": np.maximum(y, 0.0)}


# 7. Size of a value OpenVINO computes, read back by OpenVINO nodes: Size goes to the CPU
#    provider and the partition has a cycle.

def _size_case():
    x = np.random.default_rng(7).standard_normal((2, 3)).astype(np.float32)
    model = _model(
        [oh.make_node("Relu", ["x"], ["y"]), oh.make_node("Size", ["y"], ["size"]),
         oh.make_node("Cast", ["size"], ["size_float"], to=FLOAT), oh.make_node("Mul", ["y", "size_float"], ["z"])],
        [("x", FLOAT, ["N", 3])], ["z"],
    )
    return model, {"x": x}, {"z": np.maximum(x.astype(np.float64), 0.0) * 6}


# 8. int64 arithmetic past 32 bits (the seeded Dropout mask generator's): computed in 32 bits.

def _int64_case():
    a = np.array([3, -5, 7], np.int64)
    big = np.asarray(1 << 40, np.int64)
    model = _model(
        [oh.make_node("Mul", ["a", "big"], ["wide"]), oh.make_node("Div", ["wide", "half_big"], ["twice"]),
         oh.make_node("Cast", ["twice"], ["y"], to=FLOAT)],
        [("a", onnx.TensorProto.INT64, [3])], [("y", [3])], [("big", big), ("half_big", big // 2)],
    )
    return model, {"a": a}, {"y": (2 * a).astype(np.float64)}


def _int32_mod_case():
    a = np.array([2**30 + 1, 2**30 + 3, 5], np.int32)  # float32 rounds the first two to 2**30
    model = _model(
        [oh.make_node("Mod", ["a", "two"], ["odd"]), oh.make_node("Cast", ["odd"], ["y"], to=FLOAT)],
        [("a", onnx.TensorProto.INT32, [3])], [("y", [3])], [("two", np.asarray(2, np.int32))],
    )
    return model, {"a": a}, {"y": (a % 2).astype(np.float64)}


# Each defect: its reproducer, what the defect is, the error text it is known by when OpenVINO
# refuses the model (None: it gives a wrong result).
DEFECTS = {
    "shared_square_conv_weight": (
        _shared_weight_case,
        "a constant square weight [C, C, k, k] read by both a Conv and a ConvTranspose gives a wrong ConvTranspose",
        None),
    "initializer_input_frozen": (
        _initializer_input_case,
        "an input that is also an initializer is frozen to its stored value; the fed value is ignored",
        None),
    "training_mode_batch_norm": (
        _batch_norm_case,
        "BatchNormalization with training_mode=1 is refused at session creation, with no fallback to the CPU provider",
        "Training mode of BatchNormalization is not supported"),
    "output_names_mismatch": (
        _onehot_case,
        "a OneHot with a run-time depth goes to the CPU provider and the constant OpenVINO folded for it "
        "(CastLike of a constant) is lost at the boundary",
        "Output names mismatch between OpenVINO and ONNX"),
    "unused_input_binding": (
        _unused_input_case,
        "with an unused graph input (c) before the used ones, inputs are bound by position: Sub(a, b) computes c - a",
        None),
    "group_normalization_21": (
        _group_norm_case,
        "GroupNormalization-21's output loses its rank and the model fails to compile",
        "dynamic rank"),
    "size_cycle": (
        _size_case,
        "Size is left to the CPU provider; between two OpenVINO parts the partition is cyclic and the session fails "
        "(in larger graphs the producing part falls back to the CPU provider instead)",
        "the graph is not acyclic"),
    "int64_in_32_bits": (
        _int64_case,
        "int64 Mul past 32 bits comes out truncated (the seeded Dropout mask generator keeps every integer below "
        "2**31)",
        None),
    "int32_mod_in_float32": (
        _int32_mod_case,
        "int32 Mod (and Div) is computed in float32, wrong past 2**24 (the seeded Dropout mask generator corrects "
        "the quotient exactly: rewrites._Emitter.divmod)",
        None),
}


@pytest.mark.parametrize("name", DEFECTS)
def test_defect(name):
    case, defect, refusal = DEFECTS[name]
    _observe(*case(), defect, refusal)


@pytest.mark.parametrize("name", ["shared_square_conv_weight", "output_names_mismatch", "unused_input_binding",
                                  "group_normalization_21", "size_cycle"])
def test_portable(name):
    """make_portable's graph is right on OpenVINO (the two other defects have tests of their own)."""
    _portable_is_correct(*DEFECTS[name][0]())
