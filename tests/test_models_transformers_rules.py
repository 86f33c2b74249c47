"""Whole transformer-family models through torch's exporters: a classifier with nn.Dropout in
training mode and a tiny BERT encoder (transformers), gradients against torch autograd."""

from __future__ import annotations

import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from normgrad.graphs import UnsupportedOperatorError, build_training_graph, supported_op_types

torch = pytest.importorskip("torch")
nn = torch.nn

import _torch_models  # noqa: E402


def _distinct_parameters(module, seed=0):
    """Distinct random values for every parameter, so that no exporter can merge two of them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            offset = 1.0 if name.endswith("LayerNorm.weight") or name.endswith("norm.weight") else 0.0
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3 + offset)


def _export(module, args, exporter, input_names, output_names):
    if exporter == "torchscript":
        buffer = io.BytesIO()
        torch.onnx.export(module, args, buffer, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, input_names=input_names, output_names=output_names, opset_version=17)
        return onnx.load_from_string(buffer.getvalue())
    try:
        program = torch.onnx.export(module, args, dynamo=True, opset_version=18, input_names=input_names,
                                    output_names=output_names, optimize=False, verbose=False)
    except Exception as error:  # the dynamo exporter needs onnxscript
        pytest.skip(f"dynamo exporter unavailable: {type(error).__name__}: {error}")
    return program.model_proto


def _run_training(forward, feeds, seeds, extra_outputs=()):
    """The training graph's outputs by name: forward outputs, gradients and ``extra_outputs``."""
    training = build_training_graph(forward)
    for name in extra_outputs:
        training.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in training.graph.initializer}
    feeds = dict(feeds, **{f"{name}_grad": seed for name, seed in seeds.items()})
    feeds.update({i.name: initializers[i.name] for i in training.graph.input if i.name in initializers})
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(training.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in training.graph.output]
    return dict(zip(names, session.run(None, feeds))), set(initializers)


def _assert_gradients_match(results, initializers, module, extra=None):
    """Every parameter (each an initializer of its own name) and ``extra`` against torch
    autograd, to 1e-4 of the largest gradient."""
    expected = dict(extra or {})
    for name, param in module.named_parameters():
        assert name in initializers, (name, sorted(initializers))
        expected[name] = param.grad.numpy()
    largest = max(np.abs(grad).max() for grad in expected.values())
    for name, grad in expected.items():
        error = np.abs(results[f"{name}_grad"] - grad).max()
        assert error < 1e-4 * largest, (name, error, largest)


class _Classifier(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 16), nn.Dropout(p), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_classifier_with_training_mode_dropout_matches_torch_given_the_mask(exporter, p):
    """The mask is read from the ONNX Dropout's mask output; torch autograd then runs with
    that very mask (nn.Dropout's output replaced by x * mask / (1 - p))."""
    torch.manual_seed(0)
    module = _Classifier(p).train()
    _distinct_parameters(module)
    x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    forward = _export(module, (torch.tensor(x),), exporter, ["x"], ["y"])
    dropouts = [n for n in forward.graph.node if n.op_type == "Dropout"]
    if exporter == "dynamo" and p == 0.0 and not dropouts:
        pass  # the dynamo exporter drops a p = 0 Dropout: the classifier is still compared
    else:
        assert len(dropouts) == 1
    dy = np.random.default_rng(1).standard_normal((16, 3)).astype(np.float32)
    mask_name = []
    if dropouts:
        while len(dropouts[0].output) < 2:
            dropouts[0].output.append("")
        dropouts[0].output[1] = dropouts[0].output[1] or "dropout_mask"
        mask_name = [dropouts[0].output[1]]
    results, initializers = _run_training(forward, {"x": x}, {"y": dy}, mask_name)
    mask = results[mask_name[0]] if mask_name else np.ones((16, 16), bool)
    if p:
        assert 0.1 < 1 - mask.mean() < 0.5
    handle = module.drop.register_forward_hook(lambda m, inputs, out: inputs[0] * torch.tensor(mask) / (1 - p))
    xt = torch.tensor(x, requires_grad=True)
    y = module(xt)
    handle.remove()
    y.backward(torch.tensor(dy))
    np.testing.assert_allclose(results["y"], y.detach().numpy(), rtol=1e-5, atol=1e-5)
    _assert_gradients_match(results, initializers, module, {"x": xt.grad.numpy()})


def _tiny_bert(layer_norm):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    encoder = _torch_models.BertEncoder(layer_norm).train()
    _distinct_parameters(encoder)
    return encoder


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("layer_norm", ["decomposed", "nn"])
def test_tiny_bert_matches_torch(exporter, layer_norm):
    """BertModel (hidden 32, 2 layers, 2 heads, vocab 100, dropout p = 0 in training mode):
    embedding Gathers, attention, GELU (Erf), pooler Tanh. With nn.LayerNorm the export needs
    a LayerNormalization rule: until there is one, the error must name it as the only gap."""
    encoder = _tiny_bert(layer_norm)
    ids = np.random.default_rng(0).integers(0, 100, (2, 8)).astype(np.int64)
    ids[0, :3] = 7  # a repeated token: its embedding row sums three gradients
    forward = _export(encoder, (torch.tensor(ids),), exporter, ["input_ids"], ["hidden", "pooled"])
    if layer_norm == "nn" and "LayerNormalization" not in supported_op_types():
        with pytest.raises(UnsupportedOperatorError, match=r"^no gradient rule for operator LayerNormalization \(5 nodes"):
            build_training_graph(forward)
        pytest.skip("LayerNormalization has no gradient rule on this branch (the LayerNorm helper adds it)")
    rng = np.random.default_rng(1)
    seeds = {"hidden": rng.standard_normal((2, 8, 32)).astype(np.float32), "pooled": rng.standard_normal((2, 32)).astype(np.float32)}
    results, initializers = _run_training(forward, {"input_ids": ids}, seeds)
    hidden, pooled = encoder(torch.tensor(ids))
    torch.autograd.backward([hidden, pooled], [torch.tensor(seeds["hidden"]), torch.tensor(seeds["pooled"])])
    np.testing.assert_allclose(results["hidden"], hidden.detach().numpy(), rtol=1e-4, atol=1e-4)
    _assert_gradients_match(results, initializers, encoder)
