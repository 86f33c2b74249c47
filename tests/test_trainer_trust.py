"""A step you can trust (issues 19 and 24): in-place updates sound for the graph onnxruntime
runs, steps that fail or meet a non-finite loss leave the state bitwise unchanged, batches,
learning rates and step graphs checked before anything runs."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import normgrad
from normgrad import checkpoint
from normgrad.graphs import build_step_graph, build_training_graph
from normgrad.graphs.optimizers import hyperparameter_feeds
from normgrad.ops import IR_VERSION
from normgrad.train import Trainer, TrainerError

from _artifacts import LABELS, X, export_sgd, frozen_base_step
from _graph_models import two_layer_model
from _helpers import cpp_available
from _trainer_graphs import _linear_tanh_linear, _mse_batch, _options, _step

LEVELS = [ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
          ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, ort.GraphOptimizationLevel.ORT_ENABLE_ALL]


def _session_step(step, state, batch, lr, number, level):
    session = ort.InferenceSession(step.SerializeToString(), normgrad.session_options("cpp", _options(level)),
                                   providers=["CPUExecutionProvider"])
    state_map = json.loads({e.key: e.value for e in step.metadata_props}["normgrad.state"])
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, {
        **hyperparameter_feeds(step), **batch, **state, "lr": np.array(lr, np.float32), "step": np.array(number, np.float32)})))
    return {name: outputs[next_name] for name, next_name in state_map.items()}


def _snapshot(trainer):
    return {name: value.tobytes() for name, value in trainer.state_dict().items()}, trainer.step_count


# -- 19.1: in-place updates sound for the graph onnxruntime runs ---------------------------------

@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name)
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_in_place_updates_survive_transpose_elimination(level, kind):
    """From ORT_ENABLE_BASIC up onnxruntime removes Transpose(Transpose(W)), so the backward
    MatMul reads W itself; updating W in place before that read gave a.weight 3e-3 off."""
    step, initial = _step(kind=kind)
    trainer = Trainer(step, initial, lr=0.1, session_options=_options(level))
    batch = _mse_batch()
    trainer.step(**batch)
    expected = _session_step(step, initial, batch, 0.1, 1, level)
    for name, value in trainer.state_dict().items():
        np.testing.assert_allclose(value, expected[name], rtol=0, atol=1e-6 * np.abs(expected[name]).max(), err_msg=name)


def test_aliasing_ops_count_as_reads():
    """A reader of Reshape(s) (or a chain of such views) reads s's buffer."""
    from normgrad.graphs.structure import in_place_updates

    value_info = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
    shape = helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(np.array([3], np.int64)))

    def graph(nodes):
        return helper.make_graph([shape] + nodes, "g", [value_info("s", [3]), value_info("g", [3])],
                                 [value_info("s.next", [3]), value_info("other", [3])])

    views = [helper.make_node("Reshape", ["s", "shape"], ["view"]), helper.make_node("Identity", ["view"], ["view2"])]
    update = [helper.make_node("Sub", ["view2", "g"], ["d"]), helper.make_node("Add", ["s", "d"], ["s.next"])]
    # the Reshape node precedes the write, but Neg reads its output (s's buffer) at any time
    late_view_reader = views + update + [helper.make_node("Neg", ["view2"], ["other"])]
    assert in_place_updates(graph(late_view_reader), {"s": "s.next"}) == set()
    early_view_reader = views + [helper.make_node("Neg", ["view2"], ["other"]),
                                 helper.make_node("Add", ["s", "other"], ["s.next"])]
    assert in_place_updates(graph(early_view_reader), {"s": "s.next"}) == {"s"}


# -- 19.3, 24.14, 24.20: batches checked before any run -------------------------------------------

def _ce_trainer(**loss_options):
    step, initial = _step(loss="cross_entropy", kind="adamw", loss_options=loss_options or None)
    return Trainer(step, initial, lr=0.01, session_options=_options())


def _ce_batch(labels):
    x = np.random.default_rng(2).standard_normal((len(labels), 3, 8)).astype(np.float32)
    return {"x": x, "labels": np.array(labels, np.int64)}


@pytest.mark.parametrize("labels,message", [
    ([[0, 1, 2, 0, 0], [1, 2, -1, 0, 0], [0] * 5, [1] * 5], "holds -1; cross_entropy labels must be class indices 0..2"),
    ([[0, 1, 2, 0, 0], [1, 2, 3, 0, 0], [0] * 5, [1] * 5], "holds 3; cross_entropy labels must be class indices 0..2"),
])
def test_labels_out_of_range_are_refused_and_nothing_changes(labels, message):
    trainer = _ce_trainer()
    trainer.step(**_ce_batch([[0, 1, 2, 1, 0]] * 4))
    before = _snapshot(trainer)
    with pytest.raises(TrainerError, match=message):
        trainer.step(**_ce_batch(labels))
    assert _snapshot(trainer) == before


def test_ignore_index_labels_are_accepted():
    trainer = _ce_trainer(ignore_index=-100)
    loss = trainer.step(**_ce_batch([[0, 1, -100, 2, 2], [2] * 5, [0, -100, 0, 1, 1], [1] * 5]))
    assert np.isfinite(loss) and trainer.step_count == 1
    with pytest.raises(TrainerError, match="holds -1; .* 0..2 or the ignore_index -100"):
        trainer.step(**_ce_batch([[0, 1, -1, 0, 0]] * 4))


def test_batch_inputs_sharing_a_dimension_must_agree():
    trainer = _ce_trainer()
    batch = _ce_batch([[0, 1, 2, 0, 0]] * 3)
    batch["x"] = np.concatenate([batch["x"], batch["x"][:1]])
    before = _snapshot(trainer)
    with pytest.raises(TrainerError, match=r"'labels' has 3 along axis 0 and 'x' 4 along axis 0; .* names both 'batch'"):
        trainer.step(**batch)
    assert _snapshot(trainer) == before


def test_batch_inputs_sharing_a_dimension_must_agree_in_each_micro_batch():
    """x [batch, 3] and z [k, batch]: with accumulation each micro-batch splits axis 0 of both,
    so z's batch axis no longer matches x's (the graph may read x's batch size for z's)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]),
             helper.make_node("ReduceSum", ["z", "axis0"], ["zs"], keepdims=1),
             helper.make_node("Transpose", ["zs"], ["zt"], perm=[1, 0]),
             helper.make_node("Add", ["xw", "zt"], ["y"])]
    graph = helper.make_graph(nodes, "two_inputs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
                                                    helper.make_tensor_value_info("z", TensorProto.FLOAT, ["k", "batch"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])],
                              [numpy_helper.from_array(np.ones((3, 1), np.float32), "w"),
                               numpy_helper.from_array(np.array([0], np.int64), "axis0")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)
    step, initial = build_step_graph(build_training_graph(model, loss="mse"), "sgd")
    batch = {"x": np.ones((4, 3), np.float32), "z": np.ones((4, 4), np.float32), "labels": np.ones((4, 1), np.float32)}
    assert np.isfinite(Trainer(step, initial, lr=0.1, session_options=_options()).step(**batch))
    trainer = Trainer(step, initial, lr=0.1, accumulation=2, session_options=_options())
    before = _snapshot(trainer)
    with pytest.raises(TrainerError, match=r"^batch input 'z' \(each micro-batch\) has 4 along axis 1 and 'x' 2 along "
                                           r"axis 0; the step graph names both 'batch', so they must agree$"):
        trainer.step(**batch)
    assert _snapshot(trainer) == before


def test_empty_batch_is_refused():
    trainer = _ce_trainer()
    with pytest.raises(TrainerError, match=r"batch input 'x' is empty \(shape \[0, 3, 8\]\)"):
        trainer.step(**_ce_batch(np.zeros((0, 5), np.int64)))
    assert trainer.step_count == 0


# -- 24.5: learning rates --------------------------------------------------------------------------

@pytest.mark.parametrize("value", [None, float("nan"), float("inf"), 1e39, 10**400, -0.1, "0.1", True])
def test_bad_learning_rates_are_refused_before_the_step(value):
    step, initial = _step()
    trainer = Trainer(step, initial, lr=lambda step: value, session_options=_options())
    before = _snapshot(trainer)
    with pytest.raises(TrainerError, match="the lr schedule returned .* for step 1; a learning rate must be a finite"):
        trainer.step(**_mse_batch())
    assert _snapshot(trainer) == before


# -- 24.22: corrupt step graphs --------------------------------------------------------------------

def test_truncated_step_graph_is_a_trainer_error(tmp_path):
    step, initial = _step()
    data = step.SerializeToString()
    path = tmp_path / "step.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TrainerError, match="is not an ONNX model"):
        Trainer(path, initial)


@pytest.mark.parametrize("key,value", [("normgrad.state", "{not json"), ("normgrad.parameters", '{"a": 1}'),
                                       ("normgrad.data_inputs", '["x", "nope"]'), ("normgrad.state", '{"q": "q.next"}'),
                                       ("normgrad.loss", "[")])
def test_malformed_metadata_is_a_trainer_error(key, value):
    step, initial = _step()
    helper.set_model_props(step, {**{e.key: e.value for e in step.metadata_props}, key: value})
    with pytest.raises(TrainerError, match="corrupt step graph"):
        Trainer(step, initial)


def test_malformed_optimizer_metadata_is_a_trainer_error():
    step, initial = _step()
    helper.set_model_props(step, {**{e.key: e.value for e in step.metadata_props}, "normgrad.optimizer": "{"})
    with pytest.raises(TrainerError, match="corrupt step graph"):
        Trainer(step, initial, accumulation=2)


def test_non_ascii_digit_step_count_is_a_trainer_error():
    step, initial = _step()
    from normgrad import checkpoint

    with pytest.raises(TrainerError, match="must be a step count"):
        Trainer(step, checkpoint.Checkpoint(tensors=initial, metadata={"normgrad.step": "\u00b2"}))


# -- 19.2: transactional steps ---------------------------------------------------------------------

def test_non_finite_loss_raises_and_keeps_the_state():
    step, initial = _step(kind="adamw")
    trainer = Trainer(step, initial, lr=0.01, session_options=_options())
    trainer.step(**_mse_batch(1))
    before = _snapshot(trainer)
    bad = _mse_batch(2)
    bad["x"][1, 2, 3] = np.nan
    with pytest.raises(TrainerError, match="step 2: the loss \\(nan\\) or a gradient is not finite; the state is unchanged"):
        trainer.step(**bad)
    assert _snapshot(trainer) == before and trainer.skipped_steps == 1


@pytest.mark.parametrize("accumulation", [1, 2])
def test_non_finite_steps_can_be_skipped(accumulation):
    """nonfinite='skip': the step is not taken (state, step count, schedule position kept),
    and the next finite step is exactly the step a trainer that never saw the bad batch takes."""
    step, initial = _step(kind="adamw")
    skipping = Trainer(step, initial, lr=0.01, accumulation=accumulation, nonfinite="skip", session_options=_options())
    clean = Trainer(step, initial, lr=0.01, accumulation=accumulation, session_options=_options())
    bad = _mse_batch(2)
    bad["labels"][0, 0, 0] = np.inf
    assert not np.isfinite(skipping.step(**bad))
    assert skipping.step_count == 0 and skipping.skipped_steps == 1
    assert _snapshot(skipping)[0] == _snapshot(clean)[0]
    assert skipping.step(**_mse_batch(3)) == clean.step(**_mse_batch(3))
    assert _snapshot(skipping) == _snapshot(clean)


def _resnet_block_step():
    from normgrad.graphs import examples

    return build_step_graph(build_training_graph(examples.resnet_block(), loss="mse"), "adamw", max_grad_norm=1.0)


def test_a_step_that_raises_after_the_gradient_graph_ran_restores_the_running_statistics():
    """Split (accumulating) trainer: the gradient graph has updated the BatchNorm running
    statistics when the gradient reduction raises; the state is restored bitwise."""
    step, initial = _resnet_block_step()

    class Failing(Trainer):
        fail = False

        def reduce_gradients(self, gradients):
            if self.fail:
                raise RuntimeError("a rank left")
            return gradients

    trainer = Failing(step, initial, lr=0.01, accumulation=2, session_options=_options())
    rng = np.random.default_rng(4)
    batch = lambda: rng.standard_normal((4, 4, 5, 5)).astype(np.float32)
    trainer.step(batch(), batch())
    before = _snapshot(trainer)
    trainer.fail = True
    with pytest.raises(RuntimeError, match="a rank left"):
        trainer.step(batch(), batch())
    assert _snapshot(trainer) == before


def test_gated_updates_are_bitwise_the_step_graph_and_all_in_place():
    """The finiteness gate (every state update waits for the loss and every gradient) changes
    no finite value, and makes every state tensor safe to update in place."""
    step, initial = _resnet_block_step()
    trainer = Trainer(step, initial, lr=0.01, session_options=_options())
    assert trainer._in_place == set(initial)
    rng = np.random.default_rng(4)
    batch = {"x": rng.standard_normal((2, 4, 5, 5)).astype(np.float32),
             "labels": rng.standard_normal((2, 4, 5, 5)).astype(np.float32)}
    trainer.step(**batch)
    expected = _session_step(step, initial, batch, 0.01, 1, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    assert all(trainer.state_dict()[name].tobytes() == expected[name].tobytes() for name in expected)


def test_a_step_onnxruntime_fails_midway_writes_nothing():
    """BatchNorm (running statistics updated in place) before a Reshape that fails for a batch
    of 4 (16 values into rows of 3): onnxruntime raises after the statistics' update could
    run; the state stays bitwise as it was."""
    rng = np.random.default_rng(0)
    initializers = {"scale": rng.uniform(0.5, 1.5, 4), "bias": rng.standard_normal(4) * 0.1, "mean": np.zeros(4),
                    "var": np.ones(4), "w": rng.standard_normal((4, 4)) * 0.5}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("BatchNormalization", ["h", "scale", "bias", "mean", "var"], ["n", "mean_out", "var_out"],
                              training_mode=1),
             helper.make_node("Constant", [], ["rows_of_3"], value=numpy_helper.from_array(np.array([-1, 3], np.int64))),
             helper.make_node("Constant", [], ["rows_of_4"], value=numpy_helper.from_array(np.array([-1, 4], np.int64))),
             helper.make_node("Reshape", ["n", "rows_of_3"], ["r"]), helper.make_node("Relu", ["r"], ["a"]),
             helper.make_node("Reshape", ["a", "rows_of_4"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    model.ir_version = IR_VERSION
    step, initial = build_step_graph(build_training_graph(model, loss="mse"), "adamw")
    assert {"mean", "var"} <= set(initial)
    trainer = Trainer(step, initial, lr=0.01, session_options=_options())
    trainer.step(rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((3, 4)).astype(np.float32))
    before = _snapshot(trainer)
    with pytest.raises(Exception, match="Reshape|reshape"):
        trainer.step(rng.standard_normal((4, 4)).astype(np.float32), rng.standard_normal((4, 4)).astype(np.float32))
    assert _snapshot(trainer) == before


# -- issue 31: the gate inside every update, no per-tensor Where -----------------------------------

OPTIMIZER_SETUPS = {
    "sgd": ("sgd", {}), "sgd_weight_decay": ("sgd", dict(weight_decay=0.01)),
    "sgd_momentum_dampening": ("sgd", dict(momentum=0.9, dampening=0.3)),
    "sgd_nesterov": ("sgd", dict(momentum=0.9, nesterov=True, weight_decay=0.01)),
    "sgd_clipping": ("sgd", dict(momentum=0.8, max_grad_norm=0.5)),
    "adam": ("adam", dict(weight_decay=0.01)), "adamw": ("adamw", dict(weight_decay=0.1, max_grad_norm=1.0)),
    "amsgrad": ("adam", dict(amsgrad=True, weight_decay=0.01)),
    "adamw_amsgrad_no_weight_decay": ("adamw", dict(amsgrad=True, weight_decay=0.1, no_weight_decay=["*bias*", "t*"])),
}


def _gate_model_step(model, setup):
    from normgrad.graphs import examples

    kind, options = OPTIMIZER_SETUPS[setup]
    if model == "batch_norm":
        forward = examples.resnet_block()
        options = {**options, "no_weight_decay": ["b1", "t*"]} if "no_weight_decay" in options else options
    else:
        forward = _linear_tanh_linear()
        options = {**options, "no_weight_decay": ["*.bias"]} if "no_weight_decay" in options else options
    step, initial = build_step_graph(build_training_graph(forward, loss="mse"), kind, **options)
    if model == "batch_norm":
        rng = np.random.default_rng(4)
        batch = lambda: {"x": rng.standard_normal((2, 4, 5, 5)).astype(np.float32),  # noqa: E731
                         "labels": rng.standard_normal((2, 4, 5, 5)).astype(np.float32)}
    else:
        seeds = iter(range(10, 100))
        batch = lambda: _mse_batch(next(seeds))  # noqa: E731
    return step, initial, batch


@pytest.mark.parametrize("kernels", ["auto", None], ids=["kernels", "function_bodies"])
@pytest.mark.parametrize("model", ["mlp", "batch_norm"])
@pytest.mark.parametrize("setup", OPTIMIZER_SETUPS)
def test_a_non_finite_step_keeps_every_state_tensor_bitwise(setup, model, kernels):
    """Every optimizer setup, with BatchNorm running statistics: the updates take the gate
    themselves; a NaN in the batch leaves every state tensor (weights, moments, buffers,
    running statistics) bitwise as it was, and the next step is the clean trainer's."""
    step, initial, batch = _gate_model_step(model, setup)
    skipping = Trainer(step, initial, lr=0.05, nonfinite="skip", kernels=kernels, session_options=_options())
    clean = Trainer(step, initial, lr=0.05, kernels=kernels, session_options=_options())
    for _ in range(2):
        good = batch()
        skipping.step(**good)
        clean.step(**good)
    before = _snapshot(skipping)
    bad = batch()
    bad["x"].flat[7] = np.nan
    assert not np.isfinite(skipping.step(**bad))
    assert _snapshot(skipping) == before and skipping.skipped_steps == 1
    good = batch()
    assert skipping.step(**good) == clean.step(**good)
    assert _snapshot(skipping)[0] == _snapshot(clean)[0]


@pytest.mark.skipif(not cpp_available(), reason="needs the C++ library")
@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name)
@pytest.mark.parametrize("setup", ["sgd_nesterov", "sgd", "adamw", "amsgrad"])
def test_the_graph_onnxruntime_runs_has_no_where_gate_and_updates_in_place(setup, level):
    """The graph onnxruntime runs (optimized at each level, as the Trainer inspects it): every
    state update is written by an update node that takes the gate (AdamUpdate, SGDUpdate;
    GatedUpdate for the running statistics), no Where; every state tensor is updated in place."""
    from normgrad._session import APPLIED, _gate_state_updates, _session_and_running_graph
    from normgrad.graphs.step_graph import expose_forward_outputs, forward_outputs

    step, initial, _ = _gate_model_step("batch_norm", setup)
    trainer = Trainer(step, initial, lr=0.05, session_options=_options(level))
    assert trainer._in_place == set(initial)
    state = trainer._state_map
    gated = _gate_state_updates(expose_forward_outputs(step, forward_outputs(step)), state,
                                [f"{p}_grad" for p in trainer.parameters], "loss")
    _, running = _session_and_running_graph(ort, gated, normgrad.session_options("cpp", _options(level)),
                                            ["CPUExecutionProvider"])
    producers = {name: node for node in running.graph.node for name in node.output}
    writers = {producers[next_name].op_type for next_name in state.values()}
    expected = {"sgd": {"SGDUpdate"}}.get(OPTIMIZER_SETUPS[setup][0], {"AdamUpdate"}) | {"GatedUpdate"}
    assert writers == expected
    assert all(APPLIED in producers[next_name].input for next_name in state.values())
    gate_where = [n.name for n in running.graph.node if n.op_type == "Where" and APPLIED in n.input]
    assert not gate_where


def test_eval_model_external_data_outside_its_folder_is_refused(tmp_path):
    step, ckpt = frozen_base_step(tmp_path / "run" if (tmp_path / "run").mkdir() is None else None)
    (tmp_path / "secret.bin").write_bytes(b"\0" * 4096)
    evaluation = onnx.load(tmp_path / "run" / "step.eval.onnx", load_external_data=False)
    for tensor in evaluation.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../secret.bin"
    onnx.save(evaluation, tmp_path / "run" / "bad.eval.onnx")
    with pytest.raises(TrainerError, match=r"evaluation graph: .*'\.\./secret\.bin' is not a plain relative path"):
        Trainer(step, ckpt, kernels=None, eval_model=tmp_path / "run" / "bad.eval.onnx")


def test_a_cut_short_frozen_base_is_one_trainer_error(tmp_path, capfd):
    step, ckpt = frozen_base_step(tmp_path)
    data = tmp_path / "forward.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(TrainerError, match=r"forward\.onnx\.data holds 1000 bytes; tensor 'w1' needs .*cut short"):
        Trainer(step, ckpt, kernels=None)
    assert capfd.readouterr().err == ""  # no onnxruntime log


def test_a_4bit_external_tensor_is_two_elements_to_a_byte(tmp_path):
    """onnx stores INT4/UINT4 packed two to a byte: an external one of 5 elements holds 3
    bytes, which the extent check accepts, and 2 are cut short."""
    from normgrad.util.external_data import ExternalDataError, external_data_extent

    (tmp_path / "w.data").write_bytes(bytes(3))
    tensor = TensorProto(name="w", data_type=TensorProto.UINT4, dims=[5])
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "w.data"), ("offset", "0"), ("length", "3")):
        tensor.external_data.add(key=key, value=value)
    assert external_data_extent(tensor, tmp_path)[1:] == (0, 3)
    tensor.external_data[2].value = "2"
    with pytest.raises(ExternalDataError, match=r"needs 3 bytes"):
        external_data_extent(tensor, tmp_path)


@pytest.mark.parametrize("key, value, rule", [
    ("normgrad.dropout", '{"seed": "abc"}', "int64 'seed'"),
    ("normgrad.loss", '{"kind": "mse"}', "string 'kind' and 'output'"),
    ("normgrad.forward_outputs", "5", "a list of names"),
    ("normgrad.parameters", "[1, 2]", "a list of names"),
    ("normgrad.state", "{not json", "not JSON"),
])
def test_malformed_step_graph_metadata_is_one_trainer_error(tmp_path, key, value, rule):
    onnx.save(two_layer_model(), tmp_path / "forward.onnx")
    assert export_sgd(tmp_path / "forward.onnx", tmp_path / "s.onnx") == 0
    model = onnx.load(tmp_path / "s.onnx")
    helper.set_model_props(model, {**{e.key: e.value for e in model.metadata_props}, key: value})
    with pytest.raises(TrainerError, match=f"corrupt step graph: metadata {key} .*{rule}"):
        Trainer(model, tmp_path / "s.ckpt", kernels=None)
    with pytest.raises(TrainerError, match=f"corrupt evaluation graph: metadata {key}"):
        onnx.save(model, tmp_path / "bad.eval.onnx")
        Trainer(tmp_path / "s.onnx", tmp_path / "s.ckpt", kernels=None, eval_model=tmp_path / "bad.eval.onnx")


@pytest.mark.parametrize("lr", [True, "0.1", float("nan"), -1.0])
def test_a_learning_rate_that_is_no_number_is_refused_at_construction(tmp_path, lr):
    onnx.save(two_layer_model(), tmp_path / "forward.onnx")
    assert export_sgd(tmp_path / "forward.onnx", tmp_path / "s.onnx") == 0
    with pytest.raises(TrainerError, match=r"lr.*a learning rate must be a finite number >= 0"):
        Trainer(tmp_path / "s.onnx", tmp_path / "s.ckpt", lr=lr, kernels=None)


def test_lr_none_is_the_step_graphs_own_learning_rate(tmp_path):
    onnx.save(two_layer_model(), tmp_path / "forward.onnx")
    assert export_sgd(tmp_path / "forward.onnx", tmp_path / "s.onnx") == 0
    default = Trainer(tmp_path / "s.onnx", tmp_path / "s.ckpt", lr=None, kernels=None)
    stored = default.hyperparameters["lr"]
    explicit = Trainer(tmp_path / "s.onnx", tmp_path / "s.ckpt", lr=stored, kernels=None)
    assert default.step(X, LABELS) == explicit.step(X, LABELS)
    for name, value in default.state_dict().items():
        np.testing.assert_array_equal(value, explicit.state_dict()[name], err_msg=name)


@pytest.mark.parametrize("seed", [str(2**63), str(-2**63 - 1), "1e3"])
def test_a_checkpoint_seed_outside_int64_is_refused(tmp_path, seed):
    onnx.save(two_layer_model(), tmp_path / "forward.onnx")
    assert export_sgd(tmp_path / "forward.onnx", tmp_path / "s.onnx") == 0
    state = checkpoint.load(tmp_path / "s.ckpt").tensors
    checkpoint.save(tmp_path / "bad.ckpt", state, {"normgrad.dropout_seed": seed})
    with pytest.raises(TrainerError, match="normgrad.dropout_seed must be an integer in the int64 range"):
        Trainer(tmp_path / "s.onnx", tmp_path / "bad.ckpt", kernels=None)
    trainer = Trainer(tmp_path / "s.onnx", tmp_path / "s.ckpt", kernels=None)
    with pytest.raises(TrainerError, match="int64 range"):
        trainer.load(tmp_path / "bad.ckpt")
    trainer.step(X, LABELS)  # the process and the trainer go on
