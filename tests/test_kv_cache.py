"""Models with a KV cache train without it (graphs/rewrites/kv_cache.py): the past inputs of
GroupQueryAttention are dropped (a zero-length past), the present outputs too, and a
position_ids input is derived from attention_mask."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from normgrad.graphs import build_training_graph
from normgrad.graphs.rewrites import drop_kv_cache
from normgrad.ops import IR_VERSION

from _group_query_attention import gqa_model

ort = pytest.importorskip("onnxruntime")

FLOAT, INT64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64


def _run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _with_cache(model):
    """``model`` with its past as graph inputs past_key_values.0.* and its present as outputs present.0.*."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph, node = model.graph, model.graph.node[0]
    for index, kind in ((3, "key"), (4, "value")):
        while len(node.input) <= index:
            node.input.append("")
        node.input[index] = f"past_key_values.0.{kind}"
        node.output[index - 2] = f"present.0.{kind}"
        graph.input.append(oh.make_tensor_value_info(node.input[index], FLOAT, ["batch", 2, "past", 32]))
        graph.output.append(oh.make_tensor_value_info(node.output[index - 2], FLOAT, ["batch", 2, "total", 32]))
    return model


def test_past_inputs_and_present_outputs_are_dropped():
    plain, feeds = gqa_model(2, 6, 4, 2, 32, rotary_dim=32, packed=True)
    cached = _with_cache(plain)
    empty = np.zeros((2, 2, 0, 32), np.float32)
    assert _run(cached, {**feeds, "past_key_values.0.key": empty, "past_key_values.0.value": empty})["y"] \
        == pytest.approx(_run(plain, feeds)["y"])
    training = build_training_graph(cached)
    assert [i.name for i in training.model.graph.input] == ["query", "y_grad"]
    assert [o.name for o in training.model.graph.output] == ["y", "query_grad"]
    dy = np.random.default_rng(0).standard_normal((2, 6, 128)).astype(np.float32)
    expected = _run(build_training_graph(plain).model, {**feeds, "y_grad": dy})
    np.testing.assert_array_equal(_run(training.model, {**feeds, "y_grad": dy})["query_grad"], expected["query_grad"])


def test_position_ids_come_from_the_attention_mask():
    """Out = position_ids as float, for a model with a KV cache: derived in the graph as
    onnxruntime-genai computes them for a prompt (count of attended positions - 1, 1 where masked)."""
    model = _with_cache(gqa_model(2, 4, 4, 2, 32)[0])
    graph = model.graph
    graph.input.extend([oh.make_tensor_value_info("attention_mask", INT64, ["batch", "seq"]),
                        oh.make_tensor_value_info("position_ids", INT64, ["batch", "seq"])])
    graph.node.append(oh.make_node("Cast", ["position_ids"], ["positions"], to=FLOAT))
    graph.output.append(oh.make_tensor_value_info("positions", FLOAT, ["batch", "seq"]))
    assert drop_kv_cache(model) == 4
    assert {i.name for i in graph.input} == {"query", "key", "value", "attention_mask"}
    mask = np.asarray([[1, 1, 1, 0], [1, 1, 1, 1]], np.int64)
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal((2, 4, 128 if n == "query" else 64)).astype(np.float32)
             for n in ("query", "key", "value")}
    positions = _run(model, {**feeds, "attention_mask": mask})["positions"]
    np.testing.assert_array_equal(positions, [[0, 1, 2, 1], [0, 1, 2, 3]])


def test_a_model_without_cache_is_unchanged():
    model, _ = gqa_model(2, 4, 4, 2, 32)
    before = model.SerializeToString()
    assert drop_kv_cache(model) == 0
    assert model.SerializeToString() == before
