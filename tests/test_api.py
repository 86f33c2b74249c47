"""The public API: DOMAIN, session_options, add_functions, library_path, the CLI."""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
import onnxruntime
import onnxruntime as ort
import pytest
from onnx import helper

import normgrad
from normgrad.ops import DOMAIN, batch_norm_reduce_backward as bnr, group_normalization_grad as gng, harness
from normgrad.tools import cli

from _helpers import batch_norm_inputs


def _gn_model():
    rng = np.random.default_rng(0)
    inputs = {
        "x": rng.normal(size=(2, 3, 4)).astype(np.float32),
        "dy": rng.normal(size=(2, 3, 4)).astype(np.float32),
        "gamma": np.ones((1, 3, 1), np.float32),
        "mean": np.zeros((2, 3), np.float32),
        "rstd": np.ones((2, 3), np.float32),
    }
    return harness.node_model(gng.OP_TYPE, inputs), inputs


def test_domain_is_dedicated():
    assert normgrad.DOMAIN == "normgrad" and normgrad.OPSET_VERSION == 1


def test_add_functions_is_idempotent_and_keeps_other_functions():
    model, _ = _gn_model()
    other = onnx.parser.parse_function(
        '<domain: "mine", opset_import: ["" : 18]> Twice (x) => (y) { y = Add (x, x) }'
    )
    model.functions.append(other)
    once = normgrad.add_functions(model)
    twice = normgrad.add_functions(once)
    assert [(f.domain, f.name) for f in once.functions] == [("mine", "Twice"), (normgrad.DOMAIN, gng.OP_TYPE)]
    assert once.SerializeToString() == twice.SerializeToString()
    assert len(model.functions) == 1, "the caller's model is not modified"


def test_model_without_kernels_or_functions_fails_at_session_creation():
    model, _ = _gn_model()
    with pytest.raises(Exception, match=gng.OP_TYPE):
        onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_function_bodies_need_opset_15():
    model, _ = _gn_model()
    model.opset_import[0].version = 14
    with pytest.raises(ValueError, match="opset >= 15"):
        normgrad.add_functions(model)


def test_session_options_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        normgrad.session_options("cuda")


def test_session_options_registers_into_given_options():
    options = onnxruntime.SessionOptions()
    assert normgrad.session_options("python", options) is options
    model, inputs = _gn_model()
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    dx = session.run(["dx"], inputs)[0]
    np.testing.assert_allclose(dx, gng.reference(**inputs).dx, rtol=1e-5, atol=1e-6)


def test_python_kernels_reject_omitted_outputs_at_session_creation():
    model, _ = _gn_model()
    del model.graph.node[0].output[1:]
    del model.graph.output[1:]
    with pytest.raises(Exception, match="output"):
        onnxruntime.InferenceSession(
            model.SerializeToString(), normgrad.session_options("python"), providers=["CPUExecutionProvider"]
        )


def test_cli_lists_commands(capsys):
    assert cli.main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert cli.main(["nonsense"]) == 2


def test_demo_runs_and_agrees(capsys):
    assert cli.main(["demo", "--shape", "2", "8", "4", "4", "--groups", "4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "all backends agree" in out and "NO" not in out.split()
    for op_type in ("LayerNormalizationGrad", "RMSNormalizationGrad"):
        assert sum(line.startswith(op_type) for line in out.splitlines()) >= 10, op_type  # accuracy + timing rows


def test_bench_quick_runs(capsys):
    assert cli.main(["bench", "--quick"]) == 0
    out = capsys.readouterr().out
    bfloat16_arrays = hasattr(onnxruntime.OrtValue, "ortvalue_from_numpy_with_onnx_type")  # onnxruntime 1.20+
    for row in ("BatchNormReduceBackward", "GroupNormalizationGrad", "BatchNormElemtBackward", "ResNet", "floor",
                "LayerNormalizationGrad bfloat16" if bfloat16_arrays else "bfloat16 rows: skipped",
                "RMSNormalizationGrad float32", "write dx"):
        assert row in out
    assert "failed" not in out, out  # every implementation ran, the Python kernels included
    assert "\nCPU: " in out


def test_bench_names_the_cpu_from_its_first_processor(tmp_path):
    from normgrad.tools._bench_options import cpu_description

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse2 avx2 fma\n\n"
                       "processor\t: 1\nmodel name\t: Other CPU\nflags\t\t: fpu avx512f avx2\n\n")
    cores = len(os.sched_getaffinity(0))
    assert cpu_description(str(cpuinfo)) == f"Test CPU 9000, avx2, {cores} cores"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Wide CPU\nflags\t\t: avx2 avx512f avx512bw\n")
    assert cpu_description(str(cpuinfo)) == f"Wide CPU, avx512f, {cores} cores"
    assert cpu_description(str(tmp_path / "absent")).endswith(f", {cores} cores")  # the platform's name alone


@pytest.mark.slow
def test_bench_train_quick_runs_and_agrees(capsys):
    """The output format of ``bench --train``, and the losses of the first two steps of
    every variant agreeing with cpp's (exit status 0); timings are not asserted."""
    pytest.importorskip("torch")
    models = ["resnet_block", "mbconv_block", "lstm"]
    assert cli.main(["bench", "--train", "--quick", "--repeat", "1", "--models", *models]) == 0
    out = capsys.readouterr().out
    for name in ("resnet_block x [2, 8, 16, 16]", "mbconv_block x [2, 8, 8, 8]", "lstm x [4, 16, 8]"):
        assert name in out
    for variant in ("cpp", "functions", "torch"):
        rows = [line for line in out.splitlines() if line.strip().startswith(variant + " ") and "ms" in line]
        assert len(rows) == len(models) and all("vs cpp" in row and "MISMATCH" not in row for row in rows)
    assert out.count("cpp profile (op types by share of node time): ") == len(models)


def test_bench_train_bad_ort_python_is_a_usage_error(capsys):
    assert cli.main(["bench", "--train", "--ort-training-python", "/nonexistent/python"]) == 2
    assert "--ort-training-python" in capsys.readouterr().err


def test_python_ops_of_other_domains_keep_working():
    """normgrad's invocation hook hands other libraries' Python ops to the original one."""
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    @onnx_op(op_type="normgrad.test::Twice", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float])
    def twice(x):
        return x * 2

    node = helper.make_node("Twice", ["x"], ["y"], domain="normgrad.test")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("normgrad.test", 1)], ir_version=10
    )
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), normgrad.session_options("python"), providers=["CPUExecutionProvider"]
    )
    np.testing.assert_array_equal(session.run(None, {"x": np.arange(3, dtype=np.float32)})[0], [0, 2, 4])


def test_bench_train_stops_a_worker_that_does_not_answer(tmp_path, monkeypatch):
    """A hung worker is stopped with an error after the timeout; the bench does not wait forever."""
    from normgrad.tools import bench_train

    silent = tmp_path / "silent_worker.py"
    silent.write_text("import sys, time\nsys.stderr.write('x' * 200000)\ntime.sleep(60)\n")
    monkeypatch.setattr(bench_train, "WORKER", str(silent))
    monkeypatch.setattr(bench_train, "WORKER_TIMEOUT", 2.0)
    worker = bench_train._Worker(sys.executable, "cpp", "resnet_block", {}, 1, True)
    assert worker.error == "no answer within 2 s; worker stopped"
    worker.close()
    assert worker.process.poll() is not None


def test_bench_train_worker_runs_where_normgrad_is_not_installed(tmp_path):
    """The ort-training column runs the worker in onnxruntime-training's own Python, which
    has no normgrad: with normgrad unimportable, the worker gets as far as that variant's
    own import (here onnxruntime.training, absent from this environment)."""
    import json
    import os
    import subprocess

    from normgrad.tools import bench_train

    np.save(tmp_path / "x.npy", np.zeros((1, 1), np.float32))
    np.save(tmp_path / "labels.npy", np.zeros(1, np.int64))
    paths = json.dumps({"onnx": str(tmp_path / "none.onnx"), "x.npy": str(tmp_path / "x.npy"),
                        "labels.npy": str(tmp_path / "labels.npy")})
    code = (
        "import runpy, sys\n"
        "sys.modules['normgrad'] = None  # import normgrad raises ImportError\n"
        f"sys.argv = [{bench_train.WORKER!r}, 'ort-training', 'resnet_block', {paths!r}, '1', '1']\n"
        f"sys.path.insert(0, {os.path.dirname(bench_train.WORKER)!r})\n"
        f"runpy.run_path({bench_train.WORKER!r}, run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, input="end\n")
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout.splitlines()[0])
    assert "normgrad" not in reply.get("error", ""), reply
    assert "onnxruntime.training" in reply["error"] or "rss_mb" in reply, reply


def test_submodules_load_on_first_use():
    """``normgrad.train`` and friends work after a plain ``import normgrad``; torch is not
    imported by that import alone; an unknown name is still an AttributeError."""
    import subprocess

    code = (
        "import sys, normgrad\n"
        "assert 'torch' not in sys.modules\n"
        "assert normgrad.train.Trainer.__name__ == 'Trainer'\n"
        "assert normgrad.checkpoint.load\n"
        "try:\n    normgrad.no_such_thing\nexcept AttributeError as e:\n    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "module 'normgrad' has no attribute 'no_such_thing'"


def test_training_errors_are_one_class_each_wherever_imported():
    """TrainerError, CheckpointError and LoraError are defined once, in normgrad.errors, which
    imports nothing of normgrad (the bottom layer), and are the same class where users import
    them."""
    import ast

    from normgrad import checkpoint, errors, lora, train

    tree = ast.parse(open(errors.__file__).read())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [name for name in imported if name.split(".")[0] == "normgrad"], imported
    assert normgrad.TrainerError is train.TrainerError is errors.TrainerError
    assert normgrad.CheckpointError is checkpoint.CheckpointError is errors.CheckpointError
    assert normgrad.LoraError is lora.LoraError is errors.LoraError
    assert all(issubclass(e, ValueError) for e in (errors.TrainerError, errors.CheckpointError, errors.LoraError))


def test_session_options_register_once_per_options_object():
    """Two trainers (or any two callers) registering into one SessionOptions: the second
    registration is a no-op, so every later session still loads (onnxruntime refused them
    with "Domain already set in registry"); another backend beside it is refused."""
    import onnxruntime as ort

    from normgrad.graphs import examples

    model = examples.mlp().SerializeToString()
    options = ort.SessionOptions()
    for _ in range(2):
        assert normgrad.session_options("cpp", options) is options
        ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    with pytest.raises(ValueError, match="already have normgrad's 'cpp' kernels"):
        normgrad.session_options("python", options)


def _bnr_model(inputs, node_inputs, node_outputs, attributes):
    """One BatchNormReduceBackward node exactly as given: no defaults written, omissions kept."""
    node = helper.make_node(bnr.OP_TYPE, node_inputs, node_outputs, domain=DOMAIN, **attributes)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, list(inputs[n].shape)) for n in node_inputs if n],
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in node_outputs if n],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)],
                             ir_version=normgrad.ops.IR_VERSION)


BRIDGE_CASES = {
    # attributes left to their defaults, weight omitted, trailing outputs omitted
    "defaults": (["grad_out", "input", "mean", "invstd"], ["sum_dy", "sum_dy_xmu"], {}),
    # a flag at 0 with its outputs omitted, the others named in the middle
    "flag_off": (["grad_out", "input", "mean", "invstd", ""], ["", "", "grad_weight"], {"input_g": 0, "bias_g": 0}),
}


@pytest.mark.parametrize("case", sorted(BRIDGE_CASES))
def test_python_backend_takes_nodes_relying_on_defaults_and_omissions(case):
    node_inputs, node_outputs, attributes = BRIDGE_CASES[case]
    inputs = batch_norm_inputs((2, 3, 5))
    model = _bnr_model(inputs, node_inputs, node_outputs, attributes)
    feeds = {n: inputs[n] for n in node_inputs if n}
    with pytest.raises(Exception):  # what the bridge does with the node as written
        ort.InferenceSession(model.SerializeToString(), normgrad.session_options("python"),
                             providers=["CPUExecutionProvider"])
    truth = bnr.reference(**feeds, **attributes)._asdict()
    wanted = [n for n in node_outputs if n]
    session = normgrad.inference_session(model, backend="python", providers=["CPUExecutionProvider"])
    for name, value in zip(wanted, session.run(wanted, feeds)):
        np.testing.assert_allclose(value, truth[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # the public helper, for users building their own sessions
    prepared = normgrad.prepare_for_python_kernels(model)
    own = ort.InferenceSession(prepared.SerializeToString(), normgrad.session_options("python"),
                               providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(own.run(wanted, feeds), session.run(wanted, feeds))
    assert [o.name for o in prepared.graph.output] == wanted
    assert model.graph.node[0].output[:] == node_outputs  # the input model is not changed


def test_python_rewrite_reaches_subgraphs():
    """A node inside an If branch is rewritten too."""
    inputs = {"x": np.random.default_rng(1).normal(size=(2, 4, 3)).astype(np.float32)}
    stats = gng.reference  # the truth
    gamma = np.ones((1, 4, 1), np.float32)
    mean, rstd = np.zeros((2, 4), np.float32), np.ones((2, 4), np.float32)
    consts = [helper.make_node("Constant", [], [n], value=onnx.numpy_helper.from_array(v))
              for n, v in (("gamma", gamma), ("mean", mean), ("rstd", rstd))]
    branch = helper.make_graph(
        [helper.make_node(gng.OP_TYPE, ["x", "x", "gamma", "mean", "rstd"], ["dx"], domain=DOMAIN)], "then", [],
        [helper.make_tensor_value_info("dx", onnx.TensorProto.FLOAT, None)],
    )
    cond = helper.make_node("Constant", [], ["cond"], value=onnx.numpy_helper.from_array(np.array(True)))
    if_node = helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)
    graph = helper.make_graph(consts + [cond, if_node], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4, 3])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)],
                              ir_version=normgrad.ops.IR_VERSION)
    session = normgrad.inference_session(model, backend="python", providers=["CPUExecutionProvider"])
    expected = stats(inputs["x"], inputs["x"], gamma, mean, rstd).dx
    np.testing.assert_allclose(session.run(["y"], inputs)[0], expected, rtol=1e-5, atol=1e-6)
