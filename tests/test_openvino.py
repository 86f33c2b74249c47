"""The interoperability corpus and a 5-step training loop on OpenVINOExecutionProvider
(device CPU), against the float64 expected values; where the nodes ran, from the session
profile. Skips where onnxruntime-openvino is not installed (``.ci/run`` builds a venv with it).

Training graphs run as :func:`normgrad.graphs.portable.make_portable` makes them (the
exporter's ``--portable``); ``tests/test_openvino_defects.py`` shows why each rewrite is needed.
"""

from __future__ import annotations

import json
import pathlib
import tempfile

import numpy as np
import onnx
import onnxruntime
import pytest

from normgrad.graphs import build_step_graph, build_training_graph, examples
from normgrad.graphs.portable import make_portable
from normgrad.ops import harness
from normgrad.tools.corpus import float64_outputs
from normgrad.graphs.optimizers import hyperparameter_feeds

import _runtimes
from _providers import OPENVINO_CPU, counted_nodes, max_relative_error, nodes_on_cpu, requires_openvino, run, session
from _helpers import cpp_available
from _corpus_cases import CASES, MANIFEST, TOLERANCE, _has_bfloat16, assert_matches, load_case

pytestmark = [pytest.mark.slow, requires_openvino]

# the 0-d loss: onnxruntime-openvino leaves reductions to a 0-d float tensor to the CPU provider
LOSS_ON_CPU = {"ReduceMean"}
# The nodes a case may run on the CPU provider, and why. Anything else on the CPU fails.
ALLOWED_ON_CPU = {
    # the 0-d loss, and (BiasSoftmaxCrossEntropy's body) the 0-d arithmetic next to its
    # reduction: the loss's Neg and a Cast onnxruntime inserts there
    "train_mlp_cross_entropy": LOSS_ON_CPU | {"Neg", "Cast"},
    "train_mlp_cross_entropy_stored_weights": LOSS_ON_CPU | {"Neg", "Cast"},
}
# bfloat16 cases: OpenVINO's CPU device takes no bfloat16 tensors, so the Casts from and to
# bfloat16 (and BatchNormReduceBackward's one Mul between two of them) stay on the CPU provider.
BFLOAT16_ON_CPU = {"Cast", "Mul"}


def run_case(name: str):
    """(outputs, nodes on CPU, counted nodes) of a corpus case on OpenVINO."""
    model, inputs, _ = load_case(name)
    model, moved = make_portable(model)
    assert set(moved) <= set(inputs)  # the fed values, not the moved stored ones, are the case's weights
    declared = {i.name for i in model.graph.input}
    bfloat16_outputs = [o.name for o in model.graph.output if o.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16]
    if _has_bfloat16(model):
        model = harness._bfloat16_via_float(model)
    s = session(model, OPENVINO_CPU, profile=True)
    outputs = harness.run_session(s, {k: v for k, v in inputs.items() if k in declared}, bfloat16_outputs)
    return outputs, nodes_on_cpu(s), counted_nodes(model)


@pytest.mark.parametrize("name", CASES)
def test_corpus_case_on_openvino(name):
    info = MANIFEST[name]
    _, _, expected = load_case(name)
    outputs, on_cpu, total = run_case(name)
    assert_matches(outputs, expected, TOLERANCE[(info["kind"], info["dtype"])], f"{name} on OpenVINO")
    op_types = {op for op, _ in on_cpu}
    allowed = BFLOAT16_ON_CPU if info["dtype"] == "bfloat16" else ALLOWED_ON_CPU.get(name, set())
    unexplained = op_types - allowed
    assert not unexplained, f"{name}: {len(on_cpu)} of {total} nodes ran on the CPU provider: {sorted(on_cpu)}"
    _runtimes.record("openvino-ep", f"corpus/{name}/portable", "pass")


def _step_loop(step_model, state, batches, run_step):
    """5 steps feeding each step's state outputs back; returns (losses, final state)."""
    meta = {p.key: json.loads(p.value) for p in step_model.metadata_props}
    losses = []
    for k, batch in enumerate(batches, start=1):
        out = run_step({**hyperparameter_feeds(step_model), **state, **batch, "lr": np.array(0.1, np.float32), "step": np.array(k, np.float32)})
        losses.append(out["loss"])
        state = {name: out[meta["normgrad.state"][name]] for name in state}
    return losses, state


# The update operators' function bodies (AdamUpdate, SGDUpdate) check their scalar inputs
# (0-d Sqrt, Mul by zero, Sum, Equal, GreaterOrEqual) before they update; OpenVINO leaves
# some of those 0-d nodes (and with them the mse loss's scale) to the CPU provider. The
# update itself runs on OpenVINO.
UPDATE_CHECKS_ON_CPU = {"Mul", "Sum", "GreaterOrEqual"}
# Plain SGD (no momentum, no weight decay) on the style-transfer block with cross-entropy:
# measured with 28 nodes on the CPU provider (the convolutions and InstanceNormalization of
# the forward among them), after SGDUpdate's body replaced the separate SGD ops; the losses
# and weights still match float64. Not yet understood: a named, non-strict xfail of the
# node placement only.
SGD_BODY_SPLITS_PARTITION = "plain SGDUpdate's body splits the EP's partition on this graph (nodes on the CPU provider)"


@pytest.mark.parametrize(
    "block, loss, optimizer, options, allowed_on_cpu",
    [
        ("style_transfer_block", "mse", "sgd", dict(momentum=0.9), LOSS_ON_CPU | UPDATE_CHECKS_ON_CPU),
        ("resnet_block", "mse", "sgd", dict(momentum=0.9, nesterov=True), LOSS_ON_CPU | UPDATE_CHECKS_ON_CPU),
        ("style_transfer_block", "cross_entropy", "sgd", dict(), None),
        # Adam only where no gradient is ~0: a conv bias before a normalization has a zero
        # gradient, which Adam turns into steps of size lr made of rounding noise
        ("mlp", "cross_entropy", "adamw", dict(weight_decay=0.01), LOSS_ON_CPU | UPDATE_CHECKS_ON_CPU),
        # LayerNormalization (its statistics computed beside it in the portable form), no Dropout
        ("transformer_block", "mse", "sgd", dict(momentum=0.9), LOSS_ON_CPU | UPDATE_CHECKS_ON_CPU),
        # the seeded Dropout mask, exact in 32-bit integers
        ("transformer_block_dropout", "mse", "sgd", dict(momentum=0.9), LOSS_ON_CPU | UPDATE_CHECKS_ON_CPU),
        ("transformer_block_dropout", "mse", "adamw", dict(weight_decay=0.01), LOSS_ON_CPU | UPDATE_CHECKS_ON_CPU),
    ],
)
def test_training_loop_on_openvino(block, loss, optimizer, options, allowed_on_cpu):
    """Five steps of a step graph on OpenVINO, weights and optimizer state fed back each
    step, against the same five steps of the graph evaluated in float64."""
    forward = examples.transformer_block(dropout=0.1) if block == "transformer_block_dropout" else (
        examples.transformer_block(dropout=0.0) if block == "transformer_block" else getattr(examples, block)())
    training = build_training_graph(forward, loss=loss)
    step_model, state = build_step_graph(training, optimizer, portable=True, **options)
    assert not step_model.graph.initializer or all(
        t.name not in {i.name for i in step_model.graph.input} for t in step_model.graph.initializer
    )
    rng = np.random.default_rng(7)
    x_info = step_model.graph.input[0]
    x_shape = [d.dim_value or 4 for d in x_info.type.tensor_type.shape.dim]
    batches = []
    for _ in range(5):
        x = rng.standard_normal(x_shape).astype(np.float32)
        y_shape = [d.dim_value or 4 for d in forward.graph.output[0].type.tensor_type.shape.dim]
        if loss == "cross_entropy":
            labels = rng.integers(0, y_shape[1], [x_shape[0]] + y_shape[2:]).astype(np.int64)
        else:
            labels = rng.standard_normal(y_shape).astype(np.float32)
        batches.append({x_info.name: x, "labels": labels})
        if "dropout_seed" in {i.name for i in step_model.graph.input}:
            batches[-1]["dropout_seed"] = np.array(5, np.int64)

    s = session(step_model, OPENVINO_CPU, profile=True)
    names = [o.name for o in s.get_outputs()]
    losses, final = _step_loop(step_model, state, batches, lambda feeds: dict(zip(names, s.run(None, feeds))))
    on_cpu = nodes_on_cpu(s)
    want_losses, want = _step_loop(step_model, {k: v.astype(np.float64) for k, v in state.items()}, batches,
                                   lambda feeds: float64_outputs(step_model, feeds))
    for k, (got, expected) in enumerate(zip(losses, want_losses), start=1):
        assert max_relative_error(got, expected) <= 1e-4, f"loss of step {k}"
    for name, expected in want.items():
        assert max_relative_error(final[name], expected) <= 1e-4, name
    assert max_relative_error(final[step_model.graph.input[1].name], state[step_model.graph.input[1].name]) > 1e-3, \
        "the weights did not move: the loop tests nothing"
    _runtimes.record("openvino-ep", f"training/{block}_{loss}/{optimizer}/portable", "pass")  # the numbers match
    if allowed_on_cpu is None:
        if on_cpu:
            pytest.xfail(f"{SGD_BODY_SPLITS_PARTITION}: {len(on_cpu)} of {counted_nodes(step_model)}")
        allowed_on_cpu = set()
    unexplained = {op for op, _ in on_cpu} - allowed_on_cpu
    assert not unexplained, f"{len(on_cpu)} of {counted_nodes(step_model)} nodes ran on the CPU provider: {sorted(on_cpu)}"
    print(f"{block} {loss} {optimizer}: {len(on_cpu)} of {counted_nodes(step_model)} nodes on the CPU provider: "
          f"{sorted({op for op, _ in on_cpu})}")


def test_trainer_on_openvino():
    """normgrad.train.Trainer with providers=[OpenVINO, CPU] and no kernels registered (so
    OpenVINO inlines the function bodies): 5 steps of a portable step graph, state fed back
    through IOBinding, against the float64 loop."""
    from normgrad.train import Trainer

    training = build_training_graph(examples.style_transfer_block(), loss="mse")
    step_model, state = build_step_graph(training, "sgd", portable=True, momentum=0.9)
    trainer = Trainer(step_model, state, lr=0.1, providers=OPENVINO_CPU, kernels=None)
    assert trainer._step_part.session.get_providers()[0] == "OpenVINOExecutionProvider"
    rng = np.random.default_rng(8)
    batches = [{"x": rng.standard_normal((2, 4, 6, 6)).astype(np.float32),
                "labels": rng.standard_normal((2, 4, 6, 6)).astype(np.float32)} for _ in range(5)]
    losses = [trainer.step(**batch) for batch in batches]
    want_losses, want = _step_loop(step_model, {k: v.astype(np.float64) for k, v in state.items()}, batches,
                                   lambda feeds: float64_outputs(step_model, feeds))
    for k, (got, expected) in enumerate(zip(losses, want_losses), start=1):
        assert max_relative_error(got, expected) <= 1e-4, f"loss of step {k}"
    final = trainer.state_dict()
    for name, expected in want.items():
        assert max_relative_error(final[name], expected) <= 1e-4, name


def test_inference_session_on_openvino():
    """normgrad.inference_session passes any provider list: with function bodies
    (backend="functions") OpenVINO runs the whole node; with the C++ kernels registered the
    normgrad node is a CPU kernel, so it runs on the CPU provider."""
    import normgrad

    name = "node_GroupNormalizationGrad_float32"
    model, inputs, expected = load_case(name)
    for backend, normgrad_on_cpu in (("functions", False), ("cpp", True)):
        if backend == "cpp" and not cpp_available():
            continue
        options = onnxruntime.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(pathlib.Path(tempfile.mkdtemp(prefix="normgrad-profile-")) / "run")
        s = normgrad.inference_session(model, backend=backend, options=options, providers=OPENVINO_CPU)
        assert s.get_providers()[0] == "OpenVINOExecutionProvider"
        outputs = dict(zip([o.name for o in s.get_outputs()], s.run(None, inputs)))
        assert_matches(outputs, expected, TOLERANCE[("node", "float32")], f"{name}, backend {backend}")
        on_cpu = {op for op, _ in nodes_on_cpu(s)}
        assert ("GroupNormalizationGrad" in on_cpu) == normgrad_on_cpu, on_cpu


TRAINING_CASES = [c for c in CASES if MANIFEST[c]["kind"] == "training"]


@pytest.mark.parametrize("name", TRAINING_CASES)
def test_training_case_as_stored_on_openvino(name):
    """Each training case as stored, no make_portable: the default export form (weights pure
    inputs) must match; a ``_stored_weights`` case (weights inputs and initializers, fed other
    values) is recorded as it measures (OpenVINO freezes such an input to its stored value),
    an explicit xfail where wrong."""
    model, inputs, expected = load_case(name)
    tolerance = TOLERANCE[("training", MANIFEST[name]["dtype"])]
    if not name.endswith("_stored_weights"):
        assert_matches(run(model, inputs, OPENVINO_CPU), expected, tolerance, f"{name} as stored on OpenVINO")
        _runtimes.record("openvino-ep", f"corpus/{name}/stored", "pass")
        return
    try:
        assert_matches(run(model, inputs, OPENVINO_CPU), expected, tolerance, f"{name} as stored on OpenVINO")
    except AssertionError as error:
        _runtimes.record("openvino-ep", f"corpus/{name}/stored", f"lacks {FED_WEIGHTS_IGNORED}")
        pytest.xfail(f"{FED_WEIGHTS_IGNORED}: {str(error).splitlines()[1][:200]}")
    except Exception as error:  # noqa: BLE001 (the OneHot defect, which --portable rewrites)
        if "Output names mismatch" not in str(error):
            raise
        _runtimes.record("openvino-ep", f"corpus/{name}/stored", f"lacks {ONEHOT_DEFECT}")
        pytest.xfail(ONEHOT_DEFECT)
    _runtimes.record("openvino-ep", f"corpus/{name}/stored", "pass")


ONEHOT_DEFECT = "OneHot with a run-time depth next to a folded constant ('Output names mismatch'; --portable rewrites it)"
FED_WEIGHTS_IGNORED = "fed values of inputs that are also initializers (the stored value is used: wrong values)"
