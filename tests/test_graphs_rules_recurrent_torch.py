"""nn.LSTM, nn.GRU and nn.RNN through normgrad.torch.export (TorchScript and dynamo) and
build_training_graph: every input and parameter gradient against torch autograd, with 1 and
2 layers, one and two directions, batch_first or not, initial states given or not."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import normgrad.torch  # noqa: E402
from normgrad.graphs import build_training_graph  # noqa: E402

from _graph_models import run_training  # noqa: E402


class Wrapped(torch.nn.Module):
    def __init__(self, kind, layers, bidirectional, batch_first, nonlinearity=None, features=3, hidden=4):
        super().__init__()
        extra = {"nonlinearity": nonlinearity} if nonlinearity else {}
        self.rnn = getattr(torch.nn, kind)(features, hidden, num_layers=layers, bidirectional=bidirectional,
                                           batch_first=batch_first, **extra)
        self.kind = kind

    def forward(self, x, *states):
        if not states:
            return self.rnn(x)[0]
        if self.kind == "LSTM":
            y, (h, c) = self.rnn(x, states)
            return y, h, c
        y, h = self.rnn(x, states[0])
        return y, h


CONFIGS = [  # kind, layers, bidirectional, batch_first, initial states, nonlinearity
    ("LSTM", 1, False, False, True, None),
    ("LSTM", 2, True, True, False, None),
    ("GRU", 2, True, True, True, None),
    ("RNN", 1, True, False, True, "relu"),
]


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("kind, layers, bidirectional, batch_first, initial, nonlinearity", CONFIGS)
def test_matches_torch_autograd(tmp_path, exporter, kind, layers, bidirectional, batch_first, initial, nonlinearity):
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    module = Wrapped(kind, layers, bidirectional, batch_first, nonlinearity).train()
    rng = np.random.default_rng(0)
    batch, steps, directions = 2, 5, 2 if bidirectional else 1
    data = {"x": rng.standard_normal((batch, steps, 3) if batch_first else (steps, batch, 3)).astype(np.float32)}
    if initial:
        data["h0"] = rng.standard_normal((layers * directions, batch, 4)).astype(np.float32)
        if kind == "LSTM":
            data["c0"] = rng.standard_normal((layers * directions, batch, 4)).astype(np.float32)
    with torch.no_grad():
        reference = module(*(torch.tensor(v) for v in data.values()))
    reference = reference if isinstance(reference, tuple) else (reference,)
    outputs = ["y", "h", "c"][: len(reference)]
    forward = normgrad.torch.export(module, tuple(torch.tensor(v) for v in data.values()), tmp_path / "f.onnx",
                                    exporter=exporter, input_names=list(data), output_names=outputs)
    training = build_training_graph(forward)
    seeds = {f"{o}_grad": rng.standard_normal(r.shape).astype(np.float32) for o, r in zip(outputs, reference)}
    results = run_training(training, {**data, **seeds})

    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in data.items()}
    produced = module(*tensors.values())
    produced = produced if isinstance(produced, tuple) else (produced,)
    for name, value in zip(outputs, produced):
        np.testing.assert_allclose(results[name], value.detach().numpy(), atol=1e-5, err_msg=name)
    torch.autograd.backward(list(produced), [torch.tensor(seeds[f"{o}_grad"]) for o in outputs])
    expected = {k: t.grad.numpy() for k, t in tensors.items()}
    expected.update({name: p.grad.numpy() for name, p in module.named_parameters()})
    gradient_of = json.loads(next(p.value for p in training.model.metadata_props if p.key == "normgrad.gradients"))
    trained = {source: grad for grad, source in gradient_of.items()}
    assert set(trained) == set(expected)
    largest = max(float(np.abs(g).max()) for g in expected.values())
    for name, grad in expected.items():
        np.testing.assert_allclose(results[trained[name]], grad, atol=2e-5 * largest, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("kind, hidden", [("LSTM", 128), ("GRU", 192)])
def test_large_weight_gradients_match_torch_autograd(tmp_path, kind, hidden):
    """Sizes where dW and dR are OuterProductSums (at least 2^24 multiply-adds over the
    steps and samples), not Gemms: every gradient against torch autograd."""
    torch.manual_seed(0)
    features, steps, batch = 128, 16, 16
    module = Wrapped(kind, 2, False, False, features=features, hidden=hidden).train()
    x = np.random.default_rng(0).standard_normal((steps, batch, features)).astype(np.float32)
    forward = normgrad.torch.export(module, (torch.tensor(x),), tmp_path / "f.onnx", exporter="torchscript",
                                    input_names=["x"], output_names=["y"])
    training = build_training_graph(forward)
    assert sum(n.op_type == "OuterProductSum" for n in training.model.graph.node) == 4  # dW, dR of both layers
    seed = np.random.default_rng(1).standard_normal((steps, batch, hidden)).astype(np.float32)
    results = run_training(training, {"x": x, "y_grad": seed})
    tensor = torch.tensor(x, requires_grad=True)
    module(tensor).backward(torch.tensor(seed))
    expected = {"x": tensor.grad.numpy(), **{name: p.grad.numpy() for name, p in module.named_parameters()}}
    gradient_of = json.loads(next(p.value for p in training.model.metadata_props if p.key == "normgrad.gradients"))
    trained = {source: grad for grad, source in gradient_of.items()}
    for name, grad in expected.items():
        np.testing.assert_allclose(results[trained[name]], grad, atol=2e-5 * float(np.abs(grad).max()), rtol=1e-4,
                                   err_msg=name)
