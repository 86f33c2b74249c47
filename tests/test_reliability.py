"""Issue 13: what adversarial use found, each case asserting the behaviour it must have now.

Crash-prone cases (C++ kernels, CLI runs on malformed models) run in subprocesses with a
timeout, so a crash fails the test instead of the test run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

import normgrad
from normgrad.ops import DOMAIN, harness
from normgrad.ops import batch_norm_reduce_backward as bnr
from normgrad.ops import group_normalization_grad as gng

from conftest import batch_norm_inputs, cpp_available

needs_cpp = pytest.mark.skipif(not cpp_available(), reason="C++ library not built")
HERE = os.path.dirname(os.path.abspath(__file__))


def _run_subprocess(code: str, *args: str, env=None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})), cwd=HERE)


# ------------------------------------------------------------- 4. Python kernels take every valid node


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


# ------------------------------------------------------------- 5. invalid attributes


BAD_ATTRIBUTES = [
    ("float", helper.make_attribute("input_g", 0.0), "FLOAT"),
    ("string", helper.make_attribute("input_g", "0"), "STRING"),
    ("ints", helper.make_attribute("input_g", [0]), "INTS"),
]


def _with_attribute(attribute):
    inputs = batch_norm_inputs((2, 3, 4))
    model = harness.node_model(bnr.OP_TYPE, inputs, outputs=["grad_weight"], attributes={"input_g": 0})
    node = model.graph.node[0]
    kept = [a for a in node.attribute if a.name != attribute.name]
    del node.attribute[:]
    node.attribute.extend(kept + [attribute])
    return model, inputs


@pytest.mark.parametrize("case,attribute,type_name", BAD_ATTRIBUTES, ids=[c[0] for c in BAD_ATTRIBUTES])
@pytest.mark.parametrize("backend", ["python", "cpp", "functions"])
def test_wrongly_typed_attribute_is_named(case, attribute, type_name, backend):
    if backend == "cpp" and not cpp_available():
        pytest.skip("C++ library not built")
    model, _ = _with_attribute(attribute)
    with pytest.raises(normgrad.NormgradInputError, match=f"attribute 'input_g' must be of type INT; got {type_name}"):
        normgrad.inference_session(model, backend=backend, providers=["CPUExecutionProvider"])


def test_unknown_attribute_is_named():
    model, _ = _with_attribute(helper.make_attribute("input_gg", 0))
    with pytest.raises(normgrad.NormgradInputError, match="unknown attribute 'input_gg'"):
        normgrad.inference_session(model, backend="cpp", providers=["CPUExecutionProvider"])
    with pytest.raises(normgrad.NormgradInputError, match="unknown attribute 'input_gg'"):
        normgrad.prepare_for_python_kernels(model)


_CPP_ATTRIBUTE_SCRIPT = r"""
import sys
import onnxruntime as ort
import normgrad
import test_reliability as t
for case, attribute, type_name in t.BAD_ATTRIBUTES:
    model, inputs = t._with_attribute(attribute)
    try:
        ort.InferenceSession(model.SerializeToString(), normgrad.session_options("cpp"),
                             providers=["CPUExecutionProvider"])
        print(case, "accepted")
    except Exception as error:
        print(case, "OK" if f"BatchNormReduceBackward: attribute 'input_g' must be of type INT; got {type_name}"
              in str(error) else f"other error: {error}")
"""


@needs_cpp
def test_cpp_kernels_reject_wrongly_typed_attributes():
    """Registered by hand (no Python check in between), the kernel itself names the attribute."""
    process = _run_subprocess(_CPP_ATTRIBUTE_SCRIPT)
    assert process.returncode == 0, process.stderr[-2000:]
    assert process.stdout.split() == [w for c, _, _ in BAD_ATTRIBUTES for w in (c, "OK")], process.stdout


# ------------------------------------------------------------- 6. non-finite inputs on every path


_NON_FINITE_SCRIPT = r"""
import json
import numpy as np
from normgrad.ops import harness, batch_norm_reduce_backward as bnr
results = []
for spatial in (5, 64, 67, 100, 4099):  # per-sample path, vector path with and without a tail
    dy = np.full((2, 2, spatial), 0.5, np.float32)
    inputs = {"grad_out": dy, "input": np.ones_like(dy), "mean": np.array([np.inf, -np.inf], np.float32),
              "invstd": np.ones(2, np.float32)}
    out = harness.run("cpp", bnr.OP_TYPE, inputs)
    truth = bnr.reference(**{k: v.astype(np.float64) for k, v in inputs.items()})
    for name in bnr.OUTPUTS:
        results.append([spatial, name, out[name].tolist(), getattr(truth, name).tolist()])
print(json.dumps(results))
"""


@needs_cpp
@pytest.mark.parametrize("kernels", ["default", "generic"])
def test_non_finite_mean_gives_the_ieee_result(kernels):
    """mean = +-inf, dy > 0: sum_dy_xmu = -+inf on every row length, as the float64 reference."""
    import json

    env = {"NORMGRAD_KERNELS": "generic"} if kernels == "generic" else {}
    process = _run_subprocess(_NON_FINITE_SCRIPT, env=env)
    assert process.returncode == 0, process.stderr[-2000:]
    for spatial, name, got, truth in json.loads(process.stdout):
        assert got == truth, (spatial, name, got, truth)  # json writes inf as Infinity, NaN as NaN
        if name == "sum_dy_xmu":
            assert got == [-np.inf, np.inf]


# ------------------------------------------------------------- 1. control flow with outer-scope captures


def _capturing_model(op_type: str) -> onnx.ModelProto:
    """y = F(x) + b, where F is an If/Loop/Scan whose body reads x from the outer scope only."""
    TP = onnx.TensorProto
    const = lambda name, value: helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(value))
    if op_type == "If":
        then = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["t"])], "then", [],
                                 [helper.make_tensor_value_info("t", TP.FLOAT, [3])])
        other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                                  [helper.make_tensor_value_info("e", TP.FLOAT, [3])])
        nodes = [const("c", np.array(True)),
                 helper.make_node("If", ["c"], ["u"], then_branch=then, else_branch=other, name="branch")]
    elif op_type == "Loop":
        body = helper.make_graph(
            [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["v_in", "x"], ["v_out"])],
            "body",
            [helper.make_tensor_value_info("i", TP.INT64, []), helper.make_tensor_value_info("cond_in", TP.BOOL, []),
             helper.make_tensor_value_info("v_in", TP.FLOAT, [3])],
            [helper.make_tensor_value_info("cond_out", TP.BOOL, []), helper.make_tensor_value_info("v_out", TP.FLOAT, [3])],
        )
        nodes = [const("trips", np.array(2, np.int64)), const("go", np.array(True)), const("v0", np.zeros(3, np.float32)),
                 helper.make_node("Loop", ["trips", "go", "v0"], ["u"], body=body, name="branch")]
    else:
        body = helper.make_graph(
            [helper.make_node("Add", ["s_in", "x"], ["s_out"]), helper.make_node("Identity", ["e_in"], ["e_out"])],
            "body",
            [helper.make_tensor_value_info("s_in", TP.FLOAT, [3]), helper.make_tensor_value_info("e_in", TP.FLOAT, [])],
            [helper.make_tensor_value_info("s_out", TP.FLOAT, [3]), helper.make_tensor_value_info("e_out", TP.FLOAT, [])],
        )
        nodes = [const("s0", np.zeros(3, np.float32)), const("seq", np.arange(2, dtype=np.float32)),
                 helper.make_node("Scan", ["s0", "seq"], ["u", "scanned"], body=body, num_scan_inputs=1, name="branch")]
    nodes.append(helper.make_node("Add", ["u", "b"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [3])],
                              initializer=[onnx.numpy_helper.from_array(np.ones(3, np.float32), "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=normgrad.ops.IR_VERSION)


@pytest.mark.parametrize("op_type", ["If", "Loop", "Scan"])
def test_gradient_through_captures_is_refused(op_type):
    from normgrad.graphs import UnsupportedOperatorError, build_training_graph

    with pytest.raises(UnsupportedOperatorError, match=f"operator {op_type} \\({op_type} node 'branch'\\)"):
        build_training_graph(_capturing_model(op_type))


def test_check_fails_a_graph_that_ignores_captures(monkeypatch):
    """A training graph built as before (captures unseen: x_grad = 0) is called wrong by check."""
    from normgrad.graphs import build_training_graph, builder
    from normgrad.tools import check as check_tool

    monkeypatch.setattr(builder, "subgraph_captures", lambda node: [])
    wrong = build_training_graph(_capturing_model("If"))
    checks = {c.wrt: c for c in check_tool.check_gradients(wrong, directions=2)}
    assert checks["x"].analytic == [0.0, 0.0] and min(abs(n) for n in checks["x"].numeric) > 1e-3
    assert checks["x"].error > 0.5  # FAIL
    assert checks["b"].error < 1e-6


# ------------------------------------------------------------- 8. nothing to differentiate


@pytest.mark.parametrize("op_type", ["ArgMax", "Shape"])
def test_model_without_differentiable_output_is_refused(op_type, tmp_path, capsys):
    from normgrad.graphs import build_training_graph
    from normgrad.tools import cli

    node = helper.make_node(op_type, ["x"], ["y"], **({"axis": 1} if op_type == "ArgMax" else {}))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.INT64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=normgrad.ops.IR_VERSION)
    with pytest.raises(ValueError, match="no output of the model is differentiable.*y \\(int64\\)"):
        build_training_graph(model)
    onnx.save(model, tmp_path / "m.onnx")
    assert cli.main(["export", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "t.onnx")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no output of the model is differentiable" in err
    assert not (tmp_path / "t.onnx").exists()


# ------------------------------------------------------------- 7. one line, never a traceback


def _forward(nodes, inits=()):
    TP = onnx.TensorProto
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [2, 3])], initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=normgrad.ops.IR_VERSION)


def _external(folder, location, keep_file):
    model = _forward([helper.make_node("Mul", ["x", "w"], ["y"])], [onnx.numpy_helper.from_array(np.ones((2, 3), np.float32), "w")])
    onnx.save(model, os.path.join(folder, "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    if not keep_file:
        os.remove(os.path.join(folder, "m.data"))
    if location != "m.data":
        model = onnx.load(os.path.join(folder, "m.onnx"), load_external_data=False)
        for entry in model.graph.initializer[0].external_data:
            if entry.key == "location":
                entry.value = location
        onnx.save(model, os.path.join(folder, "m.onnx"))
    return os.path.join(folder, "m.onnx")


def _training_graph(folder, change):
    """t.onnx and its weights' t.ckpt, as `normgrad export` writes them, after ``change``."""
    import json
    from normgrad import checkpoint
    from normgrad.graphs import build_training_graph
    from normgrad.graphs.examples import resnet_block

    model, weights = build_training_graph(resnet_block(channels=2))
    change(model, json)
    path = os.path.join(folder, "t.onnx")
    onnx.save(model, path)
    checkpoint.save(os.path.join(folder, "t.ckpt"), weights)
    return path


def _set_metadata(key, value):
    def change(model, json):
        for prop in model.metadata_props:
            if prop.key == key:
                prop.value = value(json.loads(prop.value), json)
    return change


def _save(folder, model, name="m.onnx"):
    path = os.path.join(folder, name)
    with open(path, "wb") as handle:
        handle.write(model.SerializeToString())
    return path


# case -> (build(folder) -> argv, expected exit status, words the one line must hold)
CLI_CASES = {
    "cycle": (lambda d: ["export", _save(d, _forward([helper.make_node("Add", ["x", "b"], ["a"]),
                                                       helper.make_node("Add", ["a", "x"], ["b"]),
                                                       helper.make_node("Relu", ["a"], ["y"])]))],
              1, "cycle"),
    "out_of_order": (lambda d: ["export", _save(d, _forward([helper.make_node("Relu", ["a"], ["y"]),
                                                              helper.make_node("Tanh", ["x"], ["a"])]))],
                     1, "topological order"),
    "duplicate_output": (lambda d: ["export", _save(d, _forward([helper.make_node("Tanh", ["x"], ["y"]),
                                                                  helper.make_node("Relu", ["x"], ["y"])]))],
                         1, "'y' is produced twice"),
    "missing_external_data": (lambda d: ["export", _external(d, "m.data", keep_file=False)], 1, "missing"),
    "escaping_external_data": (lambda d: ["export", _external(d, "../../etc/passwd", keep_file=True)], 1,
                               "outside the model's folder"),
    "empty_file_export": (lambda d: ["export", _save(d, onnx.ModelProto())], 1, "is empty: not an ONNX model"),
    "empty_file_check": (lambda d: ["check", _save(d, onnx.ModelProto())], 1, "is empty: not an ONNX model"),
    "gradient_names_missing_output": (
        lambda d: ["check", _training_graph(d, _set_metadata("normgrad.gradients", lambda v, j: j.dumps({**v, "nope_grad": "x"})))],
        1, "'nope_grad', which is not a graph output"),
    "gradient_of_missing_input": (
        lambda d: ["check", _training_graph(d, _set_metadata("normgrad.gradients", lambda v, j: j.dumps({k: "nope" for k in v})))],
        1, "'nope', which is not a graph input"),
    "metadata_not_json": (lambda d: ["check", _training_graph(d, _set_metadata("normgrad.seeds", lambda v, j: "{oops"))],
                          1, "not valid JSON"),
    "directions_0": (lambda d: ["check", "t.onnx", "--directions", "0"], 2, "--directions"),
    "directions_-1": (lambda d: ["check", "t.onnx", "--directions", "-1"], 2, "--directions"),
    "step_0": (lambda d: ["check", "t.onnx", "--step", "0"], 2, "--step"),
    "export_in_place": (lambda d: ["export", _save(d, _forward([helper.make_node("Relu", ["x"], ["y"])])), "-o",
                                   os.path.join(d, "m.onnx")], 2, "is the input model"),
}


_CLI_SCRIPT = r"""
import contextlib, io, json, os, sys, tempfile
import test_reliability as t
from normgrad.tools import cli
for name in sys.argv[1:]:
    build, _, _ = t.CLI_CASES[name]
    folder = tempfile.mkdtemp()
    argv = build(folder)
    argv = argv[:1] + [a if os.path.isabs(a) or a.startswith("-") or not a.endswith(".onnx") else os.path.join(folder, a)
                       for a in argv[1:]]
    before = {f: open(os.path.join(folder, f), "rb").read() for f in os.listdir(folder)}
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = cli.main(argv + (["-o", os.path.join(folder, "out.onnx")] if argv[0] == "export" and "-o" not in argv else []))
    after = {f: open(os.path.join(folder, f), "rb").read() for f in os.listdir(folder)}
    print(json.dumps({"case": name, "status": status, "stderr": err.getvalue(), "unchanged": before == after}), flush=True)
"""


def test_cli_reports_bad_models_and_arguments_in_one_line():
    import json

    process = _run_subprocess(_CLI_SCRIPT, *CLI_CASES, timeout=1800)
    results = {r["case"]: r for r in map(json.loads, process.stdout.splitlines())}
    assert sorted(results) == sorted(CLI_CASES), f"crashed after {sorted(results)}:\n{process.stderr[-3000:]}"
    for name, (_, status, words) in CLI_CASES.items():
        result = results[name]
        stderr = result["stderr"]
        assert result["status"] == status, (name, result)
        assert stderr.count("\n") == 1 and stderr.startswith("normgrad "), (name, stderr)
        assert words in stderr and "Traceback" not in stderr, (name, stderr)
        assert result["unchanged"], (name, "a file was written or changed")


def test_check_attaches_missing_function_bodies(tmp_path, capsys):
    """A training graph stripped of its function bodies still checks (the functions backend attaches them)."""
    from normgrad.tools import cli

    path = _training_graph(str(tmp_path), lambda model, json: model.ClearField("functions"))
    assert cli.main(["check", path, "--directions", "1"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and " gradients within " in out


# ------------------------------------------------------------- 2. corpus writes only into its own folders


def _tiny_corpus(*cases):
    from normgrad.tools import corpus as corpus_tool

    files = {"README.md": b"readme " + ",".join(cases).encode()}
    for case in cases:
        files[f"{case}/model.onnx"] = case.encode()
        files[f"{case}/test_data_set_0/input_0.pb"] = b"input of " + case.encode()
    return corpus_tool.with_written_list(files)


def test_corpus_refuses_a_foreign_folder(tmp_path, capsys):
    from normgrad.tools import cli

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "model.onnx").write_bytes(b"user data")
    (tmp_path / "README.md").write_text("my notes")
    before = sorted((p.relative_to(tmp_path).as_posix(), p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file())
    assert cli.main(["corpus", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not empty" in err and "written-by-normgrad.json" in err
    after = sorted((p.relative_to(tmp_path).as_posix(), p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file())
    assert after == before


def test_corpus_removes_only_what_it_listed(tmp_path):
    from normgrad.tools import corpus as corpus_tool

    corpus_tool.write(tmp_path, _tiny_corpus("old_case", "kept_case"))
    (tmp_path / "old_case" / "user_notes.txt").write_text("mine")
    (tmp_path / "user_case").mkdir()
    (tmp_path / "user_case" / "model.onnx").write_bytes(b"user model")
    new = _tiny_corpus("kept_case")
    corpus_tool.write(tmp_path, new)
    assert not (tmp_path / "old_case" / "model.onnx").exists()
    assert not (tmp_path / "old_case" / "test_data_set_0").exists()  # emptied by the removal
    assert (tmp_path / "old_case" / "user_notes.txt").read_text() == "mine"
    assert (tmp_path / "user_case" / "model.onnx").read_bytes() == b"user model"
    assert not corpus_tool.compare(tmp_path, {**new, "old_case/user_notes.txt": b"mine", "user_case/model.onnx": b"user model"})


def test_corpus_default_folder_is_under_the_current_directory(tmp_path, monkeypatch, capsys):
    from normgrad.tools import cli
    from normgrad.tools import corpus as corpus_tool

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        corpus_tool.main(["--help"])
    assert "./normgrad-corpus in the current directory" in " ".join(capsys.readouterr().out.split())
    assert cli.main(["corpus"]) == 0
    assert (tmp_path / "normgrad-corpus" / corpus_tool.WRITTEN).is_file()
    assert cli.main(["corpus", "--check"]) == 0


# ------------------------------------------------------------- 3. no clobbered files


def _fail_fsync(monkeypatch):
    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)


def test_failed_corpus_write_keeps_the_old_files(tmp_path, monkeypatch, capsys):
    from normgrad.tools import corpus as corpus_tool

    corpus_tool.write(tmp_path, _tiny_corpus("a", "b"))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    _fail_fsync(monkeypatch)
    with pytest.raises(OSError):
        corpus_tool.write(tmp_path, _tiny_corpus("b"))
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("command", ["export", "corpus"])
def test_full_disk_leaves_the_old_output(tmp_path, monkeypatch, capsys, command):
    from normgrad.graphs.examples import mlp
    from normgrad.tools import cli

    onnx.save(mlp(), tmp_path / "net.onnx")
    if command == "export":
        target = tmp_path / "train.onnx"
        target.write_bytes(b"the good old training graph")
        argv = ["export", str(tmp_path / "net.onnx"), "-o", str(target)]
    else:
        target = tmp_path / "corpus" / "README.md"
        from normgrad.tools import corpus as corpus_tool

        corpus_tool.write(tmp_path / "corpus", _tiny_corpus("a"))
        argv = ["corpus", "--out", str(tmp_path / "corpus")]
    old = target.read_bytes()
    _fail_fsync(monkeypatch)
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err
    assert target.read_bytes() == old
    assert not [p for p in target.parent.iterdir() if p.name.endswith(".tmp")]
