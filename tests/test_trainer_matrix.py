"""Trainer.step against session.run of the same step graph, at every onnxruntime graph
optimization level, on tiny BERT, GPT-2, ViT and Llama blocks (transformers, random
configs), a ResNet and a UNet (diffusers): every state tensor within 1e-6 of its scale after
two steps. onnxruntime's optimizer rewrites the graph it runs (a Transpose pair around a
weight removed, fusions), which an in-place update must survive. The whole optimizer list
runs on BERT, one optimizer on the other models. Then 20 steps against torch.optim on a
transformer and a CNN."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from normgrad.graphs import build_step_graph, build_training_graph
from normgrad.train import Trainer

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _matrix_models import (BATCH, LEVELS, MODELS, _assert_state_close, _batch, _frozen, _reference_steps, _session_options,  # noqa: E402
                            _forward)


@pytest.fixture(scope="module")
def forward(tmp_path_factory):
    """get(model name) -> _forward's (module, make_input, forward model), exported once."""
    exported = {}

    def get(name):
        if name not in exported:
            exported[name] = _forward(name, tmp_path_factory.mktemp(name))
        return exported[name]

    return get


OPTIMIZERS = {  # name: (kind, options, accumulation)
    "sgd": ("sgd", {}, 1),
    "momentum": ("sgd", {"momentum": 0.9, "weight_decay": 0.01}, 1),
    "adam": ("adam", {"weight_decay": 0.01}, 1),
    "adamw": ("adamw", {"weight_decay": 0.1}, 1),
    "adamw_clip": ("adamw", {"weight_decay": 0.1, "max_grad_norm": 0.5}, 1),
    "amsgrad": ("adam", {"amsgrad": True}, 1),
    "accumulation": ("adamw", {"weight_decay": 0.1}, 2),
}


@pytest.fixture(scope="module")
def step_graphs(forward):
    """get(model, kind, options) -> build_step_graph's (step graph, initial state), built once."""
    built = {}

    def get(model, kind, options):
        key = (model, kind, json.dumps(options, sort_keys=True))
        if key not in built:
            forward_model = forward(model)[2]
            built[key] = build_step_graph(
                build_training_graph(forward_model, loss="mse", frozen=_frozen(forward_model)), kind, **options)
        return built[key]

    return get


CASES = [("bert", optimizer) for optimizer in OPTIMIZERS] + [
    (model, "adamw") for model in MODELS if model != "bert"]


@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("model,optimizer", CASES)
def test_trainer_step_is_the_step_graph_at_every_optimization_level(forward, step_graphs, model, optimizer, level):
    _, make_input, _, output_shape = forward(model)
    kind, options, accumulation = OPTIMIZERS[optimizer]
    step, initial = step_graphs(model, kind, options)
    # with accumulation the step graph on the whole batch is the reference: the mean of the
    # micro-batches' mean gradients is the whole batch's (no BatchNorm in BERT)
    batches = [_batch(make_input, output_shape, seed, BATCH * accumulation) for seed in (1, 2)]
    lr = 0.01
    trainer = Trainer(step, initial, lr=lr, accumulation=accumulation, session_options=_session_options(LEVELS[level]))
    for batch in batches:
        trainer.step(**batch)
    assert trainer.step_count == 2
    expected = _reference_steps(step, initial, batches, lr, LEVELS[level])
    _assert_state_close(trainer.state_dict(), expected, f"{model}/{optimizer}/{level}", 1e-6)


# -- against torch.optim, 20 steps -------------------------------------------------------------

TORCH_STEPS = 20


@pytest.mark.parametrize("model", ["bert", "unet"])
def test_twenty_adamw_steps_match_torch(forward, model):
    """A transformer and a CNN (diffusers' UNet block: convolutions, GroupNorm, attention;
    tests/test_train.py has a BatchNorm CNN against torch)."""
    module, make_input, forward_model, output_shape = forward(model)
    frozen = _frozen(forward_model)
    step, initial = build_step_graph(
        build_training_graph(forward_model, loss="mse", frozen=frozen), "adamw", weight_decay=0.1)
    trainer = Trainer(step, initial, lr=0.01)
    net = copy.deepcopy(module).train()
    torch_names = {onnx_name: torch_name for onnx_name, torch_name in json.loads(
        {e.key: e.value for e in forward_model.metadata_props}["normgrad.torch_parameters"]).items()
        if onnx_name not in frozen}
    parameters = {name: p for name, p in net.named_parameters() if name in torch_names.values()}
    for name, parameter in net.named_parameters():
        parameter.requires_grad_(name in parameters)
    optimizer = torch.optim.AdamW(parameters.values(), lr=0.01, weight_decay=0.1)
    losses, torch_losses = [], []
    for number in range(TORCH_STEPS):
        batch = _batch(make_input, output_shape, 100 + number)
        losses.append(trainer.step(**batch))
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(net(torch.tensor(batch["x"])), torch.tensor(batch["labels"]))
        loss.backward()
        optimizer.step()
        torch_losses.append(loss.item())
    np.testing.assert_allclose(losses, torch_losses, rtol=1e-4)
    state = trainer.state_dict()
    expected = {}
    for onnx_name, torch_name in torch_names.items():
        parameter = parameters[torch_name]
        expected[onnx_name] = parameter.detach().numpy()
        expected[f"{onnx_name}.exp_avg"] = optimizer.state[parameter]["exp_avg"].numpy()
    _assert_state_close(state, expected, f"{model} after {TORCH_STEPS} AdamW steps", 1e-4)
