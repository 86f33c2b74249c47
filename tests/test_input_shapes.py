"""The training graph reads computed values' shapes (and sizes) from its data inputs
(:mod:`normgrad.graphs.rewrites.input_shapes`): the shapes are the runtime ones at sizes other
than the export's, the losses and gradients bitwise those of the graph without the pass (a
torch-exported BERT with dynamic batch and sequence, onnxruntime-genai's tiny int4 Llama with
LoRA adapters, a static block), at onnxruntime's lowest and highest optimization levels, and no
Shape or Size node is left reading a computed value whose dims onnx's inference resolves."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

from normgrad.graphs import build_training_graph, examples, rewrites
from normgrad.graphs.context import value_types
from normgrad.graphs.rewrites.input_shapes import dim_sources, shapes_from_inputs
from normgrad.graphs.tidy import _weightless

LEVELS = (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)


def _run(model: onnx.ModelProto, feeds, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
    """{output: value} of every output of ``model``, run in onnxruntime at ``level``."""
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _shape_reads(model: onnx.ModelProto):
    """The Shape and Size nodes of the main graph that read a value a node computes, as input names."""
    computed = {name for node in model.graph.node for name in node.output}
    return [n.input[0] for n in model.graph.node if n.op_type in ("Shape", "Size") and n.input[0] in computed]


def _forward_values(model: onnx.ModelProto):
    """The values of a training graph with a loss that do not depend on its labels."""
    backward = {"labels"}
    for node in model.graph.node:
        if backward.intersection(node.input):
            backward.update(node.output)
    return {name for node in model.graph.node for name in node.output} - backward


def _resolvable_shape_reads(model: onnx.ModelProto, data_inputs):
    """The float forward values a Shape or Size node reads whose every dim onnx's own
    inference on ``model`` finds as an int or a dim one of ``data_inputs`` names (a shape
    the rules compute is int64, and small)."""
    inferred = onnx.shape_inference.infer_shapes(_weightless(model), data_prop=True).graph
    types = {i.name: i.type.tensor_type for i in list(inferred.value_info) + list(inferred.output)}
    named, forward = dim_sources(model.graph, data_inputs), _forward_values(model)
    left = []
    for name in set(_shape_reads(model)) & forward:
        tensor = types.get(name)
        if tensor is not None and tensor.elem_type == onnx.TensorProto.FLOAT and tensor.HasField("shape") and all(
                d.HasField("dim_value") or d.dim_param in named for d in tensor.shape.dim):
            left.append(name)
    return left


def _both_ways(monkeypatch, build):
    """``build()`` with the pass and without it (the builder's call made a no-op)."""
    passed = build()
    with monkeypatch.context() as patched:
        patched.setattr(rewrites, "shapes_from_inputs", lambda *args: 0)
        unpassed = build()
    return passed, unpassed


def _assert_bitwise(passed, unpassed, feeds_list):
    """Every output of the two training graphs bitwise equal, per feeds and level."""
    for feeds in feeds_list:
        for level in LEVELS:
            got = _run(passed.model, {**passed.weights, **feeds}, level)
            want = _run(unpassed.model, {**unpassed.weights, **feeds}, level)
            assert sorted(got) == sorted(want)
            for name, value in want.items():
                assert got[name].shape == value.shape, (name, level)
                assert np.array_equal(got[name], value, equal_nan=True), (name, level)


# -- the pass on a graph built by hand ------------------------------------------------------

def _hand_built():
    """a [n, t, 3] and b [n, 5]: Shapes of computed values with start/end, of a flattened
    value (an unknown dim) read as a Reshape's target and as an output, of a value whose batch
    dim b names too."""
    nodes = [
        oh.make_node("Relu", ["a"], ["h"]),
        oh.make_node("Shape", ["h"], ["whole"]),
        oh.make_node("Shape", ["h"], ["tail"], start=1),
        oh.make_node("Shape", ["h"], ["last"], start=-1),
        oh.make_node("Shape", ["h"], ["first"], end=1),
        oh.make_node("Shape", ["h"], ["middle"], start=1, end=-1),
        oh.make_node("Shape", ["h"], ["nothing"], start=2, end=1),
        oh.make_node("Flatten", ["h"], ["f"], axis=2),
        oh.make_node("Shape", ["f"], ["f_target"]),
        oh.make_node("Neg", ["f"], ["g"]),
        oh.make_node("Reshape", ["g", "f_target"], ["reshaped"]),
        oh.make_node("Shape", ["f"], ["f_shape"]),
        oh.make_node("Size", ["h"], ["h_size"]),
        oh.make_node("Size", ["f"], ["f_size"]),
        oh.make_node("Relu", ["b"], ["u"]),
        oh.make_node("Shape", ["u"], ["u_shape"]),
    ]
    shapes = ["whole", "tail", "last", "first", "middle", "nothing", "f_shape", "u_shape", "h_size", "f_size"]
    return _model(nodes, {"a": ("n", "t", 3), "b": ("n", 5)}, shapes, ["reshaped"])


def _model(nodes, inputs, int_outputs, float_outputs=()):
    """A model of ``nodes``: float inputs of the given shapes, int64 and float outputs."""
    info = oh.make_tensor_value_info
    graph = oh.make_graph(nodes, "shapes", [info(name, onnx.TensorProto.FLOAT, dims) for name, dims in inputs.items()],
                          [info(name, onnx.TensorProto.INT64, None) for name in int_outputs]
                          + [info(name, onnx.TensorProto.FLOAT, None) for name in float_outputs])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)


def test_shapes_are_the_runtime_ones_read_from_the_inputs():
    model = _hand_built()
    types = value_types(model)
    assert shapes_from_inputs(model, types.get, ["a", "b"]) == 9
    # one Shape of a, shared; f's shape and size stay where an output reads them (its rows are no input's dim)
    assert sorted((n.op_type, n.input[0]) for n in model.graph.node if n.op_type in ("Shape", "Size")) == [
        ("Shape", "a"), ("Shape", "f"), ("Size", "f")]
    for n, t in ((2, 3), (4, 1)):
        feeds = {"a": np.random.default_rng(n).standard_normal((n, t, 3)).astype(np.float32),
                 "b": np.zeros((n, 5), np.float32)}
        out = _run(model, feeds)
        expected = {"whole": [n, t, 3], "tail": [t, 3], "last": [3], "first": [n], "middle": [t], "nothing": [],
                    "f_shape": [n * t, 3], "u_shape": [n, 5], "h_size": n * t * 3, "f_size": n * t * 3}
        for name, value in expected.items():
            assert out[name].dtype == np.int64 and out[name].tolist() == value, name
        np.testing.assert_array_equal(out["reshaped"], -np.maximum(feeds["a"], 0).reshape(n * t, 3))


def test_a_dim_no_data_input_names_keeps_its_shape():
    """A dim onnx's inference invents (a Concat's summed length), or one only a non-data input names."""
    nodes = [oh.make_node("Concat", ["a", "c"], ["j"], axis=0), oh.make_node("Shape", ["j"], ["j_shape"]),
             oh.make_node("Relu", ["c"], ["r"]), oh.make_node("Shape", ["r"], ["r_shape"])]
    model = _model(nodes, {"a": ("n", 3), "c": ("m", 3)}, ["j_shape", "r_shape"])
    dims = value_types(model)["j"].tensor_type.shape.dim
    assert not dims[0].HasField("dim_value") and not dims[0].dim_param.startswith("n")
    assert shapes_from_inputs(model, value_types(model).get, ["a"]) == 0
    assert _shape_reads(model) == ["j", "r"]


def test_an_input_the_graph_does_not_read_is_no_source():
    """The graph's inputs stay read or unread as they were (the step graph orders its data
    inputs by that): the batch comes from a, not from the unread input listed first."""
    nodes = [oh.make_node("Relu", ["a"], ["r"]), oh.make_node("Shape", ["r"], ["r_shape"])]
    model = _model(nodes, {"unread": ("n",), "a": ("n", 3)}, ["r_shape"])
    assert shapes_from_inputs(model, value_types(model).get, ["unread", "a"]) == 1
    assert [list(n.input) for n in model.graph.node if n.op_type == "Shape"] == [["a"]]
    out = _run(model, {"unread": np.zeros(1, np.float32), "a": np.zeros((4, 3), np.float32)})
    assert out["r_shape"].tolist() == [4, 3]


# -- training graphs ------------------------------------------------------------------------

def test_a_static_model_gets_constant_shapes_and_the_same_numbers(monkeypatch):
    def build():
        block = examples.transformer_block(dropout=0.0)
        for info in (block.graph.input[0], block.graph.output[0]):
            info.type.tensor_type.shape.dim[0].dim_value = 2
        return build_training_graph(block, loss="mse")

    passed, unpassed = _both_ways(monkeypatch, build)
    assert _shape_reads(unpassed.model) and not _shape_reads(passed.model)
    assert len(passed.model.graph.node) <= len(unpassed.model.graph.node)
    rng = np.random.default_rng(0)
    _assert_bitwise(passed, unpassed, [{"x": rng.standard_normal((2, 4, 8)).astype(np.float32),
                                        "labels": rng.standard_normal((2, 4, 8)).astype(np.float32)}])


@pytest.mark.slow
def test_torch_bert_with_dynamic_batch_and_sequence(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from normgrad.torch import export
    from _torch_models import BertEncoder

    torch.manual_seed(0)
    path = tmp_path / "bert.onnx"
    export(BertEncoder(), (torch.zeros((2, 8), dtype=torch.int64),), path, input_names=["input_ids"],
           output_names=["hidden", "pooled"], dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}})
    passed, unpassed = _both_ways(monkeypatch, lambda: build_training_graph(onnx.load(path), loss="mse"))
    assert len(_shape_reads(passed.model)) < len(_shape_reads(unpassed.model))
    assert _resolvable_shape_reads(unpassed.model, ["input_ids"])
    assert not _resolvable_shape_reads(passed.model, ["input_ids"])
    rng = np.random.default_rng(1)
    _assert_bitwise(passed, unpassed, [
        {"input_ids": rng.integers(0, 100, (b, t)).astype(np.int64),
         "labels": rng.standard_normal((b, t, 32)).astype(np.float32)} for b, t in ((2, 8), (3, 5))])


@pytest.mark.slow
def test_genai_llama_with_lora_adapters(monkeypatch, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("transformers")
    from normgrad import lora
    from _genai_models import VOCABULARY, build_tiny_llama

    path = build_tiny_llama(tmp_path)
    passed, unpassed = _both_ways(monkeypatch, lambda: build_training_graph(
        lora.add_adapters(onnx.load(path), targets="*", rank=4, alpha=8), loss="causal_lm"))
    data = ["input_ids", "attention_mask"]
    assert _resolvable_shape_reads(unpassed.model, data) and not _resolvable_shape_reads(passed.model, data)
    assert not _shape_reads(passed.model)
    rng = np.random.default_rng(2)
    feeds = []
    for b, t in ((2, 12), (3, 7)):
        ids = rng.integers(0, VOCABULARY, (b, t)).astype(np.int64)
        mask = np.ones_like(ids)
        mask[-1, -2:] = 0
        # B starts at zero (peft's initialization): other values, so that every gradient is nonzero
        weights = {name: rng.standard_normal(value.shape).astype(np.float32) * 0.1
                   for name, value in passed.weights.items()}
        feeds.append({"input_ids": ids, "attention_mask": mask, "labels": np.where(mask == 1, ids, -100), **weights})
    _assert_bitwise(passed, unpassed, feeds)
