"""A worker of ``normgrad bench --train``: builds one variant's training step for one model,
then answers JSON lines on stdin: ``step`` (one step; its wall time, this process's CPU time and loss), ``profile``
(the op types' node time of one profiled step), ``end`` (peak RSS). Runs as a script, also in
a Python that has onnxruntime-training and no normgrad (``ort-training``), so it imports
normgrad only for normgrad's variants."""

import glob
import json
import os
import resource
import sys
import tempfile
import time

import numpy as np

# the module beside this script, not normgrad.tools._bench_options: onnxruntime-training's
# Python has no normgrad (it cannot share an environment with a current onnxruntime)
from _bench_options import bench_session_options  # noqa: E402

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01


def _rss_mb():
    """This process's peak RSS. On Linux VmHWM: ru_maxrss carries the parent's peak across
    fork and exec, which would credit the bench's own exports to every worker."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _events(path):
    """The events of a profile file (onnxruntime-training may append several JSON arrays)."""
    with open(path) as f:
        text = f.read()
    decoder, events, at = json.JSONDecoder(), [], 0
    while at < len(text):
        while at < len(text) and text[at] in " \r\n\t,":
            at += 1
        if at >= len(text):
            break
        try:
            chunk, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:  # a file the session has not closed yet: its complete events
            chunk, at = json.loads(text[at:text.rindex("}", at) + 1].rstrip().rstrip(",") + "]"), len(text)
        events += chunk if isinstance(chunk, list) else [chunk]
    return events


def _by_op(*profile_paths):
    """Node time per op type, after the first model run (warm-up) in profile files."""
    events = [e for path in profile_paths for e in _events(path)]
    runs = sorted((e for e in events if e.get("name") in ("model_run", "TrainStep") or e.get("name", "").endswith("_run")
                   and e.get("cat") == "Session"), key=lambda e: e["ts"])
    start = runs[0]["ts"] + runs[0]["dur"] if len(runs) > 1 else 0
    result = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= start:
            op = e.get("args", {}).get("op_name", "?")
            result[op] = result.get(op, 0.0) + e["dur"]
    return result


def _normgrad(variant, forward_path, x, labels, threads, loss, step_path=None):
    import onnx
    import onnxruntime

    from normgrad.graphs import build_step_graph, build_training_graph
    from normgrad.graphs.optimizers import hyperparameter_feeds
    from normgrad.train import Trainer
    from normgrad._session import training_session_options

    kernels = "cpp" if variant == "cpp" else None
    if step_path:  # a step graph file from normgrad export (its base in external data), as a user trains it
        # the Trainer's defaults for this graph (pre-packing on for MatMulNBits), with the bench's threads
        graph = onnx.load(step_path, load_external_data=False)
        options = bench_session_options(threads, options=training_session_options(onnxruntime, graph))
        del graph
        trainer = Trainer(step_path, step_path[:-len(".onnx")] + ".ckpt", lr=LR, session_options=options, kernels=kernels)
        # a genai model's attention mask: all ones, as torch's default
        batch = (x, np.ones_like(x), labels) if "attention_mask" in trainer.data_inputs else (x, labels)
        return (lambda: float(trainer.step(*batch))), None

    forward = onnx.load(forward_path)
    x_name = forward.graph.input[0].name
    training = build_training_graph(forward, loss=loss)
    del forward
    step_graph, initial = build_step_graph(training, "adamw", betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    del training
    # the Trainer's own default options (memory patterns and pre-packing off), with the bench's threads
    options = bench_session_options(threads, options=training_session_options(onnxruntime))
    trainer = Trainer(step_graph, initial, lr=LR, session_options=options, kernels=kernels)
    del initial  # the trainer holds the state: a NumPy copy kept here would count in the peak RSS

    def step():
        return float(trainer.step(x, labels))

    def profile():
        from normgrad.ops import api

        with tempfile.TemporaryDirectory() as folder:
            options = bench_session_options(threads, os.path.join(folder, "p"), training_session_options(onnxruntime))
            if variant == "cpp":
                api.session_options("cpp", options)
            session = onnxruntime.InferenceSession(step_graph.SerializeToString(), options,
                                                   providers=["CPUExecutionProvider"])
            feeds = {**hyperparameter_feeds(step_graph), **trainer.state_dict(), x_name: x, "labels": labels,
                     "lr": np.array(LR, np.float32),
                     "step": np.array(1, np.float32)}
            feeds = {i.name: feeds[i.name] for i in session.get_inputs()}
            for _ in range(2):
                session.run(None, feeds)
            return _by_op(session.end_profiling())

    return step, profile


def _torch(name, state_path, x, labels, threads, quick, weights=None):
    import torch

    from normgrad.tools.bench_train import torch_model, transformer_model

    torch.set_num_threads(threads)
    # weights: a genai row's int4 weights dequantized, in place of the seed's
    model = transformer_model(name, quick, weights) if weights else torch_model(name, quick)
    if os.path.exists(state_path):  # else the model as its seed builds it (the bench's --memory row)
        model.load_state_dict(torch.load(state_path))
    trainable = [p for p in model.parameters() if p.requires_grad]  # peft LoRA: the adapters alone
    optimizer = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    tx, tl = torch.from_numpy(x), torch.from_numpy(labels)
    if x.dtype == np.int64:  # a transformers model (token ids): its own loss, as a torch user computes it
        forward = lambda: model(input_ids=tx, labels=tl).loss  # noqa: E731
    else:
        forward = lambda: torch.nn.functional.cross_entropy(model(tx), tl)  # noqa: E731

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = forward()
        loss.backward()
        optimizer.step()
        return float(loss)

    return step, None


def _shift_logits(forward):
    """Appends to ``forward`` the causal-LM shift of its logits [batch, sequence, vocabulary]:
    positions 0..sequence-2, flattened to [tokens, vocabulary] (CrossEntropyLoss's layout)."""
    from onnx import helper, numpy_helper

    logits = forward.graph.output[0]
    batch, sequence, vocabulary = (d.dim_value for d in logits.type.tensor_type.shape.dim)
    constants = {"shift_starts": [0], "shift_ends": [-1], "shift_axes": [1], "shift_shape": [-1, vocabulary]}
    forward.graph.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), k) for k, v in constants.items())
    forward.graph.node.extend([
        helper.make_node("Slice", [logits.name, "shift_starts", "shift_ends", "shift_axes"], ["shift_kept"]),
        helper.make_node("Reshape", ["shift_kept", "shift_shape"], ["shifted_logits"]),
    ])
    del forward.graph.output[:]
    # with its shape: CrossEntropyLoss derives the labels' shape from it
    forward.graph.output.append(helper.make_tensor_value_info("shifted_logits", logits.type.tensor_type.elem_type,
                                                              [batch * (sequence - 1), vocabulary]))


def _constant(forward, name):
    from onnx import numpy_helper

    for t in forward.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    for n in forward.graph.node:
        if n.op_type == "Constant" and n.output[0] == name and n.attribute[0].name == "value":
            return numpy_helper.to_array(n.attribute[0].t)
    return None


def _ort_training_forms(forward):
    """Rewrites what the dynamo exporter writes into forms onnxruntime-training has gradients
    for, computing the same: LayerNormalization with its mean and inverse-std outputs (its
    gradient builder reads them) and SplitToSequence + SequenceAt at constant indices as Split
    (it has no gradient for sequence ops)."""
    from onnx import helper, numpy_helper

    for node in forward.graph.node:
        if node.op_type == "LayerNormalization" and len(node.output) == 1:
            node.output.extend([node.output[0] + "_mean", node.output[0] + "_inv_std"])
    readers = {}
    for node in forward.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    replaced, dropped = {}, set()
    for node in forward.graph.node:
        if node.op_type != "SplitToSequence" or len(node.input) < 2:
            continue
        sizes = _constant(forward, node.input[1])
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if sizes is not None and sizes.ndim == 0:  # a chunk size: the sizes from the input's shape
            dims = [d.dim_value for v in forward.graph.value_info if v.name == node.input[0]
                    for d in v.type.tensor_type.shape.dim]
            whole = dims[axis] if dims and dims[axis] > 0 else None
            sizes = None if whole is None else np.array([min(sizes, whole - at) for at in range(0, whole, int(sizes))])
        takers = readers.get(node.output[0], [])
        indices = [_constant(forward, t.input[1]) if t.op_type == "SequenceAt" else None for t in takers]
        if sizes is None or any(i is None for i in indices):
            continue
        outputs = [f"{node.output[0]}_{i}" for i in range(len(sizes))]
        for taker, index in zip(takers, indices):
            outputs[int(index) % len(sizes)] = taker.output[0]
            dropped.add(id(taker))
        sizes_name = node.output[0] + "_sizes"
        forward.graph.initializer.append(numpy_helper.from_array(sizes.astype(np.int64), sizes_name))
        replaced[id(node)] = helper.make_node("Split", [node.input[0], sizes_name], outputs, axis=axis)
    nodes = [replaced.get(id(n), n) for n in forward.graph.node if id(n) not in dropped]
    del forward.graph.node[:]
    forward.graph.node.extend(nodes)


def _ort_training(forward_path, x, labels, threads, loss):
    import onnx
    from onnxruntime.training import artifacts, onnxblock
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    folder = tempfile.mkdtemp()
    forward = onnx.load(forward_path)
    _ort_training_forms(forward)
    if loss == "causal_lm":
        _shift_logits(forward)
        labels = np.ascontiguousarray(labels[:, 1:].reshape(-1))
    floats = [t.name for t in forward.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    metadata = {p.key: p.value for p in forward.metadata_props}
    if "normgrad.torch_parameters" in metadata:  # torch's requires_grad (peft: the adapters alone)
        params = list(json.loads(metadata["normgrad.torch_parameters"]))
    else:
        params = [name for name in floats if not any(s in name for s in ("running_mean", "running_var"))]
    frozen = [name for name in floats if name not in set(params)]
    artifacts.generate_artifacts(forward, requires_grad=params, frozen_params=frozen,
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 # its OptimType.AdamW has eps 1e-6 and no weight decay
                                 optimizer=onnxblock.optim.AdamW(betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY),
                                 artifact_directory=folder)
    ckpt = os.path.join(folder, "checkpoint")

    def make(profile_prefix=None):
        state = CheckpointState.load_checkpoint(ckpt)
        kwargs = {}
        module = Module(os.path.join(folder, "training_model.onnx"), state, None, "cpu",
                        session_options=bench_session_options(threads, profile_prefix), **kwargs)
        optimizer = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
        optimizer.set_learning_rate(LR)
        module.train()
        return module, optimizer

    module, optimizer = make()
    def run(module, optimizer):
        loss = module(x, labels)
        optimizer.step()
        module.lazy_reset_grad()
        return float(loss)

    def profile():
        prefix = os.path.join(folder, "profile")
        m, o = make(prefix)
        for _ in range(2):
            run(m, o)
        del m, o
        import gc

        gc.collect()
        files = glob.glob(prefix + "*.json")
        return _by_op(*files) if files else None

    return (lambda: run(module, optimizer)), profile


def _describe(error):
    """One line; the end of a long onnxruntime message, where it says what went wrong."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    return f"{type(error).__name__}: {text if len(text) <= 150 else '...' + text[-150:]}"


def main():
    variant, name, paths, threads, quick = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
    x, labels = np.load(paths["x.npy"]), np.load(paths["labels.npy"])
    try:
        loss = paths.get("loss", "cross_entropy")
        if variant in ("cpp", "functions"):
            step, profile = _normgrad(variant, paths["onnx"], x, labels, threads, loss, paths.get("step"))
        elif variant == "torch":
            step, profile = _torch(name, paths["pt"], x, labels, threads, quick, paths.get("dequantized"))
        else:
            step, profile = _ort_training(paths["onnx"], x, labels, threads, loss)
    except Exception as error:
        print(json.dumps({"error": _describe(error)}), flush=True)
        return
    print(json.dumps({"rss_mb": _rss_mb()}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        try:
            if command == "step":
                start, cpu_start = time.perf_counter(), time.process_time()
                loss = step()
                print(json.dumps({"time": time.perf_counter() - start, "cpu": time.process_time() - cpu_start,
                                  "loss": loss}), flush=True)
            elif command == "profile":
                try:
                    result = {"profile": profile() if profile else None}
                except Exception as error:  # a profile is a convenience: the timings stand without it
                    result = {"profile": None, "profile_error": f"{type(error).__name__}: {error}"[:150]}
                print(json.dumps(result), flush=True)
            elif command == "rss":
                print(json.dumps({"peak_mb": _rss_mb()}), flush=True)
            elif command == "end":
                return
        except Exception as error:
            print(json.dumps({"error": _describe(error)}), flush=True)


if __name__ == "__main__":
    main()
