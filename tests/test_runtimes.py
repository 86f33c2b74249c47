"""The corpus and 5-step training loops on ONNX runtimes other than onnxruntime
(``tests/_runtimes.py``): onnx's ReferenceEvaluator, OpenVINO's own runtime, tract.

Corpus: every case as stored and, for single-node cases, inlined by normgrad
(:func:`normgrad.graphs.inline.inline_normgrad`: standard ops, static reduction axes),
against the corpus's float64 expected values. Training: step graphs as ``normgrad export``
writes them (weights pure inputs, fed each step; ``--inline`` and not), 5 steps of SGD with
momentum and of AdamW, against the same 5 steps run by onnxruntime's CPU provider.

A model a runtime lacks something for (:func:`_runtimes.lacks`) must fail there: an explicit
xfail naming what it lacks; if it runs, the test fails (update ``lacks``). Every outcome is
checked against ``graphs/runtime_support.json`` and, with ``NORMGRAD_RECORD_RUNTIMES=1``,
recorded there; ``normgrad.tools.runtime_table`` renders docs/reference/runtimes.md from it.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from normgrad.graphs import build_step_graph, build_training_graph, examples
from normgrad.graphs.inline import inline_normgrad
from normgrad.graphs.portable import as_exported, make_portable
from normgrad.tools.corpus import fed_weights
from normgrad.graphs.optimizers import hyperparameter_feeds

import _runtimes
from _providers import max_relative_error
from _corpus_cases import CASES, MANIFEST, TOLERANCE, assert_matches, load_case

pytestmark = pytest.mark.slow

FORMS = ("stored", "inlined")


def _expect(runtime: str, row: str, model: onnx.ModelProto, attempt) -> None:
    """Runs ``attempt`` (which asserts the values) where the runtime lacks nothing, or
    expects it to fail and xfails naming what the runtime lacks."""
    missing = _runtimes.lacks(runtime, model)
    if missing is None:
        attempt()
        _runtimes.record(runtime, row, "pass")
        return
    try:
        attempt()
    except Exception as error:  # noqa: BLE001 (any failure of the runtime is the expected one)
        _runtimes.record(runtime, row, f"lacks {missing}")
        pytest.xfail(f"{runtime} lacks {missing}: {str(error).splitlines()[0][:200] if str(error) else type(error).__name__}")
    pytest.fail(f"{runtime} ran {row} although it was expected to lack {missing}: update _runtimes.lacks")


def _corpus_model(name: str, form: str):
    model, inputs, expected = load_case(name)
    if form == "inlined":
        model = inline_normgrad(model)
    return model, inputs, expected


def _corpus_params():
    params = []
    for runtime in _runtimes.RUNTIMES:
        if runtime == "openvino-ep":
            continue  # tests/test_openvino.py runs the corpus on the EP
        for name in CASES:
            for form in FORMS:
                if form == "inlined" and MANIFEST[name]["kind"] != "node":
                    continue  # training cases have their own _inline twin
                params.append(pytest.param(runtime, name, form, marks=_runtimes.requires(runtime)))
    return params


@pytest.mark.parametrize("runtime, name, form", _corpus_params())
def test_corpus_case(runtime, name, form):
    model, inputs, expected = _corpus_model(name, form)
    info = MANIFEST[name]

    def attempt():
        actual = _runtimes.run(runtime, model, inputs)
        assert_matches(actual, expected, TOLERANCE[(info["kind"], info["dtype"])], f"{name} ({form}) on {runtime}")

    _expect(runtime, f"corpus/{name}/{form}", model, attempt)


def test_inlined_bodies_have_static_axes():
    """Inlined, no corpus case computes a reduction axis at run time (CumSum/NonZero)."""
    for name in CASES:
        model = inline_normgrad(load_case(name)[0]) if MANIFEST[name]["kind"] == "node" else load_case(name)[0]
        if MANIFEST[name]["kind"] == "node" or MANIFEST[name]["inline"]:
            assert not model.functions and not {o.domain for o in model.opset_import} - {"", "ai.onnx"}, name
            assert not {n.op_type for n in model.graph.node} & {"CumSum", "NonZero"}, name


LOOPS = [
    ("unet_block", "mse", "sgd", dict(momentum=0.9)),
    ("style_transfer_block", "mse", "sgd", dict(momentum=0.9, nesterov=True)),
    ("resnet_block", "mse", "sgd", dict(momentum=0.9)),
    # AdamW where no gradient is ~0 (a conv bias before a normalization has a zero gradient,
    # which Adam turns into steps of size lr made of rounding noise)
    ("mlp", "cross_entropy", "adamw", dict(weight_decay=0.01)),
    ("lstm_block", "cross_entropy", "adamw", dict(weight_decay=0.01)),
    ("gru_block", "cross_entropy", "sgd", dict(momentum=0.9)),
    # LayerNormalization and training-mode Dropout (the step graph's seeded mask)
    ("transformer_block", "mse", "sgd", dict(momentum=0.9)),
]


def _recurrent_block(kind: str, direction: str) -> onnx.ModelProto:
    """x [N, 5, 3] batch first, transposed to time-major, a recurrent node (hidden 4), its
    last hidden states [D, N, 4] flattened per sample to 3 logits."""
    gates, hidden, directions = {"LSTM": 4, "GRU": 3}[kind], 4, 2 if direction == "bidirectional" else 1
    params = examples.weights(11, W=(directions, gates * hidden, 3), R=(directions, gates * hidden, hidden),
                              B=(directions, 2 * gates * hidden), w_out=(directions * hidden, 3), b_out=(3,))
    params["flat"] = np.array([0, -1], np.int64)
    nodes = [
        onnx.helper.make_node("Transpose", ["x"], ["x_time"], perm=[1, 0, 2]),
        onnx.helper.make_node(kind, ["x_time", "W", "R", "B"], ["", "h_last"], hidden_size=hidden, direction=direction),
        onnx.helper.make_node("Transpose", ["h_last"], ["h_batch"], perm=[1, 0, 2]),
        onnx.helper.make_node("Reshape", ["h_batch", "flat"], ["h_flat"]),
        onnx.helper.make_node("MatMul", ["h_flat", "w_out"], ["z"]),
        onnx.helper.make_node("Add", ["z", "b_out"], ["y"]),
    ]
    return examples.model(nodes, {"x": ("N", 5, 3)}, ["y"], params)


BLOCKS = {"lstm_block": lambda: _recurrent_block("LSTM", "bidirectional"),
          "gru_block": lambda: _recurrent_block("GRU", "forward")}
"""Training-loop models of this file's own, beside :mod:`normgrad.graphs.examples`'s."""


def _step_graph(block, loss, optimizer, options, inline, portable=False):
    """(step graph as ``normgrad export`` writes it, ``--portable`` too if ``portable``,
    initial state with fed weights, batches)."""
    forward = BLOCKS[block]() if block in BLOCKS else getattr(examples, block)()
    training = build_training_graph(forward, loss=loss, inline=inline)
    step, state = build_step_graph(training, optimizer, **options)
    step, _ = make_portable(step) if portable else as_exported(step)
    weights = json.loads({p.key: p.value for p in step.metadata_props}["normgrad.gradients"]).values()
    state.update(fed_weights({k: v for k, v in state.items() if k in set(weights)}, block))
    rng = np.random.default_rng(7)
    x = forward.graph.input[0]
    x_shape = [d.dim_value or 4 for d in x.type.tensor_type.shape.dim]
    y_shape = [d.dim_value or 4 for d in forward.graph.output[0].type.tensor_type.shape.dim]
    batches = []
    for _ in range(5):
        labels = (rng.integers(0, y_shape[1], [x_shape[0]] + y_shape[2:]).astype(np.int64) if loss == "cross_entropy"
                  else rng.standard_normal(x_shape).astype(np.float32))  # the conv blocks keep x's shape
        batches.append({x.name: rng.standard_normal(x_shape).astype(np.float32), "labels": labels})
    return step, state, batches


def _loop(step, state, batches, run):
    meta = {p.key: json.loads(p.value) for p in step.metadata_props if p.key == "normgrad.state"}["normgrad.state"]
    losses = []
    for k, batch in enumerate(batches, start=1):
        feeds = {**hyperparameter_feeds(step), **state, **batch, "lr": np.array(0.05, np.float32),
                 "step": np.array(k, np.float32), "dropout_seed": np.array(3, np.int64)}
        out = run({i.name: feeds[i.name] for i in step.graph.input})
        losses.append(out["loss"])
        state = {name: out[meta[name]] for name in state}
    return losses, state


def _onnxruntime(step):
    import normgrad

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(normgrad.add_functions(step).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return lambda feeds: dict(zip(names, session.run(None, feeds)))


FORMS_ON = {runtime: ("default", "inline") for runtime in _runtimes.RUNTIMES}
FORMS_ON["openvino-ep"] += ("portable",)  # what the EP needs (tests/test_openvino.py checks where the nodes ran)


def _loop_params():
    return [pytest.param(runtime, *loop, form, marks=_runtimes.requires(runtime))
            for runtime in _runtimes.RUNTIMES for loop in LOOPS for form in FORMS_ON[runtime]]


@pytest.mark.parametrize("runtime, block, loss, optimizer, options, form", _loop_params())
def test_training_loop(runtime, block, loss, optimizer, options, form):
    """5 steps, weights (fed, unlike any stored value) and optimizer state fed back each
    step, against the same loop on onnxruntime's CPU provider."""
    inline = form == "inline"
    step, state, batches = _step_graph(block, loss, optimizer, options, inline, portable=form == "portable")
    assert not {i.name for i in step.graph.input} & {t.name for t in step.graph.initializer}
    assert not inline or not step.functions

    _expect(runtime, f"training/{block}/{optimizer}/{form}", step,
            lambda: _assert_loop_matches_onnxruntime(runtime, step, state, batches))


def _assert_loop_matches_onnxruntime(runtime, step, state, batches) -> None:
    """The 5-step loop on ``runtime`` gives onnxruntime's CPU provider's losses and final
    state (within 1e-4 of scale), and the state moved."""
    losses, final = _loop(step, state, batches, lambda feeds: _runtimes.run(runtime, step, feeds))
    want_losses, want = _loop(step, state, batches, _onnxruntime(step))
    for k, (got, expected) in enumerate(zip(losses, want_losses), start=1):
        assert max_relative_error(got, expected) <= 1e-4, f"loss of step {k}: {got} != {expected}"
    for name, expected in want.items():
        assert max_relative_error(final[name], expected) <= 1e-4, name
    moved = max(max_relative_error(final[name], state[name]) for name in state)
    assert moved > 1e-3, "the state did not move: the loop tests nothing"


RECURRENT_NODES = {
    **{f"{kind.lower()}_{direction}": (kind, dict(direction=direction, initial=True))
       for kind in ("LSTM", "GRU", "RNN") for direction in ("forward", "reverse", "bidirectional")},
    "lstm_peepholes_sequence_lens": ("LSTM", dict(direction="bidirectional", peephole=True, initial=True, lens=[4, 1, 3])),
    "gru_linear_before_reset": ("GRU", dict(direction="bidirectional", initial=True, linear_before_reset=1)),
    "gru_sequence_lens": ("GRU", dict(direction="reverse", lens=[3, 4, 1])),
    "rnn_sequence_lens": ("RNN", dict(direction="bidirectional", lens=[3, 4, 1], initial=True)),
}
"""Training graphs of one recurrent node (:func:`test_graphs_rules_recurrent._case`, whose
gradients are checked there against float64 finite differences)."""


def _recurrent_params():
    return [pytest.param(runtime, name, inline, marks=_runtimes.requires(runtime))
            for runtime in _runtimes.RUNTIMES if runtime != "openvino-ep" for name in RECURRENT_NODES
            for inline in (False, True)]


@pytest.mark.parametrize("runtime, name, inline", _recurrent_params())
def test_recurrent_training_graph(runtime, name, inline):
    """Every output (Y, Y_h, Y_c and every gradient) of a recurrent node's training graph,
    default form and --inline, against onnxruntime's CPU provider."""
    from _recurrent_cases import _case

    kind, options = RECURRENT_NODES[name]
    forward, values, outputs = _case(kind, **options)
    training = build_training_graph(forward, inline=inline).model
    rng = np.random.default_rng(5)
    truth = _onnxruntime_outputs(forward, values)  # the forward's outputs give the seeds' shapes
    feeds = {**values, **{f"{o}_grad": rng.standard_normal(truth[o].shape).astype(np.float32) for o in outputs}}
    feeds = {i.name: feeds[i.name] for i in training.graph.input}

    def attempt():
        got, want = _runtimes.run(runtime, training, feeds), _onnxruntime_outputs(training, feeds)
        for key, value in want.items():
            assert max_relative_error(got[key], value) <= 1e-4, f"{key}: {got[key]} != {value}"

    _expect(runtime, f"recurrent/{name}/{'inline' if inline else 'default'}", training, attempt)


def _onnxruntime_outputs(model, feeds):
    import normgrad

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(normgrad.add_functions(model).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {k: v for k, v in feeds.items()
                                                                               if k in wanted})))


@pytest.mark.parametrize("name", [c for c in CASES if MANIFEST[c]["kind"] == "node" and MANIFEST[c]["dtype"] != "bfloat16"])
def test_static_axes_bodies_are_bitwise_the_shared_ones(name):
    """On onnxruntime, a node inlined with its static-axes body gives bitwise what the shared
    body (run-time axes) gives."""
    model, inputs, _ = load_case(name)
    want, got = _onnxruntime_outputs(model, inputs), _onnxruntime_outputs(inline_normgrad(model), inputs)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and np.array_equal(got[key], value, equal_nan=True), key


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_inline_step_graph_is_standard_domains_only(optimizer):
    """--inline step graphs: no normgrad node, function or opset, AdamUpdate included."""
    training = build_training_graph(examples.unet_block(), loss="mse", inline=True)
    step, _ = build_step_graph(training, optimizer)
    assert not step.functions
    assert {n.domain for n in step.graph.node} <= {""}
    assert {o.domain for o in step.opset_import} <= {"", "ai.onnx"}
    assert not {n.op_type for n in step.graph.node} & {"CumSum", "NonZero"}


def test_export_default_weights_are_pure_inputs(tmp_path):
    """normgrad export with defaults: no weight is an initializer, the checkpoint beside holds
    the forward model's values, and normgrad check uses them."""
    import onnx.numpy_helper as onh

    from normgrad import checkpoint
    from normgrad.tools import check as check_tool
    from normgrad.tools import export as export_tool

    forward = examples.unet_block()
    onnx.save(forward, tmp_path / "block.onnx")
    assert export_tool.main([str(tmp_path / "block.onnx"), "-o", str(tmp_path / "train.onnx"), "--loss", "mse"]) == 0
    written = onnx.load(str(tmp_path / "train.onnx"))
    assert not {i.name for i in written.graph.input} & {t.name for t in written.graph.initializer}
    stored = checkpoint.load(tmp_path / "train.ckpt").tensors
    initializers = {t.name: onh.to_array(t) for t in forward.graph.initializer}
    assert set(stored) == set(initializers) and all(np.array_equal(stored[k], initializers[k]) for k in stored)
    feeds = check_tool._feeds_with_checkpoint(written, str(tmp_path / "train.onnx"), None, 0)
    assert all(np.array_equal(feeds[k], stored[k]) for k in stored)
    assert check_tool.main([str(tmp_path / "train.onnx")]) == 0
    assert check_tool.main([str(tmp_path / "train.onnx"), "--checkpoint", str(tmp_path / "missing.ckpt")]) == 1


TORCH_OPTIMIZERS = {
    "sgd": (["--optimizer", "sgd", "--momentum", "0.9"], lambda torch, params: torch.optim.SGD(params, lr=0.05, momentum=0.9)),
    "adamw": (["--optimizer", "adamw", "--weight-decay", "0.01"],
              lambda torch, params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)),
}


def _conv_groupnorm(torch):
    """Conv without bias (Adam would turn its ~0 gradient into noise), GroupNorm, SiLU, Linear."""
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1, bias=False), torch.nn.GroupNorm(2, 4), torch.nn.SiLU(),
                              torch.nn.Flatten(), torch.nn.Linear(4 * 5 * 5, 3))
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.uniform_(-0.5, 0.5)
    return net


def _recurrent(kind):
    def make(torch):
        class Classifier(torch.nn.Module):
            """2-layer batch-first recurrent network, its last step to a Linear."""

            def __init__(self):
                super().__init__()
                self.rnn = getattr(torch.nn, kind)(3, 4, num_layers=2, batch_first=True)
                self.fc = torch.nn.Linear(4, 3)

            def forward(self, x):
                return self.fc(self.rnn(x)[0][:, -1])

        return Classifier()
    return make


TORCH_NETS = {"conv_groupnorm": (_conv_groupnorm, (4, 3, 5, 5)), "lstm": (_recurrent("LSTM"), (4, 5, 3)),
              "gru": (_recurrent("GRU"), (4, 5, 3))}


def _torch_params():
    return [pytest.param(runtime, net, optimizer, inline,
                         marks=[] if runtime == "onnxruntime" else _runtimes.requires(runtime))
            for runtime in ("onnxruntime",) + _runtimes.RUNTIMES for net in TORCH_NETS for optimizer in TORCH_OPTIMIZERS
            for inline in (False, True)]


@pytest.mark.parametrize("runtime, net_name, optimizer, inline", _torch_params())
def test_torch_model_trains_as_torch(runtime, net_name, optimizer, inline, tmp_path):
    """A torch model (:data:`TORCH_NETS`) exported with normgrad.torch.export and
    `normgrad export` defaults (plus --inline): 5 steps on the runtime, weights read from the
    checkpoint and fed back each step, match torch.optim's 5 steps."""
    torch = pytest.importorskip("torch")
    from normgrad import checkpoint
    from normgrad.torch import export as torch_export
    from normgrad.tools import export as export_tool

    torch.manual_seed(0)
    make_net, x_shape = TORCH_NETS[net_name]
    net = make_net(torch)
    forward = torch_export(net, torch.randn(*x_shape), tmp_path / "net.onnx", input_names=["x"], output_names=["y"])
    flags, make_optimizer = TORCH_OPTIMIZERS[optimizer]
    argv = [str(tmp_path / "net.onnx"), "-o", str(tmp_path / "step.onnx"), "--loss", "cross_entropy"] + flags
    assert export_tool.main(argv + (["--inline"] if inline else [])) == 0
    step = onnx.load(str(tmp_path / "step.onnx"))
    state = dict(checkpoint.load(tmp_path / "step.ckpt").tensors)
    names = json.loads({p.key: p.value for p in forward.metadata_props}["normgrad.torch_parameters"])
    rng = np.random.default_rng(3)
    batches = [{"x": rng.standard_normal(x_shape).astype(np.float32),
                "labels": rng.integers(0, 3, 4).astype(np.int64)} for _ in range(5)]
    parameters = dict(net.named_parameters())
    torch_optimizer = make_optimizer(torch, list(parameters.values()))
    want_losses = []
    for batch in batches:
        torch_optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(batch["x"])), torch.from_numpy(batch["labels"]))
        loss.backward()
        torch_optimizer.step()
        want_losses.append(loss.item())
    run = _onnxruntime(step) if runtime == "onnxruntime" else (lambda feeds: _runtimes.run(runtime, step, feeds))

    def attempt():
        losses, final = _loop(step, state, batches, run)
        for k, (got, expected) in enumerate(zip(losses, want_losses), start=1):
            assert max_relative_error(got, expected) <= 1e-4, f"loss of step {k}: {got} != {expected}"
        for onnx_name, torch_name in names.items():
            assert max_relative_error(final[onnx_name], parameters[torch_name].detach().numpy()) <= 1e-4, torch_name

    if runtime == "onnxruntime":
        attempt()
    else:
        _expect(runtime, f"training/torch_{net_name}/{optimizer}/{'inline' if inline else 'default'}", step, attempt)


def _dropout_mlp() -> onnx.ModelProto:
    """x [N, 5] -> Gemm -> Relu -> training-mode Dropout (0.25) -> Gemm -> 3 logits."""
    params = examples.weights(21, w1=(5, 8), b1=(8,), w2=(8, 3), b2=(3,))
    params.update(ratio=np.array(0.25, np.float32), training=np.array(True))
    nodes = [onnx.helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]), onnx.helper.make_node("Relu", ["h"], ["r"]),
             onnx.helper.make_node("Dropout", ["r", "ratio", "training"], ["d"]),
             onnx.helper.make_node("Gemm", ["d", "w2", "b2"], ["y"])]
    return examples.model(nodes, {"x": ("N", 5)}, ["y"], params)


EMBEDDING_CLASSIFIER = pathlib.Path(__file__).parent / "data" / "embedding_bag_classifier.onnx"
"""torch's ``nn.EmbeddingBag`` (100 x 6, mode mean, offsets) + ``nn.Embedding`` (5 x 6) of each
sample's category, summed, to a Linear of 3 logits: :func:`export_embedding_classifier`'s
export, stored (the OpenVINO venvs have no torch)."""


def export_embedding_classifier(path) -> onnx.ModelProto:
    """Writes :data:`EMBEDDING_CLASSIFIER` with torch's TorchScript exporter (static sizes:
    9 ids in 4 bags, one of them empty)."""
    import torch

    from normgrad.torch import export as torch_export

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bag, self.category = torch.nn.EmbeddingBag(100, 6, mode="mean"), torch.nn.Embedding(5, 6)
            self.fc = torch.nn.Linear(6, 3)

        def forward(self, ids, offsets, category):
            return self.fc(self.bag(ids, offsets) + self.category(category))

    torch.manual_seed(0)
    example = (torch.randint(0, 100, (9,)), torch.tensor([0, 3, 3, 7]), torch.randint(0, 5, (4,)))
    return torch_export(Classifier(), example, path, input_names=["ids", "offsets", "category"], output_names=["y"])


def _embedding_classifier() -> onnx.ModelProto:
    return onnx.load(str(EMBEDDING_CLASSIFIER))


def test_embedding_classifier_is_torchs_export(tmp_path):
    """The stored classifier is what :func:`export_embedding_classifier` writes now (its
    nodes, inputs and initializers' shapes; the weights are random)."""
    pytest.importorskip("torch")
    fresh, stored = export_embedding_classifier(tmp_path / "fresh.onnx"), _embedding_classifier()
    assert [(n.op_type, list(n.input)) for n in fresh.graph.node] == [(n.op_type, list(n.input)) for n in stored.graph.node]
    assert [(t.name, list(t.dims)) for t in fresh.graph.initializer] == [(t.name, list(t.dims)) for t in stored.graph.initializer]


def _gru_tagger() -> onnx.ModelProto:
    """x [N, 5, 3] -> GRU (hidden 4) over time -> per-step logits y [N, 3 tags, 5]."""
    params = examples.weights(23, W=(1, 12, 3), R=(1, 12, 4), B=(1, 24), w=(4, 3), b=(3,))
    params["steps"] = np.array([0, -1, 4], np.int64)
    nodes = [onnx.helper.make_node("Transpose", ["x"], ["x_time"], perm=[1, 0, 2]),
             onnx.helper.make_node("GRU", ["x_time", "W", "R", "B"], ["states"], hidden_size=4),
             onnx.helper.make_node("Reshape", ["states", "steps"], ["per_step"]),  # [T, N, 4]
             onnx.helper.make_node("MatMul", ["per_step", "w"], ["z"]), onnx.helper.make_node("Add", ["z", "b"], ["zb"]),
             onnx.helper.make_node("Transpose", ["zb"], ["y"], perm=[1, 2, 0])]
    return examples.model(nodes, {"x": ("N", 5, 3)}, ["y"], params)


def _embedding_batch(rng):
    offsets = np.array([0, 3, 3, 7], np.int64)  # bag sizes 3, 0 (an empty bag: zeros), 4, 2 (9 ids)
    return {"ids": rng.integers(0, 100, 9).astype(np.int64), "offsets": offsets,
            "category": rng.integers(0, 5, 4).astype(np.int64), "labels": rng.integers(0, 3, 4).astype(np.int64)}


MODEL_KINDS = {
    "dropout_mlp": (_dropout_mlp, "sgd", dict(momentum=0.9),
                    lambda rng: {"x": rng.standard_normal((4, 5)).astype(np.float32),
                                 "labels": rng.integers(0, 3, 4).astype(np.int64)}),
    "embedding_classifier": (_embedding_classifier, "adamw", dict(weight_decay=0.01), _embedding_batch),
    "gru_tagger": (_gru_tagger, "adamw", dict(weight_decay=0.01),
                   lambda rng: {"x": rng.standard_normal((4, 5, 3)).astype(np.float32),
                                "labels": rng.integers(0, 3, (4, 5)).astype(np.int64)}),
}
"""Model kinds the corpus lacks (training-mode Dropout, embedding tables, a per-step
recurrent output): (forward builder, optimizer, its options, batch maker), cross-entropy."""
KIND_FORMS = ("default", "inline", "portable", "inline-portable")
"""``normgrad export`` with neither flag, ``--inline``, ``--portable``, both."""


def _kind_graphs(kind: str, form: str):
    """(grad-only training graph, its weights, step graph, its initial state) of ``kind`` as
    ``normgrad export`` writes them in ``form``; fed weights unlike the stored ones."""
    build, optimizer, options, _ = MODEL_KINDS[kind]
    inline, portable = form.startswith("inline"), form.endswith("portable")
    training = build_training_graph(build(), loss="cross_entropy", inline=inline, portable=portable)
    step, state = build_step_graph(build_training_graph(build(), loss="cross_entropy", inline=inline), optimizer, **options)
    step, _ = make_portable(step) if portable else as_exported(step)
    weights = fed_weights(training.weights, kind)
    state.update({k: weights[k] for k in weights if k in state})
    return training.model, weights, step, state


def _kind_params():
    return [pytest.param(runtime, kind, form, marks=_runtimes.requires(runtime))
            for runtime in _runtimes.RUNTIMES for kind in MODEL_KINDS for form in KIND_FORMS]


@pytest.mark.parametrize("runtime, kind, form", _kind_params())
def test_model_kind_grad_graph(runtime, kind, form):
    """The grad-only training graph of each of :data:`MODEL_KINDS` in each form: every output
    against onnxruntime's CPU provider. (The default form's training-mode Dropout draws each
    runtime's own random mask: there only that it runs and gives finite outputs of the same
    shapes.)"""
    model, weights, _, _ = _kind_graphs(kind, form)
    batch = MODEL_KINDS[kind][3](np.random.default_rng(8))
    feeds = {**weights, **batch, "dropout_seed": np.array(3, np.int64), "step": np.array(1, np.float32)}
    feeds = {i.name: feeds[i.name] for i in model.graph.input}

    def attempt():
        got, want = _runtimes.run(runtime, model, feeds), _onnxruntime_outputs(model, feeds)
        for key, value in want.items():
            assert got[key].shape == value.shape and np.all(np.isfinite(got[key])), key
            if not _runtimes.training_dropout(model):
                assert max_relative_error(got[key], value) <= 1e-4, f"{key}: {got[key]} != {value}"

    _expect(runtime, f"grad/{kind}/{form}", model, attempt)


@pytest.mark.parametrize("runtime, kind, form", _kind_params())
def test_model_kind_training_loop(runtime, kind, form):
    """5 steps of each of :data:`MODEL_KINDS`'s step graph in each form, state fed back,
    against the same loop on onnxruntime's CPU provider."""
    _, _, step, state = _kind_graphs(kind, form)
    rng = np.random.default_rng(9)
    batches = [MODEL_KINDS[kind][3](rng) for _ in range(5)]

    _expect(runtime, f"training/{kind}/{MODEL_KINDS[kind][1]}/{form}", step,
            lambda: _assert_loop_matches_onnxruntime(runtime, step, state, batches))
