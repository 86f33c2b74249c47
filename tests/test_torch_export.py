"""normgrad.torch.export (both exporters): the settings it chooses, the metadata it writes,
its errors; and the torch exports `normgrad export` refuses or warns about, measured on real
exports of torch's own exporters with their default settings."""

from __future__ import annotations

import io
import json
import os
import sys
import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import normgrad.torch  # noqa: E402
from _torch_models import run_training_graph  # noqa: E402
from normgrad.graphs import build_training_graph  # noqa: E402
from normgrad.graphs.torch_exports import (  # noqa: E402
    METADATA_EMBEDDINGS,
    METADATA_TORCH_PARAMETERS,
    MisexportedModelError,
    TorchExportWarning,
)
from normgrad.tools import export as export_tool  # noqa: E402

EXPORTERS = ["torchscript", "dynamo"]


class ConvNet(nn.Module):
    """Conv -> BatchNorm -> ReLU -> GroupNorm (twice, equal weights at init) -> pool ->
    Dropout -> Linear, with a frozen parameter."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.gn1, self.gn2 = nn.GroupNorm(2, 4), nn.GroupNorm(2, 4)
        self.drop = nn.Dropout(0.0)
        self.fc = nn.Linear(4, 3)
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x):
        y = self.gn2(torch.relu(self.gn1(torch.relu(self.bn(self.conv(x))))))
        return self.fc(self.drop(y.mean((2, 3)))) * self.frozen


def _image(batch=2, size=8, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, 3, size, size)).astype(np.float32)


def _torch_gradients(module, x, dy):
    module.zero_grad()
    xt = torch.tensor(x, requires_grad=True)
    module(xt).backward(torch.tensor(dy))
    grads = {name: p.grad.numpy() for name, p in module.named_parameters() if p.grad is not None}
    return dict(grads, x=xt.grad.numpy())


def _assert_matches_torch(module, forward, x, seed=1):
    training = build_training_graph(forward)
    dy = np.random.default_rng(seed).standard_normal((x.shape[0], 3)).astype(np.float32)
    results = run_training_graph(training.model, training.feeds({"x": x, "y_grad": dy}))
    expected = _torch_gradients(module, x, dy)
    assert {n[: -len("_grad")] for n in results if n.endswith("_grad") and n != "y_grad"} == set(expected)
    largest = max(np.abs(g).max() for g in expected.values())
    for name, grad in expected.items():
        assert np.abs(results[f"{name}_grad"] - grad).max() <= 1e-4 * largest, name


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_export_keeps_training_batch_norm_and_every_parameter(exporter, tmp_path):
    torch.manual_seed(0)
    module = ConvNet().train()
    path = tmp_path / "net.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("error", TorchExportWarning)
        forward = normgrad.torch.export(module, (torch.tensor(_image()),), path, exporter=exporter,
                                        input_names=["x"], output_names=["y"])
    assert onnx.load(path) == forward and forward.ir_version == 10
    assert [os.path.basename(p) for p in os.listdir(tmp_path)] == ["net.onnx"]  # no temporary file left
    batch_norms = [n for n in forward.graph.node if n.op_type == "BatchNormalization"]
    assert len(batch_norms) == 1 and onnx.helper.get_attribute_value(
        next(a for a in batch_norms[0].attribute if a.name == "training_mode")) == 1
    recorded = json.loads(next(p.value for p in forward.metadata_props if p.key == METADATA_TORCH_PARAMETERS))
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert recorded == {n: n for n in trainable}  # gn1/gn2 weights equal at init, still two initializers
    assert {"bn.running_mean", "bn.running_var", "frozen"} <= {t.name for t in forward.graph.initializer}
    _assert_matches_torch(module, forward, _image())  # no gradient for buffers or the frozen parameter


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_eval_mode_modules_stay_in_eval_mode_without_merged_initializers(exporter, tmp_path):
    """An eval-mode model: BatchNorm with its running statistics, Dropout the identity, and
    the equal GroupNorm weights still two initializers named as in torch."""
    torch.manual_seed(0)
    module = ConvNet()
    module.drop.p = 0.5
    with torch.no_grad():
        module.bn.running_mean.uniform_(-1, 1)
        module.bn.running_var.uniform_(0.5, 2)
    module.eval()
    forward = normgrad.torch.export(module, (torch.tensor(_image()),), tmp_path / "net.onnx", exporter=exporter,
                                    input_names=["x"], output_names=["y"])
    names = {t.name for t in forward.graph.initializer}
    assert {"gn1.weight", "gn2.weight", "bn.weight"} <= names and not any(n.startswith("wrapped.") for n in names)
    for node in forward.graph.node:
        if node.op_type == "BatchNormalization":
            assert all(a.i == 0 for a in node.attribute if a.name == "training_mode")
    _assert_matches_torch(module, forward, _image())
    assert module.training is False and not any(m.training for m in module.modules())


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_dynamic_batch_serves_every_batch_size(exporter, tmp_path):
    torch.manual_seed(0)
    module = ConvNet().train()
    forward = normgrad.torch.export(module, (torch.tensor(_image()),), tmp_path / "net.onnx", exporter=exporter,
                                    input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "batch"}})
    assert forward.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    for batch in (3, 5):
        _assert_matches_torch(module, forward, _image(batch, seed=batch), seed=batch)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_dynamic_batch_and_image_size_serve_every_size(exporter, tmp_path):
    torch.manual_seed(0)
    module = ConvNet().train()
    forward = normgrad.torch.export(module, (torch.tensor(_image()),), tmp_path / "net.onnx", exporter=exporter,
                                    input_names=["x"], output_names=["y"], dynamic_axes={"x": [0, 2, 3]})
    dims = forward.graph.input[0].type.tensor_type.shape.dim
    assert [bool(d.dim_param) for d in dims] == [True, False, True, True]
    for batch, size in ((3, 8), (2, 11)):
        _assert_matches_torch(module, forward, _image(batch, size, seed=size), seed=size)


@pytest.mark.parametrize("arguments, message", [
    (dict(module="not a module"), r"^module must be a torch.nn.Module; got str$"),
    (dict(exporter="onnx"), r"^exporter must be one of 'torchscript', 'dynamo'; got 'onnx'$"),
    (dict(example_inputs=([1.0],)), r"^example_inputs\[0\] must be a torch.Tensor; got list"),
    (dict(example_inputs=()), r"^example_inputs is empty"),
    (dict(opset=9), r"^opset for the torchscript exporter must be an int in 12..20; got 9$"),
    (dict(opset=17, exporter="dynamo"), r"^opset for the dynamo exporter must be an int in 18..21; got 17$"),
    (dict(input_names=["a", "b"]), r"^input_names has 2 names for 1 example inputs$"),
    (dict(input_names="x"), r"^input_names must be a list of non-empty strings"),
    (dict(dynamic_axes={"z": [0]}), r"^dynamic_axes names 'z', which is none of the input or output names"),
    (dict(dynamic_axes={"x": [4]}), r"^dynamic_axes\['x'\] has axis 4, not an axis of a rank-4 tensor$"),
])
def test_bad_arguments_are_one_clear_error(arguments, message, tmp_path):
    call = dict(module=ConvNet(), example_inputs=(torch.zeros(2, 3, 8, 8),), path=tmp_path / "m.onnx",
                input_names=["x"], output_names=["y"])
    call.update(arguments)
    with pytest.raises(normgrad.torch.TorchExportError, match=message):
        normgrad.torch.export(call.pop("module"), call.pop("example_inputs"), call.pop("path"), **call)
    assert not os.listdir(tmp_path)


def test_a_folder_as_path_is_refused(tmp_path):
    with pytest.raises(normgrad.torch.TorchExportError, match="is a folder"):
        normgrad.torch.export(ConvNet(), torch.zeros(2, 3, 8, 8), tmp_path)


class _Unexportable(nn.Module):
    def forward(self, x):
        return torch.linalg.svd(x)[1]


@pytest.mark.parametrize("exporter, message", [
    ("torchscript", "torch's TorchScript exporter failed: UnsupportedOperatorError: Exporting the operator 'aten::linalg_svd'"),
    ("dynamo", "torch's dynamo exporter failed: ConversionError: .* Caused by DispatchError: No ONNX function found for "
               "<OpOverload\\(op='aten._linalg_svd'"),
])
def test_an_exporter_failure_is_reported_with_its_own_error_and_leaves_the_file(exporter, message, tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(b"previous")
    with pytest.raises(normgrad.torch.TorchExportError, match=message):
        normgrad.torch.export(_Unexportable(), torch.randn(3, 3), path, exporter=exporter)
    assert path.read_bytes() == b"previous"


def test_missing_torch_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match=r"normgrad.torch.export needs torch .*pip install \"normgrad\[torch\]\""):
        normgrad.torch.export(object(), (), tmp_path / "m.onnx")


# What `normgrad export` refuses: torch's own exporters with their defaults -------------------


def _dynamo(module, x, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.onnx.export(module, (x,), dynamo=True, opset_version=18, input_names=["x"], output_names=["y"],
                                 verbose=False, **options).model_proto


def _cli(tmp_path, model, *args):
    source = tmp_path / "in.onnx"
    onnx.save(model, source)
    return export_tool.main([str(source), "-o", str(tmp_path / "out.onnx"), *args])


def test_dynamo_optimizer_folding_batch_norm_is_refused(tmp_path, capsys):
    """optimize=True (the default) folds train-mode BatchNorm into the Conv weights."""
    torch.manual_seed(0)
    forward = _dynamo(ConvNet().train(), torch.tensor(_image()))
    assert "BatchNormalization" not in {n.op_type for n in forward.graph.node}
    with pytest.raises(MisexportedModelError, match=r"optimizer folded BatchNorm into 1 node\(s\) \(first Conv"):
        build_training_graph(forward)
    assert _cli(tmp_path, forward) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Fix: export with normgrad.torch.export(module, inputs, path)" in err
    assert not (tmp_path / "out.onnx").exists()


def test_dynamo_optimizer_merging_and_folding_parameters_is_refused():
    """optimize=True merges the two GroupNorms' equal weights and folds their reshapes: the
    torch parameters gn1.weight, ... no longer have initializers of their own."""
    torch.manual_seed(0)
    module = ConvNet().train()
    module.bn = nn.Identity()
    forward = _dynamo(module, torch.tensor(_image()))
    names = {t.name for t in forward.graph.initializer}
    assert "gn1.weight" not in names and "gn2.weight" not in names
    with pytest.raises(MisexportedModelError, match=r"torch parameter\(s\) \(first p_gn1_weight, read by .*\) are not "
                                                    r"initializers of their own"):
        build_training_graph(forward)


def test_dynamo_inference_mode_batch_norm_is_refused():
    """optimize=False: the dynamo exporter writes torch's training-mode batch_norm with
    training_mode=0."""
    torch.manual_seed(0)
    forward = _dynamo(ConvNet().train(), torch.tensor(_image()), optimize=False)
    with pytest.raises(MisexportedModelError, match=r"1 BatchNormalization node\(s\) .* ran in training mode in torch but "
                                                    r"are written with training_mode=0"):
        build_training_graph(forward)


def test_torchscript_folded_constants_are_trained_with_a_warning(tmp_path, capsys):
    """do_constant_folding=True (torch's default) in training mode folds the GroupNorm
    weights into onnx::Mul_N constants: they train, under those names, with a warning."""
    torch.manual_seed(0)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(ConvNet().train(), (torch.tensor(_image()),), buffer, dynamo=False, opset_version=17,
                          training=torch.onnx.TrainingMode.TRAINING, input_names=["x"], output_names=["y"])
    forward = onnx.load_from_string(buffer.getvalue())
    with pytest.warns(TorchExportWarning, match=r"^4 trainable initializer\(s\) \(onnx::Mul_\d+, onnx::Add_\d+, onnx::Mul_\d+, "
                                                r"\.\.\.\) look like constants torch's TorchScript exporter folded"):
        training = build_training_graph(forward)
    assert any(o.name.startswith("onnx::Mul_") and o.name.endswith("_grad") for o in training.model.graph.output)
    assert _cli(tmp_path, forward) == 0
    err = capsys.readouterr().err
    assert err.startswith("normgrad export: warning: 4 trainable initializer(s)") and err.count("\n") == 1


def test_eval_mode_export_is_named_in_torch_terms(tmp_path, capsys):
    """torch.onnx.export's TorchScript defaults (training=EVAL, do_constant_folding=True) fold
    BatchNorm into the Conv and drop Dropout: the warning says so in those words, and the
    training-mode export of the same module gets no such warning."""
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Dropout(0.2),
                        nn.Linear(8 * 6 * 6, 4)).train()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.tensor(_image()),), buffer, dynamo=False, input_names=["x"], output_names=["y"])
    forward = onnx.load_from_string(buffer.getvalue())
    with pytest.warns(TorchExportWarning, match=r"^the model looks exported in eval mode \(torch.onnx.export's default "
                      r"training=TrainingMode.EVAL\): BatchNorm folded into the layer before it, Dropout removed"):
        build_training_graph(forward, loss="cross_entropy")
    assert _cli(tmp_path, forward, "--loss", "cross_entropy") == 0
    err = capsys.readouterr().err
    assert err.startswith("normgrad export: warning: the model looks exported in eval mode") and err.count("\n") == 1
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.tensor(_image()),), buffer, dynamo=False, input_names=["x"], output_names=["y"],
                          training=torch.onnx.TrainingMode.PRESERVE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TorchExportWarning)
        build_training_graph(onnx.load_from_string(buffer.getvalue()), loss="cross_entropy")


def test_metadata_naming_a_missing_initializer_is_refused(tmp_path, capsys):
    forward = normgrad.torch.export(ConvNet().train(), torch.tensor(_image()), tmp_path / "net.onnx",
                                    input_names=["x"], output_names=["y"])
    onnx.helper.set_model_props(forward, {METADATA_TORCH_PARAMETERS: json.dumps({"conv.weight": "conv.weight", "ghost": "ghost"})})
    with pytest.raises(MisexportedModelError, match=r"metadata normgrad.torch_parameters names ghost, which is not an initializer"):
        build_training_graph(forward)
    assert _cli(tmp_path, forward) == 1


def test_torchscript_merged_initializers_are_trained_with_a_warning():
    """An eval-mode model through the TorchScript exporter: equal initializers (all-ones
    BatchNorm/GroupNorm scales, all-zeros biases) are merged into one, the others written as
    Identity nodes of it; its gradient is then the sum of all of theirs."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(ConvNet().eval(), (torch.tensor(_image()),), buffer, dynamo=False, opset_version=17,
                          do_constant_folding=False, input_names=["x"], output_names=["y"])
    forward = onnx.load_from_string(buffer.getvalue())
    assert "gn1.weight" not in {t.name for t in forward.graph.initializer}
    with pytest.warns(TorchExportWarning, match=r"^2 trainable initializer\(s\) stand for several torch tensors \(bn.bias "
                                                r"also stands for gn2.bias, gn1.bias, bn.running_mean; bn.weight also "
                                                r"stands for gn2.weight, gn1.weight, bn.running_var\)"):
        build_training_graph(forward)


class _TiedHead(nn.Module):
    """An embedding whose weight the output projection shares (tied, as language models do)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_shared_parameter_is_one_trainable_initializer_with_torchs_summed_gradient(exporter, tmp_path):
    torch.manual_seed(0)
    module = _TiedHead().train()
    ids = np.array([[1, 2, 2], [7, 1, 0]], np.int64)
    forward = normgrad.torch.export(module, torch.tensor(ids), tmp_path / "m.onnx", exporter=exporter,
                                    input_names=["ids"], output_names=["y"])
    recorded = json.loads(next(p.value for p in forward.metadata_props if p.key == METADATA_TORCH_PARAMETERS))
    assert list(recorded.values()) == ["embed.weight"]
    dy = np.random.default_rng(0).standard_normal((2, 3, 10)).astype(np.float32)
    training = build_training_graph(forward)
    results = run_training_graph(training.model, training.feeds({"ids": ids, "y_grad": dy}))
    module(torch.tensor(ids)).backward(torch.tensor(dy))
    grad = results[f"{next(iter(recorded))}_grad"]
    np.testing.assert_allclose(grad, module.embed.weight.grad.numpy(), rtol=1e-5, atol=1e-5)


class _PaddedTiedHead(nn.Module):
    """_TiedHead with torch's gradient-only embedding settings: the lookup gives row
    padding_idx no gradient (the tied head's MatMul still does), and with scale_grad_by_freq
    divides each row's lookup gradient by how often the batch reads the row."""

    def __init__(self, rows, padding_idx, scale_grad_by_freq):
        super().__init__()
        self.embed = nn.Embedding(rows, 4, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
        self.head = nn.Linear(4, rows, bias=False)
        self.head.weight = self.embed.weight
        with torch.no_grad():  # nn.Embedding zeroes the padding row: no gradient through the head either
            self.embed.weight.normal_()

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("rows, padding_idx, scale_grad_by_freq", [
    (10, 0, False), (10, -1, True), (100, 3, True), (100, None, True),
])  # 10 rows: the one-hot GEMM gradient; 100: EmbeddingGrad
def test_embedding_padding_idx_and_scale_grad_by_freq_give_torchs_gradient(
        exporter, rows, padding_idx, scale_grad_by_freq, tmp_path):
    torch.manual_seed(0)
    module = _PaddedTiedHead(rows, padding_idx, scale_grad_by_freq).train()
    padding = module.embed.padding_idx  # torch's, counted from the start
    ids = np.array([[1, 2, 2, 0], [7, 1, 3, rows - 1], [3, 3, 3, 7]], np.int64)
    forward = normgrad.torch.export(module, torch.tensor(ids), tmp_path / "m.onnx", exporter=exporter,
                                    input_names=["ids"], output_names=["y"])
    initializer = next(iter(json.loads(next(p.value for p in forward.metadata_props if p.key == METADATA_TORCH_PARAMETERS))))
    assert json.loads(next(p.value for p in forward.metadata_props if p.key == METADATA_EMBEDDINGS)) == {
        initializer: {"padding_idx": padding, "scale_grad_by_freq": scale_grad_by_freq}}
    dy = np.random.default_rng(0).standard_normal((3, 4, rows)).astype(np.float32)
    training = build_training_graph(forward)
    grad = run_training_graph(training.model, training.feeds({"ids": ids, "y_grad": dy}))[f"{initializer}_grad"]
    module(torch.tensor(ids)).backward(torch.tensor(dy))
    expected = module.embed.weight.grad.numpy()
    if padding is not None:  # the head's gradient only: the padding row is still trained
        assert padding in ids and np.abs(expected[padding]).max() > 0.1
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-5)


def test_embeddings_sharing_a_weight_with_different_padding_are_refused(tmp_path):
    module = _TiedHead()
    module.other = nn.Embedding(10, 4, padding_idx=2)
    module.other.weight = module.embed.weight
    module.forward = lambda ids: module.head(module.embed(ids) + module.other(ids))
    with pytest.raises(normgrad.torch.TorchExportError, match=r"^nn.Embedding modules 'embed' \(padding_idx=None, "
                       r"scale_grad_by_freq=False\) and 'other' \(padding_idx=2, scale_grad_by_freq=False\) share one weight"):
        normgrad.torch.export(module, torch.tensor([[1, 2]]), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("value, message", [
    ('{"embed.weight": {"padding_idx": 10, "scale_grad_by_freq": false}}', "gives 'embed.weight' padding_idx 10, not one of its 10 rows"),
    ('{"embed.weight": {"padding_idx": 1}}', "must be a JSON object"),
    ('{"ghost": {"padding_idx": 1, "scale_grad_by_freq": false}}', "names 'ghost', which is no 2-D initializer"),
    ('[1]', "must be a JSON object"),
])
def test_malformed_embedding_metadata_is_refused(value, message, tmp_path, capsys):
    forward = normgrad.torch.export(_TiedHead(), torch.tensor([[1, 2]]), tmp_path / "m.onnx", input_names=["ids"])
    onnx.helper.set_model_props(forward, {**{p.key: p.value for p in forward.metadata_props}, METADATA_EMBEDDINGS: value})
    with pytest.raises(MisexportedModelError, match=f"^metadata normgrad.embeddings .*{message}"):
        build_training_graph(forward)


@pytest.mark.parametrize("own", [None, "eager"])
def test_mixture_of_experts_exported_with_batched_mm_experts(tmp_path, own):
    """A transformers mixture-of-experts model is traced with its experts as batched_mm (the
    implementation both exporters can export) and gets its own implementation back after."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        intermediate_size=8, vocab_size=10, num_local_experts=2, num_experts_per_tok=1)
    mixtral = transformers.MixtralForCausalLM(config)
    if own:
        mixtral.set_experts_implementation(own)
    before = mixtral.get_experts_implementation()
    traced = []

    class Embedding(nn.Module):  # records the experts implementation the export runs with
        def __init__(self):
            super().__init__()
            self.mixtral = mixtral

        def forward(self, ids):
            traced.append(self.mixtral.get_experts_implementation())
            return self.mixtral.model.embed_tokens(ids)

    normgrad.torch.export(Embedding(), (torch.tensor([[1, 2]]),), tmp_path / "m.onnx")
    assert traced and all(seen == {"": "batched_mm"} for seen in traced)
    assert mixtral.get_experts_implementation() == before != {"": "batched_mm"}
