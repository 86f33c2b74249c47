"""The schemas: onnx.checker and strict shape inference accept good nodes and reject bad ones."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import normgrad
from normgrad.ops import batch_norm_reduce_backward as bnr
from normgrad.ops import group_normalization_grad as gng
from normgrad.ops import layer_normalization_grad as lng
from normgrad.ops import rms_normalization_grad as rmsg


def _model(op_type, inputs, outputs, attributes=None):
    """inputs: name -> (elem_type, shape); outputs: names the node writes."""
    node = helper.make_node(op_type, list(inputs), outputs, domain=normgrad.DOMAIN, **(attributes or {}))
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(name, elem, shape) for name, (elem, shape) in inputs.items()],
        [onnx.ValueInfoProto(name=name) for name in outputs if name],
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(normgrad.DOMAIN, 1)],
        ir_version=10,
    )


F, H, B = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16


def _bn_inputs(t=F, u=F, x_shape=("N", 4, 5), c=4):
    return {"grad_out": (t, x_shape), "input": (t, x_shape), "mean": (u, [c]), "invstd": (u, [c]), "weight": (u, [c])}


def _gn_inputs(t=F, u=F, gamma_shape=(1, 2, 3, 1)):
    x = ["N", 2, 3, 7]
    return {"x": (t, x), "dy": (t, x), "gamma": (t, list(gamma_shape)), "mean": (u, ["N", 2]), "rstd": (u, ["N", 2])}


def _ln_inputs(t=F, u=F, scale_shape=(7,), stats_shape=("N", 3, 1)):
    x = ["N", 3, 7]
    stats = {"mean": (u, list(stats_shape)), "inv_std_dev": (u, list(stats_shape))}
    return {"dy": (t, x), "x": (t, x), "scale": (t, list(scale_shape)), **stats}


def _rms_inputs(t=F, u=F, scale_shape=(7,), stats_shape=("N", 3, 1)):
    inputs = _ln_inputs(t, u, scale_shape, stats_shape)
    inputs.pop("mean")
    inputs["inv_rms"] = inputs.pop("inv_std_dev")
    return inputs


def _infer(model):
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, check_type=True)
    onnx.checker.check_model(inferred, full_check=True)
    return {o.name: o.type.tensor_type for o in inferred.graph.output}


@pytest.mark.parametrize("t,u", [(F, F), (H, F), (B, H), (H, H)])
def test_batch_norm_reduce_infers_u_of_length_c(t, u):
    types = _infer(_model(bnr.OP_TYPE, _bn_inputs(t, u), list(bnr.OUTPUTS)))
    for name in bnr.OUTPUTS:
        assert types[name].elem_type == u
        assert [d.dim_value for d in types[name].shape.dim] == [4]


@pytest.mark.parametrize("gamma_shape", [(1, 2, 3, 1), (2, 3, 7), (1,), (5, 2, 3, 7)])
def test_group_norm_grad_infers_shapes(gamma_shape):
    if gamma_shape[0] == 5:
        gamma_shape = ("N", 2, 3, 7)
    types = _infer(_model(gng.OP_TYPE, _gn_inputs(gamma_shape=gamma_shape), list(gng.OUTPUTS)))
    assert [d.dim_param or d.dim_value for d in types["dx"].shape.dim] == ["N", 2, 3, 7]
    assert [d.dim_param or d.dim_value for d in types["dgamma"].shape.dim] == list(gamma_shape)


@pytest.mark.parametrize("t,u", [(F, F), (H, F), (B, F), (B, B)])
@pytest.mark.parametrize("module,make_inputs", [(lng, _ln_inputs), (rmsg, _rms_inputs)], ids=["layer", "rms"])
@pytest.mark.parametrize("axis,scale_shape,stats_shape", [(-1, (7,), ("N", 3, 1)), (1, (3, 7), ("N", 1, 1)), (-2, (1, 7), ("N", 1, 1))])
def test_row_normalization_grads_infer_shapes(module, make_inputs, t, u, axis, scale_shape, stats_shape):
    inputs = make_inputs(t, u, scale_shape, stats_shape)
    types = _infer(_model(module.OP_TYPE, inputs, list(module.OUTPUTS), {"axis": axis}))
    assert types["dx"].elem_type == t
    assert [d.dim_param or d.dim_value for d in types["dx"].shape.dim] == ["N", 3, 7]
    for name in module.OUTPUTS[1:]:
        assert types[name].elem_type == t
        assert [d.dim_value for d in types[name].shape.dim] == list(scale_shape)


def test_omitted_optional_io_is_accepted():
    inputs = _bn_inputs()
    inputs.pop("weight")
    _infer(_model(bnr.OP_TYPE, inputs, ["", "", "grad_weight"], {"input_g": 0, "bias_g": 0}))
    _infer(_model(gng.OP_TYPE, _gn_inputs(), ["dx"]))
    _infer(_model(lng.OP_TYPE, _ln_inputs(), ["dx", "", "dbias"]))
    _infer(_model(rmsg.OP_TYPE, _rms_inputs(), ["dx"]))


REJECTED = [
    ("flag value 2", bnr.OP_TYPE, _bn_inputs(), list(bnr.OUTPUTS), {"input_g": 2}, "input_g"),
    ("output named with flag 0", bnr.OP_TYPE, _bn_inputs(), list(bnr.OUTPUTS), {"bias_g": 0}, "grad_bias"),
    ("mean length", bnr.OP_TYPE, {**_bn_inputs(), "mean": (F, [3])}, ["sum_dy"], None, "mean"),
    ("input rank 1", bnr.OP_TYPE, _bn_inputs(x_shape=[4], c=4), ["sum_dy"], None, "input"),
    ("grad_out shape", bnr.OP_TYPE, {**_bn_inputs(), "grad_out": (F, ["N", 4, 6])}, ["sum_dy"], None, "grad_out"),
    ("gamma not broadcastable", gng.OP_TYPE, _gn_inputs(gamma_shape=(1, 2, 4, 1)), ["dx"], None, "gamma"),
    ("x rank 2", gng.OP_TYPE, {**_gn_inputs(), "x": (F, [2, 3]), "dy": (F, [2, 3])}, ["dx"], None, "x"),
    ("rstd shape", gng.OP_TYPE, {**_gn_inputs(), "rstd": (F, ["N", 3])}, ["dx"], None, "rstd"),
    ("ln axis out of range", lng.OP_TYPE, _ln_inputs(), ["dx"], {"axis": 3}, "axis"),
    ("ln dy shape", lng.OP_TYPE, {**_ln_inputs(), "dy": (F, ["N", 3, 6])}, ["dx"], None, "dy"),
    ("ln scale not broadcastable", lng.OP_TYPE, _ln_inputs(scale_shape=(6,)), ["dx"], None, "scale"),
    ("ln scale varies per row", lng.OP_TYPE, _ln_inputs(scale_shape=(3, 7)), ["dx"], None, "scale"),
    ("ln mean without trailing 1", lng.OP_TYPE, _ln_inputs(stats_shape=("N", 3)), ["dx"], None, "mean"),
    ("rms inv_rms shape", rmsg.OP_TYPE, _rms_inputs(stats_shape=("N", 1, 1)), ["dx"], None, "inv_rms"),
    ("rms x scalar", rmsg.OP_TYPE, {**_rms_inputs(), "x": (F, []), "dy": (F, [])}, ["dx"], None, "x"),
]


@pytest.mark.parametrize("case,op_type,inputs,outputs,attributes,name", REJECTED, ids=[r[0] for r in REJECTED])
def test_shape_inference_rejects(case, op_type, inputs, outputs, attributes, name):
    with pytest.raises(Exception, match=name):
        onnx.shape_inference.infer_shapes(_model(op_type, inputs, outputs, attributes), strict_mode=True)


@pytest.mark.parametrize(
    "op_type,inputs",
    [
        (bnr.OP_TYPE, {**_bn_inputs(), "input": (TensorProto.INT64, ["N", 4, 5])}),
        (bnr.OP_TYPE, _bn_inputs(t=TensorProto.DOUBLE)),
        (gng.OP_TYPE, {**_gn_inputs(), "gamma": (TensorProto.INT32, [1, 2, 3, 1])}),
        (lng.OP_TYPE, _ln_inputs(t=TensorProto.DOUBLE)),
        (rmsg.OP_TYPE, {**_rms_inputs(), "inv_rms": (TensorProto.INT64, ["N", 3, 1])}),
    ],
)
def test_checker_rejects_wrong_types(op_type, inputs):
    model = _model(op_type, inputs, ["sum_dy"] if op_type == bnr.OP_TYPE else ["dx"])
    with pytest.raises(Exception):
        onnx.checker.check_model(onnx.shape_inference.infer_shapes(model), full_check=True)


def test_checker_rejects_unknown_attribute():
    model = _model(bnr.OP_TYPE, _bn_inputs(), ["sum_dy"], {"momentum": 1})
    with pytest.raises(Exception, match="momentum"):
        onnx.checker.check_model(onnx.shape_inference.infer_shapes(model), full_check=True)


@pytest.mark.parametrize(
    "op_type,inputs,attributes",
    [(gng.OP_TYPE, _gn_inputs(), None), (lng.OP_TYPE, _ln_inputs(), {"axis": -1}), (rmsg.OP_TYPE, _rms_inputs(), None)],
    ids=["group", "layer", "rms"],
)
def test_model_with_function_bodies_passes_the_checker(op_type, inputs, attributes):
    outputs = list(normgrad.ops.operator(op_type).OUTPUTS)
    model = normgrad.add_functions(_model(op_type, inputs, outputs, attributes))
    onnx.checker.check_model(onnx.shape_inference.infer_shapes(model, strict_mode=True), full_check=True)
