"""LoRA on any ONNX model: adapters added by glob (normgrad.lora.add_adapters, normgrad export
--lora-*) beside MatMul, Gemm and MatMulNBits; their loss and gradients against torch + peft in
float64; the trained adapters out in onnxruntime's adapter format with the deployable model
run by onnxruntime (LoraAdapter + RunOptions.add_active_adapter); every user mistake in one line."""

from __future__ import annotations

import copy
import os
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxruntime as ort

from normgrad import lora
from normgrad.errors import LoraError
from normgrad.graphs import build_step_graph, build_training_graph

RANK, ALPHA = 4, 8.0
WIDTHS = (6, 16, 12, 3)


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _matmul_model(weight_is_input: bool = False, out: int = 16) -> onnx.ModelProto:
    """x [2, 32] @ proj.weight [32, out] -> y, by hand."""
    weight = np.random.default_rng(0).standard_normal((32, out)).astype(np.float32)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 32])]
    if weight_is_input:
        inputs.append(helper.make_tensor_value_info("proj.weight", TensorProto.FLOAT, [32, out]))
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "proj.weight"], ["y"], name="proj")], "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, out])],
                              [] if weight_is_input else [numpy_helper.from_array(weight, "proj.weight")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


# --- user mistakes: one line each, nothing changed ---------------------------------------------

def test_glob_matching_nothing_names_it_and_candidates():
    with pytest.raises(LoraError) as caught:
        lora.add_adapters(_matmul_model(), ["proj*", "*q_proj*"], RANK, ALPHA)
    message = str(caught.value)
    assert message.startswith("LoRA targets ['*q_proj*'] match no MatMul, Gemm or MatMulNBits node or weight name")
    assert "some are: proj.weight)" in message and "\n" not in message


def test_model_without_matmul_is_refused():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(LoraError, match="no MatMul, Gemm or MatMulNBits node"):
        lora.add_adapters(helper.make_model(graph), ["*"], RANK, ALPHA)


@pytest.mark.parametrize("rank", [0, -2, 1.5])
def test_rank_must_be_positive_integer(rank):
    with pytest.raises(LoraError, match="rank must be a positive integer"):
        lora.add_adapters(_matmul_model(), ["*"], rank, ALPHA)


@pytest.mark.parametrize("options, rule", [(dict(alpha=0.0), "alpha must be a positive"),
                                           (dict(alpha=ALPHA, dropout=1.0), r"dropout must be in \[0, 1\)"),
                                           (dict(alpha=ALPHA, dropout=-0.1), r"dropout must be in \[0, 1\)")])
def test_alpha_and_dropout_checked(options, rule):
    with pytest.raises(LoraError, match=rule):
        lora.add_adapters(_matmul_model(), ["*"], RANK, **options)


def test_target_whose_weight_is_no_initializer_is_refused():
    with pytest.raises(LoraError, match=r"LoRA target 'proj' matches only layers whose weight is not an initializer, "
                                        r"e.g. MatMul node 'proj' reading 'proj.weight'"):
        lora.add_adapters(_matmul_model(weight_is_input=True), ["proj"], RANK, ALPHA)


def test_star_adapts_the_layers_with_stored_weights_only():
    """``*`` passes over a MatMul of two activations (attention's scores): only the layer
    with a stored weight gets an adapter, and the model computes what it did (B = 0)."""
    model = _matmul_model()
    scores = helper.make_node("MatMul", ["y", "y_t"], ["scores"], name="scores")
    model.graph.node.extend([helper.make_node("Transpose", ["y"], ["y_t"], name="t"), scores])
    model.graph.output.append(helper.make_tensor_value_info("scores", TensorProto.FLOAT, [2, 2]))
    adapted = lora.add_adapters(model, ["*"], RANK, ALPHA)
    assert sorted(t.name for t in adapted.graph.initializer if ".lora_" in t.name) == ["proj.lora_A.weight",
                                                                                       "proj.lora_B.weight"]
    x = np.random.default_rng(1).standard_normal((2, 32)).astype(np.float32)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})  # noqa: E731
    for before, after in zip(run(model), run(adapted)):
        np.testing.assert_array_equal(before, after)


def test_adapters_twice_are_refused():
    adapted = lora.add_adapters(_matmul_model(), ["*"], RANK, ALPHA)
    with pytest.raises(LoraError, match="already has LoRA adapters"):
        lora.add_adapters(adapted, ["*"], RANK, ALPHA)


# --- the graph surgery on a hand-built model ---------------------------------------------------

def test_initialization_as_peft_seeded_and_b_zero():
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (peft's kaiming_uniform_(a=sqrt(5)), checked against
    torch's own draw's bound when torch is installed), B zeros; the same seed gives the same
    bytes, another seed another A; the model's output unchanged (B = 0)."""
    first = lora.add_adapters(_matmul_model(), ["proj.weight"], RANK, ALPHA, seed=3)
    again = lora.add_adapters(_matmul_model(), ["proj.weight"], RANK, ALPHA, seed=3)
    other = lora.add_adapters(_matmul_model(), ["proj.weight"], RANK, ALPHA, seed=4)
    assert first.SerializeToString() == again.SerializeToString()
    values = {t.name: numpy_helper.to_array(t) for t in first.graph.initializer}
    down, up = values["proj.lora_A.weight"], values["proj.lora_B.weight"]
    assert down.shape == (RANK, 32) and up.shape == (16, RANK) and not up.any()
    bound = 1 / np.sqrt(32)
    assert np.abs(down).max() <= bound and np.abs(down).max() > 0.9 * bound and abs(down.mean()) < 0.2 * bound
    assert not np.array_equal(down, numpy_helper.to_array(
        next(t for t in other.graph.initializer if t.name == "proj.lora_A.weight")))
    torch = pytest.importorskip("torch")
    linear = torch.nn.Linear(32, RANK, bias=False)
    torch.nn.init.kaiming_uniform_(linear.weight, a=np.sqrt(5))  # peft's init of lora_A
    assert float(linear.weight.abs().max()) <= bound * (1 + 1e-6)
    x = np.random.default_rng(1).standard_normal((2, 32)).astype(np.float32)
    np.testing.assert_array_equal(_session(first).run(None, {"x": x})[0], _session(_matmul_model()).run(None, {"x": x})[0])


def _nbits_model() -> onnx.ModelProto:
    """_matmul_model with its weight quantized to 4 bits by onnxruntime's quantizer (MatMulNBits;
    onnxruntime before 1.20 names it MatMul4BitsQuantizer)."""
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as error:
        try:
            from onnxruntime.quantization.matmul_4bits_quantizer import MatMul4BitsQuantizer as MatMulNBitsQuantizer
        except ImportError:  # onnxruntime's quantizer needs onnx_ir (onnxscript's dependency) since 1.20
            pytest.skip(f"onnxruntime's MatMulNBits quantizer does not import here: {error}")

    quantizer = MatMulNBitsQuantizer(_matmul_model(), block_size=16, is_symmetric=True)
    quantizer.process()
    return quantizer.model.model


def test_matmul_nbits_wired_from_its_k_and_n():
    """An adapter beside a MatMulNBits (packed uint8 weight: its shape from K and N) computes
    base + x A^T B^T * alpha/r, against float64 NumPy on the quantized model's output.
    (Structure and forward only: its gradient needs the MatMulNBits rule of another branch.)"""
    quantized = _nbits_model()
    node = next(n for n in quantized.graph.node if n.op_type == "MatMulNBits")
    adapted = lora.add_adapters(quantized, [node.input[1]], RANK, ALPHA)
    (layer,) = lora.lora_layers(adapted)["layers"]
    assert (layer.op_type, layer.in_features, layer.out_features) == ("MatMulNBits", 32, 16)
    assert layer.A == f"{node.input[1]}.lora_A" and layer.weight == node.input[1]
    values = {t.name: numpy_helper.to_array(t) for t in adapted.graph.initializer}
    assert values[layer.A].shape == (RANK, 32) and values[layer.B].shape == (16, RANK)
    up = np.random.default_rng(2).standard_normal((16, RANK)).astype(np.float32)
    for tensor in adapted.graph.initializer:
        if tensor.name == layer.B:
            tensor.CopyFrom(numpy_helper.from_array(up, layer.B))
    x = np.random.default_rng(1).standard_normal((2, 32)).astype(np.float32)
    base = _session(quantized).run(None, {"x": x})[0].astype(np.float64)
    expected = base + x.astype(np.float64) @ values[layer.A].T.astype(np.float64) @ up.T.astype(np.float64) * (ALPHA / RANK)
    np.testing.assert_allclose(_session(adapted).run(None, {"x": x})[0], expected, rtol=1e-5, atol=1e-5)


def test_dropout_in_training_only():
    """--lora-dropout: training-mode Dropout on the adapter's input changes the training loss;
    the inference model computes base + x A^T B^T * alpha/r without it (float64 NumPy)."""
    from normgrad.train import Trainer

    adapted = lora.add_adapters(_matmul_model(), ["*"], RANK, ALPHA, dropout=0.5)
    (layer,) = lora.lora_layers(adapted)["layers"]
    step, initial = build_step_graph(build_training_graph(adapted, loss="mse"), "sgd")
    rng = np.random.default_rng(5)
    initial[layer.B] = rng.standard_normal((16, RANK)).astype(np.float32)
    x, labels = rng.standard_normal((2, 32)).astype(np.float32), np.zeros((2, 16), np.float32)
    weights = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in adapted.graph.initializer}
    expected = x @ weights["proj.weight"] + x @ weights[layer.A].T @ initial[layer.B].T.astype(np.float64) * (ALPHA / RANK)
    trainer = Trainer(step, initial, lr=1e-3)
    inference = trainer.inference_model()
    assert not [n for n in inference.graph.node if n.op_type == "Dropout"]
    np.testing.assert_allclose(_session(inference).run(None, {"x": x})[0], expected, rtol=1e-5, atol=1e-5)
    loss = trainer.step(x=x, labels=labels)
    assert abs(loss - float(np.mean(expected ** 2))) > 1e-3 * float(np.mean(expected ** 2))


def _dequantized(model: onnx.ModelProto, node: onnx.NodeProto) -> np.ndarray:
    """The float weight [K, N] a MatMulNBits node multiplies by: onnxruntime's product of the identity."""
    k = next(a.i for a in node.attribute if a.name == "K")
    n = next(a.i for a in node.attribute if a.name == "N")
    alone = onnx.NodeProto()
    alone.CopyFrom(node)
    alone.input[0] = "eye"
    del alone.output[:]
    alone.output.append("w")
    graph = helper.make_graph([alone], "dequantized", [helper.make_tensor_value_info("eye", TensorProto.FLOAT, [k, k])],
                              [helper.make_tensor_value_info("w", TensorProto.FLOAT, [k, n])],
                              [t for t in model.graph.initializer if t.name in node.input[1:]])
    single = helper.make_model(graph, opset_imports=list(model.opset_import))
    single.ir_version = model.ir_version
    return _session(single).run(None, {"eye": np.eye(k, dtype=np.float32)})[0]


def test_matmul_nbits_adapter_gradients_match_torch():
    """Two MatMulNBits layers with adapters (the first one's gradient passes through the
    second's packed weight): the loss and adapter gradients within 1e-4 of their scale of
    torch float64 on the dequantized weights. Needs the MatMulNBits gradient rule."""
    from normgrad.graphs.rules.registry import supported_op_types

    if "com.microsoft.MatMulNBits" not in supported_op_types():
        pytest.skip("no MatMulNBits gradient rule in this normgrad")
    torch = pytest.importorskip("torch")
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    from _torch_models import run_training_graph

    rng = np.random.default_rng(7)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "l1.weight"], ["h"], name="l1"), helper.make_node("Tanh", ["h"], ["a"]),
         helper.make_node("MatMul", ["a", "l2.weight"], ["y"], name="l2")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])],
        [numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32) / 6, "l1.weight"),
         numpy_helper.from_array(rng.standard_normal((32, 16)).astype(np.float32) / 6, "l2.weight")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    quantizer = MatMulNBitsQuantizer(model, block_size=16, is_symmetric=True)
    quantizer.process()
    quantized = quantizer.model.model
    weights = [_dequantized(quantized, n) for n in quantized.graph.node if n.op_type == "MatMulNBits"]
    training = build_training_graph(lora.add_adapters(quantized, ["*"], RANK, ALPHA), loss="mse")
    adapters = {name: rng.standard_normal(value.shape).astype(np.float32) * 0.3 for name, value in training.weights.items()}
    x, labels = rng.standard_normal((2, 32)).astype(np.float32), rng.standard_normal((2, 16)).astype(np.float32)
    outputs = run_training_graph(training._replace(weights=adapters), {"x": x, "labels": labels})
    layers = lora.lora_layers(training.model)["layers"]
    params = {name: torch.tensor(value, dtype=torch.float64, requires_grad=True) for name, value in adapters.items()}
    value = torch.tensor(x, dtype=torch.float64)
    for i, (layer, weight) in enumerate(zip(layers, weights)):
        value = value @ torch.tensor(weight, dtype=torch.float64) + value @ params[layer.A].T @ params[layer.B].T * (ALPHA / RANK)
        value = torch.tanh(value) if i == 0 else value
    loss = torch.nn.functional.mse_loss(value, torch.tensor(labels, dtype=torch.float64))
    loss.backward()
    np.testing.assert_allclose(outputs["loss"], loss.item(), rtol=1e-5)
    for name, param in params.items():
        expected = param.grad.numpy()
        assert np.abs(outputs[f"{name}_grad"] - expected).max() <= 1e-4 * np.abs(expected).max(), name


def test_float16_layer_gets_a_float32_adapter():
    """A float16 MatMul: the adapter computes in float32 (x cast in, its term cast back), the
    adapters stay float32; the output against float64 NumPy within float16 rounding, and the
    adapter's gradients against float64 within 1e-2 of their scale."""
    pytest.importorskip("torch")  # the helper module that runs a training graph imports it
    from _torch_models import run_training_graph

    model = _matmul_model()
    weight = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float16)
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(weight, "proj.weight"))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.elem_type = TensorProto.FLOAT16
    training = build_training_graph(lora.add_adapters(model, ["*"], RANK, ALPHA), loss="mse")
    (layer,) = lora.lora_layers(training.model)["layers"]
    assert layer.dtype == TensorProto.FLOAT16 and training.weights[layer.A].dtype == np.float32
    rng = np.random.default_rng(3)
    adapters = {layer.A: training.weights[layer.A], layer.B: rng.standard_normal((16, RANK)).astype(np.float32)}
    x, labels = rng.standard_normal((2, 32)).astype(np.float16), np.zeros((2, 16), np.float16)
    outputs = run_training_graph(training._replace(weights=adapters), {"x": x, "labels": labels})
    x64, down, up = x.astype(np.float64), adapters[layer.A].astype(np.float64), adapters[layer.B].astype(np.float64)
    hidden = x64 @ down.T
    y = x64 @ weight.astype(np.float64) + hidden @ up.T * (ALPHA / RANK)
    np.testing.assert_allclose(outputs["y"].astype(np.float64), y, rtol=1e-2, atol=2e-2 * np.abs(y).max())
    dy = 2 * y / y.size  # d mean(y^2) / dy
    grads = {layer.B: (dy.T @ hidden) * (ALPHA / RANK), layer.A: ((dy @ up) * (ALPHA / RANK)).T @ x64}
    for name, expected in grads.items():
        assert outputs[f"{name}_grad"].dtype == np.float32
        assert np.abs(outputs[f"{name}_grad"] - expected).max() <= 1e-2 * np.abs(expected).max(), name


def test_adapter_files_need_onnxruntime_1_20(tmp_path, monkeypatch):
    """An onnxruntime without the adapter format (before 1.20): one line, nothing written."""
    step, initial = build_step_graph(build_training_graph(lora.add_adapters(_matmul_model(), ["*"], RANK, ALPHA),
                                                          loss="mse"), "sgd")
    monkeypatch.delattr(ort, "AdapterFormat", raising=False)  # absent already before onnxruntime 1.20
    with pytest.raises(LoraError, match=r"has no adapter format .*needs? onnxruntime 1.20 or newer"):
        lora.save_onnx_adapter(tmp_path / "a.onnx_adapter", step, initial)
    assert os.listdir(tmp_path) == []


def test_shared_weight_gets_one_adapter_per_node():
    model = _matmul_model()
    model.graph.node.append(helper.make_node("MatMul", ["x", "proj.weight"], ["z"], name="again"))
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 16]))
    layers = lora.lora_layers(lora.add_adapters(model, ["proj.weight"], RANK, ALPHA))["layers"]
    assert [layer.A for layer in layers] == ["proj.lora_A.weight", "again.lora_A.weight"]


# --- against torch + peft, and out to onnxruntime ----------------------------------------------

@pytest.fixture(scope="module", params=[2, 3], ids=["gemm", "matmul"])
def mlp(request, tmp_path_factory):
    """A torch MLP exported by normgrad.torch.export (2-D input: Gemm; 3-D: MatMul of a
    Transpose of the weight), its peft LoRA twin with random A and B, and a batch."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    pytest.importorskip("onnxscript")
    import normgrad.torch

    torch.manual_seed(0)
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        layers += [torch.nn.Linear(fan_in, fan_out)] + ([torch.nn.Tanh()] if i < len(WIDTHS) - 2 else [])
    base = torch.nn.Sequential(*layers)
    shape = (4, WIDTHS[0]) if request.param == 2 else (2, 3, WIDTHS[0])
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=generator)
    labels = torch.randn(shape[:-1] + (WIDTHS[-1],), generator=generator)
    path = tmp_path_factory.mktemp("mlp") / "mlp.onnx"
    forward = normgrad.torch.export(base, (x,), path, exporter="dynamo", input_names=["x"], output_names=["y"])
    twin = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["0", "2", "4"]))
    with torch.no_grad():
        for name, param in twin.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return dict(torch=torch, base=base, twin=twin, forward=forward, path=str(path), x=x, labels=labels)


def _peft_adapters(twin) -> dict:
    """peft's adapters by the names add_adapters gives them ("0.lora_A.weight", ...)."""
    return {name.replace("base_model.model.", "").replace(".default", ""): p.detach().numpy().copy()
            for name, p in twin.named_parameters() if "lora_" in name}


def test_initial_loss_is_the_base_models(mlp):
    """B = 0: the adapted training graph's loss is the base model's and torch's (float64)."""
    torch = mlp["torch"]
    adapted = lora.add_adapters(mlp["forward"], ["?.weight"], RANK, ALPHA)
    feeds = {"x": mlp["x"].numpy(), "labels": mlp["labels"].numpy()}
    from _torch_models import run_training_graph

    training = build_training_graph(adapted, loss="mse")
    assert set(training.weights) == {f"{i}.lora_{p}.weight" for i in (0, 2, 4) for p in "AB"}
    loss = run_training_graph(training, feeds)["loss"]
    base_loss = run_training_graph(build_training_graph(mlp["forward"], loss="mse"), feeds)["loss"]
    truth = torch.nn.functional.mse_loss(copy.deepcopy(mlp["base"]).double()(mlp["x"].double()),
                                         mlp["labels"].double()).item()
    assert loss == base_loss
    np.testing.assert_allclose(loss, truth, rtol=1e-5)


def test_loss_and_lora_gradients_match_torch_and_peft(mlp):
    """peft's A and B copied in: the loss and every adapter's gradient within 1e-4 of its scale
    of torch + peft's in float64; no gradient of a base weight is computed."""
    torch = mlp["torch"]
    from _torch_models import run_training_graph

    training = build_training_graph(lora.add_adapters(mlp["forward"], ["?.weight"], RANK, ALPHA), loss="mse")
    adapters = _peft_adapters(mlp["twin"])
    assert set(adapters) == set(training.weights)
    outputs = run_training_graph(training._replace(weights=adapters),
                                 {"x": mlp["x"].numpy(), "labels": mlp["labels"].numpy()})
    twin = copy.deepcopy(mlp["twin"]).double()
    truth = torch.nn.functional.mse_loss(twin(mlp["x"].double()), mlp["labels"].double())
    truth.backward()
    grads = {name.replace("base_model.model.", "").replace(".default", ""): p.grad.numpy()
             for name, p in twin.named_parameters() if "lora_" in name}
    np.testing.assert_allclose(outputs["loss"], truth.item(), rtol=1e-5)
    for name, expected in grads.items():
        got = outputs[f"{name}_grad"]
        assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max(), name
    assert not [o for o in outputs if o.endswith("_grad") and "lora_" not in o and o != "x_grad"]


def _trained(mlp, steps: int = 3):
    """A step graph (AdamW) of the adapted MLP trained ``steps`` steps from peft's adapters: (step, state)."""
    from normgrad.train import Trainer

    step, initial = build_step_graph(build_training_graph(
        lora.add_adapters(mlp["forward"], ["?.weight"], RANK, ALPHA), loss="mse"), "adamw")
    initial.update(_peft_adapters(mlp["twin"]))
    trainer = Trainer(step, initial, lr=1e-2)
    for _ in range(steps):
        trainer.step(x=mlp["x"].numpy(), labels=mlp["labels"].numpy())
    return step, trainer


def test_adapter_file_and_model_run_in_onnxruntime(mlp, tmp_path):
    """The deployable model keeps the base graph; with the adapter file active it gives the
    trained step model's logits (1e-5), with none the base model's."""
    step, trainer = _trained(mlp)
    path = lora.save_onnx_adapter(tmp_path / "mlp.onnx_adapter", step, trainer.state_dict())
    assert sorted(os.listdir(tmp_path)) == ["mlp.onnx_adapter"]
    deployable = lora.adapter_model(step, mlp["path"])
    base = onnx.load(mlp["path"])
    assert {n.name for n in base.graph.node} <= {n.name for n in deployable.graph.node}
    assert {t.name for t in base.graph.initializer} < {t.name for t in deployable.graph.initializer}
    assert [i.name for i in deployable.graph.input][1:] == sorted(f"{i}.lora_{p}.weight" for i in (0, 2, 4) for p in "AB")
    lora.check_onnx_adapter(path, deployable)
    x = mlp["x"].numpy()
    session = _session(deployable)
    options = ort.RunOptions()
    adapter = ort.LoraAdapter()
    adapter.Load(str(path))
    options.add_active_adapter(adapter)
    trained_logits = _session(trainer.inference_model()).run(None, {"x": x})[0]
    base_logits = _session(base).run(None, {"x": x})[0]
    assert np.abs(trained_logits - base_logits).max() > 1e-2  # the adapters changed the model
    np.testing.assert_allclose(session.run(None, {"x": x}, options)[0], trained_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], base_logits, rtol=1e-6, atol=1e-6)


def test_merged_model_gives_the_adapter_models_outputs(mlp, tmp_path):
    """Trainer.export_merged_model of a float model with adapters: W + (alpha/r) B A folded into
    each base weight in its layout (Gemm transB, Transpose-read), no adapter left, onnxruntime's
    outputs of the deployable model with the adapter file active (1e-5)."""
    step, trainer = _trained(mlp)
    trainer.export_merged_model(tmp_path / "merged.onnx")
    merged = onnx.load(tmp_path / "merged.onnx")
    read = {name for node in merged.graph.node for name in node.input} | {t.name for t in merged.graph.initializer}
    assert not any(".lora_" in name for name in read)
    state, weights = trainer.state_dict(), {t.name: numpy_helper.to_array(t) for t in merged.graph.initializer}
    base = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in onnx.load(mlp["path"]).graph.initializer}
    for layer in lora.lora_layers(step)["layers"]:
        delta = ALPHA / RANK * state[layer.B].astype(np.float64) @ state[layer.A].astype(np.float64)  # [out, in]
        np.testing.assert_allclose(weights[layer.weight], base[layer.weight] + delta, rtol=1e-6, atol=1e-6)
    path = lora.save_onnx_adapter(tmp_path / "mlp.onnx_adapter", step, state)
    options = ort.RunOptions()
    adapter = ort.LoraAdapter()
    adapter.Load(str(path))
    options.add_active_adapter(adapter)
    x = mlp["x"].numpy()
    expected = _session(lora.adapter_model(step, mlp["path"])).run(None, {"x": x}, options)[0]
    np.testing.assert_allclose(_session(merged).run(None, {"x": x})[0], expected, rtol=1e-5, atol=1e-5)


def test_merged_matmul_weight_keeps_its_in_out_layout():
    """A MatMul reading its square weight [in, out] directly: the merged weight is W + s (B A)^T,
    against float64 NumPy."""
    adapted = lora.add_adapters(_matmul_model(out=32), ["proj"], RANK, ALPHA)
    step, state = build_step_graph(build_training_graph(adapted, loss="mse"), "sgd")
    (layer,) = lora.lora_layers(step)["layers"]
    state[layer.B] = np.random.default_rng(3).standard_normal(state[layer.B].shape).astype(np.float32)
    merged = lora.merged_model(step, state)
    x = np.random.default_rng(4).standard_normal((2, 32))
    weight = numpy_helper.to_array(next(t for t in _matmul_model(out=32).graph.initializer)).astype(np.float64)
    delta = (state[layer.B].astype(np.float64) @ state[layer.A].astype(np.float64)).T * (ALPHA / RANK)
    np.testing.assert_allclose(_session(merged).run(None, {"x": x.astype(np.float32)})[0], x @ (weight + delta),
                               rtol=1e-5, atol=1e-5)


def test_merging_into_a_matmul_nbits_base_is_refused(tmp_path):
    """A 4-bit base weight cannot take the adapter: one line naming the node, nothing written."""
    from normgrad.graphs.rules.registry import supported_op_types
    from normgrad.train import Trainer

    if "com.microsoft.MatMulNBits" not in supported_op_types():
        pytest.skip("no MatMulNBits gradient rule in this normgrad")
    step, state = build_step_graph(build_training_graph(lora.add_adapters(_nbits_model(), ["*"], RANK, ALPHA),
                                                        loss="mse"), "sgd")
    with pytest.raises(LoraError, match="cannot merge LoRA adapter .* into MatMulNBits node .*quantized") as error:
        Trainer(step, state, lr=0.1).export_merged_model(tmp_path / "merged.onnx")
    assert "\n" not in str(error.value)
    assert not os.listdir(tmp_path)


def test_adapter_for_another_model_is_refused(mlp, tmp_path):
    """An adapter file for another model, or a step graph made from another model: one line."""
    step, trainer = _trained(mlp, steps=1)
    path = lora.save_onnx_adapter(tmp_path / "a.onnx_adapter", step, trainer.state_dict())
    other = lora.add_adapters(_matmul_model(), ["*"], RANK, ALPHA)
    with pytest.raises(LoraError, match=r"a.onnx_adapter holds adapter '0.lora_A.weight'.*another model$"):
        lora.check_onnx_adapter(path, other)
    onnx.save(_matmul_model(), tmp_path / "other.onnx")
    with pytest.raises(LoraError, match="other.onnx: no weight '0.weight'.*another model$"):
        lora.adapter_model(step, tmp_path / "other.onnx")
    (tmp_path / "garbage.onnx").write_bytes(b"nonsense")
    with pytest.raises(LoraError, match=r"garbage.onnx is not a readable ONNX model \(.*\)$"):
        lora.adapter_model(step, tmp_path / "garbage.onnx")
    broken = onnx.load(mlp["path"])
    broken.graph.node.append(onnx.helper.make_node("Relu", ["nowhere"], ["relu_of_nowhere"]))
    onnx.save(broken, tmp_path / "broken.onnx")
    with pytest.raises(LoraError, match=r"broken.onnx: with the adapters wired in, not a valid ONNX model \(.*nowhere"):
        lora.adapter_model(step, tmp_path / "broken.onnx")
    (tmp_path / "not.onnx_adapter").write_bytes(b"nonsense")
    with pytest.raises(LoraError, match="not an onnxruntime adapter file"):
        lora.check_onnx_adapter(tmp_path / "not.onnx_adapter", other)
    with pytest.raises(LoraError, match="no trained value for adapter"):
        lora.save_onnx_adapter(tmp_path / "b.onnx_adapter", step, {})
    assert not (tmp_path / "b.onnx_adapter").exists()


def test_cli_export_and_train_write_the_adapter(mlp, tmp_path, capsys):
    """normgrad export --lora-*: only the adapters (and their AdamW moments) are state;
    normgrad train writes the adapter file and the deployable model beside its checkpoints,
    which give the trained inference model's logits in onnxruntime."""
    from normgrad.tools import export, train

    step_path = tmp_path / "step.onnx"
    assert export.main([mlp["path"], "-o", str(step_path), "--loss", "mse", "--optimizer", "adamw",
                        "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--lora-targets", "0.weight",
                        "--lora-targets", "node_*"]) == 0
    from normgrad import checkpoint

    state = checkpoint.load(str(tmp_path / "step.ckpt")).tensors
    assert set(state) == {f"{i}.lora_{p}.weight{s}" for i in (0, 2, 4) for p in "AB" for s in ("", ".exp_avg",
                                                                                                ".exp_avg_sq")}
    np.savez(tmp_path / "data.npz", x=mlp["x"].numpy(), labels=mlp["labels"].numpy())
    out = tmp_path / "out"
    assert train.main([str(step_path), "--data", str(tmp_path / "data.npz"), "--epochs", "2", "--batch-size",
                       str(len(mlp["x"])), "--out", str(out), "--no-progress"]) == 0
    folder = out / "checkpoints"
    printed = capsys.readouterr()
    assert f"{folder / 'adapter.onnx_adapter'}" in printed.out
    assert "peft" not in printed.err and not (folder / "peft_adapter").exists()  # peft's files: genai builds only
    deployable = onnx.load(folder / "adapter_model.onnx")
    options = ort.RunOptions()
    adapter = ort.LoraAdapter()
    adapter.Load(str(folder / "adapter.onnx_adapter"))
    options.add_active_adapter(adapter)
    x = mlp["x"].numpy()
    expected = _session(onnx.load(out / "inference.onnx")).run(None, {"x": x})[0]
    np.testing.assert_allclose(_session(deployable).run(None, {"x": x}, options)[0], expected, rtol=1e-5, atol=1e-5)


def test_cli_streams_an_external_data_base_into_the_adapter_models_data(mlp, tmp_path):
    """A base whose weights are in an external data file (as onnxruntime-genai's builds keep
    them): adapter_model.onnx holds none of them inline, they are in one data file beside it
    (a second run's replaces the first's), and onnxruntime runs it from its path as the
    trained inference model; a base whose data file is cut short is refused in one line
    naming the tensor."""
    from normgrad.tools import export, train

    base = tmp_path / "base" / "mlp.onnx"
    base.parent.mkdir()
    onnx.save(onnx.load(mlp["path"]), base, save_as_external_data=True, all_tensors_to_one_file=True,
              location="mlp.onnx.data", size_threshold=0)
    step_path = tmp_path / "base" / "step.onnx"
    assert export.main([str(base), "-o", str(step_path), "--loss", "mse", "--optimizer", "adamw",
                        "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--lora-targets", "*"]) == 0
    np.savez(tmp_path / "data.npz", x=mlp["x"].numpy(), labels=mlp["labels"].numpy())
    out = tmp_path / "out"
    folder = out / "checkpoints"
    x = mlp["x"].numpy()
    for again in ([], ["--resume"]):
        assert train.main([str(step_path), "--data", str(tmp_path / "data.npz"), "--epochs", str(1 + len(again)),
                           "--batch-size", str(len(x)), "--out", str(out), "--no-progress", *again]) == 0
        data_files = [name for name in os.listdir(folder) if name.startswith("adapter_model.onnx.")]
        assert len(data_files) == 1 and data_files[0].endswith(".data")
        stored = onnx.load(folder / "adapter_model.onnx", load_external_data=False)
        base_weights = {t.name for t in onnx.load(base, load_external_data=False).graph.initializer}
        assert base_weights and all(t.data_location == TensorProto.EXTERNAL
                                    for t in stored.graph.initializer if t.name in base_weights)
        options = ort.RunOptions()
        adapter = ort.LoraAdapter()
        adapter.Load(str(folder / "adapter.onnx_adapter"))
        options.add_active_adapter(adapter)
        session = ort.InferenceSession(str(folder / "adapter_model.onnx"), providers=["CPUExecutionProvider"])
        expected = _session(onnx.load(out / "inference.onnx")).run(None, {"x": x})[0]
        np.testing.assert_allclose(session.run(None, {"x": x}, options)[0], expected, rtol=1e-5, atol=1e-5)
    step = onnx.load(step_path, load_external_data=False)
    data = base.parent / "mlp.onnx.data"
    data.write_bytes(data.read_bytes()[:-4])
    with pytest.raises(LoraError, match="cut short") as error:
        lora.save_adapter_model(tmp_path / "again.onnx", step, base)
    assert "\n" not in str(error.value) and not list(tmp_path.glob("again.onnx*"))


def test_cli_train_without_a_usable_base_keeps_its_files_and_says_why(mlp, tmp_path, capsys):
    """A base model onnx refuses once the adapters are wired in (or gone): normgrad train ends
    normally with its checkpoints and adapter file, says in one line why adapter_model.onnx
    is not written, and leaves no earlier run's adapter_model.onnx beside the new adapter."""
    from normgrad.tools import export, train

    base = tmp_path / "mlp.onnx"
    shutil.copyfile(mlp["path"], base)
    step_path = tmp_path / "step.onnx"
    assert export.main([str(base), "-o", str(step_path), "--loss", "mse", "--optimizer", "adamw",
                        "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--lora-targets", "0.weight"]) == 0
    broken = onnx.load(base)
    broken.graph.node.append(onnx.helper.make_node("Relu", ["nowhere"], ["relu_of_nowhere"]))
    onnx.save(broken, base)
    np.savez(tmp_path / "data.npz", x=mlp["x"].numpy(), labels=mlp["labels"].numpy())
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "adapter_model.onnx").write_bytes(b"an earlier run's")
    capsys.readouterr()
    assert train.main([str(step_path), "--data", str(tmp_path / "data.npz"), "--epochs", "1", "--batch-size",
                       str(len(mlp["x"])), "--out", str(out), "--no-progress"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "adapter_model.onnx" in line]
    assert len(warnings) == 1 and "not written" in warnings[0] and "not a valid ONNX model" in warnings[0]
    assert (out / "checkpoints" / "adapter.onnx_adapter").exists()
    assert not (out / "checkpoints" / "adapter_model.onnx").exists()


def test_cli_adapter_files_are_one_set(mlp, tmp_path, monkeypatch):
    """The adapter file and adapter_model.onnx ``normgrad train`` writes are put in place as
    one set: a failure while the set is built leaves the earlier ones as they were (not a new
    adapter file beside an earlier model, which may be another rank's or targets'), and a
    success replaces them."""
    from normgrad.tools import _train_step, export
    from normgrad.train import Trainer

    step_path = tmp_path / "step.onnx"
    assert export.main([mlp["path"], "-o", str(step_path), "--loss", "mse", "--optimizer", "adamw",
                        "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--lora-targets", "0.weight"]) == 0
    trainer = Trainer(str(step_path), str(tmp_path / "step.ckpt"), lr=0.1)
    folder = tmp_path / "checkpoints"
    written = _train_step._export_onnx_adapter(trainer, str(step_path), str(folder))
    assert sorted(os.path.basename(p) for p in written) == ["adapter.onnx_adapter", "adapter_model.onnx"]
    earlier = {name: (folder / name).read_bytes() for name in ("adapter.onnx_adapter", "adapter_model.onnx")}
    trainer.step(mlp["x"].numpy(), mlp["labels"].numpy())  # the adapter changes

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(lora, "adapter_model", no_room)
        with pytest.raises(OSError, match="No space left"):
            _train_step._export_onnx_adapter(trainer, str(step_path), str(folder))
    assert {name: (folder / name).read_bytes() for name in earlier} == earlier
    assert sorted(os.listdir(folder)) == sorted(earlier)  # no temporary left behind
    _train_step._export_onnx_adapter(trainer, str(step_path), str(folder))
    assert (folder / "adapter.onnx_adapter").read_bytes() != earlier["adapter.onnx_adapter"]


@pytest.mark.parametrize("argv, message", [
    (["--lora-rank", "4", "--lora-targets", "nothing*"], "LoRA targets ['nothing*'] match no"),
    (["--lora-rank", "0", "--lora-targets", "*"], "rank must be a positive integer"),
])
def test_cli_mistakes_are_one_line_and_write_nothing(mlp, tmp_path, capsys, argv, message):
    from normgrad.tools import export

    code = export.main([mlp["path"], "-o", str(tmp_path / "step.onnx"), "--loss", "mse", "--optimizer", "adamw", *argv])
    error = capsys.readouterr().err
    assert code == 1 and message in error and error.count("\n") == 1
    assert os.listdir(tmp_path) == []


def test_cli_lora_flags_need_rank_and_targets(mlp, tmp_path, capsys):
    from normgrad.tools import export

    for argv, message in ((["--lora-alpha", "4"], "--lora-alpha needs --lora-rank"),
                          (["--lora-rank", "4"], "--lora-rank needs --lora-targets")):
        with pytest.raises(SystemExit) as caught:
            export.main([mlp["path"], "-o", str(tmp_path / "s.onnx"), "--loss", "mse", *argv])
        assert caught.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_gpt2_lora_gradients_match_torch_and_peft(tmp_path):
    """A tiny GPT-2 exported without adapters, adapters added by glob to its Conv1D layers
    (Gemm over [in, out] weights): with peft's A and B copied in (fan_in_fan_out), the
    causal-LM loss and every adapter's gradient within 1e-4 of its scale of torch + peft in
    float64; with B = 0 the base model's loss."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    from _lora_models import _fresh_base, _peft_model
    from _torch_models import run_training_graph
    import normgrad.torch

    twin, base_state = _peft_model("gpt2")
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in twin.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    input_ids = torch.randint(0, 64, (2, 8), generator=generator)
    base = _fresh_base("gpt2", base_state)
    forward = normgrad.torch.export(normgrad.torch.causal_lm_logits(base), (input_ids,), tmp_path / "gpt2.onnx",
                                    exporter="dynamo", input_names=["input_ids"], output_names=["logits"])
    adapted = lora.add_adapters(forward, ["*c_attn.weight", "*c_proj.weight", "*c_fc.weight"], 4, 8)
    training = build_training_graph(adapted, loss="causal_lm")
    feeds = {"input_ids": input_ids.numpy(), "labels": input_ids.numpy()}
    initial_loss = run_training_graph(training, feeds)["loss"]
    assert initial_loss == run_training_graph(build_training_graph(forward, loss="causal_lm"), feeds)["loss"]
    adapters = {"model." + name.replace("base_model.model.", "").replace(".default", ""): p.detach().numpy().copy()
                for name, p in twin.named_parameters() if "lora_" in name}
    assert set(adapters) == set(training.weights)
    outputs = run_training_graph(training._replace(weights=adapters), feeds)
    twin = copy.deepcopy(twin).double()
    truth = twin(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    truth.backward()
    np.testing.assert_allclose(outputs["loss"], truth.item(), rtol=1e-5)
    for name, param in twin.named_parameters():
        if "lora_" in name:
            expected = param.grad.numpy()
            got = outputs["model." + name.replace("base_model.model.", "").replace(".default", "") + "_grad"]
            assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max(), name
