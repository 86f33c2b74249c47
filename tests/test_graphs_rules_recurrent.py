"""LSTM, GRU and RNN gradients against float64 central finite differences of a NumPy
reference of the ONNX operators (onnx's reference evaluator ignores sequence_lens, and
onnxruntime runs these operators in float32 only): <gradient, v> of the float32 training
graph against (f(p + h v) - f(p - h v)) / 2h in float64, f = sum(Y dY) + sum(Y_h dY_h)
(+ sum(Y_c dY_c)), for every differentiable input, with the forward checked too."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from normgrad.graphs import UnsupportedOperatorError, build_training_graph
from normgrad.graphs.inline import shared_scan_outputs
from normgrad.ops import IR_VERSION
from _recurrent_cases import GATES, _case

ACT = {"Sigmoid": lambda v: 1 / (1 + np.exp(-v)), "Tanh": np.tanh, "Relu": lambda v: np.maximum(v, 0)}
DEFAULTS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}


def reference(kind, inputs, hidden, direction="forward", layout=0, activations=None, linear_before_reset=0):
    """The ONNX operator in float64: (Y, Y_h[, Y_c]) in the node's layout."""
    x = inputs["X"].astype(np.float64)
    if layout:
        x = x.transpose(1, 0, 2)
    steps, batch = x.shape[:2]
    directions = 2 if direction == "bidirectional" else 1
    acts = activations or DEFAULTS[kind] * directions
    n = len(DEFAULTS[kind])
    lens = inputs.get("sequence_lens", np.full(batch, steps)).astype(np.int64)

    def state(name, d):
        if name not in inputs:
            return np.zeros((batch, hidden))
        value = inputs[name].astype(np.float64)
        return (value.transpose(1, 0, 2) if layout else value)[d]

    y = np.zeros((steps, directions, batch, hidden))
    yh, yc = np.zeros((directions, batch, hidden)), np.zeros((directions, batch, hidden))
    for d in range(directions):
        f, g, h = [ACT[a] for a in acts[d * n:(d + 1) * n]] + [None] * (3 - n)
        w, r = inputs["W"][d].astype(np.float64), inputs["R"][d].astype(np.float64)
        b = inputs["B"][d].astype(np.float64) if "B" in inputs else np.zeros(2 * GATES[kind] * hidden)
        wb, rb = np.split(b, 2)
        p = inputs["P"][d].astype(np.float64) if "P" in inputs else np.zeros(3 * hidden)
        for k in range(batch):
            ht, ct = state("initial_h", d)[k], state("initial_c", d)[k]
            order = range(lens[k]) if d == 0 and direction != "reverse" else reversed(range(lens[k]))
            for t in order:
                xt = x[t, k]
                if kind == "RNN":
                    ht = f(w @ xt + r @ ht + wb + rb)
                elif kind == "GRU":
                    xw, hr = np.split(w @ xt + wb, 3), np.split(r, 3)
                    rbs = np.split(rb, 3)
                    z = f(xw[0] + hr[0] @ ht + rbs[0])
                    rr = f(xw[1] + hr[1] @ ht + rbs[1])
                    if linear_before_reset:
                        n_ = g(xw[2] + rr * (hr[2] @ ht + rbs[2]))
                    else:
                        n_ = g(xw[2] + hr[2] @ (rr * ht) + rbs[2])
                    ht = (1 - z) * n_ + z * ht
                else:
                    pi, po, pf = np.split(p, 3)
                    i_, o_, f_, c_ = np.split(w @ xt + r @ ht + wb + rb, 4)
                    i_, f_ = f(i_ + pi * ct), f(f_ + pf * ct)
                    ct = f_ * ct + i_ * g(c_)
                    ht = f(o_ + po * ct) * h(ct)
                y[t, d, k] = ht
            yh[d, k], yc[d, k] = ht, ct
    if layout:
        y, yh, yc = y.transpose(2, 0, 1, 3), yh.transpose(1, 0, 2), yc.transpose(1, 0, 2)
    return (y, yh, yc) if kind == "LSTM" else (y, yh)


def _check(kind, tolerance=2e-4, inline=False, **kwargs):
    import onnxruntime as ort

    forward, values, outputs = _case(kind, **kwargs)
    attrs = {a.name: oh.get_attribute_value(a) for a in forward.graph.node[0].attribute}
    acts = [a.decode() for a in attrs["activations"]] if "activations" in attrs else None
    training = build_training_graph(forward, inline=inline).model  # every weight is a graph input, in values
    assert not inline or not any(shared_scan_outputs(n) for n in training.graph.node if n.op_type == "Scan")
    assert not inline or not any(n.op_type == "ReverseSequence" for n in training.graph.node)  # tract has none
    rng = np.random.default_rng(1)
    session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    def f(vals):
        ref = reference(kind, vals, attrs["hidden_size"], attrs["direction"].decode(), attrs.get("layout", 0), acts,
                        attrs.get("linear_before_reset", 0))
        return dict(zip(["Y", "Y_h", "Y_c"], ref))

    expected = f(values)
    seeds = {f"{o}_grad": rng.standard_normal(expected[o].shape).astype(np.float32) for o in outputs}
    grads = dict(zip([o.name for o in session.get_outputs()], session.run(None, {**values, **seeds})))
    for name in outputs:
        np.testing.assert_allclose(grads[name], expected[name], atol=1e-5, err_msg=f"forward {name}")
    checked = 0
    for name, value in values.items():
        if name == "sequence_lens":
            continue
        grad = grads[f"{name}_grad"]
        v = rng.standard_normal(value.shape)
        step = 1e-6
        objective = lambda vals: sum(float(np.sum(f(vals)[o] * seeds[f"{o}_grad"])) for o in outputs)  # noqa: E731
        plus = objective({**values, name: value.astype(np.float64) + step * v})
        minus = objective({**values, name: value.astype(np.float64) - step * v})
        numeric, analytic = (plus - minus) / (2 * step), float(np.sum(grad.astype(np.float64) * v))
        scale = max(abs(numeric), float(np.sqrt(np.sum(grad.astype(np.float64) ** 2))), 1e-3)
        assert abs(analytic - numeric) / scale < tolerance, (name, analytic, numeric)
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("inline", [False, True], ids=["default", "inline"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_directions(kind, direction, inline):
    """Every direction, and the --inline form (Scan bodies self-contained, per-step outputs values of their own)."""
    _check(kind, direction=direction, initial=True, inline=inline)


@pytest.mark.parametrize("inline", [False, True], ids=["default", "inline"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_layout_1_and_sequence_lens(kind, inline):
    _check(kind, direction="bidirectional", layout=1, lens=[4, 2, 1], initial=True, inline=inline)


@pytest.mark.parametrize("time_axis", [0, 1])
def test_reversal_by_gather_is_reverse_sequence(time_axis):
    """--inline's GatherElements reversal against a float64 NumPy reversal of each sequence's
    first sequence_lens steps (lengths 0, 1, in between and whole; rank 4, int32 lengths)."""
    import onnxruntime as ort
    from onnx.reference import ReferenceEvaluator

    from normgrad.graphs.inline import reversals_by_gather

    steps, lengths = 5, np.array([0, 5, 1, 3], np.int32)
    shape = [steps, len(lengths), 2, 3] if time_axis == 0 else [len(lengths), steps, 2, 3]
    x = np.random.default_rng(0).standard_normal(shape)
    want = x.copy()
    for b, n in enumerate(lengths):
        if time_axis == 0:
            want[:n, b] = x[:n, b][::-1]
        else:
            want[b, :n] = x[b, :n][::-1]
    node = oh.make_node("ReverseSequence", ["x", "lens"], ["y"], time_axis=time_axis, batch_axis=1 - time_axis)
    model = oh.make_model(oh.make_graph([node], "reverse", [oh.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, shape),
                                                            oh.make_tensor_value_info("lens", onnx.TensorProto.INT32, [4])],
                                        [oh.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, shape)]),
                          opset_imports=[oh.make_opsetid("", 18)], ir_version=IR_VERSION)
    reversals_by_gather(model)
    assert "ReverseSequence" not in {n.op_type for n in model.graph.node}
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for got in (session.run(None, {"x": x, "lens": lengths})[0], ReferenceEvaluator(model).run(None, {"x": x, "lens": lengths})[0]):
        assert got.shape == want.shape and np.array_equal(got, want)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_sequence_lens_no_initial_state_no_bias(kind):
    _check(kind, direction="reverse", lens=[3, 4, 1], bias=False)


def test_lstm_peepholes():
    _check("LSTM", direction="bidirectional", peephole=True, initial=True, lens=[4, 1, 3])


@pytest.mark.parametrize("linear_before_reset", [0, 1])
def test_gru_linear_before_reset(linear_before_reset):
    _check("GRU", direction="bidirectional", initial=True, linear_before_reset=linear_before_reset)


@pytest.mark.parametrize("outputs", [["Y_h"], ["Y"], ["Y_c"]])
def test_lstm_one_output(outputs):
    _check("LSTM", outputs=outputs, initial=True)


def test_other_activations():
    _check("RNN", direction="bidirectional", activations=["Relu", "Sigmoid"], initial=True)
    _check("LSTM", activations=["Sigmoid", "Relu", "Tanh"], initial=True)
    _check("GRU", activations=["Tanh", "Sigmoid"], initial=True)


@pytest.mark.parametrize("attrs, message", [
    ({"clip": 2.0}, "'clip'"),
    ({"activations": ["Sigmoid", "Tanh", "Softsign"]}, "activation Softsign"),
    ({"input_forget": 1}, "input_forget=1"),
])
def test_refused_by_name(attrs, message):
    forward, _, _ = _case("LSTM", **attrs)
    with pytest.raises(UnsupportedOperatorError, match=message):
        build_training_graph(forward)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_bitwise_same_for_any_thread_count_and_optimization_level(kind):
    """1-4 threads, every optimization level, default and --inline form. The LSTM training graph computes its forward
    with normgrad's Scan (onnxruntime's LSTM kernel changed the last bits of Y at 3 or more
    threads); GRU's forward is onnxruntime's kernel, the backward the same for the three operators."""
    import onnxruntime as ort

    forward, values, outputs = _case(kind, steps=6, batch=5, size=7, hidden=9, direction="bidirectional", lens=[6, 3, 1, 5, 6])
    model = build_training_graph(forward).model
    assert (kind in {n.op_type for n in model.graph.node}) == (kind != "LSTM")  # LSTM: replaced by our Scan forward
    inlined = build_training_graph(forward, inline=True).model
    rng = np.random.default_rng(3)
    shapes = {"Y": (6, 2, 5, 9), "Y_h": (2, 5, 9), "Y_c": (2, 5, 9)}
    feeds = {**values, **{f"{o}_grad": rng.standard_normal(shapes[o]).astype(np.float32) for o in outputs}}
    results = []
    for threads, level in ((1, ort.GraphOptimizationLevel.ORT_ENABLE_ALL), (2, ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
                           (3, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC), (4, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)):
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.graph_optimization_level = threads, level
        for training in (model, inlined):  # the --inline form too: the same values in other nodes
            session = ort.InferenceSession(training.SerializeToString(), options, providers=["CPUExecutionProvider"])
            results.append(session.run(None, feeds))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)
