"""``normgrad bench``: the kernels side by side, from one run.

``normgrad bench --train`` instead times whole training steps of four CNNs against torch
eager and onnxruntime-training (:mod:`normgrad.tools.bench_train`).

For each operator it times, with medians over interleaved repetitions (each repetition runs
every implementation once, in turn, so drifts in machine load hit them alike; torch's OpenMP
workers are told to sleep between calls, ``OMP_WAIT_POLICY=PASSIVE``, unless set already):

* ``cpp``: the compiled kernels (``session_options("cpp")``);
* ``python``: the onnxruntime-extensions Python kernels (``session_options("python")``, float32);
* ``functions``: the function bodies in plain onnxruntime (``normgrad.add_functions``);
* ``numpy``: the float64 NumPy reference;
* ``torch``: torch's CPU kernels, when torch is importable
  (``aten::native_batch_norm_backward`` with output mask [False, True, True],
  ``aten::native_group_norm_backward`` with [True, False, False],
  ``aten::native_layer_norm_backward`` with [True, True, True] on torch's own forward
  statistics, and for RMSNorm ``torch.autograd.grad`` of ``F.rms_norm`` (x and weight, graph
  retained, so only the backward is timed: torch has no fused CPU RMSNorm backward);
* ``floor``: the memory-streaming floor, the time to read the operator's input tensors once:
  ``np.add.reduce`` of their bytes viewed as int64 words, over contiguous slices, one slice
  per thread, on as many Python threads as the kernels get (NumPy releases the GIL while it
  sums; integer sums are vectorised, so this runs at memory speed for every dtype). The floor reads and
  writes nothing else: an operator that also writes an output of the input's size (dx)
  cannot reach it.

Every session gets ``intra_op_num_threads = --threads`` with spinning of idle pool threads off
(``session.intra_op.allow_spinning = 0``: a spinning pool would steal the cores from the
implementation timed next), and torch ``set_num_threads(--threads)``.
``mem`` is the growth of the process's peak RSS (``ru_maxrss``) during the implementation's
first call, with the inputs already allocated: a rough view of its temporaries (0 when it
stayed below an earlier peak). Ratios are to the ``cpp`` row and to the ``floor`` row.

The last row group times one training step of a ResNet basic block (Conv3x3-BN-ReLU-Conv3x3-BN
+ identity skip, ReLU; convolutions without bias, BatchNormalization with ``training_mode=1``,
as torch's TorchScript exporter writes it in ``TrainingMode.TRAINING``), ``--resnet-shape``
[N, C, H, W] (default 16 64 56 56; ``--quick`` 2 8 8 8): the forward model is built in code and
turned into a training graph by ``build_training_graph`` (seed gradient ``y_grad``), which runs

* ``cpp``: with normgrad's kernels (``session_options("cpp")``);
* ``functions``: in plain onnxruntime, on the function bodies the training graph carries;
* ``torch``: eager forward + ``backward(y_grad)`` of the same block (same weights, copied from
  the ONNX initializers, same ``x`` and ``y_grad``), ``train()`` mode; the gradients of ``x``
  and of the parameters are reset to ``None`` inside the timed call (no memset; backward
  allocates them afresh, as onnxruntime allocates its outputs on every run).

Every implementation computes ``y`` and the gradients of ``x`` and of every parameter. The
onnxruntime rows bind ``x``, ``y_grad`` and the weights once (as a training loop feeds its
weights). Before timing, one call of each is checked against ``cpp``: the largest
``|a - b| / max|b|`` over ``y`` and every gradient must be at most 1e-3 (the exit status is 1
otherwise); that first call is the one ``mem`` measures. With ``cpp`` a profiled extra session
(``enable_profiling``) reports the share of the node time spent in normgrad's nodes.

``normgrad bench --mpi`` prints only the data-parallel section instead: the same block's
training step on 1 and 2 MPI ranks with the same global batch (``normgrad.tools.bench_mpi``).
"""

from __future__ import annotations

import argparse
import os
import concurrent.futures
import resource
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import ml_dtypes
import numpy as np

from normgrad.tools.cli import ArgumentParser, positive_int

__all__ = ["main"]

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPE_NAMES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _session_options(threads):
    from normgrad.tools._bench_options import bench_session_options

    return bench_session_options(threads)


def _session(op_type, inputs, outputs, attributes, backend, threads):
    from normgrad.ops import harness

    return harness.make_session(harness.node_model(op_type, inputs, outputs, attributes), backend,
                                options=_session_options(threads))


def _to_ort(value):
    import onnx
    import onnxruntime

    value = np.ascontiguousarray(value)
    if value.dtype == BF16:
        return onnxruntime.OrtValue.ortvalue_from_numpy_with_onnx_type(value.view(np.uint16), onnx.TensorProto.BFLOAT16)
    return onnxruntime.OrtValue.ortvalue_from_numpy(value)


def _ort_runner(session, inputs) -> Callable[[], object]:
    """A call of ``session`` with inputs bound once (bfloat16 included)."""
    binding = session.io_binding()
    for name, value in inputs.items():
        if value is not None:
            binding.bind_ortvalue_input(name, _to_ort(value))
    for output in session.get_outputs():
        binding.bind_output(output.name, "cpu")

    def run():
        session.run_with_iobinding(binding)

    run.binding = binding
    return run


def _words(array) -> np.ndarray:
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return raw[: raw.size // 8 * 8].view(np.int64)  # int64 arithmetic is vectorised and memory-bound


def _floor_runner(arrays, threads, write_like=None) -> Callable[[], object]:
    """Reads every array once: np.add.reduce over contiguous slices, `threads` at a time.
    With ``write_like``, reads the two arrays and writes one of their size instead:
    np.add(a, b, out=c), slice by slice."""
    chunks = []
    if write_like is not None:
        words = [_words(a) for a in arrays] + [_words(np.empty_like(write_like))]
        step = max(1, -(-words[0].size // threads))
        chunks = [tuple(w[i:i + step] for w in words) for i in range(0, words[0].size, step)]
    for array in arrays if write_like is None else ():
        words = _words(array)
        step = max(1, -(-words.size // threads))
        chunks += [words[i:i + step] for i in range(0, words.size, step)]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads)

    def read(chunk):
        if write_like is not None:
            return np.add(chunk[0], chunk[1], out=chunk[2])
        return np.add.reduce(chunk)

    def run():
        return list(pool.map(read, chunks))

    run.pool = pool
    return run


def _torch_bn(inputs, threads):
    import torch

    torch.set_num_threads(threads)
    to = {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in inputs.items() if v is not None}
    weight = to.get("weight", torch.ones_like(to["mean"]))
    mean, invstd = to["mean"], to["invstd"]

    def run():
        with torch.no_grad():
            return torch.ops.aten.native_batch_norm_backward(
                to["grad_out"], to["input"], weight, None, None, mean, invstd, True, 1e-5, [False, True, True]
            )

    return run


def _torch_gn(inputs, threads):
    import torch

    torch.set_num_threads(threads)
    x = torch.from_numpy(inputs["x"])
    n, g = x.shape[:2]
    channels = g * x.shape[2]
    hw = int(np.prod(x.shape[3:]))
    x4 = x.reshape(n, channels, hw)
    dy4 = torch.from_numpy(inputs["dy"]).reshape(n, channels, hw)
    gamma = torch.from_numpy(np.array(np.broadcast_to(inputs["gamma"], (1, g, x.shape[2], 1)).reshape(-1)))
    mean = torch.from_numpy(inputs["mean"])
    rstd = torch.from_numpy(inputs["rstd"])

    def run():
        with torch.no_grad():
            return torch.ops.aten.native_group_norm_backward(dy4, x4, mean, rstd, gamma, n, channels, hw, g,
                                                             [True, False, False])

    return run


def _torch_row_norm(op_type):
    """torch's backward of LayerNorm (native_layer_norm_backward) or RMSNorm (autograd)."""

    def make(inputs, threads):
        import torch

        torch.set_num_threads(threads)

        def tensor(name):
            value = inputs[name]
            if value.dtype == BF16:
                return torch.from_numpy(value.astype(np.float32)).to(torch.bfloat16)
            return torch.from_numpy(value)

        x, dy, weight = tensor("x"), tensor("dy"), tensor("scale")
        shape = list(weight.shape)
        if op_type == "LayerNormalizationGrad":
            bias = torch.zeros_like(weight)
            _, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, weight, bias, 1e-5)

            def run():
                with torch.no_grad():
                    return torch.ops.aten.native_layer_norm_backward(dy, x, shape, mean, rstd, weight, bias,
                                                                     [True, True, True])

            return run
        x, weight = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        y = torch.nn.functional.rms_norm(x, shape, weight, 1e-5)

        def run():
            return torch.autograd.grad(y, [x, weight], dy, retain_graph=True)

        return run

    return make


def _numpy_runner(module, inputs, attributes=None):
    args = {name: inputs.get(name) for name in module.INPUTS}

    def run():
        return module.reference(**args, **dict(attributes or {}))

    return run


def _time(runners: Dict[str, Callable[[], object]], repeat: int) -> Dict[str, dict]:
    """Warm-up call (with peak-RSS growth), then `repeat` interleaved timed rounds."""
    results = {}
    for name, run in runners.items():
        before = _maxrss_mb()
        try:
            run()
        except Exception as error:  # an implementation that cannot run this case is reported, not fatal
            results[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"}
            continue
        results[name] = {"mem": max(0.0, _maxrss_mb() - before), "times": []}
    for _ in range(repeat):
        for name, run in runners.items():
            if "times" not in results[name]:
                continue
            start = time.perf_counter()
            run()
            results[name]["times"].append(time.perf_counter() - start)
    for result in results.values():
        if "times" in result:
            result["median"] = statistics.median(result["times"])
    return results


def _print_table(title: str, results: Dict[str, dict], out) -> None:
    print(f"\n{title}", file=out)
    cpp = results.get("cpp", {}).get("median")
    floor = results.get("floor", {}).get("median")
    print(f"  {'implementation':<16}{'median':>12}{'x cpp':>9}{'x floor':>9}{'mem MB':>9}", file=out)
    for name, result in results.items():
        if "error" in result:
            print(f"  {name:<16}{'failed: ' + result['error']}", file=out)
            continue
        median = result["median"]
        ratio_cpp = f"{median / cpp:8.2f}x" if cpp else "       -"
        ratio_floor = f"{median / floor:8.2f}x" if floor else "       -"
        mem = "" if name == "floor" or result.get("mem") is None else f"{result['mem']:9.0f}"
        print(f"  {name:<16}{median * 1e3:10.3f}ms {ratio_cpp}{ratio_floor}{mem}", file=out)


def _bn_inputs(shape, t, u, rng):
    x = rng.standard_normal(shape, dtype=np.float32)
    c = shape[1]
    return {
        "grad_out": rng.standard_normal(shape, dtype=np.float32).astype(t),
        "input": x.astype(t),
        "mean": (0.1 * rng.standard_normal(c)).astype(u),
        "invstd": (1.0 + 0.1 * rng.random(c)).astype(u),
        "weight": rng.standard_normal(c).astype(u),
    }


def _gn_inputs(shape, groups, t, u, rng):
    n, c = shape[:2]
    x_shape = (n, groups, c // groups, int(np.prod(shape[2:])))
    return {
        "x": rng.standard_normal(x_shape, dtype=np.float32).astype(t),
        "dy": rng.standard_normal(x_shape, dtype=np.float32).astype(t),
        "gamma": rng.standard_normal((1, groups, c // groups, 1)).astype(t),
        "mean": (0.1 * rng.standard_normal((n, groups))).astype(u),
        "rstd": (1.0 + 0.1 * rng.random((n, groups))).astype(u),
    }


def _have_torch() -> bool:
    try:
        import torch  # noqa: F401
    except Exception:
        return False
    return True


def _runners(op_type, inputs, outputs, threads, *, full: bool, torch_runner=None, floor_inputs=(), floor_writes=None):
    from normgrad.ops import operator

    module = operator(op_type)
    runners = {}
    for backend in ("cpp",) + (("functions", "python") if full else ()):
        try:
            # The Python kernels cannot omit outputs: they compute them all.
            session = _session(op_type, inputs, None if backend == "python" else outputs, None, backend, threads)
            runners[backend] = _ort_runner(session, inputs)
        except Exception as error:
            message = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
            runners[backend] = (lambda m: (lambda: (_ for _ in ()).throw(RuntimeError(m))))(message)
    if full and torch_runner is not None and _have_torch():
        runners["torch"] = torch_runner(inputs, threads)
    if full:
        runners["numpy (float64)"] = _numpy_runner(module, inputs)
    runners["floor"] = _floor_runner([inputs[name] for name in floor_inputs], threads,
                                     None if floor_writes is None else inputs[floor_writes])
    return runners


# ---- ResNet basic block: one training step (forward + backward)

RESNET_OPS = ("BatchNormReduceBackward", "BatchNormElemtBackward", "GroupNormalizationGrad")


def _resnet_forward(n: int, c: int, h: int, w: int):
    """The forward ONNX model of a ResNet basic block on x [n, c, h, w] (opset 17)."""
    import onnx.helper as oh

    from normgrad.graphs import examples

    rng = np.random.default_rng(42)
    std = np.sqrt(2.0 / (9 * c))  # He initialisation keeps the activations O(1)
    params = {
        "w1": (rng.standard_normal((c, c, 3, 3)) * std).astype(np.float32),
        "w2": (rng.standard_normal((c, c, 3, 3)) * std).astype(np.float32),
    }
    for i in (1, 2):
        params[f"s{i}"] = rng.uniform(0.5, 1.5, c).astype(np.float32)
        params[f"t{i}"] = (0.1 * rng.standard_normal(c)).astype(np.float32)
        params[f"m{i}"] = (0.1 * rng.standard_normal(c)).astype(np.float32)
        params[f"v{i}"] = rng.uniform(0.5, 1.5, c).astype(np.float32)
    nodes = [
        oh.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        oh.make_node("BatchNormalization", ["c1", "s1", "t1", "m1", "v1"], ["n1", "rm1", "rv1"], training_mode=1),
        oh.make_node("Relu", ["n1"], ["r1"]),
        oh.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        oh.make_node("BatchNormalization", ["c2", "s2", "t2", "m2", "v2"], ["n2", "rm2", "rv2"], training_mode=1),
        oh.make_node("Add", ["n2", "x"], ["sum"]),
        oh.make_node("Relu", ["sum"], ["y"]),
    ]
    return examples.model(nodes, {"x": (n, c, h, w)}, ["y"], params, opset=17, name="resnet_basic_block")


def _torch_resnet(params, inputs, threads):
    """Torch eager forward + backward of the block with ``params``; run() returns y, and the
    gradients are read from ``run.grads()`` afterwards (names as in the training graph)."""
    import torch

    torch.set_num_threads(threads)
    c = params["w1"].shape[0]

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.bn1 = torch.nn.BatchNorm2d(c, eps=1e-5, momentum=0.1)  # ONNX momentum 0.9
            self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.bn2 = torch.nn.BatchNorm2d(c, eps=1e-5, momentum=0.1)

        masks = None  # (ReLU 1, ReLU 2) 0/1 masks to use instead of torch's own: the check only

        def forward(self, x):
            if self.masks is None:
                r1 = torch.relu(self.bn1(self.conv1(x)))
                return torch.relu(self.bn2(self.conv2(r1)) + x)
            r1 = self.bn1(self.conv1(x)) * self.masks[0]
            return (self.bn2(self.conv2(r1)) + x) * self.masks[1]

    block = Block().train()
    with torch.no_grad():
        for i in (1, 2):
            getattr(block, f"conv{i}").weight.copy_(torch.from_numpy(params[f"w{i}"]))
            bn = getattr(block, f"bn{i}")
            bn.weight.copy_(torch.from_numpy(params[f"s{i}"]))
            bn.bias.copy_(torch.from_numpy(params[f"t{i}"]))
            bn.running_mean.copy_(torch.from_numpy(params[f"m{i}"]))
            bn.running_var.copy_(torch.from_numpy(params[f"v{i}"]))
    x = torch.from_numpy(inputs["x"]).clone().requires_grad_(True)
    y_grad = torch.from_numpy(inputs["y_grad"])
    named = {"x": x}
    for i in (1, 2):
        named[f"w{i}"] = getattr(block, f"conv{i}").weight
        named[f"s{i}"] = getattr(block, f"bn{i}").weight
        named[f"t{i}"] = getattr(block, f"bn{i}").bias

    def run():
        for tensor in named.values():
            tensor.grad = None
        y = block(x)
        y.backward(y_grad)
        return y

    run.grads = lambda: {f"{name}_grad": tensor.grad.numpy() for name, tensor in named.items()}

    def with_masks(r1, y):
        """y and the gradients with the ReLU masks of another implementation's r1 and y."""
        with torch.no_grad():  # torch's own ReLU inputs, without touching the running statistics
            n1 = torch.nn.functional.batch_norm(block.conv1(x), None, None, block.bn1.weight, block.bn1.bias,
                                                training=True, eps=1e-5)
            own_r1 = torch.relu(n1).numpy()
        own_y = run().detach().numpy()
        flips = int(np.count_nonzero((own_r1 > 0) != (r1 > 0)) + np.count_nonzero((own_y > 0) != (y > 0)))
        block.masks = (torch.from_numpy((r1 > 0).astype(np.float32)), torch.from_numpy((y > 0).astype(np.float32)))
        try:
            result = run().detach().numpy().copy()
            return {"y": result, **{k: v.copy() for k, v in run.grads().items()}}, flips
        finally:
            block.masks = None

    run.with_masks = with_masks
    return run


def _ort_outputs(run, session) -> Dict[str, np.ndarray]:
    return dict(zip([o.name for o in session.get_outputs()], run.binding.copy_outputs_to_cpu()))


def _ort_r1(train, inputs, threads) -> np.ndarray:
    """The first ReLU's output r1 in the cpp session of the training graph ``train``."""
    import copy

    import onnx
    import onnx.helper as oh
    import onnxruntime

    import normgrad

    model = copy.deepcopy(train)
    model.graph.output.append(oh.make_tensor_value_info("r1", onnx.TensorProto.FLOAT, None))
    options = normgrad.session_options("cpp", _session_options(threads))
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(["r1"], inputs)[0]


def _profile_breakdown(train_bytes, inputs, threads, runs: int = 3) -> str:
    """The share of the cpp session's node time in normgrad's nodes, from onnxruntime's profiler."""
    import json
    import tempfile

    import onnxruntime

    import normgrad

    with tempfile.TemporaryDirectory() as tmp:
        options = normgrad.session_options("cpp", _session_options(threads))
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(tmp, "resnet")
        session = onnxruntime.InferenceSession(train_bytes, options, providers=["CPUExecutionProvider"])
        run = _ort_runner(session, inputs)
        for _ in range(runs + 1):
            run()
        with open(session.end_profiling()) as f:
            events = json.load(f)
    # Drop the first run (warm-up): node events carry the run they belong to only through
    # their time stamps, so keep the events after the first model_run event ends.
    runs_ = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                   key=lambda e: e["ts"])
    start = runs_[0]["ts"] + runs_[0]["dur"] if len(runs_) > 1 else 0
    by_op: Dict[str, float] = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= start:
            op = e.get("args", {}).get("op_name", "?")
            by_op[op] = by_op.get(op, 0.0) + e["dur"]
    total = sum(by_op.values())
    run_total = sum(e["dur"] for e in runs_[1:]) if len(runs_) > 1 else 0
    if not total:
        return "profile: no node events"
    ours = {op: t for op, t in by_op.items() if op in RESNET_OPS}
    top = sorted(((t, op) for op, t in by_op.items() if op not in RESNET_OPS), reverse=True)[:3]
    parts = ", ".join(f"{op} {t / total:.1%}" for op, t in sorted(ours.items()))
    others = ", ".join(f"{op} {t / total:.1%}" for t, op in top)
    runs_done = max(1, len(runs_) - 1)
    return (f"cpp profile ({runs_done} runs): normgrad nodes {sum(ours.values()) / total:.1%} of node time "
            f"({parts}; {sum(ours.values()) / runs_done / 1e3:.2f}ms/run); {others}; "
            f"node time {total / runs_done / 1e3:.1f}ms/run of model_run {run_total / runs_done / 1e3:.1f}ms/run")


def _resnet_group(shape, threads, repeat, full: bool, out) -> bool:
    """Times one training step of the ResNet block; False when the agreement check failed."""
    import onnx.numpy_helper as onh
    import onnxruntime

    import normgrad
    from normgrad.graphs import build_training_graph

    n, c, h, w = shape
    forward = _resnet_forward(n, c, h, w)
    train, weights = build_training_graph(forward)
    train_bytes = train.SerializeToString()
    params = {name: np.array(value) for name, value in weights.items()}  # writable, for torch
    params.update((t.name, np.array(onh.to_array(t))) for t in train.graph.initializer)  # and the BN statistics
    trainable = [i.name for i in train.graph.input if i.name in weights]
    rng = np.random.default_rng(7)
    inputs = {"x": rng.standard_normal(shape, dtype=np.float32),
              "y_grad": rng.standard_normal(shape, dtype=np.float32),
              **{name: params[name] for name in trainable}}

    sessions, runners = {}, {}
    for backend in ("cpp",) + (("functions",) if full else ()):
        options = _session_options(threads)
        if backend == "cpp":
            normgrad.session_options("cpp", options)
        try:
            sessions[backend] = onnxruntime.InferenceSession(train_bytes, options, providers=["CPUExecutionProvider"])
        except Exception as error:
            message = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
            runners[backend] = (lambda m: (lambda: (_ for _ in ()).throw(RuntimeError(m))))(message)
            continue
        runners[backend] = _ort_runner(sessions[backend], inputs)
    if full and _have_torch():
        runners["torch"] = _torch_resnet(params, inputs, threads)

    # One call of each (the call `mem` measures), checked against cpp.
    got: Dict[str, Dict[str, np.ndarray]] = {}
    mem: Dict[str, float] = {}
    for name, run in runners.items():
        before = _maxrss_mb()
        try:
            y = run()
        except Exception:
            continue  # _time reports the error
        mem[name] = max(0.0, _maxrss_mb() - before)
        if name in sessions:
            got[name] = _ort_outputs(run, sessions[name])
        else:
            got[name] = {"y": y.detach().numpy().copy(), **{k: v.copy() for k, v in run.grads().items()}}
    keys = ["y"] + [f"{name}_grad" for name in ["x"] + trainable]

    def worst(result, reference):
        errors = {}
        for key in keys:
            a, b = np.asarray(result[key], np.float64), np.asarray(reference[key], np.float64)
            errors[key] = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
        key = max(errors, key=errors.get)
        return errors[key], key

    ok = True
    if "cpp" in got and len(got) > 1:
        reference = got["cpp"]
        for name, result in got.items():
            if name == "cpp":
                continue
            error, key = worst(result, reference)
            line = f"  check {name} vs cpp: max |a-b|/max|b| over y and {len(keys) - 1} gradients {error:.2e} ({key})"
            if name == "torch" and error > 1e-3:
                # A ReLU input that rounds to the other side of 0 in one implementation flips
                # that element's gradient (an O(1) change that convolutions spread to their
                # neighbours and into the weight gradients); compare again with cpp's masks.
                forced, flips = runners["torch"].with_masks(_ort_r1(train, inputs, threads), reference["y"])
                error, key = worst(forced, reference)
                line += (f"; {flips} ReLU input(s) round to the other side of 0 than in cpp; with cpp's ReLU "
                         f"masks: {error:.2e} ({key})")
            good = error <= 1e-3
            ok &= good
            print(line + (": ok" if good else ": MISMATCH (> 1e-3)"), file=out)
    else:
        print("  check: skipped (" + ("cpp failed" if "cpp" not in got else "--no-slow: cpp only") + ")", file=out)

    results = _time(runners, repeat)
    for name, result in results.items():
        if "times" in result:
            result["mem"] = mem.get(name)
    flops = 2 * n * c * c * 9 * h * w * 2 * 3  # two 3x3 convs; forward, grad input, grad weight each
    _print_table(f"ResNet basic block training step (forward + backward) float32 x {list(shape)}, "
                 f"BN training_mode=1, {flops / 1e9:.3g} GFLOP of convolution", results, out)
    cpp = results.get("cpp", {}).get("median")
    if cpp:
        print(f"  cpp: {flops / cpp / 1e9:.1f} GFLOP/s of convolution", file=out)
        try:
            print("  " + _profile_breakdown(train_bytes, inputs, threads), file=out)
        except Exception as error:  # profiling is a convenience
            print(f"  cpp profile: failed ({type(error).__name__}: {str(error).splitlines()[0][:80]})", file=out)
    return ok


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="normgrad bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", action="store_true",
                        help="instead: training steps of four CNNs against torch (and onnxruntime-training); see --train --help")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (CI smoke test)")
    parser.add_argument("--threads", type=positive_int, default=2, help="intra-op threads for every implementation (2)")
    parser.add_argument("--repeat", type=positive_int, default=None, help="timed rounds (default 7, --quick 3)")
    parser.add_argument("--shape", type=positive_int, nargs="+", default=None,
                        help="[N, C, H, W...] of the input (default 32 256 56 56; --quick 4 64 14 14)")
    parser.add_argument("--groups", type=positive_int, default=32, help="GroupNorm groups (default 32)")
    parser.add_argument("--no-slow", action="store_true", help="skip python/functions/numpy/torch rows")
    parser.add_argument("--rows", type=str, nargs="+", default=None, metavar="TOKENSxHIDDEN",
                        help="LayerNorm/RMSNorm gradient shapes (default 8192x768 4096x4096; --quick 64x96)")
    parser.add_argument("--resnet-shape", type=positive_int, nargs=4, default=None, metavar=("N", "C", "H", "W"),
                        help="ResNet basic block input (default 16 64 56 56; --quick 2 8 8 8)")
    parser.add_argument("--mpi", action="store_true",
                        help="only the data-parallel section: the ResNet block step on 1 and 2 MPI ranks (launches mpirun)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    if "--train" in (sys.argv[1:] if argv is None else argv):
        from normgrad.tools import bench_train

        return bench_train.main(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.mpi:
        from normgrad.tools import bench_mpi

        resnet_shape = list(args.resnet_shape or ((4, 8, 16, 16) if args.quick else (16, 64, 56, 56)))
        if args.repeat is not None and args.repeat < 1:
            parser.error(f"--repeat must be >= 1; got {args.repeat}")
        if resnet_shape[0] % 2 or min(resnet_shape) < 1:
            parser.error(f"--mpi splits the batch over 2 ranks: --resnet-shape needs an even N >= 2; got {resnet_shape}")
        return bench_mpi.run_section(resnet_shape, args.threads, args.repeat or 3, sys.stdout)
    # torch's OpenMP workers spin after each call by default and would steal the cores
    # from whatever runs next in the interleaved rounds; let them sleep instead.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    shape = tuple(args.shape or ((4, 64, 14, 14) if args.quick else (32, 256, 56, 56)))
    repeat = args.repeat or (3 if args.quick else 7)
    threads = args.threads
    out = sys.stdout
    if len(shape) < 3 or shape[1] % args.groups:
        parser.error(f"--shape needs rank >= 3 and C divisible by --groups; got {list(shape)}, {args.groups}")

    try:
        row_shapes = [tuple(int(v) for v in text.lower().split("x")) for text in args.rows or
                      (["64x96"] if args.quick else ["8192x768", "4096x4096"])]
    except ValueError:
        parser.error(f"--rows takes TOKENSxHIDDEN shapes such as 8192x768; got {args.rows}")

    import onnxruntime

    import normgrad

    rng = np.random.default_rng(0)
    full = not args.no_slow
    print(f"normgrad bench: shape {list(shape)}, groups {args.groups}, {threads} threads, median of {repeat}; "
          f"onnxruntime {onnxruntime.__version__}, torch {'yes' if _have_torch() else 'not installed'}", file=out)
    print(f"C++ library: {normgrad.library_path()}", file=out)
    from normgrad.tools._bench_options import cpu_description

    print(f"CPU: {cpu_description()}", file=out)
    # onnxruntime takes bfloat16 arrays from NumPy from 1.20 on; before, those rows are left out
    bfloat16 = (BF16,) if hasattr(onnxruntime.OrtValue, "ortvalue_from_numpy_with_onnx_type") else ()
    _batch_and_group_norm_rows(shape, args.groups, threads, repeat, full, bfloat16, rng, out)
    _row_norm_rows(row_shapes, threads, repeat, full, bfloat16, out)

    # ---- ResNet basic block: forward + backward, cpp / functions / torch
    resnet_shape = tuple(args.resnet_shape or ((2, 8, 8, 8) if args.quick else (16, 64, 56, 56)))
    print(f"\nResNet basic block x {list(resnet_shape)}: agreement check (one call each)", file=out)
    status = 0 if _resnet_group(resnet_shape, threads, repeat, full, out) else 1
    _print_latency(threads, repeat, rng, out)
    for width in (16,) if args.quick else (16, 128):
        _print_step_table(width, threads, max(repeat, 9), out)
    return status


def _batch_and_group_norm_rows(shape, groups: int, threads: int, repeat: int, full: bool, bfloat16, rng, out) -> None:
    """The BatchNorm and GroupNorm gradient operators' tables: float32 against every
    implementation, float16 and bfloat16 (C++ only) against the floor of their own bytes."""
    import onnxruntime

    f32 = np.dtype(np.float32)
    # ---- BatchNormReduceBackward
    bn = _bn_inputs(shape, f32, f32, rng)
    runners = _runners("BatchNormReduceBackward", bn, ["sum_dy", "sum_dy_xmu", "grad_weight", "grad_bias"], threads,
                       full=full, torch_runner=_torch_bn, floor_inputs=("grad_out", "input"))
    _print_table(f"BatchNormReduceBackward float32 {list(shape)} (floor: read grad_out + input)",
                 _time(runners, repeat), out)
    del runners

    # ---- GroupNormalizationGrad
    gn = _gn_inputs(shape, groups, f32, f32, rng)
    runners = _runners("GroupNormalizationGrad", gn, ["dx"], threads, full=full, torch_runner=_torch_gn,
                       floor_inputs=("x", "dy"))
    _print_table(f"GroupNormalizationGrad float32 x {list(gn['x'].shape)}, gamma {list(gn['gamma'].shape)}, "
                 f"dx only (floor: read x + dy)", _time(runners, repeat), out)
    del runners

    # ---- BatchNormElemtBackward (cpp, functions, numpy, floor)
    from normgrad.ops import batch_norm_reduce_backward as bnr

    sums = bnr.reference(**{k: bn[k] for k in ("grad_out", "input", "mean", "invstd")})
    elemt = dict(bn, sum_dy=sums.sum_dy, sum_dy_xmu=sums.sum_dy_xmu)
    try:
        runners = _runners("BatchNormElemtBackward", elemt, ["grad_input"], threads, full=full,
                           floor_inputs=("grad_out", "input"))
        runners.pop("python", None)
        _print_table(f"BatchNormElemtBackward float32 {list(shape)} (floor: read grad_out + input)",
                     _time(runners, repeat), out)
        del runners
    except KeyError as error:  # operator not registered in this build
        print(f"\nBatchNormElemtBackward: skipped ({error})", file=out)

    # ---- float16 / bfloat16 rows (C++ only, against float32 C++ and the floor of their own bytes)
    del bn, gn, elemt
    if not bfloat16:
        print(f"\nbfloat16 rows: skipped (onnxruntime {onnxruntime.__version__} takes no bfloat16 arrays from NumPy; "
              "1.20 and newer do)", file=out)
    for t in (np.dtype(np.float16), *bfloat16):
        bn = _bn_inputs(shape, t, f32, rng)
        runners = _runners("BatchNormReduceBackward", bn, ["sum_dy", "sum_dy_xmu", "grad_weight", "grad_bias"],
                           threads, full=False, floor_inputs=("grad_out", "input"))
        _print_table(f"BatchNormReduceBackward {t.name} (U float32)", _time(runners, repeat), out)
        del runners, bn
        gn = _gn_inputs(shape, groups, t, f32, rng)
        runners = _runners("GroupNormalizationGrad", gn, ["dx"], threads, full=False, floor_inputs=("x", "dy"))
        _print_table(f"GroupNormalizationGrad {t.name} (U float32), dx only", _time(runners, repeat), out)
        del runners, gn


def _row_norm_rows(row_shapes, threads: int, repeat: int, full: bool, bfloat16, out) -> None:
    """LayerNormalizationGrad and RMSNormalizationGrad on [tokens, hidden], float32 and bfloat16."""
    from normgrad.tools.demo import row_norm_case

    f32 = np.dtype(np.float32)
    for row_shape in row_shapes:
        for t in (f32, *bfloat16):
            for op_type, outputs in (("LayerNormalizationGrad", ["dx", "dscale", "dbias"]),
                                     ("RMSNormalizationGrad", ["dx", "dscale"])):
                inputs = row_norm_case(op_type, row_shape, t, np.float32)
                runners = _runners(op_type, inputs, outputs, threads, full=full, torch_runner=_torch_row_norm(op_type),
                                   floor_inputs=("x", "dy"), floor_writes="x")
                if t != f32:
                    runners.pop("python", None)
                _print_table(f"{op_type} {t.name} (U float32) x {list(row_shape)}, axis -1, {', '.join(outputs)} "
                             f"(floor: read x + dy, write dx)", _time(runners, repeat), out)
                del runners, inputs


def _print_latency(threads: int, repeat: int, rng, out) -> None:
    """Tiny tensors: the per-call latency of an operator against an Identity node."""
    import onnx
    import onnxruntime
    from onnx import helper

    from normgrad.ops import IR_VERSION

    f32 = np.dtype(np.float32)
    tiny = _bn_inputs((2, 3, 4), f32, f32, rng)
    runners = {"cpp": _ort_runner(_session("BatchNormReduceBackward", tiny, None, None, "cpp", threads), tiny)}
    identity = helper.make_model(
        helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3, 4])]),
        opset_imports=[helper.make_opsetid("", 18)], ir_version=IR_VERSION)
    options = _session_options(threads)
    id_session = onnxruntime.InferenceSession(identity.SerializeToString(), options,
                                              providers=["CPUExecutionProvider"])
    runners["Identity node"] = _ort_runner(id_session, {"x": tiny["input"]})
    results = _time(runners, max(repeat, 9) * 50)
    print("\nTiny tensors [2, 3, 4]: per-call latency (session.run_with_iobinding)", file=out)
    for name, result in results.items():
        print(f"  {name:<16}{result['median'] * 1e6:10.1f}us", file=out)
    cpp, ident = results["cpp"]["median"], results["Identity node"]["median"]
    print(f"  overhead over Identity: {(cpp - ident) * 1e6:.1f}us", file=out)


def _print_step_table(width: int, threads: int, repeat: int, out) -> None:
    """One AdamW step of the digits CNN (batch 32): ``normgrad.train.Trainer`` (state in
    ping-pong OrtValues through IOBinding) against ``session.run`` of the same step graph
    with the state fed from NumPy and the outputs copied back, as a hand-written loop does."""
    import json

    import onnxruntime

    import normgrad
    from normgrad.graphs import build_step_graph, build_training_graph, examples
    from normgrad.graphs.optimizers import hyperparameter_feeds
    from normgrad.train import Trainer

    step, initial = build_step_graph(build_training_graph(examples.digits_cnn(width=width), loss="cross_entropy"), "adamw")
    rng = np.random.default_rng(1)
    x, labels = rng.standard_normal((32, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 32)
    trainer = Trainer(step, initial, lr=1e-3, session_options=_session_options(threads))
    session = onnxruntime.InferenceSession(step.SerializeToString(), normgrad.session_options("cpp", _session_options(threads)),
                                           providers=["CPUExecutionProvider"])
    next_of = json.loads({p.key: p.value for p in step.metadata_props}["normgrad.state"])
    names = [o.name for o in session.get_outputs()]
    state = dict(initial)

    def numpy_loop():
        feeds = {**hyperparameter_feeds(step), **state, "x": x, "labels": labels, "lr": np.array(1e-3, np.float32), "step": np.array(1, np.float32)}
        outputs = dict(zip(names, session.run(None, feeds)))
        state.update({name: outputs[next_of[name]] for name in state})

    results = _time({"Trainer.step": lambda: trainer.step(x, labels), "run + NumPy": numpy_loop}, repeat)
    megabytes = sum(v.nbytes for v in initial.values()) / 1e6
    print(f"\nTraining step: digits CNN width {width} ({megabytes:.1f} MB of state), batch 32, AdamW", file=out)
    for name, result in results.items():
        print(f"  {name:<16}{result['median'] * 1e3:10.3f}ms  (range {min(result['times']) * 1e3:.3f}-"
              f"{max(result['times']) * 1e3:.3f})", file=out)


if __name__ == "__main__":
    sys.exit(main())
