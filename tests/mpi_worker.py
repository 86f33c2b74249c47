"""Programs the MPI tests launch under ``mpirun -n N`` (tests/test_mpi.py): each checks
what it computes on every rank and raises on a mismatch (which aborts the whole job).

    python tests/mpi_worker.py allreduce      AllReduce kernels against the reference
    python tests/mpi_worker.py train sync|local  data-parallel ResNet block training against
                                              one process on the global batch / DDP semantics
    python tests/mpi_worker.py trainer DIR    normgrad.mpi.DataParallelTrainer against a
                                              one-process Trainer on the global batch
    python tests/mpi_worker.py raise RANK     RANK raises after MPI is up; the others wait
    python tests/mpi_worker.py exit RANK      RANK calls sys.exit(3); the others wait
    python tests/mpi_worker.py systemexit RANK  RANK raises SystemExit(3); the others wait
    python tests/mpi_worker.py leave RANK     RANK's program ends normally; the others wait
    python tests/mpi_worker.py unconfigured   AllReduce kernels without mpi.init() refuse to run
    python tests/mpi_worker.py sizes|differ   DataParallelTrainer refuses unequal batches / step graphs
    python tests/mpi_worker.py hang RANK SECONDS  RANK hangs; the others time out naming it
    python tests/mpi_worker.py die RANK       RANK is killed by SIGKILL; the others wait
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import ml_dtypes
import numpy as np

from normgrad import mpi
from normgrad.ops import all_reduce, harness
from normgrad.graphs.optimizers import hyperparameter_feeds

TOLERANCE = {np.dtype(np.float16): 2e-3, np.dtype(ml_dtypes.bfloat16): 1.6e-2}


def _bits(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def check_allreduce() -> None:
    comm = mpi.comm()
    assert mpi.configured_size() == mpi.size(), (mpi.configured_size(), mpi.size())
    rng = np.random.default_rng(100 + mpi.rank())
    # sizes below, at and across the chunking (one element, fewer elements than ranks, odd
    # lengths) and across one 2**22-element segment boundary
    shapes = [(), (0,), (1,), (3, 5), (2, 1000)]
    for dtype in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16):
        for shape in shapes + ([(2**22 + 7,)] if dtype == np.float32 else []):
            value = (rng.normal(size=shape) * 3).astype(dtype)
            everyone = comm.allgather(value)
            expected = all_reduce.reference(*everyone).output
            # "python": what the Python kernel runs (importing onnxruntime-extensions on
            # every rank would cost more than this whole check)
            for backend in ("cpp", "python"):
                if backend == "cpp":
                    runs = [harness.run("cpp", "AllReduce", {"input": value})["output"] for _ in range(2)]
                else:
                    runs = [all_reduce.python_kernel(value).output for _ in range(2)]
                got = runs[0]
                assert got.dtype == np.dtype(dtype) and got.shape == value.shape, (backend, got.dtype, got.shape)
                assert _bits(runs[1]) == _bits(got), f"{backend} {dtype} {shape}: two runs differ"
                if np.dtype(dtype) in TOLERANCE:
                    scale = max(1.0, float(np.abs(expected.astype(np.float64)).max())) if value.size else 1.0
                    error = float(np.abs(got.astype(np.float64) - expected.astype(np.float64)).max()) if value.size else 0.0
                    assert error <= TOLERANCE[np.dtype(dtype)] * scale, f"{backend} {dtype} {shape}: error {error}"
                else:  # float64 sum in rank order rounded once: the reference's bits
                    assert _bits(got) == _bits(expected), f"{backend} {dtype} {shape}: not the reference's bits"
                others = comm.allgather(_bits(got))
                assert all(bits == others[0] for bits in others), f"{backend} {dtype} {shape}: ranks differ"
    # broadcast: rank 0's values, dtypes and shapes everywhere (a scalar and bfloat16 included)
    mine = {"w": rng.normal(size=(2, 3)).astype(np.float32), "step": np.array(mpi.rank() + 5.0),
            "h": rng.normal(size=4).astype(ml_dtypes.bfloat16)}
    got = mpi.broadcast(mine)
    root = comm.bcast(mine, root=0)
    for name, value in root.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert _bits(got[name]) == _bits(value), f"broadcast {name}"
    try:
        mpi.shard(np.arange(mpi.size() + 1))
    except ValueError as error:
        assert f"{mpi.size() + 1} samples along axis 0 cannot be split evenly over {mpi.size()} ranks" in str(error)
    else:
        raise AssertionError("shard split an uneven batch")
    np.testing.assert_array_equal(mpi.shard(np.arange(2 * mpi.size())), [2 * mpi.rank(), 2 * mpi.rank() + 1])
    if mpi.rank() == 0:
        print(f"allreduce ok on {mpi.size()} ranks")


# ---------------------------------------------------------------------------------- training

PER_RANK_BATCH = 2
STEPS = 3
LR, MOMENTUM = 0.1, 0.9
TOLERANCE_OF_SCALE = 1e-5


def resnet_model():
    from normgrad.graphs import examples

    return examples.resnet_block(batch="N")


def _session(model, options=None):
    import onnxruntime

    return onnxruntime.InferenceSession(model.SerializeToString(), options or mpi.session_options(),
                                        providers=["CPUExecutionProvider"])


def _run(session, feeds) -> dict:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


def _truth_gradients(model, params: dict, x: np.ndarray, labels: np.ndarray):
    """float64 loss and parameter gradients of the MSE-loss block on one batch (BatchNorm over
    that batch): torch autograd when torch is installed, else normgrad's float64 evaluation of
    the single-process training graph (onnx ReferenceEvaluator + NumPy references)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        from normgrad.graphs import build_training_graph
        from normgrad.tools.corpus import float64_outputs

        outputs = float64_outputs(build_training_graph(model, loss="mse").model, {"x": x, "labels": labels, **params})
        return float(outputs["loss"]), {name: outputs[f"{name}_grad"] for name in params}
    p = {name: torch.tensor(value, dtype=torch.float64, requires_grad=True) for name, value in params.items()}
    xt = torch.tensor(x, dtype=torch.float64)
    bn = lambda value, i: F.batch_norm(value, None, None, p[f"s{i}"], p[f"t{i}"], training=True, eps=1e-5)  # noqa: E731
    hidden = torch.relu(bn(F.conv2d(xt, p["w1"], p["b1"], padding=1), 1))
    y = torch.relu(bn(F.conv2d(hidden, p["w2"], padding=1), 2) + xt)
    loss = ((y - torch.tensor(labels, dtype=torch.float64)) ** 2).mean()
    loss.backward()
    return float(loss.detach()), {name: p[name].grad.numpy() for name in params}


def _relative_error(actual, expected) -> float:
    """max |actual - expected| over the tensors of a dict (or one tensor), relative to the
    largest |expected| among them: b1's gradient is ~0 (BatchNorm follows the bias), so
    each tensor's own scale would be rounding noise."""
    if not isinstance(expected, dict):
        actual, expected = {"": actual}, {"": expected}
    scale = max(float(np.abs(np.asarray(v, np.float64)).max()) for v in expected.values())
    error = max(float(np.abs(np.asarray(actual[k], np.float64) - np.asarray(v, np.float64)).max())
                for k, v in expected.items())
    return error / max(scale, 1e-30)


def check_training(mode: str) -> None:
    """2 ranks x batch B against one process x batch 2B (sync) or per-rank BatchNorm with
    averaged gradients (local, torch DDP's semantics): loss, gradients, and the weights after
    STEPS SGD-with-momentum steps, within TOLERANCE_OF_SCALE of their scale; every rank
    bitwise the same weights."""
    from normgrad.graphs import build_step_graph, build_training_graph

    sync = mode == "sync"
    comm, ranks = mpi.comm(), mpi.size()
    model = resnet_model()
    training = build_training_graph(model, loss="mse", data_parallel=True, sync_batch_norm=sync)
    plain = build_training_graph(model, loss="mse")
    rng = np.random.default_rng(7)
    global_batch = PER_RANK_BATCH * ranks
    batches = [(rng.normal(size=(global_batch, 4, 5, 5)).astype(np.float32),
                rng.normal(size=(global_batch, 4, 5, 5)).astype(np.float32)) for _ in range(STEPS)]
    step_model, initial = build_step_graph(training, "sgd", momentum=MOMENTUM)
    state = mpi.broadcast(initial)
    params = {name: state[name] for name in ("w1", "w2", "b1", "s1", "t1", "s2", "t2")}

    def truth(params64, x, labels):
        if sync:
            return _truth_gradients(model, params64, x, labels)
        parts = [slice(r * PER_RANK_BATCH, (r + 1) * PER_RANK_BATCH) for r in range(ranks)]
        shards = [_truth_gradients(model, params64, x[part], labels[part]) for part in parts]
        return (float(np.mean([loss for loss, _ in shards])),
                {name: np.mean([grads[name] for _, grads in shards], axis=0) for name in params64})

    errors = {}
    # 1. loss and gradients of one training-graph run
    x, labels = batches[0]
    got = _run(_session(training.model), {"x": mpi.shard(x), "labels": mpi.shard(labels), **params})
    true_loss, true_grads = truth({k: v.astype(np.float64) for k, v in params.items()}, x, labels)
    errors["loss vs truth"] = _relative_error(got["loss"], true_loss)
    gradients = {n: got[f"{n}_grad"] for n in params}
    errors["gradients vs truth"] = _relative_error(gradients, true_grads)
    if sync:  # the same graph engine on one process and the global batch
        single = _run(_session(plain.model, mpi.session_options()), {"x": x, "labels": labels, **params})
        errors["loss vs 1 process"] = _relative_error(got["loss"], single["loss"])
        errors["gradients vs 1 process"] = _relative_error(gradients, {n: single[f"{n}_grad"] for n in params})
        # control: per-rank statistics are measurably different, so the comparison can fail
        local = build_training_graph(model, loss="mse", data_parallel=True)
        local_grads = _run(_session(local.model), {"x": mpi.shard(x), "labels": mpi.shard(labels), **params})
        control = _relative_error({n: local_grads[f"{n}_grad"] for n in params}, {n: single[f"{n}_grad"] for n in params})
        assert control > 1e-3, f"per-rank BatchNorm gradients match the global batch's ({control:.2e}): no test"

    # 2. STEPS optimizer steps of the step graph
    session = _session(step_model)
    meta = {p.key: json.loads(p.value) for p in step_model.metadata_props}
    truth_params = {k: v.astype(np.float64) for k, v in params.items()}
    buffers = {}
    single_state = dict(state)
    single_session = _session(build_step_graph(plain, "sgd", momentum=MOMENTUM)[0]) if sync else None
    for step, (x, labels) in enumerate(batches, start=1):
        feeds = {**hyperparameter_feeds(step_model), "lr": np.array(LR, np.float32), "step": np.array(step, np.float32)}
        out = _run(session, {**state, "x": mpi.shard(x), "labels": mpi.shard(labels), **feeds})
        state = {name: out[meta["normgrad.state"][name]] for name in state}
        if sync:
            out1 = _run(single_session, {**single_state, "x": x, "labels": labels, **feeds})
            single_state = {name: out1[meta["normgrad.state"][name]] for name in single_state}
        _, grads = truth(truth_params, x, labels)
        for name, grad in grads.items():  # torch.optim.SGD(momentum) in float64
            buffers[name] = grad if step == 1 else MOMENTUM * buffers[name] + grad
            truth_params[name] = truth_params[name] - LR * buffers[name]
    errors["weights vs truth"] = max(_relative_error(state[n], truth_params[n]) for n in params)
    if sync:
        errors["weights vs 1 process"] = max(_relative_error(state[n], single_state[n]) for n in params)
    # without sync BatchNorm the running statistics are each rank's own (as in torch DDP)
    running = set(meta.get("normgrad.running_statistics", [])) if not sync else set()
    assert sync or running, "the step graph should carry running statistics"
    everyone = comm.allgather(b"".join(_bits(state[n]) for n in sorted(state) if n not in running))
    assert all(bits == everyone[0] for bits in everyone), "ranks hold different weights after the steps"
    worst = {name: max(comm.allgather(error)) for name, error in errors.items()}
    bad = {name: error for name, error in worst.items() if not error <= TOLERANCE_OF_SCALE}
    assert not bad, f"{mode}: errors above {TOLERANCE_OF_SCALE} of scale: {bad}"
    if mpi.rank() == 0:
        import hashlib

        digest = hashlib.sha256(everyone[0]).hexdigest()[:16]
        print(f"train {mode} ok on {ranks} ranks: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
        print(f"state digest {digest}")


def check_trainer(folder: str) -> None:
    """DataParallelTrainer (2 ranks x batch B, sync BatchNorm) against normgrad.train.Trainer
    (1 process x batch 2B): losses and the whole state (weights, momentum buffers, running
    statistics) after STEPS steps within TOLERANCE_OF_SCALE; rank 0's differing initial
    weights win; a checkpoint saved by rank 0 is complete when save() returns on every rank."""
    import pathlib

    from normgrad import checkpoint
    from normgrad.graphs import build_step_graph, build_training_graph
    from normgrad.train import Trainer, TrainerError

    comm, ranks = mpi.comm(), mpi.size()
    folder = pathlib.Path(folder)
    model = resnet_model()
    parallel, initial = build_step_graph(build_training_graph(model, loss="mse", data_parallel=True,
                                                              sync_batch_norm=True), "sgd", momentum=MOMENTUM)
    single, _ = build_step_graph(build_training_graph(model, loss="mse"), "sgd", momentum=MOMENTUM)
    for graph, options, refusal in ((single, {}, "does not average gradients over them"),
                                    (parallel, {"kernels": None}, "needs normgrad's C++ kernels")):
        try:
            mpi.DataParallelTrainer(graph, initial, **options)
        except TrainerError as error:
            assert refusal in str(error), error
        else:
            raise AssertionError(f"DataParallelTrainer accepted {options or 'a graph without --data-parallel'}")
    # every rank but 0 starts from other weights: the trainer must replace them with rank 0's
    mine = {name: value + np.float32(mpi.rank()) for name, value in initial.items()}
    trainer = mpi.DataParallelTrainer(parallel, mine, lr=LR)
    reference = Trainer(single, initial, lr=LR)
    rng = np.random.default_rng(11)
    losses = []
    for _ in range(STEPS):
        x = rng.normal(size=(PER_RANK_BATCH * ranks, 4, 5, 5)).astype(np.float32)
        labels = rng.normal(size=x.shape).astype(np.float32)
        losses.append((trainer.step(mpi.shard(x), mpi.shard(labels)), reference.step(x, labels)))
    errors = {"losses": max(_relative_error(a, b) for a, b in losses),
              "state": _relative_error(trainer.state_dict(), reference.state_dict())}
    running = [name for name in initial if name.startswith(("m", "v")) and len(name) == 2]
    assert running and all(not np.array_equal(trainer.state_dict()[n], initial[n]) for n in running), running
    path = folder / "state.ckpt"
    trainer.save(path)
    saved = checkpoint.load(path)  # every rank: rank 0 wrote it before save() returned
    assert all(_bits(saved.tensors[n]) == _bits(v) for n, v in trainer.state_dict().items())
    trainer.load(path)
    worst = {name: max(comm.allgather(error)) for name, error in errors.items()}
    bad = {name: error for name, error in worst.items() if not error <= TOLERANCE_OF_SCALE}
    assert not bad, f"trainer: errors above {TOLERANCE_OF_SCALE} of scale: {bad}"
    if mpi.rank() == 0:
        print(f"trainer ok on {ranks} ranks: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))


def wait_then_fail(mode: str, victim: int) -> None:
    """Rank ``victim`` fails; every other rank blocks in a collective it can never finish."""
    mpi.barrier()
    if mpi.rank() == victim:
        time.sleep(0.5)
        if mode == "raise":
            raise RuntimeError("deliberate failure for the test")
        if mode == "exit":
            sys.exit(3)
        if mode == "systemexit":
            raise SystemExit(3)
        if mode == "leave":
            return  # a normal end of the program while the other rank still runs
        os.kill(os.getpid(), signal.SIGKILL)
    mpi.comm().allreduce(1)  # the victim never joins
    time.sleep(600)


def _mlp_step(momentum: float = 0.9):
    """A data-parallel SGD step graph of x [N, 4] @ W + b (N dynamic), mse loss."""
    import onnx
    import onnx.helper as oh

    from normgrad.graphs import build_step_graph, build_training_graph

    rng = np.random.default_rng(0)
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "W"], ["h"]), oh.make_node("Add", ["h", "b"], ["y"])], "mlp",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 3])],
        initializer=[onnx.numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W"),
                     onnx.numpy_helper.from_array(np.zeros(3, np.float32), "b")])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return build_step_graph(build_training_graph(model, loss="mse", data_parallel=True), "sgd", momentum=momentum)


def check_unconfigured() -> None:
    """Without mpi.init() in a 2-rank job: the C++ AllReduce kernel fails naming
    normgrad.mpi.init(); the Python kernel reports it and returns NaN (it cannot raise)."""
    import onnxruntime

    import normgrad
    from normgrad.ops import python_kernels

    assert mpi.launched_ranks() == 2 and not mpi.initialized()
    model, initial = _mlp_step()
    rng = np.random.default_rng(mpi.launched_ranks())
    feeds = {**hyperparameter_feeds(model), **initial, "x": rng.standard_normal((2, 4)).astype(np.float32),
             "labels": rng.standard_normal((2, 3)).astype(np.float32),
             "lr": np.array(0.1, np.float32), "step": np.array(1, np.float32)}
    session = onnxruntime.InferenceSession(model.SerializeToString(), normgrad.session_options("cpp"))
    try:
        session.run(None, feeds)
    except Exception as error:  # noqa: BLE001 - onnxruntime's Fail
        assert "normgrad.mpi.init()" in str(error) and "one of 2 MPI ranks" in str(error), error
    else:
        raise AssertionError("the C++ AllReduce ran unconfigured in a 2-rank job")
    # the Python kernels take normgrad nodes with every input present (SGDUpdate's optional ones)
    bridged = normgrad.prepare_for_python_kernels(model)
    session = onnxruntime.InferenceSession(bridged.SerializeToString(), normgrad.session_options("python"))
    loss = session.run(["loss"], feeds)[0]
    assert np.isnan(loss) and any("normgrad.mpi.init()" in e for e in python_kernels.errors()), python_kernels.errors()
    print("unconfigured ok")


def check_rank_mismatches(kind: str) -> None:
    """sizes: rank 0 passes 4 samples, rank 1 3; differ: rank 1's step graph has another
    momentum; options: rank 1 alone gives the Trainer a weight decay and a momentum schedule.
    Each: a TrainerError on every rank naming what differs."""
    from normgrad.train import TrainerError

    model, initial = _mlp_step(0.5 if kind == "differ" and mpi.rank() == 1 else 0.9)
    try:
        options = {"weight_decay": 0.01, "momentum": lambda step: 0.5} if kind == "options" and mpi.rank() == 1 else {}
        trainer = mpi.DataParallelTrainer(model, initial, lr=0.1, **options)
        n = 4 if mpi.rank() == 0 else 3
        if kind == "sizes":
            trainer.step(np.ones((n, 4), np.float32), np.ones((n, 3), np.float32))
    except TrainerError as error:
        wanted = {"sizes": "rank 0: 4, rank 1: 3", "differ": "ranks [1] run another step graph",
                  "options": "ranks [1] run another option weight_decay than rank 0 (rank 0: None, rank 1: 0.01)"}[kind]
        assert wanted in str(error), error
        print(f"{kind} ok on rank {mpi.rank()}: {error}")
        return
    raise AssertionError(f"{kind}: no error")


def check_fit(folder: str) -> None:
    """normgrad.loop.fit on a DataParallelTrainer, each rank passing its shard of the training
    and validation batches, with a metric, early stopping and checkpoints in one shared
    folder: every rank ends with the same history and evaluation records (taken from all
    the shards together: a record from one shard would let the ranks disagree on the best
    checkpoint or the stop, and hang); the final record's loss and metric are the float64
    ones of the whole validation set at the trained weights; rank 0 alone wrote the files."""
    from normgrad import loop, metrics

    model, initial = _mlp_step()
    trainer = mpi.DataParallelTrainer(model, initial, lr=0.05)
    rng = np.random.default_rng(11)
    target = rng.standard_normal((4, 3))

    def batches(count):
        x = [rng.standard_normal((8, 4)).astype(np.float32) for _ in range(count)]
        return [(xb, (xb @ target + 0.1 * rng.standard_normal((8, 3))).astype(np.float32)) for xb in x]

    train, validation = batches(6), batches(3)
    shards = lambda pairs: [(mpi.shard(x), mpi.shard(y)) for x, y in pairs]  # noqa: E731
    mae = lambda outputs, labels: float(np.mean(np.abs(outputs - labels)))  # noqa: E731
    result = loop.fit(trainer, shards(train), epochs=4, evaluation=shards(validation), metrics={"mae": mae},
                      output="y", checkpoint_dir=folder, log_dir=os.path.join(folder, "logs"), progress=False,
                      callbacks=[loop.EarlyStopping(monitor="val_mae", patience=1)])
    records = mpi.gather((result.history, result.evaluations), "the fit results")
    assert all(r == records[0] for r in records), records
    final = metrics.evaluate(trainer, shards(validation), {"mae": mae}, output="y")
    weights = {name: value.astype(np.float64) for name, value in trainer.state_dict().items()}
    x = np.concatenate([x for x, _ in validation]).astype(np.float64)
    y = np.concatenate([y for _, y in validation]).astype(np.float64)
    predicted = x @ weights["W"] + weights["b"]
    truth = {"val_loss": float(np.mean((predicted - y) ** 2)), "val_mae": float(np.mean(np.abs(predicted - y)))}
    for name, value in truth.items():
        assert abs(final[name] - value) <= 1e-5 * abs(value), (name, final[name], value)
    mpi.gather(None, "the files' check")
    if mpi.rank() == 0:
        names = sorted(os.listdir(folder))
        assert any(n.startswith("best-") for n in names) and os.path.exists(os.path.join(folder, "logs", "metrics.csv")), names
        assert not [n for n in names if ".tmp" in n or n.startswith(".")], names
    print(f"fit ok on rank {mpi.rank()}: {len(result.history)} steps, {len(result.evaluations)} evaluations")


def check_unequal_shards(folder: str, ends_with: str) -> None:
    """normgrad.loop.fit with rank 0 holding 3 training batches and rank 1 2, each epoch
    ending in ``ends_with``: an evaluation, a checkpoint, both or neither: a TrainerError on every
    rank naming the ranks and the steps they came to (rank 1's batches ran out after step 2),
    never another collective's message read as a step's."""
    from normgrad import loop
    from normgrad.train import TrainerError

    model, initial = _mlp_step()
    trainer = mpi.DataParallelTrainer(model, initial, lr=0.05)
    ones = (np.ones((2, 4), np.float32), np.ones((2, 3), np.float32))
    options = {"evaluation": [ones] if ends_with in ("evaluation", "both") else None,
               "checkpoint_dir": folder if ends_with in ("checkpoint", "both") else None}
    try:
        loop.fit(trainer, [ones] * (3 if mpi.rank() == 0 else 2), epochs=2, progress=False, **options)
    except TrainerError as error:
        assert re.search(r"the ranks' training batches ran out at different steps: rank 0 to step 3, rank 1 to the "
                         r"end of epoch 1 after step 2: rank 1 had no batch for step 3 while the others "
                         r"did; every rank needs as many batches per epoch", str(error)), error
        print(f"unequal shards ok on rank {mpi.rank()}: {error}")
        return
    raise AssertionError("unequal shards: no error")


def hang(victim: int) -> None:
    """Rank ``victim`` sleeps before its first step; the others must fail within the timeout."""
    model, initial = _mlp_step()
    trainer = mpi.DataParallelTrainer(model, initial, lr=0.1)
    if mpi.rank() == victim:
        time.sleep(3600)  # past test_mpi's hang guard: the job must end without waiting for it
    trainer.step(np.ones((2, 4), np.float32), np.ones((2, 3), np.float32))


def main(argv) -> None:
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
    if argv[0] == "unconfigured":
        return check_unconfigured()
    mpi.init(timeout=float(argv[2]) if argv[0] == "hang" else None)
    if argv[0] == "allreduce":
        check_allreduce()
    elif argv[0] == "trainer":
        check_trainer(argv[1])
    elif argv[0] == "train":
        check_training(argv[1])
    elif argv[0] in ("raise", "exit", "systemexit", "leave", "die"):
        wait_then_fail(argv[0], int(argv[1]))
    elif argv[0] in ("sizes", "differ", "options"):
        check_rank_mismatches(argv[0])
    elif argv[0] == "hang":
        hang(int(argv[1]))
    elif argv[0] == "fit":
        check_fit(argv[1])
    elif argv[0] == "unequal":
        check_unequal_shards(argv[1], argv[2])
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
