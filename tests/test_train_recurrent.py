"""20 AdamW steps of an nn.LSTM sequence classifier through normgrad.train.Trainer (step graph
from `normgrad export --optimizer adamw`) against torch.optim.AdamW, on the newest and the
oldest supported onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest

from normgrad.train import cosine
from _train_runs import STEPS, _assert_close, _batches, _step_graph, _torch_steps, _train


def _lstm_classifier(torch):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(3, 6, num_layers=2, bidirectional=True, batch_first=True)
            self.fc = torch.nn.Linear(12, 4)

        def forward(self, x):
            return self.fc(self.lstm(x)[0][:, -1])

    torch.manual_seed(0)
    return Net().train()


@pytest.mark.parametrize("runtime", ["current", "old"])
def test_twenty_adamw_steps_match_torch(tmp_path, runtime):
    torch = pytest.importorskip("torch")
    import copy

    source = _lstm_classifier(torch)
    forward_path = tmp_path / "lstm.onnx"
    torch.onnx.export(source, (torch.randn(4, 5, 3),), str(forward_path), dynamo=False, do_constant_folding=False,
                      input_names=["x"], output_names=["y"], opset_version=17)
    step_path, start = _step_graph(tmp_path, forward_path, ["--optimizer", "adamw", "--weight-decay", "0.05"])
    x, labels, lrs = _batches(tmp_path / "batches.npz", (4, 5, 3), 4, lrs=cosine(0.02, STEPS, warmup_steps=3))
    state, losses, _ = _train(runtime, step_path, start, tmp_path / "batches.npz", tmp_path / "out")

    net = copy.deepcopy(source)
    optimizer, torch_losses = _torch_steps(
        torch, net, lambda torch, params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.05), None, x, labels, lrs)
    np.testing.assert_allclose(losses, torch_losses, rtol=1e-4)
    assert int(state.metadata["normgrad.step"]) == STEPS
    for name, p in net.named_parameters():
        _assert_close(state.tensors[name], p.detach().numpy(), name)
        for key, value in optimizer.state[p].items():
            if key != "step":
                _assert_close(state.tensors[f"{name}.{key}"], value.numpy(), f"{name}.{key}")
