"""com.microsoft GroupQueryAttention without a KV cache: onnxruntime's forward and the rule's
gradients against torch float64 autograd of the unfused attention (rotary, shared K/V heads,
causal mask, local window, softcap), a float64 finite difference, and the refusals by name."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from normgrad.graphs import build_training_graph
from normgrad.graphs.context import UnsupportedOperatorError

from _group_query_attention import gqa_model, gqa_reference, unfused_model

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

CASES = {
    "separate": dict(),
    "packed": dict(packed=True),
    "rotary": dict(rotary_dim=32),
    "rotary_interleaved_packed": dict(rotary_dim=32, interleaved=True, packed=True),
    "partial_rotary": dict(rotary_dim=16),
    "partial_rotary_interleaved": dict(rotary_dim=16, interleaved=True),
    "local_window": dict(rotary_dim=32, local_window_size=3),
    "softcap": dict(softcap=1.5, scale=0.4),
    "empty_past": dict(past=True, rotary_dim=32, packed=True),
    "one_kv_head": dict(kv_num_heads=1),
}


def _run(model, feeds, outputs=None):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(outputs or [o.name for o in session.get_outputs()], session.run(outputs, feeds)))


def _case(kv_num_heads=2, **options):
    return gqa_model(2, 6, 4, kv_num_heads, 32, **options)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_autograd_of_the_unfused_attention(name):
    model, feeds = _case(**CASES[name])
    dy = np.random.default_rng(5).standard_normal((2, 6, 128)).astype(np.float32)
    forward = _run(model, feeds, ["y"])["y"]
    # the runtime's local window: local_window_size keys (onnxruntime 1.32) or one more (older)
    expected = next(reference for extra in (0, 1) for reference in [gqa_reference(model, {**feeds, "y_grad": dy}, extra)]
                    if np.allclose(forward, reference["y"], rtol=1e-5, atol=1e-5) or extra == 1)
    np.testing.assert_allclose(forward, expected["y"], rtol=1e-5, atol=1e-5)
    training = build_training_graph(model)
    outputs = _run(training.model, {**feeds, **training.weights, "y_grad": dy})
    for input_name in feeds:
        np.testing.assert_allclose(outputs[f"{input_name}_grad"], expected[f"{input_name}_grad"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rotary", [False, True])
def test_matches_the_unfused_standard_onnx_attention(rotary):
    model, feeds = _case(rotary_dim=32 if rotary else None)
    unfused = unfused_model(2, 6, 4, 2, 32, rotary)
    dy = np.random.default_rng(7).standard_normal((2, 6, 128)).astype(np.float32)
    fused_outputs = _run(build_training_graph(model).model, {**feeds, "y_grad": dy})
    frozen = {"cos", "sin", "mask", "scale"}
    unfused_outputs = _run(build_training_graph(unfused, frozen=frozen).model, {**feeds, "y_grad": dy})
    for name in ("y", "query_grad", "key_grad", "value_grad"):
        np.testing.assert_allclose(fused_outputs[name], unfused_outputs[name], rtol=1e-4, atol=1e-5)


def test_directional_finite_difference():
    model, feeds = _case(rotary_dim=32, local_window_size=4, softcap=2.0)
    rng = np.random.default_rng(6)
    dy = rng.standard_normal((2, 6, 128))
    training = build_training_graph(model)
    outputs = _run(training.model, {**feeds, "y_grad": dy.astype(np.float32)})
    directions = {n: rng.standard_normal(v.shape) for n, v in feeds.items()}
    h = 1e-3

    def loss(sign):  # float64 outside, float32 inside onnxruntime: a step large enough to stay above rounding
        shifted = {n: (v + sign * h * directions[n]).astype(np.float32) for n, v in feeds.items()}
        return float((dy * _run(model, shifted, ["y"])["y"]).sum())

    slope = (loss(1) - loss(-1)) / (2 * h)
    assert slope == pytest.approx(sum(float((outputs[f"{n}_grad"] * d).sum()) for n, d in directions.items()), rel=2e-3)


@pytest.mark.parametrize("change,message", [
    (lambda node: node.attribute.add(name="smooth_softmax", i=1, type=2), "smooth_softmax=1"),
    (lambda node: node.input.extend(["", "", "", "query"]), "attention_bias"),
    (lambda node: [a for a in node.attribute if a.name == "local_window_size"][0].__setattr__("i", 0),
     "local_window_size=0"),
])
def test_uncovered_variants_are_refused_by_name(change, message):
    model, _ = _case(local_window_size=2)
    change(model.graph.node[0])
    with pytest.raises(UnsupportedOperatorError, match=message):
        build_training_graph(model)


def test_a_nonempty_past_is_refused():
    model, _ = _case(past=True)
    model = copy.deepcopy(model)
    for tensor in model.graph.initializer:
        if tensor.name.startswith("past_"):
            tensor.dims[2] = 1
            tensor.raw_data = np.zeros((2, 2, 1, 32), np.float32).tobytes()
    with pytest.raises(UnsupportedOperatorError, match="past .* is not empty"):
        build_training_graph(model)
