"""Every command's user mistakes (a bad model, a bad argument) end in one line naming the input and the
rule, never a traceback, and leave every file as it was."""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import helper

import normgrad

from _helpers import run_in_tests_folder


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
import test_cli_errors as t
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

    process = run_in_tests_folder(_CLI_SCRIPT, *CLI_CASES, timeout=1800)
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
