"""The rules of issue 8's spatial and data-movement ops alone (Slice, Split, Tile, Pad,
Resize/Upsample, ConvTranspose) and Conv/pool/Resize/Pad at dynamic image sizes: float64
central finite differences, and torch autograd of the equivalent torch op when torch is
installed."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

from normgrad.graphs import TrainingGraph, UnsupportedOperatorError, build_training_graph
from normgrad.tools.check import _output_shapes, check_gradients

from _graph_models import model, run_training, weights
from _rule_checks import TOLERANCE, _check, _node


def _ints(**values):
    return {name: np.asarray(value, np.int64) for name, value in values.items()}


@pytest.mark.parametrize("starts, ends, axes, steps", [
    ([1], [3], [1], None),
    ([0, -3], [2, 100], None, None),  # axes omitted, negative start, oversized end
    ([-1], [-100], [2], [-1]),  # full reverse
    ([4, 1], [0, 5], [-1, 0], [-2, 2]),  # negative step and negative axis
    ([-100], [100], [-2], [3]),
])
def test_slice(starts, ends, axes, steps):
    params = _ints(starts=starts, ends=ends)
    inputs = ["x", "starts", "ends"]
    if axes is not None or steps is not None:
        params["axes"] = np.asarray(axes if axes is not None else range(len(starts)), np.int64)
        inputs.append("axes")
    if steps is not None:
        params["steps"] = np.asarray(steps, np.int64)
        inputs.append("steps")
    _check(model([_node("Slice", inputs)], {"x": (3, 4, 5)}, ["y"], params))


def test_slice_opset_9_attributes():
    node = _node("Slice", ["x"], starts=[1, 0], ends=[3, -1], axes=[0, 2])
    _check(model([node], {"x": (4, 3, 5)}, ["y"], opset=9))


def test_slice_starts_computed_at_run_time():
    """Starts from the input's shape (Shape → Div): one training graph for every size."""
    params = _ints(two=[2], big=[1000], axes=[1])
    nodes = [
        oh.make_node("Shape", ["x"], ["shape"], start=1, end=2),
        oh.make_node("Div", ["shape", "two"], ["half"]),
        _node("Slice", ["x", "half", "big", "axes"]),
    ]
    forward = model(nodes, {"x": ("N", "L")}, ["y"], params)
    training = build_training_graph(forward)
    for length in (5, 8):
        _check_at(training, {"x": (2, length)})


@pytest.mark.parametrize("opset, attrs, split, used, shape", [
    (13, {"axis": 1}, [1, 3], [0, 1], (3, 4, 2)),
    (13, {"axis": -1}, [2, 2, 1], [0, 2], (3, 2, 5)),  # an output without gradient
    (11, {"axis": 0, "split": [1, 2]}, None, [1], (3, 2, 4)),
    (18, {"axis": 1, "num_outputs": 3}, None, [0, 1, 2], (3, 5, 2)),  # uneven: 2, 2, 1
    (13, {"axis": 2}, None, [0, 1], (3, 2, 4)),  # equal parts
])
def test_split(opset, attrs, split, used, shape):
    params = _ints(split=split) if split is not None else {}
    count = len(split) if split is not None else len(attrs.get("split", [])) or attrs.get("num_outputs", 2)
    outputs = [f"y{i}" for i in range(count)]
    inputs = ["x", "split"] if split is not None else ["x"]
    nodes = [oh.make_node("Split", inputs, outputs, **attrs)]
    _check(model(nodes, {"x": shape}, [outputs[i] for i in used], params, opset=opset))


@pytest.mark.parametrize("x_shape, repeats", [((2, 3), [2, 1]), ((2, 1, 3), [1, 3, 2]), ((4,), [3])])
def test_tile(x_shape, repeats):
    _check(model([_node("Tile", ["x", "repeats"])], {"x": x_shape}, ["y"], _ints(repeats=repeats)))


def _forward_in_onnxruntime(monkeypatch) -> None:
    """Finite differences through onnxruntime's float64 kernels: onnx's reference evaluator
    has no negative Pad pads and no Pad axes."""
    from normgrad.tools import check

    def runner(forward):
        session = ort.InferenceSession(forward.SerializeToString(), providers=["CPUExecutionProvider"])
        return lambda feeds: session.run(None, feeds)

    monkeypatch.setattr(check, "_runner", runner)


def _check_adjoint(forward: onnx.ModelProto, tolerance: float = 1e-5) -> None:
    """For an op linear in x (up to a constant): <dx, v> = <dy, y(v) - y(0)> for random v,
    the forward run in onnxruntime as exported (float32; it has no float64 Resize)."""
    training, initial = build_training_graph(forward)
    x = forward.graph.input[0]
    shape = [d.dim_value for d in x.type.tensor_type.shape.dim]
    rng = np.random.default_rng(0)
    run = ort.InferenceSession(forward.SerializeToString(), providers=["CPUExecutionProvider"]).run
    y0 = run(None, {x.name: np.zeros(shape, np.float32)})[0].astype(np.float64)
    dy = rng.standard_normal(y0.shape).astype(np.float32)
    session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    (dx,) = session.run([x.name + "_grad"], {**initial, x.name: np.zeros(shape, np.float32), "y_grad": dy})
    for _ in range(3):
        v = rng.standard_normal(shape).astype(np.float32)
        yv = run(None, {x.name: v})[0].astype(np.float64) - y0
        expected = float(np.sum(dy * yv))
        assert abs(float(np.sum(dx.astype(np.float64) * v)) - expected) < tolerance * np.linalg.norm(dy) * np.linalg.norm(v)


def _check_at(training: TrainingGraph, shapes, tolerance: float = TOLERANCE, seed: int = 0) -> None:
    """Finite differences of ``training`` with its data inputs at ``shapes`` (the seeds
    at their outputs' run-time shapes, trainable weights at their initial values)."""
    rng = np.random.default_rng(seed)
    feeds = training.feeds({name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()})
    seeds = json.loads(next(p.value for p in training.model.metadata_props if p.key == "normgrad.seeds"))
    for output, shape in _output_shapes(training.model, list(seeds), feeds).items():
        feeds[seeds[output]] = rng.standard_normal(shape).astype(np.float32)
    checks = check_gradients(training, feeds=feeds, directions=2)
    worst = max(checks, key=lambda c: c.error)
    assert worst.error < tolerance, (shapes, worst)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
@pytest.mark.parametrize("pads", [[0, 1, 2, 0, 2, 1], [0, -1, 1, 0, 1, -2], [1, 0, 0, 0, 0, 2]])
def test_pad(mode, pads, monkeypatch):
    if min(pads) < 0:
        _forward_in_onnxruntime(monkeypatch)
    params = _ints(pads=pads)
    params["value"] = np.asarray(0.5, np.float32)
    _check(model([_node("Pad", ["x", "pads", "value"], mode=mode)], {"x": (2, 3, 4)}, ["y"], params))


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad_axes_input(mode, monkeypatch):
    """Opset 18's ``axes`` (negative here); wrap is opset 19."""
    _forward_in_onnxruntime(monkeypatch)
    params = _ints(pads=[2, -1, 1, 1], axes=[-1, 1])
    node = _node("Pad", ["x", "pads", "", "axes"], mode=mode)
    _check(model([node], {"x": (2, 3, 4)}, ["y"], params, opset=19))


@pytest.mark.parametrize("mode", ["constant", "reflect"])
def test_pad_opset_2_attributes(mode):
    node = _node("Pad", ["x"], mode=mode, pads=[0, 0, 1, 2, 0, 0, 2, 1], value=0.25)
    _check(model([node], {"x": (2, 3, 4, 4)}, ["y"], opset=10))


def test_pad_pads_computed_at_run_time():
    """Pads that only the run time knows: dy is padded by their negation in the graph."""
    nodes = [oh.make_node("Shape", ["x"], ["shape"]), oh.make_node("Sub", ["shape", "shape"], ["zeros"]),
             oh.make_node("Concat", ["zeros", "ones"], ["pads"], axis=0), _node("Pad", ["x", "pads"])]
    _check(model(nodes, {"x": (2, 3)}, ["y"], _ints(ones=[1, 2])))


def _floats(**values):
    return {name: np.asarray(value, np.float32) for name, value in values.items()}


RESIZE_CASES = [
    # (attributes, scales or None, sizes or None, input shape)
    ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, [1, 1, 2, 3], None, (2, 2, 3, 4)),
    ({"mode": "nearest", "coordinate_transformation_mode": "half_pixel", "nearest_mode": "round_prefer_floor"}, [1, 1, 2, 2], None, (2, 2, 3, 4)),
    ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, [1, 1, 1.5, 0.5], None, (1, 2, 4, 6)),
    ({"mode": "nearest", "coordinate_transformation_mode": "align_corners", "nearest_mode": "round_prefer_ceil"}, None, [1, 2, 7, 5], (1, 2, 3, 4)),
    ({"mode": "nearest", "coordinate_transformation_mode": "tf_half_pixel_for_nn", "nearest_mode": "ceil"}, [1, 1, 1, 2], None, (1, 2, 3, 4)),
    ({"mode": "linear", "coordinate_transformation_mode": "half_pixel"}, [1, 1, 2, 2], None, (2, 2, 3, 4)),
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, [1, 1, 2, 2], None, (2, 2, 3, 4)),
    ({"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, None, [2, 2, 5, 1], (2, 2, 3, 4)),
    ({"mode": "linear", "coordinate_transformation_mode": "asymmetric"}, [1, 1, 0.5, 0.75], None, (1, 2, 6, 8)),
    ({"mode": "cubic", "coordinate_transformation_mode": "half_pixel", "cubic_coeff_a": -0.5}, [1, 1, 2, 1.5], None, (1, 2, 4, 4)),
    ({"mode": "cubic", "coordinate_transformation_mode": "align_corners", "exclude_outside": 1}, None, [1, 2, 6, 7], (1, 2, 4, 4)),
    ({"mode": "linear", "coordinate_transformation_mode": "half_pixel"}, [1, 1, 2.5], None, (2, 3, 4)),  # 1-D
    ({"mode": "linear", "coordinate_transformation_mode": "half_pixel"}, [1, 2], None, (4, 3)),  # an outer axis
]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("attrs, scales, sizes, shape", RESIZE_CASES)
def test_resize(attrs, scales, sizes, shape, opset):
    if opset < 18 and attrs["mode"] != "linear" and sizes is None and min(scales) < 1:
        pytest.skip("one opset is enough for downsampling nearest")
    params = _floats(scales=scales) if scales is not None else _ints(sizes=sizes)
    inputs = ["x", "", "scales"] if scales is not None else ["x", "", "", "sizes"]
    forward = model([_node("Resize", inputs, **attrs)], {"x": shape}, ["y"], params, opset=opset)
    if attrs["coordinate_transformation_mode"] == "tf_half_pixel_for_nn":
        _check_adjoint(forward)  # onnx's reference evaluator lacks the mode
    else:
        _check(forward)


def test_resize_follows_onnxruntime():
    """align_corners where in x scale is not whole: onnxruntime and onnx's reference
    evaluator place the samples differently; the gradient is the adjoint of onnxruntime's."""
    node = _node("Resize", ["x", "", "scales"], mode="linear", coordinate_transformation_mode="align_corners")
    _check_adjoint(model([node], {"x": (1, 2, 5, 9)}, ["y"], _floats(scales=[1, 1, 1, 1.5])))


def test_resize_opset_11_roi_and_empty_scales():
    params = {"roi": np.zeros(0, np.float32), "scales": np.zeros(0, np.float32), **_ints(sizes=[2, 2, 5, 7])}
    node = _node("Resize", ["x", "roi", "scales", "sizes"], mode="linear", coordinate_transformation_mode="align_corners")
    _check(model([node], {"x": (2, 2, 3, 4)}, ["y"], params, opset=11))


@pytest.mark.parametrize("attrs, values", [
    ({"axes": [-1, 2], "mode": "linear"}, {"scales": [2.0, 0.5]}),
    ({"axes": [3], "mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, {"scales": [3.0]}),
    ({"axes": [2], "mode": "linear", "antialias": 1}, {"scales": [0.5]}),
    ({"axes": [2, 3], "mode": "cubic", "antialias": 1}, {"sizes": [3, 5]}),
    ({"mode": "linear", "coordinate_transformation_mode": "half_pixel_symmetric"}, {"scales": [1, 1, 1.5, 0.5]}),
])
def test_resize_opset_19_axes_antialias(attrs, values):
    name, value = next(iter(values.items()))
    params = _floats(**values) if name == "scales" else _ints(**values)
    inputs = ["x", "", "scales"] if name == "scales" else ["x", "", "", "sizes"]
    forward = model([_node("Resize", inputs, **attrs)], {"x": (1, 2, 6, 8)}, ["y"], params, opset=19)
    if min(attrs.get("axes", [0])) < 0:  # onnx's reference evaluator fails on negative axes
        try:
            ort.InferenceSession(forward.SerializeToString(), providers=["CPUExecutionProvider"])
        except ort.capi.onnxruntime_pybind11_state.RuntimeException as error:  # onnxruntime 1.19.2
            pytest.skip(f"this onnxruntime rejects negative Resize axes: {error}")
        _check_adjoint(forward)
    else:
        _check(forward)


@pytest.mark.parametrize("opset, op_type, mode, scales", [
    (9, "Upsample", "nearest", [1, 1, 2, 1.5]),
    (9, "Upsample", "linear", [1, 1, 2, 2]),
    (10, "Resize", "nearest", [1, 1, 0.5, 0.7]),
    (10, "Resize", "linear", [1, 1, 1.5, 2]),
])
def test_upsample_and_resize_10(opset, op_type, mode, scales):
    """Converted with onnxruntime's semantics for the old ops (asymmetric; nearest floor when
    upsampling, ceil when downsampling): the gradient is the adjoint of what onnxruntime
    runs for the model as exported."""
    node = _node(op_type, ["x", "scales"], mode=mode)
    _check_adjoint(model([node], {"x": (1, 2, 4, 5)}, ["y"], _floats(scales=scales), opset=opset))


def test_upsample_opset_7_scales_attribute():
    node = _node("Upsample", ["x"], mode="nearest", scales=[1.0, 1.0, 2.0, 3.0])
    _check_adjoint(model([node], {"x": (1, 2, 3, 2)}, ["y"], opset=7))


def test_resize_10_mixed_nearest_rounding_is_refused():
    node = oh.make_node("Resize", ["x", "scales"], ["y"], name="mixed", mode="nearest")
    forward = model([node], {"x": (1, 2, 4, 4)}, ["y"], _floats(scales=[1, 1, 2, 0.5]), opset=10)
    with pytest.raises(UnsupportedOperatorError, match="Resize node 'mixed'.*re-export with opset 11"):
        build_training_graph(forward)


CONV_TRANSPOSE_CASES = [
    # (attributes, W shape [C_in, C_out/group, k...], x shape)
    ({}, (3, 2, 3, 3), (2, 3, 4, 4)),
    ({"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}, (3, 2, 3, 3), (2, 3, 3, 4)),
    ({"strides": [2, 1], "pads": [1, 0, 0, 2], "output_padding": [1, 0]}, (2, 3, 4, 3), (1, 2, 3, 3)),
    ({"dilations": [2, 1], "strides": [1, 2]}, (2, 2, 2, 3), (1, 2, 3, 3)),
    ({"group": 3, "strides": [2, 2], "pads": [1, 1, 1, 1]}, (3, 1, 4, 4), (1, 3, 3, 3)),  # depthwise
    ({"auto_pad": "SAME_UPPER", "strides": [2, 2]}, (2, 2, 3, 3), (1, 2, 3, 3)),  # odd: the extra pad at the tail
    ({"auto_pad": "SAME_LOWER", "strides": [2, 2]}, (2, 2, 3, 3), (1, 2, 3, 3)),  # odd: the extra pad at the head
    ({"auto_pad": "VALID", "strides": [3, 2]}, (2, 2, 2, 2), (1, 2, 3, 3)),
    ({"output_shape": [8, 9], "strides": [2, 2]}, (2, 2, 3, 3), (1, 2, 3, 4)),
    ({"output_shape": [7, 11], "strides": [2, 3]}, (2, 2, 3, 3), (1, 2, 3, 3)),  # larger than natural
    ({"strides": [2]}, (2, 3, 3), (2, 2, 5)),  # 1-D
    ({"pads": [1, 0, 0, 0, 1, 1], "strides": [1, 2, 1]}, (2, 1, 2, 2, 2), (1, 2, 3, 3, 2)),  # 3-D
]


@pytest.mark.parametrize("attrs, w_shape, x_shape", CONV_TRANSPOSE_CASES)
def test_conv_transpose(attrs, w_shape, x_shape):
    """No bias with groups: onnx's reference evaluator adds the first group's bias to every
    group (and fails outright for 1 < group < channels: see the adjoint test below and the
    torch cross-check)."""
    inputs = ["x", "w", "b"] if attrs.get("group", 1) == 1 else ["x", "w"]
    params = weights(2, w=w_shape, b=(w_shape[1],))
    params = {name: params[name] for name in inputs[1:]}
    _check(model([_node("ConvTranspose", inputs, **attrs)], {"x": x_shape}, ["y"], params))


def test_conv_transpose_groups_adjoint():
    params = weights(3, w=(4, 3, 2, 3))
    node = _node("ConvTranspose", ["x", "w"], group=2, strides=[1, 2], pads=[0, 1, 1, 0])
    _check_adjoint(model([node], {"x": (2, 4, 3, 3)}, ["y"], params))


DYNAMIC_CASES = {
    "conv": [("Conv", ["x", "w", "b"], {"strides": [2, 2], "pads": [1, 1, 1, 1]})],
    "conv_groups_dilations": [("Conv", ["x", "wg"], {"group": 2, "dilations": [2, 1], "pads": [2, 0, 1, 1]})],
    "conv_transpose": [("ConvTranspose", ["x", "wt", "b"], {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]})],
    "average_pool": [("AveragePool", ["x"], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]})],
    "average_pool_include_pad": [("AveragePool", ["x"], {"kernel_shape": [2, 3], "pads": [1, 1, 0, 1], "count_include_pad": 1})],
    "max_pool": [("MaxPool", ["x"], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]})],
    "global_average_pool": [("GlobalAveragePool", ["x"], {})],
    "resize_nearest": [("Resize", ["x", "", "scales2"], {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
                                                          "nearest_mode": "floor"})],
    "resize_linear": [("Resize", ["x", "", "scales2"], {"mode": "linear", "coordinate_transformation_mode": "align_corners"})],
    "pad_reflect": [("Pad", ["x", "pads"], {"mode": "reflect"})],
    "pad_constant": [("Pad", ["x", "pads"], {})],
}


@pytest.mark.parametrize("case", sorted(DYNAMIC_CASES))
def test_dynamic_image_size(case):
    """One training graph, exported once with symbolic N, H, W, matches finite differences
    at two image sizes (odd and even, so pads and output paddings differ)."""
    params = weights(4, w=(3, 4, 3, 3), wg=(2, 2, 3, 2), wt=(4, 3, 3, 3), b=(3,))
    params.update(_floats(scales2=[1, 1, 2, 1.5]))
    params.update(_ints(pads=[0, 0, 1, 2, 0, 0, 2, 1]))
    nodes = [_node(op_type, inputs, **attrs) for op_type, inputs, attrs in DYNAMIC_CASES[case]]
    used = {name for node in nodes for name in node.input}
    forward = model(nodes, {"x": ("N", 4, "H", "W")}, ["y"], {k: v for k, v in params.items() if k in used})
    training = build_training_graph(forward)
    for shape in [(2, 4, 7, 6), (1, 4, 8, 10)]:  # W x 1.5 whole: see test_resize_follows_onnxruntime
        _check_at(training, {"x": shape})


def test_resize_torch_sizes_at_dynamic_sizes():
    """TorchScript's F.interpolate(size=...) writes sizes = Concat(Shape(x)[0:2], size): the
    batch and channel axes are recognised as unchanged (no interpolation matrix for them)."""
    nodes = [
        oh.make_node("Shape", ["x"], ["shape"]),
        oh.make_node("Slice", ["shape", "zero", "two", "zero"], ["batch_channels"]),
        oh.make_node("Concat", ["batch_channels", "size"], ["sizes"], axis=0),
        _node("Resize", ["x", "", "", "sizes"], mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
    ]
    forward = model(nodes, {"x": ("N", 2, "H", "W")}, ["y"], _ints(zero=[0], two=[2], size=[5, 7]))
    training = build_training_graph(forward)
    assert sum(node.op_type == "EyeLike" for node in training.model.graph.node) == 2
    for shape in [(2, 2, 3, 4), (1, 2, 6, 9)]:
        _check_at(training, {"x": shape})


@pytest.mark.parametrize("split, keepdims, positions", [
    ([1, 3, 1], 1, [0, 2, -2]),  # sizes
    (2, 1, [1, 2]),  # a scalar: pieces of 2, the last shorter
    (None, 0, [4, 0, 0]),  # one per element, squeezed; a piece read twice
])
def test_split_to_sequence_read_by_sequence_at(split, keepdims, positions):
    """torch's dynamo exporter writes torch.split/chunk as SplitToSequence + SequenceAt:
    rewritten to a Split before differentiation."""
    params = {f"p{k}": np.asarray(p, np.int64) for k, p in enumerate(positions)}
    inputs = ["x"]
    if split is not None:
        params["split"] = np.asarray(split, np.int64)
        inputs.append("split")
    nodes = [oh.make_node("SplitToSequence", inputs, ["seq"], axis=1, keepdims=keepdims)]
    nodes += [oh.make_node("SequenceAt", ["seq", f"p{k}"], [f"a{k}"]) for k in range(len(positions))]
    nodes.append(oh.make_node("Concat", [f"a{k}" for k in range(len(positions))], ["y"], axis=1))
    forward = model(nodes, {"x": (2, 5, 3)}, ["y"], params)
    training, _ = build_training_graph(forward)
    assert not {"SplitToSequence", "SequenceAt"} & {node.op_type for node in training.graph.node}
    _check(forward)


@pytest.mark.parametrize("indices", [
    [[0, 1], [1, 2], [0, 1], [-1, 0]],  # pairs, a repeat, a negative index
    [[1], [0], [1]],  # k = 1
    [[[0, 1, 2], [1, 0, 3]], [[1, 2, 0], [1, 2, 0]]],  # full tuples, extra index axes
])
def test_gather_nd(indices):
    """torch's dynamo exporter writes nearest-exact interpolation with GatherND."""
    params = _ints(indices=indices)
    _check(model([_node("GatherND", ["x", "indices"])], {"x": (2, 3, 4)}, ["y"], params))


GATHER_ND_BATCHED = [  # (batch_dims, data shape, indices)
    (1, (2, 3, 4), [[1], [0]]),  # one row per batch
    (1, (2, 3, 4, 2), [[[0, 1], [2, 3], [0, 1]], [[-1, 0], [1, 2], [1, 2]]]),  # repeats, a negative index
    (2, (2, 3, 4, 2), [[[3], [0], [1]], [[1], [-1], [2]]]),  # two batch axes
    (1, (3, 2, 2), [[[0, 1]], [[1, 1]], [[1, 0]]]),  # full tuples: scalars gathered
]


@pytest.mark.parametrize("batch_dims, shape, indices", GATHER_ND_BATCHED)
def test_gather_nd_batch_dims(batch_dims, shape, indices):
    _check(model([_node("GatherND", ["x", "indices"], batch_dims=batch_dims)], {"x": shape}, ["y"],
                 _ints(indices=indices)))


@pytest.mark.parametrize("batch_dims, shape, indices", GATHER_ND_BATCHED)
def test_gather_nd_batch_dims_matches_torch_indexing(batch_dims, shape, indices):
    """Against torch autograd of the same gather as advanced indexing: x[b..., i0, i1, ...]."""
    torch = pytest.importorskip("torch")
    index = np.asarray(indices, np.int64)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    forward = model([_node("GatherND", ["x", "indices"], batch_dims=batch_dims)], {"x": shape}, ["y"], _ints(indices=index))
    dy = np.random.default_rng(2).standard_normal(index.shape[:-1] + shape[batch_dims + index.shape[-1]:]).astype(np.float32)
    results = run_training(build_training_graph(forward), {"x": x, "y_grad": dy})
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    lead = index.shape[:-1]
    batch = [torch.arange(lead[d]).reshape([-1] + [1] * (len(lead) - d - 1)) for d in range(batch_dims)]
    yt = xt[tuple(batch + [torch.tensor(index[..., j]) for j in range(index.shape[-1])])]
    yt.backward(torch.tensor(dy, dtype=torch.float64))
    np.testing.assert_allclose(results["y"], yt.detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(results["x_grad"], xt.grad.numpy(), rtol=1e-6, atol=1e-6)


AVERAGE_POOL_CEIL = [  # (x shape, kernel, strides, symmetric pad): ceil_mode adds a window to each
    ((1, 2, 5, 7), [2, 2], [2, 2], 0),
    ((2, 2, 6, 6), [3, 3], [2, 2], 1),  # the last window reaches past the end pad
    ((1, 1, 8, 9), [3, 3], [2, 3], 1),  # strides that differ
]


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("shape, kernel, strides, pad", AVERAGE_POOL_CEIL)
def test_average_pool_ceil_mode(shape, kernel, strides, pad, count_include_pad):
    attrs = dict(kernel_shape=kernel, strides=strides, pads=[pad] * 4, ceil_mode=1, count_include_pad=count_include_pad)
    _check(model([_node("AveragePool", ["x"], **attrs)], {"x": shape}, ["y"]))


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("shape, kernel, strides, pad", AVERAGE_POOL_CEIL)
def test_average_pool_ceil_mode_matches_torch(shape, kernel, strides, pad, count_include_pad):
    """torch's avg_pool2d(ceil_mode=True): the output size, the divisors of the windows past
    the end (count_include_pad counts the explicit pads only) and their gradients."""
    torch = pytest.importorskip("torch")
    attrs = dict(kernel_shape=kernel, strides=strides, pads=[pad] * 4, ceil_mode=1, count_include_pad=count_include_pad)
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    yt = torch.nn.functional.avg_pool2d(xt, kernel, strides, pad, ceil_mode=True, count_include_pad=bool(count_include_pad))
    dy = np.random.default_rng(4).standard_normal(tuple(yt.shape)).astype(np.float32)
    yt.backward(torch.tensor(dy, dtype=torch.float64))
    results = run_training(build_training_graph(model([_node("AveragePool", ["x"], **attrs)], {"x": shape}, ["y"])),
                           {"x": x, "y_grad": dy})
    np.testing.assert_allclose(results["y"], yt.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results["x_grad"], xt.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_average_pool_ceil_mode_asymmetric_pads_1d():
    _check(model([_node("AveragePool", ["x"], kernel_shape=[3], strides=[2], pads=[0, 1], ceil_mode=1,
                        count_include_pad=1)], {"x": (1, 2, 9)}, ["y"]))


def test_gradients_do_not_depend_on_the_thread_count():
    """Resize (interpolation matrices and repeats), reflect Pad (scatter-adds), Slice with a
    negative step, ConvTranspose, GatherND with repeated rows: bitwise equal gradients with
    1 and 3 intra-op threads."""
    params = weights(5, wt=(8, 4, 3, 3))
    params.update(_floats(linear=[1, 1, 1.5, 2], nearest=[1, 1, 2, 2]))
    params.update(_ints(pads=[0, 0, 2, 1, 0, 0, 1, 2], starts=[-1], ends=[-1000], axes=[2], steps=[-2],
                        rows=[[0, 1], [1, 2], [0, 1], [1, 3]]))
    nodes = [
        oh.make_node("Resize", ["x", "", "linear"], ["r"], mode="linear"),
        oh.make_node("Pad", ["r", "pads"], ["p"], mode="reflect"),
        oh.make_node("Slice", ["p", "starts", "ends", "axes", "steps"], ["s"]),
        oh.make_node("ConvTranspose", ["s", "wt"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1]),
        oh.make_node("Resize", ["c", "", "nearest"], ["n"], mode="nearest", coordinate_transformation_mode="asymmetric",
                     nearest_mode="floor"),
        oh.make_node("GatherND", ["n", "rows"], ["y"]),
    ]
    training, initial = build_training_graph(model(nodes, {"x": (2, 8, 24, 20)}, ["y"], params))
    rng = np.random.default_rng(0)
    feeds = {**initial, "x": rng.standard_normal((2, 8, 24, 20)).astype(np.float32)}
    feeds["y_grad"] = rng.standard_normal(_output_shapes(training, ["y"], feeds)["y"]).astype(np.float32)
    results = []
    for threads in (1, 3):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(training.SerializeToString(), options, providers=["CPUExecutionProvider"])
        results.append(session.run(["x_grad", "wt_grad"], feeds))
    for one, three in zip(*results):
        np.testing.assert_array_equal(one, three)


@pytest.mark.parametrize("op_type, inputs, attrs, params", [
    ("Slice", ["x", "starts", "ends", "axes"], {}, _ints(starts=[1, -2], ends=[100, -1], axes=[2, -1])),
    ("Pad", ["x", "pads"], {"mode": "reflect"}, _ints(pads=[0, 0, 1, 2, 0, 0, 2, 1])),
    ("Pad", ["x", "pads"], {"mode": "edge"}, _ints(pads=[0, 0, 1, 2, 0, 0, 2, 1])),
])
def test_common_slices_and_pads_avoid_scatter(op_type, inputs, attrs, params):
    """onnxruntime's ScatterElements is some hundred times slower than Pad/Slice: unit-step
    Slices and constant reflect/edge Pads are differentiated without it (and still right)."""
    forward = model([_node(op_type, inputs, **attrs)], {"x": (2, 3, 5, 4)}, ["y"], params)
    assert "ScatterElements" not in {node.op_type for node in build_training_graph(forward).model.graph.node}
    _check(forward)


def test_slice_with_value_ints_constants_pads_by_static_amounts():
    """The dynamo exporter's rotary-embedding halves: Slice starts/ends/axes as Reshape(Constant
    value_ints) and steps a value_ints Constant. They fold to constants, so the gradient is
    one Pad by amounts known at build time (no ScatterElements, no run-time pad arithmetic)."""
    nodes = []
    for name, values in {"start": [2], "end": [1 << 62], "axis": [-1], "step": [1], "flat": [-1]}.items():
        nodes.append(oh.make_node("Constant", [], [name + "_ints"], value_ints=values))
    for name in ("start", "end", "axis"):
        nodes.append(oh.make_node("Reshape", [name + "_ints", "flat_ints"], [name]))
    nodes.append(_node("Slice", ["x", "start", "end", "axis", "step_ints"]))
    forward = model(nodes, {"x": (2, 3, 5, 4)}, ["y"], {})
    op_types = [node.op_type for node in build_training_graph(forward).model.graph.node]
    assert "ScatterElements" not in op_types and op_types.count("Pad") == 1 and "Max" not in op_types
    _check(forward)


def _halves(bounds, shape=(2, 3, 5, 8), plus_x=True):
    """rotate_half: y = Concat(-x[..., a:b], x[..., c:d]) (* 2 + x), its Slices' bounds given."""
    (a, b), (c, d) = bounds
    params = _ints(a=[a], b=[b], c=[c], d=[d], axis=[-1])
    nodes = [oh.make_node("Slice", ["x", "a", "b", "axis"], ["second"]), oh.make_node("Slice", ["x", "c", "d", "axis"], ["first"]),
             oh.make_node("Neg", ["second"], ["negated"])]
    if plus_x:
        nodes += [oh.make_node("Concat", ["negated", "first"], ["rotated"], axis=-1),
                  oh.make_node("Add", ["rotated", "rotated"], ["twice"]), _node("Add", ["twice", "x"])]
    else:
        nodes.append(_node("Concat", ["negated", "first"], axis=-1))
    return model(nodes, {"x": shape}, ["y"], params)


@pytest.mark.parametrize("bounds", [((4, 1 << 62), (0, 4)), ((-4, 8), (-100, -4)), ((5, 8), (0, 5))])
def test_slices_covering_an_axis_become_one_split(bounds):
    """Slices of one value that cover an axis exactly once (rotate_half's halves) are one
    Split: the gradient a Concat instead of a zero Pad per Slice and their Sum; the forward
    the same bits."""
    forward = _halves(bounds)
    training = build_training_graph(forward)
    nodes = training.model.graph.node
    assert [n.input[0] for n in nodes if n.op_type == "Split"].count("x") == 1  # (and the Concat's gradient)
    assert not [n for n in nodes if n.op_type in ("Slice", "Pad")]
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 8)).astype(np.float32)
    exported = ort.InferenceSession(forward.SerializeToString(), providers=["CPUExecutionProvider"])
    trained = ort.InferenceSession(training.model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": x, "y_grad": np.ones_like(x)}
    np.testing.assert_array_equal(trained.run(["y"], training.feeds(feeds))[0], exported.run(None, {"x": x})[0])
    _check(forward)


@pytest.mark.parametrize("bounds, shape", [
    (((4, 8), (0, 3)), (2, 3, 5, 8)),  # a gap
    (((3, 8), (0, 4)), (2, 3, 5, 8)),  # an overlap
    (((4, 1 << 62), (0, 4)), (2, 3, 5, "L")),  # a length known at run time only
])
def test_slices_not_covering_an_axis_stay_slices(bounds, shape):
    forward = _halves(bounds, shape, plus_x=False)
    nodes = build_training_graph(forward).model.graph.node
    assert [n.input[0] for n in nodes if n.op_type == "Slice"].count("x") == 2
    assert not [n for n in nodes if n.op_type == "Split" and n.input[0] == "x"]
    if "L" not in shape:
        _check(forward)


@pytest.mark.parametrize("node, shape, params, message", [
    (oh.make_node("Resize", ["x", "", "s"], ["y"], name="crop", mode="linear", coordinate_transformation_mode="tf_crop_and_resize"),
     (1, 1, 4, 4), _floats(s=[1, 1, 2, 2]), "Resize node 'crop'.*tf_crop_and_resize"),
    (oh.make_node("Resize", ["x", "", "", "n"], ["y"], name="keep", keep_aspect_ratio_policy="not_larger"),
     (1, 1, 4, 4), _ints(n=[1, 1, 6, 7]), "Resize node 'keep'.*keep_aspect_ratio_policy not_larger"),
    (oh.make_node("Conv", ["x", "w"], ["y"], name="same", auto_pad="SAME_UPPER", strides=[2, 2]),
     ("N", 2, "H", "W"), weights(0, w=(2, 2, 3, 3)), "Conv node 'same'.*auto_pad=SAME_UPPER needs static spatial dims"),
    (oh.make_node("AveragePool", ["x"], ["y"], name="ceil", kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
     (1, 2, "H", "W"), {}, "AveragePool node 'ceil'.*ceil_mode=1 needs static spatial dims"),
    (oh.make_node("AveragePool", ["x"], ["y"], name="dropped", kernel_shape=[3, 3], strides=[3, 3], pads=[1] * 4, ceil_mode=1),
     (1, 2, 5, 5), {}, "AveragePool node 'dropped'.*drop it \\(output \\[2, 2\\]\\) but onnx's shape inference keeps it \\(\\[3, 3\\]\\)"),
    (oh.make_node("ConvTranspose", ["x", "w"], ["y"], name="shaped", output_shape=[9, 9], strides=[2, 2]),
     (1, 2, "H", "W"), weights(0, w=(2, 2, 3, 3)), "ConvTranspose node 'shaped'.*output_shape needs static spatial dims"),
])
def test_refused_variants_name_the_node(node, shape, params, message):
    with pytest.raises(UnsupportedOperatorError, match=message):
        build_training_graph(model([node], {"x": shape}, ["y"], params, opset=19))


CONV_FORM_CASES = [
    # (attributes, W shape, x shape): each gradient form of graphs/rules/conv.py and its edges
    ({"pads": [0, 2, 1, 1], "dilations": [1, 2]}, (3, 2, 3, 2), (2, 2, 5, 6)),  # stride 1: flipped-Conv dx, per-tap dW
    ({"pads": [3, 0, 0, 0]}, (2, 2, 3, 2), (1, 2, 5, 4)),  # a pad past the kernel's reach: ConvTranspose dx
    ({"strides": [2, 3], "dilations": [2, 1], "pads": [1, 0, 0, 1]}, (2, 2, 2, 2), (1, 2, 7, 8)),  # strided taps
    ({"strides": [2, 2]}, (3, 2, 1, 1), (2, 2, 5, 5)),  # 1x1 downsample: one tap
    ({"pads": [1, 1, 1, 1]}, (2, 2, 4, 4), (1, 2, 5, 5)),  # 16 taps: the big-kernel Conv dW
    ({"pads": [1, 0, 1, 1, 0, 1]}, (2, 2, 2, 2, 2), (1, 2, 3, 3, 3)),  # 3-D, 8 taps
    ({"pads": [1, 2], "dilations": [2]}, (3, 2, 3), (2, 2, 1100)),  # >= 1024 output pixels: batched MatMul per tap
    ({"strides": [2, 1], "pads": [1, 1, 0, 1]}, (2, 2, 3, 2), (1, 2, 64, 32)),  # the same, 2-D and strided
    ({"pads": [1, 1, 1, 1]}, (8, 2, 3, 3), (1, 2, 4, 4)),  # more output channels than pixels / 4: im2col dW
    ({"strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 1, 2]}, (7, 3, 3, 2), (2, 3, 5, 4)),  # the same, strided
    ({"pads": [1, 1]}, (5, 2, 3), (2, 2, 4)),  # the same, 1-D
]


@pytest.mark.parametrize("attrs, w_shape, x_shape", CONV_FORM_CASES)
@pytest.mark.parametrize("dynamic", [False, True])
def test_conv_gradient_forms(attrs, w_shape, x_shape, dynamic):
    """Finite differences of every Conv gradient form, at static sizes and at symbolic ones
    (one graph checked at two sizes)."""
    params = weights(5, w=w_shape)
    spatial = len(x_shape) - 2
    inputs = {"x": (x_shape if not dynamic else ("N", x_shape[1]) + tuple(f"S{i}" for i in range(spatial)))}
    training = build_training_graph(model([_node("Conv", ["x", "w"], **attrs)], inputs, ["y"], params))
    sizes = [x_shape] + ([x_shape[:2] + tuple(d + 1 for d in x_shape[2:])] if dynamic else [])
    for shape in sizes:
        _check_at(training, {"x": shape})
